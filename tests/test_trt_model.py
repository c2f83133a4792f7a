"""pytrt_kv.graph.tensorrt.alias_pairs enforces docs/SPEC.md O: a cache bound in place is
read by its op alone (no TensorRT needed)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from onnx_export import single_op_model
from onnx_export.example import build_example_model
from pytrt_kv.trt import model as trt_model


def _scatter():
    return single_op_model(
        "ScatterPaKvCache",
        {
            "key": np.ones((3, 2, 16), np.float16),
            "value": np.ones((3, 2, 8), np.float16),
            "key_cache": np.ones((4, 8, 2, 16), np.float16),
            "value_cache": np.ones((4, 8, 2, 8), np.float16),
            "slot_mapping": np.arange(3, dtype=np.int32),
        },
    )


# Output position -> input position of each cache an op updates in place, written out from
# the operator tables of docs/SPEC.md O (not from pytrt_kv.contract): `key_cache_out` is
# `key_cache` (input 2), `selection_kv_block_status_out` is `selection_kv_block_status`
# (input 3); `selection_kv_actual_seq` (output 3) is a plain output.
_DOC_ALIASES = {
    "ScatterPaKvCache": {0: 2, 1: 3},
    "GatherSelectionKvCache": {0: 0, 1: 1, 2: 3},
}


def test_example_model_pairs_every_cache():
    model = build_example_model()
    nodes = [n for n in model.graph.node if n.op_type in _DOC_ALIASES]
    # The example holds both operators; every cache of every node must be paired, so a
    # pairing that stops after the first node (or the first output) fails here.
    assert sorted({n.op_type for n in nodes}) == sorted(_DOC_ALIASES)
    expected = {
        node.output[o]: node.input[i]
        for node in nodes
        for o, i in _DOC_ALIASES[node.op_type].items()
    }
    assert len(expected) == sum(len(_DOC_ALIASES[n.op_type]) for n in nodes)
    assert trt_model.alias_pairs(model) == expected


def test_single_op_pairs():
    assert trt_model.alias_pairs(_scatter()) == {
        "key_cache_out": "key_cache",
        "value_cache_out": "value_cache",
    }


def test_cache_read_by_another_node_is_refused():
    m = _scatter()
    m.graph.node.append(helper.make_node("Identity", ["key_cache"], ["peek"], name="peek_node"))
    m.graph.output.append(helper.make_tensor_value_info("peek", onnx.TensorProto.FLOAT16, None))
    with pytest.raises(
        ValueError,
        match=r"key_cache: expected a cache input consumed only "
        r"by its op.*peek_node",
    ):
        trt_model.alias_pairs(m)


def test_cache_that_is_also_a_graph_output_is_refused():
    m = _scatter()
    m.graph.output.append(
        helper.make_tensor_value_info("value_cache", onnx.TensorProto.FLOAT16, None)
    )
    with pytest.raises(ValueError, match="value_cache: .*also a graph output"):
        trt_model.alias_pairs(m)
