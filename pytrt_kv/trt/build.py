"""Build TensorRT engines from ONNX models that use the pytrt_kv ops."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import _lib
from ..contract import specs
from ..contract.errors import value_error
from ..graph.lint import parse_target, validate_model
from ..graph.tensorrt import alias_pairs, needs_aliased_io, prepare_for_tensorrt
from . import _rtx
from ._tensorrt import flavour_of, import_tensorrt
from .plugins import load_plugins

Shape = tuple[int, ...]


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
    aliases: dict[str, str] = field(default_factory=dict)


_LOGGERS: dict[tuple[int, bool], Any] = {}


def _logger(trt, verbose: bool):
    """One recording logger per TensorRT module and level for the whole process
    (TensorRT keeps a pointer to it): prints warnings and errors (everything when
    ``verbose``) to stderr and keeps the error messages, so that a failed build can say
    what the plugin said."""
    key = (id(trt), bool(verbose))
    if key in _LOGGERS:
        return _LOGGERS[key]
    base = getattr(trt, "ILogger", None)
    if base is None:  # a minimal TensorRT stand-in (tests): its Logger(level) is enough
        logger = trt.Logger(trt.Logger.VERBOSE if verbose else trt.Logger.WARNING)
    else:
        threshold = 4 if verbose else 2  # Severity: 0 internal error .. 2 warning .. 4 verbose

        # base is TensorRT's ILogger, found at run time (mypy cannot type a runtime base).
        class _Recorder(base):  # type: ignore[misc,valid-type]
            def __init__(self):
                base.__init__(self)
                self.errors: list[str] = []

            def log(self, severity, msg):
                level = int(severity)
                if level <= threshold:
                    print(f"[TensorRT] {str(severity).split('.')[-1]}: {msg}", file=sys.stderr)
                if level <= 1:
                    self.errors.append(str(msg))

        logger = _Recorder()
    _LOGGERS[key] = logger
    return logger


def _errors_since(logger, mark: int) -> list[str]:
    return list(getattr(logger, "errors", [])[mark:])


def _network_flags(trt) -> int:
    flags = 0
    cflag = trt.NetworkDefinitionCreationFlag
    # TensorRT 10: strong typing is opt-in; 11 and TensorRT-RTX: always on (the flag is
    # deprecated there and may vanish).
    strongly = getattr(cflag, "STRONGLY_TYPED", None)
    if (
        strongly is not None
        and flavour_of(trt) == "tensorrt"
        and trt.__version__.split(".")[0] == "10"
    ):
        flags |= 1 << int(strongly)
    return flags


def _profile_shapes(network, shapes: Mapping[str, Any]) -> dict[str, tuple[Shape, Shape, Shape]]:
    out: dict[str, tuple[Shape, Shape, Shape]] = {}
    for i in range(network.num_inputs):
        t = network.get_input(i)
        dims = tuple(t.shape)
        if all(d >= 0 for d in dims):
            continue
        if t.name not in shapes:
            raise value_error(
                "shapes",
                f"min/opt/max shapes for the dynamic input {t.name!r} {list(dims)}",
                f"only {sorted(shapes)}",
            )
        s = shapes[t.name]
        if len(s) == 3 and all(isinstance(x, (tuple, list)) for x in s):
            out[t.name] = tuple(tuple(int(d) for d in x) for x in s)  # type: ignore[assignment]
        else:
            one = tuple(int(d) for d in s)
            out[t.name] = (one, one, one)
    return out


def rtx_targets(trt) -> list[str]:
    """Every compute capability this TensorRT-RTX can build for (``["SM75", ...]``)."""
    members = getattr(trt.ComputeCapability, "__members__", {})
    return [name for name in members if name.startswith("SM")]


def default_rtx_targets(trt, record: str | None = None) -> list[str]:
    """What a TensorRT-RTX build without ``targets`` on a machine without a GPU builds
    for: every compute capability TensorRT-RTX knows on which the installed kernels run
    (their ``cuda_architectures``, ``build_info.json``; ``record`` overrides it). Building
    for all TensorRT-RTX knows would include SM75, which the kernels are not built for
    and on which the builder fails inside TensorRT (issue 31).

    Raises
    ------
    ValueError
        No record of the kernels' architectures, or none TensorRT-RTX builds for: the
        message names ``--target``.
    """
    from ..graph.lint import _installed_record, kernel_architectures, runs_on  # noqa: PLC0415

    record = _installed_record() if record is None else record
    known = rtx_targets(trt)
    archs = kernel_architectures(record or "")
    if archs is None:
        raise value_error(
            "targets",
            f"--target (targets=) naming the compute capabilities to build for: there is no "
            f"GPU here and the installed kernels record no CUDA architectures to default to "
            f"(build_info.json cuda_architectures {record!r}); TensorRT-RTX "
            f"{trt.__version__} builds for {', '.join(known)}",
            "none",
        )
    picked = [n for n in known if runs_on(int(n[2:]), *archs)]
    if not picked:
        raise value_error(
            "targets",
            f"--target (targets=): none of the compute capabilities TensorRT-RTX "
            f"{trt.__version__} builds for ({', '.join(known)}) runs the installed kernels "
            f"(cuda_architectures {record!r})",
            "none",
        )
    return picked


def _targets_without_a_gpu(trt) -> list[str] | None:
    """TensorRT-RTX on a machine without a GPU: :func:`default_rtx_targets`, decided in
    this process against the kernels it loads (the build child is handed the list);
    None (the flavour's default) otherwise."""
    if flavour_of(trt) != "rtx":
        return None
    from .._driver import cuda_devices  # noqa: PLC0415

    return None if cuda_devices()[0] else default_rtx_targets(trt)


def _set_targets(trt, config, targets: Sequence[Any] | None) -> None:
    if flavour_of(trt) != "rtx":
        if targets:
            raise value_error(
                "targets",
                "no targets with full TensorRT (it builds for the GPU "
                "it runs on; targets are a TensorRT-RTX feature)",
                list(targets),
            )
        return
    if targets is None:
        from .._driver import cuda_devices  # noqa: PLC0415

        if cuda_devices()[0]:
            return  # TensorRT-RTX's default: the GPU of this machine (CURRENT)
        targets = default_rtx_targets(trt)  # no GPU: those the installed kernels run on
    names = [parse_target(t) for t in targets]
    if not names:
        raise value_error("targets", "at least one compute capability", "an empty list")
    known = rtx_targets(trt)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise value_error(
            "targets",
            f"compute capabilities TensorRT-RTX {trt.__version__} builds for ({', '.join(known)})",
            ", ".join(unknown),
        )
    config.num_compute_capabilities = len(names)
    for i, name in enumerate(names):
        config.set_compute_capability(getattr(trt.ComputeCapability, name), i)


def _progress_monitor(trt):
    base = getattr(trt, "IProgressMonitor", None)
    if base is None:
        return None

    class _Progress(base):
        """Prints each top-level build phase and how long it took (``pytrt-kv build``)."""

        def __init__(self):
            base.__init__(self)
            self.started: dict[str, float] = {}

        def phase_start(self, phase_name, parent_phase, num_steps):
            if parent_phase is None:
                self.started[phase_name] = time.perf_counter()
                print(f"  {phase_name} ...", file=sys.stderr, flush=True)

        def step_complete(self, phase_name, step):
            return True  # never cancel

        def phase_finish(self, phase_name):
            t0 = self.started.pop(phase_name, None)
            if t0 is not None:
                print(
                    f"  {phase_name} done in {time.perf_counter() - t0:.2f} s",
                    file=sys.stderr,
                    flush=True,
                )

    return _Progress()


def can_serialize_plugins(trt) -> bool:
    """True when ``build_plan(..., serialize_plugins=True)`` puts the plugin library into
    the plan with this TensorRT module: TensorRT-RTX (``plugins_to_serialize``, loaded back
    by a runtime with ``engine_host_code_allowed``). Full TensorRT embeds libraries only in
    version-compatible plans, which pytrt_kv does not build (docs/TENSORRT.md)."""
    return flavour_of(trt) == "rtx" and hasattr(trt.IBuilderConfig, "plugins_to_serialize")


def plugin_loading_instructions(plan_path) -> str:
    """How to load the plugin library before deserializing ``plan_path`` (a plan built
    without the library inside it)."""
    try:
        lib: str = str(_lib.require(_lib.PLUGINS_LIB))
    except FileNotFoundError:
        lib = _lib.PLUGINS_LIB
    return (
        f"{plan_path} needs the pytrt_kv plugins loaded before it is deserialized: "
        f"{lib}. From Python: pytrt_kv.trt.load_engine({str(plan_path)!r}) (it calls "
        f"pytrt_kv.trt.load_plugins first); with trtexec: trtexec --loadEngine={plan_path} "
        f"--dynamicPlugins={lib}; elsewhere: IPluginRegistry::loadLibrary({lib!r}) "
        f"(PYTRT_KV_LIB_DIR names another folder for pytrt_kv to find it in)"
    )


def build_plan(
    onnx_path,
    *,
    engine_path=None,
    timing_cache=None,
    shapes: Mapping[str, Any] | None = None,
    workspace: int | None = None,
    aliased_plugin_io: bool | None = None,
    detailed_profile: bool = True,
    verbose: bool = False,
    targets: Sequence[Any] | None = None,
    flavour: str | None = None,
    progress: bool = False,
    dims: Mapping[str, Any] | None = None,
    serialize_plugins: bool = False,
) -> bytes:
    """Parse an ONNX model with pytrt_kv nodes and build a serialized TensorRT engine.

    Building needs no GPU with TensorRT-RTX (ahead-of-time for ``targets``); full
    TensorRT builds for the GPU it runs on. Nothing is deserialized: see
    :func:`build_engine` for an engine ready to run.

    Parameters
    ----------
    onnx_path : str or Path
    engine_path : str or Path, optional
        Where to write the serialized engine.
    timing_cache : str or Path, optional
        Timing cache file (full TensorRT only): read when it exists, written back after
        the build. A cache TensorRT refuses (another GPU or TensorRT version, corrupt)
        raises ValueError before the build, so the file is never silently replaced.
    shapes : mapping input name -> shape or (min, opt, max), optional
        Needed for every dynamic input (one optimization profile).
    dims : mapping dim name -> (min, opt, max), optional
        Ranges of symbolic dimensions, applied to every input that uses them
        (:func:`shapes_from_dims`); ``shapes`` entries override them per input.
    workspace : int, optional
        Workspace pool limit in bytes.
    aliased_plugin_io : bool, optional
        Enable ``PreviewFeature.ALIASED_PLUGIN_IO_10_03``; default: when a pytrt_kv node
        has ``alias_io`` = 1 (without the feature TensorRT ignores ``getAliasedInput``).
    detailed_profile : bool
        ``ProfilingVerbosity.DETAILED`` so the engine inspector names the plugin layers.
    verbose : bool
        TensorRT verbose logging.
    targets : sequence of str or int, optional
        TensorRT-RTX only: the compute capabilities to build for (``"sm80"``, ``"8.9"``,
        ``120``...). Default: this machine's GPU, or, when there is none, every capability
        TensorRT-RTX knows on which the installed kernels run (:func:`default_rtx_targets`;
        a ValueError naming ``--target`` when that cannot be decided).
    flavour : {"tensorrt", "rtx"}, optional
        Which TensorRT builds (see :func:`pytrt_kv.trt.import_tensorrt`).
    progress : bool
        Print each build phase and its duration to stderr.
    serialize_plugins : bool
        Put the plugin library into the plan (``IBuilderConfig::setPluginsToSerialize``)
        where the TensorRT flavour supports it (:func:`can_serialize_plugins`: TensorRT-RTX),
        so the engine loads without the library installed (its runtime must allow host
        code: ``load_engine(..., host_code_allowed=True)``). Elsewhere the plan is built
        without it; :func:`plugin_loading_instructions` says how to load the library.

    Returns
    -------
    bytes
        The serialized engine.

    Raises
    ------
    ImportError
        TensorRT is not installed.
    RuntimeError
        The parser or the builder failed; the message carries the errors TensorRT and
        the plugins logged.
    ValueError, TypeError
        What :func:`pytrt_kv.graph.check_model` finds (the first problem, before
        TensorRT is imported; ``targets`` the installed kernels lack included), a cache
        dtype TensorRT cannot carry, a ``timing_cache`` TensorRT refused, a dynamic
        input without ``shapes``, or ``targets`` TensorRT-RTX does not know.

    Examples: ``build_plan("scatter.onnx", flavour="rtx", targets=["sm89"])``.
    """
    model, trt, shapes, targets = _checked_model(onnx_path, shapes, dims, targets, flavour)
    kwargs = dict(
        timing_cache=timing_cache,
        shapes=shapes,
        workspace=workspace,
        aliased_plugin_io=aliased_plugin_io,
        detailed_profile=detailed_profile,
        verbose=verbose,
        targets=targets,
        progress=progress,
        serialize_plugins=bool(serialize_plugins),
    )
    plan = _build_rtx_elsewhere(trt, onnx_path, kwargs) if flavour_of(trt) == "rtx" else None
    if plan is None:
        plan = _build_here(trt, onnx_path, model, **kwargs)
    if engine_path is not None:
        Path(engine_path).write_bytes(plan)
    return plan


def _checked_model(onnx_path, shapes, dims, targets, flavour):
    """Every model check first, before TensorRT is touched: the same one-line reason as
    runtime.run and pytrt-kv check (pytrt_kv.graph.lint), and nothing written. The
    TensorRT-RTX build child repeats the model checks but not the targets: its parent
    checked them against the kernels it loaded. Returns the model (loaded once: the
    checks, dims and the in-process build), TensorRT, the shapes and the targets."""
    in_child = bool(os.environ.get(_rtx.CHILD_ENV))
    model = _load_onnx(onnx_path)
    validate_model(model, targets=None if in_child else targets, tensorrt=True)
    trt = import_tensorrt(flavour)
    if dims:
        shapes = {**shapes_from_dims(model, dims), **(shapes or {})}
    if targets is None and not in_child:
        targets = _targets_without_a_gpu(trt)
    return model, trt, shapes, targets


def _build_rtx_elsewhere(trt, onnx_path, kwargs: dict[str, Any]) -> bytes | None:
    """TensorRT-RTX: refuse a timing cache; build in a worker process when the plugin
    parser cannot be resolved in this one (None: build here)."""
    if kwargs["timing_cache"] is not None:
        raise value_error(
            "timing_cache",
            "none with TensorRT-RTX (its timing caches need a GPU; it builds without one)",
            str(kwargs["timing_cache"]),
        )
    if _rtx.plugin_parsing_works_here():
        return None
    if os.environ.get(_rtx.CHILD_ENV):
        raise RuntimeError(
            f"{_rtx.UNVERSIONED} does not resolve even in the TensorRT-RTX "
            f"build process (LD_LIBRARY_PATH={os.environ.get('LD_LIBRARY_PATH')})"
        )
    return _rtx.build_in_worker(str(onnx_path), kwargs)


def shapes_from_dims(model, dims: Mapping[str, Any]) -> dict[str, tuple[Shape, Shape, Shape]]:
    """The (min, opt, max) shapes of every graph input whose dynamic dims are all named in
    ``dims`` (dim name -> ``(min, opt, max)``), for :func:`build_plan`'s ``shapes``: one
    range per symbolic dimension instead of one profile per input.

    Static dims keep their size. An input with a dynamic dim not in ``dims`` is left out
    (the build then asks for it by name); a name in ``dims`` that no input uses is a
    ValueError, as is a range that is not ``1 <= min <= opt <= max``.
    """
    import onnx  # noqa: PLC0415

    if not isinstance(model, onnx.ModelProto):
        model = _load_onnx(model)
    ranges: dict[str, tuple[int, int, int]] = {}
    for name, r in dims.items():
        try:
            lo, opt, hi = (int(v) for v in r)
        except (TypeError, ValueError):
            raise value_error("dims", f"(min, opt, max) integers for {name!r}", repr(r)) from None
        if not 1 <= lo <= opt <= hi:
            raise value_error(f"dims[{name!r}]", "1 <= min <= opt <= max", f"{lo}:{opt}:{hi}")
        ranges[name] = (lo, opt, hi)
    initializers = {i.name for i in model.graph.initializer}
    used: set[str] = set()
    out: dict[str, tuple[Shape, Shape, Shape]] = {}
    for inp in model.graph.input:
        if inp.name in initializers:
            continue
        shape = [(d.dim_param, d.dim_value) for d in inp.type.tensor_type.shape.dim]
        params = {p for p, v in shape if p or v <= 0}
        if not params or not params <= set(ranges):
            used |= params & set(ranges)
            continue
        used |= params
        out[inp.name] = tuple(  # type: ignore[assignment]
            tuple(ranges[p][k] if p else v for p, v in shape) for k in range(3)
        )
    unused = sorted(set(ranges) - used)
    if unused:
        names = sorted({p for i in model.graph.input for d in i.type.tensor_type.shape.dim
                        if (p := d.dim_param)})  # fmt: skip
        raise value_error("dims", f"names of dynamic dims of the model's inputs {names}",
                          f"{unused}")  # fmt: skip
    return out


def _load_onnx(onnx_path):
    import onnx  # noqa: PLC0415

    path = Path(onnx_path)
    if path.is_dir():
        raise value_error("onnx_path", "an ONNX file", f"the directory {path}")
    if not path.is_file():
        raise FileNotFoundError(f"onnx_path: no such file: {path}")
    try:
        return onnx.load(str(path))
    except Exception as exc:  # protobuf's DecodeError and friends
        raise value_error(
            "onnx_path", "an ONNX model file", f"{path} ({type(exc).__name__}: {exc})"
        ) from exc


def _build_here(
    trt,
    onnx_path,
    model,
    *,
    timing_cache,
    shapes,
    workspace,
    aliased_plugin_io,
    detailed_profile,
    verbose,
    targets,
    progress,
    serialize_plugins,
) -> bytes:
    model = prepare_for_tensorrt(model)
    plugin_lib = load_plugins(flavour=flavour_of(trt))
    logger = _logger(trt, verbose)
    mark = len(getattr(logger, "errors", []))
    want_alias = needs_aliased_io(model) if aliased_plugin_io is None else bool(aliased_plugin_io)

    builder = trt.Builder(logger)
    network = builder.create_network(_network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(model.SerializeToString(), str(Path(onnx_path).resolve())):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        errors += _errors_since(logger, mark)
        raise RuntimeError(f"TensorRT's ONNX parser rejected {onnx_path}: {'; '.join(errors)}")

    config = builder.create_builder_config()
    if want_alias:
        feature = getattr(trt.PreviewFeature, "ALIASED_PLUGIN_IO_10_03", None)
        if feature is None:
            raise RuntimeError(
                "this TensorRT has no PreviewFeature.ALIASED_PLUGIN_IO_10_03; "
                "export the model with alias_io=0"
            )
        config.set_preview_feature(feature, True)
    if workspace is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace))
    if detailed_profile:
        config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    _set_targets(trt, config, targets)
    if serialize_plugins and can_serialize_plugins(trt):
        config.plugins_to_serialize = [str(plugin_lib)]
    monitor = _progress_monitor(trt) if progress else None
    if monitor is not None:
        config.progress_monitor = monitor
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
            raise value_error(
                "timing_cache",
                "a timing cache TensorRT accepts for this GPU and "
                "version (delete the file to start a new one)",
                str(cache_file),
            )

    plan = builder.build_serialized_network(network, config)
    if plan is None:
        errors = _errors_since(logger, mark)
        detail = "; ".join(errors) if errors else "see the log above; run with verbose=True"
        raise RuntimeError(f"TensorRT could not build an engine from {onnx_path}: {detail}")
    plan_bytes = bytes(plan)
    if cache_file is not None:
        tmp = cache_file.with_suffix(cache_file.suffix + ".tmp")
        tmp.write_bytes(bytes(config.get_timing_cache().serialize()))
        os.replace(tmp, cache_file)  # never leave a half-written cache behind
    return plan_bytes


