"""Valid random feeds for models whose inputs follow the OPS.md names.

Polygraphy imports this file as a standalone script, so it uses absolute imports only.

Random index inputs are invalid for our ops (duplicate slots, out-of-range block ids,
corrupted status rows), so Polygraphy's default data loader cannot drive them. Use::

    polygraphy run model.onnx --pytrt-kv-ref --data-loader-script \\
        $(python3 -c "import pytrt_kv.polygraphy.data_loader as m; print(m.__file__)")

``load_data()`` finds the model in this order: its ``model`` argument, the
``PYTRT_KV_MODEL`` environment variable, the first ``*.onnx`` path on the command line
(which is where ``polygraphy run m.onnx ...`` puts it). Sizes are read from the model's
input shapes; the seed is fixed (``PYTRT_KV_SEED``, default 0), so every runner of one
Polygraphy invocation sees the same data.

What the feeds satisfy (OPS.md S6, S7, G2-G5):
- ``slot_mapping``: unique slots (some -1 padding); with ``full_kv_block_table`` and
  ``full_kv_actual_seq`` present, the slot of this step's token s of batch b is position
  ``kv_len - S + s`` of b's block table (a decode step);
- compressing writes: ``seq_lens``/``compress_lens``/``compress_seq_offsets`` within their
  constraints, each (b, h) run in its own rows;
- ``full_kv_block_table``: in-range, private blocks per batch when they fit;
- ``selection_kv_block_table``: private selection blocks per used row;
- ``selection_topk_indices``: distinct valid ids per row (some reused from the old status,
  padding -1 anywhere); ``selection_kv_block_status``: fresh (-1) or a valid previous state;
- ``full_q_actual_seq``: cumulative query counts; every other input random, never zeros.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Dict, Iterator, Optional, Tuple, Union

import numpy as np

from pytrt_kv import dtypes, specs
from pytrt_kv._errors import value_error

_FLOAT = {specs.FLOAT32, specs.FLOAT16, specs.BFLOAT16, specs.FLOAT8_E4M3, specs.FLOAT8_E5M2}


def _model(model: Any):
    import onnx

    if model is None:
        model = os.environ.get("PYTRT_KV_MODEL")
    if model is None:
        model = next((a for a in sys.argv[1:] if a.endswith(".onnx") and os.path.exists(a)),
                     None)
    if model is None:
        raise ValueError("model: expected an onnx model (argument, $PYTRT_KV_MODEL or an "
                         "*.onnx path on the command line), got none")
    return model if isinstance(model, onnx.ModelProto) else onnx.load(os.fspath(model))


def _inputs(model) -> Dict[str, Tuple[Tuple[int, ...], np.dtype]]:
    inits = {i.name for i in model.graph.initializer}
    out = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        shape = []
        for d in tt.shape.dim:
            if not d.HasField("dim_value"):
                raise ValueError(f"{vi.name}: expected static dims (the data loader reads the "
                                 f"sizes from the model), got a dynamic dim {d.dim_param!r}")
            shape.append(d.dim_value)
        out[vi.name] = (tuple(shape), dtypes.numpy_of_onnx(tt.elem_type, vi.name))
    return out


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
    name = dtypes.name_of(dtype)
    if name in _FLOAT:
        x = rng.standard_normal(shape, dtype=np.float32)
        # Keep exact zeros out: "untouched" checks compare against the old contents.
        x = np.where(x == 0, np.float32(0.5), x)
        return x.astype(dtype)
    info = np.iinfo(dtype)
    lo, hi = max(info.min, -100), min(info.max, 100)
    x = rng.integers(lo, hi + 1, size=shape)
    x = np.where(x == 0, 1, x)
    return x.astype(dtype)


def make_feeds(model: Any = None, seed: int = 0) -> Dict[str, np.ndarray]:
    """One valid feed dict for ``model`` (ModelProto or path); see the module docstring.

    Raises
    ------
    ValueError
        The model's sizes leave no room for valid data (e.g. too few selection blocks for
        private rows); the message names the input.
    """
    model = _model(model)
    rng = np.random.default_rng(seed)
    info = _inputs(model)
    feeds: Dict[str, np.ndarray] = {}

    def shape(n):
        return info[n][0]

    def dt(n):
        return info[n][1]

    # --- geometry shared by both ops ------------------------------------------------
    B = S = None
    if "selection_kv_block_status" in info or "selection_topk_indices" in info:
        ref = "selection_kv_block_status" if "selection_kv_block_status" in info \
            else "selection_topk_indices"
        sh = shape(ref)
        K = sh[-1] - 1 if ref == "selection_kv_block_status" else sh[-1]
        if "full_kv_actual_seq" in info:
            B = shape("full_kv_actual_seq")[0]
        if len(sh) == 4:
            B, S = sh[0], sh[1]
        else:
            B = B or sh[0]
            S = sh[0] // max(B, 1)
    elif "full_kv_actual_seq" in info:
        B, S = shape("full_kv_actual_seq")[0], 1
    kv_len = table = None
    if "full_kv_block_table" in info:
        fnb, fbs = shape("full_kv_cache")[:2]
        B = B or shape("full_kv_block_table")[0]
        fmax = shape("full_kv_block_table")[1]
        if B * fmax > fnb:
            # Shared blocks would make two batches' tokens collide (duplicate slots, S7).
            raise value_error("full_kv_cache", f"at least B*F_MAX_BLOCK_NUM = {B * fmax} blocks "
                              "so every batch gets private blocks", f"{fnb} blocks")
        table = rng.permutation(fnb)[:B * fmax].reshape(B, fmax)
        feeds["full_kv_block_table"] = table.astype(dt("full_kv_block_table"))
        S = S or 1
        cap = fmax * fbs
        kv_len = rng.integers(S, cap + 1, size=B)
        if B > 1:
            kv_len[rng.integers(B)] = cap  # the full table is exercised every time
        if "full_kv_actual_seq" in info:
            feeds["full_kv_actual_seq"] = kv_len.astype(dt("full_kv_actual_seq"))
    if "full_q_actual_seq" in info:
        feeds["full_q_actual_seq"] = (np.arange(1, B + 1) * (S or 1)).astype(
            dt("full_q_actual_seq"))

    # --- ScatterPaKvCache ------------------------------------------------------------
    if "slot_mapping" in info:
        feeds.update(_scatter_indices(model, info, rng, table, kv_len, S))

    # --- GatherSelectionKvCache -------------------------------------------------------
    if "selection_kv_block_status" in info:
        feeds.update(_gather_indices(model, info, rng, B, S, K, kv_len))

    for n, (sh, d) in info.items():
        if n not in feeds:
            feeds[n] = _random(rng, sh, d)
    return {n: feeds[n] for n in info}


def _scatter_indices(model, info, rng, table, kv_len, S) -> Dict[str, np.ndarray]:
    out: Dict[str, np.ndarray] = {}
    sm_shape, sm_dt = info["slot_mapping"]
    key_shape = info["key"][0] if "key" in info else None
    cache_name = "key_cache" if "key_cache" in info else "full_kv_cache"
    cshape = info[cache_name][0]
    if (len(sm_shape) == 1 and table is not None and kv_len is not None
            and cache_name == "full_kv_cache"):
        # A decode step writing the full cache: token t = b*S + s is position
        # kv_len[b] - S + s of batch b.
        fbs = cshape[1]
        T = sm_shape[0]
        slots = np.empty(T, np.int64)
        for t in range(T):
            b, s = divmod(t, S)
            p = int(kv_len[b]) - S + s
            slots[t] = int(table[b, p // fbs]) * fbs + p % fbs
        out["slot_mapping"] = slots.astype(sm_dt)
        return out
    layout = _node_attr(model, "ScatterPaKvCache", "cache_layout", "nd") or "nd"
    nb = cshape[0]
    if len(sm_shape) == 1:
        bs = cshape[1] if layout == "nd" else cshape[2]
        T = sm_shape[0]
        if T > nb * bs:
            raise ValueError(f"slot_mapping: expected at most NB*BS = {nb * bs} tokens, got {T}")
        slots = rng.permutation(nb * bs)[:T].astype(np.int64)
        slots[rng.random(T) < 0.2] = -1
        out["slot_mapping"] = slots.astype(sm_dt)
        return out
    # Compressing write: slot_mapping [B, H], each (b, h) run gets Smax private rows.
    bs = cshape[1]
    Bk, smax, H = key_shape[0], key_shape[1], key_shape[2]
    chunks = (nb * bs) // smax
    if chunks < Bk * H:
        raise ValueError(f"key_cache: expected room for B*H*Smax = {Bk * H * smax} rows, got "
                         f"NB*BS = {nb * bs}")
    base = rng.permutation(chunks)[:Bk * H].reshape(Bk, H).astype(np.int64) * smax
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


def _gather_indices(model, info, rng, B, S, K, kv_len) -> Dict[str, np.ndarray]:
    from pytrt_kv._gather import plan_row

    tbs = int(_node_attr(model, "GatherSelectionKvCache", "selection_topk_block_size", 64))
    out: Dict[str, np.ndarray] = {}
    snb, sbs = info["selection_kv_cache"][0][:2]
    R, smax = info["selection_kv_block_table"][0]
    need = -(-K * tbs // sbs)
    rows = B * S
    if rows * need > snb:
        raise ValueError(f"selection_kv_cache: expected at least rows*ceil(K*TBS/SBS) = "
                         f"{rows * need} blocks for private selection rows, got {snb}")
    sel = rng.integers(0, snb, size=(R, smax))
    sel[:rows, :need] = rng.permutation(snb)[:rows * need].reshape(rows, need)
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
            prev = rng.permutation(old_n_ids)[:int(rng.integers(1, min(K, old_n_ids) + 1))]
            prev_topk = np.full(K, -1, np.int64)
            prev_topk[rng.permutation(K)[:len(prev)]] = prev
            plan = plan_row([-1] * (K + 1), prev_topk.tolist(), int(kv_len[b]) - 1, S, s, tbs)
            status[r] = plan.status
            old_ids = [int(v) for v in plan.status[:K] if v >= 0]
        n = int(rng.integers(max(1, min(K, n_ids) // 2), min(K, n_ids) + 1))
        reuse = [v for v in old_ids if v < n_ids and rng.random() < 0.6][:n]
        rest = [int(v) for v in rng.permutation(n_ids) if int(v) not in reuse]
        ids = reuse + rest[:n - len(reuse)]
        ids = [ids[i] for i in rng.permutation(len(ids))]
        topk[r, np.sort(rng.permutation(K)[:len(ids)])] = ids
    out["selection_kv_block_status"] = status.reshape(info["selection_kv_block_status"][0]).astype(
        np.int32)
    if "selection_topk_indices" in info:
        out["selection_topk_indices"] = topk.reshape(info["selection_topk_indices"][0]).astype(
            np.int32)
    return out


def load_data(model: Union[str, os.PathLike, Any, None] = None, iterations: int = 3,
              seed: Optional[int] = None) -> Iterator[Dict[str, np.ndarray]]:
    """Yield ``iterations`` valid feed dicts (Polygraphy ``--data-loader-script`` entry).

    Parameters
    ----------
    model : ModelProto or path, optional
        Default: ``$PYTRT_KV_MODEL``, else the first ``*.onnx`` argument of the command line.
    iterations : int
        Feed dicts to yield (``$PYTRT_KV_ITERATIONS`` overrides the default).
    seed : int, optional
        Base seed (default ``$PYTRT_KV_SEED`` or 0); iteration i uses ``seed + i``.
    """
    model = _model(model)
    iterations = int(os.environ.get("PYTRT_KV_ITERATIONS", iterations))
    seed = int(os.environ.get("PYTRT_KV_SEED", 0)) if seed is None else seed
    for i in range(iterations):
        yield make_feeds(model, seed + i)
