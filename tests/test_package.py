"""Foundation: import hygiene, op identity, dtype tables, library lookup, CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pytrt_kv
from pytrt_kv import _lib
from pytrt_kv.cli import SUBCOMMANDS, build_parser, main
from pytrt_kv.contract import dtypes, specs
from support.env import run_python
from support.op_names import GATHER_INPUTS, SCATTER_INPUTS


def test_import_needs_no_optional_runtime():
    # `import pytrt_kv` (and the reference) must never pull in torch, TensorRT or CUDA.
    r = run_python(
        "-c",
        "import sys, pytrt_kv, pytrt_kv.reference, pytrt_kv.specs\n"
        "bad = [m for m in ('torch', 'tensorrt', 'cupy', 'cuda', 'pycuda', 'onnxruntime')"
        " if m in sys.modules]\n"
        "print(','.join(bad))",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "", f"imported eagerly: {r.stdout.strip()}"


def test_public_import_paths_are_the_contract():
    # pytrt_kv.specs and pytrt_kv.dtypes are public paths from before the contract layer:
    # they must be the very same modules, not copies.
    import importlib

    from pytrt_kv import contract

    for old, new in (("specs", "specs"), ("dtypes", "dtypes")):
        assert importlib.import_module(f"pytrt_kv.{old}") is getattr(contract, new)


def test_public_functions_are_the_reference():
    from pytrt_kv import reference

    assert pytrt_kv.scatter_pa_kv_cache is reference.scatter_pa_kv_cache
    assert pytrt_kv.gather_selection_kv_cache is reference.gather_selection_kv_cache
    # The public names of pytrt_kv.reference (docs/ops/*.md, README.md), each defined
    # there; their results are checked by tests/test_reference_*.py.
    assert sorted(reference.__all__) == [
        "RowPlan",
        "gather_selection_kv_cache",
        "id_size",
        "plan_row",
        "quantise",
        "scatter_pa_kv_cache",
    ]
    for name in reference.__all__:
        fn = getattr(reference, name)
        assert callable(fn) and fn.__module__ == "pytrt_kv.reference", name


@pytest.mark.parametrize("op", list(specs.OPS.values()), ids=lambda o: o.name)
def test_op_spec_is_consistent(op):
    assert len(set(op.input_names)) == len(op.input_names)
    assert len(set(op.output_names)) == len(op.output_names)
    for out, src in op.aliases.items():
        o, i = op.output(out), op.input(src)
        assert o.dtypes == i.dtypes and o.dtype_group == i.dtype_group
        assert op.aliased_input_index(op.output_index(out)) == op.input_index(src)
    for t in op.inputs + op.outputs:
        assert t.dtypes and all(d in dtypes.NUMPY for d in t.dtypes)
    for a in op.attributes:
        assert a.type in ("int", "string")
        if a.choices:
            assert a.default in a.choices
    assert op.attribute("alias_io").default == 1


def test_op_identity_matches_ops_md():
    # docs/SPEC.md section O and G1/S1: names and order are part of the contract.
    s = specs.SCATTER_PA_KV_CACHE
    assert s.name == "ScatterPaKvCache"
    assert s.input_names == SCATTER_INPUTS
    assert s.output_names == ("key_cache_out", "value_cache_out")
    assert s.attribute_names == ("cache_layout", "compress_mode", "alias_io")
    g = specs.GATHER_SELECTION_KV_CACHE
    assert g.name == "GatherSelectionKvCache"
    assert g.input_names == GATHER_INPUTS
    assert g.output_names == (
        "selection_k_rope_out",
        "selection_kv_cache_out",
        "selection_kv_block_status_out",
        "selection_kv_actual_seq",
    )
    assert g.attribute("selection_topk_block_size").default == 64
    assert specs.NAMESPACE == specs.DOMAIN == "pytrt_kv" and specs.PLUGIN_VERSION == "1"
    assert specs.ONNX_IR_VERSION == 10 and specs.ONNX_OPSET >= 17


def test_get_op_names_the_choices():
    with pytest.raises(ValueError, match="op_type.*GatherSelectionKvCache.*got 'Nope'"):
        specs.get_op("Nope")


@pytest.mark.parametrize("name", sorted(dtypes.NUMPY))
def test_dtype_tables_round_trip(name):
    np_dt = dtypes.NUMPY[name]
    assert dtypes.name_of(np_dt) == name
    assert dtypes.name_of(name) == name
    assert dtypes.ONNX_TO_NAME[dtypes.ONNX[name]] == name
    assert dtypes.itemsize(name) == np_dt.itemsize


def test_dtype_onnx_numbers_match_onnx():
    import onnx

    for name, num in dtypes.ONNX.items():
        assert onnx.helper.tensor_dtype_to_np_dtype(num) == dtypes.NUMPY[name], name


def test_dtype_unknown_is_a_type_error():
    with pytest.raises(TypeError, match="dtype: .*complex64.*expected one of"):
        dtypes.name_of(np.complex64)
    with pytest.raises(TypeError, match="dtype"):
        dtypes.name_of(object())


def test_missing_library_error_lists_searched_paths(tmp_path, monkeypatch):
    monkeypatch.setenv(_lib.LIB_DIR_ENV, str(tmp_path))
    with pytest.raises(FileNotFoundError) as exc:
        _lib.require("libpytrt_kv_does_not_exist.so")
    msg = str(exc.value)
    assert str(tmp_path / "libpytrt_kv_does_not_exist.so") in msg
    assert _lib.LIB_DIR_ENV in msg
    # What works from this repository (issue 17): the binary wheel, or headers by pip's
    # long option (Debian 12's pip has no -C).
    assert "scripts/build_wheel.sh" in msg
    assert "--config-settings=cmake.define.TensorRT_INCLUDE_DIR=" in msg


def test_env_override_is_searched_first(tmp_path, monkeypatch):
    (tmp_path / _lib.KERNELS_LIB).write_bytes(b"")
    monkeypatch.setenv(_lib.LIB_DIR_ENV, str(tmp_path))
    assert _lib.find(_lib.KERNELS_LIB) == tmp_path / _lib.KERNELS_LIB


def test_build_record_when_installed():
    # The CMake build installs build_info.json beside the libraries; when present it must
    # say whether CUDA was used, and give the reason when it was not.
    info = _lib.build_info()
    if not info:
        pytest.skip("package not installed through its CMake build (source tree on sys.path)")
    assert info["cuda"] in ("ON", "OFF")
    if info["cuda"] == "OFF":
        assert info["no_cuda_reason"]
    else:
        assert _lib.find(_lib.KERNELS_LIB) is not None, "CUDA build but no kernel library"


def test_cli_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name, _, _ in SUBCOMMANDS:
        assert name in out


def test_cli_without_command_prints_help(capsys):
    assert main([]) == 2
    assert "usage: pytrt-kv" in capsys.readouterr().out


def test_cli_info_runs(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"pytrt_kv {pytrt_kv.__version__}" in out
    assert "numpy" in out and "Native libraries" in out and "GPU" in out


@pytest.mark.parametrize("value", ["off", "false", "2", "yes"])
def test_a_small_push_switch_that_is_neither_0_nor_1_is_refused_by_name(capsys, monkeypatch, value):
    """PYTRT_KV_DATADIST_C is exact: a typo must not leave the C path on silently."""
    from pytrt_kv.datadist import smallpush

    monkeypatch.setenv(smallpush.ENV, value)
    with pytest.raises(ValueError, match=f"PYTRT_KV_DATADIST_C: expected '0' .* got {value!r}"):
        smallpush.load()
    assert main(["info"]) == 0  # info says so and goes on
    out = capsys.readouterr().out
    assert "small-push path    none: PYTRT_KV_DATADIST_C: expected '0'" in out
    assert "ONNX Runtime" in out
    monkeypatch.setenv(smallpush.ENV, " 1 ")
    assert smallpush.load() is smallpush.load()  # on (or None where not built), no error


def test_cli_info_says_which_small_push_path_runs(capsys, monkeypatch):
    """`pytrt-kv info` names the datadist small-push path: C (the module's file) when it
    loads, Python when it is turned off (docs/DATADIST.md decision 15)."""
    from pytrt_kv.datadist import smallpush

    monkeypatch.setenv(smallpush.ENV, "0")
    assert main(["info"]) == 0
    assert f"small-push path    Python ({smallpush.ENV}=0)" in capsys.readouterr().out
    monkeypatch.delenv(smallpush.ENV)
    c_path = smallpush.load()
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    if c_path is not None:
        assert f"small-push path    C ({c_path.__file__})" in out
    else:
        assert "small-push path    Python (the C module is not built here" in out


def test_module_entry_point():
    r = subprocess.run(
        [sys.executable, "-m", "pytrt_kv", "--help"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert "info" in r.stdout and "demo" in r.stdout


def test_cli_info_says_whether_tensorrt_can_run_engines(capsys, monkeypatch):
    """`pytrt-kv info` gives TensorRT's availability reason (it replaced `python -m
    pytrt_kv.trt availability`)."""
    from pytrt_kv import trt

    monkeypatch.setattr(trt, "availability", lambda: "no CUDA GPU (test reason)")
    assert main(["info"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "engines here" in x)
    assert "no CUDA GPU (test reason)" in line
    monkeypatch.setattr(trt, "availability", lambda: "")
    assert main(["info"]) == 0
    assert "usable" in next(x for x in capsys.readouterr().out.splitlines() if "engines here" in x)


def test_parser_subcommands_have_runners():
    parser = build_parser()
    # One CLI wing: every command is a module of pytrt_kv.cli (docs/ARCHITECTURE.md).
    assert all(module.startswith("pytrt_kv.cli.") for _, module, _ in SUBCOMMANDS)
    for name, _, _ in SUBCOMMANDS:
        positional = {
            "export-example": ["x.onnx"],
            "build": ["x.onnx"],
            "check": ["x.onnx"],
            "prepare": ["x.onnx", "y.onnx"],
            "generate": ["--prompt", "x"],
        }
        args = parser.parse_args([name] + positional.get(name, []))
        assert callable(args._run)


def test_numpy_of_onnx_covers_standard_types_and_names_the_input():
    import onnx

    assert dtypes.numpy_of_onnx(onnx.TensorProto.BFLOAT16) == dtypes.NUMPY["bfloat16"]
    assert dtypes.numpy_of_onnx(onnx.TensorProto.BOOL) == np.dtype(bool)
    assert dtypes.numpy_of_onnx(onnx.TensorProto.DOUBLE) == np.dtype(np.float64)
    with pytest.raises(TypeError, match="mask: expected an ONNX tensor type .* got type number 0"):
        dtypes.numpy_of_onnx(onnx.TensorProto.UNDEFINED, "mask")


def test_gpu_workload_imports_without_a_gpu():
    # scripts/gpu_workload.py only runs under scripts/gpu_check.sh on a GPU machine; its
    # imports must follow the package's moves here, where CI runs.
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "gpu_workload.py"
    spec = importlib.util.spec_from_file_location("gpu_workload", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert callable(module.main)
