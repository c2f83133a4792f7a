"""Shared test configuration: markers that skip cleanly where a GPU, TensorRT or the
TensorRT headers are absent (and say why), plus common fixtures."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=None)
def gpu_unavailable_reason() -> str:
    """'' when CUDA tests can run here, else why not."""
    from pytrt_kv import _lib
    from pytrt_kv.info import cuda_devices

    names, detail = cuda_devices()
    if not names:
        return f"no CUDA GPU ({detail})"
    if _lib.find(_lib.KERNELS_LIB) is None:
        return f"{_lib.KERNELS_LIB} was not built (see `pytrt-kv info`)"
    return ""


@functools.lru_cache(maxsize=None)
def trt_unavailable_reason() -> str:
    gpu = gpu_unavailable_reason()
    if gpu:
        return gpu
    if importlib.util.find_spec("tensorrt") is None:
        return "TensorRT Python package not installed"
    try:
        import tensorrt  # noqa: F401
    except Exception as exc:  # the stub wheels raise at import
        return f"tensorrt does not import: {exc}"
    return ""


def trt_include_dir() -> Path | None:
    """TensorRT headers from TensorRT_INCLUDE_DIR or TensorRT_ROOT/include, if set."""
    inc = os.environ.get("TensorRT_INCLUDE_DIR")
    if inc:
        return Path(inc)
    root = os.environ.get("TensorRT_ROOT")
    if root:
        return Path(root) / "include"
    return None


def polygraphy_command() -> list[str]:
    """The command that runs Polygraphy's CLI with this interpreter's installation.

    Never a ``polygraphy`` found on PATH: that may belong to another environment (or be
    there only because someone installed it by hand), and the test command does not put
    its virtual environment on PATH. The console script beside ``sys.executable`` is the
    one pip installed with the test extra; without it, the same entry point
    (``polygraphy.tools:main``; Polygraphy has no ``python -m polygraphy``).
    """
    script = Path(sys.executable).with_name("polygraphy")
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from polygraphy.tools import main; sys.exit(main())"]


def pytest_collection_modifyitems(config, items):
    del config
    for item in items:
        if "gpu" in item.keywords and gpu_unavailable_reason():
            item.add_marker(pytest.mark.skip(reason=gpu_unavailable_reason()))
        if "trt" in item.keywords and trt_unavailable_reason():
            item.add_marker(pytest.mark.skip(reason=trt_unavailable_reason()))
        if "trt_headers" in item.keywords:
            inc = trt_include_dir()
            if inc is None:
                item.add_marker(pytest.mark.skip(
                    reason="TensorRT headers: set TensorRT_INCLUDE_DIR (or TensorRT_ROOT)"))
            # Set but wrong is not skipped: the test fails on the missing headers.


@pytest.fixture(scope="session")
def lib():
    """The kernel library (ctypes), for tests of its host-side code; skipped where it was
    not built (no nvcc), but a failure when the installation says CUDA was built and the
    library is missing anyway."""
    from pytrt_kv import _cuda, _lib

    try:
        return _cuda.kernels()
    except FileNotFoundError as exc:
        if _lib.build_info().get("cuda") == "ON":
            pytest.fail(f"built with CUDA but the library is missing: {exc}")
        pytest.skip(str(exc))


@pytest.fixture
def rng() -> np.random.Generator:
    """Seeded generator: reproducible random data (never zeros, docs/ARCHITECTURE.md habit 7)."""
    return np.random.default_rng(20261121)
