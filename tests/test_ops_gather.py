"""pytrt_kv.ops.gather_selection_kv_cache on the GPU, bit-exact against the reference
(docs/SPEC.md G): parameter grids over dtype, TBS, S, K, block sizes, BSND/TND, padding, the
quantised (no k_rope) mode, host-resident full caches and multi-step reuse; CUDA-graph
capture and replay; out-of-range table entries skipped. Caches start as a sentinel byte
pattern so untouched rows are checked too. All tests need a GPU (marker ``gpu``: a real
one with torch CUDA tensors, or the emulated device with pytrt_kv's own buffers,
tests/support/device.py; torch streams, CUDA graphs and CuPy: ``real_gpu``) except the
host-side checks at the end.
"""

from __future__ import annotations

import numpy as np
import pytest

from pytrt_kv.contract import dtypes
from pytrt_kv.reference import gather_selection_kv_cache as ref_gather
from pytrt_kv.reference import plan_row
from support import device as dv
from support.arrays import (
    FakeCudaArray,
    assert_same_bits,
    random_data,
    sentinel,
    to_torch,
    torch_mod,
)
from support.device import gpu, real_gpu


class Case:
    """One gather problem in NumPy: every argument of docs/SPEC.md G1, valid for the reference."""

    def __init__(
        self,
        rng,
        *,
        B=2,
        S=1,
        K=8,
        tbs=1,
        sbs=16,
        fbs=16,
        kv=64,
        rope=16,
        dtype="bfloat16",
        layout="BSND",
        extra_rows=1,
        fmax=8,
        kv_lens=None,
    ):
        self.rng, self.B, self.S, self.K, self.tbs = rng, B, S, K, tbs
        self.layout, self.dtype = layout, dtype
        self.R = B * S + extra_rows
        self.smax = -(-K * tbs // sbs)
        self.sbn = self.R * self.smax + 3
        self.fbn = B * fmax + 2
        self.fbs, self.sbs, self.fmax = fbs, sbs, fmax
        self.full_kv = random_data(rng, (self.fbn, fbs, kv), dtype)
        self.full_rope = (
            random_data(rng, (self.fbn, fbs, rope), dtype)
            if rope
            else np.zeros((0,), dtypes.numpy_dtype(dtype))
        )
        self.sel_kv = sentinel((self.sbn, sbs, kv), dtype)
        self.sel_rope = (
            sentinel((self.sbn, sbs, rope), dtype)
            if rope
            else np.zeros((0,), dtypes.numpy_dtype(dtype))
        )
        # Each row owns distinct selection blocks (rows never write the same place).
        self.sel_table = (
            rng.permutation(self.sbn)[: self.R * self.smax]
            .reshape(self.R, self.smax)
            .astype(np.int32)
        )
        self.full_table = rng.permutation(self.fbn)[: B * fmax].reshape(B, fmax).astype(np.int32)
        shape = (B, S, 1) if layout == "BSND" else (B * S, 1)
        self.status = np.full(shape + (K + 1,), -1, np.int32)
        self.kv_len = (
            np.array(kv_lens, np.int32)
            if kv_lens is not None
            else rng.integers(S, fmax * fbs - 4 * S, B).astype(np.int32)
        )
        self.q_len = np.cumsum(rng.integers(1, 4, B)).astype(np.int32)  # cumulative: ignored
        self.topk = np.full(shape + (K,), -1, np.int32)
        self.prev = None

    def new_topk(self, reuse: float, pad: float = 0.15, beyond: float = 0.1) -> None:
        """Random distinct valid ids per row (plus padding and ids past max_id), keeping
        a ``reuse`` share of the previous step's ids."""
        rows = self.topk.reshape(-1, self.K)
        for r in range(self.B * self.S):
            b, s = divmod(r, self.S)
            eff = int(self.kv_len[b]) - (self.S - 1 - s)
            max_id = -(-eff // self.tbs) - 1 if eff > 0 else -1
            pool = self.rng.permutation(max(max_id + 1, 0))
            keep = []
            if self.prev is not None:
                keep = [
                    v
                    for v in dict.fromkeys(int(x) for x in self.prev[r])
                    if 0 <= v <= max_id and self.rng.random() < reuse
                ]
            fresh = [int(v) for v in pool if int(v) not in keep][: self.K - len(keep)]
            row = np.array(keep + fresh + [-1] * self.K, np.int64)[: self.K]
            u = self.rng.random(self.K)
            row[u < pad] = -1
            row[(u >= pad) & (u < pad + beyond)] = max_id + 1 + self.rng.integers(0, 9)
            self.rng.shuffle(row)
            rows[r] = row
        self.prev = rows.copy()

    def advance(self) -> None:
        """Next decode step: S more tokens; the newest positions are rewritten."""
        self.kv_len = np.minimum(self.kv_len + self.S, self.fmax * self.fbs).astype(np.int32)
        for b in range(self.B):
            for p in range(max(int(self.kv_len[b]) - 2 * self.S, 0), int(self.kv_len[b])):
                blk = self.full_table[b, p // self.fbs]
                self.full_kv[blk, p % self.fbs] = random_data(
                    self.rng, self.full_kv.shape[2:], self.dtype
                )
                if self.full_rope.size:
                    self.full_rope[blk, p % self.fbs] = random_data(
                        self.rng, self.full_rope.shape[2:], self.dtype
                    )

    def args(self):
        return [
            self.sel_rope,
            self.sel_kv,
            self.sel_table,
            self.status,
            self.topk,
            self.full_rope,
            self.full_kv,
            self.full_table,
            self.kv_len,
            self.q_len,
        ]


def to_device_args(case: Case, host_full: bool):
    a = case.args()
    out = []
    for i, x in enumerate(a):
        out.append(dv.to_device(x, pinned=i in (5, 6) and host_full))
    return out


def op_args(dev):
    """The buffers of :func:`to_device_args` as ``pytrt_kv.ops`` takes them."""
    return [dv.device_array(x) for x in dev]


def run_step(case: Case, dev, host_full: bool):
    """Run the reference on the case's arrays and the GPU op on ``dev``; compare all."""
    from pytrt_kv import ops

    del host_full  # where the full caches live is decided by the buffers in ``dev``
    # The inputs that change between steps are re-uploaded (status/caches stay on the GPU).
    for i in (4, 8):
        dv.copy_into(dev[i], case.args()[i])
    for i in (5, 6):
        if case.args()[i].size:
            dv.copy_into(dev[i], case.args()[i])
    want = ref_gather(*case.args(), selection_topk_block_size=case.tbs)
    got = ops.gather_selection_kv_cache(*op_args(dev), selection_topk_block_size=case.tbs)
    dv.synchronize()
    assert dv.to_numpy(got).tolist() == want.tolist(), "selection_kv_actual_seq"
    assert dv.to_numpy(dev[3]).tolist() == case.status.tolist(), "selection_kv_block_status"
    assert_same_bits(dv.to_numpy(dev[1]), case.sel_kv, "selection_kv_cache")
    if case.sel_rope.size:
        assert_same_bits(dv.to_numpy(dev[0]), case.sel_rope, "selection_k_rope")


GRID = [
    # (K, tbs, sbs, fbs, S)
    (1, 1, 16, 16, 1),
    (4, 1, 3, 5, 1),
    (33, 1, 16, 16, 2),
    (256, 1, 64, 128, 1),
    (2048, 1, 128, 128, 1),
    (3, 4, 4, 8, 1),
    (8, 4, 12, 8, 3),
    (16, 64, 64, 128, 1),
    (32, 2, 6, 10, 2),
    (40, 4, 8, 8, 1),  # K > 32 with TBS > 1 (docs/SPEC.md G2, lifted)
    (190, 128, 128, 256, 1),  # retrieval at 128K: 20% of 128-token blocks
    (5, 3, 9, 6, 4),
]


def _grid_steps(rng, grid, reuses, host_full: bool, **case_kw):
    """One Case of ``grid`` (K, TBS, SBS, FBS, S) with room in the full table for twice
    the selected tokens, then one call per topk reuse ratio in ``reuses`` (the sequences
    advance between calls), each checked bit for bit. Returns the device arguments."""
    K, tbs, sbs, fbs, S = grid
    fmax = max(-(-K * tbs * 2 // fbs), 4)
    case = Case(rng, S=S, K=K, tbs=tbs, sbs=sbs, fbs=fbs, fmax=fmax, **case_kw)
    dev = to_device_args(case, host_full=host_full)
    for step, reuse in enumerate(reuses):
        if step:
            case.advance()
        case.new_topk(reuse)
        run_step(case, dev, host_full=host_full)
    return dev


@gpu
@pytest.mark.parametrize("grid", GRID, ids=lambda g: "K{}_tbs{}_sbs{}_fbs{}_S{}".format(*g))
@pytest.mark.parametrize(
    "dtype,rope",
    [("bfloat16", 64), ("float16", 8), ("int8", 0), ("float32", 4), ("float8_e4m3fn", 16)],
)
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_gather_multi_step_bit_exact(rng, grid, dtype, rope, layout):
    kv = 48 if dtype != "int8" else 656
    steps = (0.0, 0.6, 0.9, 0.9)
    _grid_steps(rng, grid, steps, False, B=3, kv=kv, rope=rope, dtype=dtype, layout=layout)


@gpu
@pytest.mark.parametrize(
    "grid", [(64, 1, 16, 32, 1), (8, 16, 16, 64, 2), (2048, 1, 64, 64, 1)], ids=str
)
@pytest.mark.parametrize("rope", [64, 0])
def test_gather_from_pinned_host_memory(rng, grid, rope):
    dtype = "bfloat16" if rope else "int8"
    dev = _grid_steps(rng, grid, (0.0, 0.9, 0.6), True, B=2, kv=512, rope=rope, dtype=dtype)
    assert dv.is_pinned_host(dev[6])


@gpu
@pytest.mark.parametrize("kv_lens", [[0, 5], [-4, 0], [1, 2]])
def test_gather_skipped_rows(rng, kv_lens):
    """kv_len <= 0 or eff <= 0: status untouched, output 0, caches untouched."""
    case = Case(rng, B=2, S=3, K=4, tbs=2, sbs=4, fbs=4, kv=32, rope=8, fmax=4, kv_lens=kv_lens)
    rows = case.status.reshape(-1, case.K + 1)
    rows[:, :2] = [1, 0]  # an old state (valid prefix) that a skipped row must keep
    rows[:, case.K] = 3
    case.new_topk(0.0)
    dev = to_device_args(case, host_full=False)
    run_step(case, dev, host_full=False)


def expected_with_skips(case: Case, bad_full_cols, bad_sel_cols):
    """What the kernel does when some table entries are out of range: the plan (status,
    actual_seq) is unchanged; the copies that would read or write through a bad entry are
    skipped. ``bad_*_cols``: sets of (row-or-batch, column)."""
    sel_kv = case.sel_kv.copy()
    sel_rope = case.sel_rope.copy()
    status = case.status.reshape(-1, case.K + 1).copy()
    actual = np.zeros(case.R, np.int32)
    for r in range(case.B * case.S):
        b, s = divmod(r, case.S)
        plan = plan_row(
            status[r], case.topk.reshape(-1, case.K)[r], int(case.kv_len[b]), case.S, s, case.tbs
        )
        if plan.skipped:
            continue
        eff = int(case.kv_len[b]) - (case.S - 1 - s)
        max_id = -(-eff // case.tbs) - 1
        for j in np.flatnonzero(plan.copy):
            v = int(plan.status[j])
            size = eff - max_id * case.tbs if v == max_id else case.tbs
            for i in range(size):
                p, q = v * case.tbs + i, j * case.tbs + i
                if (b, p // case.fbs) in bad_full_cols or (r, q // case.sbs) in bad_sel_cols:
                    continue
                src = case.full_table[b, p // case.fbs], p % case.fbs
                dst = case.sel_table[r, q // case.sbs], q % case.sbs
                sel_kv[dst] = case.full_kv[src]
                if sel_rope.size:
                    sel_rope[dst] = case.full_rope[src]
        status[r] = plan.status
        actual[r] = plan.actual_seq
    return sel_kv, sel_rope, status.reshape(case.status.shape), actual


@gpu
def test_gather_out_of_range_table_entries_are_skipped(rng):
    from pytrt_kv import ops

    case = Case(rng, B=2, S=1, K=16, tbs=1, sbs=4, fbs=4, kv=32, rope=8, fmax=6, kv_lens=[24, 24])
    case.new_topk(0.0, pad=0.0, beyond=0.0)
    # Sanity of the oracle: with valid tables it is the reference.
    want = expected_with_skips(case, set(), set())
    ref_case = [x.copy() for x in case.args()]
    ref_out = ref_gather(*ref_case, selection_topk_block_size=1)
    assert_same_bits(want[0], ref_case[1], "oracle vs reference")
    assert want[3][: ref_out.size].tolist() == ref_out.tolist()
    # Break entries: full -1 and >= F_BLOCK_NUM, selection -5 and >= S_BLOCK_NUM.
    case.full_table[0, 1] = -1
    case.full_table[1, 2] = case.fbn
    case.sel_table[0, 0] = -5
    case.sel_table[1, 3] = case.sbn + 7
    bad_full = {(0, 1), (1, 2)}
    bad_sel = {(0, 0), (1, 3)}
    sel_kv, sel_rope, status, actual = expected_with_skips(case, bad_full, bad_sel)
    dev = to_device_args(case, host_full=False)
    out = ops.gather_selection_kv_cache(*dev, selection_topk_block_size=1)
    dv.synchronize()
    assert_same_bits(dv.to_numpy(dev[1]), sel_kv, "selection_kv_cache")
    assert_same_bits(dv.to_numpy(dev[0]), sel_rope, "selection_k_rope")
    assert dv.to_numpy(dev[3]).tolist() == status.tolist()
    assert dv.to_numpy(out).tolist() == actual.tolist()
    with pytest.raises(ValueError):
        ops.gather_selection_kv_cache(*dev, selection_topk_block_size=1, validate=True)


@gpu
def test_gather_ids_past_the_full_table_are_skipped(rng):
    """kv_len larger than F_MAX_BLOCK_NUM * FBS: ids needing a column past the table are
    skipped (the reference raises)."""
    from pytrt_kv import ops

    case = Case(
        rng, B=1, S=1, K=8, tbs=1, sbs=8, fbs=2, kv=16, rope=0, dtype="int8", fmax=3, kv_lens=[40]
    )
    case.topk[...] = np.array([0, 5, 6, 7, 39, 12, -1, 3], np.int32).reshape(case.topk.shape)
    bad_full = {(0, c) for c in range(3, 40)}
    sel_kv, _, status, actual = expected_with_skips(case, bad_full, set())
    dev = to_device_args(case, host_full=False)
    out = ops.gather_selection_kv_cache(*dev, selection_topk_block_size=1)
    dv.synchronize()
    assert_same_bits(dv.to_numpy(dev[1]), sel_kv, "selection_kv_cache")
    assert dv.to_numpy(dev[3]).tolist() == status.tolist()
    assert dv.to_numpy(out).tolist() == actual.tolist()


@gpu
def test_gather_duplicates_stay_in_bounds(rng):
    from pytrt_kv import ops

    case = Case(rng, B=1, S=1, K=8, tbs=1, sbs=8, fbs=8, kv=16, rope=4, fmax=4, kv_lens=[20])
    case.topk[...] = np.array([3, 3, 5, 3, -1, 5, 7, 1], np.int32).reshape(case.topk.shape)
    sentinel_rows = case.sel_kv.copy()
    dev = to_device_args(case, host_full=False)
    out = ops.gather_selection_kv_cache(*dev, selection_topk_block_size=1)
    dv.synchronize()
    status = dv.to_numpy(dev[3]).reshape(-1)
    assert dv.to_numpy(out).tolist()[0] == 7 and status[8] == 7
    assert sorted(status[:7].tolist()) == [1, 3, 3, 3, 5, 5, 7] and status[7] == -1
    # Only the row's own selection blocks may change.
    got = dv.to_numpy(dev[1])
    others = np.setdiff1d(np.arange(case.sbn), case.sel_table[0])
    assert_same_bits(got[others], sentinel_rows[others], "other selection blocks")


@real_gpu
def test_gather_cuda_graph_capture_and_replay(rng):
    """Warm-up on the capture stream, capture once, replay over decode steps."""
    from pytrt_kv import ops

    torch = torch_mod()
    case = Case(rng, B=4, S=2, K=64, tbs=1, sbs=16, fbs=32, kv=128, rope=32, fmax=8)
    case.new_topk(0.0)
    dev = to_device_args(case, host_full=False)
    out = torch.empty(case.R, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    # Warm-up on a throw-away copy of the state so that the replayed steps start fresh.
    scratch = [t.clone() for t in dev]
    with torch.cuda.stream(stream):
        ops.gather_selection_kv_cache(*scratch, selection_topk_block_size=1, out=out)
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        ops.gather_selection_kv_cache(*dev, selection_topk_block_size=1, out=out)
    for step, reuse in enumerate((0.0, 0.6, 0.9)):
        if step:
            case.advance()
            case.new_topk(reuse)
        for i in (4, 5, 6, 8):
            dev[i].copy_(to_torch(case.args()[i]))
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
        want = ref_gather(*case.args(), selection_topk_block_size=1)
        assert dv.to_numpy(out).tolist() == want.tolist()
        assert dv.to_numpy(dev[3]).tolist() == case.status.tolist()
        assert_same_bits(dv.to_numpy(dev[1]), case.sel_kv, "selection_kv_cache")
        assert_same_bits(dv.to_numpy(dev[0]), case.sel_rope, "selection_k_rope")


@real_gpu
def test_gather_cupy_inputs(rng):
    cupy = pytest.importorskip("cupy")
    from pytrt_kv import ops

    case = Case(rng, B=2, S=1, K=16, tbs=1, sbs=8, fbs=8, kv=32, rope=8, dtype="float16", fmax=6)
    case.new_topk(0.0)
    dev = [cupy.asarray(x) for x in case.args()]
    want = ref_gather(*case.args(), selection_topk_block_size=1)
    out = ops.gather_selection_kv_cache(*dev, selection_topk_block_size=1)
    cupy.cuda.get_current_stream().synchronize()
    assert isinstance(out, cupy.ndarray) and cupy.asnumpy(out).tolist() == want.tolist()
    assert cupy.asnumpy(dev[3]).tolist() == case.status.tolist()
    assert_same_bits(cupy.asnumpy(dev[1]), case.sel_kv, "selection_kv_cache")


@gpu
def test_gather_rejects_pageable_full_cache(rng):
    from pytrt_kv import ops

    case = Case(rng, B=1, S=1, K=4, tbs=1, sbs=4, fbs=4, kv=16, rope=0, dtype="int8", fmax=2)
    dev = to_device_args(case, host_full=False)
    dev[6] = to_torch(case.full_kv, device="cpu") if dv.use_torch() else case.full_kv.copy()
    with pytest.raises(ValueError, match="full_kv_cache: expected GPU memory or pinned host"):
        ops.gather_selection_kv_cache(*dev, selection_topk_block_size=1)


@gpu
@pytest.mark.parametrize("grid", [(40, 4, 16, 32, 2), (190, 128, 128, 256, 1)], ids=str)
def test_gather_large_topk_with_blocks(rng, grid):
    """K > 32 with TBS > 1 (docs/SPEC.md G2 lifts the Ascend limit; retrieval needs ~190
    blocks of 128 tokens), multi-step with reuse, bit-exact."""
    K, tbs, sbs, fbs, S = grid
    fmax = max(-(-K * tbs * 2 // fbs), 4)
    case = Case(rng, B=2, S=S, K=K, tbs=tbs, sbs=sbs, fbs=fbs, kv=64, rope=8, fmax=fmax)
    dev = to_device_args(case, host_full=False)
    for step, reuse in enumerate((0.0, 0.9, 0.5)):
        if step:
            case.advance()
        case.new_topk(reuse)
        run_step(case, dev, host_full=False)


@gpu
@pytest.mark.parametrize("kind", ["HostArray", "PinnedHost"])
def test_gather_from_the_projects_pinned_memory(rng, kind):
    """Full caches in pinned host memory from pytrt_kv's own allocator (HostArray) or
    registered by it (PinnedHost over a NumPy array), passed as the NumPy arrays."""
    from pytrt_kv import _cuda, ops

    case = Case(rng, B=2, S=1, K=64, tbs=1, sbs=16, fbs=32, kv=256, rope=32, fmax=8)
    dev = to_device_args(case, host_full=False)
    keep = []
    for i in (5, 6):
        a = case.args()[i]
        if kind == "HostArray":
            h = _cuda.HostArray(a.shape, a.dtype)
            h.array[...] = a
        else:
            h = _cuda.PinnedHost(np.ascontiguousarray(a).copy())
        keep.append(h)
        dev[i] = h.array
    for step, reuse in enumerate((0.0, 0.9)):
        if step:
            case.advance()
            for i, h in zip((5, 6), keep):
                h.array[...] = case.args()[i]
        case.new_topk(reuse)
        for i in (4, 8):
            dv.copy_into(dev[i], case.args()[i])
        want = ref_gather(*case.args(), selection_topk_block_size=case.tbs)
        got = ops.gather_selection_kv_cache(*dev, selection_topk_block_size=case.tbs)
        dv.synchronize()
        assert dv.to_numpy(got).tolist() == want.tolist()
        assert dv.to_numpy(dev[3]).tolist() == case.status.tolist()
        assert_same_bits(dv.to_numpy(dev[1]), case.sel_kv, "selection_kv_cache")
        assert_same_bits(dv.to_numpy(dev[0]), case.sel_rope, "selection_k_rope")
    for h in keep:
        h.close()


@gpu
@pytest.mark.parametrize("where", ["valid address", "address 0"])
def test_gather_zero_element_rope(rng, where):
    """C8 mode: the k_rope pair is zero-element, bound at a valid (non-null, aligned)
    device address or at 0; nothing is read or written through it."""
    case = Case(rng, B=2, S=1, K=16, tbs=2, sbs=8, fbs=8, kv=64, rope=0, dtype="int8", fmax=8)
    dev = to_device_args(case, host_full=False)
    null = where == "address 0"
    dev[0] = dv.zero_elements((0,), "int8", null=null)
    dev[5] = dv.zero_elements((0,), "int8", null=null)
    assert (dv.address(dev[5]) == 0) == null
    for step, reuse in enumerate((0.0, 0.8)):
        if step:
            case.advance()
        case.new_topk(reuse)
        run_step(case, dev, host_full=False)


def _raw_gather_params(case, dev, workspace, out, workspace_bytes=1 << 16):
    from pytrt_kv import _cuda

    p = _cuda.GatherSelectionParams()
    a = dv.address
    p.selectionKvCache, p.selectionKvBlockTable = a(dev[1]), a(dev[2])
    p.selectionKvBlockStatus, p.selectionTopkIndices = a(dev[3]), a(dev[4])
    p.fullKvCache, p.fullKvBlockTable = a(dev[6]), a(dev[7])
    p.fullKvActualSeq, p.selectionKvActualSeq = a(dev[8]), a(out)
    p.cacheType = _cuda.DTYPE_CODE[case.dtype]
    p.batch, p.seqPerBatch, p.topk, p.topkBlockSize = case.B, case.S, case.K, case.tbs
    p.selectionRows = case.R
    p.selectionBlockNum, p.selectionBlockSize = case.sbn, case.sbs
    p.selectionMaxBlockNum = case.smax
    p.fullBlockNum, p.fullBlockSize, p.fullMaxBlockNum = case.fbn, case.fbs, case.fmax
    p.kvDim = case.sel_kv.shape[2]
    p.workspace, p.workspaceBytes = a(workspace), workspace_bytes
    return p


@gpu
def test_kernel_empty_batch_writes_only_actual_seq(rng):
    """B*S == 0 through the C ABI: success, status and caches untouched, every table
    row's actual_seq 0 (rows >= B*S are 0)."""
    import ctypes

    from pytrt_kv import _cuda

    # S = 1, K = 8 and TBS = 1 as Case makes them by default.
    case = Case(rng, B=1, sbs=8, fbs=8, kv=16, rope=0, dtype="float16", fmax=4, extra_rows=2)
    case.new_topk(0.0)
    dev = to_device_args(case, host_full=False)
    out = dv.full((case.R,), 77, "int32")
    workspace = dv.empty((1 << 16,), "uint8")
    lib = _cuda.kernels()
    for batch, seq in ((0, 1), (0, 0)):
        p = _raw_gather_params(case, dev, workspace, out)
        p.batch, p.seqPerBatch = batch, seq
        rc = lib.pytrt_kv_gather_selection_kv_cache(ctypes.byref(p), None, -1)
        dv.synchronize()
        assert rc == 0, lib.pytrt_kv_get_last_error()
        assert dv.to_numpy(out).tolist() == [0] * case.R
        assert dv.to_numpy(dev[3]).tolist() == case.status.tolist()
        assert_same_bits(dv.to_numpy(dev[1]), case.sel_kv, "selection_kv_cache")
        dv.copy_into(out, np.full(case.R, 77, np.int32))


@gpu
def test_failed_helper_call_is_not_blamed_on_the_next_launch(rng):
    """A failed CUDA call of the library (an impossible cudaMalloc) is reported by its
    own return value and does not make the next launch fail or carry its message."""
    import ctypes

    from pytrt_kv import _cuda

    lib = _cuda.kernels()
    ptr = ctypes.c_void_p()
    assert lib.pytrt_kv_device_malloc(1 << 60, 0, ctypes.byref(ptr)) != 0
    case = Case(rng, B=2, S=1, K=8, tbs=1, sbs=8, fbs=8, kv=16, rope=0, dtype="float16", fmax=4)
    case.new_topk(0.0)
    dev = to_device_args(case, host_full=False)
    out = dv.empty((case.R,), "int32")
    workspace = dv.empty((1 << 16,), "uint8")
    p = _raw_gather_params(case, dev, workspace, out)
    rc = lib.pytrt_kv_gather_selection_kv_cache(ctypes.byref(p), None, -1)
    dv.synchronize()
    assert rc == 0, lib.pytrt_kv_get_last_error()
    want = ref_gather(*case.args(), selection_topk_block_size=1)
    assert dv.to_numpy(out).tolist() == want.tolist()
    assert_same_bits(dv.to_numpy(dev[1]), case.sel_kv, "selection_kv_cache")


# --- CPU ------------------------------------------------------------------------------------


def test_gather_shape_errors_come_before_any_gpu_work():
    from pytrt_kv import ops

    f16, i32 = "<f2", "<i4"
    args = [
        FakeCudaArray((4, 16, 8), f16),
        FakeCudaArray((4, 16, 32), f16),
        FakeCudaArray((2, 1), i32),
        FakeCudaArray((2, 1, 1, 9), i32),
        FakeCudaArray((2, 1, 1, 8), i32),
        FakeCudaArray((4, 16, 8), f16),
        FakeCudaArray((4, 16, 32), f16),
        FakeCudaArray((2, 4), i32),
        FakeCudaArray((2,), i32),
        FakeCudaArray((2,), i32),
    ]
    bad = list(args)
    bad[4] = FakeCudaArray((2, 1, 1, 7), i32)  # topk K != status K+1 - 1
    with pytest.raises(ValueError, match="selection_topk_indices|selection_kv_block_status"):
        ops.gather_selection_kv_cache(*bad, selection_topk_block_size=1)
    bad = list(args)
    bad[6] = FakeCudaArray((4, 16, 32), "<f4")
    with pytest.raises((TypeError, ValueError), match="full_kv_cache"):
        ops.gather_selection_kv_cache(*bad, selection_topk_block_size=1)
