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

from ..contract import dtypes, specs
from ..contract.errors import value_error
from ..contract.layouts import LAYOUTS

_FLOAT = {specs.FLOAT32, specs.FLOAT16, specs.BFLOAT16, specs.FLOAT8_E4M3, specs.FLOAT8_E5M2}

#: Polygraphy's DEFAULT_SHAPE_VALUE: a dynamic dim nobody gave a value for.
DEFAULT_DYNAMIC_DIM = 1

#: make_feeds refuses feeds larger than this in all (8 GiB; docs/GRAPH_MODE.md).
DEFAULT_MAX_BYTES = 8 * 2**30

#: Inputs of our ops whose values must satisfy the value rules (docs/SPEC.md S7, G4, G5).
INDEX_PORTS = {
    specs.SCATTER_PA_KV_CACHE.name: (
        "slot_mapping",
        "compress_lens",
        "compress_seq_offsets",
        "seq_lens",
    ),
    specs.GATHER_SELECTION_KV_CACHE.name: (
        "selection_kv_block_table",
        "selection_kv_block_status",
        "selection_topk_indices",
        "full_kv_block_table",
        "full_kv_actual_seq",
        "full_q_actual_seq",
    ),
}

Shape = tuple[int, ...]


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


def _declared(model) -> dict[str, tuple[list[Any], np.dtype]]:
    """Graph inputs (initializers excluded): dims (int, or str/None when dynamic), dtype."""
    inits = {i.name for i in model.graph.initializer}
    out = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        dims = [
            d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim
        ]
        out[vi.name] = (dims, dtypes.numpy_of_onnx(tt.elem_type, vi.name))
    return out


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


def _our_nodes(model) -> list[tuple[Any, specs.OpSpec, dict[str, str]]]:
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


def _check_index_inputs(model, info: Mapping[str, Any]) -> None:
    """Refuse an index input the loader would fill randomly (see the module docstring)."""
    for node, op, ports in _our_nodes(model):
        for port in INDEX_PORTS[op.name]:
            tensor = ports.get(port)
            if tensor is not None and tensor in info and tensor != port:
                raise ValueError(
                    f"{tensor}: expected the graph input to be named {port!r}, the input of "
                    f"node {node.name or op.name!r} ({op.name}) it feeds, so that the data "
                    f"loader can make valid values for it; got the name {tensor!r}. Rename "
                    f"it, or feed the model with data of your own (--load-inputs)"
                )


def _node_attr(model, op_type: str, name: str, default):
    from onnx import helper

    for node in model.graph.node:
        if node.domain == specs.DOMAIN and node.op_type == op_type:
            for a in node.attribute:
                if a.name == name:
                    v = helper.get_attribute_value(a)
                    return v.decode() if isinstance(v, bytes) else v
            return default
    return default


def _random(rng: np.random.Generator, shape, dtype: np.dtype) -> np.ndarray:
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


def _need(info: Mapping[str, Any], name: str, why: str) -> tuple[Shape, np.dtype]:
    if name not in info:
        raise ValueError(
            f"{name}: expected a graph input named {name!r} ({why}), got none: "
            f"the model computes it or names it differently; feed the model "
            f"with data of your own (--load-inputs)"
        )
    return info[name]


