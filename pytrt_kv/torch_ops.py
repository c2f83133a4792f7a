"""``torch.ops.pytrt_kv``: both ops as torch custom ops that write their caches in place
(docs/GRAPH_MODE.md, "torch.compile").

Importing this module registers, with ``torch.library.custom_op``:

- ``torch.ops.pytrt_kv.scatter_pa_kv_cache_(key, value, key_cache, value_cache,
  slot_mapping, compress_lens, compress_seq_offsets, seq_lens, cache_layout,
  compress_mode, k_scale, v_scale) -> None``, mutating ``key_cache`` and ``value_cache``
  (docs/SPEC.md S);
- ``torch.ops.pytrt_kv.gather_selection_kv_cache_(selection_k_rope, selection_kv_cache,
  selection_kv_block_table, selection_kv_block_status, selection_topk_indices,
  full_k_rope, full_kv_cache, full_kv_block_table, full_kv_actual_seq,
  full_q_actual_seq, selection_topk_block_size) -> Tensor``, mutating the two selection
  caches and the status, returning ``selection_kv_actual_seq`` int32 ``[R]``
  (docs/SPEC.md G).

CPU tensors run the NumPy reference on views of their memory (so the caches are written
in place, bfloat16/float8 included); CUDA tensors run the kernels of :mod:`pytrt_kv.ops`.
The fake (meta) implementations give shapes to ``torch.compile`` and ``torch.export``:
because the ops declare what they mutate, ``torch.compile(fullgraph=True)`` keeps them in
the graph (no graph break) and the caches are updated in place. Refusals are the
reference's (CPU) or :mod:`pytrt_kv.ops`'s (CUDA) ValueError/TypeError.

Example
-------
>>> import torch, pytrt_kv.torch_ops
>>> key, cache = torch.full((2, 1, 8), 3.0), torch.zeros(2, 4, 1, 8)
>>> torch.ops.pytrt_kv.scatter_pa_kv_cache_(key, None, cache, None,
...     torch.tensor([5, 0], dtype=torch.int32))
>>> float(cache[1, 1, 0, 0])
3.0
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .contract import dtypes, specs
from .contract.args import op_tensors
from .reference import gather_selection_kv_cache as _ref_gather
from .reference import scatter_pa_kv_cache as _ref_scatter

__all__ = ["scatter_pa_kv_cache_", "gather_selection_kv_cache_", "as_numpy"]

#: torch dtypes NumPy cannot view directly -> (same-width integer view, dtype name).
_VIEWS = {
    torch.bfloat16: (torch.int16, specs.BFLOAT16),
    torch.float8_e4m3fn: (torch.uint8, specs.FLOAT8_E4M3),
    torch.float8_e5m2: (torch.uint8, specs.FLOAT8_E5M2),
}


def as_numpy(t: torch.Tensor | None, name: str) -> np.ndarray | None:
    """A NumPy view of a CPU tensor's memory (writes go to the tensor), bfloat16 and
    float8 as their ml_dtypes dtype; None stays None."""
    if t is None:
        return None
    if t.device.type != "cpu":
        raise ValueError(f"{name}: expected a CPU tensor here, got one on {t.device}")
    if t.dtype in _VIEWS:
        raw, dtype_name = _VIEWS[t.dtype]
        return t.detach().view(raw).numpy().view(dtypes.NUMPY[dtype_name])
    return t.detach().numpy()


def _all_cuda(*tensors: torch.Tensor | None) -> bool:
    return any(t is not None and t.device.type == "cuda" for t in tensors)


@torch.library.custom_op(
    "pytrt_kv::scatter_pa_kv_cache_", mutates_args=("key_cache", "value_cache")
)
def scatter_pa_kv_cache_(
    key: torch.Tensor,
    value: torch.Tensor | None,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    compress_lens: torch.Tensor | None = None,
    compress_seq_offsets: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    cache_layout: str | None = None,
    compress_mode: str | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """ScatterPaKvCache in place (docs/SPEC.md S); arguments as
    :func:`pytrt_kv.reference.scatter_pa_kv_cache`."""
    named: dict[str, Any] = op_tensors(specs.SCATTER_PA_KV_CACHE, locals())
    if _all_cuda(*named.values()):
        from . import ops

        ops.scatter_pa_kv_cache(**named, cache_layout=cache_layout, compress_mode=compress_mode)
        return
    x: dict[str, Any] = {k: as_numpy(v, k) for k, v in named.items()}
    _ref_scatter(
        x.pop("key"),
        x.pop("value"),
        x.pop("key_cache"),
        x.pop("value_cache"),
        x.pop("slot_mapping"),
        cache_layout=cache_layout,
        compress_mode=compress_mode,
        **x,
    )


@scatter_pa_kv_cache_.register_fake
def _scatter_fake(key, value, key_cache, value_cache, slot_mapping, *args, **kwargs) -> None:
    return None


@torch.library.custom_op(
    "pytrt_kv::gather_selection_kv_cache_",
    mutates_args=("selection_k_rope", "selection_kv_cache", "selection_kv_block_status"),
)
def gather_selection_kv_cache_(
    selection_k_rope: torch.Tensor,
    selection_kv_cache: torch.Tensor,
    selection_kv_block_table: torch.Tensor,
    selection_kv_block_status: torch.Tensor,
    selection_topk_indices: torch.Tensor,
    full_k_rope: torch.Tensor,
    full_kv_cache: torch.Tensor,
    full_kv_block_table: torch.Tensor,
    full_kv_actual_seq: torch.Tensor,
    full_q_actual_seq: torch.Tensor,
    selection_topk_block_size: int = 64,
) -> torch.Tensor:
    """GatherSelectionKvCache in place (docs/SPEC.md G); returns selection_kv_actual_seq
    int32 ``[R]``. Arguments as :func:`pytrt_kv.reference.gather_selection_kv_cache`."""
    named = op_tensors(specs.GATHER_SELECTION_KV_CACHE, locals())
    args = list(named.values())
    if _all_cuda(*args):
        from . import ops

        return ops.gather_selection_kv_cache(
            *args, selection_topk_block_size=selection_topk_block_size
        )
    arrays: list[Any] = [as_numpy(t, n) for n, t in named.items()]
    actual = _ref_gather(
        *arrays,
        selection_topk_block_size=selection_topk_block_size,
    )
    return torch.from_numpy(np.ascontiguousarray(actual, dtype=np.int32))


@gather_selection_kv_cache_.register_fake
def _gather_fake(selection_k_rope, selection_kv_cache, selection_kv_block_table, *args, **kw):
    return selection_kv_block_table.new_empty((selection_kv_block_table.shape[0],))
