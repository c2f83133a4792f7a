"""Streams: the ``cudaStream_t`` value of a torch/CuPy/cuda-python stream, an int
handle or None."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from ..contract.errors import type_error
from .buffers import _is_torch


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
