"""ONNX-side preparation for TensorRT: pure ``onnx``, runs on any CPU.

The plugins take their inputs by position and have a fixed number of outputs
(docs/TENSORRT.md, "Optional inputs"): ScatterPaKvCache takes 5 inputs (3-D key) or
8 (4-D key) and always has 2 outputs. ONNX instead leaves optional inputs empty ("")
and may omit ``value_cache_out``. :func:`prepare_for_tensorrt` rewrites every pytrt_kv
node into the plugin form:

- an absent ``value``/``value_cache`` becomes a zero-element initializer (shape [0],
  dtype of ``key``) -- the plugin then performs a key-only write;
- an absent ``compress_seq_offsets`` of a 4-D key becomes a zero-element initializer
  of the index dtype (the plugin then defaults to ``alibi``);
- trailing empty inputs are dropped, and a missing ``value_cache_out`` gets a name that
  nothing consumes;
- attributes left at their defaults are written out (the parser warns about each
  missing one otherwise).

It refuses, with a ValueError or TypeError naming the node and the tensor, what TensorRT
would fail on later with a generic message or what would silently lose data: first what
the CPU runtime refuses, with the same message (``pytrt_kv.graph.lint.validate_model``:
more inputs or outputs than the op has, an empty required input, a cache update whose
output is unnamed, bad attributes, a graph output declared unlike the op's output), then
cache dtypes TensorRT cannot
carry as plugin I/O (uint8, float8_e5m2) and index tensors of mixed int32/int64
(docs/TENSORRT.md, "What prepare_for_tensorrt refuses").
"""

from __future__ import annotations

from collections.abc import Iterator

from ..contract import specs

SCATTER = specs.SCATTER_PA_KV_CACHE
GATHER = specs.GATHER_SELECTION_KV_CACHE

#: Dtypes of the ops' contract that TensorRT cannot pass through plugin I/O: it has no
#: float8 E5M2 type, and kUINT8 is only a network input/output type (docs/TENSORRT.md).
TENSORRT_UNSUPPORTED_DTYPES = (specs.UINT8, specs.FLOAT8_E5M2)


def _onnx():
    import onnx  # noqa: PLC0415

    return onnx


def pytrt_kv_nodes(model) -> Iterator:
    """Every node of ``model.graph`` that belongs to the pytrt_kv domain."""
    for node in model.graph.node:
        if node.domain == specs.DOMAIN and node.op_type in specs.OPS:
            yield node


def _attr(node, name: str, default):
    onnx = _onnx()
    for a in node.attribute:
        if a.name == name:
            v = onnx.helper.get_attribute_value(a)
            return v.decode() if isinstance(v, bytes) else v
    return default


def needs_aliased_io(model) -> bool:
    """True when a pytrt_kv node declares its aliases (``alias_io`` = 1, the default): the
    builder then needs ``PreviewFeature.ALIASED_PLUGIN_IO_10_03``."""
    return any(int(_attr(n, "alias_io", 1)) != 0 for n in pytrt_kv_nodes(model))


def _tensor_types(model) -> dict[str, tuple[int, tuple | None]]:
    """name -> (ONNX elem type, shape or None) for graph inputs, outputs, value_info and
    initializers; shape inference fills the rest when our schemas are registered."""
    onnx = _onnx()
    out: dict[str, tuple[int, tuple | None]] = {}

    def take(vis):
        for vi in vis:
            tt = vi.type.tensor_type
            shape = None
            if tt.HasField("shape"):
                shape = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim)
            out[vi.name] = (tt.elem_type, shape)

    take(model.graph.input)
    take(model.graph.value_info)
    take(model.graph.output)
    for init in model.graph.initializer:
        out[init.name] = (init.data_type, tuple(init.dims))
    wanted = {n for node in pytrt_kv_nodes(model) for n in node.input if n}
    if not wanted.issubset(out):
        try:
            from . import schemas  # noqa: F401,PLC0415 - registers the op schemas

            inferred = onnx.shape_inference.infer_shapes(model)
            take(inferred.graph.value_info)
        except Exception:  # inference is a convenience; a clear error follows below
            pass
    return out


