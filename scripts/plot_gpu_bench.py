"""Kernel times against the same-run baselines, from the JSON of `pytrt-kv bench`
(scripts/gpu_check.sh writes OUT/bench-<op>.json): one PNG with three panels, all in CUDA
graph replay (microseconds per call, log-log):

- scatter: the kernel, device copy of the same bytes, torch ``index_copy_``, the Triton
  scatter, per token count;
- gather from device memory, no reuse: the kernel, device copy of the gathered bytes, torch
  indexing, per row count;
- gather from pinned host memory, no reuse: the kernel and the pinned H2D copy.

It also prints quantise-on-write against copy bandwidth (issue 36's target, >= 0.85):
the quantising scatter reads 2 bytes (float16) and writes 1 (e4m3) per element, the copy
of the scatter benchmark reads and writes 2 of the same element count (same H, D, tokens),
so ``copy_ratio = (3 / 4) * copy_graph_us / kernel_graph_us``.

    python3 scripts/plot_gpu_bench.py benchmarks/results/h200-2026-11-27 \\
        --output docs/gpu_bench_h200.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def load(folder: Path, op: str) -> dict[str, Any]:
    """``folder/bench-<op>.json``: its ``info`` and its ``results[op]`` rows (non-empty)."""
    path = folder / f"bench-{op}.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SystemExit(f"plot_gpu_bench: {path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise SystemExit(f"plot_gpu_bench: {path} is not JSON: {exc}") from None
    rows = data.get("results", {}).get(op) if isinstance(data, dict) else None
    if not isinstance(rows, list) or not rows:
        raise SystemExit(f"plot_gpu_bench: {path}: expected results.{op} to be a non-empty list")
    return {"info": data.get("info", {}), "rows": rows}


def _series(rows: list[dict[str, Any]], x: str, keys: list[str]) -> dict[str, list[Any]]:
    """Columns ``x`` and ``keys`` of the rows that have them all."""
    kept = [r for r in rows if all(isinstance(r.get(k), (int, float)) for k in [x, *keys])]
    return {k: [r[k] for r in kept] for k in [x, *keys]}


def quant_copy_ratios(scatter: list[dict[str, Any]], quant: list[dict[str, Any]]) -> list[dict]:
    """Per token count in both runs: quantise-on-write bandwidth / copy bandwidth."""
    copy = {r["tokens"]: r for r in scatter}
    out = []
    for q in quant:
        s = copy.get(q["tokens"])
        if s is None or (s.get("heads"), s.get("dim")) != (8, 128):
            continue  # bench_quant's H = 8, D = 128; the copy must be of the same elements
        ratio = 0.75 * s["copy_graph_us"] / q["kernel_graph_us"]
        out.append(
            {
                "tokens": q["tokens"],
                "quant_graph_us": q["kernel_graph_us"],
                "copy_graph_us": s["copy_graph_us"],
                "copy_ratio": ratio,
            }
        )
    return out


def plot(folder: Path, output: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scatter, gather = load(folder, "scatter"), load(folder, "gather")
    info = scatter["info"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    panels = [
        (
            "scatter nd bf16 (H=8, D=128)",
            "tokens",
            scatter["rows"],
            [
                ("kernel_graph_us", "pytrt_kv kernel"),
                ("copy_graph_us", "device copy, same bytes"),
                ("torch_graph_us", "torch index_copy_"),
                ("triton_graph_us", "Triton scatter"),
            ],
        ),
        (
            "gather from device memory (K=2048, no reuse)",
            "rows",
            [r for r in gather["rows"] if "device" in r["op"] and r["overlap"] == 0],
            [
                ("kernel_graph_us", "pytrt_kv kernel"),
                ("copy_graph_us", "device copy, same bytes"),
                ("torch_graph_us", "torch indexing"),
            ],
        ),
        (
            "gather from pinned host memory (no reuse)",
            "rows",
            [r for r in gather["rows"] if "host" in r["op"] and r["overlap"] == 0],
            [
                ("kernel_graph_us", "pytrt_kv kernel"),
                ("copy_graph_us", "pinned H2D copy, same bytes"),
            ],
        ),
    ]
    for ax, (title, x, rows, lines) in zip(axes, panels, strict=True):
        for key, label in lines:
            s = _series(rows, x, [key])
            if s[x]:
                ax.plot(s[x], s[key], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(x)
        ax.set_ylabel("µs per call (CUDA graph replay)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"{info.get('device', '?')}, {info.get('driver', '?')}, torch {info.get('torch', '?')}, "
        f"{info.get('date', '?')}"
    )
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path, help="folder with bench-scatter/gather/quant.json")
    p.add_argument("--output", type=Path, help="PNG to write (default: only the table)")
    args = p.parse_args(argv)
    if args.output:
        plot(args.folder, args.output)
        print(f"wrote {args.output}")
    if (args.folder / "bench-quant.json").exists():
        scatter, quant = load(args.folder, "scatter"), load(args.folder, "quant")
        print("| tokens | quant_graph_us | copy_graph_us (scatter run) | quant / copy bandwidth |")
        print("|---|---|---|---|")
        for r in quant_copy_ratios(scatter["rows"], quant["rows"]):
            print(
                f"| {r['tokens']} | {r['quant_graph_us']:.2f} | {r['copy_graph_us']:.2f} "
                f"| {r['copy_ratio']:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
