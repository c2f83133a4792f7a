"""The two ops as ONNX Runtime kernels: one :class:`_capi.CustomOp` per ``pytrt_kv`` node
signature, computing with the NumPy reference straight into ONNX Runtime's output buffers.

Semantics are the CPU runtime's (:mod:`pytrt_kv.graph.runtime`): each ``*_out`` is a copy
of its cache input updated by the reference (ONNX Runtime never lets a kernel write a
graph input), absent optional inputs and the placeholders of prepared models are read
the same way, and a refusal is the reference's ValueError/TypeError with the same
``node 'n' (Op): argument (graph tensor 't'): ...`` prefix.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import onnx

from ..contract import dtypes, specs
from ..graph.runtime import _absent_placeholders, _attrs, _named, gather_node, scatter_node
from . import _capi

#: ONNX type of an absent optional input's slot (ONNX Runtime never checks it).
_ANY: int = onnx.TensorProto.FLOAT


def _node_attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _fresh(out: np.ndarray | None, src: np.ndarray, what: str) -> np.ndarray:
    if out is None:
        raise RuntimeError(f"onnxruntime gave no buffer for {what}")
    np.copyto(out, src, casting="no")
    return out


def _scatter(node: onnx.NodeProto):
    op = specs.SCATTER_PA_KV_CACHE
    attrs = _attrs(op, _node_attrs(node))

    def compute(api: _capi.OrtApi, context: int) -> None:
        x: dict[str, Any] = _named(
            op, [api.input(context, i) for i in range(api.input_count(context))]
        )
        placeholders = _absent_placeholders(x)
        key_cache, value_cache = x["key_cache"], x["value_cache"]
        assert key_cache is not None  # a required input
        n_out = api.output_count(context)
        key_out = _fresh(api.output(context, 0, key_cache.shape), key_cache, "key_cache_out")
        value_out = None
        if value_cache is not None:
            value_out = _fresh(
                api.output(context, 1, value_cache.shape), value_cache, "value_cache_out"
            )
        scatter_node(node, x, attrs, key_out, value_out)
        if value_out is None and n_out > 1 and "value_cache" in placeholders:
            ph = placeholders["value_cache"]
            out = api.output(context, 1, ph.shape)
            if out is not None:
                np.copyto(out, ph, casting="no")

    return compute


def _gather(node: onnx.NodeProto):
    op = specs.GATHER_SELECTION_KV_CACHE
    attrs = _attrs(op, _node_attrs(node))

    def compute(api: _capi.OrtApi, context: int) -> None:
        x: dict[str, Any] = _named(
            op, [api.input(context, i) for i in range(api.input_count(context))]
        )
        k_rope, kv, status = (
            x["selection_k_rope"],
            x["selection_kv_cache"],
            x["selection_kv_block_status"],
        )
        assert k_rope is not None and kv is not None and status is not None  # required
        k_rope_out = _fresh(api.output(context, 0, k_rope.shape), k_rope, "selection_k_rope_out")
        kv_out = _fresh(api.output(context, 1, kv.shape), kv, "selection_kv_cache_out")
        status_out = _fresh(
            api.output(context, 2, status.shape), status, "selection_kv_block_status_out"
        )
        actual = gather_node(node, x, attrs, k_rope_out, kv_out, status_out)
        out = api.output(context, 3, actual.shape)
        if out is not None:
            np.copyto(out, actual, casting="no")

    return compute


def _types(op: specs.OpSpec, node: onnx.NodeProto, types: dict[str, int]):
    """ONNX types of the op's inputs and outputs for this node (absent ones: any)."""
    where = f"node {node.name or '<unnamed>'!r} ({node.op_type}): "
    ins: list[int] = []
    for i, spec in enumerate(op.inputs):
        name = node.input[i] if i < len(node.input) else ""
        if not name:
            ins.append(_ANY)
            continue
        if not types.get(name):
            raise ValueError(
                f"{where}{spec.name} (graph tensor {name!r}): expected a known element type "
                f"(a graph input, initializer or inferable tensor), got none"
            )
        ins.append(types[name])
    outs: list[int] = []
    for spec in op.outputs:
        src = op.aliases.get(spec.name)
        outs.append(ins[op.input_index(src)] if src else dtypes.ONNX[specs.INT32])
    return ins, outs


def custom_op(node: onnx.NodeProto, types: dict[str, int]) -> _capi.CustomOp:
    """The ONNX Runtime op that runs ``node`` (a validated ``pytrt_kv`` node) whose
    tensors have the element ``types`` (name -> ONNX type); same node and types give
    the same op name, so a model loaded twice registers nothing new."""
    op = specs.OPS[node.op_type]
    ins, outs = _types(op, node, types)
    key = hashlib.sha256(node.SerializeToString(deterministic=True) + bytes(ins)).hexdigest()
    name = f"PytrtKv{op.name}_{key[:20]}"
    compute = _scatter(node) if op is specs.SCATTER_PA_KV_CACHE else _gather(node)
    return _capi.CustomOp(
        name,
        ins,
        outs,
        {i for i, t in enumerate(op.inputs) if t.optional},
        {i for i, t in enumerate(op.outputs) if t.optional},
        compute,
    )
