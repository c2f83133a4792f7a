"""The gather planning code of the kernels (plugins/kernels/gatherPlan.h), compiled for
the host, against the reference (pytrt_kv/reference.py plan_row, docs/SPEC.md G3-G5).

gatherPlan.h holds the planning kernel's phases once, for the GPU and the host: the host
entry points run the very same code (hash, scan, miss-list compaction) for every virtual
thread in turn. Two entry points are tested:

* ``pytrt_kv_gather_plan_rows_host``: independent rows against ``plan_row`` (status,
  actual_seq, copy flags, skipped rows);
* ``pytrt_kv_gather_plan_host``: the planning step of a whole call (same checks as the
  launch) against the reference op over multi-step decodes: status, actual_seq of every
  table row, the compacted miss list the copy kernel walks (equal to the reference's
  copied set, addresses included) and the bytes that list moves.

Needs libpytrt_kv_kernels.so (no GPU): skipped, with pytrt_kv._lib's reason, where the
package was built without nvcc.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pytrt_kv import _cuda, reference
from pytrt_kv.contract import gather as _gather
from pytrt_kv.reference import id_size, plan_row
from support.op_names import GATHER_PLAN_POINTERS


def _ptr(a: np.ndarray, ctype):
    return a.ctypes.data_as(ctypes.POINTER(ctype))


def host_plan(
    lib, old: np.ndarray, topk: np.ndarray, kv_len: np.ndarray, s: np.ndarray, S: int, tbs: int
):
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
        rows,
        K,
        S,
        tbs,
        _ptr(old, ctypes.c_int32),
        _ptr(topk, ctypes.c_int32),
        _ptr(kv_len, ctypes.c_int32),
        _ptr(s, ctypes.c_int32),
        _ptr(status, ctypes.c_int32),
        _ptr(copy, ctypes.c_uint8),
        _ptr(actual, ctypes.c_int32),
        _ptr(skipped, ctypes.c_uint8),
    )
    assert rc == 0, lib.pytrt_kv_get_last_error()
    return status, copy[:, :K].astype(bool), actual, skipped.astype(bool)


def assert_same_plans(lib, old, topk, kv_len, s, S, tbs):
    status, copy, actual, skipped = host_plan(lib, old, topk, kv_len, s, S, tbs)
    for r in range(topk.shape[0]):
        want = plan_row(old[r], topk[r], int(kv_len[r]), S, int(s[r]), tbs)
        ctx = (
            f"row {r}: old={old[r].tolist()} topk={topk[r].tolist()} kv_len={kv_len[r]} "
            f"S={S} s={s[r]} tbs={tbs}"
        )
        assert skipped[r] == want.skipped, ctx
        assert status[r].tolist() == want.status.tolist(), ctx
        assert int(actual[r]) == want.actual_seq, ctx
        assert copy[r].tolist() == want.copy.tolist(), ctx
    return status


def random_topk(
    rng: np.random.Generator, K: int, max_id: int, pad: float, beyond: float
) -> np.ndarray:
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


@pytest.mark.parametrize(
    "tbs,K", [(1, 1), (1, 4), (1, 33), (1, 300), (2, 5), (4, 3), (4, 16), (16, 8), (64, 32), (3, 7)]
)
@pytest.mark.parametrize("S", [1, 2, 4])
def test_multi_step_grid(lib, rng, tbs, K, S):
    run_steps(lib, rng, K=K, S=S, tbs=tbs, rows=6, steps=4, pad=0.15, beyond=0.1, reuse=0.7)


def test_max_topk_uses_the_whole_scratch(lib, rng):
    """K = 2048 (docs/SPEC.md G2's maximum): the host planner's fixed scratch must hold 2*K ids."""
    run_steps(lib, rng, K=2048, S=1, tbs=1, rows=2, steps=2, pad=0.15, beyond=0.1, reuse=0.7)


def test_worked_examples_of_ops_md(lib):
    # docs/SPEC.md G6, TBS = 1, K = 4.
    old = np.full((1, 5), -1, np.int32)
    st1 = assert_same_plans(
        lib, old, np.array([[5, 9, 2, -1]]), np.array([10]), np.array([0]), 1, 1
    )
    assert st1[0].tolist() == [5, 9, 2, -1, 3]
    st2 = assert_same_plans(lib, st1, np.array([[2, 7, 9, 1]]), np.array([11]), np.array([0]), 1, 1)
    assert st2[0].tolist() == [7, 9, 2, 1, 4]
    # TBS = 4, K = 3.
    old = np.full((1, 4), -1, np.int32)
    st1 = assert_same_plans(lib, old, np.array([[0, 2, 1]]), np.array([10]), np.array([0]), 1, 4)
    assert st1[0].tolist() == [0, 1, 2, 10]
    st2 = assert_same_plans(lib, st1, np.array([[2, 0, -1]]), np.array([11]), np.array([0]), 1, 4)
    assert st2[0].tolist() == [0, 2, -1, 7]


@pytest.mark.parametrize(
    "kv_len,S,s", [(0, 1, 0), (-3, 1, 0), (2, 4, 0), (3, 4, 0), (1, 2, 0), (4, 4, 0)]
)
def test_skipped_rows_keep_status(lib, rng, kv_len, S, s):
    old = np.array([[3, 1, 0, -1, 17]], np.int32)
    topk = rng.integers(-1, 6, (1, 4)).astype(np.int32)
    status, copy, actual, skipped = host_plan(
        lib, old, topk, np.array([kv_len]), np.array([s]), S, 4
    )
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
    ids = data.draw(
        st.lists(st.integers(0, max_id + 3), min_size=old_n, max_size=old_n, unique=True)
    )
    old = np.array(ids + [-1] * (K - old_n) + [data.draw(st.integers(-1, K * tbs))], np.int32)
    valid = data.draw(st.lists(st.integers(0, max_id), max_size=K, unique=True))
    noise = data.draw(
        st.lists(
            st.one_of(st.integers(-5, -1), st.integers(max_id + 1, max_id + 9)),
            min_size=K - len(valid),
            max_size=K - len(valid),
        )
    )
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
        status, copy, actual, skipped = host_plan(
            lib, old.astype(np.int32), topk, np.array([12]), np.array([0]), 1, tbs
        )
        n = int(((topk >= 0) & (topk <= 11)).sum())
        assert not skipped[0]
        assert (status[0, n:K] == -1).all() and int(status[0, K]) == int(actual[0]) == n
        assert sorted(status[0, :n].tolist()) == sorted(t for t in topk[0].tolist() if t >= 0)


def test_refuses_bad_sizes(lib):
    z = np.zeros(4, np.int32)
    p = _ptr(z, ctypes.c_int32)
    u = _ptr(np.zeros(4, np.uint8), ctypes.c_uint8)
    # (1, 2, 1, 2**30): K * TBS > INT32_MAX, the bound of the plan's 32-bit token total.
    cases = [(1, 2049, 1, 1), (1, 2, 0, 1), (1, 2, 1, 0), (-1, 2, 1, 1), (1, 2, 1, 1 << 30)]
    for rows, K, S, tbs in cases:
        assert lib.pytrt_kv_gather_plan_rows_host(rows, K, S, tbs, p, p, p, p, p, u, p, u) == 1
        assert lib.pytrt_kv_get_last_error()


# --- the whole planning step of a call: status, actual_seq and the miss list ----------

#: One miss-list entry (plugins/kernels/gatherPlan.h MissEntry): the copy kernel moves
#: ``size`` token rows from full-cache row ``src`` to selection-cache row ``dst``.
MISS_DTYPE = np.dtype(
    [
        ("src", "<i8"),
        ("dst", "<i8"),
        ("size", "<i4"),
        ("row", "<i4"),
        ("slot", "<i4"),
        ("id", "<i4"),
    ]
)
MISS_LIST_OFFSET = 256


def _addr(a: np.ndarray) -> int:
    return a.ctypes.data if a.size else 0


def host_gather_plan(
    lib, *, status, topk, sel_table, full_table, kv_len, S, tbs, sel_cache, full_cache
):
    """Run ``pytrt_kv_gather_plan_host`` (the planning kernel's code on the CPU).

    ``status`` int32 ``[B*S, K+1]`` is updated in place like the kernel's output. Returns
    ``(actual_seq [R], misses)`` with ``misses`` a MISS_DTYPE array in list order.
    """
    B = kv_len.shape[0]
    K = topk.shape[-1]
    p = _cuda.GatherSelectionParams()
    p.selectionKvCache, p.fullKvCache = _addr(sel_cache), _addr(full_cache)
    p.selectionKvBlockTable, p.selectionKvBlockStatus = _addr(sel_table), _addr(status)
    p.selectionTopkIndices, p.fullKvBlockTable = _addr(topk), _addr(full_table)
    p.fullKvActualSeq = _addr(kv_len)
    actual = np.full(sel_table.shape[0], -7, np.int32)
    p.selectionKvActualSeq = _addr(actual)
    p.cacheType = _cuda.DTYPE_CODE["float16"]
    p.batch, p.seqPerBatch, p.topk, p.topkBlockSize = B, S, K, tbs
    p.selectionRows = sel_table.shape[0]
    p.selectionBlockNum, p.selectionBlockSize = sel_cache.shape[0], sel_cache.shape[1]
    p.selectionMaxBlockNum = sel_table.shape[1]
    p.fullBlockNum, p.fullBlockSize = full_cache.shape[0], full_cache.shape[1]
    p.fullMaxBlockNum = full_table.shape[1]
    p.kvDim = sel_cache.shape[2]
    size = lib.pytrt_kv_gather_workspace_size(ctypes.byref(p))
    # Garbage, not zeros: the plan must zero the count and write every entry it lists.
    workspace = np.full(max(size // 8, 1), -0x0123456789ABCDE, np.int64)
    p.workspace, p.workspaceBytes = workspace.ctypes.data, size
    rc = lib.pytrt_kv_gather_plan_host(ctypes.byref(p))
    assert rc == 0, lib.pytrt_kv_get_last_error()
    raw = workspace.view(np.uint8)
    count = int(raw[:4].view(np.int32)[0]) if size else 0
    assert 0 <= count <= B * S * K
    misses = raw[MISS_LIST_OFFSET : MISS_LIST_OFFSET + count * MISS_DTYPE.itemsize].view(MISS_DTYPE)
    return actual, misses.copy()


def expected_misses(plans, kv_len, S, tbs, sel_table, full_table, sbs, fbs):
    """The reference's copied set as miss entries: for every copied slot of every row,
    (row, slot, id, size) and the token rows of docs/SPEC.md G4."""
    out = []
    for r, plan in enumerate(plans):
        if plan.skipped:
            continue
        b, s = divmod(r, S)
        eff = int(kv_len[b]) - (S - 1 - s)
        for j in np.flatnonzero(plan.copy):
            v = int(plan.status[j])
            p, q = v * tbs, int(j) * tbs
            src = int(full_table[b, p // fbs]) * fbs + p % fbs
            dst = int(sel_table[r, q // sbs]) * sbs + q % sbs
            out.append((src, dst, id_size(v, eff, tbs), r, int(j), v))
    return np.array(out, MISS_DTYPE)


def _by_row_slot(m: np.ndarray) -> np.ndarray:
    return np.sort(m, order=["row", "slot"])


def apply_misses(misses, sel_cache, full_cache):
    """What the copy kernel does with the list: every token row of every entry."""
    sel = sel_cache.reshape(-1, sel_cache.shape[-1])
    full = full_cache.reshape(-1, full_cache.shape[-1])
    for m in misses:
        if m["src"] >= 0 and m["dst"] >= 0:
            sel[m["dst"] : m["dst"] + m["size"]] = full[m["src"] : m["src"] + m["size"]]


def run_call_steps(
    lib,
    rng,
    *,
    B,
    S,
    K,
    tbs,
    sbs,
    fbs,
    extra_rows,
    layout,
    steps,
    reuse,
    pad=0.15,
    beyond=0.1,
    kv_dim=8,
):
    """Multi-step decode through the host planner of a whole call, against the reference:
    new status, actual_seq of all R rows, the miss list (as a set per row, in topk order
    inside a row) and the bytes the list moves."""
    R = B * S + extra_rows
    smax = -(-K * tbs // sbs) + int(rng.integers(0, 2))
    sel_blocks = R * smax
    sel_table = rng.permutation(sel_blocks).astype(np.int32).reshape(R, smax)
    fmax = int(rng.integers(4, 12))
    full_blocks = B * fmax + 3
    full_table = np.stack([rng.permutation(full_blocks)[:fmax] for _ in range(B)]).astype(np.int32)
    full_cache = rng.standard_normal((full_blocks, fbs, kv_dim)).astype(np.float16)
    sel_cache = np.full((sel_blocks, sbs, kv_dim), -3.5, np.float16)
    status = np.full((B * S, K + 1), -1, np.int32)
    capacity = fmax * fbs
    kv_len = rng.integers(-1, capacity // 2, B).astype(np.int32)
    prev = None
    total_copied = total_slots = 0
    for _ in range(steps):
        kv_len = np.minimum(kv_len + rng.integers(0, S + 2, B), capacity).astype(np.int32)
        topk = np.empty((B * S, K), np.int32)
        for r in range(B * S):
            b, s = divmod(r, S)
            eff = int(kv_len[b]) - (S - 1 - s)
            max_id = max((eff + tbs - 1) // tbs - 1, 0)
            row = random_topk(rng, K, max(max_id, K + 2), pad, beyond)
            if prev is not None and eff > 0:
                keep = [int(v) for v in prev[r] if 0 <= v <= max_id and rng.random() < reuse]
                fresh = [int(v) for v in row if int(v) not in keep]
                row = np.array((keep + fresh)[:K], np.int32)
                rng.shuffle(row)
            topk[r] = row
        shape = (B, S, 1) if layout == "BSND" else (B * S, 1)
        meta = _gather.GatherMeta(
            cache_dtype="float16",
            layout=layout,
            batch=B,
            seq=S,
            heads=1,
            topk=K,
            tbs=tbs,
            rows=R,
            sel_block_num=sel_blocks,
            sel_block_size=sbs,
            sel_max_block_num=smax,
            full_block_num=full_blocks,
            full_block_size=fbs,
            full_max_block_num=fmax,
            k_rope_dim=0,
            kv_dim=kv_dim,
        )
        plans = _gather.check_gather_values(
            meta,
            selection_kv_block_table=sel_table,
            selection_kv_block_status=status.reshape(shape + (K + 1,)),
            selection_topk_indices=topk.reshape(shape + (K,)),
            full_kv_block_table=full_table,
            full_kv_actual_seq=kv_len,
            place=plan_row,
        )
        want = expected_misses(plans, kv_len, S, tbs, sel_table, full_table, sbs, fbs)

        ref_cache, ref_status = sel_cache.copy(), status.reshape(shape + (K + 1,)).copy()
        ref_actual = reference.gather_selection_kv_cache(
            np.zeros(0, np.float16),
            ref_cache,
            sel_table,
            ref_status,
            topk.reshape(shape + (K,)),
            np.zeros(0, np.float16),
            full_cache,
            full_table,
            kv_len,
            np.ones(B, np.int32),
            selection_topk_block_size=tbs,
        )

        got_status = status.copy()
        actual, misses = host_gather_plan(
            lib,
            status=got_status,
            topk=topk,
            sel_table=sel_table,
            full_table=full_table,
            kv_len=kv_len,
            S=S,
            tbs=tbs,
            sel_cache=sel_cache,
            full_cache=full_cache,
        )
        ctx = f"B={B} S={S} K={K} tbs={tbs} sbs={sbs} fbs={fbs} R={R} {layout}"
        assert got_status.tolist() == ref_status.reshape(B * S, K + 1).tolist(), ctx
        assert actual.tolist() == ref_actual.tolist(), ctx
        assert _by_row_slot(misses).tolist() == _by_row_slot(want).tolist(), ctx
        for r in np.unique(misses["row"]):
            # Inside a row the list is in topk order (the CTA's scan order).
            ids = misses["id"][misses["row"] == r].tolist()
            order = [int(v) for v in topk[r] if int(v) in ids]
            assert ids == order, ctx
        got_cache = sel_cache.copy()
        apply_misses(misses, got_cache, full_cache)
        assert np.array_equal(got_cache.view(np.uint16), ref_cache.view(np.uint16)), ctx
        total_copied += int(misses["size"].sum())
        total_slots += int(sum(p.actual_seq for p in plans))
        status, sel_cache, prev = got_status, got_cache, topk
    return total_copied, total_slots


CALL_GRID = [
    # (B, S, K, tbs, sbs, fbs, extra_rows, layout)
    (1, 1, 4, 1, 4, 8, 0, "BSND"),
    (2, 1, 33, 1, 16, 16, 1, "TND"),
    (3, 2, 300, 1, 64, 32, 2, "BSND"),
    (2, 3, 8, 4, 8, 16, 0, "TND"),
    (1, 4, 5, 2, 6, 4, 3, "BSND"),
    (2, 2, 7, 3, 9, 12, 1, "TND"),
    (2, 1, 32, 64, 128, 64, 0, "BSND"),
    (1, 2, 40, 4, 16, 32, 1, "BSND"),  # K > 32 with TBS > 1 (docs/SPEC.md G2)
    (2, 1, 190, 128, 128, 256, 0, "TND"),  # the retrieval shape: ~190 blocks of 128
]


@pytest.mark.parametrize("B,S,K,tbs,sbs,fbs,extra,layout", CALL_GRID)
def test_call_plan_matches_reference(lib, rng, B, S, K, tbs, sbs, fbs, extra, layout):
    run_call_steps(
        lib,
        rng,
        B=B,
        S=S,
        K=K,
        tbs=tbs,
        sbs=sbs,
        fbs=fbs,
        extra_rows=extra,
        layout=layout,
        steps=4,
        reuse=0.8,
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_call_plan_random(lib, data):
    seed = data.draw(st.integers(0, 2**31 - 1))
    tbs = data.draw(st.sampled_from([1, 1, 2, 3, 4, 8, 16]))
    K = data.draw(st.integers(1, 48))
    B = data.draw(st.integers(1, 3))
    S = data.draw(st.integers(1, 3))
    sbs = tbs * data.draw(st.integers(1, 4))
    fbs = tbs * data.draw(st.integers(1, 4))
    run_call_steps(
        lib,
        np.random.default_rng(seed),
        B=B,
        S=S,
        K=K,
        tbs=tbs,
        sbs=sbs,
        fbs=fbs,
        extra_rows=data.draw(st.integers(0, 2)),
        layout=data.draw(st.sampled_from(["BSND", "TND"])),
        steps=data.draw(st.integers(1, 4)),
        reuse=data.draw(st.floats(0, 1)),
        pad=data.draw(st.floats(0, 0.4)),
        beyond=data.draw(st.floats(0, 0.3)),
    )


def test_miss_list_is_proportional_to_misses(lib, rng):
    """With heavy reuse the list holds only the copied ids: far fewer tokens than the
    selected ones (what makes the copy kernel's work proportional to misses)."""
    copied, selected = run_call_steps(
        lib,
        rng,
        B=2,
        S=1,
        K=64,
        tbs=1,
        sbs=64,
        fbs=64,
        extra_rows=0,
        layout="BSND",
        steps=6,
        reuse=0.95,
        pad=0.0,
        beyond=0.0,
    )
    assert 0 < copied < 0.4 * selected


def test_call_plan_skips_out_of_range_table_entries(lib, rng):
    """An id whose full or selection table entry is out of range (the reference raises)
    is still placed (status as G5) but its entry is marked skipped: nothing is copied."""
    S, K, tbs, sbs, fbs = 1, 6, 2, 4, 4
    sel_table = np.array([[0, -1, 5]], np.int32)  # slot 2-3 -> column 1: invalid
    full_table = np.array([[1, 99, 0, 2]], np.int32)  # column 1 (ids 2, 3) -> invalid
    full_cache = rng.standard_normal((3, fbs, 4)).astype(np.float16)
    sel_cache = np.full((6, sbs, 4), -3.5, np.float16)
    status = np.full((1, K + 1), -1, np.int32)
    topk = np.array([[0, 2, 4, 1, -1, 9]], np.int32)
    kv_len = np.array([10], np.int32)
    actual, misses = host_gather_plan(
        lib,
        status=status,
        topk=topk,
        sel_table=sel_table,
        full_table=full_table,
        kv_len=kv_len,
        S=S,
        tbs=tbs,
        sel_cache=sel_cache,
        full_cache=full_cache,
    )
    want = plan_row(np.full(K + 1, -1), topk[0], 10, 1, 0, tbs)
    assert status[0].tolist() == want.status.tolist() and actual[0] == want.actual_seq
    by_slot = {int(m["slot"]): m for m in misses}
    assert sorted(by_slot) == np.flatnonzero(want.copy).tolist()
    for j, m in by_slot.items():
        v = int(m["id"])
        full_bad = full_table[0, v * tbs // fbs] == 99
        sel_bad = sel_table[0, j * tbs // sbs] < 0
        assert (m["src"] < 0) == (full_bad or sel_bad), (j, m)


def test_empty_batch_plans_nothing(lib, rng):
    """B*S == 0: nothing is planned or copied; every table row's actual_seq is 0."""
    p = _cuda.GatherSelectionParams()
    sel_table = np.zeros((3, 2), np.int32)
    actual = np.full(3, -7, np.int32)
    p.selectionKvBlockTable, p.selectionKvActualSeq = _addr(sel_table), _addr(actual)
    p.cacheType = _cuda.DTYPE_CODE["float16"]
    p.batch, p.seqPerBatch, p.topk, p.topkBlockSize, p.selectionRows = 0, 0, 8, 4, 3
    p.selectionBlockSize, p.selectionMaxBlockNum, p.fullBlockSize, p.kvDim = 16, 2, 16, 8
    assert lib.pytrt_kv_gather_workspace_size(ctypes.byref(p)) == 0
    assert lib.pytrt_kv_gather_plan_host(ctypes.byref(p)) == 0, lib.pytrt_kv_get_last_error()
    assert actual.tolist() == [0, 0, 0]


def test_refuses_a_miss_list_past_int32(lib):
    """B*S*K > INT_MAX: the int32 miss count would wrap and the plan would write before
    the workspace, so the call is refused before anything is read or written."""
    K = 2048
    S = (2**31) // K + 1  # B*S*K = 2**31 + K
    buf = np.full(64, -5, np.int32)
    before = buf.copy()
    addr = buf.ctypes.data
    p = _cuda.GatherSelectionParams()
    for name in ("selectionKvCache", "fullKvCache", *GATHER_PLAN_POINTERS):
        setattr(p, name, addr)
    p.cacheType = _cuda.DTYPE_CODE["float16"]
    p.batch, p.seqPerBatch, p.topk, p.topkBlockSize = 1, S, K, 1
    p.selectionRows = S
    p.selectionBlockNum, p.selectionBlockSize, p.selectionMaxBlockNum = 1, 1, K
    p.fullBlockNum, p.fullBlockSize, p.fullMaxBlockNum = 1, 1, 1
    p.kvDim = 8
    # A workspace that claims to be large enough: only the size check stands in the way.
    p.workspaceBytes = 2**63
    assert lib.pytrt_kv_gather_plan_host(ctypes.byref(p)) == 1
    assert "topk must fit in int32" in lib.pytrt_kv_get_last_error().decode()
    assert np.array_equal(buf, before)