def _at_least(name: str, what: str, value: int, low: int, shape: Shape) -> int:
    if value < low:
        raise value_error(name, f"{what} >= {low}", f"{value} (shape {list(shape)})")
    return value


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
    _check_index_inputs(model, info)
    feeds: dict[str, np.ndarray] = {}

    def shape(n):
        return info[n][0]

    def dt(n):
        return info[n][1]

    # --- geometry shared by both ops ------------------------------------------------
    B = S = K = None
    if "selection_kv_block_status" in info or "selection_topk_indices" in info:
        ref = (
            "selection_kv_block_status"
            if "selection_kv_block_status" in info
            else "selection_topk_indices"
        )
        sh = shape(ref)
        if len(sh) not in (3, 4):
            raise value_error(ref, "BSND [B, S, 1, *] or TND [B*S, 1, *]", list(sh))
        K = sh[-1] - 1 if ref == "selection_kv_block_status" else sh[-1]
        _at_least(ref, "K (last dim" + (" - 1)" if ref.endswith("status") else ")"), K, 1, sh)
        if "full_kv_actual_seq" in info:
            B = _at_least(
                "full_kv_actual_seq",
                "B",
                shape("full_kv_actual_seq")[0],
                1,
                shape("full_kv_actual_seq"),
            )
        if len(sh) == 4:
            if B is not None and sh[0] != B:
                raise value_error(ref, f"B = {B} (of full_kv_actual_seq) as dim 0", list(sh))
            B, S = _at_least(ref, "B", sh[0], 1, sh), _at_least(ref, "S", sh[1], 1, sh)
        else:
            B = B or _at_least(ref, "T", sh[0], 1, sh)
            if sh[0] % B or sh[0] == 0:
                raise value_error(ref, f"TND T = B*S with B = {B}, S >= 1", list(sh))
            S = sh[0] // B
    elif "full_kv_actual_seq" in info:
        B, S = shape("full_kv_actual_seq")[0], 1
        _at_least("full_kv_actual_seq", "B", B, 1, shape("full_kv_actual_seq"))
    kv_len = table = None
    if "full_kv_block_table" in info:
        fshape, _ = _need(info, "full_kv_cache", "its dims 0 and 1 size full_kv_block_table")
        if len(fshape) < 2:
            raise value_error("full_kv_cache", "[F_BLOCK_NUM, FBS, ...]", list(fshape))
        fnb, fbs = fshape[:2]
        _at_least("full_kv_cache", "FBS (dim 1)", fbs, 1, fshape)
        tshape = shape("full_kv_block_table")
        if len(tshape) != 2:
            raise value_error("full_kv_block_table", "[B, F_MAX_BLOCK_NUM]", list(tshape))
        B = B or _at_least("full_kv_block_table", "B", tshape[0], 1, tshape)
        fmax = _at_least("full_kv_block_table", "F_MAX_BLOCK_NUM", tshape[1], 1, tshape)
        if B * fmax > fnb:
            # Shared blocks would make two batches' tokens collide (duplicate slots, S7).
            raise value_error(
                "full_kv_cache",
                f"at least B*F_MAX_BLOCK_NUM = {B * fmax} blocks "
                "so every batch gets private blocks",
                f"{fnb} blocks",
            )
        table = rng.permutation(fnb)[: B * fmax].reshape(B, fmax)
        feeds["full_kv_block_table"] = table.astype(dt("full_kv_block_table"))
        S = S or 1
        cap = fmax * fbs
        if cap < S:
            raise value_error(
                "full_kv_block_table",
                f"room for S = {S} tokens per batch (F_MAX_BLOCK_NUM * FBS >= S)",
                f"{fmax} * {fbs} = {cap}",
            )
        kv_len = rng.integers(S, cap + 1, size=B)
        if B > 1:
            kv_len[rng.integers(B)] = cap  # the full table is exercised every time
        if "full_kv_actual_seq" in info:
            feeds["full_kv_actual_seq"] = kv_len.astype(dt("full_kv_actual_seq"))
    if "full_q_actual_seq" in info:
        if B is None:
            B = _at_least(
                "full_q_actual_seq",
                "B",
                shape("full_q_actual_seq")[0],
                1,
                shape("full_q_actual_seq"),
            )
        feeds["full_q_actual_seq"] = (np.arange(1, B + 1) * (S or 1)).astype(
            dt("full_q_actual_seq")
        )

    # --- ScatterPaKvCache ------------------------------------------------------------
    if "block_tables" in info and "slot_mapping" in info:
        feeds.update(_paged_step(model, info, rng))
    elif "slot_mapping" in info:
        feeds.update(_scatter_indices(model, info, rng, table, kv_len, B, S))
    for name in ("compress_lens", "compress_seq_offsets", "seq_lens"):
        if name in info and name not in feeds:
            raise value_error(
                name,
                "slot_mapping as a graph input too (the runs are made together)",
                "no slot_mapping",
            )

    # --- GatherSelectionKvCache -------------------------------------------------------
    for name in ("selection_kv_block_status", "selection_topk_indices", "selection_kv_block_table"):
        if name in info:
            if kv_len is None:
                _need(
                    info,
                    "full_kv_block_table",
                    f"the data loader derives the kv_len that {name} must agree with from it",
                )
            feeds.update(_gather_indices(model, info, rng, B, S, K, kv_len))
            break

    # docs/SPEC.md S9: quantisation scales (of every scatter node) are finite and > 0.
    for _, op, ports in _our_nodes(model):
        for arg in ("k_scale", "v_scale") if op is specs.SCATTER_PA_KV_CACHE else ():
            scale = ports.get(arg, "")
            if scale in info and scale not in feeds:
                sh, d = info[scale]
                feeds[scale] = rng.uniform(0.05, 2.0, size=tuple(sh)).astype(d)

    for n, (sh, d) in info.items():
        if n not in feeds:
            feeds[n] = _random(rng, sh, d)
    return {n: feeds[n] for n in info}


