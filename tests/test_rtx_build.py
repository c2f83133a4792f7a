"""Real TensorRT engine builds on a CPU: TensorRT-RTX (the pinned ``tensorrt-rtx`` wheel,
installed by scripts/test.sh) parses every model the GPU engine tests use, plus the
example model, and builds it ahead of time for SM80, SM89 and SM120 with the project's
plugin library. The builder calls the plugins' whole build-side contract (createPlugin,
getOutputDataTypes, getOutputShapes, getAliasedInput, supportsFormatCombination,
configurePlugin, getWorkspaceSize, clone, getFieldsToSerialize); deserializing and
enqueue need a GPU (tests/test_trt_engine.py). See docs/TENSORRT.md, "TensorRT-RTX".

Skipped, with the reason, only where the wheel is not installed or the plugin library
was not built (no CUDA compiler or no TensorRT headers at install time).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from onnx_export import single_op_model
from pytrt_kv import _lib
from support.env import fix_kernel_archs, rtx_unavailable_reason, run_python
from support.models import (
    SMALL_RETRIEVAL,
    compress_model,
    engine_test_models,
    gather_model,
    quant_model,
    scatter_model,
)

TARGETS = ["sm80", "sm89", "sm120"]


pytestmark = pytest.mark.skipif(
    bool(rtx_unavailable_reason()), reason=rtx_unavailable_reason() or "-"
)

MODELS = engine_test_models()


@pytest.fixture(autouse=True)
def _kernel_archs(monkeypatch):
    """The installed kernels' architectures as scripts/test.sh builds them (a local build
    may hold fewer, e.g. PYTRT_KV_CUDA_ARCHS=90): these tests build plans, which never run
    the kernels; the architecture rule itself is tests/test_check_model.py's."""
    fix_kernel_archs(monkeypatch)


def _build(model, tmp_path, name="m.onnx", **kw):
    from pytrt_kv.trt import build_plan

    path = tmp_path / name
    onnx.save(model, path)
    return build_plan(path, flavour="rtx", targets=kw.pop("targets", TARGETS), **kw)


def test_every_engine_test_model_is_here():
    assert len(MODELS) >= 86 and len({i for i, _ in MODELS}) == len(MODELS)


#: Models whose plans TensorRT-RTX 1.7.1 serializes with the I/O tensor table in an order
#: that varies from build to build (seen on the example: same length, same bytes, tensor
#: records permuted; single-op models are byte-identical). For these the test compares
#: the plans as byte multisets.
UNORDERED_IO = {"example"}


def _assert_same_plan(first, again, unordered=False):
    assert len(first) > 1000
    if unordered:
        assert len(first) == len(again) and sorted(first) == sorted(again), (
            "the same model built twice gave plans with different contents"
        )
    else:
        assert first == again, "the same model built twice gave different plans"


@pytest.mark.parametrize(
    "model,unordered", [(m, i in UNORDERED_IO) for i, m in MODELS], ids=[i for i, _ in MODELS]
)
def test_static_build_is_non_empty_and_reproducible(tmp_path, model, unordered):
    _assert_same_plan(
        _build(model, tmp_path, "a.onnx"), _build(model, tmp_path, "b.onnx"), unordered
    )


# --- dynamic profiles ---------------------------------------------------------------------


