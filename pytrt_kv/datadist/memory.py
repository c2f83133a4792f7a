"""Cache memory: what ``allocate_cache`` allocates and what ``register_cache`` accepts.

A registered tensor becomes an address plus a NIXL memory type ("DRAM" for host memory,
pinned or not; "VRAM" for device memory). Accepted objects, without importing any
framework: NumPy arrays (host), the project's :class:`pytrt_kv.trt.HostArray` /
``PinnedHost`` (host) and ``DeviceArray`` (device), torch tensors (``data_ptr``),
anything with ``__cuda_array_interface__`` (CuPy, Numba, PyCUDA) or DLPack, and raw int
addresses (engine buffers whose shape only the caller knows).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import sys
from typing import Any

import numpy as np

from .. import _cuda
from ..contract.errors import describe
from .types import CacheDesc


def _aligned_host(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 array: a cache tensor starts on a page of its own, so its
    registration with UCX never shares a page with unrelated memory."""
    page = mmap.PAGESIZE
    raw = np.empty(nbytes + page, np.uint8)
    off = -int(raw.ctypes.data) % page
    return raw[off : off + nbytes]


def allocate(desc: CacheDesc) -> tuple[list[Any], tuple[int, ...]]:
    """Allocate ``desc.num_tensors`` tensors; returns (tensors, addresses).

    Host caches are NumPy arrays of ``desc.shape`` (contents are uninitialized); device
    caches are :class:`pytrt_kv._cuda.DeviceArray` (needs the kernel library and a GPU).
    """
    tensors: list[Any] = []
    for _ in range(desc.num_tensors):
        if desc.placement == "host":
            t = _aligned_host(desc.tensor_bytes).view(desc.dtype).reshape(desc.shape)
            tensors.append(t)
        else:
            tensors.append(_cuda.DeviceArray(desc.shape, desc.dtype, desc.device))
    return tensors, tuple(address(t) for t in tensors)


def address(t: Any) -> int:
    """Address of an array this module allocated."""
    if isinstance(t, np.ndarray):
        return int(t.ctypes.data)
    return int(t.ptr)


def _check_shape(
    arg: str,
    desc: CacheDesc,
    shape: tuple[int, ...] | None,
    dtype: np.dtype | None,
    contiguous: bool,
) -> None:
    if shape is not None and tuple(shape) != desc.shape:
        raise ValueError(
            f"{arg}: expected shape {list(desc.shape)} (cache_desc.shape), got {list(shape)}"
        )
    if dtype is not None and dtype.itemsize != desc.dtype.itemsize:
        raise ValueError(
            f"{arg}: expected dtype {desc.data_type} (cache_desc.data_type), got {dtype}"
        )
    if dtype is not None and dtype.kind != "V" and dtype != desc.dtype:
        raise ValueError(
            f"{arg}: expected dtype {desc.data_type} (cache_desc.data_type), got {dtype}"
        )
    if not contiguous:
        raise ValueError(
            f"{arg}: expected a C-contiguous tensor (block b is the row t[b]; docs/SPEC.md D1)"
        )


