"""A plain ``onnx.helper`` graph builder (as a real-model exporter has) for the
builder-agnostic RetrievalKV subgraphs of ``onnx_export.retrieval``: ``op``, ``const`` and
``run`` (the ONNX reference evaluator on the graph ending at one output)."""

from __future__ import annotations

import numpy as np
import onnx


def tiny_builder():
    """The ``op``/``const`` pair of a plain ``onnx.helper`` graph (as a real-model
    exporter has), for the builder-agnostic representation functions."""
    from onnx import helper, numpy_helper

    nodes, inits = [], []

    def const(a):
        name = f"c{len(inits)}"
        inits.append(numpy_helper.from_array(np.asarray(a), name))
        return name

    def op(op_type, inputs, **attrs):
        out = f"n{len(nodes)}"
        nodes.append(helper.make_node(op_type, inputs, [out], **attrs))
        return out

    def run(out, feeds, rank=2):
        from onnx import TensorProto
        from onnx.reference import ReferenceEvaluator

        types = {
            np.dtype(np.float32): TensorProto.FLOAT,
            np.dtype(bool): TensorProto.BOOL,
            np.dtype(np.int64): TensorProto.INT64,
        }
        ins = [helper.make_tensor_value_info(k, types[v.dtype], v.shape) for k, v in feeds.items()]
        outs = [helper.make_tensor_value_info(out, TensorProto.FLOAT, [None] * rank)]
        graph = helper.make_graph(nodes, "g", ins, outs, inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        onnx.checker.check_model(model, full_check=True)
        return ReferenceEvaluator(model).run(None, feeds)[0]

    return op, const, run
