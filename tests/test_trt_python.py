"""pytrt_kv.trt on any CPU: clear errors without TensorRT, the ONNX rewrite into the
plugins' positional form, alias pairs, buffer/stream adapters, CLI. No TensorRT needed."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import types

import ml_dtypes
import numpy as np
import onnx
import pytest

import pytrt_kv.trt as ptrt
from onnx_export import single_op_model
from pytrt_kv.contract import specs
from pytrt_kv.trt import _tensorrt, buffers
from pytrt_kv.trt import build as trt_build
from pytrt_kv.trt import model as trt_model
from pytrt_kv.trt import runner as trt_runner
from support.env import run_python
from support.models import reference_scatter
from support.op_names import SCATTER_INPUTS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def no_tensorrt(monkeypatch):
    """Make `import tensorrt` and `import tensorrt_rtx` fail whatever is installed."""
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    monkeypatch.setitem(sys.modules, "tensorrt_rtx", None)
    monkeypatch.delenv("PYTRT_KV_TENSORRT", raising=False)


def _fake_trt(monkeypatch, version):
    monkeypatch.delenv("PYTRT_KV_TENSORRT", raising=False)
    monkeypatch.setitem(sys.modules, "tensorrt_rtx", None)  # no fallback to TensorRT-RTX
    mod = types.ModuleType("tensorrt")
    mod.__version__ = version
    monkeypatch.setitem(sys.modules, "tensorrt", mod)
    return mod


# --- no TensorRT: every entry point explains itself -------------------------------------


def _prepare_refused(model, match: str, error: type[Exception] = ValueError) -> None:
    """trt_model.prepare_for_tensorrt(model) raises ``error`` matching ``match``."""
    with pytest.raises(error, match=match):
        trt_model.prepare_for_tensorrt(model)


def test_import_does_not_load_tensorrt():
    code = (
        "import sys, pytrt_kv.trt, pytrt_kv.trt.model\n"
        "print([m for m in ('tensorrt', 'cuda', 'torch', 'cupy') if m in sys.modules])"
    )
    r = run_python("-c", code, env={"PYTHONPATH": REPO})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "call",
    [
        lambda: ptrt.build_engine("model.onnx"),
        lambda: ptrt.load_plugins(),
        lambda: ptrt.load_engine(b"plan"),
        lambda: ptrt.EngineRunner(object()),
        lambda: ptrt.run_model_steps("model.onnx", [{}]),
        lambda: _tensorrt.tensorrt_version(),
    ],
    ids=[
        "build_engine",
        "load_plugins",
        "load_engine",
        "EngineRunner",
        "run_model_steps",
        "tensorrt_version",
    ],
)
def test_clear_import_error_without_tensorrt(no_tensorrt, call, tmp_path, monkeypatch):
    # A valid model.onnx: the model checks run before TensorRT is imported (build_plan).
    monkeypatch.chdir(tmp_path)
    onnx.save(single_op_model("ScatterPaKvCache", _scatter_inputs(False)), "model.onnx")
    with pytest.raises(ImportError, match=r"TensorRT Python package.*pip install '[^']*\[trt\]'"):
        call()


def test_availability_names_tensorrt(no_tensorrt):
    reason = ptrt.availability()
    assert "TensorRT" in reason and "pip install" in reason


@pytest.mark.parametrize(
    "version,ok",
    [
        ("10.2.0.19", False),
        ("8.6.1", False),
        ("10.3.0", True),
        ("10.13.2.6", True),
        ("11.1.0", True),
    ],
)
def test_tensorrt_version_gate(monkeypatch, version, ok):
    _fake_trt(monkeypatch, version)
    if ok:
        assert _tensorrt.import_tensorrt().__version__ == version
    else:
        with pytest.raises(
            ImportError, match=r"TensorRT >= 10\.3, got " + version.replace(".", r"\.")
        ):
            _tensorrt.import_tensorrt()


def test_broken_tensorrt_import_is_reported(monkeypatch):
    class Broken(types.ModuleType):
        def __getattr__(self, name):
            raise RuntimeError("libnvinfer.so.10: cannot open shared object file")

    # A module whose attribute access fails like the stub wheel's lazy loader.
    monkeypatch.setitem(sys.modules, "tensorrt", Broken("tensorrt"))
    monkeypatch.setitem(sys.modules, "tensorrt_rtx", None)
    monkeypatch.delenv("PYTRT_KV_TENSORRT", raising=False)
    with pytest.raises(ImportError, match="import tensorrt. failed: RuntimeError: libnvinfer"):
        _tensorrt.import_tensorrt()


def test_check_cuda_unwraps_and_raises():
    class Err:
        def __init__(self, value, name):
            self.value, self.name = value, name

    assert _tensorrt.check_cuda((Err(0, "cudaSuccess"), 42), "x") == 42
    assert _tensorrt.check_cuda((Err(0, "cudaSuccess"), 1, 2), "x") == (1, 2)
    with pytest.raises(RuntimeError, match="cudaMalloc failed: cudaErrorMemoryAllocation"):
        _tensorrt.check_cuda((Err(2, "cudaErrorMemoryAllocation"), None), "cudaMalloc")


# --- the positional plugin form --------------------------------------------------------


def _scatter_inputs(value: bool, idx=np.int32, dtype=np.float16):
    d = {
        "key": np.ones((3, 2, 16), dtype),
        "key_cache": np.ones((4, 8, 2, 16), dtype),
        "slot_mapping": np.arange(3, dtype=idx),
    }
    if value:
        d["value"] = np.ones((3, 2, 8), dtype)
        d["value_cache"] = np.ones((4, 8, 2, 8), dtype)
    return d


def _compress_inputs(offsets: bool, idx=np.int32, dtype=np.float16):
    d = {
        "key": np.ones((2, 5, 3, 8), dtype),
        "value": np.ones((2, 5, 3, 8), dtype),
        "key_cache": np.ones((10, 8, 1, 8), dtype),
        "value_cache": np.ones((10, 8, 1, 8), dtype),
        "slot_mapping": np.zeros((2, 3), idx),
        "compress_lens": np.zeros((2, 3), idx),
        "seq_lens": np.zeros((2,), idx),
    }
    if offsets:
        d["compress_seq_offsets"] = np.zeros((6,), idx)
    return d


def _gather_inputs(rope: bool = True, dtype=np.float16):
    return {
        "selection_k_rope": np.ones((6, 16, 8) if rope else (0,), dtype),
        "selection_kv_cache": np.ones((6, 16, 32), dtype),
        "selection_kv_block_table": np.zeros((5, 2), np.int32),
        "selection_kv_block_status": np.zeros((2, 2, 1, 5), np.int32),
        "selection_topk_indices": np.zeros((2, 2, 1, 4), np.int32),
        "full_k_rope": np.ones((24, 16, 8) if rope else (0,), dtype),
        "full_kv_cache": np.ones((24, 16, 32), dtype),
        "full_kv_block_table": np.zeros((2, 6), np.int32),
        "full_kv_actual_seq": np.zeros((2,), np.int32),
        "full_q_actual_seq": np.zeros((2,), np.int32),
    }


def _attrs(op):
    # SBS = 16 in these shapes: the default TBS (64) does not divide it.
    return {"selection_topk_block_size": 4} if op == "GatherSelectionKvCache" else {}


def _initializers(m):
    return {i.name: onnx.numpy_helper.to_array(i) for i in m.graph.initializer}


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.int8])
def test_prepare_key_only_scatter_gets_empty_value_placeholders(dtype):
    m = single_op_model("ScatterPaKvCache", _scatter_inputs(False, dtype=dtype))
    before = m.SerializeToString()
    p = trt_model.prepare_for_tensorrt(m)
    assert m.SerializeToString() == before, "the input model must not change"
    node = p.graph.node[0]
    assert len(node.input) == 5 and len(node.output) == 2
    inits = _initializers(p)
    for k in (1, 3):
        a = inits[node.input[k]]
        assert a.shape == (0,) and a.dtype == np.dtype(dtype)
    assert (
        node.input[0] == "key" and node.input[2] == "key_cache" and node.input[4] == "slot_mapping"
    )
    assert node.output[0] == "key_cache_out" and node.output[1] not in {
        o.name for o in p.graph.output
    }
    assert len(set(node.output) | set(node.input)) == 7, "fresh names must be unique"
    onnx.checker.check_model(p)


@pytest.mark.parametrize("idx", [np.int32, np.int64])
def test_prepare_compress_without_offsets_gets_index_placeholder(idx):
    p = trt_model.prepare_for_tensorrt(
        single_op_model("ScatterPaKvCache", _compress_inputs(False, idx))
    )
    node = p.graph.node[0]
    assert len(node.input) == 8 and len(node.output) == 2
    off = _initializers(p)[node.input[6]]
    assert off.shape == (0,) and off.dtype == np.dtype(idx)
    # Every input but compress_seq_offsets (6) keeps its name; k_scale/v_scale: none given.
    assert [*node.input[:6], node.input[7]] == [*SCATTER_INPUTS[:6], SCATTER_INPUTS[7]]


@pytest.mark.parametrize(
    "op,inputs",
    [
        ("ScatterPaKvCache", _scatter_inputs(True)),
        ("ScatterPaKvCache", _compress_inputs(True, np.int64)),
        ("GatherSelectionKvCache", _gather_inputs(True)),
        ("GatherSelectionKvCache", _gather_inputs(False, np.int8)),
    ],
    ids=["scatter-3d", "scatter-4d", "gather", "gather-c8"],
)
def test_prepare_leaves_complete_nodes_alone(op, inputs):
    m = single_op_model(op, inputs, **_attrs(op))
    p = trt_model.prepare_for_tensorrt(m)
    assert list(p.graph.node[0].input) == list(m.graph.node[0].input)
    assert list(p.graph.node[0].output) == list(m.graph.node[0].output)
    assert len(p.graph.initializer) == len(m.graph.initializer)


def test_prepare_refuses_unknown_key_and_half_value():
    m = single_op_model("ScatterPaKvCache", _scatter_inputs(True))
    broken = onnx.ModelProto()
    broken.CopyFrom(m)
    broken.graph.node[0].input[3] = ""
    _prepare_refused(broken, "value, value_cache: expected both or neither")
    unknown = onnx.ModelProto()
    unknown.CopyFrom(m)
    unknown.graph.node[0].input[0] = "mystery"
    _prepare_refused(unknown, "key: expected a tensor with a known dtype and rank")


@pytest.mark.parametrize(
    "op,inputs,expected",
    [
        (
            "ScatterPaKvCache",
            _scatter_inputs(True),
            {"key_cache_out": "key_cache", "value_cache_out": "value_cache"},
        ),
        ("ScatterPaKvCache", _scatter_inputs(False), {"key_cache_out": "key_cache"}),
        (
            "GatherSelectionKvCache",
            _gather_inputs(True),
            {
                "selection_k_rope_out": "selection_k_rope",
                "selection_kv_cache_out": "selection_kv_cache",
                "selection_kv_block_status_out": "selection_kv_block_status",
            },
        ),
    ],
)
def test_alias_pairs_follow_specs(op, inputs, expected):
    p = trt_model.prepare_for_tensorrt(single_op_model(op, inputs, **_attrs(op)))
    pairs = trt_model.alias_pairs(p)
    assert pairs == expected
    spec = specs.get_op(op)
    for out, inp in pairs.items():
        assert spec.aliases[out] == inp


@pytest.mark.parametrize("alias_io,expected", [(1, True), (0, False)])
def test_needs_aliased_io(alias_io, expected):
    m = single_op_model("ScatterPaKvCache", _scatter_inputs(True), alias_io=alias_io)
    assert trt_model.needs_aliased_io(m) is expected


def test_example_model_prepares_and_aliases():
    from onnx_export.example import build_example_model

    m = build_example_model()
    p = trt_model.prepare_for_tensorrt(m)
    onnx.checker.check_model(p)
    pairs = trt_model.alias_pairs(p)
    graph_inputs = {i.name for i in p.graph.input}
    assert pairs, "the example updates caches in place"
    for out, inp in pairs.items():
        assert inp in graph_inputs
        node = next(n for n in trt_model.pytrt_kv_nodes(p) if out in n.output)
        spec = specs.OPS[node.op_type]
        k = list(node.output).index(out)
        assert node.input[spec.aliased_input_index(k)] == inp
    assert all(len(n.input) in (5, 8, 10) for n in trt_model.pytrt_kv_nodes(p))


def test_prepare_cli(tmp_path):
    src, dst = tmp_path / "m.onnx", tmp_path / "p.onnx"
    onnx.save(single_op_model("ScatterPaKvCache", _scatter_inputs(False)), src)
    r = run_python("-m", "pytrt_kv", "prepare", src, dst, env={"PYTHONPATH": REPO})
    assert r.returncode == 0, r.stderr
    assert len(onnx.load(dst).graph.node[0].input) == 5


# --- buffers and streams ----------------------------------------------------------------


class _Cai:
    def __init__(self, ptr, shape, typestr, strides=None, dtype=None):
        self.__cuda_array_interface__ = {
            "data": (ptr, False),
            "shape": shape,
            "typestr": typestr,
            "strides": strides,
            "version": 3,
        }
        if dtype is not None:
            self.dtype = dtype


@pytest.mark.parametrize(
    "typestr,name",
    [
        ("<f2", "float16"),
        ("<f4", "float32"),
        ("|i1", "int8"),
        ("<i4", "int32"),
        ("<i8", "int64"),
        ("|u1", "uint8"),
    ],
)
def test_as_buffer_reads_cuda_array_interface(typestr, name):
    v = buffers.as_buffer(_Cai(0x7000, (4, 3), typestr), "key")
    assert (v.address, v.shape, v.dtype, v.host) == (0x7000, (4, 3), name, False)


def test_as_buffer_bfloat16_through_the_objects_dtype():
    v = buffers.as_buffer(_Cai(0x10, (2,), "<V2", dtype=ml_dtypes.bfloat16), "key")
    assert v.dtype == "bfloat16"


def test_as_buffer_refuses_strided_views():
    with pytest.raises(ValueError, match=r"^key_cache: expected a C-contiguous CUDA array"):
        buffers.as_buffer(_Cai(0x10, (4, 3), "<f2", strides=(2, 8)), "key_cache")
    # Contiguous strides given explicitly are fine.
    assert buffers.as_buffer(_Cai(0x10, (4, 3), "<f2", strides=(6, 2)), "k").shape == (4, 3)


def test_as_buffer_raw_addresses_and_refusals():
    assert buffers.as_buffer(0x1234, "x").address == 0x1234
    handle = types.SimpleNamespace(handle=0x99)
    assert buffers.as_buffer(handle, "x").address == 0x99
    with pytest.raises(TypeError, match=r"^slot_mapping: expected a CUDA array"):
        buffers.as_buffer("not a buffer", "slot_mapping")


def test_as_buffer_refuses_cpu_torch_tensors():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"^key: expected a CUDA tensor.*got a CPU tensor"):
        buffers.as_buffer(torch.ones(1), "key")  # int(tensor) would silently be 1


def test_stream_handle():
    assert buffers.stream_handle(None) == 0
    assert buffers.stream_handle(7) == 7
    assert buffers.stream_handle(types.SimpleNamespace(cuda_stream=11)) == 11  # torch
    assert buffers.stream_handle(types.SimpleNamespace(ptr=12)) == 12  # CuPy
    with pytest.raises(TypeError, match=r"^stream: expected None, an int"):
        buffers.stream_handle("default")


def test_default_aliases_use_specs_naming():
    outs = ["key_cache_out", "value_cache_out", "attn_out", "selection_kv_actual_seq"]
    ins = ["key", "key_cache", "value_cache"]
    assert trt_runner._default_aliases(outs, ins) == {
        "key_cache_out": "key_cache",
        "value_cache_out": "value_cache",
    }


def test_profile_spans_the_steps():
    feeds = [
        {"key": np.zeros((3, 2, 8)), "slot": np.zeros(3)},
        {"key": np.zeros((5, 2, 8)), "slot": np.zeros(5)},
        {"key": np.zeros((1, 2, 8)), "slot": np.zeros(1)},
    ]
    prof = ptrt._profile(feeds)
    assert prof["key"] == ((1, 2, 8), (3, 2, 8), (5, 2, 8))
    assert prof["slot"] == ((1,), (3,), (5,))
    with pytest.raises(ValueError, match=r"feeds_list: key: expected one rank"):
        ptrt._profile([{"key": np.zeros((3, 2))}, {"key": np.zeros((3, 2, 1))}])
    with pytest.raises(ValueError, match="feeds_list: expected at least one step"):
        ptrt.run_model_steps("m.onnx", [])


@pytest.mark.parametrize("case", ["key_only", "alibi_without_offsets"])
def test_prepared_model_runs_on_the_cpu_reference(case):
    # `polygraphy run --trt --pytrt-kv-ref` feeds one model to both runners: the CPU
    # runtime must read the placeholders of a prepared model as absent inputs.
    from pytrt_kv.runtime import run

    rng = np.random.default_rng(7)
    inputs = _scatter_inputs(False) if case == "key_only" else _compress_inputs(False, np.int32)
    for k, v in inputs.items():  # random data, valid indices: nothing is a no-op write
        if v.dtype == np.float16:
            inputs[k] = rng.standard_normal(v.shape).astype(np.float16)
    if case == "alibi_without_offsets":
        inputs["seq_lens"] = np.array([5, 4], np.int32)
        inputs["compress_lens"] = np.array([[2, 5, 0], [4, 1, 3]], np.int32)
        inputs["slot_mapping"] = np.array([[0, 8, 20], [30, 40, 50]], np.int32)
    p = trt_model.prepare_for_tensorrt(single_op_model("ScatterPaKvCache", inputs))
    got = run(p, inputs)
    want = {k: v.copy() for k, v in inputs.items()}
    reference_scatter(want)
    assert not np.array_equal(
        want["key_cache"].view(np.uint8), inputs["key_cache"].view(np.uint8)
    ), "the case writes nothing"
    np.testing.assert_array_equal(
        got["key_cache_out"].view(np.uint8), want["key_cache"].view(np.uint8)
    )
    if "value_cache" in inputs:
        np.testing.assert_array_equal(
            got["value_cache_out"].view(np.uint8), want["value_cache"].view(np.uint8)
        )


def test_empty_batch_rope_offsets_are_not_read_as_a_placeholder():
    # B == 0: a real compress_seq_offsets [B*H] has the placeholder's shape; the model's
    # explicit rope mode must still see it (reading it as absent would refuse rope).
    from pytrt_kv.runtime import run

    inputs = _compress_inputs(True, np.int32)
    for k in ("key", "value"):
        inputs[k] = inputs[k][:0]
    for k in ("slot_mapping", "compress_lens"):
        inputs[k] = inputs[k][:0]
    inputs["seq_lens"] = inputs["seq_lens"][:0]
    inputs["compress_seq_offsets"] = inputs["compress_seq_offsets"][:0]
    m = single_op_model("ScatterPaKvCache", inputs, compress_mode="rope")
    got = run(m, inputs)
    np.testing.assert_array_equal(got["key_cache_out"], inputs["key_cache"])


# --- EngineRunner / CudaGraph / build_engine with fake TensorRT and CUDA -------------------

_TRT = types.SimpleNamespace(
    DataType=types.SimpleNamespace(HALF="half", INT32="int32"),
    TensorIOMode=types.SimpleNamespace(INPUT="in", OUTPUT="out"),
)


class _FakeContext:
    def __init__(self, engine):
        self.engine, self.out_shapes, self.addresses = engine, dict(engine.out_shapes), {}
        self.fail_at = None  # execute_async_v3 call number that returns False
        self.executions = 0

    def set_input_shape(self, name, shape):
        return True

    def get_tensor_shape(self, name):
        return self.out_shapes[name]

    def set_tensor_address(self, name, address):
        self.addresses[name] = address
        return True

    def execute_async_v3(self, stream):
        self.executions += 1
        return self.executions != self.fail_at


class _FakeEngine:
    """name -> (mode, dtype, shape); get_tensor_shape calls are counted."""

    def __init__(self, tensors, aliases=None):
        self.tensors, self.aliases, self.shape_queries = tensors, dict(aliases or {}), 0
        self.out_shapes = {n: s for n, (m, _, s) in tensors.items() if m == "out"}
        self.num_io_tensors = len(tensors)

    def get_tensor_name(self, i):
        return list(self.tensors)[i]

    def get_tensor_mode(self, n):
        return self.tensors[n][0]

    def get_tensor_dtype(self, n):
        return self.tensors[n][1]

    def get_tensor_shape(self, n):
        self.shape_queries += 1
        return self.tensors[n][2]

    def create_execution_context(self):
        return _FakeContext(self)


class _FakeDeviceArray:
    freed: list = []
    _next = [0x10000]

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), dtype
        self.ptr = self._next[0]
        self._next[0] += 0x1000

    def view(self):
        return buffers.BufferView(self.ptr, self.shape, self.dtype)

    def __del__(self):
        _FakeDeviceArray.freed.append(self.ptr)


class _FakeCudart:
    class cudaStreamCaptureMode:
        cudaStreamCaptureModeThreadLocal = 2

    def __init__(self):
        self.calls, self.end_capture = [], (0, "graph")

    def cudaStreamSynchronize(self, s):
        return (0,)

    def cudaStreamBeginCapture(self, s, mode):
        self.calls.append("begin")
        return (0,)

    def cudaStreamEndCapture(self, s):
        self.calls.append("end")
        return self.end_capture

    def cudaGraphInstantiate(self, graph, flags):
        return (0, "exe")

    def cudaGraphLaunch(self, exe, s):
        return (0,)

    def cudaGraphExecDestroy(self, exe):
        self.calls.append(("exec_destroy", exe))
        return (0,)

    def cudaGraphDestroy(self, graph):
        self.calls.append(("destroy", graph))
        return (0,)


_SCATTER_IO = {
    "key": ("in", "half", (3, 16)),
    "key_cache": ("in", "half", (8, 16)),
    "slot": ("in", "int32", (-1,)),
    "key_cache_out": ("out", "half", (8, 16)),
    "count": ("out", "int32", (4,)),
}


@pytest.fixture
def fake_runtime(monkeypatch):
    monkeypatch.setattr(trt_runner, "import_tensorrt", lambda *a, **k: _TRT)
    monkeypatch.setattr(trt_runner, "DeviceArray", _FakeDeviceArray)
    cudart = _FakeCudart()
    monkeypatch.setattr(trt_runner, "import_cudart", lambda: cudart)
    _FakeDeviceArray.freed.clear()
    return cudart


def _feeds(n_slots=3):
    return {
        "key": _Cai(0x100, (3, 16), "<f2"),
        "key_cache": _Cai(0x200, (8, 16), "<f2"),
        "slot": _Cai(0x300, (n_slots,), "<i4"),
    }


def test_runner_binds_aliases_and_queries_engine_shapes_once(fake_runtime, monkeypatch):
    eng = _FakeEngine(_SCATTER_IO)
    runner = trt_runner.EngineRunner(eng)
    assert runner.aliases == {"key_cache_out": "key_cache"}
    queries = eng.shape_queries
    checked = []
    check = runner._check
    monkeypatch.setattr(runner, "_check", lambda n, v, s: (checked.append(n), check(n, v, s)))
    runner.bind(_feeds())
    runner.bind(_feeds(2))
    assert eng.shape_queries == queries, "bind() must not re-query the engine's shapes"
    assert checked == ["key", "key_cache", "slot"] * 2, "one check per input per bind"
    assert runner.context.addresses["key_cache_out"] == 0x200
    with pytest.raises(ValueError, match=r"^key: expected shape \[3, 16\], got \[4, 16\]"):
        runner.bind({**_feeds(), "key": _Cai(0x100, (4, 16), "<f2")})
    with pytest.raises(TypeError, match=r"^slot: expected dtype int32, got int64"):
        runner.bind({**_feeds(), "slot": _Cai(0x300, (3,), "<i8")})  # dynamic: dtype still checked


def test_runner_refuses_two_outputs_on_one_input(fake_runtime):
    io = {**_SCATTER_IO, "other_out": ("out", "half", (8, 16))}
    with pytest.raises(
        ValueError,
        match=r"^aliases: expected at most one output per input, got "
        r"'key_cache_out' and 'other_out' both -> 'key_cache'",
    ):
        trt_runner.EngineRunner(_FakeEngine(io), aliases={"other_out": "key_cache"})
    with pytest.raises(ValueError, match="'key_cache_out' and 'other_out' both -> 'key_cache'"):
        trt_runner.EngineRunner(_FakeEngine(io, aliases={"other_out": "key_cache"}))


def test_runner_unknown_engine_dtype_names_the_tensor(fake_runtime):
    io = {**_SCATTER_IO, "weird": ("out", "FP4", (2,))}
    with pytest.raises(TypeError, match=r"^weird: expected a dtype in \[.*'float16'.*\], got FP4$"):
        trt_runner.EngineRunner(_FakeEngine(io))


def test_cuda_graph_keeps_runner_and_replaced_outputs_alive(fake_runtime):
    runner = trt_runner.EngineRunner(_FakeEngine(_SCATTER_IO))
    runner.bind(_feeds())
    old = runner.output("count").ptr
    graph = runner.capture_graph(5)
    assert fake_runtime.calls == ["begin", "end"]
    runner.context.out_shapes["count"] = (6,)  # a new shape: a new owned output
    runner.bind(_feeds())
    assert runner.output("count").ptr != old
    gc.collect()
    assert old not in _FakeDeviceArray.freed, "the captured graph still writes it"
    assert graph.buffers["count"].ptr == old and graph.bindings["count"].address == old
    del runner
    gc.collect()
    assert graph.runner.context.addresses["count"] != old  # the runner (context) is alive
    graph.launch(5)
    del graph
    gc.collect()
    assert old in _FakeDeviceArray.freed
    assert {("exec_destroy", "exe"), ("destroy", "graph")} <= set(fake_runtime.calls[2:])


@pytest.mark.parametrize("end", ["partial_graph", "invalidated"])
def test_capture_failure_ends_capture_and_keeps_the_original_error(fake_runtime, end):
    invalidated = types.SimpleNamespace(value=901, name="cudaErrorStreamCaptureInvalidated")
    fake_runtime.end_capture = (0, "partial") if end == "partial_graph" else (invalidated, None)
    runner = trt_runner.EngineRunner(_FakeEngine(_SCATTER_IO))
    runner.bind(_feeds())
    runner.context.fail_at = 2  # the warm-up passes, the captured execution fails
    with pytest.raises(RuntimeError, match="execute_async_v3 failed"):
        runner.capture_graph(5)
    assert fake_runtime.calls[:2] == ["begin", "end"]
    assert (("destroy", "partial") in fake_runtime.calls) == (end == "partial_graph")


class _FakeBuildConfig:
    def __init__(self, accept):
        self.accept, self.cache = accept, None

    def create_timing_cache(self, data):
        return types.SimpleNamespace(data=data, serialize=lambda: b"new cache")

    def set_timing_cache(self, cache, ignore_mismatch):
        assert ignore_mismatch is False
        self.cache = cache
        return self.accept

    def get_timing_cache(self):
        return self.cache


def _fake_build_trt(monkeypatch, accept):
    built = []
    config = _FakeBuildConfig(accept)
    network = types.SimpleNamespace(num_inputs=0)

    class Builder:
        def __init__(self, logger):
            pass

        def create_network(self, flags):
            return network

        def create_builder_config(self):
            return config

        def build_serialized_network(self, net, cfg):
            built.append(cfg)
            return b"plan"

    class Logger:
        WARNING, VERBOSE = "fake-warning", "fake-verbose"

        def __init__(self, level):
            pass

    trt = types.SimpleNamespace(
        Logger=Logger,
        Builder=Builder,
        NetworkDefinitionCreationFlag=types.SimpleNamespace(),
        OnnxParser=lambda net, logger: types.SimpleNamespace(parse=lambda data, path: True),
    )
    monkeypatch.setattr(trt_build, "import_tensorrt", lambda *a, **k: trt)
    monkeypatch.setattr(trt_build, "load_plugins", lambda *a, **k: None)
    monkeypatch.setattr(trt_build, "_LOGGERS", {})
    monkeypatch.setattr(trt_build, "load_engine", lambda plan, **kw: (plan, kw))
    return built


@pytest.mark.parametrize("accept", [False, True])
def test_build_refuses_a_timing_cache_tensorrt_rejects(tmp_path, monkeypatch, accept):
    built = _fake_build_trt(monkeypatch, accept)
    src, cache = tmp_path / "m.onnx", tmp_path / "cache.bin"
    onnx.save(single_op_model("ScatterPaKvCache", _scatter_inputs(False)), src)
    cache.write_bytes(b"cache from another GPU")

    def call():
        return ptrt.build_engine(
            src, timing_cache=cache, aliased_plugin_io=False, detailed_profile=False
        )

    if not accept:
        with pytest.raises(
            ValueError,
            match=r"^timing_cache: expected a timing cache TensorRT "
            r"accepts.*got .*cache\.bin$",
        ):
            call()
        assert not built and cache.read_bytes() == b"cache from another GPU"
    else:
        plan, kw = call()
        assert plan == b"plan" and "aliased_plugin_io" not in kw
        assert built and cache.read_bytes() == b"new cache"


# --- prepare_for_tensorrt refusals (issue: bad inputs found by fuzzing) -------------------


def test_prepare_refuses_an_eleventh_scatter_input():
    m = single_op_model("ScatterPaKvCache", _scatter_inputs(True))
    m.graph.node[0].input.extend(["", "", "", "", "", "extra"])
    _prepare_refused(m, r"inputs: expected at most 10 .*got 11")


def test_prepare_refuses_an_unnamed_cache_update():
    m = single_op_model("ScatterPaKvCache", _scatter_inputs(True))
    m.graph.node[0].output[0] = ""
    _prepare_refused(
        m,
        r"key_cache_out: expected a graph tensor \(output 0, the updated 'key_cache'; "
        r"an unnamed output would drop the cache update\)",
    )


def test_prepared_key_only_write_passes_checker_and_shape_inference():
    import onnx_export.schemas  # noqa: F401 - registers the schemas for the checker

    p = trt_model.prepare_for_tensorrt(single_op_model("ScatterPaKvCache", _scatter_inputs(False)))
    onnx.checker.check_model(p, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(p, strict_mode=True)
    assert inferred.graph.node[0].input[1].endswith("absent_value")


@pytest.mark.parametrize("dtype", ["uint8", "float8_e5m2"])
def test_prepare_refuses_dtypes_tensorrt_cannot_pass(dtype):
    from pytrt_kv import dtypes

    d = dtypes.numpy_dtype(dtype)
    m = single_op_model(
        "ScatterPaKvCache",
        {
            "key": np.ones((3, 2, 16), d),
            "key_cache": np.ones((4, 8, 2, 16), d),
            "slot_mapping": np.arange(3, dtype=np.int32),
        },
        cache_layout="nd",
    )
    _prepare_refused(m, rf"key: expected a dtype TensorRT can pass to a plugin.*got {dtype}")


def test_prepare_refuses_mixed_index_dtypes():
    m = single_op_model("ScatterPaKvCache", _scatter_inputs(True))
    for inp in m.graph.input:
        if inp.name == "slot_mapping":
            inp.type.tensor_type.elem_type = onnx.TensorProto.INT64
    m.graph.node[0].input.extend(["lens"])
    m.graph.input.append(onnx.helper.make_tensor_value_info("lens", onnx.TensorProto.INT32, [3]))
    # Static shapes: the shared model check (pytrt_kv.graph.lint) refuses it first, with
    # the contract's message, as the CPU runtime does.
    _prepare_refused(
        m,
        r"^node 'ScatterPaKvCache' \(ScatterPaKvCache\): compress_lens: expected dtype "
        r"int64 \(all index tensors share slot_mapping's dtype\), got int32 .*\[schema.dtype\]$",
    )


def test_cli_errors_are_one_line(tmp_path, capsys):
    from pytrt_kv.cli import main

    assert main(["prepare", str(tmp_path), str(tmp_path / "o.onnx")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "expected an ONNX file, got the directory" in err
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytrt_kv",
            "prepare",
            str(tmp_path / "missing.onnx"),
            str(tmp_path / "o.onnx"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0 and "no such file" in r.stderr, (
        r.stderr
    )


def test_runner_binds_zero_element_tensors_at_address_0_to_a_valid_buffer(fake_runtime):
    runner = trt_runner.EngineRunner(_FakeEngine(_SCATTER_IO))
    feeds = _feeds(0)
    feeds["slot"] = _Cai(0, (0,), "<i4")  # torch.empty(0, dtype=torch.int32).data_ptr() == 0
    runner.bind(feeds)
    bound = runner.context.addresses["slot"]
    assert bound != 0 and bound % 256 == 0
    feeds["key"] = _Cai(0, (3, 16), "<f2")
    with pytest.raises(
        ValueError, match=r"^key: expected a buffer with a non-null address for shape \[3, 16\]"
    ):
        runner.bind(feeds)


@pytest.mark.parametrize("version,ok", [("1.7.1.116", True), ("1.0.0", True), ("0.9.1", False)])
def test_tensorrt_rtx_version_gate(monkeypatch, version, ok):
    """TensorRT-RTX numbers its releases 1.x: its gate is its own, not TensorRT's 10.3."""
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    monkeypatch.delenv("PYTRT_KV_TENSORRT", raising=False)
    mod = types.ModuleType("tensorrt_rtx")
    mod.__version__ = version
    monkeypatch.setitem(sys.modules, "tensorrt_rtx", mod)
    if ok:
        assert _tensorrt.import_tensorrt() is mod and _tensorrt.flavour_of(mod) == "rtx"
    else:
        with pytest.raises(ImportError, match=r"TensorRT-RTX >= 1\.0, got 0\.9\.1"):
            _tensorrt.import_tensorrt("rtx")


