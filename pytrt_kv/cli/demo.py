"""``pytrt-kv demo``: the example sparse-attention decode loop, verified step by step
(the steps and their checks: :mod:`pytrt_kv.demo`); prints one table row per step.

Exit status 0 only when every check passed.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from .export_example import add_size_arguments, output_path, sizes_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=6, help="decode steps (default 6)")
    parser.add_argument(
        "--prompt-len",
        type=int,
        default=5,
        help="tokens already cached before the first step (default 5; "
        "batch b starts with prompt_len + b)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument(
        "--model", default=None, help="where to write the example .onnx (default: a temporary file)"
    )
    parser.add_argument(
        "--no-trt",
        action="store_true",
        help="do not run the TensorRT engine even where it is available",
    )
    add_size_arguments(parser)


def _print_native_notice() -> None:
    """One line when the install has no GPU kernels: pip hides the build's own warning."""
    from .. import _lib

    info = _lib.build_info()
    if info.get("cuda") == "OFF":
        print(
            f"GPU kernels: not built ({info.get('no_cuda_reason', '?')}); put nvcc on PATH "
            "and reinstall to get pytrt_kv.ops and the TensorRT plugins (`pytrt-kv info`)"
        )


def run(args: argparse.Namespace) -> int:
    import onnx

    from onnx_export.example import CACHE_OUTPUTS, build_example_model

    from .. import runtime
    from ..demo import _trt_compare, expected_step, initial_state, step_feeds, verify_step

    t0 = time.time()
    z = sizes_from_args(args)
    if args.steps < 1:
        raise ValueError(f"--steps: expected >= 1, got {args.steps}")
    last = args.prompt_len + z.batch - 1 + args.steps
    if args.prompt_len < 0 or last > z.max_tokens:
        raise ValueError(
            f"--prompt-len/--steps: expected prompt_len + batch - 1 + steps <= "
            f"max_blocks_per_seq * block_size = {z.max_tokens}, got {last}"
        )
    tmp = None
    if args.model:
        path = output_path("--model", args.model)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="pytrt_kv_demo_")
        path = Path(tmp.name) / "sparse_decode_step.onnx"
    try:
        model = build_example_model(z)
        onnx.save(model, str(path))
        onnx.checker.check_model(str(path), full_check=True)
        custom = sum(n.domain == "pytrt_kv" for n in model.graph.node)
        print(
            f"exported {path}: {len(model.graph.node)} nodes ({custom} pytrt_kv), "
            f"onnx.checker full_check passed"
        )
        print(
            f"sizes: B={z.batch} Hq={z.heads} KV={z.kv_dim} R={z.rope_dim} NB={z.num_blocks} "
            f"FBS={z.block_size} FMAX={z.max_blocks_per_seq} K={z.topk} "
            f"SBS={z.selection_block_size} dtype={z.dtype}"
        )
        rng = np.random.default_rng(args.seed)
        state = initial_state(z, args.prompt_len, rng, model)
        evaluator = runtime.make_evaluator(model)
        print(
            f"{'step':>4} | {'kv_len':>12} | {'selected':>8} | {'kept in place':>13} | "
            f"{'copied':>6} | {'max |attn err|':>14} | result"
        )
        all_fails: list[str] = []
        feeds_list, cpu_outputs = [], []
        for step in range(1, args.steps + 1):
            feeds = step_feeds(z, state, rng, model)
            try:
                out = runtime.run(evaluator, feeds)
            except (ValueError, TypeError) as exc:
                all_fails.append(f"step {step}: the runtime refused the step: {exc}")
                print(f"{step:>4} | runtime error: {exc}")
                break
            exp = expected_step(z, feeds)
            fails, st = verify_step(z, feeds, out, exp)
            n_sel = int(out["selection_kv_actual_seq"].sum())
            kv = ",".join(str(int(v)) for v in feeds["full_kv_actual_seq"])
            print(
                f"{step:>4} | {kv:>12} | {n_sel:>8} | {st['kept']:>13} | {st['copied']:>6} | "
                f"{st['err']:>14.3g} | {'ok' if not fails else 'FAILED'}"
            )
            for f in fails:
                print(f"       step {step}: {f}")
            all_fails += fails
            if fails:
                print("       stopping: later steps would start from wrong caches")
                break
            feeds_list.append(feeds)
            cpu_outputs.append(out)
            state = {**state, "kv_len": feeds["full_kv_actual_seq"]}
            for src, dst in CACHE_OUTPUTS.items():
                state[src] = out[dst]
        reason = (
            "disabled by --no-trt"
            if args.no_trt
            else ("not run: the CPU steps failed" if all_fails else None)
        )
        if reason is None:
            reason, trt_fails = _trt_compare(path, feeds_list, cpu_outputs)
            if not reason:
                print(
                    f"TensorRT engine: {len(feeds_list)} steps "
                    f"{'match the CPU runtime' if not trt_fails else 'DIFFER'}"
                )
                for f in trt_fails:
                    print(f"       {f}")
                all_fails += trt_fails
        if reason:
            print(f"TensorRT engine: skipped ({reason.splitlines()[0] if reason else ''})")
        _print_native_notice()
        verdict = "PASSED" if not all_fails else f"FAILED ({len(all_fails)} checks)"
        print(f"demo {verdict} in {time.time() - t0:.1f} s")
        return 0 if not all_fails else 1
    finally:
        if tmp is not None:
            tmp.cleanup()
