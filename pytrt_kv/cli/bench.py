"""``pytrt-kv bench``: time the CUDA kernels (:mod:`pytrt_kv.bench`) or, with ``bench
datadist``, the block push over NIXL (:mod:`pytrt_kv.datadist.bench`); prints the rows as
they come and the Markdown table, and writes ``--output`` / ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ._options import add_numbers

#: Timed runs of ``bench datadist``'s small-push rows by default: on a small shared host
#: the medians of 24 runs ranged 0.75-0.90 and 0.82-0.89 of raw NIXL in two benches of
#: one tree minutes apart (docs/DATADIST.md, "Where the small-push time goes"): as wide
#: as the gap to the 0.90 target they decide. ``--repeats`` stays the throughput rows'.
LATENCY_REPEATS = 60


def _progress(line: str) -> None:
    print(line, flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # `pytrt-kv bench datadist`: block push over NIXL (pytrt_kv/datadist/bench.py).
    parser.add_argument(
        "what",
        nargs="?",
        choices=("kernels", "datadist"),
        default="kernels",
        help="kernels (default) or datadist: block push over NIXL, no GPU needed",
    )
    _add_datadist_arguments(parser)
    parser.add_argument(
        "--op",
        choices=("scatter", "gather", "quant", "all"),
        default="all",
        help="which kernels to time (default all)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer sizes and iterations (a smoke run, not for BENCHMARKS.md)",
    )
    add_numbers(
        parser,
        [
            ("--iters", int, 200, "calls per timed run"),
            ("--warmup", int, 20, "untimed calls before each timed run"),
            ("--repeats", int, 5, "timed runs; the median is kept"),
            ("--device", int, 0, "CUDA device index to run on"),
        ],
    )
    parser.add_argument(
        "--output",
        metavar="PATH",
        help="write the Markdown results (with device, driver, CUDA and date) to this file",
    )
    parser.add_argument("--json", metavar="PATH", help="write the raw results as JSON to this file")


def _add_datadist_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``pytrt-kv bench datadist`` (besides the shared ``--quick``,
    ``--repeats``, ``--output``, ``--json``)."""
    g = parser.add_argument_group("datadist (pytrt-kv bench datadist)")
    g.add_argument(
        "--memory",
        choices=("host", "device", "pinned-to-device"),
        default="host",
        help="where the caches live (device variants need a GPU and the kernel library)",
    )
    add_numbers(
        g,
        [
            ("--total-mib", float, 64.0, "MiB per push"),
            ("--pushes", int, 5, "pushes per timed run"),
            ("--latency-pushes", int, 200, "pushes per timed run of the 1-16-block latency rows"),
            (
                "--latency-repeats",
                int,
                LATENCY_REPEATS,
                "timed runs of the latency rows (their ratios decide a 0.90 target within a "
                "few percent: more runs than --repeats)",
            ),
        ],
    )


def write_results(args: argparse.Namespace, text: str, raw: dict[str, Any]) -> None:
    """Print the Markdown table and write it to ``--output`` and ``raw`` to ``--json``
    (shared by the kernel and the datadist benchmarks)."""
    print()
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "what", "kernels") == "datadist":
        return _run_datadist(args)
    try:
        import torch
    except ImportError:
        raise RuntimeError("pytrt-kv bench needs torch with CUDA (pip install torch)") from None
    if not torch.cuda.is_available():
        raise RuntimeError("pytrt-kv bench needs a CUDA GPU (torch.cuda.is_available() is False)")
    from .. import _cuda
    from ..bench import Timer, _device_info, bench_gather, bench_quant, bench_scatter, markdown

    _cuda.kernels()  # the library's own error if it is missing
    torch.cuda.set_device(args.device)
    iters = 20 if args.quick else args.iters
    timer = Timer(
        torch,
        iters=iters,
        warmup=3 if args.quick else args.warmup,
        repeats=3 if args.quick else args.repeats,
    )
    info = _device_info(torch, args.device)
    print(f"pytrt-kv bench on {info['device']} ({info['driver']}), {info['date']}")
    results: dict[str, list[dict[str, Any]]] = {"scatter": [], "gather": [], "quant": []}
    if args.op in ("scatter", "all"):
        results["scatter"] = bench_scatter(torch, timer, args.quick, _progress)
    if args.op in ("quant", "all"):
        results["quant"] = bench_quant(torch, timer, args.quick, _progress)
    if args.op in ("gather", "all"):
        results["gather"] = bench_gather(torch, timer, args.quick, _progress)
    write_results(args, markdown(info, results), {"info": info, "results": results})
    missed = [r for rows in results.values() for r in rows if r.get("met") is False]
    if missed:
        print(
            f"{len(missed)} target(s) missed (see the 'met' column); targets are goals "
            f"for BENCHMARKS.md, not a failure of the run.",
            file=sys.stderr,
        )
    return 0


def _run_datadist(args: argparse.Namespace) -> int:
    from ..datadist.backends import nixl_unavailable_reason
    from ..datadist.bench import (
        BLOCK_SIZES,
        _machine,
        bench_case,
        bench_latency,
        latency_markdown,
        markdown,
    )

    reason = nixl_unavailable_reason()
    if reason:
        raise RuntimeError(f"pytrt-kv bench datadist needs nixl: {reason}")
    total = int((1.0 if args.quick else args.total_mib) * 2**20)
    pushes = 1 if args.quick else args.pushes
    repeats = 1 if args.quick else args.repeats
    info = _machine()
    print(
        f"pytrt-kv bench datadist ({args.memory} memory, {total / 2**20:.0f} MiB per push) "
        f"on {info['cpu']}, {info['date']}"
    )
    rows = []
    for block in BLOCK_SIZES:
        for pattern in ("contiguous", "scattered"):
            if block > total:
                continue
            r = bench_case(args.memory, block, pattern, total, pushes, repeats)
            print(
                f"  {block >> 10:>5} KiB {pattern:<10} wrapper {r['wrapper_gbs']:6.2f} GB/s  "
                f"raw {r['raw_gbs']:6.2f} GB/s  ({r['wrapper_vs_raw']:.2f})  baseline "
                f"{r['baseline_gbs']:6.2f} GB/s",
                flush=True,
            )
            rows.append(r)
    # Small pushes: 1-16 blocks, latency per push (issue 19), process pairs of their own.
    lat_pushes = 5 if args.quick else args.latency_pushes
    lat_repeats = 1 if args.quick else args.latency_repeats
    lat = bench_latency(4096, lat_pushes, lat_repeats)
    for r in lat:
        print(
            f"  {r['blocks']:>2} x 4 KiB   wrapper {r['wrapper_ms']:.3f} ms  raw "
            f"{r['raw_ms']:.3f} ms  ({r['wrapper_vs_raw']:.2f}); same processes: raw "
            f"{r['raw_same_ms']:.3f} ms ({r['wrapper_vs_raw_same']:.2f}), reposted "
            f"{r['raw_repost_ms']:.3f} ms ({r['wrapper_vs_raw_repost']:.2f})",
            flush=True,
        )
    text = markdown(info, rows) + "\n" + latency_markdown(lat, lat_pushes, lat_repeats)
    write_results(args, text, {"info": info, "results": rows, "latency": lat})
    if not all(r["correct"] for r in rows):
        print("a pushed block differs from its source")
        return 1
    return 0
