"""GPU buffers from any library, as (address, shape, dtype) for TensorRT bindings.

The implementation is shared with ``pytrt_kv.ops`` and lives in :mod:`pytrt_kv._cuda`
(:func:`~pytrt_kv._cuda.binding_view` says what is accepted); this module keeps the names
``pytrt_kv.trt`` has always exported.
"""

from __future__ import annotations

from typing import Any

from .._cuda import BufferView, DeviceArray, HostArray, PinnedHost, binding_view, stream_handle

__all__ = ["BufferView", "DeviceArray", "HostArray", "PinnedHost", "as_buffer", "stream_handle"]


def as_buffer(x: Any, arg: str) -> BufferView:
    """:func:`pytrt_kv._cuda.binding_view` with the arguments in this module's order."""
    return binding_view(arg, x)
