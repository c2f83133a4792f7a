"""Buffers entering ``pytrt_kv.ops`` and the memory pytrt_kv allocates itself are checked
before anything is allocated, read or written (issue 31 item 2): negative dims, byte
counts that wrap an int64, zero strides, read-only buffers used as outputs, the gather's
32-bit kernel limits; every dtype of docs/SPEC.md through ``__cuda_array_interface__``
and DLPack; and the gather's own outputs come from a per-stream pool, so a steady-state
decode loop makes no cudaMalloc/cudaFree per call (issue 31 item 5).

Allocations are counted by wrapping the kernel library's ``pytrt_kv_device_malloc`` /
``pytrt_kv_device_free`` (what ``DeviceArray`` calls), so the tests run on the emulated
device (docs/EMULATION.md) as on a GPU; they need pytrt_kv's own buffers, hence the
pytrt_kv ``DeviceArray`` everywhere (marker ``gpu``).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from pytrt_kv import _cuda, ops
from pytrt_kv._cuda import memory
from pytrt_kv.contract import dtypes
from pytrt_kv.reference import gather_selection_kv_cache as ref_gather
from pytrt_kv.reference import scatter_pa_kv_cache as ref_scatter
from support.arrays import FakeCudaArray
from support.device import gpu


class _Counting:
    """The kernel library with its device malloc/free calls counted."""

    def __init__(self, lib):
        self._lib, self.malloc, self.free = lib, 0, 0

    def __getattr__(self, name):
        fn = getattr(self._lib, name)
        if name not in ("pytrt_kv_device_malloc", "pytrt_kv_device_free"):
            return fn

        def counted(*args):
            if name.endswith("malloc"):
                self.malloc += 1
            else:
                self.free += 1
            return fn(*args)

        return counted


@pytest.fixture
def counts(monkeypatch):
    """Counts of device allocations and frees made through pytrt_kv's memory module."""
    lib = _cuda.kernels()
    counting = _Counting(lib)
    monkeypatch.setattr(memory, "kernels", lambda: counting)
    monkeypatch.setattr(memory.abi, "loaded", lambda: counting)
    return counting


class _Cai:
    """``__cuda_array_interface__`` over another buffer's memory, with a chosen shape,
    strides, typestr and read-only flag (a CuPy/PyCUDA-like producer)."""

    def __init__(self, base, shape=None, strides=None, readonly=False, typestr=None, dtype=None):
        cai = base.__cuda_array_interface__
        self.base = base
        if dtype is not None:
            self.dtype = dtype
        self.__cuda_array_interface__ = {
            "shape": tuple(cai["shape"] if shape is None else shape),
            "typestr": typestr or (dtype.str if dtype is not None else cai["typestr"]),
            "data": (cai["data"][0], readonly),
            "strides": strides,
            "version": 3,
        }


def _scatter_args(rng, cache_dtype=np.float16):
    key = rng.standard_normal((3, 2, 16)).astype(np.float16)
    cache = np.full((4, 4, 2, 16), 7, np.float16).astype(cache_dtype)
    slots = np.array([1, 14, 6], np.int32)
    return key, cache, slots


# --- DeviceArray / HostArray ------------------------------------------------------------


@gpu
@pytest.mark.parametrize(
    "shape,why",
    [
        ((2**62 + 1, 1, 1, 4), "at most 2^63-1 bytes"),  # wrapped to 16 bytes before
        ((2**61, 2, 2), "at most 2^63-1 bytes"),
        ((-1, 4), "dims >= 0"),
        ((-2, -3), "dims >= 0"),  # a positive product of negative dims
    ],
)
def test_device_and_host_arrays_refuse_bad_shapes_before_allocating(counts, shape, why):
    for make in (_cuda.DeviceArray, _cuda.HostArray):
        with pytest.raises(ValueError, match=r"^shape: expected .*" + why.replace("^", r"\^")) as e:
            make(shape, np.float32)
        assert str(list(shape)) in str(e.value), e.value
    assert counts.malloc == 0


@gpu
def test_a_wrapping_shape_never_reaches_the_kernel(rng, counts):
    """A key_cache whose byte count wraps an int64 (a CuPy-like view over 16 real bytes)
    is refused by name before any launch, even with validate=True."""
    key, cache, slots = _scatter_args(rng)
    small = _cuda.DeviceArray((4,), np.float32)
    bad = _Cai(small, shape=(2**62 + 1, 1, 1, 4), dtype=np.dtype(np.float32))
    k, s = _cuda.DeviceArray.from_numpy(key), _cuda.DeviceArray.from_numpy(slots)
    before = counts.malloc
    for validate in (False, True):
        with pytest.raises(ValueError, match=r"^key_cache: expected at most 2\^63-1 bytes"):
            ops.scatter_pa_kv_cache(k, None, bad, None, s, validate=validate)
    with pytest.raises(ValueError, match=r"^key_cache: expected dims >= 0 .*got shape \[4, -4"):
        ops.scatter_pa_kv_cache(k, None, _Cai(small, shape=(4, -4, 2, 16)), None, s)
    assert counts.malloc == before


