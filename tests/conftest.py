"""Shared test configuration: markers that skip cleanly where a GPU, TensorRT or the
TensorRT headers are absent (and say why), plus common fixtures."""

from __future__ import annotations

import ctypes
import gc
import os
import resource
import shutil
import sys
import tempfile

import numpy as np
import pytest

from pytrt_kv.model_cache import CACHE_ENV
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
    # The converted-GGUF cache (pytrt_kv.model_cache) in a folder of this session's, shared
    # by the tests and the processes they start: the first SmolLM2 load of the session
    # converts (as on a fresh machine), later ones read the folder; nothing goes to the
    # user's ~/.cache. A cache the caller names is used as it is.
    if CACHE_ENV not in os.environ:
        config._pytrt_kv_model_cache = tempfile.mkdtemp(prefix="pytrt-kv-models-")
        os.environ[CACHE_ENV] = config._pytrt_kv_model_cache


def pytest_unconfigure(config):
    folder = getattr(config, "_pytrt_kv_model_cache", None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(CACHE_ENV, None)


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


# --- No test process above the memory limit (issue 33: one process held 9.8 GB) ----------
# The suite runs in one pytest process (no xdist): its own peak RSS and that of the
# largest child it waited for (the subprocesses tests start) cover every test process.

#: The environment variable that sets the limit, in GiB (default 4).
MEMORY_LIMIT_ENV = "PYTRT_KV_TEST_MAX_RSS_GB"


def _memory_limit_gib() -> float:
    raw = os.environ.get(MEMORY_LIMIT_ENV, "4")
    try:
        gib = float(raw)
    except ValueError:
        gib = -1.0
    if not gib > 0:
        raise pytest.UsageError(
            f"{MEMORY_LIMIT_ENV}: expected a positive number of GiB, got {raw!r}"
        )
    return gib


def _peak_rss() -> dict[str, int]:
    """Peak resident set size in bytes of this process and of its largest waited child."""
    unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return {
        "pytest process": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit,
        "its largest waited child": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * unit,
    }


def _memory_verdict() -> tuple[dict[str, int], float, list[str]]:
    peaks, limit = _peak_rss(), _memory_limit_gib()
    over = [
        f"{who} peaked at {v / 2**30:.2f} GiB, above the {limit:g} GiB limit ({MEMORY_LIMIT_ENV})"
        for who, v in peaks.items()
        if v > limit * 2**30
    ]
    return peaks, limit, over


def pytest_sessionstart(session):
    """A malformed limit is refused before any test runs."""
    del session
    _memory_limit_gib()


#: (peak rise in bytes, test id) of the tests that raised this process's peak RSS.
_PEAK_RAISERS: list[tuple[int, str]] = []


def _trim_heap() -> None:
    """Give freed heap back to the OS (glibc keeps it otherwise), so that what one test
    module freed does not stay in the process's RSS under the next one's peak."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Which tests raised the peak (printed with the peaks), and a heap trim between test
    modules."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    yield
    rise = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    if rise > 0:
        _PEAK_RAISERS.append((rise * (1 if sys.platform == "darwin" else 1024), item.nodeid))
    if nextitem is None or nextitem.module is not item.module:
        _trim_heap()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """Fail the session (exit status 1) when a test process went above the limit."""
    del exitstatus
    session.config._pytrt_kv_memory = verdict = _memory_verdict()
    if verdict[2] and session.exitstatus in (
        pytest.ExitCode.OK,
        pytest.ExitCode.NO_TESTS_COLLECTED,
    ):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, config):
    """The peaks and the limit, and a FAILED line for each peak above it."""
    peaks, limit, over = getattr(config, "_pytrt_kv_memory", None) or _memory_verdict()
    terminalreporter.write_sep("-", "peak memory (RSS)")
    for who, v in peaks.items():
        terminalreporter.write_line(f"{who}: {v / 2**30:.2f} GiB (limit {limit:g} GiB)")
    raisers = sorted(_PEAK_RAISERS, reverse=True)[:5]
    if raisers:
        terminalreporter.write_line("tests that raised the pytest process's peak the most:")
        for rise, nodeid in raisers:
            terminalreporter.write_line(f"  +{rise / 2**20:.0f} MiB  {nodeid}")
    for line in over:
        terminalreporter.write_line(f"FAILED memory limit: {line}", red=True, bold=True)
