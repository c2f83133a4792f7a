"""``polygraphy run m.onnx --onnxrt``: Polygraphy's own ONNX-Runtime runner on models with
``pytrt_kv`` ops (docs/GRAPH_MODE.md, "ONNX Runtime").

Polygraphy's ``--onnxrt`` runner builds its session with ``SessionFromOnnx``. When the
extension module is loaded (``polygraphy run`` loads it through the entry point),
:func:`install` wraps that loader: a model with ``pytrt_kv`` nodes gets its session from
:func:`pytrt_kv.ort.make_session` (same providers, thread counts and optimization level
as Polygraphy would give it; ``float_math="reference"``, so its outputs are the CPU
runtime's bytes); every other model goes through Polygraphy's own code, unchanged.
"""

from __future__ import annotations

import os
from typing import Any

from ..contract import specs

_MARK = "_pytrt_kv_wrapped"


def has_our_ops(model: Any) -> bool:
    """Whether ``model`` (serialized bytes, a path or an ``onnx.ModelProto``) has a node
    of the ``pytrt_kv`` domain (top-level graph)."""
    import onnx

    if isinstance(model, (bytes, bytearray)):
        proto = onnx.load_model_from_string(bytes(model))
    elif isinstance(model, (str, os.PathLike)):
        if not os.path.isfile(os.fspath(model)):
            return False
        proto = onnx.load(os.fspath(model), load_external_data=False)
    elif isinstance(model, onnx.ModelProto):
        proto = model
    else:
        return False
    return any(n.domain == specs.DOMAIN for n in proto.graph.node)


def _session(loader, model) -> Any:
    """What ``SessionFromOnnx`` returns, built by :func:`pytrt_kv.ort.make_session`."""
    import onnxruntime
    from polygraphy import util
    from polygraphy.logger import G_LOGGER

    from ..ort import make_session

    available = onnxruntime.get_available_providers()
    providers = []
    for prov in loader.providers:
        name = util.find_str_in_iterable(prov[0] if isinstance(prov, tuple) else prov, available)
        if name is None:
            G_LOGGER.critical(
                f"Could not find specified ONNX-Runtime execution provider.\nNote: Requested "
                f"provider was: {prov}, but available providers are: {available}"
            )
        providers.append((name, prov[1]) if isinstance(prov, tuple) else name)
    try:
        threads = len(os.sched_getaffinity(0))
    except AttributeError:
        threads = 1
    options: dict[str, Any] = {"intra_op_num_threads": threads, "inter_op_num_threads": threads}
    if loader.graph_optimization_level is not None:
        options["graph_optimization_level"] = loader.graph_optimization_level
    G_LOGGER.start(
        f"Creating ONNX-Runtime Inference Session with providers: {providers} "
        f"(pytrt_kv ops and float math on the CPU runtime's NumPy: "
        f"pytrt_kv.ort.make_session(float_math='reference'))"
    )
    return make_session(model, providers=providers, float_math="reference", **options)


def install() -> None:
    """Route ``SessionFromOnnx`` of models with our ops through ``make_session`` (once)."""
    from polygraphy import util
    from polygraphy.backend.onnxrt import loader as ort_loader

    cls = ort_loader.SessionFromOnnx
    if getattr(cls.call_impl, _MARK, False):
        return
    original = cls.call_impl

    def call_impl(self):
        model, _ = util.invoke_if_callable(self._model_bytes_or_path)
        if not has_our_ops(model):
            # Polygraphy's own code, with the model already loaded (a loader runs once).
            saved = self._model_bytes_or_path
            self._model_bytes_or_path = model
            try:
                return getattr(original, "__wrapped__", original)(self)
            finally:
                self._model_bytes_or_path = saved
        return _session(self, model)

    call_impl.__doc__ = original.__doc__
    setattr(call_impl, _MARK, True)
    cls.call_impl = call_impl
