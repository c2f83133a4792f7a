"""TensorRT bindings (``pytrt_kv.trt``): :func:`binding_view` is :func:`buffer` that also
takes raw cuda-python allocations and addresses, pinned host arrays, and bfloat16/float8
arrays whose dtype only the engine knows."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..contract.dtypes import name_of
from ..contract.errors import type_error, value_error
from .buffers import HOST, PINNED, BufferView, _is_torch, buffer, locate
from .memory import DeviceArray, PinnedHost


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
