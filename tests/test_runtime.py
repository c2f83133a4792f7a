"""pytrt_kv.runtime: functional semantics, feed checking, paths, errors from the reference."""

from __future__ import annotations

import functools
import importlib.util

import numpy as np
import onnx
import pytest

from onnx_export import single_op_model
from pytrt_kv import runtime
from support.models import compress_key_feeds


def _feeds():
    return {
        "key": np.arange(16, dtype=np.float32).reshape(2, 1, 8) + 1,
        "key_cache": np.full((2, 4, 1, 8), -3, np.float32),
        "slot_mapping": np.array([5, 0], np.int32),
    }


def _refused(model, match: str, error: type[Exception] = ValueError, feeds=None) -> None:
    """Running ``model`` on ``feeds`` (:func:`_feeds` when None) raises ``error`` with a
    message matching ``match``."""
    with pytest.raises(error, match=match):
        runtime.run(model, _feeds() if feeds is None else feeds)


def _load_refused(model, match: str, error: type[Exception] = ValueError) -> None:
    """Loading ``model`` (runtime.make_evaluator) raises ``error`` matching ``match``."""
    with pytest.raises(error, match=match):
        runtime.make_evaluator(model)


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
    with pytest.raises(
        TypeError,
        match=r"^feeds\['key'\]: expected float32\[2, 1, 8\] "
        r"\(declared by graph input 'key'\), got float16",
    ):
        runtime.run(model, dict(feeds, key=feeds["key"].astype(np.float16)))


# --- every pytrt_kv node is validated against its schema (issue: fuzzing) --------------


def _set_attr(node, name, value):
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(kept + [onnx.helper.make_attribute(name, value)])


def _gather_model():
    from support.gather_cases import gather_skeleton

    return single_op_model(
        "GatherSelectionKvCache", gather_skeleton(np.float16, tbs=1), selection_topk_block_size=1
    )


def test_misspelt_compress_mode_is_refused(rng):
    feeds = compress_key_feeds(rng)
    model = single_op_model("ScatterPaKvCache", feeds)
    _set_attr(model.graph.node[0], "compress_mode", "omin")
    _refused(
        model,
        r"^node 'ScatterPaKvCache' \(ScatterPaKvCache\): "
        r"attribute 'compress_mode': expected one of .*'omin'",
        feeds=feeds,
    )


def test_float_block_size_is_refused():
    model = _gather_model()
    _set_attr(model.graph.node[0], "selection_topk_block_size", 2.9)
    _load_refused(
        model, r"attribute 'selection_topk_block_size': expected " r"INT, got FLOAT 2\.9", TypeError
    )


def test_string_attribute_given_as_int_is_refused():
    model = single_op_model("ScatterPaKvCache", _feeds())
    _set_attr(model.graph.node[0], "cache_layout", 1)
    _refused(model, "attribute 'cache_layout': expected STRING, got INT", TypeError)


def test_repeated_and_unknown_attributes_are_refused():
    model = single_op_model("ScatterPaKvCache", _feeds())
    node = model.graph.node[0]
    node.attribute.extend([onnx.helper.make_attribute("cache_layout", "nd")])
    _refused(model, "attribute 'cache_layout': expected once, got it repeated")
    model = single_op_model("ScatterPaKvCache", _feeds())
    model.graph.node[0].attribute.extend([onnx.helper.make_attribute("cache_layuot", "nd")])
    _refused(model, "attribute 'cache_layuot': expected one of .*unknown")


def test_extra_inputs_are_refused(rng):
    feeds = compress_key_feeds(rng)
    model = single_op_model("ScatterPaKvCache", feeds)
    node = model.graph.node[0]
    node.input.extend(["", "", "seq_lens"])  # an 11th input (after k_scale, v_scale)
    _refused(model, r"inputs: expected at most 10 .* got 11", feeds=feeds)


