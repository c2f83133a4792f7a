"""Every rule that decides whether a model with ``pytrt_kv`` nodes is valid, in one place
(docs/GRAPH_MODE.md, "Model checks"; ``pytrt-kv check``).

:func:`check_model` returns every :class:`Problem` it finds; :func:`validate_model` raises
the first one as a ValueError or TypeError with the same one-line text. The CPU runtime
(``runtime.run``, ``make_evaluator``, the Polygraphy runner), ``prepare_for_tensorrt``
(``pytrt-kv prepare``) and the engine build (``build_plan``/``build_engine``,
``pytrt-kv build``, before TensorRT is imported) all call :func:`validate_model`, so a
model fails the same way everywhere.

Rules (the ``rule`` of a problem):

- ``domain``: every node's domain imported, ``pytrt_kv`` at its version;
- ``schema.op``, ``schema.attribute``, ``schema.input``, ``schema.output``: the node
  against its schema (``nodes.validate_node``);
- ``schema.dtype``, ``schema.shape``: declared input dtypes and, where static, shapes
  against the contract (``check.validate_node``, the shape parts of docs/SPEC.md S and G);
- ``graph.output-declaration``: a graph output declared unlike the op's output;
- ``graph.update-dropped``: an updated cache (``*_out``) that is not a graph output
  (docs/SPEC.md O: every ``*_out`` is a graph output; later nodes may also read it);
- ``graph.cache-shared``: a cache input (or a tensor it is a view of) also read by
  another node, or returned as a graph output when it is not an earlier node's
  ``*_out`` (docs/SPEC.md O: a cache input is consumed by its op only, whatever
  ``alias_io``; later nodes read the ``*_out``);
- ``graph.two-caches``: one tensor updated in place by two nodes (or twice by one);
- ``graph.cache-consistency``: two scatters chained through one cache with different
  ``cache_layout``, or the chained cache declared with another dtype;
- ``target``: a ``--target`` compute capability the installed kernels were not compiled
  for (the ``cuda_architectures`` CMake recorded in the ``build_info.json`` beside the
  kernels library, ``pytrt_kv._lib.kernel_architectures``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import onnx

from ..contract import dtypes, specs
from . import check, model_rules, nodes, rules

#: Ops through which a cache stays the same data (a view): docs/GRAPH_MODE.md's example
#: feeds the scatter's ``*_out`` to the gather through a Reshape.
VIEW_OPS = frozenset({"Reshape", "Identity", "Squeeze", "Unsqueeze", "Flatten"})


@dataclass(frozen=True)
class Problem:
    """One reason a model is invalid.

    ``node`` is the node's name (``""`` for a model-wide problem such as a target),
    ``op`` its op type, ``tensor`` the input, output or attribute concerned, ``rule`` the
    rule's name (module docstring) and ``message`` ``"expected ..., got ..."``.
    """

    node: str
    op: str
    tensor: str
    rule: str
    message: str
    kind: type[Exception] = ValueError

    def __str__(self) -> str:
        where = f"node {self.node or '<unnamed>'!r} ({self.op}): " if self.op else ""
        return f"{where}{self.tensor}: {self.message} [{self.rule}]"

    def error(self) -> Exception:
        """The ValueError or TypeError :func:`validate_model` raises for it."""
        return self.kind(str(self))


def _from_exception(exc: Exception, node: onnx.NodeProto | None, default: str) -> Problem:
    """A Problem from a ``"node 'n' (Op): arg: expected ..., got ..."`` error; its rule is
    the one the error carries (``rules.ruled``), else ``default``."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if node is not None:
        where = nodes.node_where(node)
        text = text[len(where) :] if text.startswith(where) else text
    arg, sep, rest = text.partition(": ")
    if not sep:
        arg, rest = "model", text
    return Problem(
        node.name if node is not None else "",
        node.op_type if node is not None else "",
        arg,
        rules.rule_of(exc, default),
        rest,
        TypeError if isinstance(exc, TypeError) else ValueError,
    )


# --- targets ------------------------------------------------------------------------


