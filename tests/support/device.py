"""Buffers for the ``gpu`` tests, wherever they run: torch CUDA tensors on a real GPU (what
most users pass), pytrt_kv's own buffers on the emulated device (docs/EMULATION.md), where
torch has no CUDA. The tests write one body for both; what only torch can do (its streams,
CUDA graphs, CuPy) is in tests marked ``real_gpu``.

Every function takes and returns either kind: :func:`to_device` uploads a NumPy array (device
memory, pinned host memory, or at an unaligned address), :func:`to_numpy` reads any buffer
back (bit views: bfloat16 / float8 survive), :func:`copy_into` refills a buffer in place,
:func:`synchronize` waits for the device.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest

from pytrt_kv import _cuda
from pytrt_kv.contract import dtypes

# The markers of the tests that need a device; tests/conftest.py skips them where none runs.
gpu = pytest.mark.gpu
real_gpu = pytest.mark.real_gpu


@functools.cache
def use_torch() -> bool:
    """True on a real GPU with a CUDA build of torch; False on the emulated device (or
    without torch), where pytrt_kv's own buffers are used."""
    from pytrt_kv import _lib

    if _lib.emulated():
        return False
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


class DeviceView:
    """Part of a :class:`pytrt_kv._cuda.DeviceArray` (an offset into it), exposed through
    ``__cuda_array_interface__`` like a CuPy view: unaligned addresses for the tests of the
    narrower vector widths."""

    def __init__(self, base: Any, offset_bytes: int, shape: tuple[int, ...], dtype: np.dtype):
        self.base, self.offset = base, offset_bytes
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)

    @property
    def ptr(self) -> int:
        return (int(self.base.ptr) if self.base is not None else 0) + self.offset

    # The package's own definition, read from the same shape, dtype and ptr.
    __cuda_array_interface__ = _cuda.DeviceArray.__cuda_array_interface__

    def get(self) -> np.ndarray:
        from pytrt_kv._cuda import copy_to_host

        return copy_to_host(np.empty(self.shape, self.dtype), self.ptr, 0, -1)


def to_device(a: np.ndarray, *, pinned: bool = False, offset_elems: int = 0) -> Any:
    """A copy of ``a`` in device memory (or pinned, mapped host memory with ``pinned``),
    starting ``offset_elems`` elements into a larger buffer when > 0 (an unaligned address)."""
    a = np.array(a, order="C", copy=None)  # keeps 0-d (ascontiguousarray makes it 1-d)
    if use_torch():
        from support.arrays import to_torch

        return to_torch(
            a, device="cpu" if pinned else "cuda", pinned=pinned, offset_elems=offset_elems
        )
    from pytrt_kv._cuda import DeviceArray, HostArray

    if pinned:
        if offset_elems:
            raise NotImplementedError("pinned and unaligned together")
        host = HostArray(a.shape, a.dtype)
        host.array[...] = a
        return host
    if not offset_elems:
        return DeviceArray.from_numpy(a)
    raw = np.zeros(a.size + offset_elems, a.dtype)
    raw[offset_elems:] = a.reshape(-1)
    base = DeviceArray.from_numpy(raw)
    return DeviceView(base, offset_elems * a.dtype.itemsize, a.shape, a.dtype)


def address(x: Any) -> int:
    """The device address of a buffer made here."""
    if hasattr(x, "data_ptr"):
        return int(x.data_ptr())
    return int(x.__cuda_array_interface__["data"][0])


def zero_elements(shape: tuple[int, ...], dtype: str, *, null: bool = False) -> Any:
    """A zero-element device buffer of ``shape``: inside a live allocation (a valid,
    non-null address), or at address 0 with ``null``."""
    nd = dtypes.numpy_dtype(dtype)
    if null:
        if use_torch():
            import torch

            return torch.empty(shape, dtype=getattr(torch, dtype), device="cuda")
        return DeviceView(None, 0, tuple(shape), nd)
    # torch reports data_ptr() 0 for every zero-element tensor, views into a live
    # allocation included (seen on an H200, torch 2.11): the valid address is a view into
    # pytrt_kv's own allocation, on the GPU as on the emulated device.
    from pytrt_kv._cuda import DeviceArray

    base = DeviceArray((8,), nd)
    return DeviceView(base, 3 * nd.itemsize, tuple(shape), nd)


