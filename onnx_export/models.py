"""One-node models and the model conventions shared by every exporter (docs/SPEC.md O)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
from onnx import helper

from pytrt_kv.contract import dtypes, specs
from pytrt_kv.graph import schemas  # noqa: F401  (registers the schemas)
from pytrt_kv.graph.check import TensorInfo, dtype_name, validate_node


def finalize_model(model: onnx.ModelProto, *, check: bool = True) -> onnx.ModelProto:
    """Apply the pytrt_kv conventions to ``model`` (in place) and return it.

    IR version 10; the standard opset raised to at least 17; ``pytrt_kv`` version 1
    imported. With ``check`` (default) the model must pass
    ``onnx.checker.check_model(model, full_check=True)``.
    """
    model.ir_version = specs.ONNX_IR_VERSION
    found = {o.domain: o for o in model.opset_import}
    std = found.get("") or found.get("ai.onnx")
    if std is None:
        model.opset_import.append(helper.make_opsetid("", specs.ONNX_OPSET))
    elif std.version < specs.ONNX_OPSET:
        std.version = specs.ONNX_OPSET
    if specs.DOMAIN not in found:
        model.opset_import.append(helper.make_opsetid(specs.DOMAIN, specs.DOMAIN_VERSION))
    if not model.producer_name:
        model.producer_name = "pytrt_kv"
    if check:
        onnx.checker.check_model(model, full_check=True)
    return model


def _value_info(name: str, info: TensorInfo) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtypes.ONNX[info.dtype], info.shape)


def single_op_model(
    op_type: str, inputs: Mapping[str, np.ndarray], **attributes: Any
) -> onnx.ModelProto:
    """A model made of one pytrt_kv node whose graph I/O carry the docs/SPEC.md names.

    Parameters
    ----------
    op_type : str
        ``"ScatterPaKvCache"`` or ``"GatherSelectionKvCache"``.
    inputs : mapping docs/SPEC.md input name -> array
        Only shapes and dtypes are used (bfloat16/float8 as ``ml_dtypes`` arrays); optional
        inputs become graph inputs only when present.
    **attributes
        Op attributes; ``cache_layout`` is resolved from the shapes when omitted.

    Returns
    -------
    onnx.ModelProto
        IR 10, opset 17 + ``pytrt_kv`` 1, checked with ``full_check=True``.

    Examples
    --------
    >>> import numpy as np, onnx
    >>> from onnx_export import single_op_model
    >>> m = single_op_model("ScatterPaKvCache", {
    ...     "key": np.ones((3, 2, 16), np.float16), "key_cache": np.ones((4, 8, 2, 16), np.float16),
    ...     "slot_mapping": np.arange(3, dtype=np.int32)})
    >>> attrs = {a.name: onnx.helper.get_attribute_value(a) for a in m.graph.node[0].attribute}
    >>> [o.name for o in m.graph.output], attrs["cache_layout"], attrs["plugin_namespace"]
    (['key_cache_out'], b'nd', b'pytrt_kv')
    """
    op = specs.get_op(op_type)
    infos: dict[str, TensorInfo] = {}
    for name, arr in inputs.items():
        if arr is None:
            continue
        if not hasattr(arr, "shape") or not hasattr(arr, "dtype"):
            raise TypeError(f"{name}: expected an array, got {type(arr).__name__}")
        infos[name] = TensorInfo(tuple(int(d) for d in arr.shape), dtype_name(arr.dtype))
    attrs, outs = validate_node(op.name, infos, attributes, where=f"{op.name}: ")
    present = [t.name for t in op.inputs if t.name in infos]
    last = max(op.input_index(n) for n in present)
    node_inputs: list[str] = [t.name if t.name in infos else "" for t in op.inputs[: last + 1]]
    node = helper.make_node(
        op.name, node_inputs, list(outs), name=op.name, domain=specs.DOMAIN, **attrs
    )
    graph = helper.make_graph(
        [node],
        f"{op.name}_single",
        [_value_info(n, infos[n]) for n in present],
        [_value_info(n, info) for n, info in outs.items()],
    )
    model = helper.make_model(
        graph,
        opset_imports=[
            helper.make_opsetid("", specs.ONNX_OPSET),
            helper.make_opsetid(specs.DOMAIN, specs.DOMAIN_VERSION),
        ],
    )
    return finalize_model(model)
