"""onnx-graphsurgeon helpers that append a pytrt_kv node to a ``gs.Graph``.

Each helper validates shapes, dtypes and attributes at export time with the reference's
own checkers (``check_scatter`` / ``check_gather``), resolves ``cache_layout`` from the
shapes when it is not given, always writes ``plugin_namespace`` and ``plugin_version``,
and returns the node's output tensors (``*_out`` = the updated caches, docs/SPEC.md O).

Example
-------
>>> import numpy as np, onnx_graphsurgeon as gs
>>> from onnx_export.graphsurgeon import add_scatter_pa_kv_cache
>>> g = gs.Graph(opset=17)
>>> key = gs.Variable("key", np.float16, (3, 2, 16))
>>> cache = gs.Variable("key_cache", np.float16, (4, 8, 2, 16))
>>> slots = gs.Variable("slot_mapping", np.int32, (3,))
>>> g.inputs = [key, cache, slots]
>>> (cache_out,) = add_scatter_pa_kv_cache(g, key, None, cache, None, slots)
>>> g.nodes[0].attrs["cache_layout"], cache_out.shape
('nd', [4, 8, 2, 16])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import onnx_graphsurgeon as gs

from pytrt_kv.contract import dtypes, specs
from pytrt_kv.contract.args import op_attributes, op_tensors
from pytrt_kv.graph import schemas  # noqa: F401  (registers the schemas)
from pytrt_kv.graph.check import TensorInfo, dtype_name, validate_node


def tensor_info(arg: str, tensor: Any) -> TensorInfo:
    """TensorInfo of a gs tensor (Variable or Constant); clear error when untyped."""
    if not isinstance(tensor, gs.Tensor):
        raise TypeError(
            f"{arg}: expected an onnx_graphsurgeon Variable or Constant, got "
            f"{type(tensor).__name__}"
        )
    if tensor.dtype is None:
        raise TypeError(
            f"{arg}: expected a tensor with a dtype, got {tensor.name!r} with dtype None"
        )
    shape = (
        None
        if tensor.shape is None
        else tuple(int(d) if isinstance(d, int) else d for d in tensor.shape)
    )
    return TensorInfo(shape, dtype_name(tensor.dtype))


def _unique_name(base: str, taken: set) -> str:
    name, i = base, 1
    while name in taken:
        name = f"{base}_{i}"
        i += 1
    taken.add(name)
    return name


def add_node(
    graph: gs.Graph,
    op_type: str,
    inputs: Mapping[str, gs.Tensor | None],
    attributes: Mapping[str, Any] | None = None,
    *,
    name: str | None = None,
    output_names: Sequence[str] | None = None,
) -> list[gs.Variable]:
    """Append one pytrt_kv node (any op of ``pytrt_kv.specs``) to ``graph``.

    Parameters
    ----------
    graph : gs.Graph
    op_type : str
        ``"ScatterPaKvCache"`` or ``"GatherSelectionKvCache"``.
    inputs : mapping docs/SPEC.md input name -> gs.Tensor or None
    attributes : mapping, optional
        Op attributes (unknown names are refused).
    name : str, optional
        Node name; default: the op type, made unique in the graph.
    output_names : sequence of str, optional
        Names of the output tensors (as many as the node has); default: the docs/SPEC.md output
        names, suffixed when already taken in the graph.

    Returns
    -------
    list of gs.Variable
        The outputs, in docs/SPEC.md order (``value_cache_out`` only with a value input).
    """
    op = specs.get_op(op_type)
    infos = {k: tensor_info(k, v) for k, v in inputs.items() if v is not None}
    node_name = name
    taken_nodes = {n.name for n in graph.nodes}
    if node_name is None:
        node_name = _unique_name(op.name, taken_nodes)
    attrs, outs = validate_node(
        op.name, infos, dict(attributes or {}), where=f"{op.name} node {node_name!r}: "
    )
    if output_names is not None and len(output_names) != len(outs):
        raise ValueError(
            f"output_names: expected {len(outs)} names ({list(outs)}), got {list(output_names)}"
        )
    taken = set(graph.tensors().keys())
    out_vars: list[gs.Variable] = []
    for i, (out_name, info) in enumerate(outs.items()):
        tname = output_names[i] if output_names is not None else _unique_name(out_name, taken)
        out_vars.append(
            gs.Variable(
                tname,
                dtype=dtypes.numpy_dtype(info.dtype),
                shape=list(info.shape) if info.shape is not None else None,
            )
        )
    # ONNX addresses optional inputs by position: absent ones in the middle are empty.
    node_inputs: list[gs.Tensor] = []
    last = max(op.input_index(k) for k in infos)
    for t in op.inputs[: last + 1]:
        node_inputs.append(
            inputs.get(t.name) if inputs.get(t.name) is not None else gs.Variable.empty()
        )
    node = gs.Node(
        op=op.name,
        name=node_name,
        domain=specs.DOMAIN,
        attrs=attrs,
        inputs=node_inputs,
        outputs=out_vars,
    )
    graph.nodes.append(node)
    _import_domain(graph)
    return out_vars


def _import_domain(graph: gs.Graph) -> None:
    from onnx import helper

    domains = list(graph.import_domains or [])
    if not any(d.domain == "" for d in domains):
        domains.append(helper.make_opsetid("", max(graph.opset or 0, specs.ONNX_OPSET)))
    if not any(d.domain == specs.DOMAIN for d in domains):
        domains.append(helper.make_opsetid(specs.DOMAIN, specs.DOMAIN_VERSION))
    graph.import_domains = domains


def _add_op(graph: gs.Graph, op: specs.OpSpec, args: Mapping[str, Any]) -> list[gs.Variable]:
    """:func:`add_node` for ``op`` with its tensors and attributes taken from ``args`` (an
    ``add_*`` function's ``locals()``, whose parameters carry the op's names)."""
    return add_node(
        graph,
        op.name,
        op_tensors(op, args),
        op_attributes(op, args),
        name=args["name"],
        output_names=args["output_names"],
    )


def add_scatter_pa_kv_cache(
    graph: gs.Graph,
    key: gs.Tensor,
    value: gs.Tensor | None,
    key_cache: gs.Tensor,
    value_cache: gs.Tensor | None,
    slot_mapping: gs.Tensor,
    *,
    compress_lens: gs.Tensor | None = None,
    compress_seq_offsets: gs.Tensor | None = None,
    seq_lens: gs.Tensor | None = None,
    cache_layout: str | None = None,
    compress_mode: str | None = None,
    k_scale: gs.Tensor | None = None,
    v_scale: gs.Tensor | None = None,
    alias_io: int = 1,
    name: str | None = None,
    output_names: Sequence[str] | None = None,
) -> list[gs.Variable]:
    """Append a ScatterPaKvCache node (docs/SPEC.md S, O); arguments as in the reference.

    Parameters
    ----------
    key : [T, H, Dk] or [B, Smax, H, Dk]
    value : [T, H, Dv] or [B, Smax, H, Dv], or None (key-only write)
    key_cache, value_cache : the paged caches (docs/SPEC.md S2 shapes); value_cache None
        exactly when value is None
    slot_mapping : [T] or [B, H], int32 or int64
    compress_lens, compress_seq_offsets, seq_lens : 4-D key only
    cache_layout : "nd" | "nz" | "hnd", optional
        Detected from the shapes when not given, also when only T (key, value,
        slot_mapping dim 0) and NB (cache dim 0) are dynamic; required when another dim
        is dynamic or the shapes fit several layouts (the error says so).
    compress_mode : "rope" | "omni" | "alibi", optional
    k_scale, v_scale : float32 [] or [H], optional
        Quantise key / value on write into a float8_e4m3fn or int8 cache (docs/SPEC.md S9).
    alias_io : 0 or 1

    Returns
    -------
    [key_cache_out] or [key_cache_out, value_cache_out]
    """
    return _add_op(graph, specs.SCATTER_PA_KV_CACHE, locals())


def add_gather_selection_kv_cache(
    graph: gs.Graph,
    selection_k_rope: gs.Tensor,
    selection_kv_cache: gs.Tensor,
    selection_kv_block_table: gs.Tensor,
    selection_kv_block_status: gs.Tensor,
    selection_topk_indices: gs.Tensor,
    full_k_rope: gs.Tensor,
    full_kv_cache: gs.Tensor,
    full_kv_block_table: gs.Tensor,
    full_kv_actual_seq: gs.Tensor,
    full_q_actual_seq: gs.Tensor,
    *,
    selection_topk_block_size: int = 64,
    alias_io: int = 1,
    name: str | None = None,
    output_names: Sequence[str] | None = None,
) -> list[gs.Variable]:
    """Append a GatherSelectionKvCache node (docs/SPEC.md G, O); tensors as in docs/SPEC.md G2.

    Returns
    -------
    [selection_k_rope_out, selection_kv_cache_out, selection_kv_block_status_out,
     selection_kv_actual_seq]
        The first three are the updated inputs; the last is int32 ``[R]``.
    """
    return _add_op(graph, specs.GATHER_SELECTION_KV_CACHE, locals())


def export_model(graph: gs.Graph, *, check: bool = True):
    """``gs.export_onnx`` with the pytrt_kv conventions: IR 10, opset >= 17 plus
    ``pytrt_kv`` 1, and ``onnx.checker`` with ``full_check=True``.

    Returns
    -------
    onnx.ModelProto
    """
    import onnx

    from .models import finalize_model

    if graph.opset is None or graph.opset < specs.ONNX_OPSET:
        graph.opset = specs.ONNX_OPSET
    _import_domain(graph)
    model = gs.export_onnx(graph, do_type_check=True)
    return finalize_model(model, check=check) if isinstance(model, onnx.ModelProto) else model
