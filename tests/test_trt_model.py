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


def test_example_model_pairs_every_cache():
    pairs = trt_model.alias_pairs(build_example_model())
    assert pairs and all(out.endswith("_out") for out in pairs)
    assert len(set(pairs.values())) == len(pairs)


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
