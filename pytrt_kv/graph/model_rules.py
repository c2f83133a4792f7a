"""Rules of :func:`pytrt_kv.graph.lint.check_model` beyond one node's schema and contract
(docs/GRAPH_MODE.md, "Model checks"): what a later path (the reference at run time,
``prepare_for_tensorrt``, the TensorRT parser or builder, the plugin creators) would
otherwise refuse with its own message, or not at all (issue 31).

Every function raises (or returns) errors that carry their rule (``rules.ruled``):

- ``model``: a file that holds no model (a 0-byte file parses as an empty ModelProto);
- ``graph.input-declaration``: a graph input declared without a dtype or a shape (rank;
  dims may be symbolic): TensorRT needs both for every network input;
- ``schema.attribute``: a ScatterPaKvCache with a 3-D key and no ``cache_layout``
  (docs/SPEC.md O: required with a 3-D key and resolved at export time; the plugin
  creator refuses it);
- ``schema.shape``: a ScatterPaKvCache whose key has no known rank;
- ``constant.scale``: a constant ``k_scale``/``v_scale`` (an initializer or a Constant
  node) that is not finite and > 0 (docs/SPEC.md S9);
- ``tensorrt.dtype`` (TensorRT paths only): a tensor of a pytrt_kv node in a dtype
  TensorRT cannot pass to a plugin (uint8, float8_e5m2).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from ..contract import dtypes, specs
from .nodes import Type, describe, node_where, type_of
from .rules import ruled

SCATTER = specs.SCATTER_PA_KV_CACHE

#: Dtypes of the contract that TensorRT cannot pass through plugin I/O: it has no float8
#: E5M2 type, and kUINT8 is only a network input/output type (docs/TENSORRT.md).
TENSORRT_UNSUPPORTED_DTYPES = (specs.UINT8, specs.FLOAT8_E5M2)


def check_not_empty(model: onnx.ModelProto) -> None:
    """A model file parses into something with an IR version, an opset and a graph."""
    if model.ir_version < 1 or not model.opset_import or not model.HasField("graph"):
        what = "an empty ModelProto (a 0-byte or non-ONNX file?)"
        if model.ByteSize():
            what = (
                f"a ModelProto with ir_version {model.ir_version}, "
                f"{len(model.opset_import)} opset imports and "
                f"{'a' if model.HasField('graph') else 'no'} graph"
            )
        raise ruled(
            "model",
            ValueError(
                f"model: expected an ONNX model (an ir_version, an opset_import and a "
                f"graph), got {what}"
            ),
        )


#: ONNX element types TensorRT's ONNX parser takes for a graph input or output (checked
#: with TensorRT-RTX 1.7: float8_e5m2 and int16 fail in ``importInput`` with a bare
#: "Failed to convert ONNX data type to TensorRT data type").
TENSORRT_IO_ELEM_TYPES = frozenset(
    {
        onnx.TensorProto.FLOAT,
        onnx.TensorProto.UINT8,
        onnx.TensorProto.INT8,
        onnx.TensorProto.INT32,
        onnx.TensorProto.INT64,
        onnx.TensorProto.BOOL,
        onnx.TensorProto.FLOAT16,
        onnx.TensorProto.DOUBLE,
        onnx.TensorProto.BFLOAT16,
        onnx.TensorProto.FLOAT8E4M3FN,
        onnx.TensorProto.INT4,
    }
)


def _dtype_name(elem: int) -> str:
    return describe((elem, None)).rsplit("[", 1)[0]


def tensorrt_io_dtypes(model: onnx.ModelProto) -> list[Exception]:
    """One ``tensorrt.dtype`` error per graph input or output whose dtype TensorRT's ONNX
    parser cannot import (those of pytrt_kv nodes: :func:`check_tensorrt_dtypes`)."""
    inits = {i.name for i in model.graph.initializer}
    # A tensor of a pytrt_kv node is named by check_tensorrt_dtypes, with its argument.
    ours = {n for node in model.graph.node if node.domain == specs.DOMAIN for n in node.input}
    ours |= {n for node in model.graph.node if node.domain == specs.DOMAIN for n in node.output}
    allowed = ", ".join(_dtype_name(e) for e in sorted(TENSORRT_IO_ELEM_TYPES))
    out: list[Exception] = []
    for kind, vis in (("graph input", model.graph.input), ("graph output", model.graph.output)):
        for vi in vis:
            if vi.name in inits or vi.name in ours or not vi.type.HasField("tensor_type"):
                continue
            elem = vi.type.tensor_type.elem_type
            if elem and elem not in TENSORRT_IO_ELEM_TYPES:
                out.append(
                    ruled(
                        "tensorrt.dtype",
                        ValueError(
                            f"{vi.name}: expected a {kind} dtype TensorRT imports ({allowed}), "
                            f"got {_dtype_name(elem)}"
                        ),
                    )
                )
    return out


#: Initializers with more elements than this are weights: shape inference needs only
#: their type and shape (shape-like constants, for Reshape and Slice, are small).
_WEIGHT_ELEMENTS = 64


def _without_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` without its weights: large initializers become graph inputs of the same
    type and shape, so shape inference costs milliseconds instead of serializing every
    weight (a 135M-parameter model took seconds per check); the weights are not copied."""
    light = onnx.ModelProto()
    light.ir_version = model.ir_version
    light.opset_import.extend(model.opset_import)
    light.functions.extend(model.functions)
    g, src = light.graph, model.graph
    g.name = src.name
    g.node.extend(src.node)
    g.input.extend(src.input)
    g.output.extend(src.output)
    g.value_info.extend(src.value_info)
    declared = {vi.name for vi in src.input}
    for init in src.initializer:
        if int(np.prod(init.dims, dtype=np.int64)) <= _WEIGHT_ELEMENTS:
            g.initializer.append(init)
        elif init.name not in declared:
            g.input.append(onnx.helper.make_tensor_value_info(init.name, init.data_type, init.dims))
    return light