def parse_target(target: Any) -> str:
    """``"sm80"``, ``"SM_80"``, ``"8.0"``, ``"80"`` or ``80`` -> ``"SM80"``.

    Raises
    ------
    ValueError
        ``target`` is not a compute capability.
    """
    text = str(target).strip().upper().replace("_", "")
    if text.startswith("SM"):
        text = text[2:]
    if "." in text:
        major, _, minor = text.partition(".")
        text = major + minor
    if not text.isdigit() or len(text) < 2:
        raise ValueError(
            f"targets: expected compute capabilities such as 'sm80', '8.9' or 120, got {target!r}"
        )
    return f"SM{int(text)}"


def kernel_architectures(record: str) -> tuple[list[int], list[int]] | None:
    """(SASS archs, PTX archs) of a CMake ``CUDA_ARCHITECTURES`` value such as
    ``"80-real;89-real;120"`` (``"90"`` is both SASS and PTX); None when the value names
    no explicit architectures (``all``, ``native``, empty)."""
    sass: list[int] = []
    ptx: list[int] = []
    for entry in record.replace(",", ";").split(";"):
        entry = entry.strip()
        base, _, suffix = entry.partition("-")
        if not base.isdigit():
            if entry:
                return None  # all, all-major, native, 90a...: not decided here
            continue
        if suffix in ("", "real"):
            sass.append(int(base))
        if suffix in ("", "virtual"):
            ptx.append(int(base))
    return (sass, ptx) if sass or ptx else None


def runs_on(target: int, sass: Sequence[int], ptx: Sequence[int]) -> bool:
    """True when kernels with machine code for ``sass`` and PTX of ``ptx`` run on SM ``target``."""
    # Machine code for X.y runs on X.z with z >= y; PTX is compiled for any newer GPU.
    return any(a // 10 == target // 10 and a <= target for a in sass) or any(
        a <= target for a in ptx
    )


def check_targets(targets: Iterable[Any], record: str | None) -> list[Problem]:
    """A problem for each of ``targets`` the kernels recorded in ``record`` (CMake's
    ``cuda_architectures``) cannot run on; none when there is no record."""
    names = [parse_target(t) for t in targets]
    if not names:
        return [Problem("", "", "targets", "target", "expected a compute capability, got none")]
    archs = kernel_architectures(record or "")
    if archs is None:
        return []
    sass, ptx = archs
    bad = [n for n in names if not runs_on(int(n[2:]), sass, ptx)]
    if not bad:
        return []
    listed = [f"SM{a}" for a in sorted(set(sass))]
    newer = f" and newer through PTX of SM{min(ptx)}" if ptx else ""
    return [
        Problem(
            "",
            "",
            "targets",
            "target",
            f"expected compute capabilities the installed kernels were compiled for "
            f"({', '.join(listed)}{newer}; build_info.json cuda_architectures {record!r}; "
            f"rebuild with PYTRT_KV_CUDA_ARCHS, docs/TENSORRT.md), got {', '.join(bad)}",
        )
    ]


def _installed_record() -> str | None:
    from .._lib import kernel_architectures  # noqa: PLC0415 - the build record, pure Python

    return kernel_architectures()


# --- graph rules ---------------------------------------------------------------------


def _empty(types: Mapping[str, nodes.Type], name: str) -> bool:
    shape = types.get(name, (0, None))[1]
    return shape is not None and 0 in shape


def _readers(model: onnx.ModelProto) -> dict[str, list[tuple[onnx.NodeProto, int]]]:
    out: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            if name:
                out.setdefault(name, []).append((node, i))
    return out


def _label(node: onnx.NodeProto) -> str:
    return node.name or f"<unnamed {node.op_type}>"


def _ours(node: onnx.NodeProto) -> bool:
    return node.domain == specs.DOMAIN and node.op_type in specs.OPS


def _through_views(
    name: str, readers: Mapping[str, list[tuple[onnx.NodeProto, int]]]
) -> Iterable[tuple[onnx.NodeProto, int, str]]:
    """(reader, input index, tensor read) of ``name`` and of its views (VIEW_OPS)."""
    seen, todo = {name}, [name]
    while todo:
        t = todo.pop()
        for node, i in readers.get(t, []):
            yield node, i, t
            if node.op_type in VIEW_OPS and i == 0 and node.output and node.output[0]:
                if node.output[0] not in seen:
                    seen.add(node.output[0])
                    todo.append(node.output[0])


