"""docs/SPEC.md S6-S7 value rules of ScatterPaKvCache: slots in range and distinct, and
the runs of a compressing write (:func:`run_segments`, the S6 geometry the write shares)
within their constraints and apart."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import describe, type_error, value_error
from .basics import ScatterMeta, fmt


def _as_index(arg: str, x: Any, shape: tuple[int, ...]) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        raise type_error(arg, "a NumPy array", describe(x))
    if x.shape != shape:
        raise value_error(arg, f"shape {fmt(shape)}", describe(x))
    return x.astype(np.int64)  # a copy: the caller's array is never touched


def run_segments(
    mode: str, seq_len: int, width: int, offset: int
) -> tuple[list[tuple[int, int, int]], tuple[int, int] | None]:
    """docs/SPEC.md S6 geometry of one (b, h) run: the copies [(first row, first token,
    count)] and the mean row (row, first token of the w averaged ones) or None; rows are
    relative to the run's base slot. ``offset`` is -1 for "alibi" (values ignored)."""
    if mode == "alibi":  # keep the last w tokens
        return [(0, seq_len - width, width)], None
    if offset == -1 or width == 0 or offset == seq_len:  # an uncompressed head
        return [(0, 0, seq_len)], None
    rest = seq_len - offset - width  # tokens after the w compressed ones
    if mode == "rope":  # the w tokens become their mean, in row o
        return [(0, 0, offset), (offset + 1, offset + width, rest)], (offset, offset)
    return [(0, 0, offset), (offset, offset + width, rest)], None  # "omni": dropped


def _refuse(bad: np.ndarray, arg: str, expected: str, got: Callable[[int, int], str]) -> None:
    """ValueError naming ``arg`` and the first (b, h) where ``bad`` [B, H] holds."""
    if bad.any():
        b, h = (int(i) for i in np.argwhere(bad)[0])
        raise value_error(arg, expected, got(b, h))


def _run_rows(
    meta: ScatterMeta,
    base: np.ndarray,
    lens: np.ndarray,
    offsets: np.ndarray | None,
    seq: np.ndarray,
) -> np.ndarray:
    """Rows each (b, h) run writes, [B, H] int64, after checking the S6 constraints."""
    active = base >= 0
    seq_bh = np.broadcast_to(seq[:, None], base.shape)
    heads = meta.num_heads
    _refuse(
        active & ((seq_bh < 0) | (seq_bh > meta.max_seq_len)),
        "seq_lens",
        f"0 <= seq_lens[b] <= Smax={meta.max_seq_len} for every batch b with a non-padding run",
        lambda b, h: f"seq_lens[{b}] = {seq[b]} (run (b, h) = ({b}, {h}))",
    )
    if meta.mode == "alibi":
        _refuse(
            active & ((lens < 0) | (lens > seq_bh)),
            "compress_lens",
            "0 <= w <= seq_lens[b] for compress_mode='alibi'",
            lambda b, h: f"compress_lens[{b}, {h}] = {lens[b, h]} with seq_lens[{b}] = {seq[b]}",
        )
    else:
        assert offsets is not None  # rope and omni: check_scatter_values required them
        uncompressed = (offsets == -1) | (lens == 0) | (offsets == seq_bh)
        comp = active & ~uncompressed
        _refuse(
            comp & ((offsets < 0) | (offsets > seq_bh)),
            "compress_seq_offsets",
            "-1 or 0 <= o <= seq_lens[b]",
            lambda b, h: (
                f"compress_seq_offsets[{b * heads + h}] = {offsets[b, h]} "
                f"(b={b}, h={h}) with seq_lens[{b}] = {seq[b]}"
            ),
        )
        # o is in [0, L] here, so L - o cannot overflow.
        _refuse(
            comp & ((lens < 0) | (lens > seq_bh - offsets)),
            "compress_lens",
            "0 <= w and o + w <= seq_lens[b] for a compressed head",
            lambda b, h: (
                f"compress_lens[{b}, {h}] = {lens[b, h]} with compress_seq_offsets"
                f"[{b * heads + h}] = {offsets[b, h]}, seq_lens[{b}] = {seq[b]}"
            ),
        )
    rows = np.zeros(base.shape, np.int64)
    for b, h in np.argwhere(active):
        offset = -1 if offsets is None else int(offsets[b, h])
        copies, mean = run_segments(str(meta.mode), int(seq[b]), int(lens[b, h]), offset)
        rows[b, h] = sum(count for _, _, count in copies) + (mean is not None)
    return rows