def strided_view(x: Any, shape: tuple[int, ...]) -> Any:
    """A non-contiguous view of the first ``shape`` elements along each axis of ``x``."""
    if use_torch():
        return x[tuple(slice(0, n) for n in shape)]
    from support.arrays import FakeCudaArray

    nd = x.dtype
    strides = []
    acc = nd.itemsize
    for n in reversed(x.shape):
        strides.insert(0, acc)
        acc *= n
    return FakeCudaArray(tuple(shape), nd.str, strides=tuple(strides), ptr=address(x))


def device_array(obj: Any) -> Any:
    """What to pass to ``pytrt_kv.ops`` for a buffer made by :func:`to_device`: the pinned
    NumPy array of a :class:`HostArray`, else the buffer itself."""
    from pytrt_kv._cuda import HostArray

    return obj.array if isinstance(obj, HostArray) else obj


def to_numpy(x: Any) -> np.ndarray:
    """The values of any buffer (torch tensor, DeviceArray, view, pinned or NumPy array)."""
    from pytrt_kv._cuda import DeviceArray, HostArray

    if isinstance(x, HostArray):
        synchronize()
        return x.array.copy()
    if isinstance(x, (DeviceArray, DeviceView)):
        return x.get()
    if isinstance(x, np.ndarray):
        synchronize()  # pinned memory written by the device
        return x.copy()
    from support.arrays import to_numpy as torch_to_numpy

    return torch_to_numpy(x)


def copy_into(dst: Any, a: np.ndarray) -> None:
    """Overwrite the buffer ``dst`` with ``a`` (same shape and dtype), in place."""
    from pytrt_kv._cuda import DeviceArray, HostArray

    a = np.array(a, order="C", copy=None)  # keeps 0-d (ascontiguousarray makes it 1-d)
    if isinstance(dst, HostArray):
        synchronize()
        dst.array[...] = a
    elif isinstance(dst, DeviceArray):
        dst.copy_from(a)
    elif isinstance(dst, np.ndarray):
        synchronize()
        dst[...] = a
    else:
        from support.arrays import to_torch

        dst.copy_(to_torch(a, device=str(dst.device) if dst.is_cuda else "cpu"))


def is_pinned_host(x: Any) -> bool:
    from pytrt_kv._cuda import HostArray

    if isinstance(x, HostArray):
        return True
    return bool(getattr(x, "is_pinned", lambda: False)()) and not getattr(x, "is_cuda", True)


def synchronize() -> None:
    """Wait for all work on the device."""
    if use_torch():
        import torch

        torch.cuda.synchronize()
        return
    from pytrt_kv._cuda import kernels

    # A synchronous zero-byte copy on the legacy stream waits for everything issued.
    dummy = np.zeros(1, np.uint8)
    kernels().pytrt_kv_copy(dummy.ctypes.data, dummy.ctypes.data, 0, 0, -1)


def empty(shape: tuple[int, ...], dtype: str) -> Any:
    """Device memory of ``shape``/``dtype`` with no particular contents."""
    if use_torch():
        import torch

        return torch.empty(shape, dtype=getattr(torch, dtype), device="cuda")
    from pytrt_kv._cuda import DeviceArray

    return DeviceArray(shape, dtypes.numpy_dtype(dtype))


def full(shape: tuple[int, ...], value: int, dtype: str) -> Any:
    """Device memory of ``shape``/``dtype`` filled with ``value``."""
    return to_device(np.full(shape, value, dtypes.numpy_dtype(dtype)))