def _view_source_readers(
    src: str,
    readers: Mapping[str, list[tuple[onnx.NodeProto, int]]],
    producers: Mapping[str, onnx.NodeProto],
    outputs: set[str],
    updated: set[str],
) -> list[str]:
    """Other readers of the tensors ``src`` is a view of (VIEW_OPS, walking back): the
    update in place changes them too, so they are the same cache."""
    found: list[str] = []
    seen = {src}
    view = producers.get(src)
    while view is not None and view.op_type in VIEW_OPS and view.input and view.input[0]:
        base = view.input[0]
        if base in seen:
            break
        seen.add(base)
        names = sorted({_label(n) for n, _ in readers.get(base, []) if n is not view})
        if base in outputs and base not in updated:
            names.append("the graph outputs")
        found += [f"{n} (through {base!r}, of which {src!r} is a view)" for n in names]
        view = producers.get(base)
    return found


def _in_place_pairs(
    model: onnx.ModelProto, skip: set[int]
) -> Iterable[tuple[onnx.NodeProto, str, str, str, str]]:
    """``(node, output name, input name, input tensor, output tensor)`` of every in-place
    pair (``op.aliases``) of every node of ours not in ``skip``; a tensor the node leaves
    out is ``""``."""
    for idx, node in enumerate(model.graph.node):
        if not _ours(node) or idx in skip:
            continue
        op = specs.OPS[node.op_type]
        for out_name, in_name in op.aliases.items():
            j, k = op.input_index(in_name), op.output_index(out_name)
            src = node.input[j] if j < len(node.input) else ""
            dst = node.output[k] if k < len(node.output) else ""
            yield node, out_name, in_name, src, dst


def _graph_rules(
    model: onnx.ModelProto, types: Mapping[str, nodes.Type], skip: set[int]
) -> list[Problem]:
    problems: list[Problem] = []
    readers = _readers(model)
    outputs = {o.name for o in model.graph.output}
    producers = {o: n for n in model.graph.node for o in n.output if o}
    updaters: dict[str, list[tuple[onnx.NodeProto, str]]] = {}
    updated: set[str] = set()  # every *_out: a graph output, by the rule below
    for node, out_name, in_name, src, dst in _in_place_pairs(model, skip):
        if src and not _empty(types, src):
            updaters.setdefault(src, []).append((node, in_name))
        if dst:
            updated.add(dst)
        if not src or not dst or _empty(types, src):
            continue
        if dst in outputs:
            continue
        others = sorted({_label(n) for n, _ in readers.get(dst, [])})
        got = f"{dst!r} read only by {others}" if others else f"{dst!r} read by nothing"
        problems.append(
            Problem(
                node.name,
                node.op_type,
                out_name,
                "graph.update-dropped",
                f"expected a graph output (the updated {in_name} {src!r}, which the "
                f"next step feeds back; later nodes may also read it, docs/SPEC.md O), "
                f"got {got}, not a graph output",
            )
        )
    for src, users in updaters.items():
        node, in_name = users[0]
        if len(users) > 1:
            problems.append(
                Problem(
                    users[1][0].name,
                    users[1][0].op_type,
                    users[1][1],
                    "graph.two-caches",
                    f"expected a cache no other node updates in place, got {src!r}, also "
                    f"{in_name} of node {_label(node)!r}",
                )
            )
            continue
        others = sorted({_label(n) for n, _ in readers.get(src, []) if n is not node})
        if src in outputs and src not in updated:
            # An earlier node's *_out chained straight into this node is a graph output
            # by the update-dropped rule; any other cache input returned is a reader.
            others.append("the graph outputs")
        others += _view_source_readers(src, readers, producers, outputs, updated)
        if others:
            problems.append(
                Problem(
                    node.name,
                    node.op_type,
                    in_name,
                    "graph.cache-shared",
                    f"expected {src!r} read by this node only (a cache input is consumed "
                    f"by its op only, whatever alias_io: it is updated in place; read the "
                    f"*_out instead, docs/SPEC.md O), got also read by {', '.join(others)}",
                )
            )
    problems += _consistency(model, types, readers, skip)
    return problems


