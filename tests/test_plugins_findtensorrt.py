"""cmake/FindTensorRT.cmake on fake header trees: variables, environment variables,
version parsing (TensorRT 10 and 11 spellings), the 10.3 floor and the message that
names the variable to set. Needs cmake only."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from support.env import REPO, cmake_command

CMAKE = cmake_command()

pytestmark = pytest.mark.skipif(
    CMAKE is None, reason="cmake not installed (the test extra installs it)"
)

V10 = (
    "#define NV_TENSORRT_MAJOR {0}\n#define NV_TENSORRT_MINOR {1}\n#define NV_TENSORRT_PATCH {2}\n"
)
V11 = (
    "#define TRT_MAJOR_ENTERPRISE {0}\n#define TRT_MINOR_ENTERPRISE {1}\n"
    "#define TRT_PATCH_ENTERPRISE {2}\n"
    "#define NV_TENSORRT_MAJOR TRT_MAJOR_ENTERPRISE\n"
    "#define NV_TENSORRT_MINOR TRT_MINOR_ENTERPRISE\n"
    "#define NV_TENSORRT_PATCH TRT_PATCH_ENTERPRISE\n"
)


def _headers(root: Path, template: str, version) -> Path:
    inc = root / "include"
    inc.mkdir(parents=True)
    (inc / "NvInferVersion.h").write_text(template.format(*version))
    (inc / "NvInferRuntime.h").write_text("// fake\n")
    return inc


def _configure(tmp: Path, args=(), env=None) -> str:
    proj = tmp / "proj"
    proj.mkdir(exist_ok=True)
    (proj / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.24)\nproject(probe NONE)\n"
        f'list(APPEND CMAKE_MODULE_PATH "{REPO / "cmake"}")\n'
        "find_package(TensorRT)\n"
        'message(STATUS "RESULT found=${TensorRT_FOUND} version=${TensorRT_VERSION} '
        'dirs=${TensorRT_INCLUDE_DIRS}")\n'
    )
    clean_env = {
        k: v for k, v in os.environ.items() if k not in ("TensorRT_ROOT", "TensorRT_INCLUDE_DIR")
    }
    r = subprocess.run(
        [str(CMAKE), "-S", str(proj), "-B", str(tmp / "b"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean_env, **(env or {})},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    shutil.rmtree(tmp / "b")
    return r.stdout + r.stderr


@pytest.mark.parametrize(
    "template,version,expected",
    [(V11, (11, 1, 0), "11.1.0"), (V10, (10, 8, 3), "10.8.3"), (V10, (10, 3, 0), "10.3.0")],
)
@pytest.mark.parametrize("how", ["var", "env", "root-var", "root-env"])
def test_found_from_variable_or_environment(tmp_path, template, version, expected, how):
    inc = _headers(tmp_path / "trt", template, version)
    root = inc.parent
    args, env = {
        "var": ([f"-DTensorRT_INCLUDE_DIR={inc}"], {}),
        "env": ([], {"TensorRT_INCLUDE_DIR": str(inc)}),
        "root-var": ([f"-DTensorRT_ROOT={root}"], {}),
        "root-env": ([], {"TensorRT_ROOT": str(root)}),
    }[how]
    out = _configure(tmp_path, args, env)
    assert f"RESULT found=TRUE version={expected} dirs={inc}" in out, out


def test_too_old_is_refused(tmp_path):
    inc = _headers(tmp_path / "trt", V10, (10, 2, 0))
    out = _configure(tmp_path, [f"-DTensorRT_INCLUDE_DIR={inc}"])
    assert "RESULT found=FALSE" in out and "needs 10.3 or newer" in out, out


def test_wrong_folder_names_the_variable(tmp_path):
    out = _configure(tmp_path, [f"-DTensorRT_INCLUDE_DIR={tmp_path / 'nowhere'}"])
    assert "RESULT found=FALSE" in out
    assert "has no NvInferVersion.h" in out and "Set TensorRT_INCLUDE_DIR" in out, out


def test_absent_says_what_to_set(tmp_path):
    out = _configure(tmp_path)
    if "RESULT found=TRUE" in out:
        pytest.skip("this machine has TensorRT headers in a default location")
    assert "Set TensorRT_INCLUDE_DIR" in out and "TensorRT_ROOT" in out, out


def test_variable_wins_over_environment(tmp_path):
    a = _headers(tmp_path / "a", V11, (11, 0, 0))
    b = _headers(tmp_path / "b", V10, (10, 9, 0))
    out = _configure(tmp_path, [f"-DTensorRT_INCLUDE_DIR={a}"], {"TensorRT_INCLUDE_DIR": str(b)})
    assert f"version=11.0.0 dirs={a}" in out, out


def test_root_without_headers_is_not_replaced_by_other_headers(tmp_path):
    out = _configure(tmp_path, [f"-DTensorRT_ROOT={tmp_path / 'empty-root'}"])
    assert "RESULT found=FALSE" in out and "TensorRT_ROOT=" in out, out


@pytest.mark.parametrize("variable", ["TensorRT_INCLUDE_DIR", "TensorRT_ROOT"])
@pytest.mark.parametrize("how", ["cmake", "environment"])
def test_project_refuses_a_given_path_without_headers(tmp_path, variable, how):
    """`pip install . -C cmake.define.TensorRT_INCLUDE_DIR=<wrong>` must fail, not install
    a package without plugins (the project's configure step is what pip runs)."""
    wrong = tmp_path / "no-headers-here"
    wrong.mkdir()
    env = {
        k: v for k, v in os.environ.items() if k not in ("TensorRT_ROOT", "TensorRT_INCLUDE_DIR")
    }
    # The TensorRT check does not depend on CUDA (CMakeLists.txt): with no CUDA compiler
    # (defined empty, so check_language(CUDA) does not probe) a configure takes well under
    # a second instead of the ~10 s of identifying nvcc.
    args = [str(CMAKE), "-S", str(REPO), "-B", str(tmp_path / "b"), "-DCMAKE_CUDA_COMPILER="]
    if how == "cmake":
        args.append(f"-D{variable}={wrong}")
    else:
        env[variable] = str(wrong)
    r = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode != 0, r.stdout + r.stderr
    assert f"{variable}={wrong}" in r.stderr and "Fix or unset" in r.stderr, r.stderr