def build_engine(
    onnx_path,
    *,
    engine_path=None,
    timing_cache=None,
    shapes: Mapping[str, Any] | None = None,
    dims: Mapping[str, Any] | None = None,
    workspace: int | None = None,
    aliased_plugin_io: bool | None = None,
    detailed_profile: bool = True,
    verbose: bool = False,
    targets: Sequence[Any] | None = None,
    flavour: str | None = None,
    serialize_plugins: bool = False,
) -> Engine:
    """Build an engine with :func:`build_plan` and deserialize it (:func:`load_engine`)
    for this machine's GPU.

    The plugin library is loaded into the registry first (:func:`load_plugins`), the
    model is put in the plugins' positional form (:func:`prepare_for_tensorrt`), and the
    network is strongly typed (the ONNX dtypes are the plugin dtypes). The parameters are
    those of :func:`build_plan`; deserializing needs a GPU (and, with TensorRT-RTX,
    ``targets`` that include it).

    Returns
    -------
    Engine

    Raises
    ------
    ImportError
        TensorRT is not installed.
    RuntimeError
        The parser or the builder failed (the message carries the errors TensorRT and the
        plugins logged), or the engine does not deserialize here.
    ValueError
        See :func:`build_plan`.

    Examples
    --------
    >>> from pytrt_kv.trt import build_engine, EngineRunner    # doctest: +SKIP
    >>> eng = build_engine("scatter.onnx", timing_cache="cache.bin")  # doctest: +SKIP
    >>> runner = EngineRunner(eng)                                 # doctest: +SKIP
    """
    plan = build_plan(
        onnx_path,
        engine_path=engine_path,
        timing_cache=timing_cache,
        shapes=shapes,
        dims=dims,
        workspace=workspace,
        aliased_plugin_io=aliased_plugin_io,
        detailed_profile=detailed_profile,
        verbose=verbose,
        targets=targets,
        flavour=flavour,
        serialize_plugins=serialize_plugins,
    )
    model = prepare_for_tensorrt(_load_onnx(onnx_path))
    return load_engine(
        plan,
        aliases=alias_pairs(model),
        verbose=verbose,
        flavour=flavour,
        host_code_allowed=serialize_plugins,
    )


