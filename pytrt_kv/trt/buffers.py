"""GPU buffers from any library, as (address, shape, dtype) for TensorRT bindings.

Accepted (ARCHITECTURE.md, "CUDA from Python"):

- anything exposing ``__cuda_array_interface__``: torch tensors, CuPy arrays, PyCUDA
  ``GPUArray``, Numba device arrays, :class:`DeviceArray`;
- :class:`HostArray` / any NumPy array in pinned, mapped host memory (a host-resident
  full cache): bound through its device-side address (unified addressing);
- raw cuda-python allocations (``cuda.core`` ``Buffer``, ``CUdeviceptr``, int): then
  shape and dtype come from the engine.

torch tensors are read through ``__cuda_array_interface__`` too, so torch is never
imported here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import numpy as np

from .. import dtypes
from .._errors import type_error, value_error
from ._tensorrt import check_cuda, import_cudart


@dataclass(frozen=True)
class BufferView:
    """What a binding needs: a device-visible address, and shape/dtype when known."""

    address: int
    shape: Optional[Tuple[int, ...]]
    dtype: Optional[str]  #: specs.py dtype name
    host: bool = False  #: pinned host memory seen through its device address


def _typestr_dtype(typestr: str, arg: str) -> str:
    try:
        return dtypes.name_of(np.dtype(typestr))
    except TypeError:
        pass
    # bfloat16 / float8 have no array-interface letter of their own: torch publishes
    # bfloat16 as "<V2"; the engine's dtype decides (checked by size in the runner).
    if typestr.endswith(("V1", "V2")):
        return ""
    raise type_error(arg, "a CUDA array of a pytrt_kv dtype", f"typestr {typestr!r}")


def _contiguous(shape: Tuple[int, ...], strides, itemsize: int) -> bool:
    if strides is None:
        return True
    expected = itemsize
    for dim, stride in zip(reversed(shape), reversed(strides)):
        if dim != 1 and stride != expected:
            return False
        expected *= dim
    return True


def as_buffer(x: Any, arg: str) -> BufferView:
    """The :class:`BufferView` of ``x`` (see the module docstring for what is accepted).

    Raises
    ------
    TypeError
        ``x`` is none of the accepted kinds, or a pageable NumPy array.
    ValueError
        ``x`` is not C-contiguous.
    """
    if isinstance(x, (HostArray, DeviceArray)):
        return x.view()
    if getattr(x, "is_cuda", True) is False:  # a torch CPU tensor: int(x) would read its value
        raise type_error(arg, "a CUDA tensor (or pinned host memory: pytrt_kv.trt.HostArray)",
                         f"a CPU tensor {tuple(x.shape)}")
    try:
        cai = getattr(x, "__cuda_array_interface__", None)
    except (AttributeError, RuntimeError):
        cai = None
    if cai is not None:
        shape = tuple(int(d) for d in cai["shape"])
        typestr = cai["typestr"]
        itemsize = int(typestr[2:]) if typestr[2:].isdigit() else np.dtype(typestr).itemsize
        if not _contiguous(shape, cai.get("strides"), itemsize):
            raise value_error(arg, "a C-contiguous CUDA array", f"strides {cai.get('strides')}")
        dt = _typestr_dtype(typestr, arg)
        torch_dtype = getattr(x, "dtype", None)
        if not dt and torch_dtype is not None:
            dt = dtypes.name_of(torch_dtype)
        return BufferView(int(cai["data"][0]), shape, dt or None)
    if isinstance(x, np.ndarray):
        return _pinned_view(x, arg)
    handle = getattr(x, "handle", None)  # cuda.core Buffer
    if handle is not None:
        return BufferView(int(handle), None, None)
    try:
        return BufferView(int(x), None, None)  # CUdeviceptr, int
    except (TypeError, ValueError):
        raise type_error(arg, "a CUDA array (torch, CuPy, PyCUDA, Numba: __cuda_array_interface__), "
                         "a pinned host array, a cuda-python allocation or an address",
                         type(x).__name__) from None


def _pinned_view(a: np.ndarray, arg: str) -> BufferView:
    if not a.flags.c_contiguous:
        raise value_error(arg, "a C-contiguous array", "a strided view")
    cudart = import_cudart()
    err, attrs = cudart.cudaPointerGetAttributes(a.ctypes.data)
    kind = int(getattr(getattr(attrs, "type", 0), "value", getattr(attrs, "type", 0))) \
        if int(getattr(err, "value", err)) == 0 else 0
    if kind != 1:  # cudaMemoryTypeHost: pinned
        raise type_error(arg, "a device buffer or pinned host memory (pytrt_kv.trt.HostArray)",
                         "a pageable NumPy array")
    return BufferView(int(attrs.devicePointer), tuple(a.shape), dtypes.name_of(a.dtype), host=True)


class DeviceArray:
    """A minimal owned device buffer (cuda-python ``cudaMalloc``) with
    ``__cuda_array_interface__``, so torch/CuPy can wrap it without copies.

    Parameters
    ----------
    shape : tuple of int
    dtype : str or dtype
        Any dtype :func:`pytrt_kv.dtypes.name_of` accepts.
    """

    def __init__(self, shape, dtype):
        self.shape = tuple(int(d) for d in shape)
        self.dtype = dtypes.name_of(dtype)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * dtypes.itemsize(self.dtype)
        self._cudart = import_cudart()
        # Zero-element tensors still get a valid address (TensorRT refuses null ones).
        self.address = int(check_cuda(self._cudart.cudaMalloc(max(self.nbytes, 1)), "cudaMalloc"))

    def view(self) -> BufferView:
        return BufferView(self.address, self.shape, self.dtype)

    @property
    def __cuda_array_interface__(self):
        np_dt = dtypes.numpy_dtype(self.dtype)
        return {"shape": self.shape, "typestr": np_dt.str, "data": (self.address, False),
                "version": 3, "strides": None}

    def copy_from(self, host: np.ndarray, stream: int = 0) -> "DeviceArray":
        """Asynchronous host -> device copy of ``host`` (same shape and dtype)."""
        host = np.ascontiguousarray(host)
        if tuple(host.shape) != self.shape or dtypes.name_of(host.dtype) != self.dtype:
            raise value_error("host", f"{self.dtype}{list(self.shape)}",
                              f"{host.dtype}{list(host.shape)}")
        if self.nbytes:
            check_cuda(self._cudart.cudaMemcpyAsync(
                self.address, host.ctypes.data, self.nbytes,
                self._cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync")
        return self

    def to_numpy(self, stream: int = 0) -> np.ndarray:
        """Synchronous device -> host copy (waits for ``stream``)."""
        out = np.empty(self.shape, dtypes.numpy_dtype(self.dtype))
        if self.nbytes:
            check_cuda(self._cudart.cudaMemcpyAsync(
                out.ctypes.data, self.address, self.nbytes,
                self._cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync")
            check_cuda(self._cudart.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
        return out

    def free(self) -> None:
        if self.address:
            self._cudart.cudaFree(self.address)
            self.address = 0

    def __del__(self):
        try:
            self.free()
        except Exception:  # interpreter shutdown: the context may already be gone
            pass


class HostArray:
    """Pinned, mapped host memory (``cudaHostAlloc(..., cudaHostAllocMapped)``) as a NumPy
    array: a host-resident full cache the gather kernel reads over PCIe (OPS.md G7).

    ``.array`` is the NumPy view (fill it like any array); bindings use its device-side
    address. Keep the object alive while an engine may read it.
    """

    def __init__(self, shape, dtype):
        self.shape = tuple(int(d) for d in shape)
        self.dtype = dtypes.name_of(dtype)
        np_dt = dtypes.numpy_dtype(self.dtype)
        nbytes = int(np.prod(self.shape, dtype=np.int64)) * np_dt.itemsize
        self._cudart = import_cudart()
        flags = getattr(self._cudart, "cudaHostAllocMapped", 2)
        self._host = int(check_cuda(self._cudart.cudaHostAlloc(max(nbytes, 1), flags), "cudaHostAlloc"))
        self.address = int(check_cuda(self._cudart.cudaHostGetDevicePointer(self._host, 0),
                                      "cudaHostGetDevicePointer"))
        import ctypes  # noqa: PLC0415

        raw = (ctypes.c_uint8 * max(nbytes, 1)).from_address(self._host)
        self.array = np.frombuffer(raw, dtype=np.uint8, count=nbytes).view(np_dt).reshape(self.shape)

    def view(self) -> BufferView:
        return BufferView(self.address, self.shape, self.dtype, host=True)

    def free(self) -> None:
        if self._host:
            self.array = None
            self._cudart.cudaFreeHost(self._host)
            self._host = 0

    def __del__(self):
        try:
            self.free()
        except Exception:
            pass


def stream_handle(stream: Any) -> int:
    """The ``cudaStream_t`` value of ``stream``: None/0 (default stream), an int, a torch
    or CuPy stream, or a cuda-python stream object."""
    if stream is None:
        return 0
    for attr in ("cuda_stream", "ptr", "handle"):  # torch, CuPy, cuda.core
        v = getattr(stream, attr, None)
        if v is not None:
            return int(v)
    try:
        return int(stream)
    except (TypeError, ValueError):
        raise type_error("stream", "None, an int, a torch/CuPy stream or a cuda-python stream",
                         type(stream).__name__) from None
