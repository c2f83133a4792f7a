"""Contract of GatherSelectionKvCache (docs/SPEC.md section G): every argument check.

:func:`validate_gather` is the one check of a call, used identically by the NumPy
reference, :mod:`pytrt_kv.ops` and (through the reference) the CPU runtime; its parts are
:func:`check_gather` (shapes, dtypes, the attribute: never reads a value, so graph export
calls it alone), :func:`check_gather_values` (with :func:`check_row`) and
:func:`check_gather_numpy`. The value rules need the G5 placement, which is the
reference's ``plan_row``, passed in as ``place`` (the contract imports nothing above it).
The readings taken where docs/SPEC.md is silent: docs/DECISIONS.md G1-G14.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeVar

import numpy as np

from . import limits, specs
from .alias import array_range, check_no_alias
from .args import index_inputs, op_call, op_tensors
from .dtypes import name_of
from .errors import describe, type_error, value_error

__all__ = [
    "GatherMeta",
    "validate_gather",
    "MAX_TOPK",
    "GATHER_WRITTEN",
    "GATHER_READ_OR_WRITTEN",
    "GATHER_ARG_NAMES",
    "check_gather",
    "check_gather_values",
    "check_gather_numpy",
    "check_row",
]

#: docs/SPEC.md G2: largest K, for every TBS (one source for every language: limits.py).
MAX_TOPK = limits.MAX_TOPK
INT32_MAX = 2**31 - 1

#: The ten tensors of the op, in its order.
GATHER_ARG_NAMES = _ARG_NAMES = specs.GATHER_SELECTION_KV_CACHE.input_names

#: The tensors whose values check_gather_values reads.
_VALUE_ARGS = (
    "selection_kv_block_table",
    "selection_kv_block_status",
    "selection_topk_indices",
    "full_kv_block_table",
    "full_kv_actual_seq",
)

#: The arguments a gather writes in place (the eager GPU API adds its ``out``).
GATHER_WRITTEN = ("selection_k_rope", "selection_kv_cache", "selection_kv_block_status")
#: Every argument the op reads or writes: full_q_actual_seq is never read, so it may
#: share memory with anything.
GATHER_READ_OR_WRITTEN = tuple(n for n in _ARG_NAMES if n != "full_q_actual_seq")


class Placement(Protocol):
    """What the value rules read of a row's G5 plan (``pytrt_kv.reference.RowPlan``)."""

    @property
    def status(self) -> np.ndarray: ...  # int32 [K+1]: the new ids, then actual_seq
    @property
    def copy(self) -> np.ndarray: ...  # bool [K]: slot j is copied from the full cache
    @property
    def skipped(self) -> bool: ...  # G3: nothing of the row is read or written


P = TypeVar("P", bound=Placement)


@dataclass(frozen=True)
class GatherMeta:
    """Sizes of one gather call, as found by :func:`check_gather` (docs/SPEC.md G2 names)."""

    cache_dtype: str  #: dtype name of the four caches
    layout: str  #: "BSND" or "TND" (ranks of status/topk)
    batch: int  #: B
    seq: int  #: S, query tokens per batch
    heads: int  #: H (== 1)
    topk: int  #: K
    tbs: int  #: selection_topk_block_size
    rows: int  #: R, rows of selection_kv_block_table
    sel_block_num: int  #: S_BLOCK_NUM
    sel_block_size: int  #: SBS
    sel_max_block_num: int  #: S_MAX_BLOCK_NUM
    full_block_num: int  #: F_BLOCK_NUM
    full_block_size: int  #: FBS
    full_max_block_num: int  #: F_MAX_BLOCK_NUM
    k_rope_dim: int  #: K_ROPE, 0 when the k_rope pair is zero-element
    kv_dim: int  #: KV


# --- shape / dtype validation --------------------------------------------------------


def _shape(arg: str, x: Any) -> tuple[int, ...]:
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise type_error(arg, "a tensor (anything with .shape and .dtype)", describe(x))
    return tuple(int(d) for d in x.shape)


