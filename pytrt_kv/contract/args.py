"""One description of each op's Python arguments: its :class:`~.specs.OpSpec`.

The Python functions of an op (the reference, :mod:`pytrt_kv.ops`, the contract's
``check_*`` / ``validate_*``) take the op's tensors in the op's input order, then its
attributes (``alias_io`` excepted: it is a graph-only choice), all under the names of
docs/SPEC.md. The public faces (the reference, the eager GPU function, ``check_*``)
spell their signatures out, with their own types and docs; the functions that take the
same arguments plus options (``validate_*``, ``pytrt_kv.ops.prepare_*``) get theirs from
the spec (:func:`op_call`), and every call hands the arguments on with :func:`op_args` /
:func:`op_tensors` instead of listing them again. ``tests/test_op_args.py`` checks every
signature against the spec, so the spec stays the one list (the ONNX schemas, the C++
header and the plugins read it too).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from .specs import AttrSpec, OpSpec

__all__ = [
    "GRAPH_ONLY_ATTRIBUTES",
    "arg_names",
    "index_inputs",
    "op_args",
    "op_attributes",
    "op_call",
    "op_tensors",
    "python_default",
    "signature",
]

#: Attributes a model carries that no Python function takes.
GRAPH_ONLY_ATTRIBUTES = ("alias_io",)


def arg_names(op: OpSpec) -> tuple[str, ...]:
    """The op's Python arguments in order: its inputs, then its attributes."""
    attrs = tuple(a.name for a in op.attributes if a.name not in GRAPH_ONLY_ATTRIBUTES)
    return op.input_names + attrs


def op_tensors(op: OpSpec, scope: Mapping[str, Any]) -> dict[str, Any]:
    """``{input name: value}`` of the op's tensors, in op order, taken from ``scope`` (a
    function's ``locals()`` whose parameters carry the op's names)."""
    return {name: scope[name] for name in op.input_names}


def op_args(op: OpSpec, scope: Mapping[str, Any]) -> dict[str, Any]:
    """``{name: value}`` of every Python argument of the op (:func:`arg_names`), taken
    from ``scope``; pass it on as keywords."""
    return {name: scope[name] for name in arg_names(op)}


def op_attributes(op: OpSpec, scope: Mapping[str, Any]) -> dict[str, Any]:
    """``{attribute name: value}`` of the op's attributes (``alias_io`` included) taken
    from ``scope``, leaving out those that are None (not set: the model's default)."""
    return {a.name: scope[a.name] for a in op.attributes if scope[a.name] is not None}


def index_inputs(op: OpSpec) -> tuple[str, ...]:
    """The op's index inputs (int32 / int64 only), whose values the value rules read."""
    return tuple(t.name for t in op.inputs if set(t.dtypes) <= {"int32", "int64"})


def python_default(attr: AttrSpec) -> Any:
    """The Python default of an attribute: None where the model's default is "" (not
    set), else the model's default."""
    return None if attr.default == "" else attr.default


def signature(op: OpSpec, **options: Any) -> inspect.Signature:
    """The Python signature of the op, from its spec: the inputs up to the last required
    one positional, every later input keyword-only with default None, the attributes
    keyword-only with :func:`python_default`, then ``options`` (name=default),
    keyword-only."""
    required = [i for i, t in enumerate(op.inputs) if not t.optional]
    n_positional = required[-1] + 1 if required else 0
    pos, kw = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter(t.name, pos) for t in op.inputs[:n_positional]]
    params += [inspect.Parameter(t.name, kw, default=None) for t in op.inputs[n_positional:]]
    params += [
        inspect.Parameter(a.name, kw, default=python_default(a))
        for a in op.attributes
        if a.name not in GRAPH_ONLY_ATTRIBUTES
    ]
    params += [inspect.Parameter(name, kw, default=d) for name, d in options.items()]
    return inspect.Signature(params)


R = TypeVar("R")


def op_call(
    op: OpSpec, **options: Any
) -> Callable[[Callable[[dict[str, Any]], R]], Callable[..., R]]:
    """Give a function that takes one ``{argument name: value}`` dict the op's Python
    signature (:func:`signature` with ``options``): callers pass the arguments as to any
    function, the function receives them bound, defaults applied, in signature order.
    Used by the functions that take exactly the op's arguments plus options
    (``validate_*``, ``pytrt_kv.ops.prepare_*``), so that none spells the list again."""
    sig = signature(op, **options)

    def decorate(fn: Callable[[dict[str, Any]], R]) -> Callable[..., R]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> R:
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError as exc:
                raise TypeError(f"{fn.__name__}(): {exc}") from None
            bound.apply_defaults()
            return fn(dict(bound.arguments))

        call.__signature__ = sig  # type: ignore[attr-defined]  # read by inspect.signature
        return call

    return decorate
