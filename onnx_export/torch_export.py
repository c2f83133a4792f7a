"""Use the pytrt_kv ops inside ``nn.Module.forward`` and export with torch.onnx (dynamo).

Each function is functional (returns the updated caches, docs/SPEC.md O): during
``torch.onnx.export(..., dynamo=True)`` it becomes one ``pytrt_kv`` node through
``torch.onnx.ops.symbolic_multi_out`` (validated at export time with the same rules as
the reference); in eager mode it runs the NumPy reference on CPU copies, so the module
also runs (slowly) without TensorRT.

torch is optional: it is imported when a function is called, with a clear error when it
is missing.

Example
-------
>>> import torch
>>> from onnx_export import torch_export as pk
>>> class Write(torch.nn.Module):
...     def forward(self, key, key_cache, slot_mapping):
...         (key_cache_out,) = pk.scatter_pa_kv_cache(key, None, key_cache, None, slot_mapping)
...         return key_cache_out
>>> args = (torch.ones(2, 1, 8), torch.zeros(2, 4, 1, 8), torch.tensor([5, 0], dtype=torch.int32))
>>> prog = torch.onnx.export(Write(), args, dynamo=True)            # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

from pytrt_kv.contract import dtypes, specs
from pytrt_kv.contract.args import op_attributes, op_tensors
from pytrt_kv.graph import schemas  # noqa: F401  (registers the schemas)
from pytrt_kv.graph.check import TensorInfo, validate_node
from pytrt_kv.info import install_command


def _torch():
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - exercised only without torch
        raise ImportError(
            "onnx_export.torch_export needs torch (>= 2.13) and onnxscript: "
            f"{install_command('torch')}"
        ) from exc
    return torch


def _info(name: str, t: Any) -> TensorInfo:
    torch = _torch()
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    shape = tuple(int(d) if isinstance(d, int) else None for d in t.shape)
    return TensorInfo(shape, dtypes.name_of(t.dtype))


def _to_numpy(t):
    import numpy as np

    torch = _torch()
    # Always a copy: the eager path runs the in-place reference on the result, and the
    # caller's tensors must stay untouched (functional semantics).
    t = t.detach().cpu().contiguous()
    name = dtypes.name_of(t.dtype)
    if name in (specs.BFLOAT16, specs.FLOAT8_E4M3, specs.FLOAT8_E5M2):
        # torch cannot hand these to NumPy directly: move the bytes.
        raw = t.view(torch.int16 if name == specs.BFLOAT16 else torch.uint8).numpy()
        return raw.view(dtypes.numpy_dtype(name)).copy()
    return np.array(t.numpy())


def _from_numpy(a, like):
    torch = _torch()
    name = dtypes.name_of(a.dtype)
    if name in (specs.BFLOAT16, specs.FLOAT8_E4M3, specs.FLOAT8_E5M2):
        raw = torch.from_numpy(a.view("int16" if name == specs.BFLOAT16 else "uint8").copy())
        return raw.view(getattr(torch, name)).to(like.device)
    return torch.from_numpy(a.copy()).to(like.device)


def _call(op: specs.OpSpec, tensors: dict[str, Any], attributes: dict[str, Any]) -> tuple:
    torch = _torch()
    infos = {k: _info(k, v) for k, v in tensors.items() if v is not None}
    attrs, outs = validate_node(op.name, infos, attributes, where=f"{op.name}: ")
    if torch.onnx.is_in_onnx_export():
        last = max(op.input_index(k) for k in infos)
        inputs: list[Any | None] = [tensors.get(t.name) for t in op.inputs[: last + 1]]
        out_dtypes = [getattr(torch, info.dtype) for info in outs.values()]
        out_shapes = []
        for name in outs:
            src = op.aliases.get(name)
            # Reuse the input's (possibly symbolic) shape so dynamic dims survive.
            out_shapes.append(
                list(tensors[src].shape) if src else [tensors["selection_kv_block_table"].shape[0]]
            )
        return tuple(
            torch.onnx.ops.symbolic_multi_out(
                f"{specs.DOMAIN}::{op.name}",
                inputs,
                attrs,
                dtypes=out_dtypes,
                shapes=out_shapes,
                version=specs.DOMAIN_VERSION,
            )
        )
    return _eager(op, tensors, attrs, outs)


def _eager(op, tensors, attrs, outs) -> tuple:
    import numpy as np

    from pytrt_kv.reference import gather_selection_kv_cache, scatter_pa_kv_cache

    x = {k: (None if v is None else _to_numpy(v)) for k, v in tensors.items()}
    if op is specs.SCATTER_PA_KV_CACHE:
        scatter_pa_kv_cache(
            x["key"],
            x["value"],
            x["key_cache"],
            x["value_cache"],
            x["slot_mapping"],
            compress_lens=x["compress_lens"],
            compress_seq_offsets=x["compress_seq_offsets"],
            seq_lens=x["seq_lens"],
            cache_layout=attrs.get("cache_layout"),
            compress_mode=attrs.get("compress_mode"),
            k_scale=x["k_scale"],
            v_scale=x["v_scale"],
        )
        res = [x["key_cache"]] + ([x["value_cache"]] if x["value_cache"] is not None else [])
        like = [tensors["key_cache"], tensors["value_cache"]]
    else:
        actual = gather_selection_kv_cache(
            *(x[n] for n in op.input_names),
            selection_topk_block_size=attrs["selection_topk_block_size"],
        )
        res = [
            x["selection_k_rope"],
            x["selection_kv_cache"],
            x["selection_kv_block_status"],
            np.asarray(actual, np.int32),
        ]
        like = [tensors["selection_kv_cache"]] * 4
    return tuple(_from_numpy(a, t) for a, t in zip(res, like))


def scatter_pa_kv_cache(
    key,
    value,
    key_cache,
    value_cache,
    slot_mapping,
    *,
    compress_lens=None,
    compress_seq_offsets=None,
    seq_lens=None,
    cache_layout: str | None = None,
    compress_mode: str | None = None,
    k_scale=None,
    v_scale=None,
    alias_io: int = 1,
) -> tuple:
    """ScatterPaKvCache (docs/SPEC.md S) as a functional torch op.

    Tensors as in the reference (``value``/``value_cache`` may be None; ``k_scale`` /
    ``v_scale`` quantise on write, docs/SPEC.md S9). ``cache_layout`` is resolved from the
    shapes when omitted (it must be given when dims are dynamic).

    Returns
    -------
    (key_cache_out,) or (key_cache_out, value_cache_out)
        New tensors; the inputs are not modified.
    """
    op = specs.SCATTER_PA_KV_CACHE
    return _call(op, op_tensors(op, locals()), op_attributes(op, locals()))


def gather_selection_kv_cache(
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
    *,
    selection_topk_block_size: int = 64,
    alias_io: int = 1,
) -> tuple:
    """GatherSelectionKvCache (docs/SPEC.md G) as a functional torch op.

    Returns
    -------
    (selection_k_rope_out, selection_kv_cache_out, selection_kv_block_status_out,
     selection_kv_actual_seq)
        The first three are updated copies of their inputs; the last is int32 ``[R]``.
    """
    op = specs.GATHER_SELECTION_KV_CACHE
    return _call(op, op_tensors(op, locals()), op_attributes(op, locals()))