def inferred_types(model: onnx.ModelProto, types: dict[str, Type]) -> None:
    """Add to ``types`` the types ONNX shape inference gives the inputs of pytrt_kv nodes
    that no declaration names (outputs of standard ops between two of our nodes): the
    types ``prepare_for_tensorrt`` and the TensorRT parser see. Inference is best effort:
    a model it cannot infer keeps its declared types."""
    wanted = {n for node in model.graph.node if node.domain == specs.DOMAIN for n in node.input}
    missing = {n for n in wanted if n and n not in types}
    if not missing:
        return
    from . import schemas  # noqa: F401,PLC0415 - registers the op schemas

    light = _without_weights(model)
    try:
        inferred = onnx.shape_inference.infer_shapes(light)
    except Exception:  # noqa: BLE001 - one of our nodes refused: infer around them
        bare = light
        for node in bare.graph.node:
            if node.domain == specs.DOMAIN:
                node.domain = specs.DOMAIN + ".uninferred"  # no schema: skipped
        bare.opset_import.append(onnx.helper.make_opsetid(specs.DOMAIN + ".uninferred", 1))
        try:
            inferred = onnx.shape_inference.infer_shapes(bare)
        except Exception:  # noqa: BLE001 - a convenience: the declarations still decide
            return
    # A standard op's output that is also a graph output is declared there (inference
    # leaves graph outputs out of value_info).
    for vi in list(inferred.graph.value_info) + list(inferred.graph.output):
        if vi.name in missing and vi.type.HasField("tensor_type"):
            types[vi.name] = type_of(vi.type)


def input_declarations(model: onnx.ModelProto) -> list[Exception]:
    """One error per graph input (not an initializer) declared without a tensor dtype or
    without a shape."""
    inits = {i.name for i in model.graph.initializer}
    out: list[Exception] = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
        if tt is not None and tt.elem_type and tt.HasField("shape"):
            continue
        got = "no tensor type"
        if tt is not None:
            got = describe((tt.elem_type, None)) if tt.elem_type else "no dtype"
            got += "" if tt.HasField("shape") else " without a shape"
        out.append(
            ruled(
                "graph.input-declaration",
                ValueError(
                    f"{vi.name}: expected a graph input declared with a dtype and a shape "
                    f"(its rank; dims may be symbolic: TensorRT needs both), got {got}"
                ),
            )
        )
    return out


