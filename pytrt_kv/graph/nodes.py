"""Checks of one ``pytrt_kv`` node of a model and of the model's declarations, which
:func:`pytrt_kv.graph.lint.check_model` (the one place deciding validity) combines
(docs/GRAPH_MODE.md, "Model checks").

What ``onnx.checker`` with full shape inference refuses is refused here too, as a
ValueError or TypeError ``"node 'n' (Op): <argument>: expected ..., got ..."`` instead of
the bare RuntimeError of ``onnx.reference`` or a model that runs although its
declarations contradict it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import onnx
from onnx import helper

from ..contract import dtypes, specs
from .check import TensorInfo, check_attributes, check_token_dims
from .rules import ruled

#: A tensor's (ONNX elem type, shape): dims are ints, names (str) or None; shape None
#: when even the rank is unknown.
Type = tuple[int, tuple[Any, ...] | None]


def node_where(node: onnx.NodeProto) -> str:
    """Prefix of every message about ``node``."""
    return f"node {node.name or '<unnamed>'!r} ({node.op_type}): "


def declared_types(model: onnx.ModelProto) -> dict[str, Type]:
    """name -> :data:`Type` for graph inputs, value_info and initializers (not the graph
    outputs: those are the declarations :func:`check_output_declarations` checks)."""
    out: dict[str, Type] = {}
    for vi in list(model.graph.input) + list(model.graph.value_info):
        if vi.type.HasField("tensor_type"):
            out[vi.name] = type_of(vi.type)
    for init in model.graph.initializer:
        out[init.name] = (init.data_type, tuple(init.dims))
    return out


def type_of(tp: onnx.TypeProto) -> Type:
    """(elem type, dims) of a tensor TypeProto (dims: int, name or None)."""
    tt = tp.tensor_type
    if not tt.HasField("shape"):
        return tt.elem_type, None
    dims = tuple(
        d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim
    )
    return tt.elem_type, dims


def describe(t: Type) -> str:
    """``float32[2, T, 8]``: dtype name and dims (``?`` unknown)."""
    elem, shape = t
    name = dtypes.ONNX_TO_NAME.get(elem)
    if name is None:
        name = onnx.TensorProto.DataType.Name(elem).lower() if elem else "?"
    dims = "..." if shape is None else ", ".join("?" if d is None else str(d) for d in shape)
    return f"{name}[{dims}]"


def validate_node(node: onnx.NodeProto, types: Mapping[str, Type] | None = None) -> dict[str, Any]:
    """Check one ``pytrt_kv`` node against its schema, with the rules of the TensorRT
    plugin creators; return its attributes with defaults filled in.

    Checked: a known op type; every attribute known, given once, of its declared type
    (INT or STRING) and allowed value; ``plugin_namespace``/``plugin_version`` present (the
    TensorRT ONNX parser reads them) with their values; no more inputs and outputs than
    the op has, every required input and output named (the output of an input that
    ``types`` shows to have no elements may stay unnamed: nothing is updated); a
    ScatterPaKvCache has both or neither of value and value_cache, with a value cache
    also names ``value_cache_out`` (else that update would be lost), without one none;
    no input updated in place is also fed to another input of the node
    (docs/SPEC.md O), unless ``types`` shows it has no elements.

    Raises
    ------
    ValueError
        Unknown op type or attribute, repeated or missing attribute, bad value, wrong
        counts, a tensor fed twice.
    TypeError
        An attribute of the wrong type (e.g. a float ``selection_topk_block_size``).
    """
    where = node_where(node)
    if node.op_type not in specs.OPS:
        raise ruled(
            "schema.op",
            ValueError(
                f"{where}op_type: expected one of {sorted(specs.OPS)} in domain "
                f"{specs.DOMAIN!r}, got {node.op_type!r}"
            ),
        )
    op = specs.OPS[node.op_type]
    attrs: dict[str, Any] = {}
    for a in node.attribute:
        if a.name in attrs:
            raise ruled(
                "schema.attribute",
                ValueError(f"{where}attribute {a.name!r}: expected once, got it repeated"),
            )
        spec = next((x for x in op.attributes if x.name == a.name), None)
        want = (
            onnx.AttributeProto.INT
            if spec is not None and spec.type == "int"
            else onnx.AttributeProto.STRING
        )
        if (spec is not None or a.name in specs.PLUGIN_NODE_ATTRIBUTES) and a.type != want:
            raise ruled(
                "schema.attribute",
                TypeError(
                    f"{where}attribute {a.name!r}: expected "
                    f"{onnx.AttributeProto.AttributeType.Name(want)}, got "
                    f"{onnx.AttributeProto.AttributeType.Name(a.type)} "
                    f"{helper.get_attribute_value(a)!r}"
                ),
            )
        attrs[a.name] = helper.get_attribute_value(a)
    for name, value in specs.PLUGIN_NODE_ATTRIBUTES.items():
        if name not in attrs:
            raise ruled(
                "schema.attribute",
                ValueError(
                    f"{where}attribute {name!r}: expected {value!r} (read by the TensorRT ONNX "
                    f"parser), got none"
                ),
            )
    attrs = check_attributes(op, attrs, where)

    n_in, n_out = len(node.input), len(node.output)
    if n_in > len(op.inputs):
        raise ruled(
            "schema.input",
            ValueError(
                f"{where}inputs: expected at most {len(op.inputs)} "
                f"({', '.join(op.input_names)}), got {n_in}: {list(node.input)}"
            ),
        )
    for i, t in enumerate(op.inputs):
        if not t.optional and (i >= n_in or not node.input[i]):
            raise ruled(
                "schema.input",
                ValueError(
                    f"{where}{t.name}: expected a graph tensor (required input {i}), got none"
                ),
            )
    if n_out > len(op.outputs):
        raise ruled(
            "schema.output",
            ValueError(
                f"{where}outputs: expected at most {len(op.outputs)} "
                f"({', '.join(op.output_names)}), got {n_out}: {list(node.output)}"
            ),
        )
    _check_outputs(node, op, types or {}, where)
    _check_no_shared_updates(node, op, types or {})
    return attrs


def _check_outputs(
    node: onnx.NodeProto, op: specs.OpSpec, types: Mapping[str, Type], where: str
) -> None:
    """Every required output named (a cache update whose input ``types`` shows to hold
    no elements may stay unnamed); a scatter's value pair both or neither, with
    ``value_cache_out`` exactly when there is a value cache."""
    n_in, n_out = len(node.input), len(node.output)
    ins = list(node.input) + [""] * (len(op.inputs) - n_in)
    required = [t.name for t in op.outputs if not t.optional]
    if op is specs.SCATTER_PA_KV_CACHE:
        v, vc = ins[op.input_index("value")], ins[op.input_index("value_cache")]
        if bool(v) != bool(vc):
            raise ruled(
                "schema.input",
                ValueError(
                    f"{where}value, value_cache: expected both or neither, got {v!r} and {vc!r}"
                ),
            )
        vco = op.output_index("value_cache_out")
        if vc:
            required.append("value_cache_out")
        elif vco < n_out and node.output[vco]:
            raise ruled(
                "schema.output",
                ValueError(
                    f"{where}value_cache_out: expected no output for a key-only write (no "
                    f"value_cache), got {node.output[vco]!r}"
                ),
            )
    for name in required:
        i = op.output_index(name)
        if i < n_out and node.output[i]:
            continue
        src = op.aliased_input_index(i)
        if src < 0:
            raise ruled(
                "schema.output",
                ValueError(f"{where}{name}: expected a graph tensor (output {i}), got none"),
            )
        shape = types.get(ins[src], (0, None))[1]
        if shape is not None and 0 in shape:
            continue  # a zero-element input (a placeholder): nothing is updated
        raise ruled(
            "schema.output",
            ValueError(
                f"{where}{name}: expected a graph tensor (output {i}, the updated {ins[src]!r}; "
                f"an unnamed output would drop the cache update), got none"
            ),
        )


def _check_no_shared_updates(
    node: onnx.NodeProto, op: specs.OpSpec, types: Mapping[str, Type]
) -> None:
    """An input updated in place may not be another input of the node too: the plugin
    would write it while reading it (docs/SPEC.md O; the reference refuses such arrays,
    ``pytrt_kv.contract.alias``). A tensor known to hold no elements is exempt."""
    updated = {op.input_index(src) for src in op.aliases.values()}
    for j in sorted(updated):
        name = node.input[j] if j < len(node.input) else ""
        if not name:
            continue
        shape = types.get(name, (0, None))[1]
        if shape is not None and 0 in shape:
            continue
        for i, other in enumerate(node.input):
            if i != j and other == name:
                first, second = sorted((i, j))
                a, b = op.inputs[first].name, op.inputs[second].name
                written = b if second in updated else a
                raise ruled(
                    "graph.two-caches",
                    ValueError(
                        f"{node_where(node)}{b}: expected a graph tensor other than {a}'s "
                        f"({written} is updated in place), got {name!r} for both"
                    ),
                )


def check_domain(node: onnx.NodeProto, opsets: Mapping[str, int]) -> None:
    """``node``'s domain is imported by the model (``opsets``: domain -> version),
    ``pytrt_kv`` at ``specs.DOMAIN_VERSION``; a node with one of our op types is in our
    domain."""
    domain = node.domain or ""
    if domain in ("", "ai.onnx") and not any(d in opsets for d in ("", "ai.onnx")):
        raise ruled(
            "domain",
            ValueError(
                f"{node_where(node)}domain '': expected in the model's opset_import, got "
                f"{dict(opsets)}"
            ),
        )
    if node.op_type in specs.OPS and domain != specs.DOMAIN and domain not in opsets:
        raise ruled(
            "domain",
            ValueError(
                f"{node_where(node)}domain: expected {specs.DOMAIN!r} (the domain of "
                f"pytrt_kv's ops), got {domain!r}"
            ),
        )
    if domain == specs.DOMAIN and opsets.get(domain) != specs.DOMAIN_VERSION:
        raise ruled(
            "domain",
            ValueError(
                f"{node_where(node)}domain {domain!r}: expected in the model's opset_import "
                f"(version {specs.DOMAIN_VERSION}), got {dict(opsets)}"
            ),
        )
    if domain not in ("", "ai.onnx") and domain not in opsets:
        raise ruled(
            "domain",
            ValueError(
                f"{node_where(node)}domain {domain!r}: expected in the model's "
                f"opset_import, got {dict(opsets)}"
            ),
        )


def _produced(
    op: specs.OpSpec, node: onnx.NodeProto, k: int, types: Mapping[str, Type]
) -> tuple[Type, str] | None:
    """(type, origin) of output ``k`` of ``node`` as far as ``types`` tells it."""
    src = op.aliased_input_index(k)
    if src >= 0:
        name = node.input[src] if src < len(node.input) else ""
        if name not in types:
            return None
        return types[name], f"as {op.inputs[src].name}"
    # selection_kv_actual_seq: int32 [R], one per row of selection_kv_block_table.
    table = types.get(node.input[op.input_index("selection_kv_block_table")])
    rows = None if table is None or not table[1] else table[1][0]
    return (
        (dtypes.ONNX[specs.INT32], (rows,)),
        "one int32 per row of selection_kv_block_table",
    )


def check_output_declarations(model: onnx.ModelProto, types: Mapping[str, Type]) -> None:
    """Each graph output a ``pytrt_kv`` node produces is declared with the dtype, rank
    and static dims the op gives it (a symbolic or unknown dim on either side agrees).

    Raises
    ------
    TypeError
        The declared element type differs.
    ValueError
        The declared rank or a static dim differs.
    """
    declared = {
        o.name: type_of(o.type) for o in model.graph.output if o.type.HasField("tensor_type")
    }
    for node in model.graph.node:
        if node.domain != specs.DOMAIN or node.op_type not in specs.OPS:
            continue
        op = specs.OPS[node.op_type]
        for k, name in enumerate(node.output[: len(op.outputs)]):
            if not name or name not in declared:
                continue
            got = _produced(op, node, k, types)
            if got is None:
                continue
            (elem, shape), origin = got
            d_elem, d_shape = declared[name]
            want = (
                f"{node_where(node)}{op.outputs[k].name}: expected {describe((elem, shape))} "
                f"(the op's output, {origin}), got {describe((d_elem, d_shape))} declared "
                f"by graph output {name!r}"
            )
            if elem and d_elem and elem != d_elem:
                raise ruled("graph.output-declaration", TypeError(want))
            if shape is None or d_shape is None:
                continue
            if len(shape) != len(d_shape) or any(
                isinstance(a, int) and isinstance(b, int) and a != b for a, b in zip(shape, d_shape)
            ):
                raise ruled("graph.output-declaration", ValueError(want))


def check_declared_token_dims(node: onnx.NodeProto, types: Mapping[str, Type]) -> None:
    """:func:`check_token_dims` on the declared types of a 3-D scatter's inputs."""
    op = specs.SCATTER_PA_KV_CACHE
    given = {}
    for name in ("key", "value", "slot_mapping"):
        i = op.input_index(name)
        tensor = node.input[i] if i < len(node.input) else ""
        elem, shape = types.get(tensor, (0, None))
        if elem in dtypes.ONNX_TO_NAME and shape is not None:
            given[name] = TensorInfo(shape, dtypes.ONNX_TO_NAME[elem])
    key = given.get("key")
    if key is not None and key.shape is not None and len(key.shape) == 3:
        check_token_dims(given, node_where(node))
