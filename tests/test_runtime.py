"""pytrt_kv.runtime: functional semantics, feed checking, paths, errors from the reference."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from onnx_export import single_op_model
from pytrt_kv import runtime


def _feeds():
    return {"key": np.arange(16, dtype=np.float32).reshape(2, 1, 8) + 1,
            "key_cache": np.full((2, 4, 1, 8), -3, np.float32),
            "slot_mapping": np.array([5, 0], np.int32)}


def test_run_from_path_and_model_is_functional(tmp_path):
    feeds = _feeds()
    model = single_op_model("ScatterPaKvCache", feeds)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    for source in (model, path, str(path), runtime.make_evaluator(model)):
        out = runtime.run(source, feeds)
        assert np.array_equal(feeds["key_cache"], np.full((2, 4, 1, 8), -3, np.float32))
        want = np.full((2, 4, 1, 8), -3, np.float32)
        want[1, 1, 0] = feeds["key"][0, 0]
        want[0, 0, 0] = feeds["key"][1, 0]
        assert np.array_equal(out["key_cache_out"], want)
        assert out["key_cache_out"] is not feeds["key_cache"]


def test_feed_names_checked():
    feeds = _feeds()
    model = single_op_model("ScatterPaKvCache", feeds)
    with pytest.raises(ValueError, match="missing \\['slot_mapping'\\]"):
        runtime.run(model, {k: v for k, v in feeds.items() if k != "slot_mapping"})
    with pytest.raises(ValueError, match="unknown \\['extra'\\]"):
        runtime.run(model, dict(feeds, extra=np.zeros(1)))
    with pytest.raises(TypeError, match="model_or_path"):
        runtime.run(42, feeds)


def test_reference_value_errors_surface():
    feeds = _feeds()
    model = single_op_model("ScatterPaKvCache", feeds)
    with pytest.raises(ValueError, match="slot"):
        runtime.run(model, dict(feeds, slot_mapping=np.array([3, 3], np.int32)))  # duplicate
    with pytest.raises(ValueError, match="slot"):
        runtime.run(model, dict(feeds, slot_mapping=np.array([8, 0], np.int32)))  # >= NB*BS


def test_registers_schemas_on_import():
    assert onnx.defs.has("ScatterPaKvCache", "pytrt_kv")
    assert onnx.defs.has("GatherSelectionKvCache", "pytrt_kv")


def test_wrong_feed_dtype_names_the_argument():
    feeds = _feeds()
    model = single_op_model("ScatterPaKvCache", feeds)
    with pytest.raises((TypeError, ValueError), match="key_cache"):
        runtime.run(model, dict(feeds, key=feeds["key"].astype(np.float16)))
