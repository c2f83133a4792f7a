"""``pytrt-kv retrieval-demo``: RetrievalKV decode steps end to end, verified.

1. builds the retrieval decode step
   (:func:`onnx_export.retrieval.build_retrieval_decode_step`), checked by ``onnx.checker``;
2. starts each row with a random prompt (written into the full caches as a dense prefill
   would) and runs decode steps on the CPU runtime, feeding each step's caches and status
   back, the planner supplying tables, slots, representations and counts;
3. verifies every step against an independent computation: the new token lands in its
   full-cache slot and nothing else there changes; the step's ids are those of the NumPy
   reference's selection (:func:`.reference.sparse_decode_attention`); every selection
   slot holds its block's bytes; the attention output equals the reference;
4. prints, per step and row, the recalled, kept and copied blocks and the error against
   dense attention (the price of sparsity, not a defect).

Exit status 0 only when every check passed.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..contract import dtypes
from .config import DENSE, RetrievalConfig
from .planner import RetrievalPlanner, RetrievalSizes, StepRecord
from .reference import dense_attention, sparse_decode_attention

#: float32 attention in another order than the graph's: rounding only.
ATOL = {"float32": 2e-5, "float16": 2e-3}


@dataclass
class StepCheck:
    """One row of one verified step."""

    step: int
    row: int
    record: StepRecord
    err_reference: float  #: max |graph - NumPy reference|
    err_dense: float  #: max |graph - dense attention|


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.uint8)


def run_steps(
    cfg: RetrievalConfig,
    sizes: RetrievalSizes,
    prompt_lens: Sequence[int],
    steps: int,
    *,
    seed: int = 0,
    run: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None,
    log: Callable[[str], None] | None = None,
) -> list[StepCheck]:
    """Run and verify ``steps`` decode steps; raises ``AssertionError`` on a mismatch.

    Parameters
    ----------
    cfg, sizes : the step's configuration
    prompt_lens : prompt length of each row (``len == sizes.batch``)
    steps : decode steps
    run : feeds -> outputs; default the CPU runtime on the built model
    log : called with one line per step and row
    """
    from onnx_export.retrieval import build_retrieval_decode_step

    if len(prompt_lens) != sizes.batch:
        raise ValueError(f"prompt_lens: expected {sizes.batch} lengths, got {list(prompt_lens)}")
    if run is None:
        from .. import runtime

        ev = runtime.make_evaluator(build_retrieval_decode_step(sizes, cfg))
        run = lambda feeds: runtime.run(ev, feeds)  # noqa: E731
    rng = np.random.default_rng(seed)
    cdt = dtypes.numpy_dtype(sizes.dtype)
    planner = RetrievalPlanner(cfg, sizes, seed=seed)
    caches = planner.empty_caches()
    Hq, Hkv, D = sizes.q_heads, sizes.kv_heads, sizes.head_dim
    hist_k, hist_v = [], []
    for b, P in enumerate(prompt_lens):
        k = rng.standard_normal((P, Hkv, D)).astype(cdt)
        v = rng.standard_normal((P, Hkv, D)).astype(cdt)
        planner.start(b, k, v, caches)
        hist_k.append(k)
        hist_v.append(v)
    B = planner.layout.block_size
    checks: list[StepCheck] = []
    atol = ATOL[sizes.dtype]
    for step in range(steps):
        q = rng.standard_normal((sizes.batch, Hq, D)).astype(cdt)
        k_new = rng.standard_normal((sizes.batch, Hkv, D)).astype(cdt)
        v_new = rng.standard_normal((sizes.batch, Hkv, D)).astype(cdt)
        feeds = planner.step_feeds(caches["full_key_cache"])
        feeds.update(caches)
        feeds.update(query=q, key=k_new, value=v_new)
        out = run(feeds)

        # The reference, row by row, from the histories (never from the caches).
        results = []
        for b in range(sizes.batch):
            hist_k[b] = np.concatenate([hist_k[b], k_new[b : b + 1]])
            hist_v[b] = np.concatenate([hist_v[b], v_new[b : b + 1]])
            row_cfg = cfg.with_(topk_percent=1.0) if planner.modes[b] == DENSE else cfg
            results.append(sparse_decode_attention(q[b], hist_k[b], hist_v[b], row_cfg))
        want_ids = planner.topk_rows([r.selected for r in results])
        got_ids = out["topk_indices"]
        assert np.array_equal(got_ids, want_ids), (
            f"step {step}: ids {got_ids.reshape(sizes.batch, -1).tolist()} != reference "
            f"{want_ids.reshape(sizes.batch, -1).tolist()}"
        )

        # Full caches: the new token at its slot, nothing else changed.
        for name, new in (("full_key_cache", k_new), ("full_value_cache", v_new)):
            want = caches[name].copy()
            slot = feeds["slot_mapping"].astype(np.int64)
            want[slot // B, slot % B] = new
            assert np.array_equal(_bits(out[name + "_out"]), _bits(want)), (
                f"step {step}: {name}_out differs beyond the new token's slot"
            )

        records = planner.commit(
            got_ids, out["selection_kv_block_status_out"], out["selection_kv_actual_seq"]
        )
        status = out["selection_kv_block_status_out"].reshape(sizes.batch, -1)
        K = planner.layout.topk
        for b, (res, rec) in enumerate(zip(results, records)):
            L = hist_k[b].shape[0]
            assert rec.resident_tokens == len(res.positions), (
                f"step {step} row {b}: {rec.resident_tokens} resident tokens, reference "
                f"attends {len(res.positions)}"
            )
            # Every slot holds its id's tokens, bit for bit (keys and values).
            for j, v in enumerate(status[b, :K].tolist()):
                if v < 0:
                    continue
                size = min(B, L - v * B)
                blk = planner.selection_block_table[b, j]
                for name, hist in (
                    ("selection_key_cache_out", hist_k[b]),
                    ("selection_value_cache_out", hist_v[b]),
                ):
                    got = out[name][blk, :size]
                    want = hist[v * B : v * B + size].reshape(size, -1)
                    assert np.array_equal(_bits(got), _bits(want)), (
                        f"step {step} row {b}: slot {j} (id {v}) of {name} is wrong"
                    )
            got = out["attn_out"][b]
            err_ref = float(np.abs(got - res.out).max())
            assert err_ref <= atol, (
                f"step {step} row {b}: attention differs from the reference by {err_ref} > {atol}"
            )
            err_dense = float(np.abs(got - dense_attention(q[b], hist_k[b], hist_v[b])).max())
            checks.append(StepCheck(step, b, rec, err_ref, err_dense))
            if log:
                log(
                    f"step {step} row {b}: L={rec.length} {rec.mode:<14} recalled "
                    f"{rec.selected} kept {rec.kept} copied {rec.copied} blocks "
                    f"({rec.copied_tokens} tokens), resident {rec.resident_tokens}; "
                    f"|out - reference| {err_ref:.1e}, |out - dense| {err_dense:.2e}"
                )
        caches = {name: out[name + "_out"] for name in caches}
    return checks


# --- CLI -------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=6, help="decode steps (default 6)")
    parser.add_argument("--batch", type=int, default=2, help="sequences (default 2)")
    parser.add_argument(
        "--prompt-len", type=int, default=900, help="prompt of row 0 (row b: + 37*b; default 900)"
    )
    parser.add_argument(
        "--max-len", type=int, default=1024, help="full-cache capacity per sequence (default 1024)"
    )
    parser.add_argument(
        "--init-tokens", type=int, default=64, help="resident initial tokens (default 64)"
    )
    parser.add_argument(
        "--local-tokens", type=int, default=200, help="sliding-window tokens (default 200)"
    )
    parser.add_argument(
        "--block-size", type=int, default=32, help="tokens per retrievable block (default 32)"
    )
    parser.add_argument(
        "--topk-percent",
        type=float,
        default=0.2,
        help="fraction of retrievable blocks recalled per step (default 0.2)",
    )
    parser.add_argument(
        "--dense-boundary",
        type=int,
        default=256,
        help="R2 boundary (default 256, so the demo prompt is sparse)",
    )
    parser.add_argument(
        "--offload-boundary",
        type=int,
        default=512,
        help="prompt length from which the full cache is host-resident (default 512)",
    )
    parser.add_argument(
        "--representation",
        choices=("minmax", "mean"),
        default="minmax",
        help="block representation used for scoring (default minmax)",
    )
    parser.add_argument("--q-heads", type=int, default=4, help="query heads (default 4)")
    parser.add_argument("--kv-heads", type=int, default=2, help="KV heads (default 2)")
    parser.add_argument("--head-dim", type=int, default=16, help="head size (default 16)")
    parser.add_argument(
        "--dtype",
        choices=("float32", "float16"),
        default="float32",
        help="cache and activation dtype (default float32)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")


def run(args: argparse.Namespace) -> int:
    cfg = RetrievalConfig(
        init_tokens=args.init_tokens,
        local_tokens=args.local_tokens,
        block_size=args.block_size,
        topk_percent=args.topk_percent,
        dense_boundary=args.dense_boundary,
        offload_boundary=args.offload_boundary,
        representation=args.representation,
    )
    sizes = RetrievalSizes(
        batch=args.batch,
        q_heads=args.q_heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_len=args.max_len,
        dtype=args.dtype,
    )
    prompts = [args.prompt_len + 37 * b for b in range(args.batch)]
    if args.steps < 1:
        raise ValueError(f"--steps: expected >= 1, got {args.steps}")
    if max(prompts) + args.steps > args.max_len:
        raise ValueError(
            f"--max-len: expected >= longest prompt + steps = "
            f"{max(prompts) + args.steps}, got {args.max_len}"
        )
    print(f"config {cfg}")
    print(f"modes (R2): {[cfg.mode_for(p) for p in prompts]} for prompts {prompts}")
    try:
        checks = run_steps(cfg, sizes, prompts, args.steps, seed=args.seed, log=print)
    except AssertionError as exc:
        print(f"FAILED: {exc}")
        return 1
    copied = sum(c.record.copied_tokens for c in checks if c.step)
    kept = sum(c.record.kept for c in checks if c.step)
    print(
        f"OK: {len(checks)} row-steps match the NumPy reference (ids, slots, attention); "
        f"after the first step, {kept} block slots kept in place and {copied} tokens copied"
    )
    return 0
