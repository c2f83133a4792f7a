"""Load the pytrt_kv plugin library into TensorRT's plugin registry.

Two libraries are built from the same objects (docs/ARCHITECTURE.md). :func:`load_plugins`
uses ``libpytrt_kv_plugins.so`` through ``trt.get_plugin_registry().load_library``
(TensorRT calls its ``getCreators``/``setLoggerFinder``); the self-registering
``libpytrt_kv_plugins_autoreg.so`` is for ``polygraphy --plugins``, ``ctypes.CDLL`` and
``trtexec --staticPlugins``. Loading both into one process would register every creator
twice, so this module refuses to.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import Any

from .. import _lib
from ..contract import specs
from ._tensorrt import flavour_of, import_tensorrt

_lock = threading.Lock()
_loaded: dict[str, tuple[str, Path]] = {}  # flavour -> ("loader" or "autoreg", library)
_keep: list[Any] = []  # handles that must stay alive as long as the process


def _creator_registered(trt, name: str) -> bool:
    registry = trt.get_plugin_registry()
    getter = getattr(registry, "get_creator", None)
    try:
        if getter is not None:
            return getter(name, specs.PLUGIN_VERSION, specs.NAMESPACE) is not None
        return registry.get_plugin_creator(name, specs.PLUGIN_VERSION, specs.NAMESPACE) is not None
    except Exception:  # older bindings raise instead of returning None
        return False


def load_plugins(kind: str = "loader", flavour: str | None = None) -> Path:
    """Register both pytrt_kv plugin creators with TensorRT (idempotent).

    Parameters
    ----------
    kind : {"loader", "autoreg"}
        ``"loader"``: ``libpytrt_kv_plugins.so`` through the registry's ``load_library``
        (the default; TensorRT hands the library its logger). ``"autoreg"``: the
        self-registering library through ``ctypes.CDLL`` (what Polygraphy does).
    flavour : {"tensorrt", "rtx"}, optional
        Whose registry receives the creators (see :func:`pytrt_kv.trt.import_tensorrt`).

    Returns
    -------
    pathlib.Path
        The library that was loaded (found by :mod:`pytrt_kv._lib`; ``PYTRT_KV_LIB_DIR``
        overrides the package folder).

    Raises
    ------
    ImportError
        TensorRT is not installed.
    FileNotFoundError
        The library was not built (the message lists the searched paths).
    RuntimeError
        The other library is already loaded, or registration failed.

    Examples
    --------
    >>> from pytrt_kv.trt import load_plugins          # doctest: +SKIP
    >>> load_plugins().name                              # doctest: +SKIP
    'libpytrt_kv_plugins.so'
    """
    if kind not in ("loader", "autoreg"):
        raise ValueError(f"kind: expected 'loader' or 'autoreg', got {kind!r}")
    trt = import_tensorrt(flavour)
    key = flavour_of(trt)
    with _lock:
        if key in _loaded:
            loaded_kind, path = _loaded[key]
            if loaded_kind != kind:
                raise RuntimeError(
                    f"kind: {path} is already loaded; loading the {kind!r} library too would "
                    f"register every creator twice (never load both into one process)"
                )
            return path
        lib = _lib.require(_lib.PLUGINS_LIB if kind == "loader" else _lib.PLUGINS_AUTOREG_LIB)
        if kind == "loader":
            handle = trt.get_plugin_registry().load_library(str(lib))
            if handle is None:
                raise RuntimeError(f"TensorRT could not load {lib} (see the TensorRT log)")
        else:
            handle = ctypes.CDLL(str(lib))
            if handle.pytrt_kv_registered_creators() < 0:
                raise RuntimeError(f"{lib} found no TensorRT plugin registry when loaded")
        _keep.append(handle)
        missing = [n for n in specs.OPS if not _creator_registered(trt, n)]
        if missing:
            raise RuntimeError(
                f"{lib} loaded but {missing} are not in TensorRT's plugin registry "
                f"(namespace {specs.NAMESPACE!r}, version {specs.PLUGIN_VERSION!r})"
            )
        _loaded[key] = (kind, lib)
        return lib


def loaded_library(flavour: str | None = None) -> Path | None:
    """The plugin library this process loaded through :func:`load_plugins` (into the
    registry of ``flavour``; default: any), or None."""
    for key, (_, path) in _loaded.items():
        if flavour is None or key == flavour:
            return path
    return None
