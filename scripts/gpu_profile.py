"""The workload of the `profile` step of scripts/gpu_check.sh: the benchmark's shapes
(pytrt_kv/bench.py, BENCHMARKS.md) for the two kernels whose targets were missed on the
first H200 run, a few calls each, so that ``ncu`` profiles exactly these launches:

- gather from device memory: 16 rows, K = 2048, TBS 1, KV 512 + rope 64 bfloat16, full
  and selection block size 64, kv_len 16384; three calls alternating two disjoint top-k
  sets (every id copied: the no-reuse case), i.e. gatherPlanKernel + gatherCopyKernel x 3;
- quantise on write: 4096 float16 tokens, 8 heads x 128, into float8 e4m3 caches with
  per-head scales, i.e. scatterQuantTokensKernel x 3 (and the plain scatter of the same
  tokens into float16 caches x 3, the target's baseline).

Every result is checked bit-exactly against the reference, so a profile never describes a
kernel that computes something else. ``--small`` shrinks the shapes for the rehearsal on
the emulated device (gpu_check.sh --dry-run). Framework-free like gpu_workload.py.

    ncu --section WarpStateStats ... python3 scripts/gpu_profile.py
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from pytrt_kv import ops
from pytrt_kv.contract.dtypes import numpy_dtype
from pytrt_kv.reference import gather_selection_kv_cache as ref_gather
from pytrt_kv.reference import scatter_pa_kv_cache as ref_scatter

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gpu_workload import dev, rand, same  # noqa: E402


def gather(rng: np.random.Generator, *, rows: int, K: int, calls: int) -> None:
    kv, rope, bs, dtype = 512, 64, 64, "bfloat16"
    kv_len = 8 * K
    fmax = -(-kv_len // bs)
    smax = -(-K // bs)
    full_kv = rand(rng, (rows * fmax, bs, kv), dtype)
    full_rope = rand(rng, (rows * fmax, bs, rope), dtype)
    sel_kv = np.zeros((rows * smax, bs, kv), full_kv.dtype)
    sel_rope = np.zeros((rows * smax, bs, rope), full_kv.dtype)
    sel_table = np.arange(rows * smax, dtype=np.int32).reshape(rows, smax)
    full_table = rng.permutation(rows * fmax).astype(np.int32).reshape(rows, fmax)
    status = np.full((rows, 1, 1, K + 1), -1, np.int32)
    lens = np.full(rows, kv_len, np.int32)
    q = np.ones(rows, np.int32)
    # Two disjoint sets a row, below kv_len - 1 (as bench._topk_pair at overlap 0).
    sets = np.empty((2, rows, 1, 1, K), np.int32)
    for r in range(rows):
        perm = rng.permutation(kv_len - 1)[: 2 * K].astype(np.int32)
        sets[0, r, 0, 0], sets[1, r, 0, 0] = perm[:K], perm[K:]
    d = [dev(sel_rope), dev(sel_kv), dev(sel_table), dev(status), None,
         dev(full_rope), dev(full_kv), dev(full_table), dev(lens), dev(q)]  # fmt: skip
    tops = [dev(sets[0]), dev(sets[1])]
    for call in range(calls):
        d[4] = tops[call % 2]
        out = ops.gather_selection_kv_cache(*d, selection_topk_block_size=1)
        want = ref_gather(sel_rope, sel_kv, sel_table, status, sets[call % 2], full_rope,
                          full_kv, full_table, lens, q, selection_topk_block_size=1)  # fmt: skip
        what = f"gather rows={rows} K={K} call {call}"
        same(out.get(), want, what + " actual_seq")
        same(d[3].get(), status, what + " status")
        same(d[1].get(), sel_kv, what + " selection_kv_cache")
        same(d[0].get(), sel_rope, what + " selection_k_rope")
    print(f"gpu_profile: gather rows={rows} K={K}: {calls} calls match the reference")


def quantise(rng: np.random.Generator, *, tokens: int, calls: int) -> None:
    H, D, BS = 8, 128, 16
    NB = max(2 * tokens // BS, 4)
    key = (rng.standard_normal((tokens, H, D)) * 50).astype(np.float16)
    value = (rng.standard_normal((tokens, H, D)) * 50).astype(np.float16)
    ks = (rng.random(H) + 0.5).astype(np.float32)
    vs = (rng.random(H) + 0.5).astype(np.float32)
    slots = rng.permutation(NB * BS)[:tokens].astype(np.int32)
    zeros = np.zeros((NB, BS, H, D), numpy_dtype("float8_e4m3fn"))
    ref_k, ref_v = zeros.copy(), zeros.copy()
    ref_scatter(key, value, ref_k, ref_v, slots, k_scale=ks, v_scale=vs)
    dk, dv, dkey, dval, dslots = dev(zeros), dev(zeros), dev(key), dev(value), dev(slots)
    dks, dvs = dev(ks), dev(vs)
    k16 = np.zeros((NB, BS, H, D), np.float16)
    d16k, d16v = dev(k16), dev(k16)
    for _ in range(calls):
        ops.scatter_pa_kv_cache(dkey, dval, dk, dv, dslots, k_scale=dks, v_scale=dvs)
        ops.scatter_pa_kv_cache(dkey, dval, d16k, d16v, dslots)
    same(dk.get(), ref_k, "quantise key_cache")
    same(dv.get(), ref_v, "quantise value_cache")
    print(f"gpu_profile: quantise tokens={tokens}: {calls} calls match the reference")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="rehearsal shapes (emulated device)")
    p.add_argument("--calls", type=int, default=3)
    a = p.parse_args(argv)
    rng = np.random.default_rng(11)
    if a.small:
        gather(rng, rows=2, K=64, calls=a.calls)
        quantise(rng, tokens=32, calls=a.calls)
    else:
        gather(rng, rows=16, K=2048, calls=a.calls)
        quantise(rng, tokens=4096, calls=a.calls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
