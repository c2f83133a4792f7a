"""``make_session(..., float_math="reference")``: the standard nodes whose float results
ONNX Runtime's kernels round differently from the CPU runtime's, as ONNX Runtime custom
ops that run the CPU runtime's own implementation (docs/GRAPH_MODE.md, "ONNX Runtime").

The CPU runtime is onnx's ``ReferenceEvaluator`` (:mod:`pytrt_kv.graph.runtime`): NumPy
for every standard op. A result that is correctly rounded (IEEE ``+ - * /`` and sqrt in
float32/float64, a copy, a selection, a comparison) is the same bytes in both; anything
else (a reduction, a dot product, a transcendental, a fused formula) depends on the
order and the approximations of the kernel, and ONNX Runtime's MLAS and NumPy differ by
a few ulps. Half types (float16, bfloat16) differ even for ``+ - * /``: ONNX Runtime's CPU
provider has few half kernels, computes the others in float32 and drops the rounding to
half between consecutive nodes. Measured for every op kept here
(``scripts/ort_float_ops.py``): :data:`EXACT` and :data:`IEEE` are the ops whose bytes
are equal; every other standard node with a float tensor is rewritten.

Each rewritten node runs the ``OpRun`` class that the CPU runtime's evaluator picks for
it (same op version, same input types; tests/test_ort.py checks the classes are the
runtime's), on read-only NumPy views of ONNX Runtime's buffers, and its results are
copied into ONNX Runtime's outputs. NumPy's dot products and reductions also depend on
their operands' memory layout, and the CPU runtime feeds some as strided views
(Transpose, Slice) where ONNX Runtime has plain arrays: such a node also replays, on
NumPy, the nodes that made those views from plain tensors (:func:`region`).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import onnx
from onnx.reference import ReferenceEvaluator

from . import _capi

#: Standard ops whose result bytes are equal in every float type: copies, selections
#: and comparisons (the result is an input value, an index or a bool).
EXACT = frozenset(
    {
        "Abs", "And", "ArgMax", "ArgMin", "BitShift", "Ceil", "Clip", "Compress",
        "Concat", "Constant", "ConstantOfShape", "DepthToSpace", "Equal", "Expand",
        "Flatten", "Floor", "Gather", "GatherElements", "GatherND", "Greater",
        "GreaterOrEqual", "Identity", "IsInf", "IsNaN", "Less", "LessOrEqual", "Max",
        "Min", "Neg", "NonZero", "Not", "OneHot", "Or", "Pad", "ReduceMax", "ReduceMin",
        "Relu", "Reshape", "Round", "Shape", "Sign", "Size", "Slice", "SpaceToDepth",
        "Split", "Squeeze", "Tile", "TopK", "Transpose", "Trilu", "Unsqueeze", "Where",
        "Xor",
    }
)  # fmt: skip
#: Correctly rounded IEEE operations: equal bytes in float32 and float64 only.
IEEE = frozenset({"Add", "Sub", "Mul", "Div", "Sqrt", "Reciprocal"})
#: Data movement whose bytes are equal unless ``reduction`` is set.
_SCATTERS = frozenset({"ScatterND", "ScatterElements"})
_CASTS = frozenset({"Cast", "CastLike"})

_T = onnx.TensorProto
FLOATS = frozenset(
    {
        _T.FLOAT, _T.DOUBLE, _T.FLOAT16, _T.BFLOAT16, _T.FLOAT8E4M3FN, _T.FLOAT8E4M3FNUZ,
        _T.FLOAT8E5M2, _T.FLOAT8E5M2FNUZ,
    }
)  # fmt: skip
#: Float types whose +, -, *, /, sqrt ONNX Runtime computes as NumPy does.
_WIDE = frozenset({_T.FLOAT, _T.DOUBLE})
#: ONNX's standard domain, by its two names.
STANDARD = ("", "ai.onnx")


def _attr(node: onnx.NodeProto, name: str) -> Any:
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return None


def needs_reference(node: onnx.NodeProto, types: dict[str, int]) -> bool:
    """Whether ``node`` (a standard node; ``types``: tensor name -> ONNX type) gives other
    bytes on ONNX Runtime than on the CPU runtime, so ``float_math="reference"`` runs it
    on the CPU runtime's implementation."""
    tensors = [types.get(n, 0) for n in [*node.input, *node.output] if n]
    if not any(t in FLOATS for t in tensors):
        return False  # integer and bool math is exact in both
    op = node.op_type
    if op in EXACT:
        return False
    if op in _SCATTERS:
        return (_attr(node, "reduction") or b"none") not in (b"none", "none")
    if op in IEEE:
        return not all(t in _WIDE for t in tensors if t in FLOATS)
    if op in _CASTS:
        # One rounding (or none) is exact, and so is float -> int truncation; ONNX
        # Runtime casts double and integers to float16 through float32 (two roundings),
        # and its bfloat16/float8 conversions are its own.
        src, dst = types.get(node.input[0], 0), types.get(node.output[0], 0)
        if dst not in FLOATS or dst in _WIDE:
            return False
        return not (dst == _T.FLOAT16 and src in (_T.FLOAT, _T.FLOAT16))
    return True