# --- strides, read-only -------------------------------------------------------------------


@gpu
def test_zero_stride_output_is_refused(rng):
    key, cache, slots = _scatter_args(rng)
    k, c, s = (_cuda.DeviceArray.from_numpy(a) for a in (key, cache, slots))
    # Every block of the cache is the same memory: the kernel would race with itself.
    alias = _Cai(c, strides=(0, 2 * 2 * 16 * 2, 16 * 2, 2))
    want = r"^key_cache: expected .*elements do not overlap, got float16\[4, 4, 2, 16\] with "
    want += r"strides \[0, 128, 32, 2\] \(stride 0 on dim 0"
    with pytest.raises(ValueError, match=want):
        ops.scatter_pa_kv_cache(k, None, alias, None, s)
    assert (c.get() == cache).all()


@gpu
def test_read_only_buffers_are_refused_as_outputs_only(rng):
    key, cache, slots = _scatter_args(rng)
    k, c, s = (_cuda.DeviceArray.from_numpy(a) for a in (key, cache, slots))
    with pytest.raises(ValueError, match=r"^key_cache: expected a writable buffer .*got a "
                       r"read-only float16\[4, 4, 2, 16\]"):  # fmt: skip
        ops.scatter_pa_kv_cache(k, None, _Cai(c, readonly=True), None, s)
    assert (c.get() == cache).all()
    # A read-only input is fine: the call only reads it.
    ops.scatter_pa_kv_cache(_Cai(k, readonly=True), None, c, None, s)
    want = cache.copy()
    ref_scatter(key, None, want, None, slots)
    assert (c.get() == want).all()


# --- dtypes -------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("name", sorted(dtypes.NUMPY))
def test_every_spec_dtype_through_cuda_array_interface(name):
    arr = _cuda.DeviceArray((3, 2), dtypes.NUMPY[name])
    buf = _cuda.buffer("x", arr)
    assert buf.dtype == dtypes.NUMPY[name] and buf.shape == (3, 2)


def test_float8_e5m2_typestr_without_a_dtype_attribute():
    """ml_dtypes writes float8_e5m2 as typestr '<f1', which NumPy cannot parse: it used
    to fail with NumPy's bare "data type '<f1' not understood"."""
    buf = _cuda.buffer("key_cache", FakeCudaArray((2, 4), "<f1"))
    assert buf.dtype == np.dtype(ml_dtypes.float8_e5m2)
    with pytest.raises(TypeError, match=r"^key_cache: expected a dtype in .*typestr '<V2'"):
        _cuda.buffer("key_cache", FakeCudaArray((2, 4), "<V2"))


class _DlpackOnly:
    """Exposes only DLPack (as a JAX/TF array would)."""

    def __init__(self, t):
        self.t = t

    def __dlpack__(self, stream=None):
        del stream
        return self.t.__dlpack__()

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


@pytest.mark.parametrize("name", sorted(dtypes.NUMPY))
def test_every_spec_dtype_through_dlpack(name):
    torch = pytest.importorskip("torch")
    t = torch.zeros((3, 2), dtype=getattr(torch, name))
    buf = _cuda.buffer("x", _DlpackOnly(t))
    assert buf.dtype == dtypes.NUMPY[name] and buf.shape == (3, 2)
    assert buf.kind == _cuda.HOST  # a CPU tensor: refused later by placement, not by dtype


@gpu
def test_float8_e5m2_cache_scatter_matches_the_reference(rng):
    key, cache, slots = _scatter_args(rng, ml_dtypes.float8_e5m2)
    key = key.astype(ml_dtypes.float8_e5m2)
    k, c, s = (_cuda.DeviceArray.from_numpy(a) for a in (key, cache, slots))
    ops.scatter_pa_kv_cache(k, None, c, None, s, validate=True)
    want = cache.copy()
    ref_scatter(key, None, want, None, slots)
    assert c.get().view(np.uint8).tolist() == want.view(np.uint8).tolist()


@gpu
@pytest.mark.parametrize("scale", [np.float32(0.5), 0.5, np.float64(2.0)])
def test_a_scalar_scale_gets_a_message_saying_what_to_pass(rng, scale):
    key, _, slots = _scatter_args(rng)
    cache = np.zeros((4, 4, 2, 16), ml_dtypes.float8_e4m3fn)
    k, c, s = (_cuda.DeviceArray.from_numpy(a) for a in (key, cache, slots))
    want = r"^k_scale: expected a CUDA buffer \(a scalar such as a scale is passed as a 0-d "
    want += r"or 1-d GPU array.*got the Python/NumPy scalar"
    with pytest.raises(TypeError, match=want):
        ops.scatter_pa_kv_cache(k, None, c, None, s, k_scale=scale)


