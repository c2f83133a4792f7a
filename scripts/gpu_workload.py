"""A small, framework-free run of every kernel path, checked bit-exactly against the
reference: the workload of ``compute-sanitizer`` (memcheck, racecheck, synccheck, initcheck) in
scripts/gpu_check.sh. Uses only NumPy and the kernel library (device buffers are
``pytrt_kv._cuda.DeviceArray``, host-resident full caches are pinned NumPy arrays), so the
sanitizer sees our kernels and nothing of torch or CuPy.

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/gpu_workload.py

It lives beside gpu_check.sh because it is a check, not a benchmark: the benchmark is
``pytrt-kv bench`` (``pytrt_kv/bench.py``, shipped in the wheel; BENCHMARKS.md).
"""

from __future__ import annotations

import sys

import numpy as np

from pytrt_kv import _cuda, ops
from pytrt_kv.contract.dtypes import numpy_dtype
from pytrt_kv.contract.layouts import LAYOUTS
from pytrt_kv.reference import gather_selection_kv_cache as ref_gather
from pytrt_kv.reference import scatter_pa_kv_cache as ref_scatter

BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def dev(a):
    return None if a is None else _cuda.DeviceArray.from_numpy(a)


def same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    g = np.ascontiguousarray(got).view(BITS[got.dtype.itemsize])
    w = np.ascontiguousarray(want).view(BITS[want.dtype.itemsize])
    if not np.array_equal(g, w):
        raise SystemExit(f"MISMATCH: {what}: {int((g != w).sum())} elements differ")


def rand(rng, shape, dtype):
    return (rng.uniform(0.5, 3.0, shape) * rng.choice([-1, 1], shape)).astype(numpy_dtype(dtype))


def scatter_cases(rng):
    # hnd with D = 24 bf16: 3 vectors per segment, the kernel's non-power-of-two path.
    for layout, D in (("nd", 32), ("hnd", 32), ("nz", 32), ("hnd", 24)):
        for dtype in ("bfloat16", "int8", "float32"):
            T, H, NB, BS = 37, 2, 7, 9
            shape = LAYOUTS[layout].shape(NB, BS, H, D, numpy_dtype(dtype).itemsize)
            key = rand(rng, (T, H, D), dtype if dtype != "int8" else "float32").astype(
                numpy_dtype(dtype)
            )
            slots = rng.permutation(NB * BS)[:T].astype(np.int64)
            slots[::5] = -1
            slots[1] = NB * BS + 3  # out of range: skipped by the kernel
            cache = np.full(shape, 3, numpy_dtype(dtype))
            want = cache.copy()
            ref_scatter(
                key,
                key,
                want,
                want.copy(),
                np.where(slots >= NB * BS, -1, slots),
                cache_layout=layout,
            )
            dk, dc, dv, dvc = dev(key), dev(cache), dev(key), dev(cache)
            ops.scatter_pa_kv_cache(dk, dv, dc, dvc, dev(slots), cache_layout=layout)
            same(dc.get(), want, f"scatter {layout} D={D} {dtype}")
    for mode, dtype in (("rope", "bfloat16"), ("omni", "float16"), ("alibi", "int8")):
        B, Smax, H, D, NB, BS = 2, 9, 2, 64, 12, 5
        key = rand(rng, (B, Smax, H, D), "float32").astype(numpy_dtype(dtype))
        seq = np.array([9, 6], np.int32)
        lens = np.array([[3, 0], [2, 6]], np.int32)
        offs = np.array([2, -1, 4, -1], np.int32)
        if mode == "alibi":
            offs = None
        base = np.array([[0, 10], [20, 57]], np.int32)  # the last run passes NB*BS = 60
        cache = np.full((NB, BS, 1, D), 3, numpy_dtype(dtype))
        want = cache.copy()
        ok_base = base.copy()
        ok_base[1, 1] = -1
        ref_scatter(
            key,
            None,
            want,
            None,
            ok_base,
            compress_lens=lens,
            compress_seq_offsets=offs,
            seq_lens=seq,
            compress_mode=mode,
        )
        dc = dev(cache)
        # First the valid bases, compared; then the run that reaches past the cache:
        # written only inside it.
        for slots, expect in ((ok_base, want), (base, None)):
            ops.scatter_pa_kv_cache(
                dev(key),
                None,
                dc,
                None,
                dev(slots),
                compress_lens=dev(lens),
                compress_seq_offsets=dev(offs),
                seq_lens=dev(seq),
                compress_mode=mode,
            )
            got = dc.get()
            if expect is not None:
                same(got, expect, f"scatter compress {mode}")


def wide(rng, shape, dtype, *, nan):
    """Magnitudes 2^-16 .. 2^12 (under, inside and over e4m3's range once scaled) with
    zeros, infinities and (e4m3 caches) NaN of both signs: every conversion branch."""
    x = rng.choice([-1.0, 1.0], shape) * 2.0 ** rng.uniform(-16, 12, shape)
    specials = [0.0, -0.0, np.inf, -np.inf, 448.0, 464.0] + ([np.nan, -np.nan] if nan else [])
    flat = x.reshape(-1)
    flat[rng.choice(flat.size, len(specials), replace=False)] = specials
    return x.astype(numpy_dtype(dtype))


