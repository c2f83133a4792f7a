"""Numbers of the contract that the C++ side must agree with (docs/SPEC.md G2, O).

This module is the one source of these values. ``scripts/gen_contract_header.py``
writes them, with the op names, tensor names and plugin fields of ``pytrt_kv.specs``,
into ``plugins/kernels/kvContract.h``, the header the kernels, the plugins and the C ABI
include; ``tests/test_contract_header.py`` regenerates that header and fails on any
difference. The ctypes layer (``pytrt_kv._cuda``) reads its codes from here.

The package version lives here too: ``pyproject.toml`` reads :data:`VERSION` (dynamic
metadata, scikit-build-core's regex provider), ``pytrt_kv.__version__`` is it, and CMake
reads it back from the generated header (``project(VERSION)``, ``build_info.json``,
``pytrt_kv_version()``).

Nothing here imports anything but the import-free layout table, so every layer (and the
build) can read it.
"""

from __future__ import annotations

from .layouts import LAYOUTS

#: Package version (PEP 440 "major.minor.patch"); the one place to bump it.
VERSION = "0.1.0"


def _version_number(version: str) -> int:
    major, minor, patch = (int(p) for p in version.split("."))
    return major * 10000 + minor * 100 + patch


#: ``pytrt_kv_version()`` of the kernel library: major * 10000 + minor * 100 + patch.
VERSION_NUMBER = _version_number(VERSION)

#: ``pytrt_kv_abi_version()``: bumped whenever ScatterParams or GatherSelectionParams
#: (plugins/kernels/*.h, mirrored by ``pytrt_kv._cuda``) change layout.
ABI_VERSION = 2

#: docs/SPEC.md G2: largest K of GatherSelectionKvCache, for any TBS.
MAX_TOPK = 2048

# --- status codes --------------------------------------------------------------------
# Every kernel entry point returns a cudaError_t value; these are the ones pytrt_kv gives
# a meaning of its own (the C++ side static_asserts them against CUDA's enum).

#: cudaSuccess.
STATUS_SUCCESS = 0
#: cudaErrorInvalidValue: an argument was refused (the reason is in
#: ``pytrt_kv_get_last_error()``); the ctypes layer raises ValueError for it.
STATUS_INVALID_VALUE = 1
#: cudaErrorInsufficientDriver, cudaErrorStubLibrary, cudaErrorNoDevice: what the runtime
#: returns when there is no driver or no GPU.
STATUS_INSUFFICIENT_DRIVER = 35
STATUS_STUB_LIBRARY = 34
STATUS_NO_DEVICE = 100
STATUS_NO_GPU: tuple[int, ...] = (STATUS_STUB_LIBRARY, STATUS_INSUFFICIENT_DRIVER, STATUS_NO_DEVICE)

# --- enum codes of the C ABI ---------------------------------------------------------

#: ``kernels::DataType`` (plugins/kernels/kvCommon.h) of each dtype name (specs.py names).
DTYPE_CODES: dict[str, int] = {
    "float32": 0,
    "float16": 1,
    "bfloat16": 2,
    "int8": 3,
    "uint8": 4,
    "float8_e4m3fn": 5,
    "float8_e5m2": 6,
    "int32": 7,
    "int64": 8,
}
#: ``kernels::CacheLayout`` (docs/SPEC.md S2) of each ``cache_layout`` value.
LAYOUT_CODES: dict[str, int] = {name: lay.code for name, lay in LAYOUTS.items()}
#: ``kernels::CompressMode`` (docs/SPEC.md S6) of each ``compress_mode`` value.
MODE_CODES: dict[str, int] = {"rope": 0, "omni": 1, "alibi": 2}
#: ``pytrt_kv_pointer_info`` kinds: where a buffer's memory lives.
POINTER_KINDS: dict[str, int] = {"host": 0, "pinned": 1, "device": 2, "managed": 3}
