"""Valid random feeds for models whose inputs follow the docs/SPEC.md O names.

The one valid-input generator for a model: tests, examples, ``pytrt-kv demo``, the
harness case maker (plugins/harness/makeCases.py) and Polygraphy's data loader
(:mod:`pytrt_kv.polygraphy.data_loader`) all draw from it. Kernel-level generators
without a model (the benchmark, scripts/gpu_workload.py) keep their own; why:
docs/GRAPH_MODE.md (Valid feeds).

Random index inputs are invalid for our ops (duplicate slots, out-of-range block ids,
corrupted status rows), so generic random feeds cannot drive them.

:func:`make_feeds` is pure: its result depends on its arguments only (the model, the
seed, the shapes of dynamic inputs), never on ``sys.argv`` or the environment. Reading
Polygraphy's command line and the ``PYTRT_KV_*`` variables is the job of the Polygraphy
data loader (:mod:`pytrt_kv.polygraphy.data_loader`), which passes what it read as
arguments. Decision recorded in docs/GRAPH_MODE.md (Valid feeds).

What the feeds satisfy (docs/SPEC.md S6, S7, G2-G5):

- ``slot_mapping``: unique slots (some -1 padding); with ``full_kv_block_table`` and
  ``full_kv_actual_seq`` present, the slot of this step's token s of batch b is position
  ``kv_len - S + s`` of b's block table (a decode step);
- compressing writes: ``seq_lens``/``compress_lens``/``compress_seq_offsets`` within their
  constraints, each (b, h) run in its own rows;
- ``full_kv_block_table``: in-range, private blocks per batch;
- ``selection_kv_block_table``: private selection blocks per used row;
- ``selection_topk_indices``: distinct valid ids per row (some reused from the old status,
  padding -1 anywhere); ``selection_kv_block_status``: fresh (-1) or a valid previous state;
- ``full_q_actual_seq``: cumulative query counts; every other input random, never zeros.
- A model step over a paged cache (docs/LLAMA.md: graph inputs ``block_tables [B, W]``,
  ``slot_mapping``, ``positions``, and ``seq_lens [B]`` (decode, one token per sequence)
  or ``token_batch`` / ``last_token`` (a prefill of flattened prompts)): private pages per
  sequence, a random length per sequence within its W pages, each token at its position
  of its sequence and its slot in its page; ``input_ids`` index the embedding table they
  gather from (``[0, V)``).

A model the loader cannot serve is refused with a ValueError naming the input: an index
input of a pytrt_kv node whose graph input has another name than the op input it feeds
(the loader would otherwise fill it with random, invalid values), an input the loader
needs that the graph does not have, or sizes that leave no room for valid data.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..contract import dtypes
from . import feeds_gather, feeds_scatter
from .feeds_common import INDEX_PORTS, Shape, check_index_inputs, our_nodes, random_feed

#: The names data_loader.py re-exports (scripts written against it may use them).
_our_nodes = our_nodes

__all__ = [
    "DEFAULT_DYNAMIC_DIM",
    "DEFAULT_MAX_BYTES",
    "INDEX_PORTS",
    "feed_bytes",
    "load_model",
    "make_feeds",
    "resolve_shapes",
]


#: Polygraphy's DEFAULT_SHAPE_VALUE: a dynamic dim nobody gave a value for.
DEFAULT_DYNAMIC_DIM = 1

#: make_feeds refuses feeds larger than this in all (8 GiB; docs/GRAPH_MODE.md).
DEFAULT_MAX_BYTES = 8 * 2**30

# --- the model and its inputs ---------------------------------------------------------


def load_model(model: Any):
    """``model`` as an onnx.ModelProto: returned as is, or loaded (graph only, no
    weights) from a path."""
    import onnx

    if isinstance(model, onnx.ModelProto):
        return model
    if not isinstance(model, (str, Path)) and not hasattr(model, "__fspath__"):
        raise TypeError(
            f"model: expected an onnx.ModelProto or a path to an .onnx file, "
            f"got {type(model).__name__}"
        )
    path = Path(model)
    if not path.is_file():
        raise FileNotFoundError(f"model: expected an .onnx file, got {str(path)!r} (no such file)")
    return onnx.load(str(path), load_external_data=False)  # the graph is enough: no weights


def feed_bytes(info: Mapping[str, tuple[Shape, np.dtype]]) -> dict[str, int]:
    """Bytes of each input's feed array."""
    return {n: math.prod(int(x) for x in sh) * np.dtype(d).itemsize for n, (sh, d) in info.items()}


def _check_size(info: Mapping[str, tuple[Shape, np.dtype]], max_bytes: int) -> None:
    """Refuse feeds larger than ``max_bytes`` in all, naming the largest input, before
    anything is allocated (a model may declare a cache far larger than the host)."""
    sizes = feed_bytes(info)
    total = sum(sizes.values())
    if total > max_bytes:
        name = max(sizes, key=lambda n: sizes[n])
        shape, dtype = info[name]
        raise ValueError(
            f"{name}: expected the feeds to fit in max_bytes = {_human(max_bytes)} in all, "
            f"got {np.dtype(dtype).name}{list(shape)} = {_human(sizes[name])} for this input "
            f"({_human(total)} for all inputs); give smaller shapes or a larger max_bytes"
        )


