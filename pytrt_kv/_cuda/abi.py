"""The C ABI of ``libpytrt_kv_kernels.so`` (``plugins/kernels/capi.h``) through ctypes.

:func:`kernels` loads the library on first use (``pytrt_kv._lib`` finds it) and declares
every entry point; :class:`ScatterParams` / :class:`GatherSelectionParams` mirror the C++
Params structs field by field (``tests/test_kernels_abi.py`` compares the layouts with the
library's); :func:`check_status` turns a returned ``cudaError_t`` into an exception. The
codes come from ``pytrt_kv.contract.limits`` (the C++ side reads the same values from the
generated ``plugins/kernels/kvContract.h``).
"""

from __future__ import annotations

import ctypes
import threading

from .. import _lib
from ..contract import limits

# --- the library -------------------------------------------------------------------------

#: DataType of plugins/kernels/kvCommon.h for each dtype name.
DTYPE_CODE: dict[str, int] = dict(limits.DTYPE_CODES)
LAYOUT_CODE: dict[str, int] = dict(limits.LAYOUT_CODES)
MODE_CODE: dict[str, int] = dict(limits.MODE_CODES)
#: pytrt_kv_abi_version() this module's structures match.
ABI_VERSION = limits.ABI_VERSION


class ScatterParams(ctypes.Structure):
    """Mirror of ``pytrt_kv::kernels::ScatterParams`` (scatterPaKvCache.h)."""

    _fields_ = [
        ("key", ctypes.c_void_p),
        ("value", ctypes.c_void_p),
        ("keyCache", ctypes.c_void_p),
        ("valueCache", ctypes.c_void_p),
        ("slotMapping", ctypes.c_void_p),
        ("compressLens", ctypes.c_void_p),
        ("compressSeqOffsets", ctypes.c_void_p),
        ("seqLens", ctypes.c_void_p),
        ("keyType", ctypes.c_int32),
        ("valueType", ctypes.c_int32),
        ("indexType", ctypes.c_int32),
        ("compress", ctypes.c_bool),
        ("layout", ctypes.c_int32),
        ("mode", ctypes.c_int32),
        ("numTokens", ctypes.c_int64),
        ("batch", ctypes.c_int32),
        ("maxSeqLen", ctypes.c_int32),
        ("numHeads", ctypes.c_int32),
        ("headSizeK", ctypes.c_int32),
        ("headSizeV", ctypes.c_int32),
        ("numBlocks", ctypes.c_int64),
        ("blockSize", ctypes.c_int32),
        ("kScale", ctypes.c_void_p),
        ("vScale", ctypes.c_void_p),
        ("keyCacheType", ctypes.c_int32),
        ("valueCacheType", ctypes.c_int32),
        ("kScaleCount", ctypes.c_int32),
        ("vScaleCount", ctypes.c_int32),
    ]


class GatherSelectionParams(ctypes.Structure):
    """Mirror of ``pytrt_kv::kernels::GatherSelectionParams`` (gatherSelectionKvCache.h)."""

    _fields_ = [
        ("selectionKRope", ctypes.c_void_p),
        ("selectionKvCache", ctypes.c_void_p),
        ("selectionKvBlockTable", ctypes.c_void_p),
        ("selectionKvBlockStatus", ctypes.c_void_p),
        ("selectionTopkIndices", ctypes.c_void_p),
        ("fullKRope", ctypes.c_void_p),
        ("fullKvCache", ctypes.c_void_p),
        ("fullKvBlockTable", ctypes.c_void_p),
        ("fullKvActualSeq", ctypes.c_void_p),
        ("selectionKvActualSeq", ctypes.c_void_p),
        ("cacheType", ctypes.c_int32),
        ("batch", ctypes.c_int32),
        ("seqPerBatch", ctypes.c_int32),
        ("topk", ctypes.c_int32),
        ("topkBlockSize", ctypes.c_int32),
        ("selectionRows", ctypes.c_int32),
        ("selectionBlockNum", ctypes.c_int64),
        ("selectionBlockSize", ctypes.c_int32),
        ("selectionMaxBlockNum", ctypes.c_int32),
        ("fullBlockNum", ctypes.c_int64),
        ("fullBlockSize", ctypes.c_int32),
        ("fullMaxBlockNum", ctypes.c_int32),
        ("kRopeDim", ctypes.c_int32),
        ("kvDim", ctypes.c_int32),
        ("workspace", ctypes.c_void_p),
        ("workspaceBytes", ctypes.c_size_t),
    ]


