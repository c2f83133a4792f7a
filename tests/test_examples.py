"""Every script in examples/ runs as a user would run it and does what it says."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"


def run_example(name: str, tmp_path: Path, *args: str, timeout: int = 600):
    """Run examples/<name> in an empty folder (never the repository root, whose source
    folders would shadow the installed package), with this interpreter and environment."""
    return subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        cwd=tmp_path,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _ok(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r.stdout


def test_every_example_has_a_test():
    tested = {
        "export_graphsurgeon.py",
        "export_torch.py",
        "compare_polygraphy.py",
        "build_engine.py",
        "datadist_prefill_decode.py",  # run by tests/test_datadist_processes.py
    }
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


def test_export_graphsurgeon(tmp_path):
    out = _ok(run_example("export_graphsurgeon.py", tmp_path, "step.onnx"))
    assert out.count("every output bit-exact with the reference") == 3, out
    model = onnx.load(str(tmp_path / "step.onnx"))
    onnx.checker.check_model(model, full_check=True)
    assert [n.op_type for n in model.graph.node if n.domain == "pytrt_kv"] == [
        "ScatterPaKvCache",
        "GatherSelectionKvCache",
    ]


@pytest.mark.skipif(
    importlib.util.find_spec("torch") is None or importlib.util.find_spec("onnxscript") is None,
    reason="torch / onnxscript not installed (extra 'torch')",
)
def test_export_torch(tmp_path):
    out = _ok(run_example("export_torch.py", tmp_path, "t.onnx"))
    assert "== eager torch module, bit for bit (6 outputs)" in out, out
    model = onnx.load(str(tmp_path / "t.onnx"))
    assert [n.op_type for n in model.graph.node if n.domain == "pytrt_kv"] == [
        "ScatterPaKvCache",
        "GatherSelectionKvCache",
    ]


def test_compare_polygraphy(tmp_path):
    from pytrt_kv.trt import availability

    out = _ok(run_example("compare_polygraphy.py", tmp_path, "e.onnx"))
    reason = availability()
    if reason:
        assert "TensorRT runner not used" in out
        assert "pytrt-kv-ref vs numpy-step: PASSED" in out, out
    else:
        assert "pytrt-kv-ref vs numpy-step vs tensorrt: PASSED" in out, out
    assert (tmp_path / "e.onnx").is_file()


def test_build_engine(tmp_path):
    from pytrt_kv.trt import availability

    r = run_example("build_engine.py", tmp_path, "x.plan")
    out = _ok(r)
    assert (tmp_path / "x.onnx").is_file()
    reason = availability()
    if reason:
        # Says why, in the words of the library, and builds nothing.
        assert f"skipped: no engine can be built on this machine: {reason}" in out, out
        assert not (tmp_path / "x.plan").exists()
    else:
        assert "engine written:" in out and "engine outputs match the CPU runtime" in out, out
        assert (tmp_path / "x.plan").stat().st_size > 0
