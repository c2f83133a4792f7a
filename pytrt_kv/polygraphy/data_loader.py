"""Polygraphy data loader: valid random feeds (:mod:`pytrt_kv.graph.feeds`) per iteration.

Polygraphy imports this file as a standalone script, so it uses absolute imports only.

Random index inputs are invalid for our ops (duplicate slots, out-of-range block ids,
corrupted status rows), so Polygraphy's default data loader cannot drive them. Use::

    polygraphy run model.onnx --pytrt-kv-ref --data-loader-script \\
        $(python3 -c "import pytrt_kv.polygraphy.data_loader as m; print(m.__file__)")

``load_data()`` finds the model in this order: its ``model`` argument, the
``PYTRT_KV_MODEL`` environment variable, the first ``*.onnx`` path on the command line
(which is where ``polygraphy run m.onnx ...`` puts it).

This module is the only place where the command line and the environment are read:
:func:`make_feeds` is pure, and :func:`load_data` hands it what it read as arguments.
Options of the Polygraphy command line are honoured (an argument of :func:`load_data`
wins over them, and they win over the environment; a bad value is a ValueError naming
the option or the variable):

- ``--seed N``: base seed (else ``$PYTRT_KV_SEED``, else 0); iteration i uses seed + i,
  so every runner of one Polygraphy invocation sees the same data;
- ``--iterations N`` / ``--iters N``: feed dicts to yield (else
  ``$PYTRT_KV_ITERATIONS``, else 3);
- ``--input-shapes name:[d0,d1,...] ...`` (alias ``--inputs``), else the opt shapes of
  the first ``--trt-opt-shapes`` profile: the shapes of inputs with dynamic dims. A
  symbolic dim takes one value everywhere (``--input-shapes kv:[3,1,64]`` sets every
  ``batch`` dim when kv is ``[batch, 1, 64]``); a dynamic dim given by neither takes
  Polygraphy's default shape value, 1;
- ``$PYTRT_KV_MAX_BYTES``: the most bytes one feed dict may take (default
  :data:`pytrt_kv.graph.feeds.DEFAULT_MAX_BYTES`, 8 GiB); a model declaring larger
  inputs is refused with a ValueError naming the largest input and its size.

What the feeds satisfy, and which models are refused (a ValueError naming the input):
:mod:`pytrt_kv.graph.feeds`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

# Re-exported: the names this module had before the generator moved to the graph layer.
from pytrt_kv.graph.feeds import (
    DEFAULT_DYNAMIC_DIM,
    DEFAULT_MAX_BYTES,
    INDEX_PORTS,
    _our_nodes,
    load_model,
    make_feeds,
    resolve_shapes,
)

__all__ = [
    "load_data",
    "make_feeds",
    "resolve_shapes",
    "polygraphy_options",
    "INDEX_PORTS",
    "DEFAULT_DYNAMIC_DIM",
    "_our_nodes",
]

Shape = tuple[int, ...]


def _model(model: Any):
    """The model argument, else ``$PYTRT_KV_MODEL``, else the first existing ``*.onnx``
    path on the command line; loaded with :func:`pytrt_kv.graph.feeds.load_model`."""
    if model is None:
        model = os.environ.get("PYTRT_KV_MODEL") or None
    if model is None:
        model = next((a for a in sys.argv[1:] if a.endswith(".onnx") and os.path.exists(a)), None)
    if model is None:
        raise ValueError(
            "model: expected an onnx model (argument, $PYTRT_KV_MODEL or an "
            "*.onnx path on the command line), got none"
        )
    return load_model(model)


def _parse_shape_args(values: Sequence[str] | None) -> dict[str, Shape]:
    """``["kv:[3,1,64]", "x:[2]"]`` -> {"kv": (3, 1, 64), "x": (2,)}; non-shape tokens
    (such as a model path swallowed by ``nargs='+'``) are skipped."""
    out: dict[str, Shape] = {}
    for item in values or ():
        name, sep, dims = item.rpartition(":")
        dims = dims.strip()
        if not sep or not name or not (dims.startswith("[") and dims.endswith("]")):
            continue
        body = dims[1:-1].replace(" ", "")
        try:
            out[name] = tuple(int(d) for d in body.split(",") if d != "")
        except ValueError:
            raise ValueError(
                f"--input-shapes {item}: expected name:[d0,d1,...] with integer dims, got {dims!r}"
            ) from None
    return out


def polygraphy_options(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The Polygraphy options the loader honours, read from ``argv`` (default
    ``sys.argv``): ``seed``, ``iterations`` (None when absent) and ``shapes``
    (``--input-shapes``, else the first ``--trt-opt-shapes`` profile)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--seed", default=None)
    parser.add_argument("--iterations", "--iters", default=None, dest="iterations")
    parser.add_argument(
        "--input-shapes", "--inputs", nargs="+", action="append", dest="shapes", default=None
    )
    parser.add_argument("--trt-opt-shapes", nargs="+", action="append", dest="opt", default=None)
    args, _ = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    shapes = _parse_shape_args([x for group in args.shapes or [] for x in group])
    if not shapes and args.opt:
        shapes = _parse_shape_args(args.opt[0])
    return {
        "seed": _integer("--seed", args.seed, 0, "an integer >= 0"),
        "iterations": _integer("--iterations", args.iterations, 1, "a positive integer"),
        "shapes": shapes,
    }


def _integer(name: str, raw: Any, low: int, what: str) -> int | None:
    """``raw`` (None, an int or a string from the command line or the environment) as an
    int >= ``low``; a ValueError naming ``name`` otherwise."""
    if raw is None:
        return None
    if isinstance(raw, bool):
        raise ValueError(f"{name}: expected {what}, got {raw!r}")
    try:
        value = int(raw.strip()) if isinstance(raw, str) else int(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected {what}, got {raw!r}") from None
    if value < low:
        raise ValueError(f"{name}: expected {what}, got {raw!r}")
    return value


def _env_integer(var: str, low: int, what: str) -> int | None:
    raw = os.environ.get(var)
    return None if raw is None or raw == "" else _integer(var, raw, low, what)


def _setting(
    name: str, given: Any, options: Mapping[str, Any], low: int, what: str, default: int
) -> int:
    """The integer setting ``name``: the argument ``given``, else Polygraphy's option
    ``options[name]``, else ``$PYTRT_KV_<NAME>``, else ``default``; each an int >= ``low``
    (a ValueError naming the source otherwise). Later sources are read only when needed."""
    value = _integer(name, given, low, what)
    if value is None:
        value = options[name]
    if value is None:
        value = _env_integer(f"PYTRT_KV_{name.upper()}", low, what)
    return default if value is None else value


def load_data(
    model: str | os.PathLike | Any | None = None,
    iterations: int | None = None,
    seed: int | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """Yield valid feed dicts (Polygraphy ``--data-loader-script`` entry).

    Parameters
    ----------
    model : ModelProto or path, optional
        Default: ``$PYTRT_KV_MODEL``, else the first ``*.onnx`` argument of the command line.
    iterations : int, optional
        Feed dicts to yield; default Polygraphy's ``--iterations``, else
        ``$PYTRT_KV_ITERATIONS``, else 3.
    seed : int, optional
        Base seed; default Polygraphy's ``--seed``, else ``$PYTRT_KV_SEED``, else 0.
        Iteration i uses ``seed + i``.
    shapes : mapping input name -> shape, optional
        Shapes of inputs with dynamic dims; default Polygraphy's ``--input-shapes`` (or
        the first ``--trt-opt-shapes`` profile).

    Raises
    ------
    ValueError
        A bad option or variable (the message names it), or a model
        :func:`make_feeds` cannot serve.
    """
    model = _model(model)
    options = polygraphy_options()
    iterations = _setting("iterations", iterations, options, 1, "a positive integer", 3)
    seed = _setting("seed", seed, options, 0, "an integer >= 0", 0)
    if shapes is None:
        shapes = options["shapes"]
    max_bytes = _env_integer("PYTRT_KV_MAX_BYTES", 1, "a positive integer (bytes)")
    if max_bytes is None:
        max_bytes = DEFAULT_MAX_BYTES
    for i in range(iterations):
        yield make_feeds(model, seed + i, shapes, max_bytes=max_bytes)
