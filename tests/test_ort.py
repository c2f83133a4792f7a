"""ONNX Runtime sessions with our ops (pytrt_kv.ort, docs/GRAPH_MODE.md "ONNX Runtime"):
the same outputs as the CPU runtime, byte for byte, and the same refusals."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from onnx_export import single_op_model
from pytrt_kv import ort, runtime
from pytrt_kv.graph.feeds import make_feeds
from pytrt_kv.graph.tensorrt import prepare_for_tensorrt

pytest.importorskip("onnxruntime")
if ort.availability():
    pytest.skip(ort.availability(), allow_module_level=True)


def _same(model, feeds, session=None):
    """Run ``model`` on ONNX Runtime (default: ``float_math="reference"``) and on the CPU
    runtime; assert byte equality (dtype, shape and bytes) of every output."""
    session = session or ort.make_session(model)
    before = {n: a.copy() for n, a in feeds.items()}
    got = session.run(None, feeds)
    want = runtime.run(model, feeds)
    names = [o.name for o in session.get_outputs()]
    assert names == [o.name for o in model.graph.output]
    for name, g in zip(names, got):
        w = want[name]
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert g.tobytes() == w.tobytes(), name
    for n, a in feeds.items():  # functional: the feeds are never written
        assert a.tobytes() == before[n].tobytes(), n
    return dict(zip(names, got))


def _models():
    from support.models import engine_test_models

    return engine_test_models()


@pytest.mark.parametrize("name,model", _models(), ids=[n for n, _ in _models()])
def test_outputs_byte_equal_to_the_cpu_runtime(name, model):
    for seed in range(2):
        _same(model, make_feeds(model, seed=seed))


def test_example_decode_loop_feeds_outputs_back():
    from onnx_export.example import CACHE_OUTPUTS, build_example_model

    model = build_example_model()
    session = ort.make_session(model)
    feeds = make_feeds(model, seed=3)
    for step in range(3):
        out = _same(model, feeds, session)
        if step == 0:  # the new token was written
            assert not np.array_equal(out["full_kv_cache_out"], feeds["full_kv_cache"])
        for src, dst in CACHE_OUTPUTS.items():
            feeds[src] = out[dst]


def test_example_model_from_a_file_and_bytes(tmp_path):
    from onnx_export.example import build_example_model

    model = build_example_model()
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    feeds = make_feeds(model, seed=1)
    a = ort.make_session(path).run(None, feeds)
    b = ort.make_session(model.SerializeToString()).run(None, feeds)
    assert all(x.tobytes() == y.tobytes() for x, y in zip(a, b))


def test_prepared_model_with_placeholders_runs():
    from support.models import scatter_model

    model = prepare_for_tensorrt(scatter_model("nd", "float16", "int32", value=False))
    _same(model, make_feeds(model, seed=0))


def _refusal(model, feeds):
    try:
        runtime.run(model, feeds)
    except (ValueError, TypeError) as exc:
        return type(exc), str(exc)
    raise AssertionError("the runtime accepted the feeds")


def _scatter_feeds():
    return {
        "key": np.zeros((4, 2, 8), np.float16),
        "value": np.zeros((4, 2, 8), np.float16),
        "key_cache": np.zeros((8, 4, 2, 8), np.float16),
        "value_cache": np.zeros((8, 4, 2, 8), np.float16),
        "slot_mapping": np.zeros(4, np.int32),
    }


BAD_SCATTER = {
    "duplicate-slot": lambda f: f.update(slot_mapping=np.array([1, 1, 2, 3], np.int32)),
    "slot-out-of-range": lambda f: f.update(slot_mapping=np.array([1, 99, 2, 3], np.int32)),
    "feed-shape": lambda f: f.update(slot_mapping=np.array([1, 2, 3], np.int32)),
    "feed-dtype": lambda f: f.update(key=f["key"].astype(np.float32)),
    "feed-missing": lambda f: f.pop("value"),
    "feed-unknown": lambda f: f.update(extra=np.zeros(1, np.float32)),
}


@pytest.mark.parametrize("case", sorted(BAD_SCATTER))
def test_scatter_refusals_are_the_runtimes(case):
    model = single_op_model("ScatterPaKvCache", _scatter_feeds())
    feeds = make_feeds(model, seed=0)
    BAD_SCATTER[case](feeds)
    kind, message = _refusal(model, feeds)
    with pytest.raises(kind) as info:
        ort.make_session(model).run(None, feeds)
    assert str(info.value) == message


def _gather_case():
    from support.models import gather_model

    model = gather_model("float16", False, 1)
    return model, make_feeds(model, seed=0)


def _bad_status(f):
    f["selection_kv_block_status"] = f["selection_kv_block_status"].copy()
    f["selection_kv_block_status"][0, 0, 0, :2] = 3


def _bad_block(f):
    f["full_kv_block_table"] = f["full_kv_block_table"].copy()
    f["full_kv_block_table"][0, :] = 999


def _bad_length(f):
    f["full_kv_actual_seq"] = f["full_kv_actual_seq"].copy()
    f["full_kv_actual_seq"][0] = 10**6


@pytest.mark.parametrize("corrupt", [_bad_status, _bad_block, _bad_length])
def test_gather_refusals_are_the_runtimes(corrupt):
    model, feeds = _gather_case()
    corrupt(feeds)
    kind, message = _refusal(model, feeds)
    with pytest.raises(kind) as info:
        ort.make_session(model).run(None, feeds)
    assert str(info.value) == message


def test_invalid_model_is_refused_like_the_runtime():
    model = single_op_model("ScatterPaKvCache", _scatter_feeds())
    node = model.graph.node[0]
    node.attribute.extend([onnx.helper.make_attribute("alias_oi", 1)])
    with pytest.raises(ValueError) as want:
        runtime.make_evaluator(model)
    with pytest.raises(ValueError) as got:
        ort.make_session(model)
    assert str(got.value) == str(want.value)


def test_session_options_are_checked_and_applied():
    model = single_op_model("ScatterPaKvCache", _scatter_feeds())
    with pytest.raises(ValueError, match="session_options: .*'intra_op_threads'"):
        ort.make_session(model, intra_op_threads=1)
    session = ort.make_session(model, intra_op_num_threads=1)
    _same(model, make_feeds(model, seed=0), session)
    with pytest.raises(TypeError, match="model_or_path: expected"):
        ort.make_session(42)
    with pytest.raises(FileNotFoundError, match="model_or_path"):
        ort.make_session("/nonexistent/m.onnx")


def test_same_node_registers_one_op():
    from pytrt_kv.ort import _capi

    model = single_op_model("ScatterPaKvCache", _scatter_feeds())
    _, ops = ort.rewrite_for_onnxruntime(model)
    _, again = ort.rewrite_for_onnxruntime(model)
    assert [o.name for o in ops] == [o.name for o in again]
    ort.make_session(model)
    ort.make_session(model)
    assert _capi.added(ops[0].name)
    assert sum(1 for name in _capi._added if name == ops[0].name) == 1


def test_cli_info_says_whether_sessions_work(capsys, monkeypatch):
    from pytrt_kv.cli import main

    assert main(["info"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "sessions here" in x)
    assert "usable" in line
    monkeypatch.setattr(ort, "availability", lambda: "onnxruntime-extensions: (test reason)")
    assert main(["info"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "sessions here" in x)
    assert "(test reason)" in line


# --- Polygraphy: `polygraphy run m.onnx --onnxrt --pytrt-kv-ref` -------------------------


def _example():
    from onnx_export.example import build_example_model

    return build_example_model()


def test_retrieval_decode_steps_verified_on_onnxruntime():
    """The RetrievalKV step (onnx_export/retrieval.py) on ONNX Runtime, checked step by
    step by the project's own verifier against the NumPy reference (ids, slots, status
    carried over, attention). Its inputs are the planner's: make_feeds cannot make them,
    so Polygraphy's command line needs --load-inputs for this model."""
    from onnx_export.retrieval import RetrievalSizes, build_retrieval_decode_step
    from pytrt_kv.retrieval import RetrievalConfig
    from pytrt_kv.retrieval.demo import calibration_basis, run_steps

    cfg = RetrievalConfig(  # "lowrank", the default representation
        init_tokens=64, local_tokens=200, block_size=32, dense_boundary=256, offload_boundary=512,
        rank=4,
    )  # fmt: skip
    sizes = RetrievalSizes(batch=2, q_heads=6, kv_heads=2, head_dim=8, max_len=1024)
    basis = calibration_basis(cfg, sizes)
    model = build_retrieval_decode_step(sizes, cfg, basis=basis)
    session = ort.make_session(model)
    names = [o.name for o in session.get_outputs()]

    def run(feeds):
        got = dict(zip(names, session.run(None, feeds)))
        want = runtime.run(model, feeds)
        for n in names:  # attention included: float_math="reference"
            assert got[n].tobytes() == want[n].tobytes(), n
        return got

    checks = run_steps(cfg, sizes, [300, 700], steps=3, seed=7, run=run, basis=basis)
    assert len(checks) == 6 and any(c.step > 0 and c.record.kept > 0 for c in checks)