def prepare_for_tensorrt(model):
    """A copy of ``model`` whose pytrt_kv nodes have the positional form the plugins take.

    Parameters
    ----------
    model : onnx.ModelProto

    Returns
    -------
    onnx.ModelProto
        The rewritten copy (``model`` is untouched). Models already in plugin form come
        back unchanged in meaning.

    Raises
    ------
    ValueError, TypeError
        What :func:`pytrt_kv.runtime.validate_model` refuses (a node breaking its schema,
        a graph output declared unlike the op's output), with the same message; a
        node's key has no known dtype/rank, or a 4-D key lacks ``compress_lens`` or
        ``seq_lens``.

    Examples
    --------
    >>> import numpy as np
    >>> from onnx_export import single_op_model
    >>> m = single_op_model("ScatterPaKvCache", {
    ...     "key": np.ones((3, 2, 16), np.float16), "key_cache": np.ones((4, 8, 2, 16), np.float16),
    ...     "slot_mapping": np.arange(3, dtype=np.int32)})
    >>> n = prepare_for_tensorrt(m).graph.node[0]
    >>> len(n.input), len(n.output)
    (5, 2)
    """
    onnx = _onnx()
    from .lint import validate_model  # noqa: PLC0415

    # The checks the CPU runtime makes, plus the TensorRT ones (unsupported dtypes), so a
    # model fails with the line of pytrt-kv check everywhere.
    validate_model(model, tensorrt=True)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    types = _tensor_types(m)
    taken = {n for node in m.graph.node for n in list(node.input) + list(node.output)}
    taken |= {i.name for i in m.graph.initializer} | {i.name for i in m.graph.input}

    def fresh(base: str) -> str:
        name, k = base, 1
        while name in taken:
            name, k = f"{base}_{k}", k + 1
        taken.add(name)
        return name

    def empty_initializer(base: str, elem_type: int) -> str:
        name = fresh(base)
        m.graph.initializer.append(
            onnx.helper.make_tensor(name, elem_type, list(specs.ABSENT_INPUT_SHAPE), b"", raw=True)
        )
        return name

    for idx, node in enumerate(m.graph.node):
        if node.domain != specs.DOMAIN or node.op_type not in specs.OPS:
            continue
        tag = node.name or f"{node.op_type}_{idx}"
        op = specs.OPS[node.op_type]
        ins: list[str] = list(node.input) + [""] * (len(op.inputs) - len(node.input))
        outs: list[str] = list(node.output) + [""] * (len(op.outputs) - len(node.output))
        _check_node_dtypes(tag, op, ins, types)
        present = {a.name for a in node.attribute}
        for a in op.attributes:
            if a.name not in present and a.default is not None:
                node.attribute.append(onnx.helper.make_attribute(a.name, a.default))
        if node.op_type == SCATTER.name:
            ins = _scatter_positional(tag, ins, types, empty_initializer)
        for k, name in enumerate(outs):
            if not name:
                outs[k] = fresh(f"{tag}__unused_{op.outputs[k].name}")
        del node.input[:]
        node.input.extend(ins)
        del node.output[:]
        node.output.extend(outs)
    return m


def _scatter_positional(tag: str, ins: list[str], types, empty_initializer) -> list[str]:
    """A scatter node's inputs in the plugin's positional form: an absent value pair, the
    4-D key's compress tensors and the scales' slots filled with zero-element
    placeholders (``empty_initializer(base, elem_type) -> name``)."""
    onnx = _onnx()
    key = ins[SCATTER.input_index("key")]
    if key not in types or types[key][1] is None:
        raise ValueError(
            f"{tag}: key: expected a tensor with a known dtype and rank "
            f"(graph input, initializer or value_info), got {key!r}"
        )
    key_type, key_shape = types[key]
    compress = len(key_shape) == 4
    idx_name = ins[SCATTER.input_index("slot_mapping")]
    idx_type = types.get(idx_name, (onnx.TensorProto.INT32, None))[0]
    iv, ivc = SCATTER.input_index("value"), SCATTER.input_index("value_cache")
    if not ins[iv] and not ins[ivc]:  # validate_model refused one without the other
        ins[iv] = empty_initializer(f"{tag}__absent_value", key_type)
        ins[ivc] = empty_initializer(f"{tag}__absent_value_cache", key_type)
    if compress:
        for name in ("compress_lens", "seq_lens"):
            if not ins[SCATTER.input_index(name)]:
                raise ValueError(
                    f"{tag}: {name}: expected a tensor for a 4-D key {list(key_shape)}, got none"
                )
        io = SCATTER.input_index("compress_seq_offsets")
        if not ins[io]:
            ins[io] = empty_initializer(f"{tag}__absent_compress_seq_offsets", idx_type)
    # Positional inputs: 5 (token write), 8 (compress tensors), 10 (the S9 scales);
    # absent ones in between become zero-element placeholders.
    scales = any(ins[8:10])
    ins = ins[:10] if scales else ins[:8] if (compress or any(ins[5:8])) else ins[:5]
    for k in range(5, len(ins)):
        if not ins[k]:
            elem = idx_type if k < 8 else onnx.TensorProto.FLOAT
            ins[k] = empty_initializer(f"{tag}__absent_{SCATTER.inputs[k].name}", elem)
    return ins