def _gathered_rows(model, name: str) -> int | None:
    """Rows of the initializer that graph input ``name`` indexes with ``Gather(axis=0)``
    (an embedding table for token ids), or None."""
    from onnx import helper  # noqa: PLC0415

    inits = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Gather" and len(node.input) == 2 and node.input[1] == name:
            axis = next((helper.get_attribute_value(a) for a in node.attribute
                         if a.name == "axis"), 0)  # fmt: skip
            if axis == 0 and node.input[0] in inits:
                return int(inits[node.input[0]].dims[0])
    return None


def _paged_step(model, info, rng) -> dict[str, np.ndarray]:
    """Feeds of one model step over a paged cache (module docstring; docs/LLAMA.md)."""
    ports = _scatter_node_ports(model)
    cache_name = ports.get("key_cache", "")
    cshape, _ = _need(info, cache_name, "its dims 0 and 1 (NB, BS) size the block tables")
    if len(cshape) != 4:
        raise value_error(cache_name, "a 4-D cache [NB, BS, H, D]", list(cshape))
    # BS is dim 1 of an nd cache [NB, BS, H, D] and dim 2 of an hnd [NB, H, BS, D] or nz
    # cache (docs/SPEC.md S2, contract/layouts.py); a node that leaves cache_layout empty is detected as the
    # ops detect it, never assumed nd (that would read H as BS).
    layout = _node_attr(model, specs.SCATTER_PA_KV_CACHE.name, "cache_layout", "") or (
        _scatter_layout(info, ports, cache_name)
    )
    nb, bs = LAYOUTS[layout].blocks(cshape)
    tshape, tdt = info["block_tables"]
    if len(tshape) != 2:
        raise value_error("block_tables", "[B, W]", list(tshape))
    B = _at_least("block_tables", "B", tshape[0], 1, tshape)
    W = _at_least("block_tables", "W", tshape[1], 1, tshape)
    if B * W > nb:
        raise value_error(
            cache_name, f"at least B*W = {B * W} pages so every sequence gets its own", f"{nb}"
        )
    tables = rng.permutation(nb)[: B * W].reshape(B, W)
    T = info["slot_mapping"][0][0]
    decode = "token_batch" not in info
    if decode:
        if T != B:
            raise value_error("slot_mapping", f"T = B = {B} (one token per sequence)", f"T = {T}")
        lens = rng.integers(1, W * bs + 1, size=B)
        batch = np.arange(B)
        positions = lens - 1
    else:
        if not B <= T <= B * W * bs:
            raise value_error(
                "token_batch", f"B <= T <= B*W*BS = {B * W * bs} prompt tokens", f"T = {T}"
            )
        # T tokens split into B prompts of 1..W*BS tokens each.
        lens = np.ones(B, np.int64)
        for _ in range(T - B):
            room = np.flatnonzero(lens < W * bs)
            lens[rng.choice(room)] += 1
        batch = np.repeat(np.arange(B), lens)
        positions = np.concatenate([np.arange(n) for n in lens])
    slots = tables[batch, positions // bs] * bs + positions % bs
    out = {
        "block_tables": tables.astype(tdt),
        "slot_mapping": slots.astype(info["slot_mapping"][1]),
    }
    for name, value in (
        ("positions", positions),
        ("seq_lens", lens),
        ("token_batch", batch),
        ("last_token", np.cumsum(lens) - 1),
    ):
        if name in info:
            out[name] = np.asarray(value).astype(info[name][1])
    if "input_ids" in info:
        rows = _gathered_rows(model, "input_ids") or 1000
        out["input_ids"] = rng.integers(0, rows, size=info["input_ids"][0]).astype(
            info["input_ids"][1]
        )
    return out


def _scatter_node_ports(model) -> dict[str, str]:
    for _, op, ports in _our_nodes(model):
        if op is specs.SCATTER_PA_KV_CACHE:
            return ports
    return {}


def _scatter_layout(info, ports: Mapping[str, str], cache_name: str) -> str:
    """cache_layout of a 3-D scatter node that leaves it empty: detected from the shapes as
    the ops detect it (docs/SPEC.md S2), so that BS is read from the right cache dim."""
    from types import SimpleNamespace  # noqa: PLC0415

    from ..contract.scatter import check_scatter  # noqa: PLC0415

    def stand(name: str):
        shape, dtype = info[name]
        return SimpleNamespace(shape=tuple(shape), dtype=np.dtype(dtype))

    key_name = ports.get("key", "")
    if key_name not in info:
        key_name = "key"
    _need(
        info,
        key_name,
        "the data loader detects cache_layout from its shape when the node does not set it",
    )
    value = value_cache = None  # a computed value: detect from the key cache alone
    if ports.get("value") in info and ports.get("value_cache") in info:
        value, value_cache = stand(ports["value"]), stand(ports["value_cache"])
    scales = {
        arg: stand(ports[arg]) if ports.get(arg) in info else None for arg in ("k_scale", "v_scale")
    }
    if value is None:
        scales["v_scale"] = None
    meta = check_scatter(
        stand(key_name),
        value,
        stand(cache_name),
        value_cache,
        stand("slot_mapping"),
        k_scale=scales["k_scale"],
        v_scale=scales["v_scale"],
    )
    return str(meta.layout)


def _scatter_indices(model, info, rng, table, kv_len, B, S) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    sm_shape, sm_dt = info["slot_mapping"]
    ports = _scatter_node_ports(model)
    cache_name = ports.get("key_cache", "")
    if cache_name not in info:
        cache_name = "key_cache" if "key_cache" in info else "full_kv_cache"
    cshape, _ = _need(
        info,
        cache_name,
        "the data loader sizes slot_mapping from the cache ScatterPaKvCache writes",
    )
    if len(cshape) != 4:
        raise value_error(cache_name, "a 4-D cache", list(cshape))
    if (
        len(sm_shape) == 1
        and table is not None
        and kv_len is not None
        and cache_name == "full_kv_cache"
    ):
        # A decode step writing the full cache: token t = b*S + s is position
        # kv_len[b] - S + s of batch b.
        fbs = cshape[1]
        T = sm_shape[0]
        if T != B * S:
            raise value_error(
                "slot_mapping",
                f"T = B*S = {B}*{S} = {B * S} tokens (one per "
                f"query token of each batch in a decode step)",
                f"T = {T}",
            )
        slots = np.empty(T, np.int64)
        for t in range(T):
            b, s = divmod(t, S)
            p = int(kv_len[b]) - S + s
            slots[t] = int(table[b, p // fbs]) * fbs + p % fbs
        out["slot_mapping"] = slots.astype(sm_dt)
        return out
    nb = cshape[0]
    if len(sm_shape) == 1:
        layout = _node_attr(model, "ScatterPaKvCache", "cache_layout", "") or _scatter_layout(
            info, ports, cache_name
        )
        bs = LAYOUTS[layout].blocks(cshape)[1]
        T = sm_shape[0]
        if T > nb * bs:
            raise ValueError(f"slot_mapping: expected at most NB*BS = {nb * bs} tokens, got {T}")
        slots = rng.permutation(nb * bs)[:T].astype(np.int64)
        slots[rng.random(T) < 0.2] = -1
        out["slot_mapping"] = slots.astype(sm_dt)
        return out
    if len(sm_shape) != 2:
        raise value_error("slot_mapping", "[T] or [B, H]", list(sm_shape))
    # Compressing write: slot_mapping [B, H], each (b, h) run gets Smax private rows.
    key_name = ports.get("key", "")
    if key_name not in info:
        key_name = "key"
    key_shape, _ = _need(info, key_name, "the data loader reads Smax from the 4-D key")
    if len(key_shape) != 4:
        raise value_error(
            key_name, "a 4-D key [B, Smax, H, Dk] with slot_mapping [B, H]", list(key_shape)
        )
    bs = cshape[1]
    Bk, H = sm_shape
    smax = _at_least(key_name, "Smax (dim 1)", key_shape[1], 1, key_shape)
    chunks = (nb * bs) // smax
    if chunks < Bk * H:
        raise ValueError(
            f"key_cache: expected room for B*H*Smax = {Bk * H * smax} rows, got NB*BS = {nb * bs}"
        )
    base = rng.permutation(chunks)[: Bk * H].reshape(Bk, H).astype(np.int64) * smax
    base[rng.random((Bk, H)) < 0.15] = -1
    seq = rng.integers(1, smax + 1, size=Bk)
    lens = np.zeros((Bk, H), np.int64)
    offs = np.zeros(Bk * H, np.int64)
    for b in range(Bk):
        for h in range(H):
            L = int(seq[b])
            w = int(rng.integers(0, L + 1))
            lens[b, h] = w
            offs[b * H + h] = -1 if rng.random() < 0.15 else int(rng.integers(0, L - w + 1))
    out["slot_mapping"] = base.astype(sm_dt)
    if "seq_lens" in info:
        out["seq_lens"] = seq.astype(info["seq_lens"][1])
    if "compress_lens" in info:
        out["compress_lens"] = lens.astype(info["compress_lens"][1])
    if "compress_seq_offsets" in info:
        out["compress_seq_offsets"] = offs.astype(info["compress_seq_offsets"][1])
    return out


def _gather_indices(model, info, rng, B, S, K, kv_len) -> dict[str, np.ndarray]:
    from ..reference import plan_row

    if K is None:
        _need(info, "selection_kv_block_status", "the data loader reads K from it")
    tbs = _node_attr(model, "GatherSelectionKvCache", "selection_topk_block_size", 64)
    if isinstance(tbs, bool) or not isinstance(tbs, int) or tbs < 1:
        raise value_error("selection_topk_block_size", "an int >= 1", repr(tbs))
    out: dict[str, np.ndarray] = {}
    cshape, _ = _need(info, "selection_kv_cache", "its dims 0 and 1 size the selection block table")
    tshape, _ = _need(
        info, "selection_kv_block_table", "the data loader writes private selection blocks into it"
    )
    if len(cshape) != 3 or len(tshape) != 2:
        bad, sh = (
            ("selection_kv_cache", cshape)
            if len(cshape) != 3
            else ("selection_kv_block_table", tshape)
        )
        raise value_error(bad, "a 3-D cache and a 2-D table", list(sh))
    snb, sbs = cshape[:2]
    _at_least("selection_kv_cache", "SBS (dim 1)", sbs, 1, cshape)
    R, smax = tshape
    need = -(-K * tbs // sbs)
    rows = B * S
    if R < rows or smax < need:
        raise value_error(
            "selection_kv_block_table",
            f"[R >= B*S = {rows}, S_MAX_BLOCK_NUM >= ceil(K*TBS/SBS) = {need}]",
            list(tshape),
        )
    if rows * need > snb:
        raise ValueError(
            f"selection_kv_cache: expected at least rows*ceil(K*TBS/SBS) = "
            f"{rows * need} blocks for private selection rows, got {snb}"
        )
    sel = rng.integers(0, snb, size=(R, smax))
    sel[:rows, :need] = rng.permutation(snb)[: rows * need].reshape(rows, need)
    out["selection_kv_block_table"] = sel.astype(np.int32)
    status = np.full((rows, K + 1), -1, np.int64)
    topk = np.full((rows, K), -1, np.int64)
    for r in range(rows):
        b, s = divmod(r, S)
        eff = int(kv_len[b]) - (S - 1 - s)
        if eff <= 0:
            continue
        n_ids = -(-eff // tbs)
        old_ids: list = []
        if eff > 1 and rng.random() < 0.7:
            # A previous step's state (kv_len one shorter), planned like the op would.
            old_n_ids = -(-(eff - 1) // tbs)
            prev = rng.permutation(old_n_ids)[: int(rng.integers(1, min(K, old_n_ids) + 1))]
            prev_topk = np.full(K, -1, np.int64)
            prev_topk[rng.permutation(K)[: len(prev)]] = prev
            plan = plan_row([-1] * (K + 1), prev_topk.tolist(), int(kv_len[b]) - 1, S, s, tbs)
            status[r] = plan.status
            old_ids = [int(v) for v in plan.status[:K] if v >= 0]
        n = int(rng.integers(max(1, min(K, n_ids) // 2), min(K, n_ids) + 1))
        reuse = [v for v in old_ids if v < n_ids and rng.random() < 0.6][:n]
        rest = [int(v) for v in rng.permutation(n_ids) if int(v) not in reuse]
        ids = reuse + rest[: n - len(reuse)]
        ids = [ids[i] for i in rng.permutation(len(ids))]
        topk[r, np.sort(rng.permutation(K)[: len(ids)])] = ids
    if "selection_kv_block_status" in info:
        out["selection_kv_block_status"] = status.reshape(
            info["selection_kv_block_status"][0]
        ).astype(np.int32)
    if "selection_topk_indices" in info:
        out["selection_topk_indices"] = topk.reshape(info["selection_topk_indices"][0]).astype(
            np.int32
        )
    return out
