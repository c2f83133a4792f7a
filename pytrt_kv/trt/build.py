"""Build TensorRT engines from ONNX models that use the pytrt_kv ops."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from .. import specs
from .._errors import value_error
from ._tensorrt import import_tensorrt
from .model import alias_pairs, needs_aliased_io, prepare_for_tensorrt
from .plugins import load_plugins

Shape = Tuple[int, ...]


@dataclass
class Engine:
    """A deserialized engine plus what the runner needs to bind it in place.

    Attributes
    ----------
    engine : tensorrt.ICudaEngine
    runtime : tensorrt.Runtime
        Kept alive as long as the engine.
    plan : bytes
        The serialized engine (what ``engine_path`` received).
    aliases : dict
        Graph output -> graph input bound to one address (from the ONNX model).
    """

    engine: Any
    runtime: Any
    plan: bytes
    aliases: Dict[str, str] = field(default_factory=dict)


_LOGGERS: Dict[int, Any] = {}


def _logger(trt, verbose: bool):
    level = trt.Logger.VERBOSE if verbose else trt.Logger.WARNING
    # One logger per level for the whole process: TensorRT keeps a pointer to it.
    if level not in _LOGGERS:
        _LOGGERS[level] = trt.Logger(level)
    return _LOGGERS[level]


def _network_flags(trt) -> int:
    flags = 0
    cflag = trt.NetworkDefinitionCreationFlag
    # TensorRT 10: strong typing is opt-in; 11: always on (the flag is deprecated, may vanish).
    strongly = getattr(cflag, "STRONGLY_TYPED", None)
    if strongly is not None and trt.__version__.split(".")[0] == "10":
        flags |= 1 << int(strongly)
    return flags


def _profile_shapes(network, shapes: Mapping[str, Any]) -> Dict[str, Tuple[Shape, Shape, Shape]]:
    out: Dict[str, Tuple[Shape, Shape, Shape]] = {}
    for i in range(network.num_inputs):
        t = network.get_input(i)
        dims = tuple(t.shape)
        if all(d >= 0 for d in dims):
            continue
        if t.name not in shapes:
            raise value_error("shapes", f"min/opt/max shapes for the dynamic input {t.name!r} "
                              f"{list(dims)}", f"only {sorted(shapes)}")
        s = shapes[t.name]
        if len(s) == 3 and all(isinstance(x, (tuple, list)) for x in s):
            out[t.name] = tuple(tuple(int(d) for d in x) for x in s)  # type: ignore[assignment]
        else:
            one = tuple(int(d) for d in s)
            out[t.name] = (one, one, one)
    return out


def build_engine(onnx_path, *, engine_path=None, timing_cache=None,
                 shapes: Optional[Mapping[str, Any]] = None, workspace: Optional[int] = None,
                 aliased_plugin_io: Optional[bool] = None, detailed_profile: bool = True,
                 verbose: bool = False) -> Engine:
    """Parse an ONNX model with pytrt_kv nodes and build a TensorRT engine.

    The plugin library is loaded into the registry first (:func:`load_plugins`), the
    model is put in the plugins' positional form (:func:`prepare_for_tensorrt`), and the
    network is strongly typed (the ONNX dtypes are the plugin dtypes).

    Parameters
    ----------
    onnx_path : str or Path
    engine_path : str or Path, optional
        Where to write the serialized engine.
    timing_cache : str or Path, optional
        Timing cache file: read when it exists, written back after the build. A cache
        TensorRT refuses (another GPU or TensorRT version, corrupt) raises ValueError
        before the build, so the file is never silently replaced.
    shapes : mapping input name -> shape or (min, opt, max), optional
        Needed for every dynamic input (one optimization profile).
    workspace : int, optional
        Workspace pool limit in bytes.
    aliased_plugin_io : bool, optional
        Enable ``PreviewFeature.ALIASED_PLUGIN_IO_10_03``; default: when a pytrt_kv node
        has ``alias_io`` = 1 (without the feature TensorRT ignores ``getAliasedInput``).
    detailed_profile : bool
        ``ProfilingVerbosity.DETAILED`` so the engine inspector names the plugin layers.
    verbose : bool
        TensorRT verbose logging.

    Returns
    -------
    Engine

    Raises
    ------
    ImportError
        TensorRT is not installed.
    RuntimeError
        The parser or the builder failed (the message carries the parser's errors).
    ValueError
        TensorRT refused the ``timing_cache`` file, or a dynamic input has no ``shapes``.

    Examples
    --------
    >>> from pytrt_kv.trt import build_engine, EngineRunner    # doctest: +SKIP
    >>> eng = build_engine("scatter.onnx", timing_cache="cache.bin")  # doctest: +SKIP
    >>> runner = EngineRunner(eng)                                 # doctest: +SKIP
    """
    import onnx  # noqa: PLC0415

    trt = import_tensorrt()
    load_plugins()
    logger = _logger(trt, verbose)
    model = prepare_for_tensorrt(onnx.load(str(onnx_path)))
    want_alias = needs_aliased_io(model) if aliased_plugin_io is None else bool(aliased_plugin_io)

    builder = trt.Builder(logger)
    network = builder.create_network(_network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(model.SerializeToString(), str(Path(onnx_path).resolve())):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT's ONNX parser rejected {onnx_path}: {errors}")

    config = builder.create_builder_config()
    if want_alias:
        feature = getattr(trt.PreviewFeature, "ALIASED_PLUGIN_IO_10_03", None)
        if feature is None:
            raise RuntimeError("this TensorRT has no PreviewFeature.ALIASED_PLUGIN_IO_10_03; "
                               "export the model with alias_io=0")
        config.set_preview_feature(feature, True)
    if workspace is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace))
    if detailed_profile:
        config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    profile_shapes = _profile_shapes(network, shapes or {})
    if profile_shapes:
        profile = builder.create_optimization_profile()
        for name, (mn, opt, mx) in profile_shapes.items():
            profile.set_shape(name, mn, opt, mx)
        config.add_optimization_profile(profile)
    cache_file = Path(timing_cache) if timing_cache is not None else None
    if cache_file is not None:
        data = cache_file.read_bytes() if cache_file.is_file() else b""
        cache = config.create_timing_cache(data)
        # ignore_mismatch=False: a cache from another device is refused, not used.
        if cache is None or not config.set_timing_cache(cache, ignore_mismatch=False):
            raise value_error("timing_cache", "a timing cache TensorRT accepts for this GPU and "
                              "version (delete the file to start a new one)", str(cache_file))

    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError(f"TensorRT could not build an engine from {onnx_path} (see the log above; "
                           f"run with verbose=True for details)")
    plan_bytes = bytes(plan)
    if cache_file is not None:
        tmp = cache_file.with_suffix(cache_file.suffix + ".tmp")
        tmp.write_bytes(bytes(config.get_timing_cache().serialize()))
        os.replace(tmp, cache_file)  # never leave a half-written cache behind
    if engine_path is not None:
        Path(engine_path).write_bytes(plan_bytes)
    return load_engine(plan_bytes, aliases=alias_pairs(model), verbose=verbose)


def load_engine(plan, *, aliases: Optional[Mapping[str, str]] = None,
                verbose: bool = False) -> Engine:
    """Deserialize ``plan`` (bytes or an engine file path) after loading the plugins.

    ``aliases`` (graph output -> graph input) should come from the model
    (:func:`pytrt_kv.trt.model.alias_pairs`); without it, only the pairs TensorRT reports
    (``get_aliased_input_tensor``, TensorRT 10.14+) and the ``*_out`` naming of
    specs.py are used.
    """
    trt = import_tensorrt()
    load_plugins()
    if isinstance(plan, (str, Path)):
        plan = Path(plan).read_bytes()
    runtime = trt.Runtime(_logger(trt, verbose))
    engine = runtime.deserialize_cuda_engine(plan)
    if engine is None:
        raise RuntimeError("TensorRT could not deserialize the engine (built by another TensorRT "
                           "version or GPU, or the plugins are missing)")
    return Engine(engine, runtime, bytes(plan), dict(aliases or {}))


def engine_layers(engine) -> Sequence[Dict[str, Any]]:
    """The engine inspector's per-layer JSON (needs ``detailed_profile`` at build time)."""
    import json  # noqa: PLC0415

    trt = import_tensorrt()
    eng = getattr(engine, "engine", engine)
    inspector = eng.create_engine_inspector()
    info = json.loads(inspector.get_engine_information(trt.LayerInformationFormat.JSON))
    layers = info.get("Layers", [])
    return [layer if isinstance(layer, dict) else {"Name": layer} for layer in layers]


def plugin_layers(engine) -> Sequence[Dict[str, Any]]:
    """Layers that run a pytrt_kv plugin (so no fallback replaced it)."""
    out = []
    for layer in engine_layers(engine):
        text = str(layer)
        if any(name in text for name in specs.OPS) and "Plugin" in text:
            out.append(layer)
    return out


def copy_layers(engine) -> Sequence[Dict[str, Any]]:
    """Layers TensorRT added that only move data (reformat/copy): the cost aliasing
    is meant to avoid. Their presence is what the ``trt`` tests measure."""
    out = []
    for layer in engine_layers(engine):
        kind = str(layer.get("LayerType", "")) + " " + str(layer.get("Name", ""))
        if any(k in kind for k in ("Reformat", "Copy", "copy", "reformat")):
            out.append(layer)
    return out
