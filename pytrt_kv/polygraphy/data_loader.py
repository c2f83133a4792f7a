"""Polygraphy data loader: valid random feeds (:mod:`pytrt_kv.graph.feeds`) per iteration.

Polygraphy imports this file as a standalone script, so it uses absolute imports only.

Random index inputs are invalid for our ops (duplicate slots, out-of-range block ids,
corrupted status rows), so Polygraphy's default data loader cannot drive them. Use::

    polygraphy run model.onnx --pytrt-kv-ref --data-loader-script \\
        $(python3 -c "import pytrt_kv.polygraphy.data_loader as m; print(m.__file__)")

``load_data()`` finds the model in this order: its ``model`` argument, the
``PYTRT_KV_MODEL`` environment variable, the first ``*.onnx`` path on the command line
(which is where ``polygraphy run m.onnx ...`` puts it).

Options of the Polygraphy command line are honoured (an argument of :func:`load_data` or
:func:`make_feeds` wins over them, and they win over the environment):

- ``--seed N``: base seed (else ``$PYTRT_KV_SEED``, else 0); iteration i uses seed + i,
  so every runner of one Polygraphy invocation sees the same data;
- ``--iterations N`` / ``--iters N``: feed dicts to yield (else
  ``$PYTRT_KV_ITERATIONS``, else 3);
- ``--input-shapes name:[d0,d1,...] ...`` (alias ``--inputs``), else the opt shapes of
  the first ``--trt-opt-shapes`` profile: the shapes of inputs with dynamic dims. A
  symbolic dim takes one value everywhere (``--input-shapes kv:[3,1,64]`` sets every
  ``batch`` dim when kv is ``[batch, 1, 64]``); a dynamic dim given by neither takes
  Polygraphy's default shape value, 1.

What the feeds satisfy, and which models are refused (a ValueError naming the input):
:mod:`pytrt_kv.graph.feeds`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

# Re-exported: the names this module had before the generator moved to the graph layer.
from pytrt_kv.graph.feeds import (
    DEFAULT_DYNAMIC_DIM,
    INDEX_PORTS,
    _model,
    _our_nodes,
    make_feeds,
    polygraphy_options,
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
    """
    model = _model(model)
    options = polygraphy_options()
    if iterations is None:
        iterations = options["iterations"]
    if iterations is None:
        iterations = int(os.environ.get("PYTRT_KV_ITERATIONS", 3))
    if seed is None:
        seed = options["seed"]
    if seed is None:
        seed = int(os.environ.get("PYTRT_KV_SEED", 0))
    if shapes is None:
        shapes = options["shapes"]
    for i in range(iterations):
        yield make_feeds(model, seed + i, shapes)