def _human(n: int) -> str:
    """``1099511627776`` -> ``"1099511627776 bytes (1 TiB)"``."""
    unit = max((u for u in range(5) if n >= 1024**u), default=0)
    return f"{n} bytes ({n / 1024**unit:.4g} {['B', 'KiB', 'MiB', 'GiB', 'TiB'][unit]})"


def graph_inputs(model) -> dict[str, tuple[list[Any], int]]:
    """The graph inputs of ``model`` that are not initializers, in order: dims (an int, or
    the dim's name / None when dynamic) and the ONNX element type."""
    inits = {i.name for i in model.graph.initializer}
    out = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        dims = [
            d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim
        ]
        out[vi.name] = (dims, tt.elem_type)
    return out


def _declared(model) -> dict[str, tuple[list[Any], np.dtype]]:
    """Graph inputs (initializers excluded): dims (int, or str/None when dynamic), dtype."""
    return {
        name: (dims, dtypes.numpy_of_onnx(elem, name))
        for name, (dims, elem) in graph_inputs(model).items()
    }


def resolve_shapes(
    model, shapes: Mapping[str, Sequence[int]] | None = None
) -> dict[str, tuple[Shape, np.dtype]]:
    """Concrete shape and dtype of every graph input (see the module docstring).

    Parameters
    ----------
    model : onnx.ModelProto
    shapes : mapping input name -> shape, optional
        Shapes of inputs with dynamic dims; default none: a dynamic dim nobody gave
        takes :data:`DEFAULT_DYNAMIC_DIM`.

    Raises
    ------
    ValueError
        A given shape names no graph input, has another rank, or contradicts a static
        dim or another binding of the same symbolic dim.
    """
    declared = _declared(model)
    if shapes is None:
        shapes = {}
    bound: dict[str, tuple[int, str]] = {}
    given: dict[str, Shape] = {}
    for name, shape in shapes.items():
        if name not in declared:
            raise ValueError(
                f"input shapes: {name!r} is not a graph input; expected one of {sorted(declared)}"
            )
        dims, _ = declared[name]
        shape = tuple(int(d) for d in shape)
        if len(shape) != len(dims):
            raise ValueError(
                f"{name}: expected a shape of rank {len(dims)} {dims}, got "
                f"{list(shape)} from the input shapes"
            )
        for axis, (d, n) in enumerate(zip(dims, shape)):
            if n < 0:
                raise ValueError(f"{name}: expected dims >= 0, got {list(shape)}")
            if isinstance(d, int) and d != n:
                raise ValueError(
                    f"{name}: expected dim {axis} = {d} (static in the model), "
                    f"got {list(shape)} from the input shapes"
                )
            if isinstance(d, str):
                prev = bound.setdefault(d, (n, name))
                if prev[0] != n:
                    raise ValueError(
                        f"{name}: expected dim {axis} = {d} = {prev[0]} (as in {prev[1]}), got {n}"
                    )
        given[name] = shape
    out: dict[str, tuple[Shape, np.dtype]] = {}
    for name, (dims, dt) in declared.items():
        if name in given:
            out[name] = (given[name], dt)
            continue
        out[name] = (
            tuple(
                d
                if isinstance(d, int)
                else bound.get(d, (DEFAULT_DYNAMIC_DIM, ""))[0]
                if isinstance(d, str)
                else DEFAULT_DYNAMIC_DIM
                for d in dims
            ),
            dt,
        )
    return out


# --- feeds ----------------------------------------------------------------------------


def make_feeds(
    model: Any,
    seed: int = 0,
    shapes: Mapping[str, Sequence[int]] | None = None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> dict[str, np.ndarray]:
    """One valid feed dict for ``model``; see the module docstring.

    Pure: the same arguments give the same feeds; nothing is read from the command line
    or the environment.

    Parameters
    ----------
    model : onnx.ModelProto or path
    seed : int
    shapes : mapping input name -> shape, optional
        Shapes of inputs with dynamic dims (see :func:`resolve_shapes`).
    max_bytes : int
        Feeds larger than this in all are refused before anything is allocated.

    Raises
    ------
    ValueError
        The loader cannot serve the model: an index input under another name, an input
        it needs missing, or sizes that leave no room for valid data; the message names
        the input; feeds larger than ``max_bytes`` (the message names the largest input
        and its size).
    """
    model = load_model(model)
    info = resolve_shapes(model, shapes)
    _check_size(info, max_bytes)
    rng = np.random.default_rng(seed)
    check_index_inputs(model, info)
    feeds: dict[str, np.ndarray] = {}

    # The query geometry and the full cache's table first: both ops' index feeds agree with
    # them (the draws from rng keep this order, so a seed gives the same feeds).
    B, S, K = feeds_gather.query_geometry(info)
    B, S, table, kv_len = feeds_gather.full_table(info, rng, B, S, feeds)
    B = feeds_gather.q_actual_seq(info, B, S, feeds)
    feeds.update(feeds_scatter.scatter_indices(model, info, rng, table, kv_len, B, S))
    feeds.update(feeds_gather.gather_indices(model, info, rng, B, S, K, kv_len))
    feeds.update(feeds_scatter.scales(model, info, rng, feeds))
    for n, (sh, d) in info.items():
        if n not in feeds:
            feeds[n] = random_feed(rng, sh, d)
    return {n: feeds[n] for n in info}
