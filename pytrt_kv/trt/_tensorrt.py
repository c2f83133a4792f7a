"""Lazy, checked imports of TensorRT and cuda-python.

Nothing in ``pytrt_kv.trt`` imports ``tensorrt`` at module load: the package must import
(and explain itself) on machines without TensorRT.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any

from .._lib import install_command

#: Oldest TensorRT with IPluginV3OneBuildV2 / aliased plugin I/O (docs/TENSORRT.md).
MIN_TENSORRT = (10, 3)
#: Oldest TensorRT-RTX accepted (its 1.x releases carry the TensorRT 10.x plugin API;
#: 1.7.1 is the one the test suite builds with, docs/TENSORRT.md "TensorRT-RTX").
MIN_TENSORRT_RTX = (1, 0)

#: The Python modules of the two flavours, in the order they are tried.
FLAVOURS = {"tensorrt": ("tensorrt", MIN_TENSORRT), "rtx": ("tensorrt_rtx", MIN_TENSORRT_RTX)}

#: Environment variable that picks a flavour ("tensorrt" or "rtx") instead of trying both.
FLAVOUR_ENV = "PYTRT_KV_TENSORRT"


def _install_hint() -> str:
    return (
        f"install it with `{install_command('trt')}` (TensorRT 10.3+ or 11.x wheels, or a "
        "TensorRT tar/deb install) on a machine with an NVIDIA driver, or "
        f"`{install_command('rtx')}` (TensorRT-RTX, which also builds engines without a GPU)"
    )


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for p in str(text).split("."):
        digits = "".join(ch for ch in p if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _import_flavour(flavour: str) -> Any:
    module, minimum = FLAVOURS[flavour]
    label = "TensorRT-RTX" if flavour == "rtx" else "TensorRT"
    try:
        trt = importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"pytrt_kv.trt needs the {label} Python package, which is not "
            f"installed ({exc}); {_install_hint()}"
        ) from exc
    except Exception as exc:  # the PyPI stub raises other errors when libraries are missing
        raise ImportError(
            f"pytrt_kv.trt: `import {module}` failed: {type(exc).__name__}: {exc}; "
            f"{_install_hint()}"
        ) from exc
    try:
        # Lazy-loading wrappers only touch the native libraries on first attribute access.
        version = _version_tuple(getattr(trt, "__version__", "0"))
    except Exception as exc:
        raise ImportError(
            f"pytrt_kv.trt: `import {module}` failed: {type(exc).__name__}: {exc}; "
            f"{_install_hint()}"
        ) from exc
    if version[:2] < minimum:
        raise ImportError(
            f"pytrt_kv.trt needs {label} >= {minimum[0]}.{minimum[1]}, "
            f"got {getattr(trt, '__version__', '?')}; {_install_hint()}"
        )
    return trt


def import_tensorrt(flavour: str | None = None) -> Any:
    """The TensorRT module, or an ImportError that says what is missing and how to fix it.

    Parameters
    ----------
    flavour : {"tensorrt", "rtx"}, optional
        ``"tensorrt"``: the full TensorRT (``import tensorrt``, 10.3+); ``"rtx"``:
        TensorRT-RTX (``import tensorrt_rtx``, 1.x). Default: ``$PYTRT_KV_TENSORRT`` when
        set, else full TensorRT when it imports, else TensorRT-RTX.

    Raises
    ------
    ImportError
        When no flavour is installed, it does not import (e.g. the stub wheel without
        its libraries), or it is older than 10.3 (TensorRT) / 1.0 (TensorRT-RTX).
    ValueError
        ``flavour`` (or ``$PYTRT_KV_TENSORRT``) names no flavour.
    """
    if flavour is None:
        flavour = os.environ.get(FLAVOUR_ENV) or None
        where = FLAVOUR_ENV
    else:
        where = "flavour"
    if flavour is not None:
        if flavour not in FLAVOURS:
            raise ValueError(f"{where}: expected one of {sorted(FLAVOURS)}, got {flavour!r}")
        return _import_flavour(flavour)
    try:
        return _import_flavour("tensorrt")
    except ImportError as first:
        try:
            return _import_flavour("rtx")
        except ImportError:
            raise first from None


def flavour_of(trt: Any) -> str:
    """``"rtx"`` for the TensorRT-RTX module, else ``"tensorrt"``."""
    return "rtx" if getattr(trt, "__name__", "").startswith("tensorrt_rtx") else "tensorrt"


def tensorrt_version(flavour: str | None = None) -> tuple[int, ...]:
    """(major, minor, patch, ...) of the installed TensorRT (imports it)."""
    return _version_tuple(import_tensorrt(flavour).__version__)


def installed_flavours() -> dict[str, str]:
    """flavour -> version, or the reason it cannot be used, for each flavour (never raises;
    imports each installed one)."""
    out = {}
    for flavour, (module, _) in FLAVOURS.items():
        if importlib.util.find_spec(module) is None:
            out[flavour] = "not installed"
            continue
        try:
            out[flavour] = str(_import_flavour(flavour).__version__)
        except ImportError as exc:
            out[flavour] = f"unusable: {exc}"
    return out


def import_cudart() -> Any:
    """cuda-python's runtime module (``cuda.bindings.runtime``, or ``cuda.cudart`` on
    older releases), or an ImportError naming the extra to install."""
    try:
        from cuda.bindings import runtime as cudart  # noqa: PLC0415

        return cudart
    except ImportError:
        pass
    try:
        from cuda import cudart  # noqa: PLC0415 - cuda-python < 12.6

        return cudart
    except ImportError as exc:
        raise ImportError(
            "pytrt_kv.trt needs cuda-python for streams and device memory; "
            f"install it with `{install_command('trt')}` (or the 'gpu' extra)"
        ) from exc


def check_cuda(result: Any, what: str) -> Any:
    """Unwrap a cuda-python ``(err, *values)`` tuple; RuntimeError naming ``what`` on error."""
    err: Any
    if isinstance(result, tuple):
        err, rest = result[0], result[1:]
    else:
        err, rest = result, ()
    code = int(getattr(err, "value", err))
    if code != 0:
        name = getattr(err, "name", str(code))
        raise RuntimeError(f"{what} failed: {name}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest
