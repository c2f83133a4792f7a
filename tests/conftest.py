"""Shared test configuration: markers that skip cleanly where a GPU, TensorRT or the
TensorRT headers are absent (and say why), plus common fixtures."""

from __future__ import annotations

import numpy as np
import pytest

from support.env import (
    gpu_unavailable_reason,
    real_gpu_unavailable_reason,
    select_device,
    trt_include_dir,
    trt_unavailable_reason,
)

# The emulated device's C++ builds, started in the background when the session starts
# (tests/test_emulator.py waits for them; docs/EMULATION.md).
pytest_plugins = ("support.emu_builds",)


def pytest_addoption(parser):
    parser.addoption(
        "--device",
        choices=("auto", "gpu", "emu"),
        default="auto",
        help="where `gpu` tests run: auto (a real GPU, else the emulated device when built), "
        "gpu (a real GPU only), emu (the emulated device, docs/EMULATION.md)",
    )


def pytest_configure(config):
    config._pytrt_kv_device = select_device(config.getoption("--device"))


def pytest_report_header(config):
    return config._pytrt_kv_device


def pytest_collection_modifyitems(config, items):
    del config
    for item in items:
        if "real_gpu" in item.keywords and real_gpu_unavailable_reason():
            item.add_marker(pytest.mark.skip(reason=real_gpu_unavailable_reason()))
        elif "gpu" in item.keywords and gpu_unavailable_reason():
            item.add_marker(pytest.mark.skip(reason=gpu_unavailable_reason()))
        if "trt" in item.keywords and trt_unavailable_reason():
            item.add_marker(pytest.mark.skip(reason=trt_unavailable_reason()))
        if "trt_headers" in item.keywords:
            inc = trt_include_dir()
            if inc is None:
                item.add_marker(
                    pytest.mark.skip(
                        reason="TensorRT headers: set TensorRT_INCLUDE_DIR (or TensorRT_ROOT)"
                    )
                )
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
