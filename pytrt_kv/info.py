"""``pytrt-kv info``: versions and what this installation can do."""

from __future__ import annotations

import argparse
import importlib
import platform

from . import _lib

_PACKAGES = (
    "numpy",
    "ml_dtypes",
    "onnx",
    "onnx_graphsurgeon",
    "onnxruntime",
    "polygraphy",
    "onnxscript",
    "torch",
    "cupy",
    "cuda",
    "tensorrt",
    "tensorrt_rtx",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # no options


def package_versions() -> dict[str, str]:
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
                from cuda import bindings

                ver = bindings.__version__
            except Exception:
                ver = "installed"
        out[name] = str(ver or "installed")
    return out


# Re-exported: `pytrt-kv info` prints them; the code lives in the driver layer.
from ._driver import EMU_NAME, NO_GPU, cuda_devices  # noqa: E402

__all__ = ["EMU_NAME", "NO_GPU", "cuda_devices", "package_versions", "run"]


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
        built = (
            f"yes, {info.get('cuda_version', '')} for {info.get('cuda_architectures', '')}"
            if cuda
            else f"no: {info.get('no_cuda_reason', '')}"
        )
        print(f"  built with CUDA    {built}")
        plugins = info.get("plugins") == "ON"
        built = (
            f"yes (headers {info.get('tensorrt_version', '?')})"
            if plugins
            else f"no: {info.get('no_plugins_reason', '')}"
        )
        print(f"  TensorRT plugins   {built}")
    else:
        print("  no build record (package not installed through its CMake build)")
    for lib in (_lib.KERNELS_LIB, _lib.EMU_KERNELS_LIB, _lib.PLUGINS_LIB, _lib.PLUGINS_AUTOREG_LIB):
        p = _lib.find(lib)
        print(f"  {lib:<34} {p if p else 'not found'}")
    own = _lib._package_lib_dir()
    if not own.is_dir():
        installed = _lib.installed_lib_dir()
        print(
            f"  note: pytrt_kv is imported from the source tree {own.parent}; "
            + (
                f"libraries come from the installed distribution ({installed})"
                if installed
                else f"no installed {_lib.DIST_NAME} with libraries was found"
            )
        )

    print("\nTensorRT flavours (engines: pytrt-kv build):")
    from .trt._tensorrt import installed_flavours

    for flavour, state in installed_flavours().items():
        label = "TensorRT-RTX" if flavour == "rtx" else "TensorRT"
        extra = (
            " (builds without a GPU: --target)" if flavour == "rtx" and state[:1].isdigit() else ""
        )
        print(f"  {label:<18} {state}{extra}")

    print("\nGPU:")
    if _lib.emulated():
        from ._cuda import emu

        print(f"  device in use      {emu.describe()} ({_lib.DEVICE_ENV}=emu)")
    names, detail = cuda_devices()
    print(f"  {detail}")
    for i, n in enumerate(names):
        print(f"  cuda:{i} {n}")
    if not names:
        print(
            "  none: the reference, ONNX export and CPU runtime work; kernels and engines "
            "need a GPU"
        )
    return 0
