"""onnx.reference OpRun classes for the pytrt_kv ops and the :func:`run` entry point."""

from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Optional, Union

import numpy as np
import onnx
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from .. import specs
from ..reference import gather_selection_kv_cache, scatter_pa_kv_cache


def _register_schemas() -> None:
    # onnx_export owns the schemas; it ships in the same wheel.
    from onnx_export import schemas

    schemas.register()


_register_schemas()


def _attrs(op: specs.OpSpec, kwargs: Mapping[str, Any]) -> Dict[str, Any]:
    out = {}
    for a in op.attributes:
        v = kwargs.get(a.name, None)
        if isinstance(v, bytes):
            v = v.decode()
        out[a.name] = a.default if v is None else v
    return out


def _named(op: specs.OpSpec, args) -> Dict[str, Optional[np.ndarray]]:
    vals = list(args) + [None] * (len(op.inputs) - len(args))
    return {t.name: (None if v is None else np.asarray(v)) for t, v in zip(op.inputs, vals)}


def _absent_placeholders(x: Dict[str, Optional[np.ndarray]]) -> Dict[str, np.ndarray]:
    """Move the placeholders of absent optional inputs (``specs.ABSENT_INPUT_SHAPE``, the
    positional form of ``pytrt_kv.trt.prepare_for_tensorrt``) out of ``x``, so the CPU
    reference runs prepared models too; returns what was moved."""
    key = x["key"]
    # With B*H == 0 a real compress_seq_offsets [B*H] has the placeholder's shape: keep it.
    no_runs = key is not None and key.ndim == 4 and key.shape[0] * key.shape[2] == 0
    moved = {}
    for name in ("value", "value_cache", "compress_seq_offsets"):
        v = x[name]
        if v is None or v.shape != specs.ABSENT_INPUT_SHAPE:
            continue
        if name == "compress_seq_offsets" and no_runs:
            continue
        moved[name], x[name] = v, None
    return moved


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
        scatter_pa_kv_cache(
            x["key"], x["value"], key_cache, value_cache, x["slot_mapping"],
            compress_lens=x["compress_lens"], compress_seq_offsets=x["compress_seq_offsets"],
            seq_lens=x["seq_lens"], cache_layout=a["cache_layout"] or None,
            compress_mode=a["compress_mode"] or None)
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
        actual = gather_selection_kv_cache(
            sel_k_rope, sel_kv, x["selection_kv_block_table"], status,
            x["selection_topk_indices"], x["full_k_rope"], x["full_kv_cache"],
            x["full_kv_block_table"], x["full_kv_actual_seq"], x["full_q_actual_seq"],
            selection_topk_block_size=int(a["selection_topk_block_size"]))
        return sel_k_rope, sel_kv, status, np.asarray(actual, dtype=np.int32)


#: Alias names that say what the classes are (the evaluator needs the op_type as the name).
ScatterPaKvCacheOp = ScatterPaKvCache
GatherSelectionKvCacheOp = GatherSelectionKvCache


def _load(model_or_path: Union[onnx.ModelProto, str, os.PathLike]) -> onnx.ModelProto:
    if isinstance(model_or_path, onnx.ModelProto):
        return model_or_path
    if isinstance(model_or_path, (str, os.PathLike)):
        return onnx.load(os.fspath(model_or_path))
    raise TypeError(f"model_or_path: expected an onnx.ModelProto or a path, got "
                    f"{type(model_or_path).__name__}")


def make_evaluator(model_or_path: Union[onnx.ModelProto, str, os.PathLike]
                   ) -> ReferenceEvaluator:
    """A ``ReferenceEvaluator`` that knows our ops (reuse it to run a model many times)."""
    return ReferenceEvaluator(_load(model_or_path),
                              new_ops=[ScatterPaKvCache, GatherSelectionKvCache])


def run(model_or_path: Union[onnx.ModelProto, str, os.PathLike, ReferenceEvaluator],
        feeds: Mapping[str, np.ndarray]) -> Dict[str, np.ndarray]:
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
        A graph input is missing from ``feeds`` or an unknown name is fed, or the
        reference refuses an input (the message names it).
    """
    ev = model_or_path if isinstance(model_or_path, ReferenceEvaluator) else \
        make_evaluator(model_or_path)
    expected = list(ev.input_names)
    missing = [n for n in expected if n not in feeds]
    extra = [n for n in feeds if n not in expected]
    if missing or extra:
        raise ValueError(f"feeds: expected exactly the graph inputs {expected}, got "
                         f"{sorted(feeds)} (missing {missing}, unknown {extra})")
    try:
        results = ev.run(None, {n: np.asarray(feeds[n]) for n in expected})
    except TypeError as exc:
        # onnx.reference wraps every TypeError of an op into a generic message; surface
        # the reference's own (it names the argument).
        if isinstance(exc.__cause__, TypeError):
            raise exc.__cause__ from None
        raise
    return dict(zip(ev.output_names, results))
