"""``pytrt-kv info``: versions and what this installation can do."""

from __future__ import annotations

import argparse
import ctypes
import importlib
import platform
from typing import Dict, List, Tuple

from . import _lib

_PACKAGES = ("numpy", "ml_dtypes", "onnx", "onnx_graphsurgeon", "onnxruntime", "polygraphy",
             "onnxscript", "torch", "cupy", "cuda", "tensorrt", "tensorrt_rtx")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # no options


def package_versions() -> Dict[str, str]:
    out = {}
    for name in _PACKAGES:
        try:
            mod = importlib.import_module(name)
        except Exception as exc:  # a broken optional package must not break `info`
            out[name] = "not installed" if isinstance(exc, ImportError) else f"broken ({exc})"
            continue
        ver = getattr(mod, "__version__", None)
        if ver is None and name == "cuda":
            try:
                from cuda import bindings  # type: ignore

                ver = bindings.__version__
            except Exception:
                ver = "installed"
        out[name] = str(ver or "installed")
    return out


def cuda_devices() -> Tuple[List[str], str]:
    """Names of the CUDA GPUs, through the driver API alone (no toolkit needed)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return [], "no CUDA driver (libcuda.so.1 not found)"
    if cuda.cuInit(0) != 0:
        return [], "CUDA driver present but cuInit failed (no usable GPU)"
    count = ctypes.c_int(0)
    if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return [], "cuDeviceGetCount failed"
    names = []
    for i in range(count.value):
        dev = ctypes.c_int(0)
        buf = ctypes.create_string_buffer(256)
        cuda.cuDeviceGet(ctypes.byref(dev), i)
        cuda.cuDeviceGetName(buf, 256, dev)
        names.append(buf.value.decode(errors="replace"))
    drv = ctypes.c_int(0)
    cuda.cuDriverGetVersion(ctypes.byref(drv))
    return names, f"driver API {drv.value // 1000}.{drv.value % 1000 // 10}"


def run(args: argparse.Namespace) -> int:
    del args
    from . import __version__

    print(f"pytrt_kv {__version__}  (Python {platform.python_version()}, {platform.machine()})")
    print("\nPython packages:")
    for name, ver in package_versions().items():
        print(f"  {name:<18} {ver}")

    print("\nNative libraries:")
    info = _lib.build_info()
    if info:
        cuda = info.get("cuda") == "ON"
        print(f"  built with CUDA    {'yes, ' + info.get('cuda_version', '') + ' for ' + info.get('cuda_architectures', '') if cuda else 'no: ' + info.get('no_cuda_reason', '')}")
        plugins = info.get("plugins") == "ON"
        print(f"  TensorRT plugins   {'yes (headers ' + info.get('tensorrt_version', '?') + ')' if plugins else 'no: ' + info.get('no_plugins_reason', '')}")
    else:
        print("  no build record (package not installed through its CMake build)")
    for lib in (_lib.KERNELS_LIB, _lib.PLUGINS_LIB, _lib.PLUGINS_AUTOREG_LIB):
        p = _lib.find(lib)
        print(f"  {lib:<34} {p if p else 'not found'}")

    print("\nTensorRT flavours (engines: pytrt-kv build):")
    from .trt._tensorrt import installed_flavours

    for flavour, state in installed_flavours().items():
        label = "TensorRT-RTX" if flavour == "rtx" else "TensorRT"
        extra = " (builds without a GPU: --target)" if flavour == "rtx" and state[:1].isdigit() else ""
        print(f"  {label:<18} {state}{extra}")

    print("\nGPU:")
    names, detail = cuda_devices()
    print(f"  {detail}")
    for i, n in enumerate(names):
        print(f"  cuda:{i} {n}")
    if not names:
        print("  none: the reference, ONNX export and CPU runtime work; kernels and engines need a GPU")
    return 0
