"""The emulated device (docs/EMULATION.md): what only ``libpytrt_kv_kernels_emu.so``
offers beyond the C ABI, for tests and ``pytrt-kv info``.

:func:`take_launches` returns the kernels that ran since the last call with the bytes
their load/store intrinsics moved (the work counters); :func:`reset` clears a sticky
fault (the emulator's ``cudaDeviceReset``).
"""

from __future__ import annotations

import ctypes
import json
from typing import Any

from .. import _lib
from .abi import kernels


def _lib_checked() -> ctypes.CDLL:
    if not _lib.emulated():
        raise RuntimeError(
            f"pytrt_kv._cuda.emu needs the emulated device: set {_lib.DEVICE_ENV}=emu before "
            f"the kernel library is loaded"
        )
    return kernels()


def describe() -> str:
    """One line: the emulated device's description and sanitizer."""
    lib = _lib_checked()
    fn = lib.pytrt_kv_emu_describe
    fn.restype = ctypes.c_char_p
    fn.argtypes = []
    return (fn() or b"").decode()


def take_launches() -> list[dict[str, Any]]:
    """Kernel launches executed since the last call, oldest first (waits for queued work).

    Each is ``{"name", "grid", "block", "bytes_read", "bytes_written", "loads",
    "stores"}``; the byte counts are those of the kernels' cache-hint loads and stores
    (``__ldg``/``__ldcs``/``__stwb``: the data each copy moves), not of index reads.
    """
    lib = _lib_checked()
    fn = lib.pytrt_kv_emu_take_launches
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    while True:
        need = fn(None, 0)
        buf = ctypes.create_string_buffer(need + 1)
        if fn(buf, need + 1) <= need:  # taken (more may have arrived: then read again)
            return [json.loads(line) for line in buf.value.decode().splitlines() if line]


def reset() -> None:
    """Clear a sticky fault and drop queued work (the emulator's ``cudaDeviceReset``)."""
    lib = _lib_checked()
    lib.pytrt_kv_emu_reset.restype = None
    lib.pytrt_kv_emu_reset()