def test_output_counts_are_checked():
    feeds = dict(
        _feeds(),
        value=np.ones((2, 1, 8), np.float32),
        value_cache=np.full((2, 4, 1, 8), -5, np.float32),
    )
    model = single_op_model("ScatterPaKvCache", feeds)
    node = model.graph.node[0]
    assert list(node.output) == ["key_cache_out", "value_cache_out"]
    del node.output[1]  # the value update would be lost
    del model.graph.output[1]
    _refused(model, "value_cache_out: expected a graph tensor", feeds=feeds)
    model = _gather_model()
    model.graph.node[0].output.append("fifth")
    _load_refused(model, r"outputs: expected at most 4 .* got 5")


def test_missing_required_input_and_unknown_op_type_are_refused():
    model = single_op_model("ScatterPaKvCache", _feeds())
    model.graph.node[0].input[4] = ""  # slot_mapping
    _load_refused(model, "slot_mapping: expected a graph tensor")
    model = single_op_model("ScatterPaKvCache", _feeds())
    model.graph.node[0].op_type = "ScatterKvCache"
    _load_refused(model, "op_type: expected one of .*'ScatterKvCache'")


def test_feeds_checked_against_declared_shapes():
    feeds = _feeds()
    model = single_op_model("ScatterPaKvCache", feeds)
    with pytest.raises(ValueError, match=r"^feeds\['key_cache'\]: expected dim 1 = 4"):
        runtime.run(model, dict(feeds, key_cache=np.zeros((2, 5, 1, 8), np.float32)))
    with pytest.raises(ValueError, match=r"^feeds\['slot_mapping'\]: expected rank 1"):
        runtime.run(model, dict(feeds, slot_mapping=np.array([[5, 0]], np.int32)))


def test_symbolic_dims_must_agree():
    feeds = _feeds()
    model = single_op_model("ScatterPaKvCache", feeds)
    for vi in model.graph.input:
        if vi.name in ("key", "slot_mapping"):
            vi.type.tensor_type.shape.dim[0].dim_param = "T"
    ok = runtime.run(
        model, dict(feeds, key=feeds["key"][:1], slot_mapping=feeds["slot_mapping"][:1])
    )
    assert ok["key_cache_out"][1, 1, 0, 0] == feeds["key"][0, 0, 0]
    with pytest.raises(
        ValueError,
        match=r"feeds\['slot_mapping'\]: expected dim 0 = T = 1 "
        r"\(as in feeds\['key'\]\)",
    ):
        runtime.run(model, dict(feeds, key=feeds["key"][:1]))


def test_reference_errors_name_node_and_graph_tensor():
    feeds = _feeds()
    model = single_op_model("ScatterPaKvCache", feeds)
    model.graph.node[0].name = "write_kv"
    model.graph.node[0].input[4] = "slots"
    model.graph.input[2].name = "slots"
    feeds["slots"] = np.array([3, 3], np.int32)
    del feeds["slot_mapping"]
    _refused(
        model,
        r"^node 'write_kv' \(ScatterPaKvCache\): "
        r"slot_mapping \(graph tensor 'slots'\): expected "
        r"distinct",
        feeds=feeds,
    )


def test_foreign_evaluator_is_validated_too():
    from onnx.reference import ReferenceEvaluator

    model = single_op_model("ScatterPaKvCache", _feeds())
    ev = ReferenceEvaluator(
        model, new_ops=[runtime.ScatterPaKvCacheOp, runtime.GatherSelectionKvCacheOp]
    )
    _set_attr(ev.proto_.graph.node[0], "alias_io", 3)
    with pytest.raises(ValueError, match="attribute 'alias_io'"):
        runtime.run(ev, _feeds())


# --- issue 21, leftovers from fuzzing: no bare RuntimeError from onnx.reference ----------


def _without_attr(model, name):
    node = model.graph.node[0]
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(kept)
    return model