def constants(model: onnx.ModelProto, names: set[str]) -> dict[str, np.ndarray]:
    """Values of ``names`` that are initializers or outputs of Constant nodes with a
    tensor ``value`` (the constants a model can give an op input); only those are read."""
    out: dict[str, np.ndarray] = {}
    for init in model.graph.initializer:
        if init.name not in names:
            continue
        try:
            out[init.name] = numpy_helper.to_array(init)
        except Exception:  # noqa: BLE001 - an unreadable initializer: not ours to judge
            continue
    for node in model.graph.node:
        if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or not node.output:
            continue
        if node.output[0] not in names:
            continue
        for a in node.attribute:
            if a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
                try:
                    out[node.output[0]] = numpy_helper.to_array(a.t)
                except Exception:  # noqa: BLE001
                    pass
    return out


def _input(node: onnx.NodeProto, op: specs.OpSpec, name: str) -> str:
    i = op.input_index(name)
    return node.input[i] if i < len(node.input) else ""


def node_attr(node: onnx.NodeProto, name: str) -> Any:
    """The value of ``node``'s attribute ``name`` (strings decoded), None when unset."""
    for a in node.attribute:
        if a.name == name:
            v = onnx.helper.get_attribute_value(a)
            return v.decode() if isinstance(v, bytes) else v
    return None


def check_scatter_node(
    node: onnx.NodeProto, types: Mapping[str, Type], consts: Mapping[str, np.ndarray]
) -> None:
    """The key's rank known; ``cache_layout`` given with a 3-D key; constant scales
    finite and > 0."""
    where = node_where(node)
    key = _input(node, SCATTER, "key")
    shape = types.get(key, (0, None))[1]
    if shape is None:
        raise ruled(
            "schema.shape",
            ValueError(
                f"{where}key: expected a tensor with a known dtype and rank (graph input, "
                f"initializer or value_info), got {key!r}"
            ),
        )
    if len(shape) == 3 and not node_attr(node, "cache_layout"):
        raise ruled(
            "schema.attribute",
            ValueError(
                f"{where}attribute 'cache_layout': expected one of {list(specs.CACHE_LAYOUTS)} "
                f"(required with a 3-D key, docs/SPEC.md O: the plugin takes the layout from "
                f"it; onnx_export.single_op_model and the graphsurgeon helpers resolve it "
                f"from the shapes), got none"
            ),
        )
    for arg in ("k_scale", "v_scale"):
        name = _input(node, SCATTER, arg)
        value = consts.get(name) if name else None
        if value is None or value.size == 0:
            continue
        flat = value.reshape(-1).astype(np.float32)
        bad = np.flatnonzero(~(np.isfinite(flat) & (flat > 0)))
        if bad.size:
            i = int(bad[0])
            at = f"{arg}[{i}]" if value.ndim else arg
            raise ruled(
                "constant.scale",
                ValueError(
                    f"{where}{arg}: expected finite scales > 0 (docs/SPEC.md S9), got "
                    f"{at} = {float(flat[i])!r} in the constant {name!r}"
                ),
            )


def check_tensorrt_dtypes(node: onnx.NodeProto, types: Mapping[str, Type]) -> None:
    """No input of a pytrt_kv node in a dtype TensorRT cannot pass to a plugin."""
    op = specs.OPS[node.op_type]
    for k, name in enumerate(node.input[: len(op.inputs)]):
        if not name or name not in types:
            continue
        dtype = dtypes.ONNX_TO_NAME.get(types[name][0])
        if dtype in TENSORRT_UNSUPPORTED_DTYPES:
            raise ruled(
                "tensorrt.dtype",
                ValueError(
                    f"{node_where(node)}{op.inputs[k].name}: expected a dtype TensorRT can pass "
                    f"to a plugin (float16, bfloat16, float32, int8, float8_e4m3fn), got "
                    f"{dtype} ({name!r}); use the CPU runtime or the eager kernels for "
                    f"{dtype} caches"
                ),
            )
