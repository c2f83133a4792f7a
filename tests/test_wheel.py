"""The binary wheel (scripts/build_wheel.sh; README "Install", docs/TENSORRT.md "Installing
the plugins"): built for one CUDA architecture (sm_89, to stay cheap), installed into a
fresh virtual environment with no nvcc on PATH and no TensorRT headers anywhere in its
environment, it builds a TensorRT-RTX engine for sm89 with the example model, using the
plugin library it carries.

Marked ``wheel``. Needs nvcc (to build the wheel), the package index (the build
backend, the TensorRT headers' wheel unless TensorRT_INCLUDE_DIR/TensorRT_ROOT name
headers, auditwheel, the wheel's dependencies) and the ``tensorrt-rtx`` wheel installed
beside pytest (scripts/test.sh installs the pinned one); skipped, saying which is missing,
otherwise. TensorRT-RTX reaches the fresh environment through a ``.pth`` file naming a
folder that links only its three packages (``tensorrt_rtx``, ``tensorrt_rtx_bindings``,
``tensorrt_rtx_libs``): a second 230 MB download would double this test's time, and
nothing else of the test environment (pytrt_kv above all) becomes visible. About a minute
on a 2-core machine (fresh compile of one architecture included).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBS = ("libpytrt_kv_kernels.so", "libpytrt_kv_plugins.so", "libpytrt_kv_plugins_autoreg.so")
RTX_PACKAGES = ("tensorrt_rtx", "tensorrt_rtx_bindings", "tensorrt_rtx_libs")
#: Variables that could lead a build or a library lookup to headers, nvcc or another
#: pytrt_kv: none reaches the fresh environment.
HIDDEN = (
    "PYTHONPATH",
    "PYTRT_KV_LIB_DIR",
    "PYTRT_KV_DEVICE",
    "TensorRT_INCLUDE_DIR",
    "TensorRT_ROOT",
    "CUDACXX",
    "CUDA_HOME",
    "CUDA_PATH",
    "CPATH",
    "CPLUS_INCLUDE_PATH",
    "VIRTUAL_ENV",
)


def _missing() -> str:
    if shutil.which("nvcc") is None and not os.environ.get("CUDACXX"):
        return "no nvcc on PATH (nor CUDACXX): the binary wheel cannot be built here"
    if importlib.util.find_spec("tensorrt_rtx") is None:
        return "the tensorrt-rtx wheel is not installed (python3 -m pip install '.[rtx]')"
    return ""


pytestmark = [pytest.mark.wheel, pytest.mark.skipif(bool(_missing()), reason=_missing() or "-")]


def _run(cmd, *, env=None, cwd=None, timeout=600):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    return r


def _bare_env(venv: Path) -> dict[str, str]:
    """This process's environment without nvcc on PATH and without header variables."""
    keep = [
        d
        for d in os.environ.get("PATH", "").split(os.pathsep)
        if d and not (Path(d) / "nvcc").exists()
    ]
    path = os.pathsep.join([str(venv / "bin"), *keep])
    assert shutil.which("nvcc", path=path) is None
    env = {k: v for k, v in os.environ.items() if k not in HIDDEN}
    return {**env, "PATH": path}


def _link_rtx(venv: Path, where: Path) -> None:
    where.mkdir()
    for name in RTX_PACKAGES:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.submodule_search_locations, name
        (where / name).symlink_to(Path(list(spec.submodule_search_locations)[0]))
    site = _run(
        [str(venv / "bin" / "python"), "-c", "import site; print(site.getsitepackages()[0])"]
    )
    assert site.returncode == 0, site.stderr
    Path(site.stdout.strip(), "tensorrt_rtx_only.pth").write_text(f"{where}\n")


def test_binary_wheel_builds_an_rtx_engine_without_nvcc_or_headers(tmp_path):
    # 1. The wheel, one architecture. TensorRT_INCLUDE_DIR (set by scripts/test.sh) spares
    #    a second download of the headers.
    dist = tmp_path / "dist"
    env = {
        **os.environ,
        "PYTRT_KV_CUDA_ARCHS": "89",
        "PYTRT_KV_WHEEL_WORK": str(tmp_path / "work"),
        "PYTHON": sys.executable,
    }
    r = _run(["bash", str(ROOT / "scripts" / "build_wheel.sh"), str(dist)], env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    wheels = list(dist.glob("pytrt_kv-*.whl"))
    assert len(wheels) == 1, r.stdout + r.stderr
    wheel = wheels[0]
    # py3-none (no Python C API but the stable ABI's small-push module), and a platform
    # tag that says what it needs.
    assert "-py3-none-manylinux_" in wheel.name or "-py3-none-linux_" in wheel.name, wheel.name
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"pytrt_kv/lib/{n}" for n in LIBS} <= names, sorted(names)
    assert "pytrt_kv/datadist/_smallpush.abi3.so" in names, sorted(names)
    assert not any(n.endswith(".h") for n in names)

    # 2. A fresh environment without nvcc and headers; the wheel from a plain pip install.
    venv = tmp_path / "fresh"
    r = _run([sys.executable, "-m", "venv", str(venv)])
    assert r.returncode == 0, r.stderr
    bare = _bare_env(venv)
    py = str(venv / "bin" / "python")
    r = _run(
        [py, "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheel)], env=bare
    )
    assert r.returncode == 0, r.stdout + r.stderr
    _link_rtx(venv, tmp_path / "rtx-only")

    # 3. The example model, an sm89 engine, from a folder outside the source tree.
    work = tmp_path / "user"
    work.mkdir()
    cli = str(venv / "bin" / "pytrt-kv")
    where = _run(
        [py, "-c", "import pytrt_kv._lib as l; print(l.require(l.PLUGINS_LIB))"], env=bare, cwd=work
    )
    assert where.returncode == 0, where.stderr
    plugins = Path(where.stdout.strip())
    assert venv in plugins.parents, plugins
    r = _run([cli, "export-example", "m.onnx"], env=bare, cwd=work)
    assert r.returncode == 0, r.stdout + r.stderr
    build = [cli, "build", "m.onnx", "--flavour", "rtx", "--target", "sm89"]
    r = _run(build, env=bare, cwd=work)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "wrote m.plan" in r.stdout, r.stdout
    assert (work / "m.plan").stat().st_size > 100_000

    # 4. Control: the same environment without the wheel's plugin library cannot build.
    plugins.unlink()
    (work / "m.plan").unlink()
    r = _run(build, env=bare, cwd=work)
    assert r.returncode != 0 and "libpytrt_kv_plugins.so" in r.stderr, r.stdout + r.stderr
    assert not (work / "m.plan").exists()
