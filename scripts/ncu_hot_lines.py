"""The hottest CUDA source lines of one kernel in the source page that the `profile` step of
scripts/gpu_check.sh writes (OUT/profile-source.csv: `ncu --page source --csv
--print-source cuda,sass`), summed over the kernel's profiled launches, with the three
largest stall reasons of each line. BENCHMARKS.md quotes its output.

    python3 scripts/ncu_hot_lines.py OUT/profile-source.csv gatherPlanKernel [--top 25]
        [--column "Instructions Executed"]
"""

from __future__ import annotations

import argparse
import collections
import csv
import sys


def hot_lines(path: str, kernel: str, column: str) -> tuple[int, list[tuple[str, int, str, str]]]:
    """(total, [(file:line, value, source, top stalls), ...] hottest first)."""
    total = 0
    value: collections.Counter[str] = collections.Counter()
    stalls: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    source: dict[str, str] = {}
    file = func = ""
    header: list[str] | None = None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "File Path":
                file = row[1].rsplit("/", 1)[-1]
            elif row[0] == "Function Name":
                func = row[1]
            elif row[0] == "Line No":
                header = row
            elif header is not None and kernel in func:
                d = dict(zip(header, row))
                if d.get("Address") != "-":  # a SASS row; the CUDA line sums them
                    continue
                try:
                    v = int(d[column].replace(",", ""))
                except (KeyError, ValueError):
                    continue
                key = f"{file}:{d['Line No']}"
                value[key] += v
                total += v
                source[key] = row[1].strip()[:110]
                for h, x in d.items():
                    if h.startswith("stall_") and "(Not" not in h and x.isdigit():
                        stalls[key][h[6:]] += int(x)
    out = []
    for key, v in value.most_common():
        top = ", ".join(f"{k}={n}" for k, n in stalls[key].most_common(3) if n)
        out.append((key, v, source[key], top))
    return total, out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv")
    p.add_argument("kernel", help="a substring of the kernel's function name")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--column", default="Warp Stall Sampling (All Samples)")
    a = p.parse_args(argv)
    total, rows = hot_lines(a.csv, a.kernel, a.column)
    if not rows:
        print(f"no rows for kernel {a.kernel!r} in {a.csv}", file=sys.stderr)
        return 1
    print(f"{a.kernel}: {a.column}, total {total}")
    for key, v, src, top in rows[: a.top]:
        print(f"{v:9d} {key}  {src}  [{top}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
