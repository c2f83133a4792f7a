"""ONNX Runtime sessions for models with ``pytrt_kv`` ops (docs/GRAPH_MODE.md, "ONNX Runtime").

:func:`make_session` returns an ``onnxruntime.InferenceSession`` whose ``ScatterPaKvCache``
and ``GatherSelectionKvCache`` nodes run the NumPy reference on ONNX Runtime's CPU
execution provider, with the CPU runtime's semantics (docs/SPEC.md O): every ``*_out`` is
an updated copy of its cache input, the feeds are never modified, and every refusal is
the runtime's (:mod:`pytrt_kv.runtime`) ValueError or TypeError, same text.

Needs ``onnxruntime`` and ``onnxruntime-extensions`` (the ``[polygraphy]`` extra).

Example
-------
>>> import numpy as np
>>> from onnx_export import single_op_model
>>> from pytrt_kv import ort
>>> feeds = {"key": np.full((2, 1, 8), 3, np.float16),
...          "key_cache": np.zeros((2, 4, 1, 8), np.float16),
...          "slot_mapping": np.array([5, 0], np.int32)}
>>> session = ort.make_session(single_op_model("ScatterPaKvCache", feeds))
>>> (out,) = session.run(None, feeds)
>>> float(out[1, 1, 0, 0]), float(feeds["key_cache"][1, 1, 0, 0])
(3.0, 0.0)
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnx.inliner

from ..contract import dtypes, specs
from ..graph import schemas
from ..graph.lint import validate_model
from ..graph.runtime import check_feeds, exact_feeds
from . import _capi, _float_math, _kernels

__all__ = [
    "make_session",
    "availability",
    "rewrite_for_onnxruntime",
    "PytrtKvSession",
    "FLOAT_MATH",
]


def availability() -> str:
    """'' when :func:`make_session` works here, else why not (one line)."""
    try:
        import onnxruntime  # noqa: F401

        _capi.extensions_library()
    except ImportError as exc:
        return str(exc) if "onnxruntime-extensions" in str(exc) else f"onnxruntime: {exc}"
    return ""


def _load(model_or_path: Any) -> onnx.ModelProto:
    if isinstance(model_or_path, onnx.ModelProto):
        return model_or_path
    if isinstance(model_or_path, (bytes, bytearray)):
        return onnx.load_model_from_string(bytes(model_or_path))
    if isinstance(model_or_path, (str, os.PathLike)):
        path = os.fspath(model_or_path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"model_or_path: expected an ONNX file, got {path!r}")
        return onnx.load(path)
    raise TypeError(
        f"model_or_path: expected an onnx.ModelProto, a path or serialized bytes, got "
        f"{type(model_or_path).__name__}"
    )


def _element_types(model: onnx.ModelProto) -> dict[str, int]:
    """Tensor name -> ONNX element type, from the declarations and shape inference."""
    schemas.register()
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - fall back to what the model declares
        inferred = model
    graph = inferred.graph
    out = {i.name: i.data_type for i in graph.initializer}
    for vi in [*graph.input, *graph.value_info, *graph.output]:
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            out.setdefault(vi.name, vi.type.tensor_type.elem_type)
    for node in graph.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    out.setdefault(node.output[0], a.t.data_type)
    return out


#: ``float_math`` values of :func:`make_session`.
FLOAT_MATH = ("reference", "onnxruntime")


def _check_float_math(float_math: Any) -> str:
    if not isinstance(float_math, str) or float_math not in FLOAT_MATH:
        raise ValueError(f"float_math: expected one of {list(FLOAT_MATH)}, got {float_math!r}")
    return float_math


def rewrite_for_onnxruntime(
    model: onnx.ModelProto, float_math: str = "reference"
) -> tuple[onnx.ModelProto, list]:
    """A copy of ``model`` whose ``pytrt_kv`` nodes (and, with ``float_math="reference"``,
    the standard nodes whose float results ONNX Runtime rounds differently from the CPU
    runtime) are ONNX Runtime custom ops of onnxruntime-extensions' domain
    (``ai.onnx.contrib``), with the ops that run them.

    Each node becomes its own op (name from the node and its input dtypes): ONNX
    Runtime types a custom op's outputs from fixed input types, and our ops take many
    dtypes. The model is validated first (:func:`pytrt_kv.graph.validate_model`)."""
    _check_float_math(float_math)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    if float_math == "reference" and out.functions:
        out = onnx.inliner.inline_local_functions(out)
    return out, _rewrite_in_place(out, float_math)


def _rewrite_in_place(model: onnx.ModelProto, float_math: str) -> list:
    """What :func:`rewrite_for_onnxruntime` does, on ``model`` itself; returns the ops."""
    validate_model(model)
    reference = float_math == "reference"
    if reference:
        _float_math.refuse_subgraphs(model)
    types = _element_types(model)
    graph = model.graph
    if reference:  # the nodes as they were (rewriting changes them in place)
        originals = [onnx.NodeProto() for _ in graph.node]
        for copy, node in zip(originals, graph.node):
            copy.CopyFrom(node)
        producers = {o: (i, n) for i, n in enumerate(originals) for o in n.output if o}
        plain = _float_math.plain_tensors(graph)
    ops = []
    for index, node in enumerate(graph.node):
        if node.domain == specs.DOMAIN:
            original = onnx.NodeProto()
            original.CopyFrom(node)
            op = _kernels.custom_op(original, types)
        elif (
            reference
            and node.domain in _float_math.STANDARD
            and _float_math.needs_reference(node, types)
        ):
            op, leaves = _float_math.custom_op(
                originals[index], types, list(model.opset_import), producers, plain
            )
            del node.input[:]
            node.input.extend(leaves)
        else:
            continue
        ops.append(op)
        node.domain = _capi.EXTENSIONS_DOMAIN
        node.op_type = op.name
    imports = [o for o in model.opset_import if o.domain != specs.DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(imports)
    if ops and not any(o.domain == _capi.EXTENSIONS_DOMAIN for o in imports):
        model.opset_import.append(onnx.helper.make_opsetid(_capi.EXTENSIONS_DOMAIN, 1))
    return ops


def _serialized_for_onnxruntime(model: onnx.ModelProto, float_math: str) -> tuple[bytes, list]:
    """The rewritten model serialized, and its ops, without a second copy of the
    weights: ``model`` is rewritten, serialized and restored (node domains and types,
    opset imports; nothing else changes). A model with local functions is inlined into
    a copy first (``float_math="reference"`` rewrites the nodes of their bodies)."""
    if float_math == "reference" and model.functions:
        model = onnx.inliner.inline_local_functions(model)
    # (node, domain or None when unset, op_type, inputs): field presence is restored.
    nodes = [
        (n, n.domain if n.HasField("domain") else None, n.op_type, list(n.input))
        for n in model.graph.node
    ]
    imports = []
    for o in model.opset_import:  # copies: field presence is kept as it was
        imports.append(onnx.OperatorSetIdProto())
        imports[-1].CopyFrom(o)
    try:
        ops = _rewrite_in_place(model, float_math)
        return model.SerializeToString(), ops
    finally:
        for node, domain, op_type, inputs in nodes:
            node.op_type = op_type
            if list(node.input) != inputs:
                del node.input[:]
                node.input.extend(inputs)
            if domain is None:
                node.ClearField("domain")
            else:
                node.domain = domain
        del model.opset_import[:]
        model.opset_import.extend(imports)


def _onnx_type(x: np.ndarray) -> int | None:
    """ONNX type of an ml_dtypes array (bfloat16, float8) ONNX Runtime's NumPy bridge
    does not know; None for plain NumPy dtypes."""
    if x.dtype.kind == "V" or x.dtype.type.__module__.startswith("ml_dtypes"):
        return dtypes.ONNX[dtypes.name_of(x.dtype)]
    return None


@functools.cache
def _session_class():
    import onnxruntime

    class PytrtKvSession(onnxruntime.InferenceSession):
        """``onnxruntime.InferenceSession`` of a model with ``pytrt_kv`` ops: ``run``
        checks the feeds like :func:`pytrt_kv.runtime.run` and raises the runtime's
        ValueError/TypeError where an op refuses its inputs."""

        def _pytrt_kv_init(self, declared: Mapping[str, onnx.TypeProto], outputs: list[str]):
            self._pytrt_kv_declared = dict(declared)
            self._pytrt_kv_outputs = list(outputs)

        def run(self, output_names, input_feed, run_options=None):
            if isinstance(input_feed, Mapping):
                arrays = exact_feeds(list(self._pytrt_kv_declared), input_feed)
                check_feeds(self._pytrt_kv_declared, arrays)
                special = {n: t for n, a in arrays.items() if (t := _onnx_type(a)) is not None}
                if special:
                    return self._run_ort_values(output_names, arrays, special, run_options)
                input_feed = arrays
            try:
                return super().run(output_names, input_feed, run_options)
            except Exception as exc:
                raise _own_error(exc) from None

        def _run_ort_values(self, output_names, arrays, special, run_options):
            values = {
                n: (
                    onnxruntime.OrtValue.ortvalue_from_numpy_with_onnx_type(
                        a.view(f"u{a.dtype.itemsize}"), special[n]
                    )
                    if n in special
                    else onnxruntime.OrtValue.ortvalue_from_numpy(a)
                )
                for n, a in arrays.items()
            }
            names = list(output_names or self._pytrt_kv_outputs)
            try:
                results = self.run_with_ort_values(names, values, run_options)
            except Exception as exc:
                raise _own_error(exc) from None
            return [_to_numpy(v) for v in results]

    return PytrtKvSession


def _to_numpy(value) -> np.ndarray:
    """An OrtValue as NumPy: bfloat16 and float8 (which ONNX Runtime's NumPy bridge
    does not convert) as their ml_dtypes dtype, copied byte for byte."""
    name = dtypes.ONNX_TO_NAME.get(value.element_type())
    if name not in (specs.BFLOAT16, specs.FLOAT8_E4M3, specs.FLOAT8_E5M2):
        return value.numpy()
    dtype = dtypes.NUMPY[name]
    shape = tuple(value.shape())
    count = int(np.prod(shape, dtype=np.int64))
    if count == 0:
        return np.empty(shape, dtype)
    raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(value.data_ptr())
    return np.frombuffer(memoryview(raw).cast("B"), dtype=dtype).reshape(shape).copy()


def _own_error(exc: Exception) -> Exception:
    """The reference's exception behind ONNX Runtime's error text, else ``exc``."""
    own = _capi.take_error(str(exc))
    return own if isinstance(own, Exception) else exc


def make_session(
    model_or_path: onnx.ModelProto | str | os.PathLike | bytes,
    providers: Sequence[Any] | None = None,
    *,
    float_math: str = "reference",
    **session_options: Any,
):
    """An ``onnxruntime.InferenceSession`` running ``model_or_path`` with our ops.

    Parameters
    ----------
    model_or_path : onnx.ModelProto, path or serialized bytes
        Validated like the CPU runtime does (same refusals); the file is not changed.
    providers : list, optional
        ONNX Runtime execution providers; default ``["CPUExecutionProvider"]``. Our
        ops always run on the CPU provider.
    float_math : {"reference", "onnxruntime"}
        ``"reference"`` (default): outputs byte-equal to :func:`pytrt_kv.runtime.run`.
        The standard nodes whose float results ONNX Runtime's kernels round otherwise
        (dot products, reductions, transcendentals; half-type arithmetic) run the CPU
        runtime's own NumPy implementation as custom ops; copies, comparisons and
        float32/float64 ``+ - * /``, sqrt stay ONNX Runtime's. ``"onnxruntime"``: every
        standard node on ONNX Runtime's kernels (faster on large models; float results
        differ from the CPU runtime's by a few ulps, docs/GRAPH_MODE.md).
    **session_options
        ``sess_options=`` an ``onnxruntime.SessionOptions`` to start from, and any
        attribute of it (``intra_op_num_threads=2``, ``graph_optimization_level=...``).

    Returns
    -------
    onnxruntime.InferenceSession
        Its ``run(None, feeds)`` returns the graph outputs in order; feeds are checked
        against the declared inputs like :func:`pytrt_kv.runtime.run` does.

    Raises
    ------
    ImportError
        onnxruntime or onnxruntime-extensions is not installed.
    ValueError, TypeError
        The model breaks a rule (:func:`pytrt_kv.graph.check_model`), a session
        option is unknown, or ``float_math`` is none of :data:`FLOAT_MATH` (or
        ``"reference"`` meets a subgraph: If, Loop, Scan).
    """
    import onnxruntime

    _check_float_math(float_math)
    model = _load(model_or_path)
    library = _capi.extensions_library()
    model_bytes, ops = _serialized_for_onnxruntime(model, float_math)
    for op in ops:
        _capi.add_op(op)
    options = session_options.pop("sess_options", None) or onnxruntime.SessionOptions()
    for key, value in session_options.items():
        if key.startswith("_") or not hasattr(options, key):
            raise ValueError(
                f"session_options: expected attributes of onnxruntime.SessionOptions, got {key!r}"
            )
        setattr(options, key, value)
    if "log_severity_level" not in session_options:
        # A refusal is raised as the reference's exception; ONNX Runtime would also log
        # it as an error line on stderr.
        options.log_severity_level = 4
    options.register_custom_ops_library(library)
    inits = {i.name for i in model.graph.initializer}
    declared = {vi.name: vi.type for vi in model.graph.input if vi.name not in inits}
    session = _session_class()(
        model_bytes,
        sess_options=options,
        providers=list(providers) if providers else ["CPUExecutionProvider"],
    )
    session._pytrt_kv_init(declared, [o.name for o in model.graph.output])
    del model_bytes
    return session


def __getattr__(name: str):
    if name == "PytrtKvSession":
        return _session_class()
    raise AttributeError(name)