def quantise_cases(rng):
    """Quantise on write (docs/SPEC.md S9): f16/bf16/f32 into e4m3 and int8 caches, per-tensor
    and per-head scales, every layout; D = 7 makes the element-at-a-time path."""
    for layout, D in (("nd", 64), ("hnd", 64), ("nz", 64), ("nd", 7)):
        for src in ("float16", "bfloat16", "float32"):
            for cache_dt in ("float8_e4m3fn", "int8"):
                for per_head in (False, True):
                    T, H, NB, BS = 21, 2, 5, 8
                    item = numpy_dtype(cache_dt).itemsize
                    shape = LAYOUTS[layout].shape(NB, BS, H, D, item)
                    nan = cache_dt == "float8_e4m3fn"
                    key, value = (
                        wide(rng, (T, H, D), src, nan=nan),
                        wide(rng, (T, H, D), src, nan=nan),
                    )
                    ks = rng.uniform(0.25, 4.0, H) if per_head else rng.uniform(0.25, 4.0, ())
                    vs = rng.uniform(0.25, 4.0, H) if per_head else rng.uniform(0.25, 4.0, ())
                    ks, vs = np.asarray(ks, np.float32), np.asarray(vs, np.float32)
                    slots = rng.permutation(NB * BS)[:T].astype(np.int32)
                    slots[::4] = -1
                    kc = np.full(shape, 3, numpy_dtype(cache_dt))
                    want_k, want_v = kc.copy(), kc.copy()
                    ref_scatter(key, value, want_k, want_v, slots, cache_layout=layout,
                                k_scale=ks, v_scale=vs)  # fmt: skip
                    dkc, dvc = dev(kc), dev(kc)
                    ops.scatter_pa_kv_cache(dev(key), dev(value), dkc, dvc, dev(slots),
                                            cache_layout=layout, k_scale=dev(ks),
                                            v_scale=dev(vs))  # fmt: skip
                    what = f"quantise {layout} D={D} {src}->{cache_dt} per_head={per_head}"
                    same(dkc.get(), want_k, what + " key_cache")
                    same(dvc.get(), want_v, what + " value_cache")


def gather_case(rng, *, K, tbs, sbs, fbs, S, rope, host, steps=3):
    B, kv, dtype = 2, 96, "bfloat16"
    fmax = max(-(-2 * K * tbs // fbs), 3)
    fbn, R = B * fmax + 1, B * S + 1
    smax = -(-K * tbs // sbs)
    sbn = R * smax
    full_kv = rand(rng, (fbn, fbs, kv), dtype)
    full_rope = rand(rng, (fbn, fbs, rope), dtype) if rope else np.zeros(0, full_kv.dtype)
    sel_kv = np.full((sbn, sbs, kv), 3, full_kv.dtype)
    sel_rope = np.full((sbn, sbs, rope), 3, full_kv.dtype) if rope else np.zeros(0, full_kv.dtype)
    sel_table = rng.permutation(sbn).reshape(R, smax).astype(np.int32)
    full_table = rng.permutation(fbn)[: B * fmax].reshape(B, fmax).astype(np.int32)
    status = np.full((B, S, 1, K + 1), -1, np.int32)
    kv_len = np.array([fmax * fbs - S, K * tbs // 2 + 1], np.int32)
    q = np.ones(B, np.int32)
    pinned = []
    if host:
        pinned = [_cuda.PinnedHost(full_kv)] + ([_cuda.PinnedHost(full_rope)] if rope else [])
        d_full_kv, d_full_rope = full_kv, full_rope
    else:
        d_full_kv, d_full_rope = dev(full_kv), dev(full_rope)
    d = [
        dev(sel_rope),
        dev(sel_kv),
        dev(sel_table),
        dev(status),
        None,
        d_full_rope,
        d_full_kv,
        dev(full_table),
        None,
        dev(q),
    ]
    prev = None
    for step in range(steps):
        topk = np.full((B, S, 1, K), -1, np.int32)
        for r in range(B * S):
            b, s = divmod(r, S)
            eff = int(kv_len[b]) - (S - 1 - s)
            max_id = -(-eff // tbs) - 1
            ids = list(rng.permutation(max_id + 1)[:K])
            if prev is not None:
                keep = [v for v in prev.reshape(-1, K)[r] if 0 <= v <= max_id][: K // 2]
                ids = keep + [v for v in ids if v not in keep]
            row = np.array(ids[:K] + [-1] * K, np.int64)[:K]
            row[rng.random(K) < 0.2] = -1
            topk.reshape(-1, K)[r] = row
        prev = topk
        d[4], d[8] = dev(topk), dev(kv_len)
        want = ref_gather(
            sel_rope,
            sel_kv,
            sel_table,
            status,
            topk,
            full_rope,
            full_kv,
            full_table,
            kv_len,
            q,
            selection_topk_block_size=tbs,
        )
        out = ops.gather_selection_kv_cache(*d, selection_topk_block_size=tbs)
        what = f"gather K={K} tbs={tbs} S={S} rope={rope} host={host} step={step}"
        same(out.get(), want, what + " actual_seq")
        same(d[3].get(), status, what + " status")
        same(d[1].get(), sel_kv, what + " selection_kv_cache")
        if rope:
            same(d[0].get(), sel_rope, what + " selection_k_rope")
        kv_len = kv_len + np.array([0, S], np.int32)
    for p in pinned:
        p.close()


def main() -> int:
    rng = np.random.default_rng(7)
    scatter_cases(rng)
    quantise_cases(rng)
    for host in (False, True):
        gather_case(rng, K=2048, tbs=1, sbs=64, fbs=64, S=1, rope=16, host=host)
        gather_case(rng, K=8, tbs=4, sbs=8, fbs=12, S=2, rope=0, host=host)
    gather_case(rng, K=33, tbs=1, sbs=5, fbs=7, S=3, rope=8, host=False)
    gather_case(rng, K=40, tbs=4, sbs=16, fbs=8, S=2, rope=8, host=True)  # K > 32, TBS > 1
    print("gpu_workload: all kernel paths match the reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