def _dynamic(model, axes):
    """A copy of ``model`` whose inputs ``axes`` (name -> {axis: dim_param}) are dynamic,
    and the (min, opt, max) profile: 1 for each dynamic dim (``H`` for ``BH``) up to the
    static size."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    shapes = {}
    heads = None
    for inp in m.graph.input:
        if inp.name == "key" and len(inp.type.tensor_type.shape.dim) == 4:
            heads = inp.type.tensor_type.shape.dim[2].dim_value
    for inp in m.graph.input:
        if inp.name not in axes:
            continue
        dims = inp.type.tensor_type.shape.dim
        full = [d.dim_value for d in dims]
        low = list(full)
        for axis, param in axes[inp.name].items():
            dims[axis].dim_param = param
            low[axis] = heads if param == "BH" else 1
        shapes[inp.name] = (tuple(low), tuple(full), tuple(full))
    del m.graph.value_info[:]
    return m, shapes


_SCATTER_T = {n: {0: "T"} for n in ("key", "value", "slot_mapping")}
_COMPRESS_B = {
    **{n: {0: "B"} for n in ("key", "value", "slot_mapping", "compress_lens", "seq_lens")},
    "compress_seq_offsets": {0: "BH"},
}
_GATHER_B = {
    n: {0: "B"}
    for n in (
        "selection_kv_block_status",
        "selection_topk_indices",
        "full_kv_block_table",
        "full_kv_actual_seq",
        "full_q_actual_seq",
    )
}
DYNAMIC = (
    [(i, m, _SCATTER_T) for i, m in MODELS if i.startswith("scatter-")]
    + [(i, m, _COMPRESS_B) for i, m in MODELS if i.startswith("compress-")]
    + [(i, m, _GATHER_B) for i, m in MODELS if i.startswith("gather-") and "-bsnd-" in i]
)


@pytest.mark.parametrize(
    "model,axes", [(m, a) for _, m, a in DYNAMIC], ids=[i for i, _, _ in DYNAMIC]
)
def test_dynamic_profile_build_is_non_empty_and_reproducible(tmp_path, model, axes):
    dyn, shapes = _dynamic(model, axes)
    assert shapes, "no input was made dynamic"
    _assert_same_plan(
        _build(dyn, tmp_path, "a.onnx", shapes=shapes),
        _build(dyn, tmp_path, "b.onnx", shapes=shapes),
    )


def test_dynamic_input_without_a_profile_is_refused(tmp_path):
    dyn, _ = _dynamic(scatter_model("nd", "float16", "int32"), _SCATTER_T)
    with pytest.raises(
        ValueError, match=r"^shapes: expected min/opt/max shapes for the dynamic input"
    ):
        _build(dyn, tmp_path)


# --- broken models fail with the plugins' own messages ------------------------------------


def _set_attr(model, name, value):
    for a in model.graph.node[0].attribute:
        if a.name == name:
            a.CopyFrom(onnx.helper.make_attribute(name, value))
    return model


def _set_input(model, name, dims=None, elem_type=None):
    # The cache's *_out declaration follows it: prepare_for_tensorrt refuses a declared
    # output unlike the op's (issue 21), and these cases are about the plugins' checks.
    for inp in list(model.graph.input) + list(model.graph.output):
        if inp.name in (name, f"{name}_out"):
            tt = inp.type.tensor_type
            if elem_type is not None:
                tt.elem_type = elem_type
            if dims is not None:
                for d, v in zip(tt.shape.dim, dims):
                    d.dim_value = v
    del model.graph.value_info[:]
    return model


def test_bad_attribute_is_refused_before_tensorrt_as_by_the_runtime(tmp_path):
    """Issue 21: prepare_for_tensorrt makes the CPU runtime's model checks, so a bad
    attribute value fails with the runtime's message instead of the plugin field's."""
    from pytrt_kv import runtime

    model = _set_attr(scatter_model("nd", "float16", "int32"), "cache_layout", "ndz")
    want = (
        r"^node 'ScatterPaKvCache' \(ScatterPaKvCache\): attribute 'cache_layout': "
        r"expected one of \['nd', 'nz', 'hnd'\], got 'ndz'"
    )
    with pytest.raises(ValueError, match=want):
        runtime.make_evaluator(model)
    with pytest.raises(ValueError, match=want):
        _build(model, tmp_path, targets=["sm89"])


BROKEN = {
    "dtype-mismatch": (
        lambda: _set_input(
            scatter_model("nd", "float16", "int32"),
            "key_cache",
            elem_type=onnx.TensorProto.BFLOAT16,
        ),
        r"key_cache: expected dtype float16 \(same as key\)",
    ),
    "shape-mismatch": (
        lambda: _set_input(
            scatter_model("nd", "float16", "int32"), "key_cache", dims=(6, 8, 3, 16)
        ),
        r"key_cache: expected",
    ),
    "unsupported-dtype": (
        lambda: _set_input(
            _set_input(
                gather_model("float16", False, 4),
                "selection_topk_indices",
                elem_type=onnx.TensorProto.INT64,
            ),
            "selection_kv_block_status",
            elem_type=onnx.TensorProto.INT64,
        ),
        r"selection_kv_block_status: expected dtype in \['int32'\], got int64",
    ),
    "gather-shape-mismatch": (
        lambda: _set_input(gather_model("float16", False, 4), "full_kv_cache", dims=(24, 16, 16)),
        r"full_kv_cache: expected",
    ),
    "quant-scale-shape": (
        lambda: _set_input(
            quant_model("nd", "float16", "float8_e4m3fn", True), "k_scale", dims=(3,)
        ),
        r"k_scale: expected shape \[\] \(per tensor\) or \[H=2\] \(per head\)",
    ),
    "quant-scale-dtype": (
        lambda: _set_input(
            quant_model("nd", "float16", "int8", False),
            "v_scale",
            elem_type=onnx.TensorProto.FLOAT16,
        ),
        r"v_scale: expected dtype in \['float32'\], got float16",
    ),
    "compress-mode-dtype": (
        lambda: _set_attr(compress_model("int8", "int32", "omni"), "compress_mode", "rope"),
        r"key: expected a float dtype .* for compress_mode='rope'",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_model_is_refused_before_tensorrt(tmp_path, case):
    """Issue 17: these once reached the plugins' own checks inside TensorRT-RTX; the model
    checks (pytrt_kv.graph.lint) now refuse them first, with the CPU runtime's reason."""
    make, message = BROKEN[case]
    want = r"^node '\w+' \(\w+\): " + message + r".* \[schema\.(dtype|shape)\]$"
    with pytest.raises((ValueError, TypeError), match=want):
        _build(make(), tmp_path, targets=["sm89"])