def _check_node_dtypes(tag: str, op, ins: list[str], types) -> None:
    from ..contract import dtypes  # noqa: PLC0415

    index_types: dict[str, str] = {}
    for k, name in enumerate(ins):
        if not name or name not in types:
            continue
        spec = op.inputs[k]
        try:
            dtype = dtypes.ONNX_TO_NAME[types[name][0]]
        except KeyError:
            continue  # not a dtype of the contract: the schema check names it
        if dtype in TENSORRT_UNSUPPORTED_DTYPES:
            raise ValueError(
                f"{tag}: {spec.name}: expected a dtype TensorRT can pass to a plugin "
                f"(float16, bfloat16, float32, int8, float8_e4m3fn), got {dtype} "
                f"({name!r}); use the CPU runtime or the eager kernels for {dtype} caches"
            )
        if spec.dtype_group == "index":
            index_types[spec.name] = dtype
    if len(set(index_types.values())) > 1:
        first = ins[op.input_index("slot_mapping")] if "slot_mapping" in index_types else None
        want = index_types.get("slot_mapping", next(iter(index_types.values())))
        odd = {n: t for n, t in index_types.items() if t != want}
        raise ValueError(
            f"{tag}: {', '.join(odd)}: expected the index dtype of slot_mapping "
            f"({want}{', ' + repr(first) if first else ''}), got "
            f"{', '.join(f'{n} {t}' for n, t in odd.items())}; cast them in the model "
            f"(TensorRT passes one index dtype to the plugin)"
        )


def alias_pairs(model) -> dict[str, str]:
    """Graph output name -> graph input name, for every ``*_out`` of a pytrt_kv node whose
    input is a graph input: the pairs a runner binds to one address (docs/SPEC.md O)."""
    graph_inputs = {i.name for i in model.graph.input} - {i.name for i in model.graph.initializer}
    graph_outputs = {o.name for o in model.graph.output}
    readers: dict[str, list[str]] = {}
    for idx, node in enumerate(model.graph.node):
        for name in set(node.input):
            readers.setdefault(name, []).append(node.name or f"{node.op_type}_{idx}")
    pairs: dict[str, str] = {}
    for node in pytrt_kv_nodes(model):
        op = specs.OPS[node.op_type]
        for k, out in enumerate(node.output):
            src = op.aliased_input_index(k) if k < len(op.outputs) else -1
            if not out or src < 0 or src >= len(node.input):
                continue
            inp = node.input[src]
            if out not in graph_outputs or inp not in graph_inputs:
                continue
            # Bound to one address, any other reader would see the updated (or a racing)
            # cache, while the CPU runtime gives it the old one: refuse, per docs/SPEC.md O.
            if len(readers.get(inp, [])) > 1 or inp in graph_outputs or inp in pairs.values():
                raise ValueError(
                    f"{inp}: expected a cache input consumed only by its op and updated only "
                    f"through {out} (docs/SPEC.md O), got readers {readers.get(inp, [])}"
                    f"{' and it is also a graph output' if inp in graph_outputs else ''}"
                )
            pairs[out] = inp
    return pairs
