"""``pytrt-kv retrieval-demo``: RetrievalKV decode steps on the CPU runtime, verified
against the NumPy reference (the steps and checks: :mod:`pytrt_kv.retrieval.demo`); prints
one line per step and row, and ``FAILED: ...`` with exit status 1 on a mismatch.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np


def cpu_runner(cfg, sizes) -> Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """feeds -> outputs: the CPU runtime on the retrieval decode step
    (``onnx_export.retrieval.build_retrieval_decode_step``, imported here, lazily)."""
    from onnx_export.retrieval import build_retrieval_decode_step

    from .. import runtime

    ev = runtime.make_evaluator(build_retrieval_decode_step(sizes, cfg))
    return lambda feeds: runtime.run(ev, feeds)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..retrieval.config import REPRESENTATIONS, RetrievalConfig

    default_rep = RetrievalConfig().representation
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
        choices=REPRESENTATIONS,
        default=default_rep,
        help=f"block representation used for scoring (docs/SPEC.md R5; default {default_rep})",
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
    from ..retrieval.config import RetrievalConfig
    from ..retrieval.demo import VerificationError, run_steps
    from ..retrieval.planner import RetrievalSizes

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
        checks = run_steps(
            cfg, sizes, prompts, args.steps, run=cpu_runner(cfg, sizes), seed=args.seed, log=print
        )
    except VerificationError as exc:
        print(f"FAILED: {exc}")
        return 1
    copied = sum(c.record.copied_tokens for c in checks if c.step)
    kept = sum(c.record.kept for c in checks if c.step)
    print(
        f"OK: {len(checks)} row-steps match the NumPy reference (ids, slots, attention); "
        f"after the first step, {kept} block slots kept in place and {copied} tokens copied"
    )
    return 0
