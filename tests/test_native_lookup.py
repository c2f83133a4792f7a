"""Finding the native libraries and saying clearly when there is no driver or GPU.

- ``pytrt_kv._lib`` also searches the installed ``pytrt-kv`` distribution, so a
  ``pytrt_kv`` imported from a source checkout (no ``lib`` folder) still finds the
  installed libraries, and says so when there are none.
- Without a driver, the CUDA runtime reports "driver version is insufficient"; pytrt_kv
  says "no CUDA driver / GPU" instead (``pytrt_kv._driver.cuda_devices``,
  ``pytrt_kv._cuda.check_status`` used by ``pytrt_kv.ops``).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pytrt_kv import _cuda, _driver, _lib, info
from pytrt_kv.cli import info as info_command
from pytrt_kv.contract import limits


def _fake_distribution(root: Path, libs=(_lib.KERNELS_LIB,)) -> Path:
    """An installed-looking pytrt-kv (dist-info + pytrt_kv/lib) under ``root``."""
    dist = root / "pytrt_kv-0.1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: pytrt-kv\nVersion: 0.1.0\n")
    lib = root / "pytrt_kv" / "lib"
    lib.mkdir(parents=True)
    for name in libs:
        (lib / name).write_bytes(b"\x7fELF not really")
    return lib


def test_source_tree_import_finds_installed_libraries(tmp_path, monkeypatch):
    monkeypatch.delenv(_lib.LIB_DIR_ENV, raising=False)
    source_lib = tmp_path / "src" / "pytrt_kv" / "lib"  # never created
    monkeypatch.setattr(_lib, "_package_lib_dir", lambda: source_lib)
    installed = _fake_distribution(tmp_path / "site")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert _lib.installed_lib_dir() == installed
    assert _lib.search_dirs() == [source_lib, installed]
    assert _lib.find(_lib.KERNELS_LIB) == installed / _lib.KERNELS_LIB
    assert _lib.require(_lib.KERNELS_LIB) == installed / _lib.KERNELS_LIB


def test_package_lib_folder_comes_before_the_installed_one(tmp_path, monkeypatch):
    monkeypatch.delenv(_lib.LIB_DIR_ENV, raising=False)
    own = tmp_path / "own" / "pytrt_kv" / "lib"
    own.mkdir(parents=True)
    (own / _lib.KERNELS_LIB).write_bytes(b"own")
    monkeypatch.setattr(_lib, "_package_lib_dir", lambda: own)
    _fake_distribution(tmp_path / "site")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert _lib.find(_lib.KERNELS_LIB) == own / _lib.KERNELS_LIB


def test_source_tree_without_installation_says_so(tmp_path, monkeypatch):
    monkeypatch.delenv(_lib.LIB_DIR_ENV, raising=False)
    source_lib = tmp_path / "src" / "pytrt_kv" / "lib"
    monkeypatch.setattr(_lib, "_package_lib_dir", lambda: source_lib)
    monkeypatch.setattr(_lib, "installed_lib_dir", lambda: None)
    with pytest.raises(FileNotFoundError) as exc:
        _lib.require(_lib.KERNELS_LIB)
    msg = str(exc.value)
    assert "source tree" in msg and str(source_lib.parent) in msg
    assert "no installed pytrt-kv" in msg


def test_info_notes_a_source_tree_import(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(_lib.LIB_DIR_ENV, raising=False)
    source_lib = tmp_path / "src" / "pytrt_kv" / "lib"
    monkeypatch.setattr(_lib, "_package_lib_dir", lambda: source_lib)
    installed = _fake_distribution(tmp_path / "site")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(info, "cuda_devices", lambda: ([], "no CUDA driver / GPU: test"))
    assert info_command.run(None) == 0
    out = capsys.readouterr().out
    assert str(installed / _lib.KERNELS_LIB) in out
    assert "source tree" in out and str(installed) in out


class _NoDriver:
    """libcuda.so.1 whose cuInit fails (a driver without a usable GPU)."""

    @staticmethod
    def cuInit(flags):
        return 100  # CUDA_ERROR_NO_DEVICE


def test_cuda_devices_without_driver(monkeypatch):
    monkeypatch.delenv(_lib.DEVICE_ENV, raising=False)  # the real driver lookup

    def missing(name, *a, **k):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", missing)
    names, detail = info.cuda_devices()
    assert names == [] and detail.startswith(info.NO_GPU) and "libcuda.so.1" in detail


def test_cuda_devices_with_driver_but_no_gpu(monkeypatch):
    monkeypatch.delenv(_lib.DEVICE_ENV, raising=False)  # the real driver lookup
    monkeypatch.setattr(ctypes, "CDLL", lambda name, *a, **k: _NoDriver())
    names, detail = info.cuda_devices()
    assert names == [] and detail.startswith(info.NO_GPU) and "cuInit" in detail


@pytest.mark.parametrize("code", limits.STATUS_NO_GPU)
def test_check_status_says_no_driver_instead_of_insufficient(monkeypatch, code):
    monkeypatch.setattr(
        _driver,
        "cuda_devices",
        lambda: ([], f"{info.NO_GPU}: libcuda.so.1 (the NVIDIA driver) not found"),
    )

    def no_library():
        raise AssertionError("the no-GPU message must not need the library's strings")

    monkeypatch.setattr(_cuda.abi, "kernels", no_library)
    with pytest.raises(RuntimeError) as exc:
        _cuda.check_status(code, "key: cudaPointerGetAttributes")
    msg = str(exc.value)
    assert msg.startswith("key: cudaPointerGetAttributes: no CUDA driver / GPU")
    assert "insufficient" not in msg and "pytrt_kv.reference" in msg


def test_check_status_keeps_driver_errors_when_a_gpu_exists(monkeypatch):
    """With a GPU present, error 35 really means an old driver: the runtime's text stays."""
    monkeypatch.setattr(_driver, "cuda_devices", lambda: (["Some GPU"], "driver API 12.0"))

    class Lib:
        @staticmethod
        def pytrt_kv_get_last_error():
            return b""

        @staticmethod
        def pytrt_kv_error_string(code):
            return b"CUDA driver version is insufficient for CUDA runtime version"

    monkeypatch.setattr(_cuda.abi, "kernels", lambda: Lib)
    with pytest.raises(RuntimeError, match="insufficient"):
        _cuda.check_status(35, "x")


def test_ops_without_gpu_says_no_driver():
    """End to end through the built CUDA kernel library, in a process on the CUDA device
    (not the emulated one this session may use): without a driver, the no-GPU message."""
    if _lib.find(_lib.KERNELS_LIB) is None:
        pytest.skip(f"{_lib.KERNELS_LIB} not built (no nvcc at install time)")
    code = (
        "import numpy as np\n"
        "import pytrt_kv.ops as ops\n"
        "from pytrt_kv import info\n"
        "if info.cuda_devices()[0]:\n"
        "    print('GPU PRESENT')\n"
        "    raise SystemExit(0)\n"
        "key = np.ones((2, 1, 4), np.float32)\n"
        "cache = np.full((2, 2, 1, 4), 7, np.float32)\n"
        "try:\n"
        "    ops.scatter_pa_kv_cache(key, None, cache, None, np.array([0, 1], np.int32))\n"
        "except RuntimeError as e:\n"
        "    print('RAISED', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != _lib.DEVICE_ENV}
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert r.returncode == 0, r.stderr
    if "GPU PRESENT" in r.stdout:
        pytest.skip("a GPU is present: this checks the no-GPU message")
    assert "RAISED" in r.stdout and "no CUDA driver / GPU" in r.stdout, r.stdout
    assert "insufficient" not in r.stdout