@pytest.mark.parametrize("dtype", ["uint8", "float8_e5m2"])
def test_caches_tensorrt_cannot_carry_are_refused_by_name(tmp_path, dtype):
    from pytrt_kv import dtypes

    d = dtypes.numpy_dtype(dtype)
    model = single_op_model(
        "ScatterPaKvCache",
        {
            "key": np.zeros((3, 2, 16), d),
            "key_cache": np.zeros((4, 8, 2, 16), d),
            "slot_mapping": np.zeros(3, np.int32),
        },
        cache_layout="nd",
    )
    with pytest.raises(
        ValueError,
        match=rf"^node 'ScatterPaKvCache' \(ScatterPaKvCache\): key: expected a dtype TensorRT "
        rf"can pass to a plugin .*got {dtype} .*\[tensorrt\.dtype\]$",
    ):
        _build(model, tmp_path, targets=["sm89"])


# --- the build API ------------------------------------------------------------------------


def test_targets_are_parsed_and_checked(tmp_path):
    model = scatter_model("nd", "float16", "int32")
    assert _build(model, tmp_path, targets=["8.9", 120, "SM_80"]) == _build(
        model, tmp_path, targets=TARGETS
    )
    # SM70: the kernels lack it (pytrt_kv.graph.lint, before TensorRT); SM130 would run
    # the kernels' PTX but TensorRT-RTX does not know it.
    with pytest.raises(
        ValueError, match=r"^targets: expected compute capabilities the installed kernels .* SM70"
    ):
        _build(model, tmp_path, targets=["sm70"])
    with pytest.raises(
        ValueError, match=r"^targets: expected compute capabilities TensorRT-RTX .* got SM130"
    ):
        _build(model, tmp_path, targets=["sm130"])
    with pytest.raises(ValueError, match=r"^targets: expected compute capabilities such as"):
        _build(model, tmp_path, targets=["ampere"])


def test_without_targets_a_cpu_build_is_for_the_kernels_architectures(tmp_path, monkeypatch):
    """No GPU and no --target: the plan is for every compute capability TensorRT-RTX knows
    that the installed kernels run on, never SM75 (TensorRT-RTX's builder once failed there
    with a bare error about Turing FP32 GEMM, issue 31); without a record of the kernels'
    architectures the build is refused naming --target, before TensorRT builds anything."""
    import tensorrt_rtx

    from pytrt_kv import _driver
    from pytrt_kv.cli import main
    from pytrt_kv.graph import lint
    from pytrt_kv.trt import build

    monkeypatch.setattr(_driver, "cuda_devices", lambda: ([], "no CUDA driver (test)"))
    record = "80-real;86-real;89-real;90-real;120"
    assert build.default_rtx_targets(tensorrt_rtx, record) == [
        "SM80", "SM86", "SM89", "SM120", "SM121"
    ]  # fmt: skip
    assert build.default_rtx_targets(tensorrt_rtx, "89-real") == ["SM89"]
    model = scatter_model("nd", "float16", "int32")
    want = _build(model, tmp_path, "a.onnx", targets=["sm80", "sm86", "sm89", "sm120", "sm121"])
    assert _build(model, tmp_path, "b.onnx", targets=None) == want
    for bad, why in (("", "record no CUDA architectures"), ("100-real", "none of the")):
        monkeypatch.setattr(lint, "_installed_record", lambda bad=bad: bad)
        with pytest.raises(ValueError, match=rf"^targets: expected --target .*{why}"):
            _build(model, tmp_path, "c.onnx", targets=None)
        path = tmp_path / "c.onnx"
        assert main(["build", str(path), "--flavour", "rtx", "-o", str(tmp_path / "c.plan")]) == 1
        assert not (tmp_path / "c.plan").exists()