def _dtype(arg: str, x: Any, allowed: Sequence[str]) -> str:
    try:
        name = name_of(x.dtype)
    except TypeError:
        raise type_error(arg, f"dtype in {list(allowed)}", f"{x.dtype}") from None
    if name not in allowed:
        raise type_error(arg, f"dtype in {list(allowed)}", describe(x))
    return name


def _numel(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64)) if shape else 1


def _ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def _check_gather_dtypes(by_name: dict[str, Any]) -> str:
    """docs/SPEC.md G2 dtypes: one cache dtype for the four caches, int32 indices."""
    cache_dtype = _dtype(
        "selection_kv_cache", by_name["selection_kv_cache"], specs.GATHER_CACHE_DTYPES
    )
    for name in ("selection_k_rope", "full_kv_cache", "full_k_rope"):
        got = _dtype(name, by_name[name], specs.GATHER_CACHE_DTYPES)
        if got != cache_dtype:
            raise type_error(
                name,
                f"the cache dtype {cache_dtype} of selection_kv_cache "
                "(all four caches share one dtype)",
                describe(by_name[name]),
            )
    for name in index_inputs(specs.GATHER_SELECTION_KV_CACHE):
        _dtype(name, by_name[name], specs.GATHER_INDEX_DTYPES)
    return cache_dtype


def _check_tbs(tbs: Any) -> int:
    """The attribute selection_topk_block_size: an int >= 1 (a bool is not an int here)."""
    if isinstance(tbs, (bool, np.bool_)) or not isinstance(tbs, (int, np.integer)):
        raise type_error("selection_topk_block_size", "an int", repr(tbs))
    tbs = int(tbs)
    if tbs < 1:
        raise value_error("selection_topk_block_size", "an int >= 1", tbs)
    return tbs


class _Caches(NamedTuple):
    sel_block_num: int
    sbs: int
    kv_dim: int
    full_block_num: int
    fbs: int
    k_rope_dim: int


def _check_k_rope(
    shapes: dict[str, tuple[int, ...]],
    by_name: dict[str, Any],
    sel_block_num: int,
    sbs: int,
    full_block_num: int,
    fbs: int,
) -> int:
    """K_ROPE of the k_rope pair, 0 when both are zero-element (docs/DECISIONS.md G8)."""
    srope, frope = shapes["selection_k_rope"], shapes["full_k_rope"]
    both_shaped = len(srope) == 3 and len(frope) == 3 and srope[2] >= 1 and srope[2] == frope[2]
    if _numel(srope) == 0 and _numel(frope) == 0 and not both_shaped:
        return 0
    if _numel(srope) == 0 and _numel(frope) != 0 and not both_shaped:
        raise value_error(
            "selection_k_rope",
            "[S_BLOCK_NUM, SBS, K_ROPE] like full_k_rope "
            "(the k_rope pair is both present or both zero-element)",
            describe(by_name["selection_k_rope"]),
        )
    if len(srope) != 3 or srope[:2] != (sel_block_num, sbs) or srope[2] < 1:
        raise value_error(
            "selection_k_rope",
            f"shape [{sel_block_num}, {sbs}, K_ROPE "
            ">= 1] (S_BLOCK_NUM, SBS of selection_kv_cache) or "
            "zero-element",
            describe(by_name["selection_k_rope"]),
        )
    k_rope_dim = srope[2]
    if frope != (full_block_num, fbs, k_rope_dim):
        raise value_error(
            "full_k_rope",
            f"shape [{full_block_num}, {fbs}, {k_rope_dim}]"
            " (F_BLOCK_NUM, FBS of full_kv_cache, K_ROPE of "
            "selection_k_rope; the k_rope pair is both present or both "
            "zero-element)",
            describe(by_name["full_k_rope"]),
        )
    return k_rope_dim


