"""What every kind of feed reads (:mod:`pytrt_kv.graph.feeds`): the model's pytrt_kv
nodes and their attributes, the graph inputs it needs, random data for the rest."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..contract import dtypes, specs
from ..contract.args import index_inputs
from ..contract.errors import value_error

_FLOAT = {specs.FLOAT32, specs.FLOAT16, specs.BFLOAT16, specs.FLOAT8_E4M3, specs.FLOAT8_E5M2}

#: Inputs of our ops whose values must satisfy the value rules (docs/SPEC.md S7, G4, G5).
INDEX_PORTS = {op.name: index_inputs(op) for op in specs.OPS.values()}

Shape = tuple[int, ...]


def our_nodes(model) -> list[tuple[Any, specs.OpSpec, dict[str, str]]]:
    """(node, op, {op input name: graph tensor}) of every pytrt_kv node."""
    out = []
    for node in model.graph.node:
        if node.domain == specs.DOMAIN and node.op_type in specs.OPS:
            op = specs.OPS[node.op_type]
            ports = {
                t.name: node.input[i]
                for i, t in enumerate(op.inputs)
                if i < len(node.input) and node.input[i]
            }
            out.append((node, op, ports))
    return out


def check_index_inputs(model, info: Mapping[str, Any]) -> None:
    """Refuse an index input the loader would fill randomly (see the module docstring)."""
    for node, op, ports in our_nodes(model):
        for port in INDEX_PORTS[op.name]:
            tensor = ports.get(port)
            if tensor is not None and tensor in info and tensor != port:
                raise ValueError(
                    f"{tensor}: expected the graph input to be named {port!r}, the input of "
                    f"node {node.name or op.name!r} ({op.name}) it feeds, so that the data "
                    f"loader can make valid values for it; got the name {tensor!r}. Rename "
                    f"it, or feed the model with data of your own (--load-inputs)"
                )


def node_attr(model, op_type: str, name: str, default):
    from onnx import helper

    for node in model.graph.node:
        if node.domain == specs.DOMAIN and node.op_type == op_type:
            for a in node.attribute:
                if a.name == name:
                    v = helper.get_attribute_value(a)
                    return v.decode() if isinstance(v, bytes) else v
            return default
    return default


def random_feed(rng: np.random.Generator, shape, dtype: np.dtype) -> np.ndarray:
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return rng.random(shape) < 0.5
    try:
        name = dtypes.name_of(dt)
    except TypeError:
        name = None
    if name in _FLOAT or np.issubdtype(dt, np.floating):
        x = rng.standard_normal(shape, dtype=np.float32)
        # Keep exact zeros out: "untouched" checks compare against the old contents.
        x = np.where(x == 0, np.float32(0.5), x)
        return x.astype(dt)
    info = np.iinfo(dt)
    lo, hi = max(info.min, -100), min(info.max, 100)
    x = rng.integers(lo, hi + 1, size=shape)
    x = np.where(x == 0, 1, x)
    return x.astype(dt)


def need(info: Mapping[str, Any], name: str, why: str) -> tuple[Shape, np.dtype]:
    if name not in info:
        raise ValueError(
            f"{name}: expected a graph input named {name!r} ({why}), got none: "
            f"the model computes it or names it differently; feed the model "
            f"with data of your own (--load-inputs)"
        )
    return info[name]


def at_least(name: str, what: str, value: int, low: int, shape: Shape) -> int:
    if value < low:
        raise value_error(name, f"{what} >= {low}", f"{value} (shape {list(shape)})")
    return value
