"""The gather planning code of the kernels (plugins/kernels/gatherPlan.h), compiled for
the host and run through ``pytrt_kv_gather_plan_rows_host``, against the reference's
``plan_row`` (OPS.md G5): same status, actual_seq, copy flags and skipped rows.

Needs libpytrt_kv_kernels.so (no GPU): skipped, with pytrt_kv._lib's reason, where the
package was built without nvcc.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pytrt_kv._gather import plan_row


def _ptr(a: np.ndarray, ctype):
    return a.ctypes.data_as(ctypes.POINTER(ctype))


def host_plan(lib, old: np.ndarray, topk: np.ndarray, kv_len: np.ndarray, s: np.ndarray,
              S: int, tbs: int):
    """Plan rows with the library: old [rows, K+1], topk [rows, K], kv_len/s [rows]."""
    rows, K = topk.shape
    old = np.ascontiguousarray(old, np.int32)
    topk = np.ascontiguousarray(topk, np.int32)
    kv_len = np.ascontiguousarray(kv_len, np.int32)
    s = np.ascontiguousarray(s, np.int32)
    status = np.full((rows, K + 1), -7, np.int32)
    copy = np.full((rows, max(K, 1)), 9, np.uint8)
    actual = np.full(rows, -7, np.int32)
    skipped = np.full(rows, 9, np.uint8)
    rc = lib.pytrt_kv_gather_plan_rows_host(
        rows, K, S, tbs, _ptr(old, ctypes.c_int32), _ptr(topk, ctypes.c_int32),
        _ptr(kv_len, ctypes.c_int32), _ptr(s, ctypes.c_int32), _ptr(status, ctypes.c_int32),
        _ptr(copy, ctypes.c_uint8), _ptr(actual, ctypes.c_int32), _ptr(skipped, ctypes.c_uint8))
    assert rc == 0, lib.pytrt_kv_get_last_error()
    return status, copy[:, :K].astype(bool), actual, skipped.astype(bool)


def assert_same_plans(lib, old, topk, kv_len, s, S, tbs):
    status, copy, actual, skipped = host_plan(lib, old, topk, kv_len, s, S, tbs)
    for r in range(topk.shape[0]):
        want = plan_row(old[r], topk[r], int(kv_len[r]), S, int(s[r]), tbs)
        ctx = (f"row {r}: old={old[r].tolist()} topk={topk[r].tolist()} kv_len={kv_len[r]} "
               f"S={S} s={s[r]} tbs={tbs}")
        assert skipped[r] == want.skipped, ctx
        assert status[r].tolist() == want.status.tolist(), ctx
        assert int(actual[r]) == want.actual_seq, ctx
        assert copy[r].tolist() == want.copy.tolist(), ctx
    return status


def random_topk(rng: np.random.Generator, K: int, max_id: int, pad: float,
                beyond: float) -> np.ndarray:
    """K entries: distinct valid ids in [0, max_id], padding (-1 and other negatives)
    anywhere, and ids past max_id."""
    valid = rng.permutation(max_id + 1)[:K]
    row = valid.astype(np.int64)
    for i in range(K):
        u = rng.random()
        if u < pad:
            row[i] = -1 if rng.random() < 0.7 else -int(rng.integers(2, 1000))
        elif u < pad + beyond:
            row[i] = max_id + 1 + int(rng.integers(0, 50))
    return row.astype(np.int32)


def run_steps(lib, rng, *, K, S, tbs, rows, steps, pad, beyond, reuse):
    """Multi-step decode: each step's status is the last step's output; topk overlaps the
    previous one by ``reuse`` so that ids really stay in place."""
    old = np.full((rows, K + 1), -1, np.int32)
    kv_len = rng.integers(1, 40, rows).astype(np.int64) * tbs // 2 + rng.integers(0, 3, rows)
    s = rng.integers(0, S, rows).astype(np.int32)
    prev = None
    for _ in range(steps):
        kv_len = kv_len + rng.integers(0, S + 1, rows)
        topk = np.empty((rows, K), np.int32)
        for r in range(rows):
            eff = int(kv_len[r]) - (S - 1 - int(s[r]))
            max_id = max((eff + tbs - 1) // tbs - 1, 0)
            row = random_topk(rng, K, max(max_id, K + 2), pad, beyond)
            if prev is not None and eff > 0:
                keep = [v for v in prev[r] if 0 <= v <= max_id]
                keep = [v for v in keep if rng.random() < reuse]
                row = np.array([v for v in row if v not in keep], np.int32)
                row = np.concatenate([np.array(keep, np.int32), row])[:K]
                rng.shuffle(row)
            topk[r] = row
        # Rows whose eff <= 0 or kv_len <= 0 are skipped (kept in the grid on purpose).
        status = assert_same_plans(lib, old, topk, kv_len.astype(np.int32), s, S, tbs)
        old, prev = status, topk


@pytest.mark.parametrize("tbs,K", [(1, 1), (1, 4), (1, 33), (1, 300), (2, 5), (4, 3),
                                   (4, 16), (16, 8), (64, 32), (3, 7)])
@pytest.mark.parametrize("S", [1, 2, 4])
def test_multi_step_grid(lib, rng, tbs, K, S):
    run_steps(lib, rng, K=K, S=S, tbs=tbs, rows=6, steps=4, pad=0.15, beyond=0.1, reuse=0.7)


def test_max_topk_uses_the_whole_scratch(lib, rng):
    """K = 2048 (OPS.md G2's maximum): the host planner's fixed scratch must hold 2*K ids."""
    run_steps(lib, rng, K=2048, S=1, tbs=1, rows=2, steps=2, pad=0.15, beyond=0.1, reuse=0.7)


def test_worked_examples_of_ops_md(lib):
    # OPS.md G6, TBS = 1, K = 4.
    old = np.full((1, 5), -1, np.int32)
    st1 = assert_same_plans(lib, old, np.array([[5, 9, 2, -1]]), np.array([10]),
                            np.array([0]), 1, 1)
    assert st1[0].tolist() == [5, 9, 2, -1, 3]
    st2 = assert_same_plans(lib, st1, np.array([[2, 7, 9, 1]]), np.array([11]),
                            np.array([0]), 1, 1)
    assert st2[0].tolist() == [7, 9, 2, 1, 4]
    # TBS = 4, K = 3.
    old = np.full((1, 4), -1, np.int32)
    st1 = assert_same_plans(lib, old, np.array([[0, 2, 1]]), np.array([10]), np.array([0]), 1, 4)
    assert st1[0].tolist() == [0, 1, 2, 10]
    st2 = assert_same_plans(lib, st1, np.array([[2, 0, -1]]), np.array([11]), np.array([0]), 1, 4)
    assert st2[0].tolist() == [0, 2, -1, 7]


@pytest.mark.parametrize("kv_len,S,s", [(0, 1, 0), (-3, 1, 0), (2, 4, 0), (3, 4, 0),
                                        (1, 2, 0), (4, 4, 0)])
def test_skipped_rows_keep_status(lib, rng, kv_len, S, s):
    old = np.array([[3, 1, 0, -1, 17]], np.int32)
    topk = rng.integers(-1, 6, (1, 4)).astype(np.int32)
    status, copy, actual, skipped = host_plan(lib, old, topk, np.array([kv_len]),
                                              np.array([s]), S, 4)
    want = plan_row(old[0], topk[0], kv_len, S, s, 4)
    assert bool(skipped[0]) == want.skipped
    if want.skipped:
        assert status[0].tolist() == old[0].tolist() and actual[0] == 0 and not copy.any()


def test_partial_tail_and_newest_tokens(lib):
    """The old partial tail and ids touching the newest S tokens are re-copied."""
    # TBS 4: old actual 10 -> slot 2 (id 2) was a partial tail; kv_len 14, S 2.
    old = np.array([[0, 1, 2, -1, 10]], np.int32)
    for topk in ([0, 1, 2, -1], [2, 1, 0, 3], [1, -1, 0, 2], [3, 2, 1, 0]):
        assert_same_plans(lib, old, np.array([topk]), np.array([14]), np.array([1]), 2, 4)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_rows_property(lib, data):
    tbs = data.draw(st.sampled_from([1, 1, 2, 3, 4, 8, 64]))
    K = data.draw(st.integers(1, 32 if tbs > 1 else 64))
    S = data.draw(st.integers(1, 4))
    s = data.draw(st.integers(0, S - 1))
    kv_len = data.draw(st.integers(-2, 6 * K * tbs // 2 + 8))
    eff = kv_len - (S - 1 - s)
    max_id = max((eff + tbs - 1) // tbs - 1, 0) if eff > 0 else 3 * K
    old_n = data.draw(st.integers(0, min(K, max_id + 4)))
    ids = data.draw(st.lists(st.integers(0, max_id + 3), min_size=old_n, max_size=old_n,
                             unique=True))
    old = np.array(ids + [-1] * (K - old_n) + [data.draw(st.integers(-1, K * tbs))],
                   np.int32)
    valid = data.draw(st.lists(st.integers(0, max_id), max_size=K, unique=True))
    noise = data.draw(st.lists(st.one_of(st.integers(-5, -1), st.integers(max_id + 1,
                                                                           max_id + 9)),
                               min_size=K - len(valid), max_size=K - len(valid)))
    row = valid + noise
    order = data.draw(st.permutations(range(K)))
    topk = np.array([row[i] for i in order], np.int32)
    assert_same_plans(lib, old[None], topk[None], np.array([kv_len]), np.array([s]), S, tbs)


def test_duplicates_stay_in_bounds(lib, rng):
    """Duplicated ids (the reference raises): any placement, but every written slot is in
    [0, K) and the status row keeps its K+1 entries."""
    K, tbs = 8, 1
    for _ in range(50):
        topk = rng.integers(-1, 5, (1, K)).astype(np.int32)
        old = np.concatenate([rng.integers(-1, 5, K), [rng.integers(0, 9)]])[None]
        status, copy, actual, skipped = host_plan(lib, old.astype(np.int32), topk,
                                                  np.array([12]), np.array([0]), 1, tbs)
        n = int(((topk >= 0) & (topk <= 11)).sum())
        assert not skipped[0]
        assert (status[0, n:K] == -1).all() and int(status[0, K]) == int(actual[0]) == n
        assert sorted(status[0, :n].tolist()) == sorted(t for t in topk[0].tolist() if t >= 0)


def test_refuses_bad_sizes(lib):
    z = np.zeros(4, np.int32)
    p = _ptr(z, ctypes.c_int32)
    u = _ptr(np.zeros(4, np.uint8), ctypes.c_uint8)
    for rows, K, S, tbs in [(1, 2049, 1, 1), (1, 2, 0, 1), (1, 2, 1, 0), (-1, 2, 1, 1)]:
        assert lib.pytrt_kv_gather_plan_rows_host(rows, K, S, tbs, p, p, p, p, p, u, p, u) == 1
        assert lib.pytrt_kv_get_last_error()
