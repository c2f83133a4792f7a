"""The C ABI of libpytrt_kv_kernels.so without a GPU: the ctypes mirrors of the Params
structs match the C++ layout, the host-side argument checks refuse bad parameters with a
reason, and the compressing-write row logic (plugins/kernels/scatterRows.h, compiled for
the host) agrees with the reference. Skipped, with pytrt_kv._lib's reason, where the
library was not built."""

from __future__ import annotations

import ctypes
import itertools

import numpy as np
import pytest

from pytrt_kv import _cuda
from pytrt_kv.contract import limits
from pytrt_kv.reference import scatter_pa_kv_cache
from support.op_names import GATHER_PLAN_POINTERS

INVALID_VALUE = 1  # cudaErrorInvalidValue


@pytest.mark.parametrize(
    "which,struct", [(0, _cuda.ScatterParams), (1, _cuda.GatherSelectionParams)]
)
def test_params_layout_matches_ctypes(lib, which, struct):
    out = (ctypes.c_int64 * 64)()
    n = lib.pytrt_kv_params_layout(which, out, 64)
    assert n == len(struct._fields_) + 1
    want = [ctypes.sizeof(struct)] + [getattr(struct, f).offset for f, _ in struct._fields_]
    assert list(out[:n]) == want
    assert lib.pytrt_kv_params_layout(which, out, 3) == -1
    assert lib.pytrt_kv_params_layout(7, out, 64) == -1


def test_versions(lib):
    assert lib.pytrt_kv_version() == limits.VERSION_NUMBER  # 0.1.0 -> 100
    assert lib.pytrt_kv_abi_version() == _cuda.ABI_VERSION


def _ptr(n: int = 0x10000) -> int:
    # Never dereferenced: every case below is refused by the host checks first.
    return n


def good_scatter() -> _cuda.ScatterParams:
    p = _cuda.ScatterParams()
    p.key, p.value, p.keyCache, p.valueCache, p.slotMapping = (_ptr() for _ in range(5))
    p.keyType = p.valueType = _cuda.DTYPE_CODE["bfloat16"]
    p.indexType = _cuda.DTYPE_CODE["int32"]
    p.numTokens, p.numHeads, p.headSizeK, p.headSizeV = 4, 2, 16, 16
    p.numBlocks, p.blockSize = 3, 16
    return p


SCATTER_BREAKS = {
    "null key": lambda p: setattr(p, "key", None),
    "value without cache": lambda p: setattr(p, "valueCache", None),
    "int64 data": lambda p: setattr(p, "keyType", _cuda.DTYPE_CODE["int64"]),
    "float index": lambda p: setattr(p, "indexType", _cuda.DTYPE_CODE["float32"]),
    "unknown dtype": lambda p: setattr(p, "keyType", 42),
    "zero heads": lambda p: setattr(p, "numHeads", 0),
    "zero block size": lambda p: setattr(p, "blockSize", 0),
    "negative tokens": lambda p: setattr(p, "numTokens", -1),
    "bad layout": lambda p: setattr(p, "layout", 9),
    "nz misaligned": lambda p: (setattr(p, "layout", 1), setattr(p, "headSizeK", 3)),
    "compress without lens": lambda p: (
        setattr(p, "compress", True),
        setattr(p, "batch", 1),
        setattr(p, "maxSeqLen", 4),
    ),
    "rope on int8": lambda p: (
        setattr(p, "compress", True),
        setattr(p, "batch", 1),
        setattr(p, "compressLens", _ptr()),
        setattr(p, "seqLens", _ptr()),
        setattr(p, "compressSeqOffsets", _ptr()),
        setattr(p, "mode", 0),
        setattr(p, "keyType", _cuda.DTYPE_CODE["int8"]),
        setattr(p, "valueType", _cuda.DTYPE_CODE["int8"]),
    ),
    "omni without offsets": lambda p: (
        setattr(p, "compress", True),
        setattr(p, "mode", 1),
        setattr(p, "batch", 1),
        setattr(p, "maxSeqLen", 4),
        setattr(p, "compressLens", _ptr()),
        setattr(p, "seqLens", _ptr()),
    ),
}


