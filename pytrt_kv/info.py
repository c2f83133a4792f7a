"""What this installation has: package versions and the CUDA devices (``pytrt-kv info``
prints them, :mod:`pytrt_kv.cli.info`), and :func:`install_command`, the command that adds
an extra to it (every install hint prints that, never a placeholder path)."""

from __future__ import annotations

import importlib

from ._lib import install_command

_PACKAGES = (
    "numpy",
    "ml_dtypes",
    "onnx",
    "onnx_graphsurgeon",
    "onnxruntime",
    "onnxruntime_extensions",
    "polygraphy",
    "onnxscript",
    "torch",
    "cupy",
    "cuda",
    "tensorrt",
    "tensorrt_rtx",
)


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


# Re-exported for `pytrt-kv info`; the code lives in the driver layer.
from ._driver import EMU_NAME, NO_GPU, cuda_devices  # noqa: E402

__all__ = ["EMU_NAME", "NO_GPU", "cuda_devices", "install_command", "package_versions"]