def _check_caches(shapes: dict[str, tuple[int, ...]], by_name: dict[str, Any]) -> _Caches:
    """docs/SPEC.md G2: the two kv caches and the k_rope pair."""
    skv = shapes["selection_kv_cache"]
    if len(skv) != 3 or skv[1] < 1 or skv[2] < 1:
        raise value_error(
            "selection_kv_cache",
            "shape [S_BLOCK_NUM, SBS >= 1, KV >= 1]",
            describe(by_name["selection_kv_cache"]),
        )
    sel_block_num, sbs, kv_dim = skv
    fkv = shapes["full_kv_cache"]
    if len(fkv) != 3 or fkv[1] < 1 or fkv[2] != kv_dim:
        raise value_error(
            "full_kv_cache",
            f"shape [F_BLOCK_NUM, FBS >= 1, KV = {kv_dim}] (KV of selection_kv_cache)",
            describe(by_name["full_kv_cache"]),
        )
    full_block_num, fbs, _ = fkv
    k_rope_dim = _check_k_rope(shapes, by_name, sel_block_num, sbs, full_block_num, fbs)
    return _Caches(sel_block_num, sbs, kv_dim, full_block_num, fbs, k_rope_dim)


def _check_batch(shapes: dict[str, tuple[int, ...]], by_name: dict[str, Any]) -> tuple[int, int]:
    """B (from full_kv_actual_seq) and F_MAX_BLOCK_NUM."""
    kvs = shapes["full_kv_actual_seq"]
    if len(kvs) != 1:
        raise value_error(
            "full_kv_actual_seq", "shape [B] (B >= 0)", describe(by_name["full_kv_actual_seq"])
        )
    batch = kvs[0]
    if shapes["full_q_actual_seq"] != (batch,):
        raise value_error(
            "full_q_actual_seq",
            f"shape [{batch}] (B of full_kv_actual_seq)",
            describe(by_name["full_q_actual_seq"]),
        )
    ftab = shapes["full_kv_block_table"]
    if len(ftab) != 2 or ftab[0] != batch:
        raise value_error(
            "full_kv_block_table",
            f"shape [{batch}, F_MAX_BLOCK_NUM] (B of full_kv_actual_seq)",
            describe(by_name["full_kv_block_table"]),
        )
    return batch, ftab[1]


def _check_rows(
    shapes: dict[str, tuple[int, ...]], by_name: dict[str, Any], batch: int
) -> tuple[str, int, int, int]:
    """Status and top-k tensors: (layout, S, H, K)."""
    st, tk = shapes["selection_kv_block_status"], shapes["selection_topk_indices"]
    topk_x = by_name["selection_topk_indices"]
    if len(tk) not in (3, 4):
        raise value_error(
            "selection_topk_indices", "BSND [B, S, H, K] or TND [B*S, H, K]", describe(topk_x)
        )
    layout = "BSND" if len(tk) == 4 else "TND"
    if len(st) != len(tk):
        want = "[B, S, H, K+1]" if layout == "BSND" else "[B*S, H, K+1]"
        raise value_error(
            "selection_kv_block_status",
            f"{layout} {want}, the layout of selection_topk_indices (both must agree)",
            describe(by_name["selection_kv_block_status"]),
        )
    topk = tk[-1]
    heads = tk[-2]
    if layout == "BSND":
        if tk[0] != batch:
            raise value_error(
                "selection_topk_indices",
                f"BSND [B = {batch}, S, H, K] (B of full_kv_actual_seq)",
                describe(topk_x),
            )
        seq = tk[1]
    elif batch == 0:  # an empty batch (docs/SPEC.md G2): no token rows either
        if tk[0] != 0:
            raise value_error(
                "selection_topk_indices", "TND [T = 0, H, K] for B = 0", describe(topk_x)
            )
        seq = 0
    else:
        if tk[0] % batch != 0:
            raise value_error(
                "selection_topk_indices",
                f"TND [T, H, K] with T a multiple of B = {batch}",
                describe(topk_x),
            )
        seq = tk[0] // batch
    if heads != 1:
        raise value_error(
            "selection_topk_indices", "H == 1 (the only head count supported)", describe(topk_x)
        )
    if not 1 <= topk <= MAX_TOPK:
        raise value_error(
            "selection_topk_indices", f"1 <= K <= {MAX_TOPK} (last dim)", describe(topk_x)
        )
    if st != tk[:-1] + (topk + 1,):
        raise value_error(
            "selection_kv_block_status",
            f"shape {list(tk[:-1] + (topk + 1,))} (selection_topk_indices with last dim K+1)",
            describe(by_name["selection_kv_block_status"]),
        )
    return layout, seq, heads, topk