def _consistency(
    model: onnx.ModelProto,
    types: Mapping[str, nodes.Type],
    readers: Mapping[str, list[tuple[onnx.NodeProto, int]]],
    skip: set[int],
) -> list[Problem]:
    """Two nodes chained through one cache agree on its dtype and (scatters) layout."""
    problems = []
    scatter = specs.SCATTER_PA_KV_CACHE
    for node, _out_name, in_name, src, dst in _in_place_pairs(model, skip):
        if not dst or not src:
            continue
        for later, i, tensor in _through_views(dst, readers):
            if not _ours(later) or later is node:
                continue
            lop = specs.OPS[later.op_type]
            what = lop.inputs[i].name if i < len(lop.inputs) else f"input {i}"
            a, b = types.get(src, (0, None))[0], types.get(tensor, (0, None))[0]
            if a and b and a != b:
                problems.append(
                    Problem(
                        later.name,
                        later.op_type,
                        what,
                        "graph.cache-consistency",
                        f"expected the dtype of {in_name} {src!r} of node "
                        f"{_label(node)!r} ({nodes.describe((a, None))}), got "
                        f"{nodes.describe((b, None))} declared for {tensor!r}",
                        TypeError,
                    )
                )
            if node.op_type == scatter.name and lop is scatter:
                la = model_rules.node_attr(node, "cache_layout")
                lb = model_rules.node_attr(later, "cache_layout")
                if la and lb and la != lb:
                    problems.append(
                        Problem(
                            later.name,
                            later.op_type,
                            "attribute 'cache_layout'",
                            "graph.cache-consistency",
                            f"expected {la!r}, the layout node {_label(node)!r} writes "
                            f"{tensor!r} with, got {lb!r}",
                        )
                    )
    return problems


# --- per node ------------------------------------------------------------------------


def _contract_check(node: onnx.NodeProto, types: dict[str, nodes.Type]) -> None:
    """Declared input dtypes and, where every input is static, shapes against the
    contract (``check.validate_node``, as the schemas' shape inference does); records
    the types of the node's outputs in ``types``."""
    op = specs.OPS[node.op_type]
    where = nodes.node_where(node)
    known: dict[str, check.TensorInfo] = {}
    for i, name in enumerate(node.input[: len(op.inputs)]):
        if not name or name not in types:
            continue
        elem, shape = types[name]
        spec = op.inputs[i]
        dtype = dtypes.ONNX_TO_NAME.get(elem)
        if dtype is None or dtype not in spec.dtypes:
            raise rules.ruled(
                "schema.dtype",
                TypeError(
                    f"{where}{spec.name}: expected dtype in {list(spec.dtypes)}, got "
                    f"{nodes.describe((elem, shape))} ({name!r})"
                ),
            )
        known[spec.name] = check.TensorInfo(shape, dtype)
    for out_name, in_name in op.aliases.items():
        k, j = op.output_index(out_name), op.input_index(in_name)
        dst = node.output[k] if k < len(node.output) else ""
        src = node.input[j] if j < len(node.input) else ""
        if dst and src in types and dst not in types:
            types[dst] = types[src]
    present = [n for n in node.input[: len(op.inputs)] if n]
    if len(known) != len(present):
        return  # an input of unknown type (no declaration): nothing more to compare
    # Static shapes: the whole contract; dynamic ones: what the dtypes, ranks and static
    # dims decide (check.validate_node, partial.py).
    absent = (
        specs.absent_placeholders({k: v.shape for k, v in known.items()})
        if op is specs.SCATTER_PA_KV_CACHE
        else ()
    )
    attrs = {
        a.name: onnx.helper.get_attribute_value(a)
        for a in node.attribute
        if a.name not in specs.PLUGIN_NODE_ATTRIBUTES
    }
    _, outs = check.validate_node(
        op.name, {k: v for k, v in known.items() if k not in absent}, attrs, where
    )
    for k, t in enumerate(op.outputs):
        name = node.output[k] if k < len(node.output) else ""
        if name and name not in types and t.name in outs:
            info = outs[t.name]
            types[name] = (dtypes.ONNX[info.dtype], info.shape)


