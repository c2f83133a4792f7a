"""The steps and checks of ``pytrt-kv demo`` (the command: :mod:`pytrt_kv.cli.demo`): a
sparse-attention decode loop on the example model, verified.

1. exports the example model (:mod:`onnx_export.example`) and checks it with
   ``onnx.checker`` (``full_check=True``);
2. runs several decode steps on the CPU runtime, feeding each step's ``*_out`` caches back
   as the next step's inputs while ``kv_len`` grows by one token per step;
3. verifies every step against an independent NumPy computation written here: the new
   token lands in the full cache; the top-K tokens by indexer score over the visible
   positions are exactly the selected ones; every selection slot holds its token's bytes;
   the attention output equals attention over exactly those tokens;
4. when TensorRT, a GPU and the plugin library are usable (``pytrt_kv.trt``), runs the
   same steps on an engine and compares.

These functions return failures as data and never print.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

#: Bytes written into the selection cache before the first step, so a slot the op was
#: not supposed to touch is recognisable.
SENTINEL = -7.25
#: Attention is float32 math in a different order than the graph's: allow rounding only.
ATTN_TOL = 2e-5


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.uint8)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(_bits(a), _bits(b)))


def _draw(rng: np.random.Generator, model) -> dict[str, np.ndarray]:
    """One valid feed dict of the example model from :func:`pytrt_kv.graph.feeds.make_feeds`,
    the one valid-input generator (docs/GRAPH_MODE.md, Valid feeds), seeded from ``rng``."""
    from pytrt_kv.graph.feeds import make_feeds

    return make_feeds(model, seed=int(rng.integers(2**31)))


def initial_state(sizes, prompt_len: int, rng: np.random.Generator, model) -> dict[str, np.ndarray]:
    """Caches and tables before the first decode step (prompt already in the full cache).

    The full caches and both block tables come from ``make_feeds`` (``model``: the example
    model of ``sizes``, :func:`onnx_export.example.build_example_model`); what a decode loop
    starts from is set here:
    ``kv_len = prompt_len + b``, a fresh status and :data:`SENTINEL` selection caches.
    """
    z = sizes
    f = _draw(rng, model)
    B = z.batch
    state = {
        n: f[n]
        for n in ("full_kv_cache", "full_k_rope", "full_kv_block_table", "selection_kv_block_table")
    }
    return {
        **state,
        "kv_len": np.array([prompt_len + b for b in range(B)], np.int32),
        "selection_k_rope": np.full_like(f["selection_k_rope"], SENTINEL),
        "selection_kv_cache": np.full_like(f["selection_kv_cache"], SENTINEL),
        "selection_kv_block_status": np.full_like(f["selection_kv_block_status"], -1),
    }


def step_feeds(
    sizes, state: dict[str, np.ndarray], rng: np.random.Generator, model
) -> dict[str, np.ndarray]:
    """Feeds of the next decode step: one new token per sequence at position kv_len.

    The new tokens and queries come from ``make_feeds`` (see :func:`initial_state`); the
    caches, tables and status are the state, the slots and lengths those of the step.
    """
    z = sizes
    B = z.batch
    kv_len = state["kv_len"] + 1
    pos = kv_len - 1
    table = state["full_kv_block_table"]
    slots = table[np.arange(B), pos // z.block_size] * z.block_size + pos % z.block_size
    feeds = _draw(rng, model)
    feeds.update(
        {
            "slot_mapping": slots.astype(feeds["slot_mapping"].dtype),
            "full_kv_actual_seq": kv_len.astype(feeds["full_kv_actual_seq"].dtype),
            "full_q_actual_seq": np.arange(1, B + 1, dtype=feeds["full_q_actual_seq"].dtype),
        }
    )
    for name in (
        "full_kv_cache",
        "full_k_rope",
        "full_kv_block_table",
        "selection_k_rope",
        "selection_kv_cache",
        "selection_kv_block_table",
        "selection_kv_block_status",
    ):
        feeds[name] = state[name]
    return feeds


def expected_step(sizes, feeds: dict[str, np.ndarray]) -> dict[str, object]:
    """The step computed directly in NumPy, without the reference gather or the graph.

    Returns the updated full caches, per batch the set of selected positions (top-K of
    the indexer score over positions < kv_len) and the attention output over exactly
    those tokens.
    """
    z = sizes
    fbs = z.block_size
    full_kv = feeds["full_kv_cache"].copy()
    full_rope = feeds["full_k_rope"].copy()
    for b, slot in enumerate(feeds["slot_mapping"].tolist()):
        full_kv[slot // fbs, slot % fbs, 0] = feeds["kv"][b, 0]
        full_rope[slot // fbs, slot % fbs, 0] = feeds["k_rope"][b, 0]
    table = feeds["full_kv_block_table"]
    selected: list[list[int]] = []
    attn = np.zeros((z.batch, z.heads, z.kv_dim), np.float32)
    for b in range(z.batch):
        n = int(feeds["full_kv_actual_seq"][b])
        p = np.arange(n)
        tok = full_kv[table[b, p // fbs], p % fbs, 0].astype(np.float32)  # [n, KV]
        rope = full_rope[table[b, p // fbs], p % fbs, 0].astype(np.float32)  # [n, R]
        score = tok @ feeds["index_q"][b].astype(np.float32)
        top = np.argsort(-score, kind="stable")[: z.topk]
        selected.append(sorted(int(t) for t in top))
        logits = (
            feeds["q_nope"][b].astype(np.float32) @ tok[top].T
            + feeds["q_rope"][b].astype(np.float32) @ rope[top].T
        ) / math.sqrt(z.kv_dim + z.rope_dim)
        w = np.exp(logits - logits.max(axis=-1, keepdims=True))
        w /= w.sum(axis=-1, keepdims=True)
        attn[b] = w @ tok[top]
    return {
        "full_kv_cache_out": full_kv,
        "full_k_rope_out": full_rope,
        "selected": selected,
        "attn_out": attn,
    }


def verify_step(sizes, feeds, out, exp) -> tuple[list[str], dict[str, object]]:
    """Compare one step's outputs with :func:`expected_step`; returns (failures, stats)."""
    z = sizes
    fails: list[str] = []
    for name in ("full_kv_cache_out", "full_k_rope_out"):
        if not _same(out[name], exp[name]):
            fails.append(f"{name} differs from the NumPy write of the new token")
    old_status = feeds["selection_kv_block_status"].reshape(z.batch, -1)
    status = out["selection_kv_block_status_out"].reshape(z.batch, -1)
    actual = out["selection_kv_actual_seq"]
    table = feeds["full_kv_block_table"]
    kept = copied = 0
    for b in range(z.batch):
        n = len(exp["selected"][b])
        ids = status[b, : z.topk]
        if sorted(ids[:n].tolist()) != exp["selected"][b] or (ids[n:] != -1).any():
            fails.append(
                f"batch {b}: selected {ids.tolist()}, expected the set {exp['selected'][b]}"
            )
        if int(actual[b]) != n or int(status[b, z.topk]) != n:
            fails.append(
                f"batch {b}: selection_kv_actual_seq {int(actual[b])}, status[K] "
                f"{int(status[b, z.topk])}, expected {n}"
            )
        for j in range(z.topk):
            q = j  # TBS = 1: slot j holds one token
            blk = feeds["selection_kv_block_table"][b, q // z.selection_block_size]
            row = (blk, q % z.selection_block_size)
            for cache, full in (
                ("selection_kv_cache", "full_kv_cache_out"),
                ("selection_k_rope", "full_k_rope_out"),
            ):
                got = out[cache + "_out"][row]
                if j < n and ids[j] >= 0:
                    p = int(ids[j])
                    want = exp[full][table[b, p // z.block_size], p % z.block_size, 0]
                else:
                    want = feeds[cache][row]  # unused slot: untouched
                if not _same(got, want):
                    fails.append(
                        f"batch {b}: {cache} slot {j} does not hold "
                        f"{'token ' + str(int(ids[j])) if j < n else 'its old bytes'}"
                    )
        same_slot = (ids[:n] == old_status[b, :n]) & (ids[:n] >= 0)
        kept += int(same_slot.sum())
        copied += n - int(same_slot.sum())
    err = float(np.max(np.abs(out["attn_out"] - exp["attn_out"])))
    if not err <= ATTN_TOL * max(1.0, float(np.max(np.abs(exp["attn_out"])))):
        fails.append(f"attn_out: max |error| {err:.3g} above tolerance")
    return fails, {"kept": kept, "copied": copied, "err": err}


def _trt_compare(onnx_path: Path, feeds_list, cpu_outputs) -> tuple[str, list[str]]:
    """('' or the reason TensorRT was not used, failures)."""
    try:
        from pytrt_kv import trt as pytrt_trt

        reason = pytrt_trt.availability()
    except Exception as exc:  # the module or TensorRT itself may be missing or broken
        return f"{type(exc).__name__}: {exc}", []
    if reason:
        return reason, []
    results = pytrt_trt.run_model_steps(str(onnx_path), feeds_list)
    fails: list[str] = []
    for i, (got, want) in enumerate(zip(results, cpu_outputs), start=1):
        for name, w in want.items():
            g = np.asarray(got[name])
            if name == "attn_out":
                err = float(np.max(np.abs(g - w)))
                if not err <= 1e-3:
                    fails.append(f"TensorRT step {i}: attn_out max |error| {err:.3g}")
            elif not _same(g, w):
                fails.append(f"TensorRT step {i}: {name} differs from the CPU runtime")
    return "", fails