def test_flavour_choice_is_checked(monkeypatch):
    with pytest.raises(
        ValueError, match=r"^flavour: expected one of \['rtx', 'tensorrt'\], got 'trt'"
    ):
        _tensorrt.import_tensorrt("trt")
    monkeypatch.setenv("PYTRT_KV_TENSORRT", "full")
    with pytest.raises(ValueError, match=r"^PYTRT_KV_TENSORRT: expected one of"):
        _tensorrt.import_tensorrt()


def test_shapes_from_dims_applies_one_range_per_symbolic_dim():
    """pytrt_kv.trt.shapes_from_dims (build --dim): every input using a named dim gets its
    range; static dims keep their size; unknown names and bad ranges are refused."""
    from pytrt_kv.trt import shapes_from_dims

    m = single_op_model("ScatterPaKvCache", _scatter_inputs(True))
    for inp in m.graph.input:
        if inp.name in ("key", "value", "slot_mapping"):
            inp.type.tensor_type.shape.dim[0].dim_param = "T"
    got = shapes_from_dims(m, {"T": (1, 4, 16)})
    assert sorted(got) == ["key", "slot_mapping", "value"]
    key = [d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim]
    assert got["key"] == ((1, *key[1:]), (4, *key[1:]), (16, *key[1:]))
    with pytest.raises(
        ValueError, match=r"dims: expected names of dynamic dims .*\['T'\].*\['B'\]"
    ):
        shapes_from_dims(m, {"T": (1, 4, 16), "B": (1, 1, 1)})
    with pytest.raises(ValueError, match=r"dims\['T'\]: expected 1 <= min <= opt <= max"):
        shapes_from_dims(m, {"T": (4, 2, 16)})


