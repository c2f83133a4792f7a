"""``pytrt-kv info``: versions and what this installation can do, including whether
TensorRT can run engines here and, when not, why (``pytrt_kv.trt.availability``)."""

from __future__ import annotations

import argparse
import os
import platform


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # no options


def _trt_availability() -> str:
    """'' when TensorRT can run engines here, else the first reason why not."""
    try:
        from ..trt import availability

        return availability()
    except Exception as exc:  # a broken TensorRT install must not break `info`
        return f"{type(exc).__name__}: {exc}"


def _ort_availability() -> str:
    """'' when ONNX Runtime sessions with our ops work here, else why not."""
    try:
        from ..ort import availability

        return availability()
    except Exception as exc:  # a broken ONNX Runtime install must not break `info`
        return f"{type(exc).__name__}: {exc}"


def _built(info: dict[str, str], part: str, yes: str) -> str:
    """``yes`` when the build record says ``part`` was built, else its recorded reason."""
    return yes if info.get(part) == "ON" else f"no: {info.get(f'no_{part}_reason', '')}"


def run(args: argparse.Namespace) -> int:
    del args
    from .. import __version__, _lib
    from .. import info as _info

    print(f"pytrt_kv {__version__}  (Python {platform.python_version()}, {platform.machine()})")
    print("\nPython packages:")
    for name, ver in _info.package_versions().items():
        print(f"  {name:<22} {ver}")

    print("\nNative libraries:")
    info = _lib.build_info()
    if info:
        cuda = f"yes, {info.get('cuda_version', '')} for {info.get('cuda_architectures', '')}"
        print(f"  built with CUDA    {_built(info, 'cuda', cuda)}")
        plugins = f"yes (headers {info.get('tensorrt_version', '?')})"
        print(f"  TensorRT plugins   {_built(info, 'plugins', plugins)}")
    else:
        print("  no build record (package not installed through its CMake build)")
    try:  # importing pytrt_kv.datadist loads the path too
        from ..datadist import smallpush

        c_path = smallpush.load()
    except ValueError as exc:  # a PYTRT_KV_DATADIST_C that is neither 0 nor 1
        state = f"none: {exc}"
    else:
        if c_path is not None:
            state = f"C ({c_path.__file__})"
        elif os.environ.get(smallpush.ENV, "").strip() == "0":
            state = f"Python ({smallpush.ENV}=0)"
        else:
            state = "Python (the C module is not built here: docs/DATADIST.md decision 15)"
    print(f"  {'small-push path':<18} {state}")
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

    print("\nONNX Runtime (pytrt_kv.ort.make_session, polygraphy --onnxrt):")
    ort_state = _ort_availability() or "usable (onnxruntime + onnxruntime-extensions)"
    print(f"  {'sessions here':<18} {ort_state}")

    print("\nTensorRT flavours (engines: pytrt-kv build):")
    from ..trt._tensorrt import installed_flavours

    for flavour, state in installed_flavours().items():
        label = "TensorRT-RTX" if flavour == "rtx" else "TensorRT"
        extra = (
            " (builds without a GPU: --target)" if flavour == "rtx" and state[:1].isdigit() else ""
        )
        print(f"  {label:<18} {state}{extra}")
    print(f"  {'engines here':<18} {_trt_availability() or 'usable (TensorRT, GPU, plugins)'}")

    print("\nGPU:")
    if _lib.emulated():
        from .._cuda import emu

        print(f"  device in use      {emu.describe()} ({_lib.DEVICE_ENV}=emu)")
    names, detail = _info.cuda_devices()
    print(f"  {detail}")
    for i, n in enumerate(names):
        print(f"  cuda:{i} {n}")
    if not names:
        print(
            "  none: the reference, ONNX export and CPU runtime work; kernels and engines "
            "need a GPU"
        )
    return 0