def _rope(p, key_at=0x10000):
    p.compress, p.mode, p.batch, p.maxSeqLen = True, 0, 1, 4
    p.compressLens = p.seqLens = p.compressSeqOffsets = _ptr()
    p.key = _ptr(key_at)


SCATTER_LIMITS = {
    # A token row's vectors are counted in int32 by the kernels.
    "key row over 2 GiB": (
        lambda p: (setattr(p, "numHeads", 2), setattr(p, "headSizeK", 1 << 29)),
        "numHeads * headSize * itemsize must fit in int32",
    ),
    "value row over 2 GiB": (
        lambda p: setattr(p, "headSizeV", 1 << 30),
        "numHeads * headSize * itemsize must fit in int32",
    ),
    # The rope mean reads elements one at a time: raw pointers must be itemsize-aligned.
    "rope key misaligned": (
        lambda p: _rope(p, key_at=0x10001),
        "aligned to the itemsize",
    ),
}


@pytest.mark.parametrize("name", list(SCATTER_LIMITS))
def test_scatter_refuses_rows_it_cannot_address(lib, name):
    p = good_scatter()
    breaks, message = SCATTER_LIMITS[name]
    breaks(p)
    assert lib.pytrt_kv_scatter_pa_kv_cache(ctypes.byref(p), None, -1) == INVALID_VALUE
    assert message in lib.pytrt_kv_get_last_error().decode()


def test_scatter_empty_calls_launch_nothing(lib):
    # T == 0 and NB == 0 succeed without touching the GPU (there is none here).
    for field, value in (("numTokens", 0), ("numBlocks", 0)):
        p = good_scatter()
        setattr(p, field, value)
        assert lib.pytrt_kv_scatter_pa_kv_cache(ctypes.byref(p), None, -1) == 0


def test_scatter_empty_calls_accept_null_pointers(lib):
    # TensorRT passes null for zero-volume tensors: a call that writes nothing needs none.
    p = good_scatter()
    p.numTokens, p.key, p.value, p.slotMapping = 0, None, None, None
    assert lib.pytrt_kv_scatter_pa_kv_cache(ctypes.byref(p), None, -1) == 0
    p = good_scatter()
    p.compress, p.mode, p.batch, p.maxSeqLen = True, 0, 0, 4  # rope, B == 0
    p.key = p.value = p.slotMapping = None
    assert lib.pytrt_kv_scatter_pa_kv_cache(ctypes.byref(p), None, -1) == 0
    p.batch, p.key, p.value, p.slotMapping = 1, _ptr(), _ptr(), _ptr()  # B > 0: required again
    assert lib.pytrt_kv_scatter_pa_kv_cache(ctypes.byref(p), None, -1) == INVALID_VALUE


def good_gather() -> _cuda.GatherSelectionParams:
    p = _cuda.GatherSelectionParams()
    for f in (
        "selectionKRope",
        "selectionKvCache",
        "selectionKvBlockTable",
        "selectionKvBlockStatus",
        "selectionTopkIndices",
        "fullKRope",
        "fullKvCache",
        "fullKvBlockTable",
        "fullKvActualSeq",
        "selectionKvActualSeq",
        "workspace",
    ):
        setattr(p, f, _ptr())
    p.cacheType = _cuda.DTYPE_CODE["float16"]
    p.batch, p.seqPerBatch, p.topk, p.topkBlockSize, p.selectionRows = 2, 2, 8, 4, 4
    p.selectionBlockNum, p.selectionBlockSize, p.selectionMaxBlockNum = 8, 16, 2
    p.fullBlockNum, p.fullBlockSize, p.fullMaxBlockNum = 8, 16, 4
    p.kRopeDim, p.kvDim = 8, 64
    p.workspaceBytes = 1 << 20
    return p


