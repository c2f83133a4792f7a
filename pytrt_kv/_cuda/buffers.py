"""Views of caller buffers: pointer, shape, dtype, strides and where the memory lives.

:func:`buffer` reads them from a torch tensor, anything with ``__cuda_array_interface__``
(CuPy, PyCUDA GPUArray, Numba), a NumPy array or DLPack, without importing any framework
and without synchronizing; :func:`locate` asks the driver where the memory lives.
:class:`BufferView` is what a TensorRT binding needs of one.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..contract import limits, specs
from ..contract.dtypes import NUMPY, name_of
from ..contract.errors import describe, type_error, value_error
from .abi import check_status, kernels

#: Largest byte count of one buffer: what an int64 (and the kernels' size_t/int64_t
#: arithmetic) holds. A larger product of dims wraps in NumPy's int64 (issue 31:
#: ``DeviceArray((2**62 + 1, 1, 1, 4))`` allocated 16 bytes).
MAX_BYTES = 2**63 - 1


def checked_shape(arg: str, shape: Any, itemsize: int) -> tuple[int, ...]:
    """``shape`` as a tuple of Python ints, refused unless every dim is an integer >= 0
    and the byte count ``prod(shape) * itemsize`` fits in an int64 (:data:`MAX_BYTES`).

    Computed with Python integers (no wrap), before anything is allocated or written.

    Raises
    ------
    ValueError
        Naming ``arg`` and the shape.
    TypeError
        A dim that is not an integer (a bool, a float, None).
    """
    try:
        dims = tuple(shape)
    except TypeError:
        raise type_error(arg, "a shape (a sequence of ints)", repr(shape)) from None
    out = []
    for axis, d in enumerate(dims):
        if isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, np.integer)):
            raise type_error(arg, f"integer dims, dim {axis} an int", f"shape {list(dims)!r}")
        out.append(int(d))
    if any(d < 0 for d in out):
        axis = next(i for i, d in enumerate(out) if d < 0)
        raise value_error(arg, f"dims >= 0 (dim {axis} is {out[axis]})", f"shape {out}")
    nbytes = math.prod(out) * int(itemsize)
    if nbytes > MAX_BYTES:
        raise value_error(
            arg,
            f"at most 2^63-1 bytes (an int64 byte count; itemsize {itemsize})",
            f"shape {out}: {nbytes} bytes",
        )
    return tuple(out)


#: Where a buffer lives (pytrt_kv_pointer_info kinds).
HOST, PINNED, DEVICE, MANAGED = (
    limits.POINTER_KINDS[k] for k in ("host", "pinned", "device", "managed")
)


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

    readonly: bool = False  #: the producer says the memory must not be written

    def __post_init__(self) -> None:
        # Every buffer entering pytrt_kv is checked here, before anything reads its
        # bytes: negative dims and byte counts that wrap an int64 are refused.
        self.shape = checked_shape(self.arg, self.shape, self.dtype.itemsize)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _c_contiguous(shape: Sequence[int], strides: Sequence[int] | None, itemsize: int) -> bool:
    """Strides in bytes (None = C order); size-1 and empty dims never break contiguity."""
    if strides is None or any(int(d) <= 0 for d in shape):  # empty (or refused later)
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


#: The ``__cuda_array_interface__`` typestr of float8_e5m2 as ml_dtypes writes it, which
#: NumPy cannot parse (``data type '<f1' not understood``); every other 1-byte float of
#: ml_dtypes is ``V1``.
_E5M2_TYPESTRS = ("<f1", "|f1", ">f1", "=f1")


def _cai_dtype(arg: str, obj: Any, typestr: str, opaque_ok: bool) -> np.dtype:
    """The dtype of a ``__cuda_array_interface__`` buffer: its ``dtype`` attribute when
    it has one (bfloat16 and float8 have no typestr of their own), else the typestr;
    the two must agree in size."""
    size = typestr[2:]
    dt = getattr(obj, "dtype", None)
    if dt is not None:
        dtype = _numpy_dtype(arg, obj, None)
        if not size.isdigit() or int(size) != dtype.itemsize:
            raise type_error(
                arg,
                f"a __cuda_array_interface__ typestr of {dtype.itemsize} bytes "
                f"(dtype {name_of(dtype)})",
                f"typestr {typestr!r}",
            )
        return dtype
    if typestr in _E5M2_TYPESTRS:
        return NUMPY[specs.FLOAT8_E5M2]
    if typestr[1:2] == "V" and opaque_ok:
        # bfloat16 / float8 have no array-interface letter (torch publishes bfloat16 as
        # "<V2"); a raw void dtype of that size: the engine's dtype decides.
        return np.dtype(typestr)
    try:
        parsed = np.dtype(typestr)
    except TypeError:
        parsed = None
    if parsed is None or parsed.kind == "V":
        raise type_error(
            arg,
            f"a dtype in {sorted(NUMPY)} (an object with a dtype attribute for bfloat16 "
            f"and float8_e4m3fn, whose typestr is only a size)",
            f"__cuda_array_interface__ typestr {typestr!r} and no dtype attribute",
        )
    return _numpy_dtype(arg, obj, parsed)


def _from_cai(arg: str, obj: Any, cai: dict[str, Any], opaque_ok: bool = False) -> Buffer:
    try:
        shape = tuple(int(d) for d in cai["shape"])
    except (TypeError, ValueError):
        raise type_error(arg, "integer dims", f"shape {cai.get('shape')!r}") from None
    dtype = _cai_dtype(arg, obj, str(cai["typestr"]), opaque_ok)
    strides = cai.get("strides")
    strides = None if strides is None else tuple(int(s) for s in strides)
    data = cai["data"]
    ptr = int(data[0] or 0)
    readonly = bool(data[1]) if len(data) > 1 else False
    # CAI v3 "stream": the producer's stream; we order work on the caller's stream only.
    return Buffer(
        arg,
        obj,
        ptr,
        shape,
        dtype,
        _c_contiguous(shape, strides, dtype.itemsize),
        strides=strides,
        readonly=readonly,
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
            readonly=not obj.flags.writeable,
        )
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        return _from_dlpack(arg, obj)
    if isinstance(obj, (np.generic, int, float)) and not isinstance(obj, bool):
        # A scalar (k_scale=np.float32(0.5)) is a value on the host, not a buffer: say
        # what to pass instead of describing it like a 0-d array.
        raise type_error(
            arg,
            "a CUDA buffer (a scalar such as a scale is passed as a 0-d or 1-d GPU array, "
            "e.g. torch.tensor(0.5, device='cuda') or DeviceArray.from_numpy(np.float32(0.5)))",
            f"the Python/NumPy scalar {type(obj).__module__}.{type(obj).__name__} {obj!r}",
        )
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


@dataclass(frozen=True)
class BufferView:
    """What a TensorRT binding needs: a device-visible address, and shape/dtype when known."""

    address: int
    shape: tuple[int, ...] | None
    dtype: str | None  #: specs.py dtype name; None: the engine's dtype decides
    host: bool = False  #: pinned host memory seen through its device address
