"""ONNX schemas of the pytrt_kv ops, registered with ``onnx.defs`` (docs/SPEC.md section O).

Once registered, ``onnx.checker.check_model(m, full_check=True)`` and
``onnx.shape_inference.infer_shapes`` understand both ops: the checker refuses unknown
or missing attributes and wrong dtypes; shape inference gives every ``*_out`` the type
and shape of its input, ``selection_kv_actual_seq`` int32 ``[R]``, and, when the input
shapes are static, validates them with the same rules as the reference
(``check_scatter`` / ``check_gather``), so an inconsistent model fails at check time.

Registration happens on import of this module (so of ``onnx_export`` and
``pytrt_kv.runtime``); calling
:func:`register` again is harmless.
"""

from __future__ import annotations

import onnx
import onnx.defs
from onnx import helper

from ..contract import dtypes, specs
from .check import TensorInfo, dtype_name, validate_node

_P = onnx.defs.OpSchema.FormalParameter
_OPTION = onnx.defs.OpSchema.FormalParameterOption


def _type_str(name: str) -> str:
    return f"tensor({onnx.TensorProto.DataType.Name(dtypes.ONNX[name]).lower()})"


def _constraint(op: specs.OpSpec, tensor: specs.TensorSpec) -> str:
    # Outputs share the type variable of the input they update, so the checker ties
    # cache_out to cache; tensors sharing a dtype_group share one variable.
    src = op.aliases.get(tensor.name)
    if src is not None:
        tensor = op.input(src)
    return f"T_{tensor.dtype_group or tensor.name}"


def _attr_type(spec: specs.AttrSpec):
    return (
        onnx.defs.OpSchema.AttrType.INT
        if spec.type == "int"
        else onnx.defs.OpSchema.AttrType.STRING
    )


def build_schema(op: specs.OpSpec) -> onnx.defs.OpSchema:
    """The :class:`onnx.defs.OpSchema` of one op, built from ``pytrt_kv.specs``."""
    constraints: dict[str, list[str]] = {}

    def param(t: specs.TensorSpec) -> _P:
        var = _constraint(op, t)
        constraints.setdefault(var, [_type_str(d) for d in t.dtypes])
        return _P(
            t.name, var, t.doc, param_option=_OPTION.Optional if t.optional else _OPTION.Single
        )

    inputs = [param(t) for t in op.inputs]
    outputs = [param(t) for t in op.outputs]
    attributes = [
        onnx.defs.OpSchema.Attribute(a.name, helper.make_attribute(a.name, a.default), a.doc)
        for a in op.attributes
    ] + [
        onnx.defs.OpSchema.Attribute(
            name,
            onnx.defs.OpSchema.AttrType.STRING,
            f"TensorRT plugin {name[len('plugin_') :]}; must be {value!r}",
            required=True,
        )
        for name, value in specs.PLUGIN_NODE_ATTRIBUTES.items()
    ]
    schema = onnx.defs.OpSchema(
        op.name,
        specs.DOMAIN,
        specs.DOMAIN_VERSION,
        op.doc,
        inputs=inputs,
        outputs=outputs,
        type_constraints=[(k, v, "") for k, v in constraints.items()],
        attributes=attributes,
    )
    schema.set_type_and_shape_inference_function(_make_inference(op))
    return schema


def _info(tp: onnx.TypeProto) -> TensorInfo | None:
    if not tp.HasField("tensor_type") or tp.tensor_type.elem_type == 0:
        return None
    tt = tp.tensor_type
    shape = None
    if tt.HasField("shape"):
        shape = tuple(
            d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim
        )
    return TensorInfo(shape, dtype_name(tt.elem_type))


def _type_proto(info: TensorInfo) -> onnx.TypeProto:
    return helper.make_tensor_type_proto(dtypes.ONNX[info.dtype], info.shape)


def _make_inference(op: specs.OpSpec):
    def infer(ctx) -> None:
        inputs: dict[str, TensorInfo | None] = {}
        for i, t in enumerate(op.inputs):
            if i < ctx.get_num_inputs() and ctx.has_input(i):
                inputs[t.name] = _info(ctx.get_input_type(i))
        attributes = {}
        for a in list(op.attributes) + [
            specs.AttrSpec(n, "string", "") for n in specs.PLUGIN_NODE_ATTRIBUTES
        ]:
            proto = ctx.get_attribute(a.name)
            if proto is not None:
                attributes[a.name] = helper.get_attribute_value(proto)
        known = {k: v for k, v in inputs.items() if v is not None}
        if len(known) != len(inputs):
            return  # input types not known yet: nothing to infer or check
        if any(v.shape is None for v in known.values()):
            # Unknown ranks: outputs still take their input's type.
            shapes_known = {k: TensorInfo(v.shape, v.dtype) for k, v in known.items()}
            outs = {
                t.name: shapes_known[op.aliases[t.name]]
                for t in op.outputs
                if t.name in op.aliases and op.aliases[t.name] in shapes_known
            }
        else:
            # The plugins' positional form (pytrt_kv.trt.prepare_for_tensorrt) passes absent
            # optional inputs as zero-element placeholders: check the node without them.
            absent = (
                specs.absent_placeholders({k: v.shape for k, v in known.items()})
                if op is specs.SCATTER_PA_KV_CACHE
                else ()
            )
            present = {k: v for k, v in known.items() if k not in absent}
            _, outs = validate_node(
                op.name, present, attributes, where=f"{ctx.get_display_name()}: "
            )
            for name in absent:  # an absent cache's output is its placeholder
                out_name = next((o for o, i in op.aliases.items() if i == name), None)
                if out_name is not None and out_name not in outs:
                    outs[out_name] = known[name]
        for i, t in enumerate(op.outputs):
            if i < ctx.get_num_outputs() and ctx.has_output(i) and t.name in outs:
                ctx.set_output_type(i, _type_proto(outs[t.name]))
        if op is specs.GATHER_SELECTION_KV_CACHE and "selection_kv_actual_seq" not in outs:
            i = op.output_index("selection_kv_actual_seq")
            if i < ctx.get_num_outputs() and ctx.has_output(i):
                ctx.set_output_type(
                    i, helper.make_tensor_type_proto(dtypes.ONNX[specs.INT32], None)
                )

    return infer


def register() -> None:
    """Register both schemas with ``onnx.defs`` (once per process)."""
    for op in specs.OPS.values():
        if not onnx.defs.has(op.name, specs.DOMAIN):
            onnx.defs.register_schema(build_schema(op))


register()
