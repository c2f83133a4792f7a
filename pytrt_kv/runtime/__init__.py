"""CPU runtime for models made of pytrt_kv ops and standard ONNX ops (docs/SPEC.md O).

``onnx.reference.ReferenceEvaluator`` runs the standard ops; our two ops are ``OpRun``
classes that call the NumPy reference (:mod:`pytrt_kv.reference`) on copies of the
cache inputs, so every ``*_out`` is the updated copy and the feeds are never modified
(functional semantics, the same results a TensorRT engine gives with aliased
bindings). Importing this module registers the op schemas with ``onnx.defs``.

Every ``pytrt_kv`` node is validated against its schema before anything runs (the rules
of the TensorRT plugin creators: attribute names, types and values, input and output
counts), and every feed against the dtype and shape its graph input declares. Errors
are ValueError or TypeError naming the node, the op argument and the graph tensor.
Each intermediate result is dropped once no later node reads it (``onnx.reference``
itself keeps them all to the end of a run), with the same node calls and results.

Example
-------
>>> import numpy as np
>>> from onnx_export import single_op_model
>>> from pytrt_kv import runtime
>>> feeds = {"key": np.full((2, 1, 8), 3, np.float32),
...          "key_cache": np.zeros((2, 4, 1, 8), np.float32),
...          "slot_mapping": np.array([5, 0], np.int32)}
>>> out = runtime.run(single_op_model("ScatterPaKvCache", feeds), feeds)
>>> float(out["key_cache_out"][1, 1, 0, 0]), float(feeds["key_cache"][1, 1, 0, 0])
(3.0, 0.0)
"""

from ..graph.lint import Problem, check_model, validate_model
from ..graph.nodes import validate_node
from ..graph.runtime import (
    GatherSelectionKvCacheOp,
    ScatterPaKvCacheOp,
    check_feeds,
    make_evaluator,
    run,
)

__all__ = [
    "run",
    "make_evaluator",
    "validate_model",
    "check_model",
    "Problem",
    "validate_node",
    "check_feeds",
    "ScatterPaKvCacheOp",
    "GatherSelectionKvCacheOp",
]
