"""ctypes glue between Python buffers and ``libpytrt_kv_kernels.so`` (private).

One module per concern; this package re-exports the names the rest of pytrt_kv uses:

- :mod:`.abi`: the C ABI of ``plugins/kernels/capi.h`` (:func:`kernels`, the Params
  mirrors, :func:`check_status`, the enum codes of ``pytrt_kv.contract.limits``).
- :mod:`.buffers`: :func:`buffer` / :func:`locate` read pointer, shape, dtype and strides
  from torch, ``__cuda_array_interface__``, NumPy or DLPack objects (:class:`Buffer`,
  :class:`BufferView`).
- :mod:`.streams`: :func:`resolve_stream` / :func:`stream_handle` give the
  ``cudaStream_t`` value to launch on.
- :mod:`.memory`: memory pytrt_kv allocates or pins itself (:class:`DeviceArray`,
  :class:`PinnedHost`, :class:`HostArray`), host copies and the gather's
  :class:`WorkspaceCache`.
- :mod:`.bindings`: :func:`binding_view`, :func:`buffer` for TensorRT bindings.

Imports go one way: abi <- buffers <- streams <- memory <- bindings. Nothing here needs
torch or CuPy; they are used only when the caller passes their objects.
"""

from __future__ import annotations

from . import abi, bindings, buffers, memory, streams
from .abi import (
    ABI_VERSION,
    DTYPE_CODE,
    LAYOUT_CODE,
    MODE_CODE,
    GatherSelectionParams,
    ScatterParams,
    check_status,
    kernels,
)
from .bindings import binding_view
from .buffers import DEVICE, HOST, MANAGED, PINNED, Buffer, BufferView, _is_torch, buffer, locate
from .memory import (
    DeviceArray,
    HostArray,
    OutputPool,
    PinnedHost,
    WorkspaceCache,
    copy_to_host,
    read_back,
)
from .streams import resolve_stream, stream_handle

__all__ = [
    "abi",
    "bindings",
    "buffers",
    "memory",
    "streams",
    "ABI_VERSION",
    "DTYPE_CODE",
    "LAYOUT_CODE",
    "MODE_CODE",
    "GatherSelectionParams",
    "ScatterParams",
    "check_status",
    "kernels",
    "binding_view",
    "DEVICE",
    "HOST",
    "MANAGED",
    "PINNED",
    "Buffer",
    "BufferView",
    "_is_torch",
    "buffer",
    "locate",
    "DeviceArray",
    "HostArray",
    "PinnedHost",
    "WorkspaceCache",
    "OutputPool",
    "copy_to_host",
    "read_back",
    "resolve_stream",
    "stream_handle",
]
