"""Memory pytrt_kv allocates or pins itself: :class:`DeviceArray` (device memory exposed
through ``__cuda_array_interface__``), :class:`PinnedHost` / :class:`HostArray` (pinned,
mapped host memory), copies to the host, and the gather's :class:`WorkspaceCache`."""

from __future__ import annotations

import ctypes
import math
import mmap
import threading
from typing import Any

import numpy as np

from ..contract.dtypes import name_of, numpy_dtype
from ..contract.errors import describe, type_error, value_error
from . import abi
from .abi import check_status, kernels
from .buffers import HOST, Buffer, BufferView, checked_shape, locate
from .streams import stream_handle


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
        self.ptr = 0  # free() is safe on an instance refused below
        self.dtype = numpy_dtype(dtype)
        # Negative dims and byte counts that wrap an int64 are refused before cudaMalloc.
        self.shape = checked_shape("shape", shape, self.dtype.itemsize)
        self.device = device
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize
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
        a = np.array(a, order="C", copy=None)  # keeps a 0-d array 0-d
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
        host = np.array(host, order="C", copy=None)  # keeps a 0-d array 0-d
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
        lib = abi.loaded()
        if getattr(self, "ptr", 0) and lib is not None:
            lib.pytrt_kv_device_free(self.ptr, self.device)
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
    """Pins (cudaHostRegister, mapped and portable) a C-contiguous NumPy array for its
    lifetime, so that it can be passed as a host-resident full cache (to ``pytrt_kv.ops``
    as the array, to TensorRT bindings as this object: its device-side :attr:`address`)."""

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
        lib = abi.loaded()
        if self._ptr and lib is not None:
            lib.pytrt_kv_host_unregister(self._ptr)
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
        self._ptr = 0  # close() is safe on an instance refused below
        self.dtype = numpy_dtype(dtype)
        self.shape = checked_shape("shape", shape, self.dtype.itemsize)
        nbytes = math.prod(self.shape) * self.dtype.itemsize
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
    graph capture needs (see pytrt_kv.ops).

    Keying: work queued on one stream runs in order, so calls on the same explicit stream
    may share one workspace even from several threads. The per-thread default stream
    (handle 2, and handle 0 where the library resolves it per thread) is a different
    stream in each thread with the same handle, so those handles -- and the legacy
    default stream 1, kept with them for simplicity -- are keyed per calling thread:
    otherwise two threads' plan and copy kernels would run concurrently on one miss list
    (out of bounds when shapes differ). A CUDA graph captured with a workspace owns it:
    the buffer is never freed while this cache lives, but replaying that graph while an
    eager call on the same key runs concurrently is the caller's to avoid."""

    # Stream handles that name a default stream: 0 (default), 1 (legacy), 2 (per-thread).
    DEFAULT_STREAM_HANDLES = (0, 1, 2)

    @staticmethod
    def key(device: int, stream: int) -> tuple[int, int, int]:
        """The cache key of a (device, stream) pair in the calling thread."""
        thread = threading.get_ident() if stream in WorkspaceCache.DEFAULT_STREAM_HANDLES else 0
        return device, stream, thread

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: dict[tuple[int, int, int], DeviceArray] = {}
        self._retired: list = []

    def get(self, device: int, stream: int, nbytes: int) -> tuple[int, int]:
        if nbytes == 0:
            return 0, 0
        key = self.key(device, stream)
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


class _PooledArray(DeviceArray):
    """A :class:`DeviceArray` from an :class:`OutputPool`: freeing it (or dropping the
    last reference) hands its memory back to the pool instead of ``cudaFree``."""

    def __init__(
        self,
        pool: OutputPool,
        key: tuple[int, int, int, int],
        shape: tuple[int, ...],
        dtype: Any,
        device: int,
        ptr: int | None,
    ):
        self._pool, self._key = pool, key
        if ptr is None:
            super().__init__(shape, dtype, device)
            return
        self.dtype = numpy_dtype(dtype)
        self.shape = checked_shape("shape", shape, self.dtype.itemsize)
        self.device = device
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize
        self.ptr = ptr

    def free(self) -> None:
        ptr = getattr(self, "ptr", 0)
        if ptr and self._pool.give_back(self._key, ptr):
            self.ptr = 0
            return
        super().free()


class OutputPool:
    """Device memory for the outputs the eager gather allocates itself (its
    ``selection_kv_actual_seq`` when ``out=`` is not given and no framework allocator is
    at hand), so that a steady-state decode loop makes no ``cudaMalloc``/``cudaFree`` per
    call (on a GPU ``cudaFree`` synchronizes the device).

    An array handed out returns its memory here when it is freed or garbage collected;
    the next request of the same byte size on the same (device, stream) key
    (:meth:`WorkspaceCache.key`) reuses it. Reuse is limited to one stream, like torch's
    caching allocator: work queued there before runs first. A result read on another
    stream must stay referenced until that read is done (torch's ``record_stream``
    rule). At most :attr:`MAX_FREE` free arrays are kept per key; more are freed."""

    MAX_FREE = 8

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[tuple[int, int, int, int], list[int]] = {}

    def take(self, shape: tuple[int, ...], dtype: Any, device: int, stream: int) -> DeviceArray:
        """A device array of ``shape``/``dtype`` for work on ``stream`` (reused memory
        when the pool holds some of that size for that stream)."""
        dt = numpy_dtype(dtype)
        shape = checked_shape("shape", shape, dt.itemsize)
        key = (*WorkspaceCache.key(device, stream), max(math.prod(shape) * dt.itemsize, 1))
        with self._lock:
            free = self._free.get(key)
            ptr = free.pop() if free else None
        return _PooledArray(self, key, shape, dt, device, ptr)

    def give_back(self, key: tuple[int, int, int, int], ptr: int) -> bool:
        """Keep ``ptr`` for reuse; False when the pool for ``key`` is full (then the
        caller frees it)."""
        with self._lock:
            free = self._free.setdefault(key, [])
            if len(free) >= self.MAX_FREE:
                return False
            free.append(ptr)
            return True

    def held(self) -> int:
        """Free arrays held for reuse (for tests)."""
        with self._lock:
            return sum(len(v) for v in self._free.values())