@pytest.mark.parametrize("build", [_example], ids=["example"])
def test_polygraphy_onnxrt_against_the_reference_runner(build, tmp_path):
    import subprocess

    import pytrt_kv.polygraphy.data_loader as loader
    from support.env import polygraphy_command, polygraphy_env

    path = tmp_path / "m.onnx"
    onnx.save(build(), path)
    args = ["run", path, "--onnxrt", "--pytrt-kv-ref", "--data-loader-script", loader.__file__]
    args += ["--iterations", "2", "--atol", "0", "--rtol", "0"]
    res = subprocess.run(
        polygraphy_command() + [str(a) for a in args],
        cwd=tmp_path,
        env=polygraphy_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-4000:]
    assert "pytrt_kv.ort.make_session" in log  # the hook built the session
    assert "float_math='reference'" in log
    assert "Passed: 2/2 iterations" in log and "PASSED" in log


def test_onnxrt_hook_leaves_other_models_to_polygraphy(tmp_path):
    from polygraphy.backend.onnxrt import SessionFromOnnx

    from pytrt_kv.polygraphy import install_onnxrt

    assert install_onnxrt()
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    plain = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    plain.ir_version = 10
    session = SessionFromOnnx(plain.SerializeToString())()
    assert type(session).__name__ == "InferenceSession"
    ours = SessionFromOnnx(_example().SerializeToString())()
    assert type(session).__name__ != type(ours).__name__ == "PytrtKvSession"


