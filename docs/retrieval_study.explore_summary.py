"""The tables of docs/RETRIEVAL.md from rows of docs/retrieval_study.explore.py.

Usage: PYTHONPATH=. python docs/retrieval_study.explore_summary.py ROWS.jsonl [...]

Per setting, per method: the trials it ran, the needles it found, the oracle's on the same
trials and the ratio, and exact McNemar p against the window and both random baselines,
paired on the trials both ran. A (trial, method) row met twice counts once (the first).
"""

import json
import sys
from collections import defaultdict

from pytrt_kv.retrieval.study.statistics import mcnemar

found: dict[str, dict[int, int]] = defaultdict(dict)
budget: dict[str, float] = {}
for path in sys.argv[1:]:
    for line in open(path):
        r = json.loads(line)
        found[r["method"]].setdefault(r["trial"], r["found"])
        budget[r["setting"]] = r["budget"]


def paired(a: str, b: str) -> str:
    if b not in found or a == b:
        return "-"
    common = sorted(found[a].keys() & found[b].keys())
    p = mcnemar([found[a][t] for t in common], [found[b][t] for t in common])[2]
    return f"{p:.2g}"


dense = found.get("dense", {})
print(f"dense: {sum(dense.values())} of {len(dense)} trials\n")
for setting in sorted({m.split(" ", 1)[1] for m in found if " " in m}, reverse=True):
    print(f"{setting} ({100 * budget[setting]:.1f}% attended at the question)\n")
    print(
        "| method | trials | found | oracle on them | of the oracle | p window | p random "
        "| p random_fixed |"
    )
    print("|---|---|---|---|---|---|---|---|")
    labels = [m for m in found if m.endswith(" " + setting)]
    labels.sort(key=lambda m: -sum(found[m].values()) / len(found[m]))
    for m in labels:
        trials = found[m].keys()
        oracle = found.get("oracle " + setting, {})
        o = sum(oracle.get(t, 0) for t in trials)
        f = sum(found[m].values())
        ratio = f"{f / o:.2f}" if o else "-"
        name = m.rsplit(" " + setting, 1)[0]
        print(
            f"| {name} | {len(trials)} | {f} | {o} | {ratio} | "
            f"{paired(m, 'window ' + setting)} | {paired(m, 'random ' + setting)} | "
            f"{paired(m, 'random_fixed ' + setting)} |"
        )
    print()