def test_missing_plugin_attribute_is_named():
    model = _without_attr(single_op_model("ScatterPaKvCache", _feeds()), "plugin_version")
    _refused(
        model,
        r"^node 'ScatterPaKvCache' \(ScatterPaKvCache\): attribute 'plugin_version': "
        r"expected '1' \(read by the TensorRT ONNX parser\), got none",
    )


def test_missing_opset_and_foreign_domain_are_named():
    model = single_op_model("ScatterPaKvCache", _feeds())
    kept = [o for o in model.opset_import if o.domain != "pytrt_kv"]
    del model.opset_import[:]
    model.opset_import.extend(kept)
    _refused(
        model,
        r"^node 'ScatterPaKvCache' \(ScatterPaKvCache\): domain 'pytrt_kv': expected "
        r"in the model's opset_import .*version 1\), got \{'': 17\}",
    )
    model = single_op_model("ScatterPaKvCache", _feeds())
    model.graph.node[0].domain = "com.foo"
    _refused(
        model,
        r"^node 'ScatterPaKvCache' \(ScatterPaKvCache\): domain: expected 'pytrt_kv'"
        r".*, got 'com.foo'",
    )
    model = single_op_model("ScatterPaKvCache", _feeds())
    for o in model.opset_import:
        if o.domain == "pytrt_kv":
            o.version = 2
    _refused(model, r"domain 'pytrt_kv': expected .*version 1.*'pytrt_kv': 2")


def test_key_only_write_with_a_value_cache_output_is_refused():
    model = single_op_model("ScatterPaKvCache", _feeds())
    model.graph.node[0].output.append("vco")
    model.graph.output.append(
        onnx.helper.make_tensor_value_info("vco", onnx.TensorProto.FLOAT, None)
    )
    _refused(
        model,
        r"^node 'ScatterPaKvCache' \(ScatterPaKvCache\): value_cache_out: expected no "
        r"output for a key-only write \(no value_cache\), got 'vco'",
    )


def test_one_tensor_as_both_caches_is_refused():
    feeds = dict(_feeds(), value=np.ones((2, 1, 8), np.float32))
    model = single_op_model("ScatterPaKvCache", dict(feeds, value_cache=feeds["key_cache"]))
    node = model.graph.node[0]
    node.input[3] = "key_cache"
    model.graph.input.remove(next(i for i in model.graph.input if i.name == "value_cache"))
    _refused(
        model,
        r"^node 'ScatterPaKvCache' \(ScatterPaKvCache\): value_cache: expected a graph "
        r"tensor other than key_cache's \(value_cache is updated in place\), got 'key_cache' "
        r"for both",
        feeds=feeds,
    )


@pytest.mark.parametrize(
    "change, error, declared",
    [
        ("dtype", TypeError, r"float16\[2, 4, 1, 8\]"),
        ("dim", ValueError, r"float32\[2, 7, 1, 8\]"),
        ("rank", ValueError, r"float32\[2, 4, 1\]"),
    ],
)
def test_output_declarations_must_match_what_the_op_produces(change, error, declared):
    model = single_op_model("ScatterPaKvCache", _feeds())
    tt = model.graph.output[0].type.tensor_type
    if change == "dtype":
        tt.elem_type = onnx.TensorProto.FLOAT16
    elif change == "dim":
        tt.shape.dim[1].dim_value = 7
    else:
        del tt.shape.dim[3]
    _refused(
        model,
        r"^node 'ScatterPaKvCache' \(ScatterPaKvCache\): key_cache_out: expected "
        r"float32\[2, 4, 1, 8\] \(the op's output, as key_cache\), got "
        + declared
        + r" declared by graph output 'key_cache_out'",
        error,
    )
    # A symbolic declared dim is no contradiction.
    model = single_op_model("ScatterPaKvCache", _feeds())
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_param = "NB"
    runtime.run(model, _feeds())


