"""Lazy, checked imports of TensorRT and cuda-python.

Nothing in ``pytrt_kv.trt`` imports ``tensorrt`` at module load: the package must import
(and explain itself) on machines without TensorRT.
"""

from __future__ import annotations

from typing import Any, Tuple

#: Oldest TensorRT with IPluginV3OneBuildV2 / aliased plugin I/O (ARCHITECTURE.md).
MIN_TENSORRT = (10, 3)

_INSTALL_HINT = ("install it with `pip install 'pytrt-kv[trt]'` (TensorRT 10.3+ or 11.x "
                 "wheels, or a TensorRT tar/deb install) on a machine with an NVIDIA driver")


def _version_tuple(text: str) -> Tuple[int, ...]:
    parts = []
    for p in str(text).split("."):
        digits = "".join(ch for ch in p if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def import_tensorrt() -> Any:
    """The ``tensorrt`` module, or an ImportError that says what is missing and how to fix it.

    Raises
    ------
    ImportError
        When TensorRT is not installed, does not import (e.g. the stub wheel without its
        libraries), or is older than 10.3.
    """
    try:
        import tensorrt as trt  # noqa: PLC0415 - lazy by design
    except ImportError as exc:
        raise ImportError(f"pytrt_kv.trt needs the TensorRT Python package, which is not "
                          f"installed ({exc}); {_INSTALL_HINT}") from exc
    except Exception as exc:  # the PyPI stub raises other errors when libraries are missing
        raise ImportError(f"pytrt_kv.trt: `import tensorrt` failed: {type(exc).__name__}: "
                          f"{exc}; {_INSTALL_HINT}") from exc
    try:
        # Lazy-loading wrappers only touch the native libraries on first attribute access.
        version = _version_tuple(getattr(trt, "__version__", "0"))
    except Exception as exc:
        raise ImportError(f"pytrt_kv.trt: `import tensorrt` failed: {type(exc).__name__}: "
                          f"{exc}; {_INSTALL_HINT}") from exc
    if version[:2] < MIN_TENSORRT:
        raise ImportError(f"pytrt_kv.trt needs TensorRT >= {MIN_TENSORRT[0]}.{MIN_TENSORRT[1]}, "
                          f"got {getattr(trt, '__version__', '?')}; {_INSTALL_HINT}")
    return trt


def tensorrt_version() -> Tuple[int, ...]:
    """(major, minor, patch, ...) of the installed TensorRT (imports it)."""
    return _version_tuple(import_tensorrt().__version__)


def import_cudart() -> Any:
    """cuda-python's runtime module (``cuda.bindings.runtime``, or ``cuda.cudart`` on
    older releases), or an ImportError naming the extra to install."""
    try:
        from cuda.bindings import runtime as cudart  # noqa: PLC0415
        return cudart
    except ImportError:
        pass
    try:
        from cuda import cudart  # type: ignore  # noqa: PLC0415 - cuda-python < 12.6
        return cudart
    except ImportError as exc:
        raise ImportError("pytrt_kv.trt needs cuda-python for streams and device memory; "
                          "install it with `pip install 'pytrt-kv[trt]'` (or 'pytrt-kv[gpu]')"
                          ) from exc


def check_cuda(result: Any, what: str) -> Any:
    """Unwrap a cuda-python ``(err, *values)`` tuple; RuntimeError naming ``what`` on error."""
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
