"""Export-time validation of one pytrt_kv node, shared by the schemas' shape inference,
the onnx-graphsurgeon helpers, :func:`onnx_export.single_op_model` and the CPU runtime.

The rules themselves live in ``pytrt_kv.contract.scatter.check_scatter`` and
``pytrt_kv.contract.gather.check_gather`` (docs/SPEC.md S and G); this module only turns
graph tensors into the ``.shape``/``.dtype`` stand-ins those functions take, checks the node's
attributes against ``pytrt_kv.contract.specs`` and computes the output types. Values are
unknown at export time, so these are the shape parts of ``validate_scatter`` /
``validate_gather`` (docs/DECISIONS.md, Validation).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..contract import dtypes, specs
from . import partial
from .rules import rule_of, ruled

#: A dimension: an int when static, a str (symbolic name) or None when dynamic.
Dim = Any


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of a graph tensor as the validators see it.

    ``shape`` is None when even the rank is unknown; ``dtype`` is a specs.py dtype name.
    """

    shape: tuple[Dim, ...] | None
    dtype: str

    @property
    def static(self) -> bool:
        return self.shape is not None and all(isinstance(d, int) for d in self.shape)

    def describe(self) -> str:
        dims = "?" if self.shape is None else ", ".join(str(d) for d in self.shape)
        return f"{self.dtype}[{dims}]"


class _Stand:
    """``.shape``/``.dtype`` stand-in handed to check_scatter/check_gather (never read)."""

    def __init__(self, info: TensorInfo):
        assert info.shape is not None  # stand-ins are made for known shapes only
        self.shape = tuple(int(d) for d in info.shape)
        self.dtype = dtypes.numpy_dtype(info.dtype)


def dtype_name(dtype: Any) -> str:
    """specs.py name of an ONNX data type number, NumPy/ml_dtypes dtype or dtype name."""
    if isinstance(dtype, (int, np.integer)) and not isinstance(dtype, bool):
        try:
            return dtypes.ONNX_TO_NAME[int(dtype)]
        except KeyError:
            import onnx

            name = (
                onnx.TensorProto.DataType.Name(int(dtype))
                if int(dtype) in onnx.TensorProto.DataType.values()
                else str(dtype)
            )
            raise TypeError(
                f"dtype: ONNX type {name} is not supported by pytrt_kv; expected "
                f"one of {sorted(dtypes.ONNX)}"
            ) from None
    return dtypes.name_of(dtype)


def _attribute_error(kind: type[Exception], message: str) -> Exception:
    return ruled("schema.attribute", kind(message))