def test_dynamic_token_count_beside_a_static_one_is_refused_up_front():
    """Issue 21: key [T, H, D] with a named dynamic T next to a static slot_mapping [2]
    can only run with T = 2; since cache_layout is detected with dynamic T, this went
    unnoticed until a feed with another T reached the reference."""
    from pytrt_kv.trt import prepare_for_tensorrt

    model = single_op_model("ScatterPaKvCache", _feeds())
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "T"
    want = (
        r"^node 'ScatterPaKvCache' \(ScatterPaKvCache\): slot_mapping: expected dim 0 "
        r"dynamic as key's 'T' \(key, value and slot_mapping dim 0 are one token count T\), "
        r"got int32\[2\]"
    )
    _load_refused(model, want)
    with pytest.raises(ValueError, match=want):
        prepare_for_tensorrt(model)
    with pytest.raises(ValueError, match=r"slot_mapping: expected dim 0 dynamic as key's 'T'"):
        onnx.checker.check_model(model, full_check=True)
    # An unknown (unnamed) dim, as shape inference leaves behind, is no contradiction.
    model.graph.input[0].type.tensor_type.shape.dim[0].Clear()
    runtime.run(model, _feeds())


# --- intermediates released after their last reader (issue 32 item 5) -------------------


def _chain_model(layers: int, n: int) -> onnx.ModelProto:
    """x [n] -> per layer: an [n, n] outer product, Softmax, MatMul back to [n]; plus a
    ScatterPaKvCache of the first layer's row into the cache (two outputs)."""
    h = onnx.helper
    nodes, x = [], "x"
    for i in range(layers):
        nodes += [
            h.make_node("Unsqueeze", [x, "ax1"], [f"col{i}"]),
            h.make_node("Unsqueeze", [x, "ax0"], [f"row{i}"]),
            h.make_node("MatMul", [f"col{i}", f"row{i}"], [f"outer{i}"]),
            h.make_node("Softmax", [f"outer{i}"], [f"p{i}"], axis=-1),
            h.make_node("MatMul", [f"p{i}", x], [f"y{i}"]),
            h.make_node("Mul", [f"y{i}", "half"], [f"x{i}"]),
        ]
        x = f"x{i}"
    nodes += [
        h.make_node("Reshape", ["x0", "kshape"], ["key"]),
        h.make_node(
            "ScatterPaKvCache",
            ["key", "", "key_cache", "", "slot_mapping"],
            ["key_cache_out"],
            domain="pytrt_kv",
            cache_layout="nd",
            plugin_namespace="pytrt_kv",
            plugin_version="1",
        ),
    ]
    f32, i64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64
    graph = h.make_graph(
        nodes,
        "chain",
        [
            h.make_tensor_value_info("x", f32, [n]),
            h.make_tensor_value_info("key_cache", f32, [2, 4, 1, n]),
            h.make_tensor_value_info("slot_mapping", onnx.TensorProto.INT32, [1]),
        ],
        [
            h.make_tensor_value_info(x, f32, [n]),
            h.make_tensor_value_info("key_cache_out", f32, [2, 4, 1, n]),
        ],
        [
            onnx.numpy_helper.from_array(np.array([1], np.int64), "ax1"),
            onnx.numpy_helper.from_array(np.array([0], np.int64), "ax0"),
            onnx.numpy_helper.from_array(np.array(0.5, np.float32), "half"),
            onnx.numpy_helper.from_array(np.array([1, 1, n], np.int64), "kshape"),
        ],
    )
    del i64
    model = h.make_model(
        graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("pytrt_kv", 1)]
    )
    model.ir_version = 10
    return model


def _chain_feeds(rng, n: int) -> dict[str, np.ndarray]:
    return {
        "x": rng.standard_normal(n).astype(np.float32),
        "key_cache": rng.standard_normal((2, 4, 1, n)).astype(np.float32),
        "slot_mapping": np.array([6], np.int32),
    }


