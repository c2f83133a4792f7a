"""The block-transfer contract in one place: argument checks (docs/SPEC.md D4), the
transfer plan every backend executes (D2, D3) and the NumPy reference
:func:`push_kv_blocks_reference` the backends are tested against.

Both backends and the reference call :func:`check_transfer`; nothing moves before it
has accepted the whole call, so a refused call transfers nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..contract.errors import describe
from .types import CacheDesc, KvCacheExtParam, LLMRole, param_invalid


@dataclass(frozen=True)
class TransferPlan:
    """What a checked transfer moves (docs/SPEC.md D3).

    Attributes
    ----------
    src_tensors, dst_tensors : tuple of int, length U
        Tensor ``src_tensors[u]`` of the source goes to ``dst_tensors[u]`` of the destination.
    src_blocks, dst_blocks : int64 array [N]
    block_bytes : int
    """

    src_tensors: tuple[int, ...]
    dst_tensors: tuple[int, ...]
    src_blocks: np.ndarray
    dst_blocks: np.ndarray
    block_bytes: int
    #: descriptor_indices' results by (src_nb, dst_nb): a plan reused for a repeated
    #: request (LlmDataDist's plan cache) computes them once.
    _indices: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_copies(self) -> int:
        """Blocks copied: U * N."""
        return len(self.src_tensors) * len(self.src_blocks)

    @property
    def nbytes(self) -> int:
        return self.num_copies * self.block_bytes

    def descriptor_indices(self, src_nb: int, dst_nb: int) -> tuple[np.ndarray, np.ndarray]:
        """Indices into per-cache descriptor lists whose entry ``t * NB + b`` is block ``b``
        of tensor ``t``: int32 arrays [U * N], tensor-major, so that consecutive blocks stay
        adjacent (NIXL merges descriptors adjacent on both sides into one). Computed once
        per plan and shape; callers must not modify them."""
        done = self._indices.get((src_nb, dst_nb))
        if done is not None:
            return done
        st = np.asarray(self.src_tensors, np.int64)[:, None]
        dt = np.asarray(self.dst_tensors, np.int64)[:, None]
        src = (st * src_nb + self.src_blocks[None, :]).reshape(-1)
        dst = (dt * dst_nb + self.dst_blocks[None, :]).reshape(-1)
        done = (src.astype(np.int32), dst.astype(np.int32))
        for a in done:
            a.flags.writeable = False
        self._indices[src_nb, dst_nb] = done
        return done

    def runs(self) -> list[tuple[int, int, int, int, int]]:
        """Maximal runs ``(src_tensor, dst_tensor, src_block, dst_block, count)`` of blocks
        consecutive on both sides, in plan order: the fewest copies that move the plan."""
        out: list[tuple[int, int, int, int, int]] = []
        n = len(self.src_blocks)
        if n == 0:
            return out
        s, d = self.src_blocks, self.dst_blocks
        breaks = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
        starts = np.concatenate(([0], breaks))
        ends = np.concatenate((breaks, [n]))
        for st, dt in zip(self.src_tensors, self.dst_tensors):
            for a, b in zip(starts.tolist(), ends.tolist()):
                out.append((st, dt, int(s[a]), int(d[a]), b - a))
        return out


def _layer_tensors(arg: str, layer_range: Any, num_tensors: int, tnpl: int) -> tuple[int, ...]:
    """Tensors ``[first*tnpl, (second+1)*tnpl)`` of a layer range checked against its own
    side (docs/SPEC.md D2, D4)."""
    max_layer = num_tensors // tnpl - 1
    try:
        first, second = (int(v) for v in layer_range)
        if any(isinstance(v, bool) or float(v) != int(v) for v in layer_range):
            raise ValueError
    except (TypeError, ValueError):
        raise param_invalid(arg, "a pair of ints (first, second)", repr(layer_range)) from None
    if (first, second) == (-1, -1):
        return tuple(range(num_tensors))
    if not 0 <= first <= second <= max_layer:
        raise param_invalid(
            arg,
            f"(-1, -1) or 0 <= first <= second <= max layer {max_layer} "
            f"(num_tensors {num_tensors} / tensor_num_per_layer {tnpl} - 1)",
            (first, second),
        )
    return tuple(range(first * tnpl, (second + 1) * tnpl))


def _block_ids(arg: str, blocks: Any, nb: int) -> np.ndarray:
    if isinstance(blocks, (str, bytes)) or not hasattr(blocks, "__len__"):
        raise param_invalid(arg, "a sequence of block ids", describe(blocks))
    a = np.asarray(blocks)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        if a.size == 0 and a.ndim == 1:
            return np.zeros(0, np.int64)
        raise param_invalid(
            arg, "a 1-D sequence of int block ids", f"{a.dtype} array of shape {list(a.shape)}"
        )
    a = a.astype(np.int64)
    if a.size and (a.min() < 0 or a.max() >= nb):  # two reductions: cheap for small pushes
        i = int(np.flatnonzero((a < 0) | (a >= nb))[0])
        raise param_invalid(f"{arg}[{i}]", f"a block id in [0, {nb}) (NB of its cache)", int(a[i]))
    return a


def check_transfer(
    src: CacheDesc,
    dst: CacheDesc,
    src_blocks: Any,
    dst_blocks: Any,
    ext_param: KvCacheExtParam | None = None,
    *,
    op: str = "push",
    role: LLMRole | None = None,
) -> TransferPlan:
    """Check one push/pull against docs/SPEC.md D4 and return its plan.

    Parameters
    ----------
    src, dst : CacheDesc
        The source and destination caches (local or remote, whichever the op makes them).
    src_blocks, dst_blocks : sequence of int, length N
    ext_param : KvCacheExtParam or None (defaults)
    op : {"push", "pull"}
    role : LLMRole or None
        The caller's role; None skips the role rule (the reference has no role).

    Raises
    ------
    LLMParamInvalid
        Naming the argument, what was expected and what came.
    """
    if role is not None:
        need = LLMRole.PROMPT if op == "push" else LLMRole.DECODER
        if role is not need:
            raise param_invalid(
                "role",
                f"{op} only from a {need.value} node (docs/SPEC.md D4)",
                f"a {role.value} node",
            )
    ext = KvCacheExtParam() if ext_param is None else ext_param
    if not isinstance(ext, KvCacheExtParam):
        raise param_invalid("ext_param", "a KvCacheExtParam", describe(ext))
    tnpl = ext.tensor_num_per_layer
    if isinstance(tnpl, bool) or not isinstance(tnpl, (int, np.integer)) or tnpl < 1:
        raise param_invalid("ext_param.tensor_num_per_layer", "an int >= 1", repr(tnpl))
    tnpl = int(tnpl)
    # Always, also with both ranges (-1, -1) (docs/SPEC.md D4): a 1-tensor cache is
    # pushed with KvCacheExtParam(tensor_num_per_layer=1).
    for side, desc in (("source", src), ("destination", dst)):
        if not 1 <= tnpl <= desc.num_tensors or desc.num_tensors % tnpl:
            raise param_invalid(
                "ext_param.tensor_num_per_layer",
                f"a divisor of the {side} cache's num_tensors "
                f"{desc.num_tensors} in [1, {desc.num_tensors}]",
                tnpl,
            )
    st = _layer_tensors("ext_param.src_layer_range", ext.src_layer_range, src.num_tensors, tnpl)
    dt = _layer_tensors("ext_param.dst_layer_range", ext.dst_layer_range, dst.num_tensors, tnpl)
    if len(st) != len(dt):
        raise param_invalid(
            "ext_param.dst_layer_range",
            f"as many layers as src_layer_range ({len(st) // tnpl})",
            f"{len(dt) // tnpl} layers",
        )
    sb = _block_ids("src_blocks", src_blocks, src.num_blocks)
    db = _block_ids("dst_blocks", dst_blocks, dst.num_blocks)
    if len(sb) != len(db):
        raise param_invalid("dst_blocks", f"as many ids as src_blocks ({len(sb)})", len(db))
    # Small pushes (layer-wise, decode-sized): a set of <= 64 ids beats bincount's O(NB).
    distinct = len(db) <= 64 and len(set(db.tolist())) == len(db)
    counts = np.zeros(1, np.int64) if distinct or not len(db) else np.bincount(db)
    if counts.max() > 1:  # ids in range here; bincount is O(N + max id), np.unique sorts
        raise param_invalid(
            "dst_blocks",
            "distinct destination block ids",
            f"block {int(np.argmax(counts > 1))} more than once",
        )
    if src.data_type != dst.data_type:
        raise param_invalid("dst cache data_type", f"the source's {src.data_type}", dst.data_type)
    if src.block_bytes != dst.block_bytes:
        raise param_invalid(
            "dst cache block_bytes",
            f"the source's {src.block_bytes} (shape {list(src.shape)})",
            f"{dst.block_bytes} (shape {list(dst.shape)})",
        )
    return TransferPlan(st, dt, sb, db, src.block_bytes)


def desc_of_arrays(arg: str, tensors: Sequence[Any], placement: str = "host") -> CacheDesc:
    """The :class:`CacheDesc` of equal-shaped, equal-dtype NumPy arrays (the reference's
    caches)."""
    if isinstance(tensors, np.ndarray) or not isinstance(tensors, (list, tuple)) or not tensors:
        raise TypeError(
            f"{arg}: expected a non-empty list of NumPy arrays, got {describe(tensors)}"
        )
    first = tensors[0]
    for i, t in enumerate(tensors):
        if not isinstance(t, np.ndarray):
            raise TypeError(f"{arg}[{i}]: expected a NumPy array, got {describe(t)}")
        if t.shape != first.shape or t.dtype != first.dtype:
            raise ValueError(
                f"{arg}[{i}]: expected {describe(first)} like {arg}[0], got {describe(t)}"
            )
    return CacheDesc(len(tensors), first.shape, first.dtype, placement)


def push_kv_blocks_reference(
    src_cache: Sequence[np.ndarray],
    dst_cache: Sequence[np.ndarray],
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    ext_param: KvCacheExtParam | None = None,
) -> list[np.ndarray]:
    """NumPy reference of PushKvBlocks (docs/SPEC.md D2-D4): the destination after the push.

    Parameters
    ----------
    src_cache : list of num_tensors arrays [NB_src, ...]
    dst_cache : list of num_tensors' arrays [NB_dst, ...] (same dtype and block size)
    src_blocks, dst_blocks : sequence of int, length N
    ext_param : KvCacheExtParam, optional

    Returns
    -------
    list of arrays
        Copies of ``dst_cache`` with, for each i and tensor offset u,
        ``out[dst_first*tnpl + u][dst_blocks[i]] = src_cache[src_first*tnpl + u][src_blocks[i]]``.
        The inputs are not modified.

    Raises
    ------
    LLMParamInvalid
        As the backends do (docs/SPEC.md D4; no role rule here).

    Examples
    --------
    The API page's own example: 4 int32 tensors [4, 16], layer 3 with one tensor per layer,
    blocks 0..3 reversed:

    >>> import numpy as np
    >>> src = [np.arange(64, dtype=np.int32).reshape(4, 16) + 100 * t for t in range(4)]
    >>> dst = [np.full((4, 16), -1, np.int32) for _ in range(4)]
    >>> out = push_kv_blocks_reference(src, dst, [0, 1, 2, 3], [3, 2, 1, 0],
    ...                                KvCacheExtParam((3, 3), (3, 3), 1))
    >>> bool((out[3][::-1] == src[3]).all()), bool((out[2] == -1).all())
    (True, True)
    """
    sd = desc_of_arrays("src_cache", src_cache)
    dd = desc_of_arrays("dst_cache", dst_cache)
    plan = check_transfer(sd, dd, src_blocks, dst_blocks, ext_param)
    out = [t.copy() for t in dst_cache]
    row = dd.shape[1:]  # a block is bytes: equal block_bytes, the shapes may differ
    for s, d in zip(plan.src_tensors, plan.dst_tensors):
        for sb, db in zip(plan.src_blocks.tolist(), plan.dst_blocks.tolist()):
            out[d][db] = src_cache[s][sb].reshape(row)
    return out
