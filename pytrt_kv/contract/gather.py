"""Contract of GatherSelectionKvCache (docs/SPEC.md section G): every argument check.

Three layers, each usable on its own:

* :func:`check_gather` validates shapes, dtypes and the attribute (never reads values;
  works on anything with ``.shape`` and ``.dtype``: NumPy, torch, CuPy) and returns a
  :class:`GatherMeta`.
* :func:`plan_row` is the G5 placement of one row in plain Python: the specification the
  CUDA planner is tested against.
* :func:`check_gather_values` applies every value rule to NumPy index arrays and returns
  the plan of every row; :func:`pytrt_kv.reference.gather_selection_kv_cache` then moves
  the bytes.
* :func:`check_gather_numpy` adds what the NumPy reference needs (NumPy arrays, writeable
  outputs, no argument sharing memory with an output).

Decisions where docs/SPEC.md is silent (the reference raises ``ValueError`` unless noted):

1. Only rows that are processed are value-checked. A skipped row (``kv_len <= 0`` or
   ``eff <= 0``) is never read beyond ``kv_len``: its status, top-k and table rows may
   hold anything. Rows ``r >= B*S`` of ``selection_kv_block_table`` are never read.
2. A corrupted old status is either non-negative entries that are not a prefix of
   ``old[0..K-1]`` (G5.1) or the same id twice in that prefix (its "old slot" would be
   ambiguous). ``old[K]`` is never checked: only ``old[K] % TBS != 0`` matters, and that
   test gives the same answer in Python and C for negative values (a fresh row is all -1).
3. ``full_kv_actual_seq[b] > F_MAX_BLOCK_NUM * FBS`` for a batch with ``kv_len > 0`` is
   refused: the full table cannot address the tokens the row claims to have. Because of
   it, the G4 rule "an id needs a column >= F_MAX_BLOCK_NUM" can never be reached
   separately (it is still checked, as a guard).
4. Table entries are range-checked only where they are dereferenced: a
   ``full_kv_block_table[b, c]`` entry only for the columns of ids that are copied (kept
   ids are not read), a ``selection_kv_block_table[r, c]`` entry only for the columns of
   slots that are written. Unused columns may hold padding such as -1.
5. Two written selection tokens at one address (within a row or across rows, through
   repeated ``selection_kv_block_table`` entries) are refused, like duplicate slots in
   ScatterPaKvCache (S7): the winner would depend on the order of the writes. A write
   onto a slot that another row keeps is allowed (deterministic; the other row's status
   then describes overwritten data, which is the caller's business).
6. Dtype problems (an unknown or not-allowed dtype, the four caches not sharing one) and
   a non-integer ``selection_topk_block_size`` are ``TypeError``; shapes and values are
   ``ValueError``.
7. ``B >= 0``, ``S >= 0`` (``B*S == 0``: an empty batch, nothing read or written, the
   output all zeros), ``1 <= K <= 2048``, ``SBS >= 1``, ``FBS >= 1``, ``KV >= 1``
   and ``TBS >= 1`` are required. ``S_BLOCK_NUM``, ``F_BLOCK_NUM`` and
   ``F_MAX_BLOCK_NUM`` may be 0 (then any row that needs them is refused by the value
   rules).
8. The k_rope pair is "absent" when both tensors are zero-element and not both
   ``[*, *, K_ROPE >= 1]`` shaped like their caches; otherwise both must be
   ``[S_BLOCK_NUM, SBS, K_ROPE]`` / ``[F_BLOCK_NUM, FBS, K_ROPE]`` with one K_ROPE >= 1.
   Zero-element k_rope tensors must still have the cache dtype (one type for the four
   caches, as in the ONNX schema).
9. The reference needs ``numpy.ndarray`` arguments; the three updated in place
   (``selection_kv_cache``, ``selection_kv_block_status``, and ``selection_k_rope``
   when present) must be writeable, so that a refused call never writes half its output.
10. The returned ``selection_kv_actual_seq`` is a new array; the status row is the only
    record of it inside the arguments (``status[K]``).
11. Reading of G5: "max_id is valid" means max_id is among the row's valid ids (it was
    selected); only then is slot n-1 reserved. A processed row with no valid id ends
    with status all -1 and ``status[K] = 0`` (and returns 0).
12. Rows are planned from the old status of every row before anything is written.
13. An argument that shares memory with a tensor the op writes (``selection_k_rope``,
    ``selection_kv_cache``, ``selection_kv_block_status``; the eager GPU API's ``out``
    too), e.g. a status overlapping the top-k table or a full cache overlapping the
    selection cache, is refused up front naming both (:mod:`pytrt_kv.contract.alias`).
    ``full_q_actual_seq`` is never read and is exempt.
14. Every range rule is checked per id and per slot before any array of per-token
    indices is built, so a refused call allocates nothing in proportion to TBS.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from . import limits, specs
from .alias import array_range, check_no_alias
from .dtypes import name_of
from .errors import describe, type_error, value_error

__all__ = [
    "GatherMeta",
    "RowPlan",
    "MAX_TOPK",
    "GATHER_WRITTEN",
    "GATHER_READ_OR_WRITTEN",
    "GATHER_ARG_NAMES",
    "check_gather",
    "check_gather_values",
    "check_gather_numpy",
    "plan_row",
    "id_size",
]

#: docs/SPEC.md G2: largest K, for every TBS (one source for every language: limits.py).
MAX_TOPK = limits.MAX_TOPK
INT32_MAX = 2**31 - 1

#: The ten tensors of the op, in its order.
GATHER_ARG_NAMES = _ARG_NAMES = (
    "selection_k_rope",
    "selection_kv_cache",
    "selection_kv_block_table",
    "selection_kv_block_status",
    "selection_topk_indices",
    "full_k_rope",
    "full_kv_cache",
    "full_kv_block_table",
    "full_kv_actual_seq",
    "full_q_actual_seq",
)

#: The arguments a gather writes in place (the eager GPU API adds its ``out``).
GATHER_WRITTEN = ("selection_k_rope", "selection_kv_cache", "selection_kv_block_status")
#: Every argument the op reads or writes: full_q_actual_seq is never read, so it may
#: share memory with anything.
GATHER_READ_OR_WRITTEN = tuple(n for n in _ARG_NAMES if n != "full_q_actual_seq")


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


@dataclass(frozen=True, eq=False)
class RowPlan:
    """G5 placement of one row (see :func:`plan_row`).

    Attributes
    ----------
    status : numpy.ndarray
        int32 ``[K+1]``: the new status row; for a skipped row, the old one unchanged.
    actual_seq : int
        ``selection_kv_actual_seq[r]``; 0 for a skipped row.
    copy : numpy.ndarray
        bool ``[K]``: ``copy[j]`` is True when slot j receives ``size(status[j])`` tokens
        from the full cache; False for kept and unused slots.
    skipped : bool
        True when the row is skipped (G3): nothing of it is read or written.
    """

    status: np.ndarray
    actual_seq: int
    copy: np.ndarray
    skipped: bool


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
    for name in (
        "selection_kv_block_table",
        "selection_kv_block_status",
        "selection_topk_indices",
        "full_kv_block_table",
        "full_kv_actual_seq",
        "full_q_actual_seq",
    ):
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
    """K_ROPE of the k_rope pair, 0 when both are zero-element (decision 8 above)."""
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


def check_gather(
    selection_k_rope: Any,
    selection_kv_cache: Any,
    selection_kv_block_table: Any,
    selection_kv_block_status: Any,
    selection_topk_indices: Any,
    full_k_rope: Any,
    full_kv_cache: Any,
    full_kv_block_table: Any,
    full_kv_actual_seq: Any,
    full_q_actual_seq: Any,
    selection_topk_block_size: Any = 64,
) -> GatherMeta:
    """Validate the shapes, dtypes and attribute of a gather call (docs/SPEC.md G2).

    Values are never read, so the arguments may be NumPy arrays, torch tensors or CuPy
    arrays (anything with ``.shape`` and ``.dtype``).

    Parameters
    ----------
    The ten tensors of :func:`gather_selection_kv_cache`, in its order, and
    ``selection_topk_block_size`` (TBS).

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
    tensors = (
        selection_k_rope,
        selection_kv_cache,
        selection_kv_block_table,
        selection_kv_block_status,
        selection_topk_indices,
        full_k_rope,
        full_kv_cache,
        full_kv_block_table,
        full_kv_actual_seq,
        full_q_actual_seq,
    )
    shapes = {name: _shape(name, x) for name, x in zip(_ARG_NAMES, tensors)}
    by_name = dict(zip(_ARG_NAMES, tensors))
    cache_dtype = _check_gather_dtypes(by_name)
    tbs = _check_tbs(selection_topk_block_size)
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


