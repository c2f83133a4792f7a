"""`pytrt-kv demo` end to end (in process, small sizes), including that it can fail."""

from __future__ import annotations

import argparse
import sys
import types

import numpy as np
import pytest

from pytrt_kv import runtime
from pytrt_kv.cli import demo

SMALL = [
    "--steps",
    "4",
    "--batch",
    "2",
    "--topk",
    "4",
    "--selection-block-size",
    "4",
    "--block-size",
    "4",
    "--max-blocks-per-seq",
    "3",
    "--num-blocks",
    "7",
    "--kv-dim",
    "16",
    "--rope-dim",
    "8",
    "--heads",
    "2",
    "--prompt-len",
    "2",
]


def _args(extra=()):
    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    return p.parse_args(SMALL + list(extra))


def _fake_trt(monkeypatch, availability, run_model_steps=None):
    mod = types.ModuleType("pytrt_kv.trt")
    mod.availability = lambda: availability
    if run_model_steps is not None:
        mod.run_model_steps = run_model_steps
    monkeypatch.setitem(sys.modules, "pytrt_kv.trt", mod)
    import pytrt_kv

    monkeypatch.setattr(pytrt_kv, "trt", mod, raising=False)


def test_demo_passes_and_prints_table(capsys, monkeypatch):
    _fake_trt(monkeypatch, "no GPU here (test)")
    assert demo.run(_args()) == 0
    out = capsys.readouterr().out
    assert "onnx.checker full_check passed" in out
    assert "kept in place" in out and "copied" in out
    rows = [line for line in out.splitlines() if line.strip()[:1].isdigit() and "|" in line]
    assert len(rows) == 4 and all(line.rstrip().endswith("ok") for line in rows)
    # kv_len grows one token per step; later steps reuse resident tokens.
    assert [r.split("|")[1].strip() for r in rows] == ["3,4", "4,5", "5,6", "6,7"]
    assert any(int(r.split("|")[3]) > 0 for r in rows[1:])
    assert "TensorRT engine: skipped (no GPU here (test))" in out
    assert "demo PASSED" in out


def test_demo_defaults_cli(capsys, tmp_path):
    from pytrt_kv.cli import main

    assert main(["demo", "--model", str(tmp_path / "d.onnx"), "--no-trt"]) == 0
    assert (tmp_path / "d.onnx").exists()
    assert "demo PASSED" in capsys.readouterr().out


@pytest.mark.parametrize(
    "name",
    ["attn_out", "selection_kv_cache_out", "full_kv_cache_out", "selection_kv_block_status_out"],
)
def test_demo_detects_wrong_results(name, capsys, monkeypatch):
    real_run = runtime.run
    calls = {"n": 0}

    def corrupt(model, feeds):
        out = real_run(model, feeds)
        calls["n"] += 1
        if calls["n"] == 2:
            x = out[name].copy()
            flat = x.reshape(-1)
            if name == "selection_kv_block_status_out":
                flat[0] = flat[1]  # a duplicate id
            elif name == "attn_out":
                flat[3] += 1e-3
            else:
                flat.view(np.uint8)[0] ^= 1
            out[name] = x
        return out

    monkeypatch.setattr(runtime, "run", corrupt)
    assert demo.run(_args(["--no-trt"])) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "demo FAILED" in out


def test_demo_compares_trt_steps(capsys, monkeypatch):
    seen = {}

    def steps(path, feeds_list):
        seen["n"] = len(feeds_list)
        outs = [runtime.run(path, f) for f in feeds_list]
        outs[-1]["selection_kv_actual_seq"] = outs[-1]["selection_kv_actual_seq"] + 1
        return outs

    _fake_trt(monkeypatch, "", steps)
    assert demo.run(_args()) == 1
    out = capsys.readouterr().out
    assert seen["n"] == 4
    assert "TensorRT step 4: selection_kv_actual_seq differs" in out

    _fake_trt(monkeypatch, "", lambda path, fl: [runtime.run(path, f) for f in fl])
    assert demo.run(_args()) == 0
    assert "4 steps match the CPU runtime" in capsys.readouterr().out


def test_demo_refuses_too_many_steps():
    with pytest.raises(ValueError, match="--prompt-len/--steps"):
        demo.run(_args(["--steps", "40"]))


@pytest.mark.parametrize("cuda", ["ON", "OFF"])
def test_demo_says_when_the_gpu_kernels_were_not_built(cuda, capsys, monkeypatch, tmp_path):
    # pip hides the build's warning, so the main job repeats it at run time.
    import json

    from pytrt_kv import _lib

    (tmp_path / "build_info.json").write_text(
        json.dumps(
            {"cuda": cuda, "no_cuda_reason": "no CUDA compiler (nvcc) was found at build time"}
        )
    )
    monkeypatch.setenv(_lib.LIB_DIR_ENV, str(tmp_path))
    _fake_trt(monkeypatch, "no GPU here (test)")
    assert demo.run(_args()) == 0
    out = capsys.readouterr().out
    assert ("GPU kernels: not built (no CUDA compiler (nvcc)" in out) == (cuda == "OFF")


def test_demo_steps_are_drawn_from_make_feeds(monkeypatch):
    """The demo's inputs come from the one valid-input generator (issue 21 item 4,
    docs/GRAPH_MODE.md): every step is a make_feeds dict with the decode state put in,
    and the CPU runtime accepts it."""
    from onnx_export.example import build_example_model
    from pytrt_kv import demo as demo_lib
    from pytrt_kv.cli.export_example import sizes_from_args
    from pytrt_kv.graph import feeds as feeds_mod

    calls = []
    real = feeds_mod.make_feeds

    def spy(model, seed=0, shapes=None, **kw):
        out = real(model, seed, shapes, **kw)
        calls.append(out)
        return out

    monkeypatch.setattr(feeds_mod, "make_feeds", spy)
    z = sizes_from_args(_args())
    model = build_example_model(z)
    rng = np.random.default_rng(0)
    state = demo_lib.initial_state(z, 2, rng, model)
    assert len(calls) == 1
    assert calls[0]["full_kv_cache"] is state["full_kv_cache"]
    for _ in range(2):
        f = demo_lib.step_feeds(z, state, rng, model)
        assert f["kv"] is calls[-1]["kv"] and f["q_nope"] is calls[-1]["q_nope"]
        assert list(f) == [i.name for i in model.graph.input]
        out = runtime.run(model, f)
        assert not demo_lib.verify_step(z, f, out, demo_lib.expected_step(z, f))[0]
        state = {**state, "kv_len": f["full_kv_actual_seq"]}
        state.update({k: out[k + "_out"] for k in ("full_kv_cache", "full_k_rope")})
        state.update(
            {
                k: out[k + "_out"]
                for k in ("selection_k_rope", "selection_kv_cache", "selection_kv_block_status")
            }
        )
    assert len(calls) == 3