GATHER_BREAKS = {
    "topk over 2048": lambda p: (setattr(p, "topk", 2049), setattr(p, "topkBlockSize", 1)),
    "topk over 2048 with tbs > 1": lambda p: setattr(p, "topk", 2049),
    "sbs % tbs": lambda p: setattr(p, "selectionBlockSize", 6),
    "fbs % tbs": lambda p: setattr(p, "fullBlockSize", 10),
    "rows < B*S": lambda p: setattr(p, "selectionRows", 3),
    "too few selection columns": lambda p: setattr(p, "selectionMaxBlockNum", 1),
    "8-byte cache": lambda p: setattr(p, "cacheType", _cuda.DTYPE_CODE["int64"]),
    "zero kv dim": lambda p: setattr(p, "kvDim", 0),
    "rope without pointer": lambda p: setattr(p, "fullKRope", None),
    "null status": lambda p: setattr(p, "selectionKvBlockStatus", None),
    "small workspace": lambda p: setattr(p, "workspaceBytes", 4),
    "no workspace": lambda p: setattr(p, "workspace", None),
    "S = 0": lambda p: setattr(p, "seqPerBatch", 0),
    "misaligned workspace": lambda p: setattr(p, "workspace", _ptr(0x10004)),
    "negative S": lambda p: (setattr(p, "batch", 0), setattr(p, "seqPerBatch", -1)),
}


def test_gather_refuses_rows_over_2_gib(lib):
    """A token row's vectors are counted in int32 by the copy kernel."""
    p = good_gather()
    p.kvDim, p.kRopeDim = (1 << 30) - 4, 8  # (kvDim + kRopeDim) * 2 bytes > INT32_MAX
    assert lib.pytrt_kv_gather_selection_kv_cache(ctypes.byref(p), None, -1) == INVALID_VALUE
    assert "(kvDim + kRopeDim) * itemsize must fit in int32" in (
        lib.pytrt_kv_get_last_error().decode()
    )


@pytest.mark.parametrize(
    "op,name", [*(("scatter", n) for n in SCATTER_BREAKS), *(("gather", n) for n in GATHER_BREAKS)]
)
def test_refuses_on_the_host(lib, op, name):
    """A broken parameter block: the launch returns cudaErrorInvalidValue before any
    launch, and the last error names the op."""
    if op == "scatter":
        p, launch = good_scatter(), lib.pytrt_kv_scatter_pa_kv_cache
        SCATTER_BREAKS[name](p)
    else:
        p, launch = good_gather(), lib.pytrt_kv_gather_selection_kv_cache
        GATHER_BREAKS[name](p)
    assert launch(ctypes.byref(p), None, -1) == INVALID_VALUE
    assert lib.pytrt_kv_get_last_error().startswith(op.encode() + b":")


@pytest.mark.parametrize("name", list(GATHER_BREAKS))
def test_gather_host_plan_refuses_like_the_launch(lib, name):
    """pytrt_kv_gather_plan_host runs the launch's own checks before planning."""
    p = good_gather()
    GATHER_BREAKS[name](p)
    assert lib.pytrt_kv_gather_plan_host(ctypes.byref(p)) == INVALID_VALUE
    assert lib.pytrt_kv_get_last_error().startswith(b"gather:")
    assert lib.pytrt_kv_gather_plan_host(None) == INVALID_VALUE
    assert lib.pytrt_kv_get_last_error() == b"gather_plan_host: params is null"


def test_gather_empty_call_accepts_null_pointers(lib):
    p = good_gather()
    p.batch, p.selectionRows = 0, 0
    for f in GATHER_PLAN_POINTERS:
        setattr(p, f, None)
    assert lib.pytrt_kv_gather_selection_kv_cache(ctypes.byref(p), None, -1) == 0
    p.seqPerBatch = 0  # B*S == 0 either way (TND with T == 0)
    assert lib.pytrt_kv_gather_selection_kv_cache(ctypes.byref(p), None, -1) == 0
    p.seqPerBatch = 2
    p.batch = p.selectionRows = 1  # rows again: the same nulls are refused
    assert lib.pytrt_kv_gather_selection_kv_cache(ctypes.byref(p), None, -1) == INVALID_VALUE