def _check_selection_table(
    shapes: dict[str, tuple[int, ...]],
    by_name: dict[str, Any],
    tbs: int,
    sbs: int,
    fbs: int,
    topk: int,
    rows_needed: int,
) -> tuple[int, int]:
    """docs/SPEC.md G2 constraints: TBS divides SBS and FBS; the selection table is big
    enough. Returns (R, S_MAX_BLOCK_NUM)."""
    if sbs % tbs != 0:
        raise value_error(
            "selection_topk_block_size",
            f"a divisor of SBS = {sbs} (block size of selection_kv_cache)",
            tbs,
        )
    if fbs % tbs != 0:
        raise value_error(
            "selection_topk_block_size",
            f"a divisor of FBS = {fbs} (block size of full_kv_cache)",
            tbs,
        )
    if topk * tbs > INT32_MAX:
        raise value_error(
            "selection_topk_block_size",
            f"K*TBS <= 2^31-1 with K = {topk} (a row's token count is an int32)",
            tbs,
        )
    stab = shapes["selection_kv_block_table"]
    need_cols = _ceil_div(topk * tbs, sbs)
    if len(stab) != 2 or stab[0] < rows_needed or stab[1] < need_cols:
        raise value_error(
            "selection_kv_block_table",
            f"shape [R >= B*S*H = {rows_needed}, S_MAX_BLOCK_NUM >= ceil(K*TBS/SBS) = {need_cols}]",
            describe(by_name["selection_kv_block_table"]),
        )
    return stab[0], stab[1]


@op_call(specs.GATHER_SELECTION_KV_CACHE)
def check_gather(call: dict[str, Any]) -> GatherMeta:
    """Validate the shapes, dtypes and attribute of a gather call (docs/SPEC.md G2).

    Values are never read, so the arguments may be NumPy arrays, torch tensors or CuPy
    arrays (anything with ``.shape`` and ``.dtype``).

    Parameters
    ----------
    The ten tensors of :func:`gather_selection_kv_cache`, in its order, and
    ``selection_topk_block_size`` (TBS): the op spec's signature
    (:func:`pytrt_kv.contract.args.op_call`).

    Returns
    -------
    GatherMeta

    Raises
    ------
    TypeError
        An argument is not a tensor, has a dtype outside G2, the four caches do not share
        one dtype, or TBS is not an integer.
    ValueError
        Any shape rule or constraint of G2 is broken.

    Examples
    --------
    >>> import numpy as np
    >>> i32 = np.int32
    >>> meta = check_gather(
    ...     np.zeros((8, 16, 64), np.float16), np.zeros((8, 16, 512), np.float16),
    ...     np.zeros((2, 4), i32), np.zeros((2, 1, 1, 5), i32), np.zeros((2, 1, 1, 4), i32),
    ...     np.zeros((8, 16, 64), np.float16), np.zeros((8, 16, 512), np.float16),
    ...     np.zeros((2, 3), i32), np.zeros(2, i32), np.zeros(2, i32),
    ...     selection_topk_block_size=4)
    >>> meta.layout, meta.batch, meta.seq, meta.topk, meta.k_rope_dim
    ('BSND', 2, 1, 4, 64)
    """
    by_name = op_tensors(specs.GATHER_SELECTION_KV_CACHE, call)
    shapes = {name: _shape(name, x) for name, x in by_name.items()}
    cache_dtype = _check_gather_dtypes(by_name)
    tbs = _check_tbs(call["selection_topk_block_size"])
    c = _check_caches(shapes, by_name)
    batch, full_max_block_num = _check_batch(shapes, by_name)
    layout, seq, heads, topk = _check_rows(shapes, by_name, batch)
    rows, sel_max_block_num = _check_selection_table(
        shapes, by_name, tbs, c.sbs, c.fbs, topk, batch * seq * heads
    )
    return GatherMeta(
        cache_dtype=cache_dtype,
        layout=layout,
        batch=batch,
        seq=seq,
        heads=heads,
        topk=topk,
        tbs=tbs,
        rows=rows,
        sel_block_num=c.sel_block_num,
        sel_block_size=c.sbs,
        sel_max_block_num=sel_max_block_num,
        full_block_num=c.full_block_num,
        full_block_size=c.fbs,
        full_max_block_num=full_max_block_num,
        k_rope_dim=c.k_rope_dim,
        kv_dim=c.kv_dim,
    )


