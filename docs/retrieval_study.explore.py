"""The selector exploration of docs/RETRIEVAL.md ("Selectors measured at 8000 tokens").

Usage: PYTHONPATH=. python docs/retrieval_study.explore.py N LENGTH OUT.jsonl [START
[THREADS [reverse|forward [METHODS]]]] (METHODS: comma-separated, instead of the list
below). Single needle, trial i of N at depth (i + 0.5)/N of the retrievable
span (its own haystack and needle, seed [0, 1000 + i]), every method at the main
(0.1:32:128:896) and the tight (0.068:32:64:448) setting, and mean, mass, oracle with
16-token blocks; one JSON line per (trial, method), with the seconds it took.
"""

import json
import sys
import time

import numpy as np
import torch
from transformers import DynamicCache

from pytrt_kv.retrieval.study import Method, StudySettings, attention_state, load_model
from pytrt_kv.retrieval.study.methods import set_method
from pytrt_kv.retrieval.study.model import crop, forward, study_text
from pytrt_kv.retrieval.study.tasks import DENSE, NEVER, Trial, _budget, needle_prompt

N = int(sys.argv[1])
LENGTH = int(sys.argv[2])
out = open(sys.argv[3], "a")
start = int(sys.argv[4]) if len(sys.argv) > 4 else 0
main = (0.1, 32, 128, 896)
tight = (0.068, 32, 64, 448)
ALL = [
    "window",
    "random",
    "random_fixed",
    "mean",
    "minmax",
    "mass",
    "massz",
    "kmeans2",
    "kmeans2_massz",
    "kmeans4",
    "kmeans4_massz",
    "outlier4",
    "outlier4_massz",
    "blockmass",
    "oracle",
]
SMALL = ["mean", "mass", "oracle"]
if len(sys.argv) > 7:  # a comma-separated list of methods instead of ALL
    ALL = sys.argv[7].split(",")
    SMALL = []
plan = [(s, n) for s in (main, tight) for n in ALL]
plan += [((0.1, 16, 128, 896), n) for n in SMALL]
settings = StudySettings(
    lengths=(LENGTH,), trials=(N,), settings=(main, tight), curve_block_sizes=(8, 16)
)
torch.set_num_threads(int(sys.argv[5]) if len(sys.argv) > 5 else 1)
model, tok = load_model()
st = attention_state(model)
hay = tok(study_text(0), add_special_tokens=False).input_ids
order = (
    range(N - 1, start - 1, -1)
    if len(sys.argv) > 6 and sys.argv[6] == "reverse"
    else range(start, N)
)
for i in order:
    trial = Trial("single", LENGTH, (i + 0.5) / N, i, False)
    rng = np.random.default_rng([0, 1000 + i])
    prompt, q, a, ranges = needle_prompt(tok, trial, settings, hay, rng)
    P = len(prompt)
    cache = DynamicCache()
    set_method(st, DENSE, NEVER)
    t0 = time.time()
    forward(model, torch.tensor([prompt]), cache)
    tp = time.time() - t0
    feed = torch.tensor([q + a[:-1]])
    ms = [DENSE] + [Method(n, *s) for s, n in plan]
    for m in ms:
        set_method(st, m, P, seed=i)
        t0 = time.time()
        logits = forward(model, feed, cache).logits[0, len(q) - 1 :]
        crop(cache, P)
        ok = (logits.argmax(-1) == torch.tensor(a)).tolist()
        out.write(
            json.dumps(
                {
                    "trial": i,
                    "depth": trial.depth,
                    "length": LENGTH,
                    "method": m.label,
                    "name": m.name,
                    "setting": m.setting,
                    "budget": _budget(m, P + 1),
                    "found": int(all(ok)),
                    "seconds": round(time.time() - t0, 3),
                    "prefill": round(tp, 2),
                }
            )
            + "\n"
        )
        out.flush()
    print("trial", i, "done", flush=True)
