"""NumPy reference of both operators: obviously correct data movement (docs/SPEC.md S, G).

Each op reads top to bottom: validate (``validate_scatter`` / ``validate_gather`` of
:mod:`pytrt_kv.contract`), the placement rules, the write. A broken rule raises
ValueError (TypeError for a wrong type) naming the argument, what was expected and what
came, and leaves every argument untouched (an argument sharing memory with one the op
writes is refused the same way, naming both).

Data movement works on unsigned-integer views of the arrays: every layout is a pure byte
copy, so NaN payloads, float8 and integer types all move bit-exactly through one code path.

Thread safety: the functions take no lock; calls that update the same caches must be
serialized by the caller.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .contract import specs
from .contract.args import op_args, op_tensors
from .contract.dtypes import name_of, numpy_dtype
from .contract.gather import GatherMeta, check_row, validate_gather
from .contract.layouts import LAYOUTS
from .contract.quant import QUANT
from .contract.scatter import ScatterMeta, run_segments, validate_scatter

__all__ = [
    "scatter_pa_kv_cache",
    "gather_selection_kv_cache",
    "quantise",
    "plan_row",
    "RowPlan",
    "id_size",
]

#: Unsigned type of each element size: the byte-moving view of any data dtype.
_BITS = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32)}


# --- ScatterPaKvCache (docs/SPEC.md S) ----------------------------------------------------------


def _bits(x: np.ndarray) -> np.ndarray:
    """Same memory viewed as unsigned integers of the element size (any strides)."""
    return x.view(_BITS[x.dtype.itemsize])  # type: ignore[call-overload]  # numpy stubs: dtype


def _write_tokens(meta: ScatterMeta, src: np.ndarray, cache: np.ndarray, slots: np.ndarray) -> None:
    """docs/SPEC.md S3-S5 for one (tensor, cache) pair; negative slots skipped. Every
    layout is the cache seen as [NB, nseg, BS, seg] (contract/layouts.py)."""
    valid = slots >= 0
    s = slots[valid]
    rows = _bits(src)[valid]  # [n, H, D]
    n, heads, size = rows.shape
    out = LAYOUTS[str(meta.layout)].segments(_bits(cache), heads, size)
    bs = meta.block_size
    out[s // bs, :, s % bs, :] = rows.reshape(n, out.shape[1], out.shape[3])  # [n, nseg, seg]


def quantise(src: np.ndarray, scale: np.ndarray, cache_dtype: str) -> np.ndarray:
    """docs/SPEC.md S9: ``convert(clamp(float32(x) / float32(scale[h]), -M, M))`` for
    ``src [T, H, D]`` and a scale ``[]`` or ``[H]``; round to nearest even; a NaN is
    ``0x7F`` in float8_e4m3fn whatever its sign (the GPU's canonical NaN; int8 sources
    must hold no NaN: the caller checks)."""
    s = np.asarray(scale, np.float32).reshape(-1)
    per = s[None, :, None] if s.size > 1 else s[0]
    m = np.float32(QUANT[cache_dtype].max)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        v = np.clip(src.astype(np.float32) / per, -m, m)  # NaN stays NaN
        if cache_dtype == specs.INT8:
            return np.rint(v).astype(np.int8)
        out = v.astype(numpy_dtype(cache_dtype))
    # GPU float arithmetic drops a NaN's sign (and payload): -NaN is 0x7F, not 0xFF.
    out.view(np.uint8)[np.isnan(v)] = QUANT[cache_dtype].nan_bits
    return out


def _mean_row(tokens: np.ndarray) -> np.ndarray:
    """float32 sum in token order, / float32(w), rounded to nearest-even to the dtype."""
    # NaN, inf and overflow are valid data (S6: a NaN mean is any NaN): no warnings.
    with np.errstate(invalid="ignore", over="ignore"):
        acc = np.add.accumulate(tokens.astype(np.float32), axis=0, dtype=np.float32)[-1]
        return (acc / np.float32(len(tokens))).astype(tokens.dtype)


def _write_runs(
    meta: ScatterMeta,
    src: np.ndarray,
    cache: np.ndarray,
    base: np.ndarray,
    lens: np.ndarray,
    offsets: np.ndarray | None,
    seq: np.ndarray,
) -> None:
    """docs/SPEC.md S6 for one (tensor, cache) pair: row q is cache[q // BS, q % BS, 0, :]."""
    rows = _bits(cache).reshape(meta.num_slots, cache.shape[3])
    bits = _bits(src)
    for b, h in np.argwhere(base >= 0):
        start = int(base[b, h])
        offset = -1 if offsets is None else int(offsets[b, h])
        # The S6 geometry: one copy, in the contract, which checks the rows it writes.
        copies, mean = run_segments(str(meta.mode), int(seq[b]), int(lens[b, h]), offset)
        for row, token, count in copies:
            rows[start + row : start + row + count] = bits[b, token : token + count, h]
        if mean is not None:
            row, token = mean
            rows[start + row] = _bits(_mean_row(src[b, token : token + lens[b, h], h]))


def scatter_pa_kv_cache(
    key: np.ndarray,
    value: np.ndarray | None,
    key_cache: np.ndarray,
    value_cache: np.ndarray | None,
    slot_mapping: np.ndarray,
    *,
    compress_lens: np.ndarray | None = None,
    compress_seq_offsets: np.ndarray | None = None,
    seq_lens: np.ndarray | None = None,
    cache_layout: str | None = None,
    compress_mode: str | None = None,
    k_scale: np.ndarray | None = None,
    v_scale: np.ndarray | None = None,
) -> None:
    """Write new key/value tokens into a paged KV cache, in place (docs/SPEC.md S).

    Same arguments, order and names as ``torch_npu.npu_scatter_pa_kv_cache``.
    Everything is validated before the first write: a refused call raises and leaves every
    argument untouched.

    Parameters
    ----------
    key : numpy.ndarray
        ``[T, H, Dk]`` (token write) or ``[B, Smax, H, Dk]`` (compressing write, S6).
    value : numpy.ndarray or None
        ``[T, H, Dv]`` or ``[B, Smax, H, Dv]``; None for a key-only write.
    key_cache : numpy.ndarray, writeable, C-contiguous
        Updated in place. 3-D key: "nd" ``[NB, BS, H, Dk]``, "nz"
        ``[NB, H*Dk/L, BS, L]`` (``L = 32 // itemsize``) or "hnd" ``[NB, H, BS, Dk]``;
        4-D key: ``[NB, BS, 1, Dk]``.
    value_cache : numpy.ndarray or None
        As key_cache with Dv (same layout, NB and BS); None exactly when value is None.
    slot_mapping : numpy.ndarray, int32 or int64
        ``[T]``: slot of each token; ``[B, H]``: first row of each (b, h) run.
        Negative = padding, skipped.
    compress_lens : numpy.ndarray, [B, H], optional
        4-D key only (required there): w of each (b, h).
    compress_seq_offsets : numpy.ndarray, [B*H], optional
        4-D key only: o of (b, h) at index ``b*H + h``; required by "rope" and "omni",
        values ignored by "alibi".
    seq_lens : numpy.ndarray, [B], optional
        4-D key only (required there): valid tokens L of each batch.
    cache_layout : {"nd", "nz", "hnd"}, optional
        3-D key only; detected from the shapes when None (an error if ambiguous).
    compress_mode : {"rope", "omni", "alibi"}, optional
        4-D key only; default "rope" when compress_seq_offsets is given, else "alibi".
    k_scale, v_scale : numpy.ndarray, float32 ``[]`` or ``[H]``, optional
        3-D key only: quantise key (value) on write into a float8_e4m3fn or int8 cache
        (docs/SPEC.md S9); finite and > 0.

    Raises
    ------
    TypeError
        An argument is not a NumPy array or has an unsupported dtype.
    ValueError
        Any other rule of docs/SPEC.md S (shapes, slots out of range or duplicated, S6
        constraints, overlapping runs, caches not writeable or not C-contiguous), or an
        argument sharing memory with a cache (e.g. a ``value`` that views
        ``value_cache``, or the two caches overlapping); the message names both.

    Notes
    -----
    Not synchronized: calls that update the same caches (from several threads, or
    interleaved with a GPU op on the same memory) must be serialized by the caller.

    Examples
    --------
    >>> import numpy as np
    >>> from pytrt_kv.reference import scatter_pa_kv_cache
    >>> key = np.arange(2 * 1 * 4, dtype=np.float32).reshape(2, 1, 4)   # [T=2, H=1, Dk=4]
    >>> key_cache = np.full((2, 3, 1, 4), -1, np.float32)               # nd, NB=2, BS=3
    >>> scatter_pa_kv_cache(key, None, key_cache, None, np.array([4, -1], np.int32))
    >>> key_cache[1, 1, 0]
    array([0., 1., 2., 3.], dtype=float32)
    >>> int((key_cache == -1).sum())          # everything else untouched
    20
    """
    meta = validate_scatter(**op_args(specs.SCATTER_PA_KV_CACHE, locals()))
    pairs = [(key, key_cache)]
    if value is not None and value_cache is not None:  # validate_scatter: both or neither
        pairs.append((value, value_cache))
    if not meta.compress:
        slots = slot_mapping.astype(np.int64)
        for (src, cache), scale in zip(pairs, (k_scale, v_scale)):
            if scale is not None:  # S9: validate_scatter required a quantised cache dtype
                src = quantise(src, scale, str(name_of(cache.dtype)))
            _write_tokens(meta, src, cache, slots)
        return
    _write_compressed(meta, pairs, slot_mapping, compress_lens, compress_seq_offsets, seq_lens)


def _write_compressed(
    meta: ScatterMeta,
    pairs: list[tuple[np.ndarray, np.ndarray]],
    slot_mapping: np.ndarray,
    compress_lens: np.ndarray | None,
    compress_seq_offsets: np.ndarray | None,
    seq_lens: np.ndarray | None,
) -> None:
    """docs/SPEC.md S6 for every (tensor, cache) pair of a validated 4-D key call."""
    # validate_scatter required these two for a 4-D key (and offsets for rope / omni).
    assert compress_lens is not None and seq_lens is not None
    shape_bh = (meta.batch, meta.num_heads)
    base = slot_mapping.astype(np.int64)
    lens = compress_lens.astype(np.int64)
    seq = seq_lens.astype(np.int64)
    offsets = (
        None
        if meta.mode == "alibi" or compress_seq_offsets is None
        else compress_seq_offsets.astype(np.int64).reshape(shape_bh)
    )
    for src, cache in pairs:
        _write_runs(meta, src, cache, base, lens, offsets, seq)


# --- GatherSelectionKvCache (docs/SPEC.md G) -----------------------------------------------


@dataclass(frozen=True, eq=False)
class RowPlan:
    """G5 placement of one row (:func:`plan_row`): ``status`` int32 ``[K+1]`` (the new status
    row; a skipped row's old one), ``actual_seq`` (0 when skipped), ``copy`` bool ``[K]``
    (slot j receives ``size(status[j])`` tokens from the full cache) and ``skipped`` (G3:
    nothing of the row is read or written)."""

    status: np.ndarray
    actual_seq: int
    copy: np.ndarray
    skipped: bool


def id_size(v: int, eff: int, tbs: int) -> int:
    """G4 ``size(v)``: tokens of id v visible to a query that sees ``eff`` tokens."""
    max_id = -(-eff // tbs) - 1
    return eff - max_id * tbs if v == max_id else tbs


def plan_row(
    old_status: Sequence[int], topk_row: Sequence[int], kv_len: int, S: int, s: int, tbs: int
) -> RowPlan:
    """docs/SPEC.md G3-G5: which id goes to which slot of one row, and which slots are copied.

    ``old_status`` ``[K+1]`` and ``topk_row`` ``[K]`` are the row's; ``kv_len`` is
    ``full_kv_actual_seq[b]``; ``s < S`` the row's query token. The row's value rules
    (:func:`pytrt_kv.contract.gather.check_row`) raise ValueError first. This is the meaning
    the CUDA planner is tested against (tests/test_gather_plan_host.py).

    >>> p = plan_row([0, 1, 2, 10], [2, 0, -1], kv_len=11, S=1, s=0, tbs=4)  # G6, TBS = 4
    >>> p.status.tolist(), p.actual_seq, p.copy.tolist()
    ([0, 2, -1, 7], 7, [False, True, False])
    """
    old = [int(x) for x in np.asarray(old_status).reshape(-1)]
    topk = [int(x) for x in np.asarray(topk_row).reshape(-1)]
    K = len(topk)
    check_row(old, topk, kv_len, S, s, tbs)

    # G3: the query token s sees eff tokens; a row with nothing visible is skipped.
    eff = kv_len - (S - 1 - s)
    if kv_len <= 0 or eff <= 0:
        return RowPlan(np.array(old, np.int32), 0, np.zeros(K, bool), skipped=True)

    # G4: the valid ids in top-k order (negatives are padding, ids past max_id dropped).
    max_id = -(-eff // tbs) - 1
    valid = [v for v in topk if 0 <= v <= max_id]
    n = len(valid)

    # G5.1: the old ids fill slots 0..old_n-1; with TBS > 1 and an old actual_seq that is
    # not a multiple of TBS, slot old_n-1 holds a partial tail.
    old_ids = [v for v in old[:K] if v >= 0]
    old_slot = {v: j for j, v in enumerate(old_ids)}
    old_tail = len(old_ids) - 1 if tbs > 1 and old[K] % tbs != 0 else None

    # G5.3: with TBS > 1, slot n-1 is reserved for max_id when it is selected, so that the
    # valid tokens form the dense range [0, actual_seq).
    reserve = tbs > 1 and max_id in valid

    # G5.2: an id stays in place when its old slot survives, is complete, and none of its
    # tokens is among this step's newest S positions.
    slot_id: list[int | None] = [None] * n
    for v in valid:
        j = old_slot.get(v)
        if j is None or j >= n or j == old_tail or (v + 1) * tbs > kv_len - S:
            continue
        if reserve and (j == n - 1 or v == max_id):
            continue
        slot_id[j] = v
    kept = {v for v in slot_id if v is not None}
    if reserve:
        slot_id[n - 1] = max_id

    # G5.4: every other valid id, in top-k order, takes the next free slot.
    free = [j for j in range(n) if slot_id[j] is None]
    movers = [v for v in valid if v not in kept and not (reserve and v == max_id)]
    for j, v in zip(free, movers):  # equally many by construction
        slot_id[j] = v

    # G5.5, G5.6: slots not kept are copied; the status lists the slots' ids, then the count.
    ids = [int(v) for v in slot_id if v is not None]  # step 4 filled every slot
    actual_seq = sum(id_size(v, eff, tbs) for v in ids)
    status = np.array(ids + [-1] * (K - n) + [actual_seq], np.int32)
    copy = np.array([v not in kept for v in ids] + [False] * (K - n), bool)
    return RowPlan(status, actual_seq, copy, skipped=False)


def _copy_row(
    meta: GatherMeta,
    r: int,
    plan: RowPlan,
    pairs: list[tuple[np.ndarray, np.ndarray]],
    selection_kv_block_table: np.ndarray,
    full_kv_block_table: np.ndarray,
    full_kv_actual_seq: np.ndarray,
) -> int:
    """docs/SPEC.md G4: the copied slots of row r from the full caches into the selection
    caches (each pair a (selection, full) cache); returns the row's actual_seq."""
    b, s = divmod(r, meta.seq)
    eff = int(full_kv_actual_seq[b]) - (meta.seq - 1 - s)
    tbs, sbs, fbs = meta.tbs, meta.sel_block_size, meta.full_block_size
    _, src_pos, dst_q = _row_tokens(plan, eff, tbs)
    src_blk = full_kv_block_table[b, src_pos // fbs]
    dst_blk = selection_kv_block_table[r, dst_q // sbs]
    for sel, full in pairs:
        # Same-dtype fancy-index copies move the elements' bytes unchanged.
        sel[dst_blk, dst_q % sbs] = full[src_blk, src_pos % fbs]
    return plan.actual_seq


def _row_tokens(plan: RowPlan, eff: int, tbs: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token-level copies of one row: ``(slot, src_pos, dst_q)``, int64 ``[N]`` each.

    Token i of copied slot j holding id v reads full position ``v*TBS + i`` and writes
    selection position ``q = j*TBS + i`` (docs/SPEC.md G4), for ``i < size(v)``.
    """
    slots = np.flatnonzero(plan.copy).astype(np.int64)
    ids = plan.status[slots].astype(np.int64)
    sizes = np.array([id_size(int(v), eff, tbs) for v in ids], dtype=np.int64)
    # Offset of each token inside its id's run: 0..size-1, concatenated over ids.
    starts = np.cumsum(sizes) - sizes
    within = np.arange(int(sizes.sum()), dtype=np.int64) - np.repeat(starts, sizes)
    return (
        np.repeat(slots, sizes),
        np.repeat(ids * tbs, sizes) + within,
        np.repeat(slots * tbs, sizes) + within,
    )


def gather_selection_kv_cache(
    selection_k_rope: np.ndarray,
    selection_kv_cache: np.ndarray,
    selection_kv_block_table: np.ndarray,
    selection_kv_block_status: np.ndarray,
    selection_topk_indices: np.ndarray,
    full_k_rope: np.ndarray,
    full_kv_cache: np.ndarray,
    full_kv_block_table: np.ndarray,
    full_kv_actual_seq: np.ndarray,
    full_q_actual_seq: np.ndarray,
    *,
    selection_topk_block_size: int = 64,
) -> np.ndarray:
    """Gather the top-k selected tokens of a paged full cache into a selection cache.

    Reference of ``custom.npu_gather_selection_kv_cache`` (docs/SPEC.md section G). Ids already
    resident in a row's slots stay in place (G5); the others are copied from the full
    cache. Every argument is validated before the first write; a refused call modifies
    nothing.

    Parameters
    ----------
    selection_k_rope : numpy.ndarray ``[S_BLOCK_NUM, SBS, K_ROPE]`` or zero-element
        Updated in place (cache dtype: float16, bfloat16, int8, float32, float8).
    selection_kv_cache : numpy.ndarray ``[S_BLOCK_NUM, SBS, KV]``
        Updated in place.
    selection_kv_block_table : numpy.ndarray int32 ``[R >= B*S, S_MAX_BLOCK_NUM]``
        Read only. Row ``r = b*S + s`` addresses the slots of query token s of batch b.
    selection_kv_block_status : numpy.ndarray int32 BSND ``[B, S, 1, K+1]`` or TND
        ``[B*S, 1, K+1]``
        Ids resident in each row's slots, then the row's token count; updated in place.
        Reset a row to -1 when it starts a new sequence.
    selection_topk_indices : numpy.ndarray int32 BSND ``[B, S, 1, K]`` or TND ``[B*S, 1, K]``
        Selected ids in units of TBS tokens; negative entries are padding.
    full_k_rope : numpy.ndarray ``[F_BLOCK_NUM, FBS, K_ROPE]`` or zero-element
    full_kv_cache : numpy.ndarray ``[F_BLOCK_NUM, FBS, KV]``
    full_kv_block_table : numpy.ndarray int32 ``[B, F_MAX_BLOCK_NUM]``
    full_kv_actual_seq : numpy.ndarray int32 ``[B]``
        Tokens in the full cache of each batch, this step's S new tokens included.
    full_q_actual_seq : numpy.ndarray int32 ``[B]``
        Validated (shape, dtype), otherwise ignored.
    selection_topk_block_size : int, default 64
        TBS: tokens per id; 1 = token-level selection.

    Returns
    -------
    numpy.ndarray int32 ``[R]``
        ``selection_kv_actual_seq``: valid tokens of each row in its selection slots (the
        dense range ``[0, actual_seq)``); 0 for skipped rows and rows ``>= B*S``.

    Raises
    ------
    TypeError, ValueError
        See :func:`pytrt_kv.contract.gather.validate_gather`; also ValueError for an
        argument sharing memory with one the op writes (naming both).

    Notes
    -----
    Not synchronized: calls that update the same selection caches and status (from
    several threads, or interleaved with GPU work on the same memory) must be
    serialized by the caller.

    Examples
    --------
    The first TBS = 1 step of docs/SPEC.md G6 (K = 4, kv_len 10, topk ``[5, 9, 2, -1]``):

    >>> import numpy as np
    >>> full = np.arange(16 * 2, dtype=np.float16).reshape(2, 8, 2)   # 2 blocks of 8
    >>> sel = np.zeros((1, 4, 2), np.float16)
    >>> status = np.full((1, 1, 1, 5), -1, np.int32)
    >>> out = gather_selection_kv_cache(
    ...     np.zeros(0, np.float16), sel, np.zeros((1, 1), np.int32), status,
    ...     np.array([5, 9, 2, -1], np.int32).reshape(1, 1, 1, 4),
    ...     np.zeros(0, np.float16), full, np.array([[0, 1]], np.int32),
    ...     np.array([10], np.int32), np.array([1], np.int32),
    ...     selection_topk_block_size=1)
    >>> out.tolist(), status.ravel().tolist()
    ([3], [5, 9, 2, -1, 3])
    >>> sel[0, :3, 0].tolist()   # tokens 5, 9, 2 (element 0 of token p is 2*p)
    [10.0, 18.0, 4.0]
    """
    meta, plans = validate_gather(
        **op_tensors(specs.GATHER_SELECTION_KV_CACHE, locals()),
        selection_topk_block_size=selection_topk_block_size,
        place=plan_row,  # every row planned from its old status (G5) and checked
    )

    # Everything is valid: from here on, only writes.
    actual_seq = np.zeros(meta.rows, dtype=np.int32)
    if not plans:  # B*S == 0: an empty batch reads and writes nothing (docs/SPEC.md G2)
        return actual_seq
    pairs = [(selection_kv_cache, full_kv_cache), (selection_k_rope, full_k_rope)]
    tables = (selection_kv_block_table, full_kv_block_table, full_kv_actual_seq)
    new_status = np.stack([p.status for p in plans])
    for r, plan in enumerate(plans):
        if not plan.skipped:
            actual_seq[r] = _copy_row(meta, r, plan, pairs[: 1 + bool(meta.k_rope_dim)], *tables)
    selection_kv_block_status[...] = new_status.reshape(selection_kv_block_status.shape)
    return actual_seq
