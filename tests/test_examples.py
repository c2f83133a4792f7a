"""Every script in examples/ runs as a user would run it and does what it says."""

from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

from support.env import llama_unavailable_reason, polygraphy_command, polygraphy_env

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
        "compare_llama_polygraphy.py",
        "build_engine.py",
        "datadist_prefill_decode.py",  # run by tests/test_datadist_processes.py
        "datadist_layerwise.py",  # run by tests/test_datadist_layerwise.py
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


@pytest.mark.skipif(bool(llama_unavailable_reason()), reason=llama_unavailable_reason() or "-")
def test_compare_llama_polygraphy(tmp_path):
    """SmolLM2's decode graph: --pytrt-kv-ref agrees with transformers, in-process and with
    the printed `polygraphy run` command; the same command fails on a graph whose layer-5
    write stores the key in the value cache (the comparison can see a broken write)."""
    r = run_example("compare_llama_polygraphy.py", tmp_path, "llama", "--iterations", "1")
    out = _ok(r)
    assert "pytrt-kv-ref vs transformers: PASSED" in out, out
    cli = shlex.split(out.strip().splitlines()[-1])
    assert cli[:2] == ["polygraphy", "run"], out
    env = polygraphy_env(tmp_path)
    res = subprocess.run(polygraphy_command() + cli[1:], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-4000:]
    assert "Passed: 1/1 iterations" in log, log[-4000:]

    decode = tmp_path / "llama" / "decode.onnx"
    graph = onnx.load(str(decode), load_external_data=False)
    (node,) = [n for n in graph.graph.node if n.op_type == "ScatterPaKvCache" and
               n.input[2] == "key_cache_5"]  # fmt: skip
    node.input[1] = node.input[0]  # the value cache gets the key
    broken = decode.with_name("broken.onnx")  # beside llama_weights.bin, which it names
    onnx.save(graph, str(broken))
    res = subprocess.run(polygraphy_command() + cli[1:2] + [str(broken)] + cli[3:], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    log = res.stdout + res.stderr
    assert res.returncode != 0, log[-4000:]
    assert "FAILED | Output: 'value_cache_5_out'" in log, log[-4000:]


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