def tensor_address(arg: str, obj: Any, desc: CacheDesc) -> int:
    """Address of one tensor handed to ``register_cache``, checked against ``desc``.

    Raises
    ------
    TypeError
        An unsupported object, or memory of the other placement.
    ValueError
        Wrong shape or dtype, not contiguous, or a null address.
    """
    host = desc.placement == "host"
    if isinstance(obj, bool):
        raise TypeError(f"{arg}: expected a tensor or an int address, got {obj!r}")
    if isinstance(obj, (int, np.integer)):
        addr = int(obj)
    elif isinstance(obj, _cuda.PinnedHost):
        a = obj.array
        _check_shape(arg, desc, a.shape, a.dtype, a.flags.c_contiguous)
        if not host:
            raise TypeError(
                f"{arg}: expected device memory (cache_desc.placement 'device'), "
                f"got pinned host memory"
            )
        addr = int(a.ctypes.data)
    elif isinstance(obj, np.ndarray):
        _check_shape(arg, desc, obj.shape, obj.dtype, obj.flags.c_contiguous)
        if not host:
            raise TypeError(
                f"{arg}: expected device memory (cache_desc.placement 'device'), "
                f"got a NumPy array {describe(obj)}"
            )
        if not obj.flags.writeable:
            raise ValueError(f"{arg}: expected a writeable array (a cache receives blocks)")
        addr = int(obj.ctypes.data)
    else:
        if isinstance(obj, _cuda.DeviceArray):
            buf = _cuda.Buffer(
                arg, obj, obj.ptr, obj.shape, obj.dtype, True, _cuda.DEVICE, obj.device
            )
        else:
            buf = _cuda.buffer(arg, obj, opaque_ok=True)
        _check_shape(arg, desc, buf.shape, buf.dtype, buf.contiguous)
        is_device = buf.kind in (_cuda.DEVICE, _cuda.MANAGED)
        if is_device == host:
            where = "device" if is_device else "host"
            raise TypeError(
                f"{arg}: expected {desc.placement} memory (cache_desc.placement), "
                f"got {where} memory"
            )
        if is_device and buf.device >= 0 and buf.device != desc.device:
            raise ValueError(
                f"{arg}: expected memory of CUDA device {desc.device} "
                f"(cache_desc.device), got device {buf.device}"
            )
        addr = buf.ptr
    if addr == 0:
        raise ValueError(f"{arg}: expected a non-null address, got 0")
    return addr


_LIBC: Any = None


def unmapped(addrs: tuple[int, ...], nbytes: int, placement: str) -> int | None:
    """Index of the first tensor whose ``nbytes`` at its address are no longer mapped in
    this process (the caller freed registered memory), else None.

    Only host memory on Linux is checked (``mincore`` fails with ENOMEM on an unmapped
    page); device memory and other systems give None (not known)."""
    global _LIBC
    if placement != "host" or not sys.platform.startswith("linux"):
        return None
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = mmap.PAGESIZE
    for i, a in enumerate(addrs):
        start = a - a % page
        length = a + nbytes - start
        vec = ctypes.create_string_buffer((length + page - 1) // page)
        if _LIBC.mincore(start, length, vec) != 0 and ctypes.get_errno() == errno.ENOMEM:
            return i
    return None


def copy_bytes(dst: int, src: int, nbytes: int, host: bool, device: int) -> None:
    """Copy ``nbytes`` between two addresses in this process: ``memmove`` for host memory,
    ``cudaMemcpyAsync(cudaMemcpyDefault)`` + synchronize when either side is device memory."""
    if host:
        ctypes.memmove(dst, src, nbytes)
    else:
        _cuda.check_status(
            _cuda.kernels().pytrt_kv_copy(dst, src, nbytes, 0, device), "datadist local copy"
        )


def synchronize_stream(stream: Any, tensors: list[Any], device: int) -> None:
    """Synchronize the stream that produced a device source before NIXL reads it
    (docs/SPEC.md D6). ``None``: torch's current stream when the cache holds torch
    tensors, else the legacy default stream."""
    sync = getattr(stream, "synchronize", None)
    if callable(sync):  # torch / CuPy / cuda.core stream objects
        sync()
        return
    handle = _cuda.resolve_stream(stream, tensors, device)
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        # No cuda-python: the kernel library's copy entry point synchronizes the stream
        # after an (empty) cudaMemcpyAsync on it.
        _cuda.check_status(
            _cuda.kernels().pytrt_kv_copy(0, 0, 0, handle, device), "stream: cudaStreamSynchronize"
        )
        return
    err = cudart.cudaStreamSynchronize(handle)[0]
    if int(err) != 0:
        raise RuntimeError(f"stream: cudaStreamSynchronize failed ({err})")