def test_targets_change_the_plan(tmp_path):
    model = scatter_model("nd", "float16", "int32")
    assert _build(model, tmp_path, targets=["sm80"]) != _build(model, tmp_path, targets=["sm120"])


def test_timing_cache_is_refused_with_rtx(tmp_path):
    with pytest.raises(ValueError, match=r"^timing_cache: expected none with TensorRT-RTX"):
        _build(scatter_model("nd", "float16", "int32"), tmp_path, timing_cache=tmp_path / "c.bin")


def test_engine_path_receives_the_plan(tmp_path):
    plan = _build(
        scatter_model("nd", "float16", "int32"), tmp_path, engine_path=tmp_path / "m.plan"
    )
    assert (tmp_path / "m.plan").read_bytes() == plan


def test_self_registering_library_registers_under_tensorrt_rtx():
    """libpytrt_kv_plugins_autoreg.so finds getPluginRegistry in libtensorrt_rtx.so.1
    (what `polygraphy --plugins` / ctypes.CDLL users get with TensorRT-RTX). Built against
    TensorRT 10 headers (another IPluginRegistry layout than TensorRT-RTX's) it must
    refuse cleanly instead of calling into the registry (docs/TENSORRT.md)."""
    if _lib.find(_lib.PLUGINS_AUTOREG_LIB) is None:
        pytest.fail(f"{_lib.PLUGINS_AUTOREG_LIB} missing beside {_lib.find(_lib.PLUGINS_LIB)}")
    code = (
        "from pytrt_kv.trt.plugins import load_plugins\n"
        "print(load_plugins('autoreg', flavour='rtx').name)\n"
    )
    r = run_python("-c", code, env={"PYTRT_KV_TENSORRT": "rtx"})
    headers = _lib.build_info().get("tensorrt_version", "")
    if headers.split(".")[0].isdigit() and int(headers.split(".")[0]) < 11:
        assert r.returncode == 1, r.stdout + r.stderr  # a Python error, not a crash
        assert (
            "built against TensorRT 10 headers" in r.stderr
            and "found no TensorRT plugin registry" in r.stderr
        )
    else:
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.strip() == _lib.PLUGINS_AUTOREG_LIB, r.stdout + r.stderr


def test_build_cli_prints_progress_and_writes_the_plan(tmp_path, capsys):
    from pytrt_kv.cli import main

    path = tmp_path / "m.onnx"
    onnx.save(scatter_model("nd", "float16", "int32", value=False), path)
    assert (
        main(
            [
                "build",
                str(path),
                "--flavour",
                "rtx",
                "--target",
                "sm89",
                "sm120",
                "-o",
                str(tmp_path / "m.plan"),
            ]
        )
        == 0
    )
    out, _ = capsys.readouterr()
    assert (tmp_path / "m.plan").stat().st_size > 1000
    assert "wrote" in out and " s" in out
    bad = tmp_path / "bad.onnx"
    onnx.save(_set_attr(scatter_model("nd", "float16", "int32"), "cache_layout", "ndz"), bad)
    assert main(["build", str(bad), "--flavour", "rtx", "--target", "sm89"]) == 1
    err = capsys.readouterr().err
    assert "pytrt-kv build: error:" in err and "cache_layout" in err