def check_scatter_values(
    meta: ScatterMeta,
    slot_mapping: np.ndarray,
    compress_lens: np.ndarray | None = None,
    compress_seq_offsets: np.ndarray | None = None,
    seq_lens: np.ndarray | None = None,
) -> None:
    """Validate the index values of one call (docs/SPEC.md S6 constraints and S7).

    Parameters
    ----------
    meta : ScatterMeta
        What :func:`check_scatter` returned for the same call.
    slot_mapping : numpy.ndarray, [T] or [B, H]
        Negative = padding (skipped).
    compress_lens, compress_seq_offsets, seq_lens : numpy.ndarray or None
        [B, H], [B*H], [B] for a 4-D key, as check_scatter accepted them.

    Raises
    ------
    ValueError
        A slot (or a row of an S6 run) >= NB*BS, a duplicate non-negative slot,
        overlapping runs, or a broken S6 constraint; the message names the token (or
        (b, h)) and the value.

    Examples
    --------
    >>> import numpy as np
    >>> from pytrt_kv.contract.scatter import check_scatter, check_scatter_values
    >>> key = np.zeros((2, 1, 4), np.float32)
    >>> cache = np.zeros((2, 3, 1, 4), np.float32)     # 6 slots, nd
    >>> slots = np.array([5, 6], np.int32)
    >>> meta = check_scatter(key, None, cache, None, slots)
    >>> check_scatter_values(meta, slots)
    Traceback (most recent call last):
    ...
    ValueError: slot_mapping: expected every non-negative slot < NB*BS = 6, got slot 6 for token 1
    """
    if not meta.compress:
        _check_token_slots(meta, slot_mapping)
        return
    _check_runs(meta, slot_mapping, compress_lens, compress_seq_offsets, seq_lens)


def _check_token_slots(meta: ScatterMeta, slot_mapping: np.ndarray) -> None:
    """docs/SPEC.md S7 for a 3-D key: every non-negative slot < NB*BS, and distinct."""
    n_slots = meta.num_slots
    slots = _as_index("slot_mapping", slot_mapping, (meta.num_tokens,))
    over = np.flatnonzero(slots >= n_slots)
    if over.size:
        t = int(over[0])
        raise value_error(
            "slot_mapping",
            f"every non-negative slot < NB*BS = {n_slots}",
            f"slot {slots[t]} for token {t}",
        )
    used = slots[slots >= 0]
    values, counts = np.unique(used, return_counts=True)
    if (counts > 1).any():
        s = values[np.argmax(counts > 1)]
        t0, t1 = np.flatnonzero(slots == s)[:2]
        raise value_error(
            "slot_mapping", "distinct non-negative slots", f"slot {s} for tokens {t0} and {t1}"
        )


def _check_runs(
    meta: ScatterMeta,
    slot_mapping: np.ndarray,
    compress_lens: np.ndarray | None,
    compress_seq_offsets: np.ndarray | None,
    seq_lens: np.ndarray | None,
) -> None:
    """docs/SPEC.md S6-S7 for a 4-D key: the runs within their constraints, every row of
    a live run < NB*BS, and runs of different (b, h) apart."""
    n_slots = meta.num_slots
    shape_bh = (meta.batch, meta.num_heads)
    base = _as_index("slot_mapping", slot_mapping, shape_bh)
    for arg, x in (("compress_lens", compress_lens), ("seq_lens", seq_lens)):
        if x is None:
            raise value_error(arg, "a tensor for a 4-D key", "None")
    lens = _as_index("compress_lens", compress_lens, shape_bh)
    seq = _as_index("seq_lens", seq_lens, (meta.batch,))
    offsets = None
    if meta.mode != "alibi":
        if compress_seq_offsets is None:
            raise value_error(
                "compress_seq_offsets", f"a tensor for compress_mode={meta.mode!r}", "None"
            )
        offsets = _as_index(
            "compress_seq_offsets", compress_seq_offsets, (meta.batch * meta.num_heads,)
        ).reshape(shape_bh)

    rows = _run_rows(meta, base, lens, offsets, seq)
    # docs/SPEC.md S7: a run of zero rows (omni with L - w == 0, alibi with w == 0,
    # L == 0) writes nothing, so its base slot is not checked.
    _refuse(
        (rows > 0) & (base >= n_slots),
        "slot_mapping",
        f"every row of a run < NB*BS = {n_slots}",
        lambda b, h: f"slot_mapping[{b}, {h}] = {base[b, h]} for (b, h) = ({b}, {h})",
    )
    # Live runs have base < NB*BS and rows <= Smax + 1: no overflow; empty runs end at 0.
    end = np.where(rows > 0, np.minimum(base, n_slots) + rows, 0)
    _refuse(
        (rows > 0) & (end > n_slots),
        "slot_mapping",
        f"every row of a run < NB*BS = {n_slots}",
        lambda b, h: (
            f"(b, h) = ({b}, {h}) writing rows [{base[b, h]}, {end[b, h]}) from slot {base[b, h]}"
        ),
    )
    live = np.argwhere(rows > 0)
    if len(live) > 1:
        starts = base[live[:, 0], live[:, 1]]
        order = np.argsort(starts, kind="stable")
        live, starts = live[order], starts[order]
        ends = end[live[:, 0], live[:, 1]]
        clash = np.flatnonzero(starts[1:] < ends[:-1])
        if clash.size:
            i = int(clash[0])
            (b0, h0), (b1, h1) = live[i], live[i + 1]
            raise value_error(
                "slot_mapping",
                "runs of different (b, h) that do not overlap",
                f"(b, h) = ({b0}, {h0}) writing rows [{starts[i]}, {ends[i]}) "
                f"and (b, h) = ({b1}, {h1}) writing rows [{starts[i + 1]}, "
                f"{ends[i + 1]})",
            )