# --- issue 21, leftovers from fuzzing: prepare refuses what the runtime refuses -----------


def _gather_model():
    return single_op_model(
        "GatherSelectionKvCache", _gather_inputs(), **_attrs("GatherSelectionKvCache")
    )


def test_prepare_refuses_an_empty_required_input():
    m = single_op_model("ScatterPaKvCache", _scatter_inputs(True))
    m.graph.node[0].input[4] = ""
    _prepare_refused(m, r"slot_mapping: expected a graph tensor \(required input 4\), got none")


def test_prepare_refuses_a_nine_input_gather():
    m = _gather_model()
    del m.graph.node[0].input[9]
    _prepare_refused(m, r"full_q_actual_seq: expected a graph tensor \(required input 9\)")


def test_prepare_names_a_string_alias_io():
    m = _gather_model()
    node = m.graph.node[0]
    kept = [a for a in node.attribute if a.name != "alias_io"]
    del node.attribute[:]
    node.attribute.extend(kept + [onnx.helper.make_attribute("alias_io", "x")])
    _prepare_refused(m, r"attribute 'alias_io': expected INT, got STRING b?'x'", TypeError)


def test_prepare_refuses_a_gather_without_selection_kv_actual_seq_like_the_runtime():
    from pytrt_kv import runtime

    m = _gather_model()
    del m.graph.node[0].output[3]
    m.graph.output.remove(m.graph.output[3])
    want = r"selection_kv_actual_seq: expected a graph tensor \(output 3\), got none"
    with pytest.raises(ValueError, match=want):
        runtime.make_evaluator(m)
    _prepare_refused(m, want)