# --- the gather: limits before allocation, outputs pooled -----------------------------------


def _gather_case(rng, B=2, K=4):
    """A small valid gather (TBS 1, SBS = FBS = 4, KV 8, no k_rope), NumPy arrays."""
    sbn, fbn, kv = B * 2 + 1, B * 4, 8
    full_kv = rng.standard_normal((fbn, 4, kv)).astype(np.float16)
    sel_kv = np.full((sbn, 4, kv), 3, np.float16)
    sel_table = np.arange(B * 2, dtype=np.int32).reshape(B, 2)
    full_table = np.arange(fbn, dtype=np.int32).reshape(B, 4)
    status = np.full((B, 1, 1, K + 1), -1, np.int32)
    topk = np.tile(np.arange(K, dtype=np.int32), (B, 1, 1, 1))
    kv_len = np.full(B, 12, np.int32)
    q_len = np.arange(1, B + 1, dtype=np.int32)
    empty = np.zeros((0,), np.float16)
    return [empty, sel_kv, sel_table, status, topk, empty, full_kv, full_table, kv_len, q_len]


@gpu
def test_gather_over_the_kernel_limit_is_refused_before_any_allocation(rng, counts):
    """B*S*K > 2^31-1: refused by name before the output and the workspace (a 137 GB
    request before) are allocated. The big tensors are views of a few real bytes: only
    their shapes are read."""
    small = _cuda.DeviceArray((64,), np.int32)
    B, K = 2**20 + 1, 2048  # B*S*K = 2^31 + 2048
    args = [_cuda.DeviceArray.from_numpy(a) for a in _gather_case(rng)]
    big = {
        2: ((B, 2048), np.int32),  # selection_kv_block_table
        3: ((B, 1, 1, K + 1), np.int32),  # status
        4: ((B, 1, 1, K), np.int32),  # topk
        7: ((B, 4), np.int32),  # full_kv_block_table
        8: ((B,), np.int32),
        9: ((B,), np.int32),
    }
    for i, (shape, dt) in big.items():
        args[i] = _Cai(small, shape=shape, dtype=np.dtype(dt))
    args[1] = _Cai(small, shape=(2048, 1, 8), dtype=np.dtype(np.float16))
    before = counts.malloc
    for validate in (False, True):
        with pytest.raises(ValueError, match=r"^selection_topk_indices: expected B\*S\*K <= "
                           r"2\^31-1 .*got B\*S\*K = 2147485696"):  # fmt: skip
            ops.gather_selection_kv_cache(*args, selection_topk_block_size=1, validate=validate)
    assert counts.malloc == before


@gpu
def test_steady_state_gather_allocates_no_output(rng, counts):
    """Without out=, the gather's selection_kv_actual_seq comes from a per-stream pool:
    after the first call, a decode loop that drops each result makes no device malloc
    or free; with out= nothing is allocated at all. Values stay right."""
    host = _gather_case(rng)
    dev = [_cuda.DeviceArray.from_numpy(a) for a in host]
    want_status = host[3].copy()
    host_args = [a.copy() for a in host]
    host_args[3] = want_status
    want = ref_gather(*host_args, selection_topk_block_size=1)
    got = ops.gather_selection_kv_cache(*dev, selection_topk_block_size=1)
    assert got.get().tolist() == want.tolist()
    del got  # back to the pool
    first = (counts.malloc, counts.free)
    for _ in range(5):
        res = ops.gather_selection_kv_cache(*dev, selection_topk_block_size=1)
        assert res.get().tolist() == want.tolist()
        del res
    assert (counts.malloc, counts.free) == first, "a cudaMalloc/cudaFree per call"
    out = _cuda.DeviceArray((2,), np.int32)
    mark = (counts.malloc, counts.free)
    for _ in range(3):
        assert ops.gather_selection_kv_cache(*dev, selection_topk_block_size=1, out=out) is out
    assert (counts.malloc, counts.free) == mark
    assert out.get().tolist() == want.tolist()
    assert dev[3].get().tolist() == want_status.tolist()


@gpu
def test_pooled_outputs_are_not_shared_while_referenced(rng):
    """Two results kept alive are two buffers; the pool holds at most MAX_FREE per key."""
    dev = [_cuda.DeviceArray.from_numpy(a) for a in _gather_case(rng)]
    a = ops.gather_selection_kv_cache(*dev, selection_topk_block_size=1)
    b = ops.gather_selection_kv_cache(*dev, selection_topk_block_size=1)
    assert a.ptr != b.ptr
    pool = _cuda.OutputPool()
    held = [pool.take((2,), np.int32, -1, 7) for _ in range(pool.MAX_FREE + 3)]
    del held
    assert pool.held() == pool.MAX_FREE