@pytest.mark.parametrize("batch,seq,topk", [(0, 1, 8), (1, 1, 1), (3, 2, 2048), (64, 4, 17)])
def test_gather_workspace_depends_on_sizes_only(lib, batch, seq, topk):
    p = good_gather()
    p.batch, p.seqPerBatch, p.topk = batch, seq, topk
    size = lib.pytrt_kv_gather_workspace_size(ctypes.byref(p))
    assert size >= batch * seq * topk * 4 and size % 256 == 0
    p.workspace, p.fullKvCache, p.kvDim = None, None, 1
    assert lib.pytrt_kv_gather_workspace_size(ctypes.byref(p)) == size


def _runs():
    """(mode, L, w, o) over the uncompressed forms and valid compressed ones."""
    smax = 7
    for mode in ("rope", "omni"):
        for L in range(0, smax + 1):
            yield mode, L, 3, -1
            yield mode, L, 0, min(1, L)
            yield mode, L, 2, L
            # uncompressed heads write L rows whatever w is, a negative w included
            yield mode, L, -1, -1
            yield mode, L, -5, L
            for o, w in itertools.product(range(L + 1), range(1, L + 1)):
                if o + w <= L and o != L:
                    yield mode, L, w, o
    for L in range(0, smax + 1):
        for w in range(0, L + 1):
            yield "alibi", L, w, -1


@pytest.mark.parametrize("mode", ["rope", "omni", "alibi"])
def test_compress_rows_match_reference(lib, rng, mode):
    smax, bs = 7, 3
    mode_code = _cuda.MODE_CODE[mode]
    for m, L, w, o in _runs():
        if m != mode:
            continue
        key = rng.standard_normal((1, smax, 1, 4)).astype(np.float32)
        cache = np.full((4, bs, 1, 4), -7.5, np.float32)
        base = 2  # crosses block boundaries
        scatter_pa_kv_cache(
            key,
            None,
            cache,
            None,
            np.array([[base]], np.int32),
            compress_lens=np.array([[w]], np.int32),
            compress_seq_offsets=(np.array([o], np.int32) if mode != "alibi" else None),
            seq_lens=np.array([L], np.int32),
            compress_mode=mode,
        )
        source = np.full(smax, 99, np.int32)
        rows = lib.pytrt_kv_compress_rows_host(
            mode_code, L, w, o, smax, source.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        )
        got = cache.reshape(-1, 4)
        ctx = f"mode={mode} L={L} w={w} o={o} source={source.tolist()}"
        assert rows == int((source != -1).sum()), ctx
        for i in range(smax):
            row = got[base + i]
            if source[i] == -1:
                assert (row == -7.5).all(), ctx
            elif source[i] == -2:
                acc = np.float32(0)
                for t in range(o, o + w):
                    acc = np.float32(acc + key[0, t, 0])
                assert np.array_equal(row, acc / np.float32(w)), ctx
            else:
                assert np.array_equal(row, key[0, source[i], 0]), ctx
        assert (got[:base] == -7.5).all() and (got[base + smax :] == -7.5).all(), ctx


@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize(
    "L,w,o", [(9, 1, 0), (-1, 0, 0), (5, 6, 0), (5, 3, 4), (5, -1, 2), (5, 2, -3)]
)
def test_compress_rows_invalid_runs_write_nothing(lib, mode, L, w, o):
    """Values the reference refuses (L > Smax, w < 0 for alibi or a compressed head,
    o + w > L, o < -1) give an empty run on the GPU: in bounds, nothing written."""
    source = np.full(8, 99, np.int32)
    rows = lib.pytrt_kv_compress_rows_host(
        mode, L, w, o, 8, source.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
    )
    if mode == 2 and 0 <= w <= L <= 8:
        return  # alibi ignores o: a valid run
    assert rows == 0 and (source == -1).all()
