"""The native build degrades cleanly: without a CUDA compiler CMake configures, records
why in build_info.json, and skips the kernels and plugins (the pure-Python package still
installs)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from support.env import REPO, cmake_command

CMAKE = cmake_command()


@pytest.mark.skipif(CMAKE is None, reason="cmake not installed (the test extra installs it)")
def test_configure_without_cuda_records_the_reason(tmp_path):
    # Only system folders on PATH, and no CUDACXX/CUDA hints: CMake must not find nvcc.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CUDA", "TensorRT")) and k != "CUDACXX"
    }
    assert CMAKE is not None
    cmake_dir = os.path.dirname(CMAKE)
    env["PATH"] = os.pathsep.join(dict.fromkeys([cmake_dir, "/usr/bin", "/bin"]))
    if shutil.which("nvcc", path=env["PATH"]):
        pytest.skip("nvcc sits in a system folder here; cannot hide it from CMake")
    r = subprocess.run(
        [
            CMAKE,
            "-S",
            str(REPO),
            "-B",
            str(tmp_path / "b"),
            "-DCMAKE_CUDA_COMPILER=",
            "-DCUDAToolkit_ROOT=/nonexistent",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no CUDA compiler (nvcc) was found" in r.stderr
    info = json.loads((tmp_path / "b" / "build_info.json").read_text())
    assert info["cuda"] == "OFF" and info["plugins"] == "OFF"
    assert "nvcc" in info["no_cuda_reason"]