@pytest.mark.parametrize("representation", ["lowrank", "minmax", "mean"])
def test_retrieval_decode_step_builds_unchanged(tmp_path, representation):
    """The RetrievalKV decode-step graph (docs/RETRIEVAL.md) goes through the builder
    exactly as the CPU runtime runs it: standard ops plus the two plugins, host-resident
    full caches as plain inputs."""
    from onnx_export.retrieval import build_retrieval_decode_step
    from pytrt_kv.retrieval import RetrievalConfig
    from pytrt_kv.retrieval.demo import calibration_basis
    from pytrt_kv.retrieval.planner import RetrievalSizes

    small = dict(SMALL_RETRIEVAL, dense_boundary=0)
    cfg = RetrievalConfig(**small, topk_percent=0.2, representation=representation, rank=8)
    sizes = RetrievalSizes(max_len=1024)
    model = build_retrieval_decode_step(sizes, cfg, basis=calibration_basis(cfg, sizes))
    # Multi-node graph: the I/O table order varies between builds, as for the example model
    # (UNORDERED_IO above).
    first, again = _build(model, tmp_path, "a.onnx"), _build(model, tmp_path, "b.onnx")
    _assert_same_plan(first, again, unordered=True)


# --- one range per symbolic dimension (--dim) ----------------------------------------------


def test_dims_build_the_same_plan_as_per_input_shapes(tmp_path):
    dyn, shapes = _dynamic(scatter_model("nd", "float16", "int32"), _SCATTER_T)
    assert len(shapes) == 3  # key, value, slot_mapping share T
    by_input = _build(dyn, tmp_path, "a.onnx", shapes=shapes, targets=["sm89"])
    by_dim = _build(dyn, tmp_path, "b.onnx", dims={"T": (1, 9, 9)}, targets=["sm89"])
    assert by_dim == by_input


def test_dim_option_of_the_build_command(tmp_path, capsys):
    from pytrt_kv.cli import main

    dyn, _ = _dynamic(compress_model("float16", "int32", ""), _COMPRESS_B)
    path = tmp_path / "dyn.onnx"
    onnx.save(dyn, path)
    cmd = ["build", str(path), "--flavour", "rtx", "--target", "sm89", "--quiet", "--dim"]
    # Without a range for BH the build names the input that still needs one.
    assert main([*cmd, "B=1:2:2"]) == 1
    assert "compress_seq_offsets" in capsys.readouterr().err
    assert main([*cmd, "B=1:2:2", "Q=1"]) == 1
    assert "dims: expected names of dynamic dims" in capsys.readouterr().err
    assert main([*cmd, "B=1:2:2", "BH=3:6:6"]) == 0
    assert (tmp_path / "dyn.plan").stat().st_size > 1000


def test_load_engine_without_a_gpu_names_the_cause(monkeypatch, tmp_path):
    """Deserializing needs a CUDA device: without one, load_engine says that (with the
    driver's detail), not that the plan came from another TensorRT or lacks plugins."""
    from pytrt_kv import _driver
    from pytrt_kv.trt import load_engine

    detail = f"{_driver.NO_GPU}: libcuda.so.1 (the NVIDIA driver) not found"
    monkeypatch.setattr(_driver, "cuda_devices", lambda: ([], detail))
    plan = tmp_path / "m.plan"
    plan.write_bytes(b"x" * 100)
    with pytest.raises(RuntimeError) as err:
        load_engine(plan, flavour="rtx")
    msg = str(err.value)
    assert "cannot deserialize a TensorRT engine on this machine" in msg
    assert detail in msg and "(100 bytes) is not the problem" in msg
    assert "another TensorRT" not in msg


# --- the plugin library inside the plan (--serialize-plugins, issue 17 item 4) -------------


def test_serialize_plugins_puts_the_library_into_the_plan(tmp_path):
    """With TensorRT-RTX, serialize_plugins=True stores libpytrt_kv_plugins.so in the plan
    (IBuilderConfig::setPluginsToSerialize): the library's bytes are in it, and only then."""
    lib = _lib.find(_lib.PLUGINS_LIB)
    assert lib is not None
    blob = lib.read_bytes()
    model = scatter_model("nd", "float16", "int32")
    plain = _build(model, tmp_path, "a.onnx", targets=["sm89"])
    inside = _build(model, tmp_path, "b.onnx", targets=["sm89"], serialize_plugins=True)
    assert blob not in plain
    assert blob in inside
    assert len(inside) - len(plain) >= len(blob)