def _graph_attributes(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    out = []
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            out.append(a.g)
        elif a.type == onnx.AttributeProto.GRAPHS:
            out.extend(a.graphs)
    return out


def refuse_subgraphs(model: onnx.ModelProto) -> None:
    """ValueError when a node has a subgraph (If, Loop, Scan): its nodes would run on ONNX
    Runtime's kernels, so ``float_math="reference"`` could not promise equal bytes."""
    for node in model.graph.node:
        if _graph_attributes(node):
            raise ValueError(
                f"float_math: 'reference' expected a graph without subgraphs (it rewrites "
                f"top-level nodes only), got node {node.name or '<unnamed>'!r} "
                f"({node.op_type}) with one; use float_math='onnxruntime'"
            )


#: Ops whose CPU-runtime result is a new C-ordered array whatever its inputs' layout.
_FRESH = frozenset(
    {
        "Concat", "Constant", "ConstantOfShape", "Gather", "GatherElements", "GatherND",
        "Gemm", "Identity", "MatMul", "Range", "ReduceL1", "ReduceL2", "ReduceLogSum",
        "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin", "ReduceProd",
        "ReduceSum", "ReduceSumSquare", "Shape", "Size",
    }
)  # fmt: skip
#: Ops whose CPU-runtime result is a strided view of an input.
_STRIDED = frozenset({"Slice", "Split", "Transpose"})


def plain_tensors(graph: onnx.GraphProto) -> set[str]:
    """The tensors the CPU runtime holds as plain C-ordered arrays (the layout ONNX
    Runtime gives every tensor). The others are strided views (Transpose, Slice) or
    computed from them; NumPy's result of a dot product or a reduction depends on its
    operands' layout (BLAS or its own loop, summation order), so a rewritten node
    replays them (:func:`region`). Element-wise ops and reshapes keep the layout of
    their inputs; feeds are taken as C-ordered."""
    from ..contract import specs  # noqa: PLC0415

    plain = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    for node in graph.node:
        op = node.op_type
        fresh = node.domain == specs.DOMAIN or (node.domain in STANDARD and op in _FRESH)
        if fresh or (op not in _STRIDED and all(i in plain for i in node.input if i)):
            plain.update(o for o in node.output if o)
    return plain


def region(
    node: onnx.NodeProto, producers: dict[str, tuple[int, onnx.NodeProto]], plain: set[str]
) -> list[onnx.NodeProto]:
    """The nodes that compute ``node``'s inputs from plain tensors (:func:`plain_tensors`),
    in graph order: replaying them on NumPy rebuilds the CPU runtime's strided inputs."""
    seen: dict[int, onnx.NodeProto] = {}
    todo = [n for n in node.input if n and n not in plain]
    while todo:
        name = todo.pop()
        if name in plain or name not in producers:
            continue
        index, producer = producers[name]
        if index not in seen:
            seen[index] = producer
            todo.extend(i for i in producer.input if i)
    return [seen[i] for i in sorted(seen)]


def _sub_model(
    nodes: list[onnx.NodeProto],
    leaves: list[str],
    types: dict[str, int],
    opsets: list[onnx.OperatorSetIdProto],
) -> onnx.ModelProto:
    def info(name: str) -> onnx.ValueInfoProto:
        return onnx.helper.make_tensor_value_info(name, types[name], None)

    outs = [n for n in nodes[-1].output if n]
    graph = onnx.helper.make_graph(
        nodes, "float_math", [info(n) for n in leaves], [info(n) for n in outs]
    )
    model = onnx.helper.make_model(graph, opset_imports=list(opsets))
    model.ir_version = onnx.IR_VERSION
    return model


def implementation(
    nodes: list[onnx.NodeProto],
    leaves: list[str],
    types: dict[str, int],
    opsets: list[onnx.OperatorSetIdProto],
) -> ReferenceEvaluator:
    """The CPU runtime's evaluation of ``nodes`` (the replayed region, then the rewritten
    node) from the ``leaves`` tensors: onnx's ``ReferenceEvaluator``, the CPU runtime's
    base, which overrides no standard op; same op versions (``opsets``) and types."""
    return ReferenceEvaluator(_sub_model(nodes, leaves, types, opsets))


def _where(node: onnx.NodeProto) -> str:
    return f"node {node.name or '<unnamed>'!r} ({node.op_type})"


def custom_op(
    node: onnx.NodeProto,
    types: dict[str, int],
    opsets: list[onnx.OperatorSetIdProto],
    producers: dict[str, tuple[int, onnx.NodeProto]],
    plain: set[str],
) -> tuple[_capi.CustomOp, list[str]]:
    """The ONNX Runtime op that runs the standard ``node`` on the CPU runtime's
    implementation, and the graph tensors it takes as inputs (``node``'s plain inputs
    and those its :func:`region` starts from). ``types``: tensor name -> ONNX type,
    ``opsets``: the model's imports (they pick the op versions); ``producers``: tensor
    -> (index, original node). Same nodes, types and opsets give the same op name."""
    nodes = [*region(node, producers, plain), node]
    made = {o for n in nodes for o in n.output if o}
    leaves = list(dict.fromkeys(i for n in nodes for i in n.input if i and i not in made))
    unknown = [n for n in [*leaves, *node.output] if n and not types.get(n)]
    if unknown:
        raise ValueError(
            f"{_where(node)}: float_math='reference' expected known element types for "
            f"its tensors (graph inputs, initializers or inferable), got none for {unknown}"
        )
    standard = [o for o in opsets if o.domain in STANDARD]
    evaluator = implementation(nodes, leaves, types, standard)
    if any(n.need_context() for n in evaluator.rt_nodes_):
        raise ValueError(f"{_where(node)}: float_math='reference' cannot run it as a custom op")
    ins = [types[n] for n in leaves]
    outs = [types[n] if n else _T.FLOAT for n in node.output]
    want = [np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t)) for t in outs]
    model = _sub_model(nodes, leaves, types, standard)
    key = hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()
    present = [(i, n) for i, n in enumerate(node.output) if n]

    def compute(api: _capi.OrtApi, context: int) -> None:
        feeds = {}
        for i, name in enumerate(leaves):
            x = api.input(context, i)
            assert x is not None  # every leaf is a present input
            x.flags.writeable = False  # ONNX Runtime's buffer: never written
            feeds[name] = x
        results = evaluator.run(None, feeds)
        for (i, name), y in zip(present, results):
            y = np.asarray(y)
            if y.dtype != want[i]:
                raise TypeError(
                    f"{_where(node)}: output {name!r}: expected {want[i]} (the inferred "
                    f"type), got {y.dtype} from the CPU runtime's implementation"
                )
            out = api.output(context, i, y.shape)
            if out is not None and y.size:
                np.copyto(out, y, casting="no")

    op = _capi.CustomOp(
        f"PytrtKvRef{node.op_type}_{key[:20]}",
        ins,
        outs,
        set(),
        {i for i, n in enumerate(node.output) if not n},
        compute,
    )
    return op, leaves