def load_engine(
    plan,
    *,
    aliases: Mapping[str, str] | None = None,
    verbose: bool = False,
    flavour: str | None = None,
    host_code_allowed: bool = False,
) -> Engine:
    """Deserialize ``plan`` (bytes or an engine file path) after loading the plugins.

    ``host_code_allowed`` (TensorRT-RTX) lets the runtime run host code that the plan
    carries: needed for a plan built with ``serialize_plugins=True``; only for plans you
    trust.

    ``aliases`` (graph output -> graph input) should come from the model
    (:func:`pytrt_kv.graph.tensorrt.alias_pairs`); without it, only the pairs TensorRT reports
    (``get_aliased_input_tensor``, TensorRT 10.14+) and the ``*_out`` naming of
    specs.py are used.
    """
    trt = import_tensorrt(flavour)
    load_plugins(flavour=flavour_of(trt))
    if isinstance(plan, (str, Path)):
        plan = Path(plan).read_bytes()
    from .._driver import cuda_devices  # noqa: PLC0415

    names, detail = cuda_devices()
    if not names:
        # Deserializing needs a GPU; say so instead of blaming the plan (issue 17).
        raise RuntimeError(
            f"cannot deserialize a TensorRT engine on this machine: {detail}. The plan "
            f"({len(plan)} bytes) is not the problem: copy it to a machine with an NVIDIA "
            "GPU and driver and load it there (pytrt_kv.trt.load_engine, or trtexec "
            "--loadEngine with the plugin library)"
        )
    runtime = trt.Runtime(_logger(trt, verbose))
    if host_code_allowed and hasattr(runtime, "engine_host_code_allowed"):
        runtime.engine_host_code_allowed = True
    engine = runtime.deserialize_cuda_engine(plan)
    if engine is None:
        raise RuntimeError(
            "TensorRT could not deserialize the engine (built by another TensorRT "
            "version or GPU, or the plugins are missing)"
        )
    return Engine(engine, runtime, bytes(plan), dict(aliases or {}))


