"""pytrt_kv.ops.scatter_pa_kv_cache on the GPU, bit-exact against the reference
(docs/SPEC.md S), plus the host-side behaviour of pytrt_kv.ops that needs no GPU.

GPU tests (marker ``gpu``) run on a real GPU with torch CUDA tensors, and on the emulated
device (docs/EMULATION.md) with pytrt_kv's own buffers (tests/support/device.py); the ones
that need torch streams, CUDA graphs or CuPy are marked ``real_gpu``. Caches are
pre-filled with a sentinel byte pattern so that every byte outside the addressed rows is
checked to be untouched.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from pytrt_kv import _cuda
from pytrt_kv.contract import dtypes
from pytrt_kv.reference import scatter_pa_kv_cache as ref_scatter
from support import device as dv
from support.arrays import (
    FakeCudaArray,
    assert_same_bits,
    cache_shape,
    random_data,
    sentinel,
    to_torch,
    torch_mod,
)
from support.device import gpu, real_gpu


def distinct_slots(rng, n, num_slots, pad_frac=0.2, dtype=np.int32):
    slots = rng.permutation(num_slots)[:n].astype(np.int64)
    slots[rng.random(n) < pad_frac] = -1
    return slots.astype(dtype)


def _key_only(rng, dtype, *, T, H, D, NB, BS):
    """A key-only nd scatter in NumPy: key, slots (some -1), a sentinel cache and the
    cache the reference writes from them."""
    key = random_data(rng, (T, H, D), dtype)
    slots = distinct_slots(rng, T, NB * BS)
    cache = sentinel((NB, BS, H, D), dtype)
    want = cache.copy()
    ref_scatter(key, None, want, None, slots)
    return key, slots, cache, want


def run_both(kw_np: dict, device_kwargs=None, **ops_kw):
    """Run the reference on NumPy copies and pytrt_kv.ops on device copies; return both
    sets of caches as NumPy."""
    from pytrt_kv import ops

    # Copy only the arrays: cache_layout / compress_mode are strings (no .copy()).
    want = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in kw_np.items()}
    ref_kw = {k: v for k, v in want.items() if k not in ("out_of_range",)}
    ref_scatter(
        ref_kw.pop("key"),
        ref_kw.pop("value"),
        ref_kw.pop("key_cache"),
        ref_kw.pop("value_cache"),
        ref_kw.pop("slot_mapping"),
        **ref_kw,
    )
    dev = {k: (dv.to_device(v) if isinstance(v, np.ndarray) else v) for k, v in kw_np.items()}
    if device_kwargs:
        dev.update(device_kwargs)
    d = dict(dev)
    ops.scatter_pa_kv_cache(
        d.pop("key"),
        d.pop("value"),
        d.pop("key_cache"),
        d.pop("value_cache"),
        d.pop("slot_mapping"),
        **d,
        **ops_kw,
    )
    dv.synchronize()
    return want, {k: dv.to_numpy(dev[k]) for k, v in kw_np.items() if isinstance(v, np.ndarray)}


# --- GPU: 3-D key --------------------------------------------------------------------------

LAYOUT_CASES = [
    # (T, H, Dk, Dv, NB, BS)
    (1, 1, 16, 16, 2, 16),
    (7, 2, 64, 32, 5, 3),
    (33, 8, 128, 128, 9, 16),
    (300, 4, 96, 96, 40, 17),
    (64, 1, 576, 512, 10, 64),
]


def _layout_grid():
    """(layout, dtype, case) triples; nz only where H*D*itemsize % 32 == 0 (docs/SPEC.md
    S4: other sizes have no nz form, and are refused, tests/test_reference_scatter.py)."""
    for layout in ("nd", "hnd", "nz"):
        for dtype in ("bfloat16", "float16", "float32", "int8", "float8_e4m3fn"):
            for case in LAYOUT_CASES:
                _, H, Dk, Dv, _, _ = case
                item = dtypes.itemsize(dtype)
                if layout == "nz" and ((H * Dk * item) % 32 or (H * Dv * item) % 32):
                    continue
                yield pytest.param(
                    layout, dtype, case, id=f"{layout}-{dtype}-" + "x".join(map(str, case))
                )


@gpu
@pytest.mark.parametrize("layout,dtype,case", list(_layout_grid()))
@pytest.mark.parametrize("index", ["int32", "int64"])
def test_scatter_3d_bit_exact(rng, layout, dtype, case, index):
    T, H, Dk, Dv, NB, BS = case
    kw = dict(
        key=random_data(rng, (T, H, Dk), dtype),
        value=random_data(rng, (T, H, Dv), dtype),
        key_cache=sentinel(cache_shape(layout, NB, BS, H, Dk, dtype), dtype),
        value_cache=sentinel(cache_shape(layout, NB, BS, H, Dv, dtype), dtype),
        slot_mapping=distinct_slots(rng, T, NB * BS, dtype=np.dtype(index)),
        cache_layout=layout,
    )
    want, got = run_both(kw)
    assert_same_bits(got["key_cache"], want["key_cache"], "key_cache")
    assert_same_bits(got["value_cache"], want["value_cache"], "value_cache")


def random_bytes(rng, shape, dtype: str) -> np.ndarray:
    """Uniformly random bit patterns (NaN, inf, denormals included) in the storage dtype."""
    nd = dtypes.numpy_dtype(dtype)
    n = int(np.prod(shape)) * nd.itemsize
    return rng.integers(0, 256, n, dtype=np.uint8).view(nd).reshape(shape)


@gpu
@pytest.mark.parametrize("layout", ["nd", "hnd", "nz"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float8_e4m3fn"])
def test_scatter_random_bytes_move_exactly(rng, layout, dtype):
    """Issue 16 C2: any bit pattern (NaN payloads, inf, denormals) is copied unchanged."""
    T, H, D, NB, BS = 24, 2, 32, 4, 8
    kw = dict(
        key=random_bytes(rng, (T, H, D), dtype),
        value=random_bytes(rng, (T, H, D), dtype),
        key_cache=sentinel(cache_shape(layout, NB, BS, H, D, dtype), dtype),
        value_cache=sentinel(cache_shape(layout, NB, BS, H, D, dtype), dtype),
        slot_mapping=distinct_slots(rng, T, NB * BS),
        cache_layout=layout,
    )
    want, got = run_both(kw)
    assert_same_bits(got["key_cache"], want["key_cache"], "key_cache")
    assert_same_bits(got["value_cache"], want["value_cache"], "value_cache")


@gpu
@pytest.mark.parametrize("layout", ["nd", "hnd", "nz"])
@pytest.mark.parametrize("offset", [1, 2, 3])
def test_scatter_unaligned_buffers_fall_back(rng, layout, offset):
    """Addresses that are not 16-byte aligned use narrower vectors, same bytes."""
    from pytrt_kv import ops

    T, H, D, NB, BS, dtype = 20, 2, 32, 6, 7, "float16"
    key = random_data(rng, (T, H, D), dtype)
    cache = sentinel(cache_shape(layout, NB, BS, H, D, dtype), dtype)
    slots = distinct_slots(rng, T, NB * BS)
    want = cache.copy()
    ref_scatter(key, None, want, None, slots, cache_layout=layout)
    tk = dv.to_device(key, offset_elems=offset)
    tc = dv.to_device(cache, offset_elems=offset)
    assert dv.address(tk) % 16 and dv.address(tc) % 16
    ops.scatter_pa_kv_cache(tk, None, tc, None, dv.to_device(slots), cache_layout=layout)
    assert_same_bits(dv.to_numpy(tc), want, "key_cache")


@gpu
def test_scatter_nz_mixed_dtypes(rng):
    """nz: key and value may differ in dtype (docs/SPEC.md S8)."""
    T, H, NB, BS = 10, 2, 4, 16
    kw = dict(
        key=random_data(rng, (T, H, 32), "bfloat16"),
        value=random_data(rng, (T, H, 64), "int8"),
        key_cache=sentinel(cache_shape("nz", NB, BS, H, 32, "bfloat16"), "bfloat16"),
        value_cache=sentinel(cache_shape("nz", NB, BS, H, 64, "int8"), "int8"),
        slot_mapping=distinct_slots(rng, T, NB * BS),
        cache_layout="nz",
    )
    want, got = run_both(kw)
    assert_same_bits(got["key_cache"], want["key_cache"], "key_cache")
    assert_same_bits(got["value_cache"], want["value_cache"], "value_cache")


@gpu
@pytest.mark.parametrize("layout", ["nd", "hnd", "nz"])
def test_scatter_out_of_range_slots_are_skipped(rng, layout):
    """Slots >= NB*BS (the reference raises) are never written: same as padding."""
    from pytrt_kv import ops

    T, H, D, NB, BS, dtype = 40, 2, 16, 3, 5, "bfloat16"
    key = random_data(rng, (T, H, D), dtype)
    cache = sentinel(cache_shape(layout, NB, BS, H, D, dtype), dtype)
    slots = distinct_slots(rng, T, NB * BS + 1000, pad_frac=0.1)
    slots[:3] = [NB * BS, NB * BS + 1, 2**31 - 1]
    as_padding = np.where(slots >= NB * BS, -1, slots).astype(np.int32)
    want = cache.copy()
    ref_scatter(key, None, want, None, as_padding, cache_layout=layout)
    tc = dv.to_device(cache)
    ops.scatter_pa_kv_cache(
        dv.to_device(key), None, tc, None, dv.to_device(slots), cache_layout=layout
    )
    assert_same_bits(dv.to_numpy(tc), want, "key_cache")
    with pytest.raises(ValueError, match="slot"):
        ops.scatter_pa_kv_cache(
            dv.to_device(key),
            None,
            tc,
            None,
            dv.to_device(slots),
            cache_layout=layout,
            validate=True,
        )


@gpu
def test_scatter_key_only_and_empty(rng):
    T, H, D, NB, BS = 5, 1, 8, 2, 4
    kw = dict(
        key=random_data(rng, (T, H, D), "float32"),
        value=None,
        key_cache=sentinel((NB, BS, H, D), "float32"),
        value_cache=None,
        slot_mapping=distinct_slots(rng, T, NB * BS),
    )
    want, got = run_both(kw)
    assert_same_bits(got["key_cache"], want["key_cache"], "key_cache")
    kw0 = dict(
        key=random_data(rng, (0, H, D), "float32"),
        value=None,
        key_cache=sentinel((NB, BS, H, D), "float32"),
        value_cache=None,
        slot_mapping=np.zeros(0, np.int32),
    )
    want, got = run_both(kw0)
    assert_same_bits(got["key_cache"], want["key_cache"], "key_cache")


@gpu
@pytest.mark.parametrize("where", ["valid address", "address 0"])
def test_scatter_zero_tokens_at_any_address(rng, where):
    """T == 0: key, value and slot_mapping zero-element, bound at a valid (non-null)
    device address or at 0; the caches are untouched and the call succeeds."""
    from pytrt_kv import ops

    H, D, NB, BS = 2, 16, 3, 4
    cache = dv.to_device(sentinel((NB, BS, H, D), "bfloat16"))
    vcache = dv.to_device(sentinel((NB, BS, H, D), "bfloat16"))
    before = dv.to_numpy(cache)
    if where == "valid address":
        key = dv.zero_elements((0, H, D), "bfloat16")
        value = dv.zero_elements((0, H, D), "bfloat16")
        slots = dv.zero_elements((0,), "int32")
        assert dv.address(key) != 0 and dv.address(slots) != 0
    else:
        key = dv.zero_elements((0, H, D), "bfloat16", null=True)
        value = dv.zero_elements((0, H, D), "bfloat16", null=True)
        slots = dv.zero_elements((0,), "int32", null=True)
    ops.scatter_pa_kv_cache(key, value, cache, vcache, slots)
    dv.synchronize()
    assert_same_bits(dv.to_numpy(cache), before, "key_cache")
    assert_same_bits(dv.to_numpy(vcache), before, "value_cache")


# --- GPU: 4-D key (compressing write) ------------------------------------------------------


def compress_case(rng, mode, dtype, index, B, Smax, H, D, NB, BS, with_value, data=None):
    """Valid random S6 inputs: non-overlapping runs, some heads padded, every run kind.
    ``data(rng, shape, dtype)`` makes key/value (default: finite random values)."""
    data = random_data if data is None else data
    seq = rng.integers(0, Smax + 1, B)
    lens = np.zeros((B, H), np.int64)
    offs = np.full((B, H), -1, np.int64)
    rows = np.zeros((B, H), np.int64)
    for b in range(B):
        L = int(seq[b])
        for h in range(H):
            if mode == "alibi":
                lens[b, h] = rng.integers(0, L + 1)
                rows[b, h] = lens[b, h]
                continue
            kind = rng.integers(0, 4)
            if kind == 0 or L == 0:  # uncompressed via o == -1 (w is garbage)
                lens[b, h], offs[b, h] = rng.integers(0, 9), -1
            elif kind == 1:  # uncompressed via o == L
                lens[b, h], offs[b, h] = 0, L
            else:
                o = int(rng.integers(0, L))
                w = int(rng.integers(1, L - o + 1))
                lens[b, h], offs[b, h] = w, o
            comp = not (offs[b, h] == -1 or lens[b, h] == 0 or offs[b, h] == L)
            rows[b, h] = (L - lens[b, h] + (1 if mode == "rope" else 0)) if comp else L
    # Runs packed one after another with random gaps, crossing block boundaries.
    base = np.full((B, H), -1, np.int64)
    nxt = int(rng.integers(0, BS))
    for b in range(B):
        for h in range(H):
            if rng.random() < 0.15:
                continue  # padding run
            base[b, h] = nxt
            nxt += int(rows[b, h]) + int(rng.integers(0, 3))
    assert nxt <= NB * BS, "test case too large for the cache"
    idt = np.dtype(index)
    kw = dict(
        key=data(rng, (B, Smax, H, D), dtype),
        value=data(rng, (B, Smax, H, D + 8), dtype) if with_value else None,
        key_cache=sentinel((NB, BS, 1, D), dtype),
        value_cache=sentinel((NB, BS, 1, D + 8), dtype) if with_value else None,
        slot_mapping=base.astype(idt),
        compress_lens=lens.astype(idt),
        compress_seq_offsets=offs.reshape(-1).astype(idt) if mode != "alibi" else None,
        seq_lens=seq.astype(idt),
        compress_mode=mode,
    )
    return kw


@gpu
@pytest.mark.parametrize(
    "mode,dtype",
    [
        ("rope", "float16"),
        ("rope", "bfloat16"),
        ("rope", "float32"),
        ("omni", "bfloat16"),
        ("omni", "int8"),
        ("alibi", "float16"),
        ("alibi", "float8_e4m3fn"),
    ],
)
@pytest.mark.parametrize("index", ["int32", "int64"])
@pytest.mark.parametrize(
    "shape",
    [(1, 5, 1, 16, 8, 4), (3, 9, 2, 64, 40, 7), (4, 33, 4, 128, 200, 16), (2, 16, 3, 576, 60, 5)],
    ids=lambda s: "x".join(map(str, s)),
)
@pytest.mark.parametrize("with_value", [True, False])
def test_scatter_compress_bit_exact(rng, mode, dtype, index, shape, with_value):
    B, Smax, H, D, NB, BS = shape
    kw = compress_case(rng, mode, dtype, index, B, Smax, H, D, NB, BS, with_value)
    want, got = run_both(kw)
    assert_same_bits(got["key_cache"], want["key_cache"], "key_cache")
    if with_value:
        assert_same_bits(got["value_cache"], want["value_cache"], "value_cache")


def rope_mean_slots(kw) -> set[int]:
    """The cache slots that receive a "rope" mean row (S6)."""
    base, lens = kw["slot_mapping"], kw["compress_lens"]
    offs = kw["compress_seq_offsets"].reshape(base.shape)
    out = set()
    for (b, h), slot in np.ndenumerate(base):
        L, w, o = int(kw["seq_lens"][b]), int(lens[b, h]), int(offs[b, h])
        if slot >= 0 and not (o == -1 or w == 0 or o == L):
            out.add(int(slot) + o)
    return out


def assert_same_bits_but_nan_means(got, want, mean_slots, name):
    """Bit-exact, except that a mean row may hold any NaN where the reference has a NaN
    (docs/SPEC.md S6)."""
    g = got.reshape(-1, got.shape[-1])
    w = want.reshape(-1, want.shape[-1])
    differ = g.view(np.uint8).reshape(g.shape[0], -1) != w.view(np.uint8).reshape(w.shape[0], -1)
    for slot in np.flatnonzero(differ.any(axis=1)):
        assert int(slot) in mean_slots, f"{name}: copied row {slot} differs"
        gf, wf = g[slot].astype(np.float32), w[slot].astype(np.float32)
        bad = (g[slot].view(np.uint8) != w[slot].view(np.uint8)).reshape(len(gf), -1).any(axis=1)
        assert np.isnan(gf[bad]).all() and np.isnan(wf[bad]).all(), (
            f"{name}: mean row {slot} differs outside NaN"
        )


@gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("with_value", [True, False])
def test_scatter_rope_random_bytes(rng, dtype, with_value):
    """Issue 16 C2: random bit patterns (NaN payloads, inf, denormals) through the rope
    compressing write: copied rows bit-exact, a NaN mean any NaN."""
    kw = compress_case(
        rng, "rope", dtype, "int32", 3, 9, 2, 64, 40, 7, with_value, data=random_bytes
    )
    want, got = run_both(kw)
    means = rope_mean_slots(kw)
    assert_same_bits_but_nan_means(got["key_cache"], want["key_cache"], means, "key_cache")
    if with_value:
        assert_same_bits_but_nan_means(
            got["value_cache"], want["value_cache"], means, "value_cache"
        )


@gpu
def test_scatter_compress_rows_past_cache_are_skipped(rng):
    """A run that reaches past NB*BS writes only its rows inside the cache."""
    from pytrt_kv import ops

    B, Smax, H, D, NB, BS = 1, 8, 1, 16, 2, 4
    key = random_data(rng, (B, Smax, H, D), "float16")
    cache = sentinel((NB, BS, 1, D), "float16")
    base, L = NB * BS - 3, 8
    tc = dv.to_device(cache)
    ops.scatter_pa_kv_cache(
        dv.to_device(key),
        None,
        tc,
        None,
        dv.to_device(np.array([[base]], np.int32)),
        compress_lens=dv.to_device(np.array([[0]], np.int32)),
        compress_seq_offsets=dv.to_device(np.array([-1], np.int32)),
        seq_lens=dv.to_device(np.array([L], np.int32)),
        compress_mode="rope",
    )
    want = cache.reshape(-1, D).copy()
    want[base:] = key[0, :3, 0]
    assert_same_bits(dv.to_numpy(tc).reshape(-1, D), want, "key_cache")


# --- GPU: frameworks, streams, graphs ------------------------------------------------------


@real_gpu
def test_scatter_on_explicit_stream_and_int_handle(rng):
    from pytrt_kv import ops

    torch = torch_mod()
    key, slots, cache, want = _key_only(rng, "bfloat16", T=50, H=4, D=64, NB=8, BS=16)
    for stream_arg in ("torch", "int"):
        s = torch.cuda.Stream()
        tk, tc, ts = to_torch(key), to_torch(cache), to_torch(slots)
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            ops.scatter_pa_kv_cache(
                tk, None, tc, None, ts, stream=s if stream_arg == "torch" else s.cuda_stream
            )
        s.synchronize()
        assert_same_bits(dv.to_numpy(tc), want, f"key_cache ({stream_arg} stream)")


@real_gpu
def test_scatter_cuda_graph_capture_and_replay(rng):
    """Captured once, replayed with new keys and slots copied into the same buffers."""
    from pytrt_kv import ops

    torch = torch_mod()
    T, H, D, NB, BS = 16, 8, 128, 12, 16
    key = to_torch(random_data(rng, (T, H, D), "bfloat16"))
    val = to_torch(random_data(rng, (T, H, D), "bfloat16"))
    kc = to_torch(sentinel((NB, BS, H, D), "bfloat16"))
    vc = to_torch(sentinel((NB, BS, H, D), "bfloat16"))
    slots = to_torch(distinct_slots(rng, T, NB * BS))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ops.scatter_pa_kv_cache(key, val, kc, vc, slots)  # warm-up (loads the library)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.scatter_pa_kv_cache(key, val, kc, vc, slots)
    want_k, want_v = dv.to_numpy(kc), dv.to_numpy(vc)
    for _ in range(3):
        nk = random_data(rng, (T, H, D), "bfloat16")
        nv = random_data(rng, (T, H, D), "bfloat16")
        ns = distinct_slots(rng, T, NB * BS)
        key.copy_(to_torch(nk))
        val.copy_(to_torch(nv))
        slots.copy_(to_torch(ns))
        graph.replay()
        torch.cuda.synchronize()
        ref_scatter(nk, nv, want_k, want_v, ns)
        assert_same_bits(dv.to_numpy(kc), want_k, "key_cache after replay")
        assert_same_bits(dv.to_numpy(vc), want_v, "value_cache after replay")


@real_gpu
def test_scatter_cupy_inputs(rng):
    cupy = pytest.importorskip("cupy")
    from pytrt_kv import ops

    key, slots, cache, want = _key_only(rng, "float16", T=30, H=2, D=64, NB=6, BS=16)
    cc = cupy.asarray(cache)
    ops.scatter_pa_kv_cache(cupy.asarray(key), None, cc, None, cupy.asarray(slots))
    cupy.cuda.get_current_stream().synchronize()
    assert_same_bits(cupy.asnumpy(cc), want, "key_cache (cupy)")


@gpu
def test_scatter_validate_reports_duplicates(rng):
    from pytrt_kv import ops

    key = dv.to_device(random_data(rng, (4, 1, 8), "float16"))
    cache = dv.to_device(sentinel((2, 4, 1, 8), "float16"))
    slots = dv.to_device(np.array([1, 5, 1, -1], np.int32))
    with pytest.raises(ValueError):
        ops.scatter_pa_kv_cache(key, None, cache, None, slots, validate=True)
    ops.scatter_pa_kv_cache(key, None, cache, None, slots)  # in bounds, any winner
    dv.synchronize()


@gpu
def test_scatter_rejects_host_and_strided_buffers(rng):
    from pytrt_kv import ops

    key = random_data(rng, (4, 2, 8), "float16")
    cache = dv.to_device(sentinel((2, 4, 2, 8), "float16"))
    slots = dv.to_device(np.arange(4, dtype=np.int32))
    host = to_torch(key, device="cpu") if dv.use_torch() else key  # pageable host memory
    with pytest.raises(ValueError, match="key: expected GPU memory"):
        ops.scatter_pa_kv_cache(host, None, cache, None, slots)
    strided = dv.strided_view(dv.to_device(random_data(rng, (4, 2, 16), "float16")), (4, 2, 8))
    with pytest.raises(ValueError, match="key: expected a C-contiguous"):
        ops.scatter_pa_kv_cache(strided, None, cache, None, slots)


# --- CPU: what pytrt_kv.ops does before touching the GPU -----------------------------------


def test_import_needs_no_framework():
    code = (
        "import sys, pytrt_kv.ops, pytrt_kv.bench\n"
        "print(','.join(m for m in ('torch', 'cupy', 'pycuda') if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ""


def test_cuda_array_interface_is_read_without_a_gpu():
    b = _cuda.buffer("key", FakeCudaArray((3, 4, 8), "<f2"))
    assert (b.shape, b.dtype, b.contiguous, b.ptr) == (
        (3, 4, 8),
        np.dtype(np.float16),
        True,
        0x7F0000000000,
    )
    b = _cuda.buffer("key", FakeCudaArray((3, 4, 8), "<f2", strides=(128, 32, 2)))
    assert not b.contiguous
    b = _cuda.buffer("key", FakeCudaArray((3, 1, 8), "<i4", strides=(32, 999, 4)))
    assert b.contiguous  # a size-1 dimension's stride is irrelevant


def test_dlpack_is_read_without_a_gpu():
    torch = pytest.importorskip("torch")

    class OnlyDlpack:
        def __init__(self, t):
            self.t = t

        def __dlpack__(self, stream=None):
            return self.t.__dlpack__()

        def __dlpack_device__(self):
            return self.t.__dlpack_device__()

    t = torch.arange(24, dtype=torch.bfloat16).reshape(2, 3, 4)
    b = _cuda.buffer("key", OnlyDlpack(t))
    assert b.shape == (2, 3, 4) and b.dtype == dtypes.numpy_dtype("bfloat16")
    assert b.ptr == t.data_ptr() and b.kind == _cuda.HOST and b.contiguous
    b = _cuda.buffer("key", OnlyDlpack(t.transpose(0, 2)))
    assert not b.contiguous


def test_torch_cpu_tensor_is_described():
    torch = pytest.importorskip("torch")
    t = torch.zeros((2, 3), dtype=torch.float8_e4m3fn)
    b = _cuda.buffer("full_kv_cache", t)
    assert b.kind == _cuda.HOST and b.dtype == dtypes.numpy_dtype("float8_e4m3fn")


def test_shape_errors_come_before_any_gpu_work():
    from pytrt_kv import ops

    key = FakeCudaArray((3, 4, 8), "<f2")
    cache = FakeCudaArray((2, 16, 4, 9), "<f2")  # wrong head size
    slots = FakeCudaArray((3,), "<i4")
    with pytest.raises(ValueError, match="key_cache"):
        ops.scatter_pa_kv_cache(key, None, cache, None, slots)
    with pytest.raises(TypeError, match="slot_mapping"):
        ops.scatter_pa_kv_cache(
            key, None, FakeCudaArray((2, 16, 4, 8), "<f2"), None, FakeCudaArray((3,), "<f4")
        )
    with pytest.raises(TypeError, match="key: expected a CUDA buffer"):
        ops.scatter_pa_kv_cache([1, 2], None, cache, None, slots)


def test_strided_buffer_is_refused_before_any_gpu_work():
    from pytrt_kv import ops

    key = FakeCudaArray((3, 4, 8), "<f2", strides=(128, 32, 2))
    with pytest.raises(ValueError, match="key: expected a C-contiguous"):
        ops.scatter_pa_kv_cache(
            key, None, FakeCudaArray((2, 16, 4, 8), "<f2"), None, FakeCudaArray((3,), "<i4")
        )


@pytest.mark.parametrize("stream,want", [(None, 0), (0, 0), (12345, 12345)])
def test_stream_resolution(stream, want):
    assert _cuda.resolve_stream(stream, [FakeCudaArray((1,), "<f2")], 0) == want


def test_stream_objects_are_unwrapped():
    class TorchLike:
        cuda_stream = 77

    class CupyLike:
        ptr = 88

    class CoreLike:
        def __cuda_stream__(self):
            return (0, 99)

    assert _cuda.resolve_stream(TorchLike(), [], 0) == 77
    assert _cuda.resolve_stream(CupyLike(), [], 0) == 88
    assert _cuda.resolve_stream(CoreLike(), [], 0) == 99
    with pytest.raises(TypeError, match="stream"):
        _cuda.resolve_stream("fast", [], 0)
    with pytest.raises(TypeError, match="stream"):
        _cuda.resolve_stream(True, [], 0)