def test_prepare_refuses_contradicting_output_declarations_and_shared_caches():
    m = single_op_model("ScatterPaKvCache", _scatter_inputs(True))
    m.graph.output[1].type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    _prepare_refused(
        m,
        r"value_cache_out: expected float16\[4, 8, 2, 8\] \(the op's output, as "
        r"value_cache\), got float32\[4, 8, 2, 8\] declared by graph output 'value_cache_out'",
        TypeError,
    )
    m = single_op_model("ScatterPaKvCache", _scatter_inputs(True))
    m.graph.node[0].input[3] = "key_cache"
    _prepare_refused(m, r"value_cache: expected a graph tensor other than")


def test_zero_element_inputs_are_exempt_from_the_update_rules():
    """An empty placeholder updates nothing: its *_out may stay unnamed, and one empty
    tensor may stand for two inputs (issue 21: the shared model checks keep this)."""
    from pytrt_kv import runtime

    p = trt_model.prepare_for_tensorrt(single_op_model("ScatterPaKvCache", _scatter_inputs(False)))
    del p.graph.node[0].output[1]  # value_cache_out of the [0] value_cache placeholder
    assert len(trt_model.prepare_for_tensorrt(p).graph.node[0].output) == 2
    runtime.make_evaluator(p)
    m = single_op_model(
        "GatherSelectionKvCache", _gather_inputs(rope=False), **_attrs("GatherSelectionKvCache")
    )
    node = m.graph.node[0]
    node.input[5] = node.input[0]  # one empty k_rope tensor for both
    m.graph.input.remove(next(i for i in m.graph.input if i.name == "full_k_rope"))
    feeds = {k: v for k, v in _gather_inputs(rope=False).items() if k != "full_k_rope"}
    runtime.run(m, feeds)
    trt_model.prepare_for_tensorrt(m)