# --- G3-G5: placement of one row -----------------------------------------------------


def check_row(
    old: Sequence[int], topk: Sequence[int], kv_len: int, S: int, s: int, tbs: int
) -> None:
    """The value rules of one row (docs/SPEC.md G5, docs/DECISIONS.md G1, G2): an old
    status of K+1 entries whose non-negative ids are a distinct prefix, and distinct valid
    ids in the top-k row. A skipped row (G3) is not checked."""
    K = len(topk)
    if len(old) != K + 1:
        raise value_error("selection_kv_block_status", f"a row of K+1 = {K + 1} entries", len(old))
    if tbs < 1 or S < 1 or not 0 <= s < S:
        raise value_error("plan_row", "tbs >= 1, S >= 1 and 0 <= s < S", f"tbs={tbs}, S={S}, s={s}")
    eff = kv_len - (S - 1 - s)
    if kv_len <= 0 or eff <= 0:
        return
    max_id = _ceil_div(eff, tbs) - 1
    position: dict[int, int] = {}  # valid id -> its position in topk
    for i, v in enumerate(topk):
        if 0 <= v <= max_id:
            if v in position:
                raise value_error(
                    "selection_topk_indices",
                    "distinct valid ids in a row",
                    f"id {v} at positions {position[v]} and {i}",
                )
            position[v] = i
    old_ids = old[:K]
    old_n = sum(1 for x in old_ids if x >= 0)
    if any(x < 0 for x in old_ids[:old_n]):
        hole = next(j for j, x in enumerate(old_ids) if x < 0)
        late = next(j for j, x in enumerate(old_ids) if x >= 0 and j > hole)
        raise value_error(
            "selection_kv_block_status",
            "non-negative entries as a prefix of the row (a corrupted status; reset it to -1)",
            f"{old_ids[hole]} in slot {hole} before {old_ids[late]} in slot {late}",
        )
    old_slot: dict[int, int] = {}  # old id -> its slot
    for j, v in enumerate(old_ids[:old_n]):
        if v in old_slot:
            raise value_error(
                "selection_kv_block_status",
                "distinct ids in the row (a corrupted status; reset it to -1)",
                f"id {v} in slots {old_slot[v]} and {j}",
            )
        old_slot[v] = j


# --- value rules ---------------------------------------------------------------------


def _row_batch(meta: GatherMeta, r: int) -> tuple[int, int]:
    return r // meta.seq, r % meta.seq