def engine_layers(engine) -> Sequence[dict[str, Any]]:
    """The engine inspector's per-layer JSON (needs ``detailed_profile`` at build time)."""
    import json  # noqa: PLC0415

    trt = import_tensorrt()
    eng = getattr(engine, "engine", engine)
    inspector = eng.create_engine_inspector()
    info = json.loads(inspector.get_engine_information(trt.LayerInformationFormat.JSON))
    layers = info.get("Layers", [])
    return [layer if isinstance(layer, dict) else {"Name": layer} for layer in layers]


def plugin_layers(engine) -> Sequence[dict[str, Any]]:
    """Layers that run a pytrt_kv plugin (so no fallback replaced it)."""
    out = []
    for layer in engine_layers(engine):
        text = str(layer)
        if any(name in text for name in specs.OPS) and "Plugin" in text:
            out.append(layer)
    return out


def copy_layers(engine) -> Sequence[dict[str, Any]]:
    """Layers TensorRT added that only move data (reformat/copy): the cost aliasing
    is meant to avoid. Their presence is what the ``trt`` tests measure."""
    out = []
    for layer in engine_layers(engine):
        kind = str(layer.get("LayerType", "")) + " " + str(layer.get("Name", ""))
        if any(k in kind for k in ("Reformat", "Copy", "copy", "reformat")):
            out.append(layer)
    return out
