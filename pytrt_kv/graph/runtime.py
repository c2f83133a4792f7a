"""CPU runtime of the graph layer: onnx.reference OpRun classes for the pytrt_kv ops, node
and feed validation, and the :func:`run` entry point (public path: :mod:`pytrt_kv.runtime`)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from ..contract import dtypes, specs
from ..reference import gather_selection_kv_cache, scatter_pa_kv_cache
from . import schemas
from .lint import validate_model
from .nodes import node_where as _node_where

schemas.register()


def _attrs(op: specs.OpSpec, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for a in op.attributes:
        v = kwargs.get(a.name, None)
        if isinstance(v, bytes):
            v = v.decode()
        out[a.name] = a.default if v is None else v
    return out


def _named(op: specs.OpSpec, args) -> dict[str, np.ndarray | None]:
    vals = list(args) + [None] * (len(op.inputs) - len(args))
    return {t.name: (None if v is None else np.asarray(v)) for t, v in zip(op.inputs, vals)}


def _absent_placeholders(x: dict[str, np.ndarray | None]) -> dict[str, np.ndarray]:
    """Move the placeholders of absent optional inputs (``specs.absent_placeholders``, the
    positional form of ``pytrt_kv.trt.prepare_for_tensorrt``) out of ``x``, so the CPU
    reference runs prepared models too; returns what was moved."""
    names = specs.absent_placeholders({k: None if v is None else v.shape for k, v in x.items()})
    moved: dict[str, np.ndarray] = {}
    for name in names:
        v = x[name]
        assert v is not None  # absent_placeholders names only present tensors
        moved[name], x[name] = v, None
    return moved


def _named_error(node: onnx.NodeProto, op: specs.OpSpec, exc: Exception) -> Exception:
    """``exc`` of the reference, prefixed with the node and the graph tensor of the
    argument it names (``key_cache: ...`` -> ``node 'n' (ScatterPaKvCache): key_cache
    (graph tensor 'cache_in'): ...``)."""
    msg = str(exc)
    head, sep, rest = msg.partition(":")
    arg = head.split("[", 1)[0].split(" ", 1)[0]
    if sep and arg in op.input_names:
        i = op.input_index(arg)
        tensor = node.input[i] if i < len(node.input) else ""
        msg = f"{head} (graph tensor {tensor!r}):{rest}"
    return type(exc)(_node_where(node) + msg)


def scatter_node(
    node: onnx.NodeProto, x: Mapping[str, Any], attrs: Mapping[str, Any], key_cache, value_cache
) -> None:
    """The reference's scatter for one node: ``x`` its named inputs (:func:`_named`),
    ``attrs`` its attributes (:func:`_attrs`), writing ``key_cache``/``value_cache`` (the
    buffers its outputs become); a refusal carries the node's prefix (:func:`_named_error`).
    The CPU runtime and the ONNX Runtime kernels (pytrt_kv.ort) both compute through it."""
    try:
        scatter_pa_kv_cache(
            x["key"],
            x["value"],
            key_cache,
            value_cache,
            x["slot_mapping"],
            compress_lens=x["compress_lens"],
            compress_seq_offsets=x["compress_seq_offsets"],
            seq_lens=x["seq_lens"],
            cache_layout=attrs["cache_layout"] or None,
            compress_mode=attrs["compress_mode"] or None,
            k_scale=x["k_scale"],
            v_scale=x["v_scale"],
        )
    except (ValueError, TypeError) as exc:
        raise _named_error(node, specs.SCATTER_PA_KV_CACHE, exc) from None


def gather_node(
    node: onnx.NodeProto, x: Mapping[str, Any], attrs: Mapping[str, Any], k_rope, kv, status
) -> np.ndarray:
    """The reference's gather for one node, as :func:`scatter_node`, writing the selection
    caches and status given; returns actual_seq as int32."""
    try:
        actual = gather_selection_kv_cache(
            k_rope,
            kv,
            x["selection_kv_block_table"],
            status,
            x["selection_topk_indices"],
            x["full_k_rope"],
            x["full_kv_cache"],
            x["full_kv_block_table"],
            x["full_kv_actual_seq"],
            x["full_q_actual_seq"],
            selection_topk_block_size=attrs["selection_topk_block_size"],
        )
    except (ValueError, TypeError) as exc:
        raise _named_error(node, specs.GATHER_SELECTION_KV_CACHE, exc) from None
    return np.asarray(actual, dtype=np.int32)


class ScatterPaKvCache(OpRun):
    """ScatterPaKvCache on the NumPy reference; outputs are updated copies of the caches."""

    op_domain = specs.DOMAIN

    def _run(self, *args, **kwargs):
        op = specs.SCATTER_PA_KV_CACHE
        x = _named(op, args)
        a = _attrs(op, kwargs)
        placeholders = _absent_placeholders(x)
        key_cache = x["key_cache"].copy()
        value_cache = None if x["value_cache"] is None else x["value_cache"].copy()
        scatter_node(self.onnx_node, x, a, key_cache, value_cache)
        if value_cache is not None:
            return key_cache, value_cache
        if len(self.onnx_node.output) > 1 and "value_cache" in placeholders:
            return key_cache, placeholders["value_cache"].copy()
        return (key_cache,)


class GatherSelectionKvCache(OpRun):
    """GatherSelectionKvCache on the NumPy reference; the three updated inputs are copies."""

    op_domain = specs.DOMAIN

    def _run(self, *args, **kwargs):
        op = specs.GATHER_SELECTION_KV_CACHE
        x = _named(op, args)
        a = _attrs(op, kwargs)
        sel_k_rope = x["selection_k_rope"].copy()
        sel_kv = x["selection_kv_cache"].copy()
        status = x["selection_kv_block_status"].copy()
        actual = gather_node(self.onnx_node, x, a, sel_k_rope, sel_kv, status)
        return sel_k_rope, sel_kv, status, actual


#: Alias names that say what the classes are (the evaluator needs the op_type as the name).
ScatterPaKvCacheOp = ScatterPaKvCache
GatherSelectionKvCacheOp = GatherSelectionKvCache


def _load(model_or_path: onnx.ModelProto | str | os.PathLike) -> onnx.ModelProto:
    if isinstance(model_or_path, onnx.ModelProto):
        return model_or_path
    if isinstance(model_or_path, (str, os.PathLike)):
        return onnx.load(os.fspath(model_or_path))
    raise TypeError(
        f"model_or_path: expected an onnx.ModelProto or a path, got {type(model_or_path).__name__}"
    )


def release_plan(nodes: Sequence[Any], keep: Iterable[str]) -> list[tuple[str, ...]]:
    """Per node of ``nodes`` (in run order; anything with ``input`` and ``output`` name
    lists), the results to drop once it has run: those a node produced that no later node
    reads and that are not in ``keep`` (the requested outputs). A result nobody reads goes
    right after the node that made it. Graph inputs and initializers are never listed (the
    caller and the evaluator hold them anyway)."""
    produced = {o for n in nodes for o in n.output if o}
    last: dict[str, int] = {}
    for i, n in enumerate(nodes):
        for name in n.input:
            last[name] = i
        for name in n.output:
            last.setdefault(name, i)
    kept = set(keep)
    plan: list[list[str]] = [[] for _ in nodes]
    for name, i in last.items():
        if name in produced and name not in kept:
            plan[i].append(name)
    return [tuple(p) for p in plan]


class _Evaluator(ReferenceEvaluator):
    """ReferenceEvaluator that remembers the declared types of the graph inputs and drops
    each intermediate result after its last reader (:meth:`run`)."""

    def __init__(self, model: onnx.ModelProto):
        validate_model(model)
        super().__init__(model, new_ops=[ScatterPaKvCache, GatherSelectionKvCache])
        inits = {i.name for i in model.graph.initializer}
        self.declared_inputs = {
            vi.name: vi.type for vi in model.graph.input if vi.name not in inits
        }
        self.release_plan = release_plan(self.rt_nodes_, self.output_names)
        # A node with a subgraph (If, Loop, Scan) reads the enclosing results by name.
        self._releasing = not any(n.need_context() for n in self.rt_nodes_)

    # Untyped: the base class's signature changes across the onnx versions we support.
    def run(self, output_names, feed_inputs, attributes=None, intermediate=False, **kwargs):
        """``ReferenceEvaluator.run`` with the same node calls in the same order, but each
        intermediate result dropped once no later node reads it (the base class keeps every
        one until the run ends: every layer's ``[H, T, T]`` attention scores at once). The
        results are the values the base class would return. Runs the base class's
        loop instead when asked for intermediates, named outputs that are not graph
        outputs, function attributes, verbose logs, shape checks, or when a node has a
        subgraph."""
        wanted = self.output_names if output_names is None else list(output_names)
        if (
            not self._releasing
            or intermediate
            or attributes
            or kwargs
            or self.verbose
            or getattr(self, "check_shape_annotations_", False)
            or not set(wanted) <= set(self.output_names)
        ):
            return super().run(
                output_names, feed_inputs, attributes=attributes, intermediate=intermediate,
                **kwargs,
            )  # fmt: skip
        results = {"": None}
        results.update(self.rt_inits_)
        results.update(feed_inputs)
        for node, release in zip(self.rt_nodes_, self.release_plan):
            missing = [i for i in node.input if i not in results]
            if missing:
                raise RuntimeError(
                    _node_where(node.onnx_node) + f"inputs {missing} are neither graph "
                    "inputs, initializers nor outputs of an earlier node"
                )
            outputs = node.run(*[results[i] for i in node.input])
            results.update(zip(node.output, outputs))
            del outputs
            for name in release:
                results.pop(name, None)
        return [results[name] for name in wanted]


def make_evaluator(model_or_path: onnx.ModelProto | str | os.PathLike) -> ReferenceEvaluator:
    """A ``ReferenceEvaluator`` that knows our ops (reuse it to run a model many times).

    The model is validated first (:func:`validate_model`: domains, every ``pytrt_kv``
    node, the declarations of the outputs they produce).

    Raises
    ------
    ValueError, TypeError
        A node breaks its schema, or a graph output is declared with another dtype or
        shape than the op gives it; the message names the node.
    FileNotFoundError
        ``model_or_path`` names no file.
    """
    return _Evaluator(_load(model_or_path))


def _describe_type(tp: onnx.TypeProto) -> str:
    tt = tp.tensor_type
    try:
        name = str(dtypes.numpy_of_onnx(tt.elem_type)) if tt.elem_type else "?"
    except TypeError:
        name = onnx.TensorProto.DataType.Name(tt.elem_type).lower()
    if not tt.HasField("shape"):
        return f"{name}[...]"
    dims = [
        str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim
    ]
    return f"{name}[{', '.join(dims)}]"


def exact_feeds(expected: list[str], feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """``feeds`` as arrays in ``expected`` order, refused (ValueError naming what is
    missing and what is unknown) unless they are exactly the graph inputs ``expected``."""
    missing = [n for n in expected if n not in feeds]
    extra = [n for n in feeds if n not in expected]
    if missing or extra:
        raise ValueError(
            f"feeds: expected exactly the graph inputs {expected}, got "
            f"{sorted(feeds)} (missing {missing}, unknown {extra})"
        )
    return {n: np.asarray(feeds[n]) for n in expected}


def check_feeds(declared: Mapping[str, onnx.TypeProto], feeds: Mapping[str, np.ndarray]) -> None:
    """Check each feed against the dtype and shape its graph input declares.

    Static dims must match; a symbolic dim (``"T"``) must take one value across all the
    inputs that use it.

    Raises
    ------
    TypeError
        A feed's dtype differs from the declared element type.
    ValueError
        A feed's rank or a dim differs from the declaration.
    """
    bound: dict[str, Any] = {}
    for name, tp in declared.items():
        if name not in feeds or not tp.HasField("tensor_type"):
            continue
        x = np.asarray(feeds[name])
        tt = tp.tensor_type
        want = f"{_describe_type(tp)} (declared by graph input {name!r})"
        got = f"{x.dtype}{list(x.shape)}"
        if tt.elem_type:
            try:
                expected = dtypes.numpy_of_onnx(tt.elem_type, f"feeds[{name!r}]")
            except TypeError:
                expected = None
            if expected is not None and x.dtype != expected:
                raise TypeError(f"feeds[{name!r}]: expected {want}, got {got}")
        if not tt.HasField("shape"):
            continue
        dims = tt.shape.dim
        if x.ndim != len(dims):
            raise ValueError(f"feeds[{name!r}]: expected rank {len(dims)}: {want}, got {got}")
        for axis, (d, n) in enumerate(zip(dims, x.shape)):
            if d.HasField("dim_value") and d.dim_value != n:
                raise ValueError(
                    f"feeds[{name!r}]: expected dim {axis} = {d.dim_value}: {want}, got {got}"
                )
            if d.HasField("dim_param") and d.dim_param:
                prev = bound.setdefault(d.dim_param, (n, name))
                if prev[0] != n:
                    raise ValueError(
                        f"feeds[{name!r}]: expected dim {axis} = {d.dim_param} = {prev[0]} "
                        f"(as in feeds[{prev[1]!r}]): {want}, got {got}"
                    )


def run(
    model_or_path: onnx.ModelProto | str | os.PathLike | ReferenceEvaluator,
    feeds: Mapping[str, np.ndarray],
) -> dict[str, np.ndarray]:
    """Run a model on the CPU and return every graph output by name.

    Parameters
    ----------
    model_or_path : onnx.ModelProto, path, or an evaluator from :func:`make_evaluator`
    feeds : mapping graph input name -> array
        Never modified: each ``*_out`` is an updated copy of its cache input.

    Returns
    -------
    dict name -> numpy.ndarray

    Raises
    ------
    ValueError
        A graph input is missing from ``feeds`` or an unknown name is fed; a feed's
        shape differs from its declaration; a ``pytrt_kv`` node breaks its schema (see
        :func:`validate_node`); or the reference refuses an input: the message names
        the node, the op argument and its graph tensor.
    TypeError
        A feed's dtype differs from its declaration, a node attribute has the wrong
        type, or the reference refuses an argument's type (named the same way).

    Notes
    -----
    The feeds are never modified, so concurrent runs are safe; a caller that feeds
    each ``*_out`` back as the next step's input must order those steps itself.
    """
    ev = (
        model_or_path
        if isinstance(model_or_path, ReferenceEvaluator)
        else make_evaluator(model_or_path)
    )
    arrays = exact_feeds(list(ev.input_names), feeds)
    declared = getattr(ev, "declared_inputs", None)
    if declared is None:  # an evaluator made elsewhere: validate its model now
        model = getattr(ev, "proto_", None)
        if isinstance(model, onnx.ModelProto):
            validate_model(model)
            declared = {vi.name: vi.type for vi in model.graph.input if vi.name in arrays}
    check_feeds(declared or {}, arrays)
    try:
        results = ev.run(None, arrays)
    except TypeError as exc:
        # onnx.reference wraps every TypeError of an op into a generic message; surface
        # the reference's own (it names the argument).
        if isinstance(exc.__cause__, TypeError):
            raise exc.__cause__ from None
        raise
    return dict(zip(ev.output_names, results))