def test_serialize_plugins_option_of_the_build_command(tmp_path, capsys):
    from pytrt_kv.cli import main

    path = tmp_path / "m.onnx"
    onnx.save(scatter_model("nd", "float16", "int32"), path)
    cmd = ["build", str(path), "--flavour", "rtx", "--target", "sm89", "--quiet"]
    assert main([*cmd, "--serialize-plugins", "-o", str(tmp_path / "in.plan")]) == 0
    out = capsys.readouterr().out
    assert "in.plan carries the plugin library" in out and "host_code_allowed=True" in out
    assert _lib.find(_lib.PLUGINS_LIB).read_bytes() in (tmp_path / "in.plan").read_bytes()


def test_without_plan_serialization_the_loading_instructions_name_the_plan():
    """Full TensorRT (no version-compatible plans here) cannot carry the library: the
    build command prints these instructions with the plan path instead."""
    import types

    from pytrt_kv.trt import can_serialize_plugins, plugin_loading_instructions

    full = types.SimpleNamespace(__name__="tensorrt", IBuilderConfig=type("C", (), {}))
    assert not can_serialize_plugins(full)
    import tensorrt_rtx

    assert can_serialize_plugins(tensorrt_rtx)
    text = plugin_loading_instructions("out/m.plan")
    lib = str(_lib.find(_lib.PLUGINS_LIB))
    assert f"--loadEngine=out/m.plan --dynamicPlugins={lib}" in text
    assert "pytrt_kv.trt.load_engine('out/m.plan')" in text and "load_plugins" in text


# --- the ABI guard is quiet when the situation is handled (issue 17 item 4) ----------------


def _cli_build_in_a_new_process(tmp_path, model):
    import subprocess
    import sys

    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    cmd = [sys.executable, "-m", "pytrt_kv", "build", str(path), "--flavour", "rtx"]
    return subprocess.run(
        [*cmd, "--target", "sm89", "--quiet"], capture_output=True, text=True, timeout=300
    )


_NOTE = "plugin messages go to stderr, not to TensorRT's logger"


def _headers_major() -> int:
    text = _lib.build_info().get("tensorrt_version", "").split(".")[0]
    return int(text) if text.isdigit() else 0


def test_abi_guard_is_quiet_on_a_good_build(tmp_path):
    """A plugin library built against TensorRT 10 headers under TensorRT-RTX (11 layout)
    ignores RTX's logger finder and would print to stderr: handled, so a build in which the
    plugins have nothing to say prints nothing about it (it used to warn on every build)."""
    r = _cli_build_in_a_new_process(tmp_path, scatter_model("nd", "float16", "int32"))
    assert r.returncode == 0, r.stderr
    assert "[pytrt_kv]" not in r.stderr and "ILoggerFinder" not in r.stderr, r.stderr


def test_abi_guard_says_why_once_when_a_message_goes_to_stderr(tmp_path):
    """Where the layouts differ and a plugin message does go to stderr, one note says why
    (and only then); with headers of the loaded layout there is none. The message comes
    from the plugin creator, given a field it does not know: a broken model can no longer
    reach the plugins, the model checks refuse it first (docs/GRAPH_MODE.md)."""
    import subprocess
    import sys

    probe = (
        "import numpy as np\n"
        "from pytrt_kv.trt import import_tensorrt, load_plugins\n"
        "trt = import_tensorrt('rtx')\n"
        "load_plugins(flavour='rtx')\n"
        "c = trt.get_plugin_registry().get_creator('ScatterPaKvCache', '1', 'pytrt_kv')\n"
        "f = trt.PluginField('not_a_field', np.array([1], np.int32), trt.PluginFieldType.INT32)\n"
        "p = c.create_plugin('s', trt.PluginFieldCollection([f]), trt.TensorRTPhase.BUILD)\n"
        "print('created', p is not None)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert r.returncode == 0 and "created False" in r.stdout, r.stdout + r.stderr
    if 0 < _headers_major() < 11:
        # One line of its own (the failed build's error message repeats it, as it does
        # every plugin line).
        notes = [ln for ln in r.stderr.splitlines() if ln.startswith("[pytrt_kv] NOTE:")]
        assert len(notes) == 1 and _NOTE in notes[0], r.stderr
        assert "TensorRT 10 headers" in notes[0]
        assert "[pytrt_kv] ERROR: pytrt_kv::" in r.stderr, r.stderr
    else:
        assert _NOTE not in r.stderr, r.stderr