def id_size(v: int, eff: int, tbs: int) -> int:
    """G4 ``size(v)``: tokens of id v visible to a query that sees ``eff`` tokens."""
    max_id = _ceil_div(eff, tbs) - 1
    return eff - max_id * tbs if v == max_id else tbs


def plan_row(
    old_status: Sequence[int], topk_row: Sequence[int], kv_len: int, S: int, s: int, tbs: int
) -> RowPlan:
    """G5 placement of one row: which id goes to which slot and which slots are copied.

    Parameters
    ----------
    old_status : sequence of int, ``[K+1]``
        The row's status before the call.
    topk_row : sequence of int, ``[K]``
        The row's top-k indices (block ids in units of ``tbs`` tokens; negative = padding).
    kv_len : int
        ``full_kv_actual_seq[b]`` of the row's batch.
    S, s : int
        Query tokens per batch and this row's query token (``0 <= s < S``).
    tbs : int
        ``selection_topk_block_size``.

    Returns
    -------
    RowPlan

    Raises
    ------
    ValueError
        Corrupted old status (non-negative entries not a prefix, or an id twice), or the
        same valid id twice in ``topk_row``. Never for a skipped row.

    Examples
    --------
    The second TBS = 4 step of docs/SPEC.md G6: id 0 stays in slot 0, id 2 is re-copied.

    >>> p = plan_row([0, 1, 2, 10], [2, 0, -1], kv_len=11, S=1, s=0, tbs=4)
    >>> p.status.tolist(), p.actual_seq, p.copy.tolist()
    ([0, 2, -1, 7], 7, [False, True, False])
    """
    old = [int(x) for x in np.asarray(old_status).reshape(-1)]
    topk = [int(x) for x in np.asarray(topk_row).reshape(-1)]
    K = len(topk)
    if len(old) != K + 1:
        raise value_error("selection_kv_block_status", f"a row of K+1 = {K + 1} entries", len(old))
    if tbs < 1 or S < 1 or not 0 <= s < S:
        raise value_error("plan_row", "tbs >= 1, S >= 1 and 0 <= s < S", f"tbs={tbs}, S={S}, s={s}")

    # G3: the query token s sees eff tokens; rows with nothing visible are skipped.
    eff = kv_len - (S - 1 - s)
    if kv_len <= 0 or eff <= 0:
        return RowPlan(
            status=np.array(old, dtype=np.int32),
            actual_seq=0,
            copy=np.zeros(K, dtype=bool),
            skipped=True,
        )

    # G4: valid ids in topk order; negatives are padding wherever they stand, ids past
    # max_id are dropped silently.
    max_id = _ceil_div(eff, tbs) - 1
    valid: list[int] = []
    position: dict[int, int] = {}  # valid id -> its position in topk_row
    for i, v in enumerate(topk):
        if v < 0 or v > max_id:
            continue
        if v in position:
            raise value_error(
                "selection_topk_indices",
                "distinct valid ids in a row",
                f"id {v} at positions {position[v]} and {i}",
            )
        position[v] = i
        valid.append(v)
    n = len(valid)

    # G5 step 1: the old ids occupy slots 0..old_n-1; the old partial tail (TBS > 1 and
    # an actual_seq that is not a multiple of TBS) is slot old_n-1.
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
    old_tail = old_n - 1 if tbs > 1 and old[K] % tbs != 0 else None

    # G5 step 3 (needed by step 2): with TBS > 1, slot n-1 is reserved for max_id when it
    # is selected, so that the valid tokens form the dense range [0, actual_seq).
    reserve = tbs > 1 and max_id in position

    # G5 step 2: keep an id in place when its old slot survives, is complete, and none of
    # its tokens is among this step's newest S positions.
    slot_id: list[int | None] = [None] * n
    pinned = set()
    for v in valid:
        old_j = old_slot.get(v)
        if old_j is None or old_j >= n or old_j == old_tail:
            continue
        if (v + 1) * tbs > kv_len - S:
            continue
        if reserve and (old_j == n - 1 or v == max_id):
            continue
        slot_id[old_j] = v
        pinned.add(v)
    if reserve:
        slot_id[n - 1] = max_id

    # G5 step 4: every other valid id, in topk order, takes the next free slot.
    free = [j for j in range(n) if slot_id[j] is None]
    movers = [v for v in valid if v not in pinned and not (reserve and v == max_id)]
    for j, v in zip(free, movers):  # equally many by construction
        slot_id[j] = v

    # G5 steps 5 and 6: unpinned slots are copied; the status lists the slots' ids.
    status = np.full(K + 1, -1, dtype=np.int32)
    copy = np.zeros(K, dtype=bool)
    actual_seq = 0
    for j, sid in enumerate(slot_id):
        assert sid is not None  # step 4 filled every free slot
        status[j] = sid
        copy[j] = sid not in pinned
        actual_seq += id_size(sid, eff, tbs)
    status[K] = actual_seq
    return RowPlan(status=status, actual_seq=actual_seq, copy=copy, skipped=False)


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
) -> list[RowPlan]:
    """Apply every value rule of docs/SPEC.md G4/G5 (and the decisions of this module).

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

    Returns
    -------
    list of RowPlan
        The plan of every row ``r < B*S`` (``r = b*S + s``), computed from the old status.

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
    tbs, sbs, fbs = meta.tbs, meta.sel_block_size, meta.full_block_size

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

    plans: list[RowPlan] = []
    written = []  # per row: flat selection addresses (block * SBS + offset) written
    for r in range(n_rows):
        b, s = _row_batch(meta, r)
        try:
            plan = plan_row(status[r], topk[r], kv_lens[b], meta.seq, s, tbs)
        except ValueError as exc:
            raise ValueError(f"row {r} (b={b}, s={s}): {exc}") from None
        plans.append(plan)
        if plan.skipped:
            continue
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
                f"ids whose tokens lie in "
                f"the {meta.full_max_block_num} columns of full_kv_block_table",
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
        written.append((r, slot, dst_blk.astype(np.int64) * sbs + dst_q % sbs))

    _check_no_write_collision(written)
    return plans


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
    """The NumPy reference's extra rules (decisions 9 and 13 above).

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