def check_attributes(op: specs.OpSpec, attributes: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Attributes with defaults filled in; refuses unknown names, wrong types and values."""
    out: dict[str, Any] = {}
    allowed = set(op.attribute_names) | set(specs.PLUGIN_NODE_ATTRIBUTES)
    for name, value in attributes.items():
        if name not in allowed:
            raise _attribute_error(
                ValueError,
                f"{where}attribute {name!r}: expected one of {sorted(allowed)}, "
                f"got an unknown attribute",
            )
        if name in specs.PLUGIN_NODE_ATTRIBUTES:
            want = specs.PLUGIN_NODE_ATTRIBUTES[name]
            if isinstance(value, bytes):
                value = value.decode()
            if value != want:
                raise _attribute_error(
                    ValueError, f"{where}attribute {name!r}: expected {want!r}, got {value!r}"
                )
            continue
        spec = op.attribute(name)
        if spec.type == "int":
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise _attribute_error(
                    TypeError,
                    f"{where}attribute {name!r}: expected an int, got "
                    f"{type(value).__name__} {value!r}",
                )
            value = int(value)
        else:
            if isinstance(value, bytes):
                value = value.decode()
            if value is None:
                value = ""
            if not isinstance(value, str):
                raise _attribute_error(
                    TypeError,
                    f"{where}attribute {name!r}: expected a string, got "
                    f"{type(value).__name__} {value!r}",
                )
        if spec.choices and value not in spec.choices:
            raise _attribute_error(
                ValueError,
                f"{where}attribute {name!r}: expected one of "
                f"{[c for c in spec.choices if c != '']}, got {value!r}",
            )
        out[name] = value
    for spec in op.attributes:
        out.setdefault(spec.name, spec.default)
    if op is specs.GATHER_SELECTION_KV_CACHE and out["selection_topk_block_size"] < 1:
        raise _attribute_error(
            ValueError,
            f"{where}attribute 'selection_topk_block_size': expected an int "
            f">= 1, got {out['selection_topk_block_size']}",
        )
    return out


def validate_node(
    op_type: str,
    inputs: Mapping[str, TensorInfo | None],
    attributes: Mapping[str, Any],
    where: str = "",
) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    """Validate one node and compute its outputs.

    Parameters
    ----------
    op_type : str
        ``"ScatterPaKvCache"`` or ``"GatherSelectionKvCache"``.
    inputs : mapping name -> TensorInfo or None
        By docs/SPEC.md input name; absent optional inputs are missing or None.
    attributes : mapping
        Node attributes (``plugin_namespace``/``plugin_version`` allowed).
    where : str
        Prefix for error messages (e.g. the node name).

    Returns
    -------
    attributes : dict
        Every op attribute with defaults filled in and ``cache_layout``/``compress_mode``
        resolved from the shapes when they are static, plus the two plugin attributes.
    outputs : dict name -> TensorInfo
        The outputs the node has, in docs/SPEC.md order.

    Raises
    ------
    ValueError, TypeError
        Naming the tensor or attribute, what was expected and what came.
    """
    op = specs.get_op(op_type)
    given = {k: v for k, v in inputs.items() if v is not None}
    unknown = [k for k in given if k not in op.input_names]
    if unknown:
        raise ruled(
            "schema.input",
            ValueError(
                f"{where}inputs: expected names among {list(op.input_names)}, got unknown {unknown}"
            ),
        )
    for t in op.inputs:
        if not t.optional and t.name not in given:
            raise ruled(
                "schema.input",
                ValueError(
                    f"{where}{t.name}: expected a tensor (required input of {op.name}), got None"
                ),
            )
    attrs = check_attributes(op, attributes, where)
    # Pre-check dtypes from specs (also covers dynamic shapes, which the checkers
    # below cannot take).
    for name, info in given.items():
        spec = op.input(name)
        if info.dtype not in spec.dtypes:
            raise ruled(
                "schema.dtype",
                TypeError(
                    f"{where}{name}: expected dtype in {list(spec.dtypes)}, got {info.describe()}"
                ),
            )
    static = all(info.static for info in given.values())
    try:
        # What the dtypes, ranks and static dims decide whatever the dynamic dims are
        # (partial.py), then the contract itself where every shape is static.
        if op is specs.SCATTER_PA_KV_CACHE:
            partial.scatter_dtypes(given, attrs["cache_layout"])
            if not static:
                partial.scatter_dynamic(given)
            attrs = _scatter(given, attrs, static, where)
        else:
            partial.gather_dtypes(given)
            if not static:
                partial.gather_dynamic(given, attrs["selection_topk_block_size"])
            _gather(given, attrs, static, where)
    except (ValueError, TypeError) as exc:
        # The contract's own errors: dtype problems are TypeErrors, shape ones
        # ValueErrors (docs/SPEC.md S, G "errors"); partial.py's carry their rule.
        rule = rule_of(exc, "schema.dtype" if isinstance(exc, TypeError) else "schema.shape")
        if where and not str(exc).startswith(where):
            raise ruled(rule, type(exc)(f"{where}{exc}")) from None
        ruled(rule, exc)
        raise
    # An empty string attribute means "not set"; leaving it out keeps nodes minimal.
    attrs = {k: v for k, v in attrs.items() if v != ""}
    attrs.update(specs.PLUGIN_NODE_ATTRIBUTES)
    return attrs, _outputs(op, given)


def _scatter(
    given: Mapping[str, TensorInfo], attrs: dict[str, Any], static: bool, where: str
) -> dict[str, Any]:
    key = given["key"]
    if key.shape is not None and len(key.shape) == 4 and attrs["cache_layout"]:
        raise ruled(
            "schema.attribute",
            ValueError(
                f"{where}cache_layout: expected nothing for a 4-D key "
                f"(compressing write), got {attrs['cache_layout']!r}"
            ),
        )
    if static:
        from ..contract.scatter import check_scatter

        stand = {k: _Stand(v) for k, v in given.items()}
        meta = check_scatter(
            **{n: stand.get(n) for n in specs.SCATTER_PA_KV_CACHE.input_names},
            cache_layout=attrs["cache_layout"] or None,
            compress_mode=attrs["compress_mode"] or None,
        )
        attrs["cache_layout"] = meta.layout or ""
        attrs["compress_mode"] = meta.mode or ""
        return attrs
    # Dynamic shapes: the kernels need the layout written down. It depends only on H, D
    # and the cache dims after NB, so it is still detected when only T (key, value,
    # slot_mapping dim 0) and NB (cache dim 0) are dynamic.
    rank = None if key.shape is None else len(key.shape)
    if rank == 3:
        check_token_dims(given, where)
        # Detected when not given, checked against the cache shapes when given.
        attrs["cache_layout"] = _layout_with_dynamic_tokens(given, attrs, where)
    if rank is not None and rank not in (3, 4):
        raise ruled(
            "schema.shape",
            ValueError(
                f"{where}key: expected rank 3 [T, H, Dk] or 4 [B, Smax, H, Dk], got "
                f"{key.describe()}"
            ),
        )
    return attrs


def check_token_dims(given: Mapping[str, TensorInfo], where: str) -> None:
    """Refuse a 3-D scatter whose token count T (dim 0 of key, value and slot_mapping,
    docs/SPEC.md S2) is a named dynamic dim in one tensor and static in another: such a
    model runs only with T equal to the static size, which the layout detection on
    stand-ins would otherwise hide until a feed reaches the reference. An unnamed
    unknown dim (left by shape inference) agrees with anything."""
    dims = {
        n: given[n].shape[0]  # type: ignore[index]
        for n in ("key", "value", "slot_mapping")
        if n in given and given[n].shape
    }
    named = next(((n, d) for n, d in dims.items() if isinstance(d, str)), None)
    fixed = next((n for n, d in dims.items() if isinstance(d, int)), None)
    if named is not None and fixed is not None:
        raise _token_dims_error(
            f"{where}{fixed}: expected dim 0 dynamic as {named[0]}'s {named[1]!r} (key, value "
            f"and slot_mapping dim 0 are one token count T), got {given[fixed].describe()}"
        )


def _token_dims_error(message: str) -> Exception:
    return ruled("schema.shape", ValueError(message))


#: Dims of a 3-D scatter that never decide the layout: T and NB (docs/SPEC.md S2).
_LAYOUT_FREE_DIMS = {
    "key": (0,),
    "value": (0,),
    "slot_mapping": (0,),
    "key_cache": (0,),
    "value_cache": (0,),
}


def _one_of(names: tuple[str, ...]) -> str:
    """``('a', 'b', 'c')`` -> ``"'a', 'b' or 'c'"``."""
    return ", ".join(repr(n) for n in names[:-1]) + f" or {names[-1]!r}"


def _layout_error(message: str) -> Exception:
    return ruled("schema.attribute", ValueError(message))


def _layout_with_dynamic_tokens(
    given: Mapping[str, TensorInfo], attrs: dict[str, Any], where: str
) -> str:
    """cache_layout of a 3-D scatter whose only dynamic dims are T and NB: detected (or,
    when given, checked against the shapes) by check_scatter on stand-ins with T and NB
    taken from a static counterpart, else 1; with other dynamic dims the given layout,
    or a ValueError saying what to pass."""
    from ..contract.scatter import check_scatter

    dynamic = []
    for name, info in given.items():
        free = _LAYOUT_FREE_DIMS.get(name, ())
        if info.shape is None:
            dynamic.append(f"{name} {info.describe()}")
            continue
        for axis, d in enumerate(info.shape):
            if not isinstance(d, int) and axis not in free:
                dynamic.append(f"{name} {info.describe()} (dim {axis})")
    if dynamic:
        if attrs["cache_layout"]:
            return str(attrs["cache_layout"])  # given; the shapes cannot tell more
        raise _layout_error(
            f"{where}cache_layout: expected one of {list(specs.CACHE_LAYOUTS)}, because the "
            f"layout cannot be detected from dynamic dims other than T and NB: "
            f"{', '.join(dynamic)}; pass cache_layout={_one_of(specs.CACHE_LAYOUTS)}, got nothing"
        )
    # A dynamic T or NB takes the value a static counterpart has (else 1), so that the
    # stand-ins agree with each other wherever the model is static.
    groups = (("key", "value", "slot_mapping"), ("key_cache", "value_cache"))
    fill = {}
    # Every rank is known here (an unknown one is listed as dynamic above).
    shapes = {name: info.shape for name, info in given.items() if info.shape is not None}
    for group in groups:
        static = [shapes[n][0] for n in group if n in shapes and isinstance(shapes[n][0], int)]
        fill.update({n: static[0] if static else 1 for n in group})
    stand = {}
    for name, info in given.items():
        shape = tuple(d if isinstance(d, int) else fill.get(name, 1) for d in shapes[name])
        stand[name] = _Stand(TensorInfo(shape, info.dtype))
    meta = check_scatter(
        **{n: stand.get(n) for n in specs.SCATTER_PA_KV_CACHE.input_names},
        cache_layout=attrs["cache_layout"] or None,
        compress_mode=attrs["compress_mode"] or None,
    )
    assert meta.layout is not None  # a 3-D key always has a layout
    return meta.layout


def _gather(
    given: Mapping[str, TensorInfo], attrs: dict[str, Any], static: bool, where: str
) -> None:
    del where
    if not static:
        return
    from ..contract.gather import check_gather

    stand = {k: _Stand(v) for k, v in given.items()}
    check_gather(
        **{n: stand[n] for n in specs.GATHER_SELECTION_KV_CACHE.input_names},
        selection_topk_block_size=attrs["selection_topk_block_size"],
    )


def _outputs(op: specs.OpSpec, given: Mapping[str, TensorInfo]) -> dict[str, TensorInfo]:
    out: dict[str, TensorInfo] = {}
    for t in op.outputs:
        src = op.aliases.get(t.name)
        if src is not None:
            if src in given:
                out[t.name] = given[src]
            continue
        # selection_kv_actual_seq: one int32 per row of selection_kv_block_table.
        table = given["selection_kv_block_table"]
        rows = None if table.shape is None or not table.shape else table.shape[0]
        out[t.name] = TensorInfo((rows,), specs.INT32)
    return out
