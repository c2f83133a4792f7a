"""The CUDA driver as seen without the toolkit: which GPUs this machine has, or why none.

The lowest layer beside :mod:`pytrt_kv._lib` (it imports nothing else of pytrt_kv), so the
eager API, the TensorRT helpers, the benchmarks and ``pytrt-kv info`` all ask it
(docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import ctypes

from . import _lib

#: Start of every "no driver or no GPU" detail of :func:`cuda_devices`, also used in the
#: errors of ``pytrt_kv.ops`` (instead of the runtime's "driver version is insufficient").
NO_GPU = "no CUDA driver / GPU"


#: The name :func:`cuda_devices` gives the emulated device.
EMU_NAME = "pytrt_kv emulated device (CPU)"


def cuda_devices() -> tuple[list[str], str]:
    """Names of the CUDA GPUs, through the driver API alone (no toolkit needed), and a
    one-line detail: the driver version, or why there is no GPU (starting with
    :data:`NO_GPU`)."""
    if _lib.emulated():
        return [EMU_NAME], f"{EMU_NAME}: {_lib.DEVICE_ENV}=emu (docs/EMULATION.md)"
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return [], f"{NO_GPU}: libcuda.so.1 (the NVIDIA driver) not found"
    rc = cuda.cuInit(0)
    if rc != 0:
        return (
            [],
            f"{NO_GPU}: the driver is installed but cuInit failed with CUresult "
            f"{rc} (no usable GPU)",
        )
    count = ctypes.c_int(0)
    if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return [], f"{NO_GPU}: cuDeviceGetCount failed"
    names = []
    for i in range(count.value):
        dev = ctypes.c_int(0)
        buf = ctypes.create_string_buffer(256)
        cuda.cuDeviceGet(ctypes.byref(dev), i)
        cuda.cuDeviceGetName(buf, 256, dev)
        names.append(buf.value.decode(errors="replace"))
    drv = ctypes.c_int(0)
    cuda.cuDriverGetVersion(ctypes.byref(drv))
    version = f"driver API {drv.value // 1000}.{drv.value % 1000 // 10}"
    if not names:
        return [], f"{NO_GPU}: the driver ({version}) reports no GPU"
    return names, version