def test_make_session_leaves_the_model_as_it_was():
    from onnx_export.example import build_example_model

    model = build_example_model()
    before = model.SerializeToString(deterministic=True)
    ort.make_session(model)
    assert model.SerializeToString(deterministic=True) == before
    bad = single_op_model("ScatterPaKvCache", _scatter_feeds())
    bad.graph.node[0].attribute.extend([onnx.helper.make_attribute("alias_oi", 1)])
    before = bad.SerializeToString(deterministic=True)
    with pytest.raises(ValueError):
        ort.make_session(bad)
    assert bad.SerializeToString(deterministic=True) == before


# --- float_math: "reference" (default, byte-equal) and "onnxruntime" (ONNX Runtime's kernels)


def _graph(nodes, feeds, out_type=None, opset=21):
    """A model of standard ``nodes`` whose inputs are ``feeds`` (name -> array) and whose
    output is the last node's; returns (model, feeds)."""
    from onnx import helper

    def elem(x):
        return helper.np_dtype_to_tensor_dtype(x.dtype)

    ins = [helper.make_tensor_value_info(n, elem(x), x.shape) for n, x in feeds.items()]
    out = nodes[-1].output[0]
    first = elem(next(iter(feeds.values())))
    outs = [helper.make_tensor_value_info(out, out_type or first, None)]
    graph = helper.make_graph(nodes, "g", ins, outs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    return model, feeds


def _op(op, feeds, **attrs):
    return _graph([onnx.helper.make_node(op, list(feeds), ["y"], **attrs)], feeds)


def _float_cases():
    rng = np.random.default_rng(0)

    def r(dtype, lo=-3.0, hi=3.0, shape=(4, 33, 67)):
        return rng.uniform(lo, hi, shape).astype(dtype)

    f32, f16, f64 = np.float32, np.float16, np.float64
    make = onnx.helper.make_node
    return {
        "MatMul": _op("MatMul", {"a": r(f32, shape=(3, 576)), "b": r(f32, shape=(576, 96))}),
        "Gemm-f16": _op(
            "Gemm",
            {"a": r(f16, shape=(33, 67)), "b": r(f16, shape=(67, 50)), "c": r(f16, shape=(50,))},
        ),
        "Softmax": _op("Softmax", {"x": r(f32)}, axis=-1),
        "LogSoftmax-f16": _op("LogSoftmax", {"x": r(f16)}, axis=1),
        "Exp": _op("Exp", {"x": r(f32)}),
        "Tanh": _op("Tanh", {"x": r(f32)}),
        "Erf": _op("Erf", {"x": r(f32)}),
        "Sigmoid-f16": _op("Sigmoid", {"x": r(f16)}),
        "Pow": _op("Pow", {"x": r(f32, 0.1, 3.0), "p": r(f32, 0.5, 2.0)}),
        "ReduceSum": _op("ReduceSum", {"x": r(f32), "axes": np.array([-1], np.int64)}),
        "ReduceMean-f16": _op("ReduceMean", {"x": r(f16), "axes": np.array([1], np.int64)}),
        "LayerNormalization": _op(
            "LayerNormalization", {"x": r(f32), "s": r(f32, shape=(67,)), "b": r(f32, shape=(67,))}
        ),
        # float16 Mul then Add: ONNX Runtime keeps the product in float32 between them.
        "Mul-Add-f16": _graph(
            [make("Mul", ["x", "y"], ["t"]), make("Add", ["t", "y"], ["z"])],
            {"x": r(f16), "y": r(f16, 0.5, 3.0)},
        ),
        # double -> float16 goes through float32 on ONNX Runtime (two roundings).
        "Cast-f64-f16": _graph(
            [make("Cast", ["x"], ["y"], to=onnx.TensorProto.FLOAT16)],
            {"x": rng.standard_normal((64, 1024)).astype(f64) * 100},
            out_type=onnx.TensorProto.FLOAT16,
        ),
    }


@pytest.mark.parametrize("name", sorted(_float_cases()))
def test_float_math_reference_is_byte_equal_where_onnxruntime_is_not(name):
    """ONNX Runtime's own kernels give other bytes for each of these (so the test fails
    if the node is left to them) and float_math="reference", the default, gives the CPU
    runtime's bytes."""
    model, feeds = _float_cases()[name]
    (want,) = runtime.run(model, feeds).values()
    (fast,) = ort.make_session(model, float_math="onnxruntime").run(None, feeds)
    assert fast.dtype == want.dtype and fast.tobytes() != want.tobytes()
    np.testing.assert_allclose(fast, want, rtol=1e-2, atol=0.1)  # a few ulps, not a bug
    _same(model, feeds)


def test_exact_ops_stay_on_onnxruntime():
    """Copies, comparisons and float32 + - * / sqrt are ONNX Runtime's own kernels in
    either mode (their bytes are the same); everything else with floats is rewritten."""
    from onnx_export.example import build_example_model

    model = build_example_model()
    _, ops = ort.rewrite_for_onnxruntime(model)
    _, fast = ort.rewrite_for_onnxruntime(model, "onnxruntime")
    rewritten = sorted(o.name.split("_")[0] for o in ops)
    assert rewritten == sorted(
        ["PytrtKvScatterPaKvCache", "PytrtKvGatherSelectionKvCache"]
        + ["PytrtKvRefMatMul"] * 4
        + ["PytrtKvRefSoftmax"]
    )
    assert sorted(o.name.split("_")[0] for o in fast) == [
        "PytrtKvGatherSelectionKvCache",
        "PytrtKvScatterPaKvCache",
    ]


def test_rewritten_nodes_run_the_runtimes_implementation():
    """Each rewritten node runs the OpRun class the CPU runtime's evaluator runs it with."""
    from onnx_export.example import build_example_model
    from pytrt_kv.ort import _float_math

    model = build_example_model()
    evaluator = runtime.make_evaluator(model)
    types = ort._element_types(model)
    opsets = list(model.opset_import)
    checked = 0
    for node, impl in zip(model.graph.node, evaluator.rt_nodes_):
        if node.domain == "" and _float_math.needs_reference(node, types):
            leaves = [i for i in node.input if i]
            ours = _float_math.implementation([node], leaves, types, opsets).rt_nodes_[-1]
            assert type(ours) is type(impl), node.name
            checked += 1
    assert checked == 5


def test_strided_inputs_are_replayed():
    """NumPy's matmul gives other bytes on a transposed view than on a plain array (BLAS
    or its own loop); the CPU runtime feeds the view, so the rewritten MatMul replays the
    Transpose from the plain tensor (and fails byte equality without it)."""
    from onnx import helper

    from pytrt_kv.ort import _float_math

    rng = np.random.default_rng(5)
    feeds = {"a": rng.standard_normal((3, 20, 64), np.float32)}
    feeds["b"] = rng.standard_normal((3, 20, 64), np.float32)
    nodes = [
        helper.make_node("Transpose", ["b"], ["bt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["a", "bt"], ["y"]),
    ]
    model, feeds = _graph(nodes, feeds)
    plain = _float_math.plain_tensors(model.graph)
    assert "bt" not in plain and {"a", "b"} <= plain
    _, ops = ort.rewrite_for_onnxruntime(model)
    rewritten, _ = ort.rewrite_for_onnxruntime(model)
    assert list(rewritten.graph.node[1].input) == ["b", "a"]  # the Transpose is replayed
    assert len(ops) == 1
    _same(model, feeds)
    plain_bt = np.ascontiguousarray(np.transpose(feeds["b"], (0, 2, 1)))
    strided = np.matmul(feeds["a"], np.transpose(feeds["b"], (0, 2, 1)))
    assert np.matmul(feeds["a"], plain_bt).tobytes() != strided.tobytes()


def test_onnxruntime_float_math_is_close_not_equal():
    """float_math="onnxruntime": ONNX Runtime's MatMul and Softmax; the data movement is
    still byte-equal, attention within the measured bound (docs/GRAPH_MODE.md)."""
    from onnx_export.example import build_example_model

    model = build_example_model()
    session = ort.make_session(model, float_math="onnxruntime")
    names = [o.name for o in session.get_outputs()]
    differs = 0
    for seed in range(3):
        feeds = make_feeds(model, seed=seed)
        got = dict(zip(names, session.run(None, feeds)))
        want = runtime.run(model, feeds)
        for name in names:
            if name == "attn_out":
                np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)
                differs += got[name].tobytes() != want[name].tobytes()
            else:
                assert got[name].tobytes() == want[name].tobytes(), name
    assert differs  # the mode is ONNX Runtime's kernels, not the reference


@pytest.mark.parametrize("bad", ["fast", "Reference", None, 1])
def test_unknown_float_math_is_refused(bad):
    model = single_op_model("ScatterPaKvCache", _scatter_feeds())
    with pytest.raises(ValueError) as info:
        ort.make_session(model, float_math=bad)
    text = str(info.value)
    assert text.startswith("float_math: expected one of ['reference', 'onnxruntime'], got ")
    assert repr(bad) in text
    with pytest.raises(ValueError, match="float_math: expected one of"):
        ort.rewrite_for_onnxruntime(model, bad)


def test_reference_refuses_subgraphs_onnxruntime_runs_them():
    from onnx import helper

    f32 = onnx.TensorProto.FLOAT
    branch = helper.make_graph(
        [helper.make_node("Exp", ["x"], ["e"])],
        "b",
        [],
        [helper.make_tensor_value_info("e", f32, [4])],
    )
    node = helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=branch, name="if0")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, []),
         helper.make_tensor_value_info("x", f32, [4])],
        [helper.make_tensor_value_info("y", f32, [4])],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    with pytest.raises(ValueError, match="float_math: 'reference' .*'if0' \\(If\\)"):
        ort.make_session(model)
    feeds = {"c": np.array(True), "x": np.arange(4, dtype=np.float32)}
    (y,) = ort.make_session(model, float_math="onnxruntime").run(None, feeds)
    np.testing.assert_allclose(y, np.exp(feeds["x"]), rtol=1e-6)


def test_reference_kernels_never_write_onnxruntime_buffers(monkeypatch):
    """A rewritten node gets read-only views of ONNX Runtime's buffers: an implementation
    that wrote its input would fail, not corrupt the session's tensors."""
    from pytrt_kv.ort import _float_math

    class Writes:
        rt_nodes_: list = []

        def run(self, names, feeds):
            x = feeds["x"]
            x += 1
            return [x]

    monkeypatch.setattr(_float_math, "implementation", lambda *a: Writes())
    x = np.arange(4, dtype=np.float32)
    model, feeds = _graph([onnx.helper.make_node("Exp", ["x"], ["y"], name="writes")], {"x": x})
    with pytest.raises(ValueError, match="read-only"):
        ort.make_session(model).run(None, feeds)
    assert feeds["x"].tobytes() == np.arange(4, dtype=np.float32).tobytes()
