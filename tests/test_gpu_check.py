"""scripts/gpu_check.sh, rehearsed without a GPU (issue 36): ``--dry-run`` runs every step's
small version on the emulated device and OUT/summary.md lists every step with its status,
also when a step fails, times out, the build fails, the budget runs out or the whole
command is stopped; without a GPU and without --dry-run it says so and runs nothing."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time

import pytest

from support.env import REPO

SCRIPT = REPO / "scripts" / "gpu_check.sh"
ROW = re.compile(r"^\| ([a-z0-9-]+) \| ([^|]*) \| ([^|]*) \| ([^|]*) \| ([^|]*) \| ([^|]*) \|$")


def _steps() -> list[str]:
    text = SCRIPT.read_text(encoding="utf-8")
    body = re.search(r"^STEPS=\((.*?)\)", text, re.M | re.S)
    assert body, "no STEPS=(...) in gpu_check.sh"
    return body.group(1).split()


STEPS = _steps()


def _emu_reason() -> str:
    from pytrt_kv import _lib

    if _lib.find(_lib.EMU_KERNELS_LIB) is None:
        return f"{_lib.EMU_KERNELS_LIB} was not built (scripts/test.sh builds it)"
    return ""


def _env(**extra: str) -> dict[str, str]:
    # TensorRT headers only where a test asks for them (plugin-harness).
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTRT_KV_", "TensorRT_", "TRITON_"))
    }
    env["PYTHON"] = sys.executable
    env.update(extra)
    return env


def _run(out, *args: str, timeout: int = 300, **extra: str):
    r = subprocess.run(
        ["bash", str(SCRIPT), *args, str(out)],
        env=_env(**extra),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return r, _summary(out)


def _summary(out) -> dict[str, dict[str, str]]:
    text = (out / "summary.md").read_text(encoding="utf-8")
    rows = {}
    for line in text.splitlines():
        m = ROW.match(line)
        if m and m.group(1) != "step":
            name, status, secs, limit, log, note = m.groups()
            rows[name] = {"status": status, "seconds": secs, "log": log, "note": note}
    rows["_text"] = {"text": text}
    return rows


def _listed_in_order(rows) -> None:
    assert [k for k in rows if k != "_text"] == STEPS


def test_the_steps_come_in_the_order_of_the_issue():
    # build -> GPU tests -> e4m3 NaN -> compute-sanitizer -> benchmarks (value per second).
    assert STEPS[:3] == ["build", "gpu-tests", "e4m3-nan"]
    assert STEPS[3:6] == ["memcheck", "racecheck", "synccheck"]
    assert [s for s in STEPS[6:] if s.startswith("bench-")] == STEPS[6:9]


@pytest.mark.skipif(bool(_emu_reason()), reason=_emu_reason() or "-")
def test_dry_run_lists_every_step_when_one_fails_and_one_times_out(tmp_path):
    r, rows = _run(
        tmp_path,
        "--dry-run",
        PYTRT_KV_CHECK_FAIL="e4m3-nan",
        PYTRT_KV_CHECK_HANG="racecheck",
        PYTRT_KV_CHECK_HANG_LIMIT="2",
        PYTRT_KV_CHECK_SAMPLE="60",  # 10 GPU tests: the step, not the tests, is checked here
    )
    assert r.returncode == 1, r.stdout + r.stderr
    _listed_in_order(rows)
    text = rows["_text"]["text"]
    for field in ("device: emulated device", "driver:", "date: 20", "commit: ", "sm_90"):
        assert field in text, field
    assert rows["e4m3-nan"]["status"] == "FAILED (rc 3)"
    assert rows["racecheck"]["status"] == "TIMEOUT after 2 s"
    assert "stopped after its limit" in (tmp_path / "racecheck.log").read_text()
    assert "Result: some steps FAILED" in text
    # Every other step ran its small version: passed, or simulated with the reason.
    for name in set(STEPS) - {"e4m3-nan", "racecheck", "plugin-harness"}:
        status = rows[name]["status"]
        assert status == "ok" or status.startswith("simulated: "), (name, status)
        assert (tmp_path / f"{name}.log").is_file(), name
    assert rows["plugin-harness"]["status"].startswith("skipped: no TensorRT headers (set ")
    assert rows["build"]["status"] in ("ok", "simulated: no nvcc here, nothing compiled")
    assert re.search(r"\d+ passed", rows["gpu-tests"]["note"]), rows["gpu-tests"]
    # compute-sanitizer is not here: the steps say so, and the workload ran on the emulator.
    assert "compute-sanitizer" in rows["memcheck"]["status"]
    assert "workload ran on the emulator" in rows["memcheck"]["status"]
    mem_log = (tmp_path / "memcheck.log").read_text()
    assert "compute-sanitizer --tool memcheck --error-exitcode 99" in mem_log
    assert "all kernel paths match the reference" in mem_log
    sync_log = (tmp_path / "synccheck.log").read_text()
    assert "compute-sanitizer --tool synccheck" in sync_log
    bench_log = (tmp_path / "bench-scatter.log").read_text()
    assert "bench --op scatter --output" in bench_log
    assert re.search(r"Triton (baseline skipped|scatter \(interpreted\) matches)", bench_log)


def _trt_headers():
    from support.env import trt_include_dir

    inc = trt_include_dir() or REPO / ".venv-test" / "trt-headers" / "include"
    return inc if (inc / "NvInfer.h").is_file() else None


@pytest.mark.skipif(
    _trt_headers() is None, reason="no TensorRT headers (scripts/test.sh gets them)"
)
def test_with_tensorrt_headers_the_plugin_cases_are_written(tmp_path):
    r, rows = _run(
        tmp_path,
        "--dry-run",
        "--steps",
        "plugin-harness",
        TensorRT_INCLUDE_DIR=str(_trt_headers()),
        PYTRT_KV_BUILD_DIR=str(tmp_path / "build"),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    status = rows["plugin-harness"]["status"]
    assert re.fullmatch(r"simulated: the harness enqueues on a GPU; its \d+ cases were written, "
                        r"commands built", status), status  # fmt: skip
    assert "pytrt_kv_plugin_harness run" in (tmp_path / "plugin-harness.log").read_text()


def test_a_wrong_tensorrt_folder_fails_the_plugin_step(tmp_path):
    r, rows = _run(
        tmp_path, "--dry-run", "--steps", "plugin-harness", TensorRT_INCLUDE_DIR=str(tmp_path)
    )
    assert r.returncode == 1
    assert rows["plugin-harness"]["status"] == "FAILED (rc 1)"
    assert "has no NvInfer.h" in (tmp_path / "plugin-harness.log").read_text()


@pytest.mark.skipif(bool(_emu_reason()), reason=_emu_reason() or "-")
def test_a_failed_build_stops_the_rest_and_they_are_listed(tmp_path):
    r, rows = _run(tmp_path, "--dry-run", PYTRT_KV_CHECK_FAIL="build")
    assert r.returncode == 1
    _listed_in_order(rows)
    assert rows["build"]["status"] == "FAILED (rc 3)"
    for name in STEPS[1:]:
        assert rows[name]["status"] == "not run: the build failed", name
    _check_bundle(tmp_path, ["build"])


def _check_bundle(out, logs: list[str]) -> None:
    # The device returns at most 8 files: two that hold everything, named to sort first.
    names = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    assert names[:2] == ["all-logs.txt", "all.tar.gz"], names
    text = (out / "all-logs.txt").read_text(encoding="utf-8")
    assert text.startswith((out / "summary.md").read_text(encoding="utf-8"))
    for name in logs:
        log = (out / f"{name}.log").read_text(encoding="utf-8")
        assert f"\n===== {name}.log =====\n{log}" in text, name
    with tarfile.open(out / "all.tar.gz") as tar:
        members = {m.name.removeprefix("./") for m in tar.getmembers() if m.isfile()}
    assert {"summary.md", "all-logs.txt", *(f"{n}.log" for n in logs)} <= members, members


def test_a_step_gets_what_is_left_of_the_budget_and_later_ones_none(tmp_path):
    r, rows = _run(
        tmp_path,
        "--dry-run",
        "--budget",
        "12",
        "--steps",
        "gpu-tests,e4m3-nan",
        PYTRT_KV_CHECK_HANG="gpu-tests",
        PYTRT_KV_CHECK_HANG_LIMIT="60",
    )
    assert r.returncode == 1
    _listed_in_order(rows)
    assert rows["build"]["status"] == "not selected"
    # 12 s of budget less 5 kept for the summary: the hanging step is cut at 6-7 s ...
    assert re.fullmatch(r"TIMEOUT after [67] s", rows["gpu-tests"]["status"]), rows["gpu-tests"]
    # ... and what is left is too little to start the next one.
    assert re.fullmatch(r"not run: budget spent \(\d s left of 12\)", rows["e4m3-nan"]["status"])
    assert all(rows[s]["status"] == "not selected" for s in STEPS[3:])


def test_a_stopped_command_still_leaves_the_summary(tmp_path):
    p = subprocess.Popen(
        ["bash", str(SCRIPT), "--dry-run", "--steps", "gpu-tests", str(tmp_path)],
        env=_env(PYTRT_KV_CHECK_HANG="gpu-tests", PYTRT_KV_CHECK_HANG_LIMIT="60"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    summary = tmp_path / "summary.md"
    deadline = time.monotonic() + 60
    while "| gpu-tests | running |" not in (summary.read_text() if summary.exists() else ""):
        assert time.monotonic() < deadline, "the step never started"
        time.sleep(0.2)
    os.killpg(p.pid, signal.SIGTERM)  # what `timeout` does to a command past its limit
    assert p.wait(timeout=30) == 1
    rows = _summary(tmp_path)
    _listed_in_order(rows)
    assert rows["build"]["status"] == "not selected"
    assert rows["gpu-tests"]["status"] == "TIMEOUT (the whole command was stopped)"
    assert all(rows[s]["status"] == "not reached" for s in STEPS[2:])
    assert "Result: some steps FAILED" in rows["_text"]["text"]


def test_without_a_gpu_the_real_run_says_so_and_runs_nothing(tmp_path):
    # The script's own test for a GPU (pytest here may run on the emulated device, which
    # pytrt_kv reports as a device).
    smi = shutil.which("nvidia-smi")
    if smi and subprocess.run([smi, "-L"], capture_output=True, timeout=60).returncode == 0:
        pytest.skip("a GPU is here: the real run would start")
    r, rows = _run(tmp_path, timeout=60)
    assert r.returncode == 2
    _listed_in_order(rows)
    assert all(rows[s]["status"] == "not run: no GPU" for s in STEPS)
    assert "no usable GPU" in rows["_text"]["text"]


def test_without_git_the_summary_names_the_commit_it_is_given(tmp_path):
    # The device machine gets the work tree without .git.
    (tmp_path / "tree" / "scripts").mkdir(parents=True)
    script = tmp_path / "tree" / "scripts" / "gpu_check.sh"
    script.write_text(SCRIPT.read_text(encoding="utf-8"), encoding="utf-8")
    for commit, want in (("abc1234", "commit: abc1234"), (None, "commit: unknown (no git")):
        env = _env(PYTRT_KV_CHECK_FAIL="build", GIT_CEILING_DIRECTORIES=str(tmp_path))
        if commit:
            env["PYTRT_KV_COMMIT"] = commit
        out = tmp_path / f"out-{commit}"
        r = subprocess.run(
            ["bash", str(script), "--dry-run", str(out)], env=env, capture_output=True, timeout=60
        )
        assert r.returncode == 1
        assert want in (out / "summary.md").read_text(), commit


def test_a_named_commit_wins_over_the_git_found_there(tmp_path):
    # The device machine's copy may carry an older .git than the session's (the H200 runs
    # of 2026-11-27 all said "9f634c6 (+ uncommitted changes)"): the name given wins.
    env = _env(PYTRT_KV_CHECK_FAIL="build", PYTRT_KV_COMMIT="abc1234")
    r = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", "--steps", "build", str(tmp_path)],
        env=env,
        capture_output=True,
        timeout=60,
    )
    assert r.returncode == 1
    assert "commit: abc1234 (named by PYTRT_KV_COMMIT)" in (tmp_path / "summary.md").read_text()


def test_carried_python_packages_are_on_the_path_and_named(tmp_path):
    # The lent machine has no onnx_graphsurgeon and no package index: without it the build
    # step stops at once saying how to carry it; with build/pycarry it is found there.
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    (tree / "scripts" / "gpu_check.sh").write_text(SCRIPT.read_text(encoding="utf-8"))
    py = tmp_path / "python-without-site"  # an interpreter that lacks onnx_graphsurgeon
    py.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    py.chmod(0o755)
    env = _env(PYTHON=str(py), GIT_CEILING_DIRECTORIES=str(tmp_path))
    env["PYTHONPATH"] = ""
    cmd = ["bash", str(tree / "scripts" / "gpu_check.sh"), "--dry-run", "--steps", "build"]
    subprocess.run([*cmd, str(tmp_path / "a")], env=env, capture_output=True, timeout=120)
    log = (tmp_path / "a" / "build.log").read_text()
    assert "onnx_graphsurgeon does not import" in log
    fill = "mkdir -p build/pycarry && cp -r .venv-test/lib/python3*/site-packages/"
    assert fill + "onnx_graphsurgeon build/pycarry/\n" in log
    assert (
        "carried Python packages: none (no build/pycarry)"
        in _summary(tmp_path / "a")["_text"]["text"]
    )
    (tree / "build" / "pycarry" / "onnx_graphsurgeon").mkdir(parents=True)
    (tree / "build" / "pycarry" / "onnx_graphsurgeon" / "__init__.py").write_text("")
    subprocess.run([*cmd, str(tmp_path / "b")], env=env, capture_output=True, timeout=120)
    assert "onnx_graphsurgeon does not import" not in (tmp_path / "b" / "build.log").read_text()
    text = _summary(tmp_path / "b")["_text"]["text"]
    assert "carried Python packages: build/pycarry (onnx_graphsurgeon)" in text


def test_scatter_targets_are_the_issues_and_the_torch_ratio_is_apart():
    from pytrt_kv.bench import judge_scatter

    # Rows as the H200 measured them (benchmarks/results/h200-2026-11-27).
    row = {"tokens": 1, "kernel_graph_us": 1.45, "vs_torch": 3.09, "copy_ratio": 0.75}
    judge_scatter(row)
    assert row["target"] == "<= 4.0 us (graph replay)"
    assert row["met"] is True and row["torch_5x"] is False
    row = {"tokens": 256, "kernel_graph_us": 4.01, "vs_torch": 9.0, "copy_ratio": 0.5}
    judge_scatter(row)
    assert row["met"] is False and row["torch_5x"] is True
    for ratio, met in ((0.93, True), (0.89, False)):
        row = {"tokens": 4096, "kernel_graph_us": 6.24, "vs_torch": 4.33, "copy_ratio": ratio}
        judge_scatter(row)
        assert (row["target"], row["met"]) == ("copy ratio >= 0.90", met)
        assert "torch_5x" not in row
    row = {"tokens": 1024, "kernel_graph_us": 2.85, "vs_torch": 3.1, "copy_ratio": 0.82}
    judge_scatter(row)
    assert "target" not in row and "met" not in row


H200 = REPO / "benchmarks" / "results" / "h200-2026-11-27"


@pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed"
)
def test_the_plot_script_draws_the_committed_h200_results(tmp_path):
    png = tmp_path / "bench.png"
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "plot_gpu_bench.py"), str(H200), "--output",
         str(png)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    # Quantise-on-write against copy bandwidth: 3 bytes moved per element against the
    # copy's 4, so 0.75 x 5.78 / 19.56 at 4096 tokens and 0.75 x 33.31 / 74.02 at 16384.
    assert "| 4096 | 19.56 | 5.78 | 0.22 |" in r.stdout, r.stdout
    assert "| 16384 | 74.02 | 33.31 | 0.34 |" in r.stdout, r.stdout


def test_the_plot_script_refuses_a_folder_without_results(tmp_path):
    (tmp_path / "bench-scatter.json").write_text('{"results": {"scatter": []}}')
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "plot_gpu_bench.py"), str(tmp_path), "--output",
         str(tmp_path / "x.png")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode != 0
    assert "expected results.scatter to be a non-empty list" in r.stderr
    assert not (tmp_path / "x.png").exists()


def test_help_shows_the_run_command(tmp_path):
    r = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    assert 'run(command="PYTRT_KV_COMMIT=' in r.stdout
    assert "PYTRT_KV_CHECK_HANG_LIMIT" in r.stdout and "set -uo" not in r.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "build,nope"], "unknown step 'nope'"),
        (["--budget", "5"], "--budget: expected whole seconds >= 10, got '5'"),
        (["--budget", "x"], "--budget: expected whole seconds >= 10, got 'x'"),
        (["--frobnicate"], "unknown option --frobnicate"),
    ],
)
def test_bad_arguments_are_refused_naming_them(tmp_path, args, message):
    r = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", *args, str(tmp_path)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 64
    assert message in r.stderr
    assert not (tmp_path / "summary.md").exists()