_P = ctypes.c_void_p
_I32 = ctypes.c_int32
_I32P = ctypes.POINTER(ctypes.c_int32)
_U8P = ctypes.POINTER(ctypes.c_uint8)
_SIGNATURES = {
    "pytrt_kv_version": (_I32, []),
    "pytrt_kv_abi_version": (_I32, []),
    "pytrt_kv_get_last_error": (ctypes.c_char_p, []),
    "pytrt_kv_error_string": (ctypes.c_char_p, [_I32]),
    "pytrt_kv_params_layout": (_I32, [_I32, ctypes.POINTER(ctypes.c_int64), _I32]),
    "pytrt_kv_scatter_pa_kv_cache": (_I32, [ctypes.POINTER(ScatterParams), _P, _I32]),
    "pytrt_kv_gather_workspace_size": (ctypes.c_size_t, [ctypes.POINTER(GatherSelectionParams)]),
    "pytrt_kv_gather_selection_kv_cache": (_I32, [ctypes.POINTER(GatherSelectionParams), _P, _I32]),
    "pytrt_kv_pointer_info": (_I32, [_P, _I32P, _I32P, ctypes.POINTER(_P)]),
    "pytrt_kv_device_malloc": (_I32, [ctypes.c_size_t, _I32, ctypes.POINTER(_P)]),
    "pytrt_kv_device_free": (_I32, [_P, _I32]),
    "pytrt_kv_copy": (_I32, [_P, _P, ctypes.c_size_t, _P, _I32]),
    "pytrt_kv_host_register": (_I32, [_P, ctypes.c_size_t, ctypes.c_uint32]),
    "pytrt_kv_host_unregister": (_I32, [_P]),
    "pytrt_kv_gather_plan_rows_host": (
        _I32,
        [_I32, _I32, _I32, _I32, _I32P, _I32P, _I32P, _I32P, _I32P, _U8P, _I32P, _U8P],
    ),
    "pytrt_kv_gather_plan_host": (_I32, [ctypes.POINTER(GatherSelectionParams)]),
    "pytrt_kv_compress_rows_host": (
        _I32,
        [_I32, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, _I32, _I32P],
    ),
}

_LOCK = threading.Lock()
_KERNELS: ctypes.CDLL | None = None


def kernels() -> ctypes.CDLL:
    """The loaded kernel library (FileNotFoundError from ``pytrt_kv._lib`` if absent)."""
    global _KERNELS
    with _LOCK:
        if _KERNELS is None:
            name = _lib.kernels_lib()
            lib = ctypes.CDLL(str(_lib.require(name)))
            for name, (res, args) in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.restype = res
                fn.argtypes = args
            abi = lib.pytrt_kv_abi_version()
            if abi != ABI_VERSION:
                raise RuntimeError(
                    f"{name}: ABI version {abi}, this pytrt_kv expects "
                    f"{ABI_VERSION}; reinstall the package so library and Python match"
                )
            _KERNELS = lib
        return _KERNELS


#: cudaErrorStubLibrary, cudaErrorInsufficientDriver, cudaErrorNoDevice: what the runtime


def loaded() -> ctypes.CDLL | None:
    """The kernel library if :func:`kernels` loaded it already, else None (never loads:
    for finalizers, which must not load a library at interpreter exit)."""
    return _KERNELS


#: What the runtime returns when there is no driver or no GPU.
_NO_GPU_CODES = limits.STATUS_NO_GPU


def check_status(code: int, what: str) -> None:
    """Raise for a non-zero cudaError_t: ValueError for cudaErrorInvalidValue (a refused
    argument, with the library's reason), RuntimeError otherwise ("no CUDA driver / GPU"
    when that is the cause)."""
    if code == limits.STATUS_SUCCESS:
        return
    if code in _NO_GPU_CODES:
        # Without a driver the runtime says "driver version is insufficient", which sends
        # users looking for a driver update; say what is missing instead.
        from .._driver import cuda_devices

        names, detail = cuda_devices()
        if not names:
            raise RuntimeError(
                f"{what}: {detail}. pytrt_kv.ops needs an NVIDIA GPU and its driver; the "
                f"NumPy reference (pytrt_kv.reference) and the CPU runtime "
                f"(pytrt_kv.runtime) work without one"
            )
    lib = kernels()
    detail = (lib.pytrt_kv_get_last_error() or b"").decode(errors="replace")
    text = (lib.pytrt_kv_error_string(code) or b"").decode(errors="replace")
    msg = f"{what}: CUDA error {code} ({text})" + (f": {detail}" if detail else "")
    if code == limits.STATUS_INVALID_VALUE:
        raise ValueError(msg)
    raise RuntimeError(msg)