def check_model(
    model: onnx.ModelProto,
    *,
    targets: Sequence[Any] | None = None,
    kernel_archs: str | None = None,
    tensorrt: bool = False,
) -> list[Problem]:
    """Every problem of ``model`` (module docstring), in node order; [] when valid.

    Parameters
    ----------
    model : onnx.ModelProto
    targets : sequence of str or int, optional
        Compute capabilities an engine is built for (``"sm89"``, ``"8.9"``, ``120``):
        each must be one the installed kernels can run on.
    kernel_archs : str, optional
        CMake's ``CUDA_ARCHITECTURES`` of the kernels (``"80-real;89-real;120"``);
        default: the ``build_info.json`` beside the kernels library that would be loaded
        (no check without one).
    tensorrt : bool
        Add the rules of the TensorRT paths (``tensorrt.*``: ``prepare_for_tensorrt``,
        the engine build); the CPU runtime runs models these refuse.

    Raises
    ------
    TypeError
        ``model`` is not an ``onnx.ModelProto``.
    """
    if not isinstance(model, onnx.ModelProto):
        raise TypeError(f"model: expected an onnx.ModelProto, got {type(model).__name__}")
    try:
        model_rules.check_not_empty(model)
    except ValueError as exc:
        return [_from_exception(exc, None, "model")]
    problems = [_from_exception(e, None, "graph.input-declaration")
                for e in model_rules.input_declarations(model)]  # fmt: skip
    opsets = {o.domain: o.version for o in model.opset_import}
    types = nodes.declared_types(model)
    model_rules.inferred_types(model, types)
    scales = {
        n.input[i]
        for n in model.graph.node
        if _ours(n) and n.op_type == specs.SCATTER_PA_KV_CACHE.name
        for i in (8, 9)
        if i < len(n.input) and n.input[i]
    }
    consts = model_rules.constants(model, scales)
    if tensorrt:
        problems += [_from_exception(e, None, "tensorrt.dtype")
                     for e in model_rules.tensorrt_io_dtypes(model)]  # fmt: skip
    skip: set[int] = set()
    for idx, node in enumerate(model.graph.node):
        try:
            nodes.check_domain(node, opsets)
        except (ValueError, TypeError) as exc:
            problems.append(_from_exception(exc, node, "domain"))
            skip.add(idx)
            continue
        if node.domain != specs.DOMAIN:
            continue
        try:
            nodes.validate_node(node, types)
        except (ValueError, TypeError) as exc:
            problems.append(_from_exception(exc, node, "schema.input"))
            skip.add(idx)
            continue
        try:
            if node.op_type == specs.SCATTER_PA_KV_CACHE.name:
                # First: without cache_layout the contract would ask for it only where
                # the shapes fit several layouts.
                model_rules.check_scatter_node(node, types, consts)
            _contract_check(node, types)
            if node.op_type == specs.SCATTER_PA_KV_CACHE.name:
                nodes.check_declared_token_dims(node, types)
            if tensorrt:
                model_rules.check_tensorrt_dtypes(node, types)
        except (ValueError, TypeError) as exc:
            default = "schema.dtype" if isinstance(exc, TypeError) else "schema.shape"
            problems.append(_from_exception(exc, node, default))
            skip.add(idx)
    try:
        nodes.check_output_declarations(model, types)
    except (ValueError, TypeError) as exc:
        node = next((n for n in model.graph.node if str(exc).startswith(nodes.node_where(n))), None)
        problems.append(_from_exception(exc, node, "graph.output-declaration"))
    problems += _graph_rules(model, types, skip)
    if targets is not None:
        problems += check_targets(
            targets, kernel_archs if kernel_archs is not None else _installed_record()
        )
    return problems


def validate_model(
    model: onnx.ModelProto,
    *,
    targets: Sequence[Any] | None = None,
    kernel_archs: str | None = None,
    tensorrt: bool = False,
) -> None:
    """Raise the first problem :func:`check_model` finds, as the ValueError or TypeError
    ``"node 'n' (Op): <argument>: expected ..., got ... [rule]"``."""
    problems = check_model(model, targets=targets, kernel_archs=kernel_archs, tensorrt=tensorrt)
    if problems:
        raise problems[0].error()
