"""TensorRT helpers for models that use the pytrt_kv ops (layer 4).

- :func:`load_plugins`: register the plugin creators (``libpytrt_kv_plugins.so``);
- :func:`build_plan`: ONNX -> serialized engine with full TensorRT or TensorRT-RTX (which
  builds ahead of time without a GPU, for chosen compute capabilities); parser, aliased
  plugin I/O preview feature when a node has ``alias_io`` = 1, strongly typed, timing
  cache, optional engine file; :func:`build_engine` also deserializes it;
- :class:`EngineRunner`: binds each ``*_out`` to its input's address (in place), takes
  torch/CuPy/PyCUDA/cuda-python buffers and pinned host caches (:class:`HostArray`),
  captures CUDA graphs;
- :func:`availability` and :func:`run_model_steps`: what ``pytrt-kv demo`` uses;
- :func:`prepare_for_tensorrt`: the ONNX rewrite into the plugins' positional form (also
  ``pytrt-kv prepare IN.onnx OUT.onnx`` for polygraphy/trtexec).

Importing this package never imports TensorRT; the functions that need it raise an
ImportError that says how to install it. See docs/TENSORRT.md.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence

import numpy as np

from ..graph.tensorrt import alias_pairs, needs_aliased_io, prepare_for_tensorrt

__all__ = [
    "availability",
    "run_model_steps",
    "load_plugins",
    "build_plan",
    "can_serialize_plugins",
    "plugin_loading_instructions",
    "shapes_from_dims",
    "build_engine",
    "load_engine",
    "Engine",
    "EngineRunner",
    "CudaGraph",
    "DeviceArray",
    "HostArray",
    "engine_layers",
    "plugin_layers",
    "copy_layers",
    "prepare_for_tensorrt",
    "alias_pairs",
    "needs_aliased_io",
    "import_tensorrt",
]

_LAZY = {
    "load_plugins": ".plugins",
    "build_plan": ".build",
    "can_serialize_plugins": ".build",
    "plugin_loading_instructions": ".build",
    "shapes_from_dims": ".build",
    "build_engine": ".build",
    "load_engine": ".build",
    "Engine": ".build",
    "engine_layers": ".build",
    "plugin_layers": ".build",
    "copy_layers": ".build",
    "EngineRunner": ".runner",
    "CudaGraph": ".runner",
    "DeviceArray": ".buffers",
    "HostArray": ".buffers",
    "import_tensorrt": "._tensorrt",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def availability() -> str:
    """'' when TensorRT, a CUDA GPU, cuda-python and the plugin library are all usable,
    else the first reason why not (never raises)."""
    from .. import _lib
    from .._driver import cuda_devices
    from ._tensorrt import import_cudart, import_tensorrt

    try:
        import_tensorrt()
    except ImportError as exc:
        return str(exc)
    try:
        import_cudart()
    except ImportError as exc:
        return str(exc)
    names, detail = cuda_devices()
    if not names:
        return f"no CUDA GPU ({detail})"
    try:
        _lib.require(_lib.PLUGINS_LIB)
        _lib.require(_lib.KERNELS_LIB)  # DeviceArray / HostArray / pinned-host bindings
    except FileNotFoundError as exc:
        return str(exc)
    return ""


def _profile(feeds_list: Sequence[Mapping[str, np.ndarray]]) -> dict[str, tuple]:
    shapes: dict[str, list[tuple]] = {}
    for feeds in feeds_list:
        for name, a in feeds.items():
            shapes.setdefault(name, []).append(tuple(np.shape(a)))
    out = {}
    for name, seen in shapes.items():
        ranks = {len(s) for s in seen}
        if len(ranks) != 1:
            raise ValueError(
                f"feeds_list: {name}: expected one rank in every step, got shapes {seen}"
            )
        mn = tuple(min(d) for d in zip(*seen))
        mx = tuple(max(d) for d in zip(*seen))
        out[name] = (mn, seen[0], mx)
    return out


def run_model_steps(
    onnx_path, feeds_list: Sequence[Mapping[str, np.ndarray]], *, timing_cache=None
) -> list[dict[str, np.ndarray]]:
    """Build an engine from ``onnx_path`` once and run it on each step's feeds.

    Functional semantics, as the CPU runtime: each step's feeds (caches included) are the
    whole input; each ``*_out`` is the updated cache. On the GPU the caches are updated in
    place (each ``*_out`` bound to its input's buffer).

    Parameters
    ----------
    onnx_path : str or Path
    feeds_list : sequence of mapping input name -> numpy array
        One mapping per step; dynamic inputs get one optimization profile spanning the
        shapes of all steps.
    timing_cache : str or Path, optional

    Returns
    -------
    list of dict output name -> numpy array
        Every graph output of every step.

    Examples
    --------
    >>> outs = run_model_steps("example.onnx", [feeds_step1, feeds_step2])  # doctest: +SKIP
    >>> sorted(outs[0])                                                      # doctest: +SKIP
    """
    from .build import build_engine
    from .runner import run_steps

    if not feeds_list:
        raise ValueError("feeds_list: expected at least one step, got none")
    engine = build_engine(onnx_path, shapes=_profile(feeds_list), timing_cache=timing_cache)
    return run_steps(engine, feeds_list)
