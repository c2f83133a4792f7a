"""ctypes glue between Python buffers and ``libpytrt_kv_kernels.so`` (private).

- :func:`kernels` loads the library on first use (``pytrt_kv._lib`` finds it) and
  declares the C ABI of ``plugins/kernels/capi.h``.
- :class:`ScatterParams` / :class:`GatherSelectionParams` mirror the C++ Params structs
  field by field (``tests/test_kernels_abi.py`` compares the layouts with the library's).
- :func:`buffer` reads pointer, shape, dtype and strides from a torch tensor, anything
  with ``__cuda_array_interface__`` (CuPy, PyCUDA GPUArray, Numba) or DLPack, without
  importing any framework and without synchronizing.
- :func:`resolve_stream` turns a torch/CuPy/cuda-python stream, an int handle or None
  into a ``cudaStream_t`` value.
- :func:`binding_view` is :func:`buffer` for TensorRT bindings (``pytrt_kv.trt``): it also
  takes raw cuda-python allocations and addresses, pinned host arrays, and bfloat16/float8
  arrays whose dtype only the engine knows; :class:`DeviceArray`, :class:`PinnedHost` and
  :class:`HostArray` are the memory pytrt_kv allocates or pins itself.

Nothing here needs torch or CuPy; they are used only when the caller passes their objects.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _lib, specs
from ._errors import describe, type_error, value_error
from .dtypes import NUMPY, name_of, numpy_dtype

# --- the library -------------------------------------------------------------------------

#: DataType of plugins/kernels/kvCommon.h for each dtype name.
DTYPE_CODE: dict[str, int] = {
    specs.FLOAT32: 0,
    specs.FLOAT16: 1,
    specs.BFLOAT16: 2,
    specs.INT8: 3,
    specs.UINT8: 4,
    specs.FLOAT8_E4M3: 5,
    specs.FLOAT8_E5M2: 6,
    specs.INT32: 7,
    specs.INT64: 8,
}
LAYOUT_CODE = {"nd": 0, "nz": 1, "hnd": 2}
MODE_CODE = {"rope": 0, "omni": 1, "alibi": 2}
#: pytrt_kv_abi_version() this module's structures match.
ABI_VERSION = 1


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
            lib = ctypes.CDLL(str(_lib.require(_lib.KERNELS_LIB)))
            for name, (res, args) in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.restype = res
                fn.argtypes = args
            abi = lib.pytrt_kv_abi_version()
            if abi != ABI_VERSION:
                raise RuntimeError(
                    f"{_lib.KERNELS_LIB}: ABI version {abi}, this pytrt_kv expects "
                    f"{ABI_VERSION}; reinstall the package so library and Python match"
                )
            _KERNELS = lib
        return _KERNELS


#: cudaErrorStubLibrary, cudaErrorInsufficientDriver, cudaErrorNoDevice: what the runtime
#: returns when there is no driver or no GPU.
_NO_GPU_CODES = (34, 35, 100)


def check_status(code: int, what: str) -> None:
    """Raise for a non-zero cudaError_t: ValueError for cudaErrorInvalidValue (a refused
    argument, with the library's reason), RuntimeError otherwise ("no CUDA driver / GPU"
    when that is the cause)."""
    if code == 0:
        return
    if code in _NO_GPU_CODES:
        # Without a driver the runtime says "driver version is insufficient", which sends
        # users looking for a driver update; say what is missing instead.
        from .info import cuda_devices

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
    if code == 1:  # cudaErrorInvalidValue
        raise ValueError(msg)
    raise RuntimeError(msg)


# --- buffers -------------------------------------------------------------------------------

#: Where a buffer lives (pytrt_kv_pointer_info kinds).
HOST, PINNED, DEVICE, MANAGED = 0, 1, 2, 3


@dataclass
class Buffer:
    """A view of one argument: what the checks and the kernels need.

    ``shape`` and ``dtype`` make it acceptable to ``check_scatter``/``check_gather``
    (which read only those two attributes).
    """

    arg: str
    obj: Any
    ptr: int
    shape: tuple[int, ...]
    dtype: np.dtype
    contiguous: bool
    kind: int = DEVICE
    device: int = -1
    keepalive: Any = None
    strides: tuple[int, ...] | None = None  #: in bytes; None = C order

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def _c_contiguous(shape: Sequence[int], strides: Sequence[int] | None, itemsize: int) -> bool:
    """Strides in bytes (None = C order); size-1 and empty dims never break contiguity."""
    if strides is None or int(np.prod(shape, dtype=np.int64)) == 0:
        return True
    expected = itemsize
    for dim, st in zip(reversed(shape), reversed(strides)):
        if dim != 1 and st != expected:
            return False
        expected *= dim
    return True


def _numpy_dtype(arg: str, obj: Any, fallback: Any) -> np.dtype:
    dt = getattr(obj, "dtype", None)
    for candidate in (dt, fallback):
        if candidate is None:
            continue
        try:
            return NUMPY[name_of(candidate)]
        except TypeError:
            continue
    raise type_error(arg, f"a dtype in {sorted(NUMPY)}", f"{dt if dt is not None else fallback}")


def _is_torch(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def _from_torch(arg: str, t: Any) -> Buffer:
    shape = tuple(int(d) for d in t.shape)
    dtype = _numpy_dtype(arg, t, None)
    strides = tuple(int(s) * dtype.itemsize for s in t.stride())
    if t.device.type == "cuda":
        kind, device = DEVICE, int(t.device.index if t.device.index is not None else 0)
    elif t.device.type == "cpu":
        kind, device = (PINNED if t.is_pinned() else HOST), -1
    else:
        raise type_error(
            arg,
            "a CUDA tensor (or a pinned CPU tensor for the full caches)",
            f"a tensor on {t.device}",
        )
    return Buffer(
        arg,
        t,
        int(t.data_ptr()),
        shape,
        dtype,
        _c_contiguous(shape, strides, dtype.itemsize),
        kind,
        device,
        strides=strides,
    )


def _from_cai(arg: str, obj: Any, cai: dict[str, Any], opaque_ok: bool = False) -> Buffer:
    shape = tuple(int(d) for d in cai["shape"])
    typestr = cai["typestr"]
    if typestr[1] == "V" and opaque_ok and getattr(obj, "dtype", None) is None:
        # bfloat16 / float8 have no array-interface letter (torch publishes bfloat16 as
        # "<V2"); a raw void dtype of that size: the engine's dtype decides.
        dtype = np.dtype(typestr)
    else:
        dtype = _numpy_dtype(arg, obj, np.dtype(typestr) if typestr[1] != "V" else None)
    strides = cai.get("strides")
    strides = None if strides is None else tuple(int(s) for s in strides)
    ptr = int(cai["data"][0] or 0)
    # CAI v3 "stream": the producer's stream; we order work on the caller's stream only.
    return Buffer(
        arg, obj, ptr, shape, dtype, _c_contiguous(shape, strides, dtype.itemsize), strides=strides
    )


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


#: DLPack (code, bits) -> dtype name. Codes: 0 int, 1 uint, 2 float, 4 bfloat,
#: 10 float8_e4m3fn, 12 float8_e5m2 (DLPack 1.0).
_DL_DTYPES = {
    (0, 8): specs.INT8,
    (0, 32): specs.INT32,
    (0, 64): specs.INT64,
    (1, 8): specs.UINT8,
    (2, 16): specs.FLOAT16,
    (2, 32): specs.FLOAT32,
    (4, 16): specs.BFLOAT16,
    (10, 8): specs.FLOAT8_E4M3,
    (12, 8): specs.FLOAT8_E5M2,
}
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13


def _from_dlpack(arg: str, obj: Any) -> Buffer:
    try:
        capsule = obj.__dlpack__(stream=None)
    except TypeError:
        capsule = obj.__dlpack__()
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    addr = get(capsule, b"dltensor")
    # DLManagedTensor starts with its DLTensor; the capsule stays alive in keepalive, and
    # its destructor calls the producer's deleter once we drop it.
    t = _DLTensor.from_address(addr)
    shape = tuple(int(t.shape[i]) for i in range(t.ndim))
    key = (int(t.dtype.code), int(t.dtype.bits))
    if key not in _DL_DTYPES or t.dtype.lanes != 1:
        raise type_error(
            arg,
            f"a dtype in {sorted(NUMPY)}",
            f"DLPack dtype code {key[0]}, {key[1]} bits x {t.dtype.lanes}",
        )
    dtype = NUMPY[_DL_DTYPES[key]]
    strides = (
        None if not t.strides else tuple(int(t.strides[i]) * dtype.itemsize for i in range(t.ndim))
    )
    dev = int(t.device.device_type)
    kind = {_DL_CUDA: DEVICE, _DL_CUDA_HOST: PINNED, _DL_CUDA_MANAGED: MANAGED, _DL_CPU: HOST}.get(
        dev
    )
    if kind is None:
        raise type_error(arg, "a CUDA buffer", f"a DLPack tensor on device type {dev}")
    device = int(t.device.device_id) if kind in (DEVICE, MANAGED) else -1
    return Buffer(
        arg,
        obj,
        int(t.data or 0) + int(t.byte_offset),
        shape,
        dtype,
        _c_contiguous(shape, strides, dtype.itemsize),
        kind,
        device,
        keepalive=capsule,
        strides=strides,
    )


def buffer(arg: str, obj: Any, *, opaque_ok: bool = False) -> Buffer:
    """Describe ``obj`` (torch tensor, ``__cuda_array_interface__``, DLPack) as a Buffer.

    ``opaque_ok``: accept a ``__cuda_array_interface__`` typestr ``V1``/``V2`` with no
    ``dtype`` attribute (``dtype`` is then a NumPy void dtype of that size).

    Raises
    ------
    TypeError
        If ``obj`` exposes none of these interfaces.
    """
    if _is_torch(obj):
        return _from_torch(arg, obj)
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        return _from_cai(arg, obj, cai, opaque_ok)
    if isinstance(obj, np.ndarray):
        # A NumPy array is host memory: usable only if pinned (cudaHostRegister). Read
        # directly, not through DLPack, which refuses ml_dtypes (bfloat16, float8) arrays.
        shape = tuple(int(d) for d in obj.shape)
        return Buffer(
            arg,
            obj,
            int(obj.ctypes.data),
            shape,
            _numpy_dtype(arg, obj, None),
            bool(obj.flags.c_contiguous),
            HOST,
            -1,
            strides=tuple(int(s) for s in obj.strides),
        )
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        return _from_dlpack(arg, obj)
    raise type_error(
        arg,
        "a CUDA buffer: torch tensor, CuPy array, PyCUDA GPUArray or any "
        "object with __cuda_array_interface__ or DLPack",
        describe(obj),
    )


def locate(buf: Buffer) -> Buffer:
    """Ask the driver where a buffer's memory lives and set ``kind``/``device``/``ptr``
    (for pinned host memory: the device address to use). Empty buffers are left alone."""
    if buf.nbytes == 0 or buf.ptr == 0:
        return buf
    kind, device, dptr = ctypes.c_int32(), ctypes.c_int32(), ctypes.c_void_p()
    check_status(
        kernels().pytrt_kv_pointer_info(
            buf.ptr, ctypes.byref(kind), ctypes.byref(device), ctypes.byref(dptr)
        ),
        f"{buf.arg}: cudaPointerGetAttributes",
    )
    buf.kind = kind.value
    if buf.kind in (DEVICE, MANAGED):
        buf.device = device.value
    elif buf.kind == PINNED:
        buf.ptr = int(dptr.value or buf.ptr)
    return buf


# --- TensorRT bindings ---------------------------------------------------------------------


@dataclass(frozen=True)
class BufferView:
    """What a TensorRT binding needs: a device-visible address, and shape/dtype when known."""

    address: int
    shape: tuple[int, ...] | None
    dtype: str | None  #: specs.py dtype name; None: the engine's dtype decides
    host: bool = False  #: pinned host memory seen through its device address


def _has_cai(obj: Any) -> bool:
    try:
        return getattr(obj, "__cuda_array_interface__", None) is not None
    except (AttributeError, RuntimeError, TypeError):
        return False


def _raw_address(obj: Any) -> int | None:
    """A cuda.core ``Buffer`` (``.handle``), ``CUdeviceptr`` or int, else None."""
    if isinstance(obj, (bool, str, bytes)):
        return None
    handle = getattr(obj, "handle", None)
    try:
        return int(handle if handle is not None else obj)
    except (TypeError, ValueError):
        return None


def binding_view(arg: str, obj: Any) -> BufferView:
    """The :class:`BufferView` of ``obj`` for a TensorRT binding.

    Accepted: :class:`DeviceArray`, :class:`PinnedHost`/:class:`HostArray`, torch CUDA
    tensors, anything with ``__cuda_array_interface__`` (CuPy, PyCUDA ``GPUArray``,
    Numba) or DLPack, NumPy arrays in pinned host memory (bound through their device-side
    address), and raw cuda-python allocations (``cuda.core`` ``Buffer``, ``CUdeviceptr``,
    int), whose shape and dtype then come from the engine.

    Raises
    ------
    TypeError
        ``obj`` is none of the accepted kinds, a CPU tensor or a pageable NumPy array.
    ValueError
        ``obj`` is not C-contiguous.
    """
    if isinstance(obj, (DeviceArray, PinnedHost)):
        return obj.view()
    if getattr(obj, "is_cuda", True) is False:  # a torch CPU tensor: int(x) would read its value
        raise type_error(
            arg,
            "a CUDA tensor (or pinned host memory: pytrt_kv.trt.HostArray)",
            f"a CPU tensor {tuple(obj.shape)}",
        )
    array_like = _is_torch(obj) or _has_cai(obj) or isinstance(obj, np.ndarray)
    if (
        not array_like
        and getattr(obj, "handle", None) is None
        and hasattr(obj, "__dlpack__")
        and hasattr(obj, "__dlpack_device__")
    ):
        array_like = True  # DLPack; a cuda.core Buffer (handle) is bound as a raw address
    if not array_like:
        address = _raw_address(obj)
        if address is None:
            raise type_error(
                arg,
                "a CUDA array (torch, CuPy, PyCUDA, Numba: "
                "__cuda_array_interface__), a pinned host array, a cuda-python "
                "allocation or an address",
                type(obj).__name__,
            )
        return BufferView(address, None, None)
    buf = buffer(arg, obj, opaque_ok=True)
    if not buf.contiguous:
        raise value_error(arg, "a C-contiguous CUDA array", f"strides {buf.strides}")
    if buf.kind in (HOST, PINNED):  # pinned: bind the device-side address, as ops do
        locate(buf)
        if buf.kind == HOST:
            raise type_error(
                arg,
                "a device buffer or pinned host memory (pytrt_kv.trt.HostArray)",
                "a pageable host array",
            )
    try:
        dtype: str | None = name_of(buf.dtype)
    except TypeError:  # the void dtype of an opaque bfloat16/float8 array
        dtype = None
    return BufferView(buf.ptr, buf.shape, dtype, host=buf.kind == PINNED)


# --- streams -------------------------------------------------------------------------------


def _frameworks_of(objs: Sequence[Any]) -> tuple[bool, bool]:
    torch_in = any(_is_torch(o) for o in objs)
    cupy_in = any(type(o).__module__.startswith("cupy") for o in objs)
    return torch_in, cupy_in


_STREAM_EXPECTED = "None, an int handle or a torch/CuPy/cuda-python stream"


def resolve_stream(stream: Any, objs: Sequence[Any], device: int) -> int:
    """The ``cudaStream_t`` value to launch on.

    None: torch's current stream when torch tensors are passed, else CuPy's current
    stream for CuPy arrays, else 0 (the legacy default stream). An int is a raw handle;
    torch/CuPy streams, cuda-python streams (``__cuda_stream__``, ``handle``) and
    ``CUstream`` objects are unwrapped.
    """
    if stream is None:
        torch_in, cupy_in = _frameworks_of(objs)
        if torch_in and "torch" in sys.modules:
            torch = sys.modules["torch"]
            return int(torch.cuda.current_stream(max(device, 0)).cuda_stream)
        if cupy_in and "cupy" in sys.modules:
            return int(sys.modules["cupy"].cuda.get_current_stream().ptr)
        return 0
    if isinstance(stream, bool):
        raise type_error("stream", _STREAM_EXPECTED, repr(stream))
    if isinstance(stream, int):
        return stream
    for attr in ("cuda_stream", "ptr"):
        value = getattr(stream, attr, None)
        if isinstance(value, int):
            return value
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        value = proto() if callable(proto) else proto
        return int(value[1])
    handle = getattr(stream, "handle", None)
    if handle is not None:
        return int(getattr(handle, "value", handle) or 0)  # ctypes.c_void_p handles too
    try:
        return int(stream)  # cuda.bindings CUstream / cudaStream_t
    except (TypeError, ValueError):
        raise type_error("stream", _STREAM_EXPECTED, type(stream).__name__) from None


def stream_handle(stream: Any) -> int:
    """The ``cudaStream_t`` value of ``stream`` with no arrays to infer it from: None is
    0 (the legacy default stream); otherwise as :func:`resolve_stream`."""
    return resolve_stream(stream, (), -1)


# --- device memory owned by pytrt_kv -------------------------------------------------------


class DeviceArray:
    """Device memory allocated by the kernel library, exposed through
    ``__cuda_array_interface__`` (so torch/CuPy can wrap it without copies); used when no
    framework allocator is at hand, and for the outputs ``pytrt_kv.trt`` allocates.

    Parameters
    ----------
    shape : tuple of int
    dtype : dtype
        Any dtype :func:`pytrt_kv.dtypes.name_of` accepts (NumPy/ml_dtypes, torch, name).
    device : int
        CUDA device; -1 (default): the current one.
    """

    def __init__(self, shape: tuple[int, ...], dtype: Any, device: int = -1):
        self.shape = tuple(int(d) for d in shape)
        self.dtype = numpy_dtype(dtype)
        self.device = device
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        ptr = ctypes.c_void_p()
        # Zero-element arrays still get a valid address (TensorRT refuses null ones).
        check_status(
            kernels().pytrt_kv_device_malloc(max(self.nbytes, 1), device, ctypes.byref(ptr)),
            "cudaMalloc",
        )
        self.ptr = int(ptr.value or 0)

    @classmethod
    def from_numpy(cls, a: np.ndarray, device: int = -1) -> DeviceArray:
        """A device copy of the NumPy array ``a`` (synchronous)."""
        a = np.ascontiguousarray(a)
        return cls(a.shape, a.dtype, device).copy_from(a)

    @property
    def address(self) -> int:
        return self.ptr

    def view(self) -> BufferView:
        return BufferView(self.ptr, self.shape, name_of(self.dtype))

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (self.ptr, False),
            "strides": None,
            "version": 3,
        }

    def copy_from(self, host: np.ndarray, stream: Any = 0) -> DeviceArray:
        """Host -> device copy of ``host`` (same shape and dtype), ordered on ``stream``;
        returns when it is done."""
        host = np.ascontiguousarray(host)
        if tuple(host.shape) != self.shape or numpy_dtype(host.dtype) != self.dtype:
            raise value_error(
                "host",
                f"{name_of(self.dtype)}{list(self.shape)}",
                f"{host.dtype}{list(host.shape)}",
            )
        if self.nbytes:
            check_status(
                kernels().pytrt_kv_copy(
                    self.ptr, host.ctypes.data, self.nbytes, stream_handle(stream), self.device
                ),
                "copy to device",
            )
        return self

    def get(self, stream: Any = 0) -> np.ndarray:
        """Copy to a NumPy array (waits for ``stream``)."""
        out = np.empty(self.shape, self.dtype)
        copy_to_host(out, self.ptr, stream_handle(stream), self.device)
        return out

    to_numpy = get

    def free(self) -> None:
        if getattr(self, "ptr", 0) and _KERNELS is not None:
            _KERNELS.pytrt_kv_device_free(self.ptr, self.device)
        self.ptr = 0

    def __del__(self):
        self.free()


def copy_to_host(out: np.ndarray, ptr: int, stream: int, device: int) -> np.ndarray:
    """Fill the C-contiguous ``out`` from device address ``ptr``, ordered on ``stream``."""
    if out.nbytes:
        check_status(
            kernels().pytrt_kv_copy(out.ctypes.data, ptr, out.nbytes, stream, device),
            "copy to host",
        )
    return out


def read_back(buf: Buffer, stream: int) -> np.ndarray:
    """The values of a device buffer as a NumPy array (synchronizes ``stream``)."""
    return copy_to_host(np.empty(buf.shape, buf.dtype), buf.ptr, stream, buf.device)


class PinnedHost:
    """Pins (cudaHostRegister, mapped) a C-contiguous NumPy array for its lifetime, so that
    it can be passed as a host-resident full cache (to ``pytrt_kv.ops`` as the array, to
    TensorRT bindings as this object: its device-side :attr:`address`)."""

    def __init__(self, a: np.ndarray):
        if not a.flags.c_contiguous:
            raise type_error(
                "a",
                "a C-contiguous NumPy array to pin",
                f"a strided {describe(a)} with strides {a.strides}",
            )
        self.array = a
        self._ptr = int(a.ctypes.data) if a.nbytes else 0
        self._nbytes = int(a.nbytes)
        self._device_ptr: int | None = None
        if self._ptr:
            check_status(
                kernels().pytrt_kv_host_register(self._ptr, a.nbytes, 0), "cudaHostRegister"
            )

    @property
    def address(self) -> int:
        """The device-side address of the pinned memory (0 for an empty array)."""
        if self._device_ptr is None:
            buf = Buffer(
                "array", self.array, self._ptr, (self._nbytes,), np.dtype(np.uint8), True, HOST
            )
            self._device_ptr = locate(buf).ptr
        return self._device_ptr

    def view(self) -> BufferView:
        a = self.array
        return BufferView(self.address, tuple(a.shape), name_of(a.dtype), host=True)

    def close(self) -> None:
        if self._ptr and _KERNELS is not None:
            _KERNELS.pytrt_kv_host_unregister(self._ptr)
        self._ptr = 0

    free = close

    def __del__(self):
        self.close()


class HostArray(PinnedHost):
    """Pinned, mapped host memory as a NumPy array: a host-resident full cache the gather
    kernel reads over PCIe (docs/SPEC.md G7).

    ``.array`` is the NumPy view (fill it like any array); bindings use its device-side
    :attr:`address`. Keep the object alive while an engine may read it.

    Parameters
    ----------
    shape : tuple of int
    dtype : dtype
        Any dtype :func:`pytrt_kv.dtypes.name_of` accepts.
    """

    def __init__(self, shape: tuple[int, ...], dtype: Any):
        self.shape = tuple(int(d) for d in shape)
        self.dtype = numpy_dtype(dtype)
        nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        # Whole pages of its own (cudaHostRegister refuses a page registered twice), and a
        # valid address for zero-element arrays too (TensorRT refuses null ones).
        page = mmap.PAGESIZE
        size = -(-max(nbytes, 1) // page) * page
        raw = np.empty(size + page, np.uint8)
        offset = -int(raw.ctypes.data) % page
        raw = raw[offset : offset + size]
        super().__init__(raw)
        self.array = raw[:nbytes].view(self.dtype).reshape(self.shape)
        self._raw = raw


class WorkspaceCache:
    """Gather workspaces per (device, stream): grow-only, so steady-state calls allocate
    nothing. Outgrown buffers are kept (not freed) so that CUDA graphs captured with them
    stay valid; allocation is not allowed during capture, hence the warm-up call that
    graph capture needs (see pytrt_kv.ops)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: dict[tuple[int, int], DeviceArray] = {}
        self._retired: list = []

    def get(self, device: int, stream: int, nbytes: int) -> tuple[int, int]:
        if nbytes == 0:
            return 0, 0
        key = (device, stream)
        with self._lock:
            buf = self._current.get(key)
            if buf is None or buf.nbytes < nbytes:
                if buf is not None:
                    self._retired.append(buf)
                # Round up so that slowly growing batches do not reallocate every call.
                size = 1 << max(12, (nbytes - 1).bit_length())
                buf = DeviceArray((size,), np.uint8, device)
                self._current[key] = buf
            return buf.ptr, buf.nbytes
