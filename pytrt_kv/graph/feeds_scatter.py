"""Feeds of ScatterPaKvCache's index inputs (docs/SPEC.md S6, S7, S9): a model step over a
paged cache (block tables, slots, positions: docs/LLAMA.md), slots of a decode step into
the full cache, free slots of a plain cache, the runs of a compressing write, and the
quantisation scales."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..contract import specs
from ..contract.errors import value_error
from ..contract.layouts import LAYOUTS
from .feeds_common import at_least, need, node_attr, our_nodes


def scatter_indices(model, info, rng, table, kv_len, B, S) -> dict[str, np.ndarray]:
    """slot_mapping and the compress inputs (none without slot_mapping; the compress
    inputs without it are refused)."""
    feeds: dict[str, np.ndarray] = {}
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
    return feeds


def scales(model, info, rng, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """docs/SPEC.md S9: the scales of every scatter node, finite and > 0."""
    out: dict[str, np.ndarray] = {}
    for _, op, ports in our_nodes(model):
        for arg in ("k_scale", "v_scale") if op is specs.SCATTER_PA_KV_CACHE else ():
            scale = ports.get(arg, "")
            if scale in info and scale not in feeds and scale not in out:
                sh, d = info[scale]
                out[scale] = rng.uniform(0.05, 2.0, size=tuple(sh)).astype(d)
    return out


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
    cshape, _ = need(info, cache_name, "its dims 0 and 1 (NB, BS) size the block tables")
    if len(cshape) != 4:
        raise value_error(cache_name, "a 4-D cache [NB, BS, H, D]", list(cshape))
    # BS is dim 1 of an nd cache [NB, BS, H, D] and dim 2 of an hnd [NB, H, BS, D] or nz
    # cache (docs/SPEC.md S2, contract/layouts.py); a node that leaves cache_layout empty
    # is detected as the ops detect it, never assumed nd (that would read H as BS).
    layout = node_attr(model, specs.SCATTER_PA_KV_CACHE.name, "cache_layout", "") or (
        _scatter_layout(info, ports, cache_name)
    )
    nb, bs = LAYOUTS[layout].blocks(cshape)
    tshape, tdt = info["block_tables"]
    if len(tshape) != 2:
        raise value_error("block_tables", "[B, W]", list(tshape))
    B = at_least("block_tables", "B", tshape[0], 1, tshape)
    W = at_least("block_tables", "W", tshape[1], 1, tshape)
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
    for _, op, ports in our_nodes(model):
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
    need(
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
    cshape, _ = need(
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
        layout = node_attr(model, "ScatterPaKvCache", "cache_layout", "") or _scatter_layout(
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
    key_shape, _ = need(info, key_name, "the data loader reads Smax from the 4-D key")
    if len(key_shape) != 4:
        raise value_error(
            key_name, "a 4-D key [B, Smax, H, Dk] with slot_mapping [B, H]", list(key_shape)
        )
    bs = cshape[1]
    Bk, H = sm_shape
    smax = at_least(key_name, "Smax (dim 1)", key_shape[1], 1, key_shape)
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
