"""One description of each op's Python arguments: its :class:`~.specs.OpSpec`.

The Python functions of an op (the reference, :mod:`pytrt_kv.ops`, the contract's
``check_*`` / ``validate_*``) take the op's tensors in the op's input order, then its
attributes (``alias_io`` excepted: it is a graph-only choice), all under the names of
docs/SPEC.md. Instead of spelling the list out again at every call, each function hands
its arguments on with :func:`op_args` / :func:`op_tensors`;
``tests/test_op_args.py`` checks every such signature against the spec, so the spec
stays the one list (the ONNX schemas, the C++ header and the plugins read it too).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .specs import OpSpec

__all__ = ["GRAPH_ONLY_ATTRIBUTES", "arg_names", "op_args", "op_tensors"]

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
