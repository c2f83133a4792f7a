"""``pytrt-kv retrieval-demo``: RetrievalKV decode steps on the CPU runtime, verified
against the NumPy reference (the steps and checks: :mod:`pytrt_kv.retrieval.demo`); prints
one line per step and row, and ``FAILED: ...`` with exit status 1 on a mismatch.

With "lowrank" (the default representation) the basis is calibrated on keys drawn from a
random stream of their own, not on the decoded sequences' keys
(:func:`pytrt_kv.retrieval.demo.calibration_basis`).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from ._options import add_numbers


def cpu_runner(
    cfg, sizes, basis: np.ndarray | None = None
) -> Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """feeds -> outputs: the CPU runtime on the retrieval decode step
    (``onnx_export.retrieval.build_retrieval_decode_step``, imported here, lazily);
    ``basis``: the "lowrank" basis, a constant of the step (required for "lowrank")."""
    from onnx_export.retrieval import build_retrieval_decode_step

    from .. import runtime

    ev = runtime.make_evaluator(build_retrieval_decode_step(sizes, cfg, basis=basis))
    return lambda feeds: runtime.run(ev, feeds)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..retrieval.config import REPRESENTATIONS, RetrievalConfig

    default_rep = RetrievalConfig().representation
    add_numbers(
        parser,
        [
            ("--steps", int, 6, "decode steps"),
            ("--batch", int, 2, "sequences"),
            ("--prompt-len", int, 900, "prompt of row 0; row b's is 37*b longer"),
            ("--max-len", int, 1024, "full-cache capacity per sequence"),
            ("--init-tokens", int, 64, "resident initial tokens"),
            ("--local-tokens", int, 200, "sliding-window tokens"),
            ("--block-size", int, 32, "tokens per retrievable block"),
            ("--topk-percent", float, 0.2, "fraction of retrievable blocks recalled per step"),
            ("--dense-boundary", int, 256, "R2 boundary, so that the demo prompt is sparse"),
            (
                "--offload-boundary",
                int,
                512,
                "prompt length from which the full cache is host-resident",
            ),
        ],
    )
    parser.add_argument(
        "--representation",
        choices=REPRESENTATIONS,
        default=default_rep,
        help=f"block representation used for scoring (docs/SPEC.md R5; default {default_rep}; "
        "lowrank's basis is calibrated on random keys of another seed than the decoded ones)",
    )
    add_numbers(
        parser,
        [
            ("--rank", int, 8, "lowrank: numbers per key and KV head, at most --head-dim"),
            ("--q-heads", int, 4, "query heads"),
            ("--kv-heads", int, 2, "KV heads"),
            ("--head-dim", int, 16, "head size"),
        ],
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "float16"),
        default="float32",
        help="cache and activation dtype (default float32)",
    )
    add_numbers(parser, [("--seed", int, 0, "random seed")])


def _fields_from(cls: Any, args: argparse.Namespace) -> dict[str, Any]:
    """``{field: value}`` of the dataclass ``cls``'s fields that have an option of the
    same name (``--init-tokens`` is ``init_tokens``), taken from ``args``; the other
    fields keep their defaults."""
    names = [f.name for f in dataclasses.fields(cls) if hasattr(args, f.name)]
    return {name: getattr(args, name) for name in names}


def run(args: argparse.Namespace) -> int:
    from ..retrieval.config import RetrievalConfig
    from ..retrieval.demo import VerificationError, calibration_basis, run_steps
    from ..retrieval.planner import RetrievalSizes

    cfg = RetrievalConfig(**_fields_from(RetrievalConfig, args))
    sizes = RetrievalSizes(**_fields_from(RetrievalSizes, args))
    prompts = [args.prompt_len + 37 * b for b in range(args.batch)]
    if args.steps < 1:
        raise ValueError(f"--steps: expected >= 1, got {args.steps}")
    if max(prompts) + args.steps > args.max_len:
        raise ValueError(
            f"--max-len: expected >= longest prompt + steps = "
            f"{max(prompts) + args.steps}, got {args.max_len}"
        )
    basis = calibration_basis(cfg, sizes, args.seed)
    print(f"config {cfg}")
    if basis is not None:
        print(
            f"lowrank basis {list(basis.shape)}: calibrated on random keys of seed "
            f"[{args.seed}, 1], not the decoded sequences'"
        )
    print(f"modes (R2): {[cfg.mode_for(p) for p in prompts]} for prompts {prompts}")
    try:
        checks = run_steps(
            cfg, sizes, prompts, args.steps, run=cpu_runner(cfg, sizes, basis), seed=args.seed,
            log=print, basis=basis,
        )  # fmt: skip
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