def _same_bytes(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert (a[name].dtype, a[name].shape) == (b[name].dtype, b[name].shape), name
        assert a[name].tobytes() == b[name].tobytes(), name


def _traced_peak(fn) -> int:
    """Peak bytes numpy and Python allocate while ``fn`` runs (tracemalloc)."""
    import gc
    import tracemalloc

    gc.collect()
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_release_plan_drops_each_result_after_its_last_reader():
    from pytrt_kv.graph.runtime import release_plan

    plan = release_plan(_chain_model(2, 4).graph.node, ["x1", "key_cache_out"])
    # Unsqueeze col0 / row0 are read by the MatMul (node 2), outer0 by Softmax (3), p0 by
    # MatMul (4), y0 by Mul (5); x0 by layer 1 (nodes 6-10) and the Reshape (12).
    assert plan[:6] == [(), (), ("col0", "row0"), ("outer0",), ("p0",), ("y0",)]
    assert "x0" in plan[12] and "key" in plan[13]
    assert not any(n in names for names in plan for n in ("x", "x1", "key_cache_out", "half"))


def test_releasing_run_is_byte_identical_to_the_base_loop(rng):
    from onnx.reference import ReferenceEvaluator

    model = _chain_model(3, 16)
    feeds = _chain_feeds(rng, 16)
    ev = runtime.make_evaluator(model)
    base = dict(zip(ev.output_names, ReferenceEvaluator.run(ev, None, feeds)))
    _same_bytes(runtime.run(ev, feeds), base)
    _same_bytes(runtime.run(model, feeds), base)
    # One output by name, and an intermediate by name (the base loop answers that one).
    assert ev.run(["key_cache_out"], feeds)[0].tobytes() == base["key_cache_out"].tobytes()
    inner = ReferenceEvaluator.run(ev, ["p1"], feeds)[0]
    assert ev.run(["p1"], feeds)[0].tobytes() == inner.tobytes()
    assert set(ev.run(None, feeds, intermediate=True)) >= {"p0", "p1", "p2"}


def test_releasing_run_holds_one_layer_of_intermediates(rng):
    """Six layers of [n, n] products: the base loop keeps all twelve n x n tensors to the
    end, the runtime at most one layer's."""
    from onnx.reference import ReferenceEvaluator

    n = 512
    model = _chain_model(6, n)
    feeds = _chain_feeds(rng, n)
    ev = runtime.make_evaluator(model)
    square = n * n * 4
    kept = _traced_peak(lambda: ReferenceEvaluator.run(ev, None, feeds))
    released = _traced_peak(lambda: runtime.run(ev, feeds))
    assert kept > 12 * square
    assert released < 5 * square, (released / square, kept / square)  # Softmax makes 2 more


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None,
    reason="torch/transformers are not installed (the 'study' extra)",
)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_decoder_generation_is_byte_identical_to_the_base_loop(dtype):
    """A small random-weight Llama's prefill and decode graphs (onnx_export.decoder):
    every step's logits and the final caches equal, byte for byte, what the base
    onnx.reference loop (every intermediate kept) gives."""
    import torch
    import transformers
    from onnx.reference import ReferenceEvaluator

    from onnx_export.decoder import DecoderRunner

    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    runner = DecoderRunner(
        model.to(getattr(torch, dtype)), block_size=4, num_blocks=24, dtype=dtype
    )
    prompts = [[5, 9, 17, 33, 2, 7, 11, 40, 3], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]]
    runs = []
    for base in (False, True):
        for ev in (runner._prefill, runner._decode):
            if base:
                ev.run = functools.partial(ReferenceEvaluator.run, ev)
        tokens, _, _ = runner.generate(prompts, 4)
        runs.append((tokens, runner.last_logits, runner.last_caches))
    (tokens, logits, caches), (base_tokens, base_logits, base_caches) = runs
    assert tokens == base_tokens
    assert len(logits) == len(base_logits) == 4
    for a, b in zip(logits, base_logits):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    _same_bytes(caches, base_caches)