def check_gather_values(
    meta: GatherMeta,
    *,
    selection_kv_block_table: np.ndarray,
    selection_kv_block_status: np.ndarray,
    selection_topk_indices: np.ndarray,
    full_kv_block_table: np.ndarray,
    full_kv_actual_seq: np.ndarray,
    place: Callable[[Sequence[int], Sequence[int], int, int, int, int], P],
) -> list[P]:
    """Apply every value rule of docs/SPEC.md G4/G5 (docs/DECISIONS.md G1-G14).

    Parameters
    ----------
    meta : GatherMeta
        From :func:`check_gather` on the same arguments.
    selection_kv_block_table : numpy.ndarray, int32 ``[R, S_MAX_BLOCK_NUM]``
    selection_kv_block_status : numpy.ndarray, int32 BSND ``[B, S, 1, K+1]`` or TND
        ``[B*S, 1, K+1]``
    selection_topk_indices : numpy.ndarray, int32, status's shape with last dim K
    full_kv_block_table : numpy.ndarray, int32 ``[B, F_MAX_BLOCK_NUM]``
    full_kv_actual_seq : numpy.ndarray, int32 ``[B]``
    place : callable
        The G5 placement of one row, ``pytrt_kv.reference.plan_row``: the table entries
        checked are those its plan dereferences (DECISIONS G4, G5).

    Returns
    -------
    list
        ``place``'s plan of every row ``r < B*S`` (``r = b*S + s``), from the old status.

    Raises
    ------
    ValueError
        A corrupted status row, a duplicate valid id, ``kv_len`` beyond what the full
        table addresses, a table entry out of range where it is dereferenced, or two
        written tokens at one selection address.
    """
    n_rows = meta.batch * meta.seq
    status = np.asarray(selection_kv_block_status).reshape(n_rows, meta.topk + 1)
    topk = np.asarray(selection_topk_indices).reshape(n_rows, meta.topk)
    sel_table = np.asarray(selection_kv_block_table)
    full_table = np.asarray(full_kv_block_table)
    kv_lens = [int(x) for x in np.asarray(full_kv_actual_seq)]
    tbs, fbs = meta.tbs, meta.full_block_size

    capacity = meta.full_max_block_num * fbs
    for b, kv_len in enumerate(kv_lens):
        if kv_len > capacity:
            raise value_error(
                f"full_kv_actual_seq[{b}]",
                f"at most F_MAX_BLOCK_NUM * FBS = "
                f"{meta.full_max_block_num} * {fbs} = {capacity} (the tokens "
                "full_kv_block_table can address)",
                kv_len,
            )

    plans: list[P] = []
    written = []  # per row: flat selection addresses (block * SBS + offset) written
    for r in range(n_rows):
        b, s = _row_batch(meta, r)
        try:
            plan = place(status[r], topk[r], kv_lens[b], meta.seq, s, tbs)
        except ValueError as exc:
            raise ValueError(f"row {r} (b={b}, s={s}): {exc}") from None
        plans.append(plan)
        if plan.skipped:
            continue
        written.append(_row_writes(meta, r, b, plan, full_table, sel_table))

    _check_no_write_collision(written)
    return plans


def _row_writes(
    meta: GatherMeta,
    r: int,
    b: int,
    plan: Placement,
    full_table: np.ndarray,
    sel_table: np.ndarray,
) -> tuple[int, np.ndarray, np.ndarray]:
    """The table entries row r's plan dereferences, checked (DECISIONS G4, G5); returns
    (r, copied slots, the flat selection address of each slot's first token)."""
    tbs, sbs, fbs = meta.tbs, meta.sel_block_size, meta.full_block_size
    # SBS and FBS are multiples of TBS (G2), so the tokens of one id lie in one column
    # of full_kv_block_table and those of one slot in one column of its selection
    # table row: the ranges are checked per id, before any per-token array exists
    # (a huge TBS must not allocate for tokens that are refused anyway).
    slot = np.flatnonzero(plan.copy).astype(np.int64)
    ids = plan.status[slot].astype(np.int64)
    src_col = ids * tbs // fbs
    bad = np.flatnonzero(src_col >= meta.full_max_block_num)
    if bad.size:  # unreachable after the capacity rule; kept as a guard
        k = bad[0]
        raise value_error(
            f"selection_topk_indices row {r}",
            f"ids whose tokens lie in the {meta.full_max_block_num} columns of full_kv_block_table",
            f"id {ids[k]} needing column {src_col[k]}",
        )
    src_blk = full_table[b, src_col]
    bad = np.flatnonzero((src_blk < 0) | (src_blk >= meta.full_block_num))
    if bad.size:
        k = bad[0]
        raise value_error(
            f"full_kv_block_table[{b}, {src_col[k]}]",
            f"a block in [0, F_BLOCK_NUM = {meta.full_block_num}) (read "
            f"for id {ids[k]} of row {r})",
            int(src_blk[k]),
        )

    dst_q = slot * tbs
    dst_col = dst_q // sbs
    dst_blk = sel_table[r, dst_col]
    bad = np.flatnonzero((dst_blk < 0) | (dst_blk >= meta.sel_block_num))
    if bad.size:
        k = bad[0]
        raise value_error(
            f"selection_kv_block_table[{r}, {dst_col[k]}]",
            f"a block in [0, S_BLOCK_NUM = {meta.sel_block_num}) (written for slot {slot[k]})",
            int(dst_blk[k]),
        )
    # A slot writes at most TBS tokens from a TBS-aligned offset of its block: two
    # slots' writes overlap exactly when their first tokens share an address.
    return r, slot, dst_blk.astype(np.int64) * sbs + dst_q % sbs


