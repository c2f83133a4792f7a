"""The selector exploration of docs/RETRIEVAL.md ("Selectors measured at 8000 tokens").

Usage: PYTHONPATH=. python docs/retrieval_study.explore.py N LENGTH OUT.jsonl [START
[THREADS [reverse|forward|spread [METHODS]]]] (METHODS: comma-separated, instead of the
list below; spread: the trials in an order that covers the depths evenly at any point,
for a run that may be cut short). Single needle, trial i of N at depth (i + 0.5)/N of
the retrievable span (its own haystack and needle, seed [0, 1000 + i]), every method at
the main (0.1:32:128:896) and the tight (0.068:32:64:448) setting, and mean, mass, oracle
with 16-token blocks; one JSON line per (trial, method), with the seconds it took.

Environment: PYTRT_KV_STUDY_DEVICE (a torch device, default cpu; the GPU run of
RETRIEVAL.md used cuda), PYTRT_KV_STUDY_DEADLINE (seconds: no trial starts after them),
PYTRT_KV_STUDY_SMALL (comma-separated: the methods also run with 16-token blocks;
default mean,mass,oracle, none with METHODS), PYTRT_KV_STUDY_MODEL (the GGUF file;
default the installed wheel's). The heavy4 candidates make the prefill record each key's
received attention (window 128). The *_cal candidates take their basis from one dense
prefill of a calibration text of another kind than the haystack: the source code of the
standard library's argparse module, its first 4096 tokens (PYTRT_KV_STUDY_CALIBRATION
names another module), the first 128 tokens left out.
"""

import json
import os
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
if "PYTRT_KV_STUDY_SMALL" in os.environ:
    SMALL = [n for n in os.environ["PYTRT_KV_STUDY_SMALL"].split(",") if n]
DEVICE = os.environ.get("PYTRT_KV_STUDY_DEVICE", "cpu")
DEADLINE = time.time() + float(os.environ.get("PYTRT_KV_STUDY_DEADLINE", "inf"))
plan = [(s, n) for s in (main, tight) for n in ALL]
plan += [((0.1, 16, 128, 896), n) for n in SMALL]
settings = StudySettings(
    lengths=(LENGTH,), trials=(N,), settings=(main, tight), curve_block_sizes=(8, 16)
)
torch.set_num_threads(int(sys.argv[5]) if len(sys.argv) > 5 else 1)
model, tok = load_model(os.environ.get("PYTRT_KV_STUDY_MODEL"), device=DEVICE)
st = attention_state(model)
if any(n.startswith("heavy") for n in ALL + SMALL):
    st.heavy_window = 128
if any(n.endswith("_cal") for n in ALL + SMALL):
    import importlib
    import inspect

    from pytrt_kv.retrieval.study.attention import calibrate

    source = inspect.getsource(
        importlib.import_module(os.environ.get("PYTRT_KV_STUDY_CALIBRATION", "argparse"))
    )
    ids = tok(source, add_special_tokens=False).input_ids[:4096]
    st.record = {}
    forward(model, torch.tensor([ids]), DynamicCache())
    calibrate(st, st.record, rank=32, skip=128)
    st.record = None
    print(f"calibrated on {len(ids)} tokens", flush=True)
hay = tok(study_text(0), add_special_tokens=False).input_ids
how = sys.argv[6] if len(sys.argv) > 6 else "forward"
order = range(N - 1, start - 1, -1) if how == "reverse" else range(start, N)
if how == "spread":  # depths covered evenly at any point: bit-reversed trial order
    bits = max(1, (N - 1).bit_length())
    order = sorted(order, key=lambda i: int(f"{i:0{bits}b}"[::-1], 2))
if os.environ.get("PYTRT_KV_STUDY_TRIALS"):  # only these trials (comma-separated)
    keep = {int(x) for x in os.environ["PYTRT_KV_STUDY_TRIALS"].split(",")}
    order = [i for i in order if i in keep]
for i in order:
    if time.time() > DEADLINE:
        print("deadline: stopped before trial", i, flush=True)
        break
    trial = Trial("single", LENGTH, (i + 0.5) / N, i, False)
    rng = np.random.default_rng([0, 1000 + i])
    prompt, q, a, ranges = needle_prompt(tok, trial, settings, hay, rng)
    P = len(prompt)
    cache = DynamicCache()
    set_method(st, DENSE, NEVER)
    t0 = time.time()
    st.importance.clear()
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