def _check_no_write_collision(written: list[tuple[int, np.ndarray, np.ndarray]]) -> None:
    if not written:
        return
    rows = np.concatenate([np.full(a.size, r, dtype=np.int64) for r, _, a in written])
    slots = np.concatenate([sl for _, sl, _ in written])
    addrs = np.concatenate([a for _, _, a in written])
    order = np.argsort(addrs, kind="stable")
    dup = np.flatnonzero(addrs[order][1:] == addrs[order][:-1])
    if dup.size:
        first, second = order[dup[0]], order[dup[0] + 1]
        raise value_error(
            "selection_kv_block_table",
            "distinct selection cache addresses for every written token",
            f"row {rows[first]} slot {slots[first]} and row "
            f"{rows[second]} slot {slots[second]} both writing token "
            f"{addrs[first]} (block * SBS + offset)",
        )


def check_gather_numpy(meta: GatherMeta, args: Sequence[Any]) -> None:
    """The NumPy reference's extra rules (docs/DECISIONS.md G12, G13).

    ``args`` are the ten tensors of the op in its order: each a ``numpy.ndarray``, the
    outputs writeable, no argument sharing memory with an output.
    """
    for name, x in zip(_ARG_NAMES, args):
        if not isinstance(x, np.ndarray):
            raise type_error(
                name, "a numpy.ndarray (the reference runs on the CPU)", type(x).__name__
            )
    named = dict(zip(_ARG_NAMES, args))
    outputs = ["selection_kv_cache", "selection_kv_block_status"]
    if meta.k_rope_dim:
        outputs.append("selection_k_rope")
    for name in outputs:
        if not named[name].flags.writeable:
            raise value_error(name, "a writeable array (updated in place)", "read-only")
    check_no_alias(
        {name: array_range(named[name]) for name in GATHER_READ_OR_WRITTEN}, GATHER_WRITTEN, named
    )


@op_call(specs.GATHER_SELECTION_KV_CACHE, place=None, read="numpy")
def validate_gather(call: dict[str, Any]) -> tuple[GatherMeta, list[Any]]:
    """Every rule of docs/SPEC.md G on one call, before anything is written.

    Tensors and TBS as :func:`pytrt_kv.reference.gather_selection_kv_cache`; ``read`` as
    :data:`pytrt_kv.contract.scatter.Read` ("numpy" adds :func:`check_gather_numpy`);
    ``place`` as in :func:`check_gather_values`, required unless ``read`` is None.
    Returns the meta and every row's plan (none when ``read`` is None).
    """
    place, read = call.pop("place"), call.pop("read")
    named = op_tensors(specs.GATHER_SELECTION_KV_CACHE, call)
    tensors = tuple(named.values())
    meta = check_gather(**call)
    if read is None:
        return meta, []
    if place is None:
        raise type_error("place", "the G5 placement (pytrt_kv.reference.plan_row)", "None")
    if read == "numpy":
        check_gather_numpy(meta, tensors)
    fetch = (lambda x: x) if read == "numpy" else read
    plans = check_gather_values(
        meta,
        **{name: fetch(named[name]) for name in _VALUE_ARGS},
        place=place,
    )
    return meta, plans
