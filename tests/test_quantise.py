"""docs/SPEC.md S9, quantise on write: the reference against hand-computed encodings, the
contract's refusals, and (marker ``gpu``: a real GPU or the emulated device) the kernels
bit-exact against the reference for every layout, source dtype, cache dtype and scale
kind, on data that covers ties, subnormals, out-of-range values, infinities and NaN."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from pytrt_kv.contract import dtypes
from pytrt_kv.reference import quantise
from pytrt_kv.reference import scatter_pa_kv_cache as ref_scatter
from support import device as dv
from support.arrays import assert_same_bits, cache_shape, sentinel
from support.device import gpu

E4M3 = "float8_e4m3fn"
SOURCES = ("float16", "bfloat16", "float32")
CACHES = (E4M3, "int8")


def e4m3_bits(values) -> list[int]:
    return [int(b) for b in np.asarray(values).view(np.uint8).reshape(-1)]


# --- the reference ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "x, scale, want",
    [
        (1.0, 1.0, 0x38),  # 1.0 = exponent 7, mantissa 0
        (1.0625, 1.0, 0x38),  # halfway 1.0 / 1.125: ties to even (mantissa 0)
        (1.1875, 1.0, 0x3A),  # halfway 1.125 / 1.25: ties to even (mantissa 2)
        (250.0, 1.0, 0x78),  # nearest is 256 (steps of 32 above 256, 16 below)
        (500.0, 1.0, 0x7E),  # clamped to 448, not NaN (0x7F)
        (-1e9, 1.0, 0xFE),  # clamped to -448
        (float("inf"), 1.0, 0x7E),
        (3 * 2.0**-10, 1.0, 0x02),  # subnormal halfway 1/2 steps of 2^-9: even (2)
        (2.0**-10, 1.0, 0x00),  # half the smallest subnormal: even (0)
        (-(2.0**-12), 1.0, 0x80),  # rounds to -0
        (6.0, 2.0, 0x44),  # divided by the scale first: 3.0 = 1.5 * 2^1
        (float("nan"), 1.0, 0x7F),
        (-float("nan"), 1.0, 0x7F),  # the GPU's canonical NaN: the sign is dropped
    ],
)
def test_reference_e4m3_encodings(x, scale, want):
    got = quantise(np.array([[[x]]], np.float32), np.array(scale, np.float32), E4M3)
    assert got.dtype == ml_dtypes.float8_e4m3fn
    assert e4m3_bits(got) == [want]


@pytest.mark.parametrize("src", SOURCES)
def test_reference_writes_every_nan_as_0x7f(src):
    """Every NaN bit pattern of the source (both signs, any payload) is 0x7F (SPEC S9)."""
    dt = dtypes.numpy_dtype(src)
    bits = {
        "float16": [0x7C01, 0x7E00, 0x7FFF, 0xFC01, 0xFE00, 0xFFFF],
        "bfloat16": [0x7F81, 0x7FC0, 0x7FFF, 0xFF81, 0xFFC0, 0xFFFF],
        "float32": [0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0xFF800001, 0xFFC00000, 0xFFFFFFFF],
    }[src]
    x = np.array(bits, {2: np.uint16, 4: np.uint32}[dt.itemsize]).view(dt).reshape(1, 1, -1)
    for scale in (1.0, 0.375):
        assert e4m3_bits(quantise(x, np.array(scale, np.float32), E4M3)) == [0x7F] * len(bits)


@pytest.mark.parametrize(
    "x, scale, want",
    [(2.5, 1.0, 2), (3.5, 1.0, 4), (-2.5, 1.0, -2), (200.0, 1.0, 127), (-1e9, 1.0, -127),
     (10.0, 4.0, 2), (float("-inf"), 1.0, -127)],
)  # fmt: skip
def test_reference_int8_rounds_half_to_even_and_clamps(x, scale, want):
    got = quantise(np.array([[[x]]], np.float32), np.array(scale, np.float32), "int8")
    assert got.dtype == np.int8 and int(got.reshape(-1)[0]) == want


def test_reference_per_head_scales_divide_each_head():
    x = np.array([[[8.0, 8.0], [8.0, 8.0], [8.0, 8.0]]], np.float32)  # [T=1, H=3, D=2]
    got = quantise(x, np.array([1.0, 2.0, 4.0], np.float32), "int8")
    assert got.reshape(3, 2).tolist() == [[8, 8], [4, 4], [2, 2]]


def test_reference_writes_quantised_rows_in_every_layout():
    """The same quantised bytes land in nd, hnd and nz at the slot's place."""
    rng = np.random.default_rng(3)
    T, H, D, NB, BS = 3, 2, 16, 2, 4
    key = rng.standard_normal((T, H, D)).astype(np.float16)
    scale = np.array([0.5, 0.25], np.float32)
    slots = np.array([5, -1, 2], np.int32)
    q = quantise(key, scale, E4M3)
    for layout, shape in (("nd", (NB, BS, H, D)), ("hnd", (NB, H, BS, D)), ("nz", (NB, 1, BS, 32))):
        cache = np.zeros(shape, ml_dtypes.float8_e4m3fn)
        ref_scatter(key, None, cache, None, slots, cache_layout=layout, k_scale=scale)
        u = cache.view(np.uint8)
        for t, s in ((0, 5), (2, 2)):
            blk, off = divmod(s, BS)
            row = u[blk, off] if layout == "nd" else u[blk, :, off]
            assert row.reshape(-1).tolist() == e4m3_bits(q[t]), (layout, t)
        assert int(np.count_nonzero(u)) <= 2 * H * D


# --- the contract's refusals -----------------------------------------------------------------


def _call(**kw):
    rng = np.random.default_rng(0)
    T, H, D, NB, BS = 4, 2, 8, 2, 4
    args = dict(
        key=rng.standard_normal((T, H, D)).astype(np.float16),
        value=rng.standard_normal((T, H, D)).astype(np.float16),
        key_cache=np.zeros((NB, BS, H, D), ml_dtypes.float8_e4m3fn),
        value_cache=np.zeros((NB, BS, H, D), ml_dtypes.float8_e4m3fn),
        slot_mapping=np.array([0, 1, 2, 3], np.int32),
        k_scale=np.array(1.0, np.float32),
        v_scale=np.array([1.0, 2.0], np.float32),
    )
    args.update(kw)
    a = dict(args)
    ref_scatter(a.pop("key"), a.pop("value"), a.pop("key_cache"), a.pop("value_cache"),
                a.pop("slot_mapping"), **a)  # fmt: skip
    return args


BAD = {
    "zero scale": (dict(k_scale=np.array(0.0, np.float32)), ValueError, "k_scale: expected finite"),
    "negative head scale": (
        dict(v_scale=np.array([1.0, -2.0], np.float32)),
        ValueError,
        "v_scale[1] = -2.0",
    ),
    "nan scale": (dict(k_scale=np.array(np.nan, np.float32)), ValueError, "k_scale"),
    "inf scale": (dict(v_scale=np.array([np.inf, 1], np.float32)), ValueError, "v_scale[0]"),
    "float64 scale": (dict(k_scale=np.array(1.0)), TypeError, "k_scale: expected a float32"),
    "scale [H+1]": (dict(k_scale=np.ones(3, np.float32)), ValueError, "[] (per tensor) or [H=2]"),
    "scale [1, H]": (dict(k_scale=np.ones((1, 2), np.float32)), ValueError, "k_scale"),
    "missing v_scale": (dict(v_scale=None), ValueError, "or give v_scale to quantise value"),
    "scale into float16 cache": (
        dict(key_cache=np.zeros((2, 4, 2, 8), np.float16)),
        TypeError,
        "key_cache: expected a quantised dtype",
    ),
    "int8 source": (
        dict(key=np.zeros((4, 2, 8), np.int8), key_cache=np.zeros((2, 4, 2, 8), np.int8)),
        TypeError,
        "key: expected a float dtype",
    ),
    "v_scale without value": (
        dict(value=None, value_cache=None),
        ValueError,
        "v_scale: expected None for a key-only write",
    ),
    "nan into int8": (
        dict(
            key=np.full((4, 2, 8), np.nan, np.float16),
            key_cache=np.zeros((2, 4, 2, 8), np.int8),
            value_cache=np.zeros((2, 4, 2, 8), np.int8),
        ),
        ValueError,
        "key: expected no NaN",
    ),
    "e4m3 key, int8 value in nd": (
        dict(value_cache=np.zeros((2, 4, 2, 8), np.int8)),
        ValueError,
        "value_cache: expected dtype float8_e4m3fn (same as key_cache",
    ),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_quantise_calls_are_refused_untouched(name):
    kw, exc, fragment = BAD[name]
    caches = {k: kw.get(k) for k in ("key_cache", "value_cache")}
    with pytest.raises(exc) as info:
        _call(**kw)
    assert fragment in str(info.value)
    for c in caches.values():
        if c is not None:
            assert not np.any(c.view(np.uint8)), "a refused call wrote"


def test_scales_refused_with_a_4d_key():
    key = np.zeros((1, 2, 1, 8), np.float16)
    cache = np.zeros((2, 4, 1, 8), ml_dtypes.float8_e4m3fn)
    i = np.zeros((1, 1), np.int32)
    with pytest.raises(ValueError, match="k_scale: expected None with a 4-D key"):
        ref_scatter(key, None, cache, None, i, compress_lens=i, seq_lens=np.zeros(1, np.int32),
                    k_scale=np.array(1.0, np.float32))  # fmt: skip


def test_valid_call_passes():
    args = _call()
    assert np.any(args["key_cache"].view(np.uint8))


# --- kernels (real GPU or emulated device) ---------------------------------------------------


def wide_values(rng, shape, dtype: str, *, nan: bool) -> np.ndarray:
    """Magnitudes 2^-16 .. 2^12 with random signs (under, inside and over e4m3's range
    once scaled), plus exact e4m3 midpoints (ties), zeros, infinities and NaN."""
    n = int(np.prod(shape))
    x = np.sign(rng.standard_normal(n)) * 2.0 ** rng.uniform(-16, 12, n)
    # All e4m3 magnitudes and the midpoints between neighbours: exact in every source dtype.
    grid = np.arange(0, 127, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    ties = np.concatenate([grid, (grid[1:] + grid[:-1]) / 2])
    k = min(n // 3, len(ties))
    x[rng.choice(n, k, replace=False)] = rng.choice(ties, k) * np.sign(rng.standard_normal(k))
    specials = [0.0, -0.0, np.inf, -np.inf, 448.0, 464.0, 480.0, -127.5, 126.5]
    if nan:
        specials += [np.nan, -np.nan]
    x[rng.choice(n, len(specials), replace=False)] = specials
    return x.astype(dtypes.numpy_dtype(dtype)).reshape(shape)


def random_bytes(rng, shape, dtype: str, *, nan: bool) -> np.ndarray:
    """Every bit pattern equally likely: NaNs of both signs with any payload, infinities,
    subnormals (float16 ~3% NaN). ``nan=False`` (int8 caches refuse NaN) makes NaNs 0."""
    dt = dtypes.numpy_dtype(dtype)
    n = int(np.prod(shape))
    x = rng.integers(0, 256, n * dt.itemsize, dtype=np.uint8).view(dt).reshape(shape)
    if not nan:
        x[np.isnan(x.astype(np.float32))] = 0
    return x


def run_both(kw: dict, *, offset_elems: int = 0):
    from pytrt_kv import ops

    want = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
    w = dict(want)
    ref_scatter(w.pop("key"), w.pop("value"), w.pop("key_cache"), w.pop("value_cache"),
                w.pop("slot_mapping"), **w)  # fmt: skip
    dev = {
        k: (dv.to_device(v, offset_elems=offset_elems) if isinstance(v, np.ndarray) else v)
        for k, v in kw.items()
    }
    d = dict(dev)
    ops.scatter_pa_kv_cache(d.pop("key"), d.pop("value"), d.pop("key_cache"),
                            d.pop("value_cache"), d.pop("slot_mapping"), **d)  # fmt: skip
    dv.synchronize()
    return want, {k: dv.to_numpy(dev[k]) for k in ("key_cache", "value_cache") if kw[k] is not None}


def _slots(rng, T, n_slots):
    s = rng.permutation(n_slots)[:T].astype(np.int32)
    s[rng.random(T) < 0.2] = -1
    return s


def _scale(rng, per_head: bool, H: int) -> np.ndarray:
    """Powers of two keep the data's exact ties ties after the division (the rounding
    rule is then tested); per-head scales mix them with arbitrary ones."""
    if per_head:
        s = rng.uniform(0.05, 4.0, H)
        s[::2] = 2.0 ** rng.integers(-2, 3, len(s[::2]))
        return s.astype(np.float32)
    return np.array(2.0 ** rng.integers(-2, 3), np.float32)


def _quantise_both_same_bits(rng, key, value, layout, cache, per_head, NB, BS) -> dict:
    """Quantise ``key`` and ``value`` [T, H, D] into sentinel caches of dtype ``cache``
    with random scales (per tensor or per head) by the reference and by the kernels; both
    caches must hold the same bits. Returns the kernels' caches."""
    T, H, D = key.shape
    kw = dict(
        key=key,
        value=value,
        key_cache=sentinel(cache_shape(layout, NB, BS, H, D, cache), cache),
        value_cache=sentinel(cache_shape(layout, NB, BS, H, D, cache), cache),
        slot_mapping=_slots(rng, T, NB * BS),
        cache_layout=layout,
        k_scale=_scale(rng, per_head, H),
        v_scale=_scale(rng, per_head, H),
    )
    want, got = run_both(kw)
    assert_same_bits(got["key_cache"], want["key_cache"], "key_cache")
    assert_same_bits(got["value_cache"], want["value_cache"], "value_cache")
    return got


@gpu
@pytest.mark.parametrize("layout", ["nd", "hnd", "nz"])
@pytest.mark.parametrize("src", SOURCES)
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("per_head", [False, True], ids=["tensor", "head"])
def test_quantise_bit_exact(rng, layout, src, cache, per_head):
    T, H, D, NB, BS = 37, 4, 64, 12, 8
    nan = cache == E4M3
    key = wide_values(rng, (T, H, D), src, nan=nan)
    value = wide_values(rng, (T, H, D), src, nan=nan)
    _quantise_both_same_bits(rng, key, value, layout, cache, per_head, NB, BS)


@gpu
@pytest.mark.parametrize("layout", ["nd", "nz"])
@pytest.mark.parametrize("src", SOURCES)
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("per_head", [False, True], ids=["tensor", "head"])
def test_quantise_random_bytes_bit_exact(rng, layout, src, cache, per_head):
    """Random bytes as key and value (not only finite data): the kernels write what the
    reference writes, every e4m3 NaN as 0x7F whatever its sign (SPEC S9)."""
    T, H, D, NB, BS = 29, 4, 32, 8, 8
    nan = cache == E4M3
    key = random_bytes(rng, (T, H, D), src, nan=nan)
    value = random_bytes(rng, (T, H, D), src, nan=nan)
    if nan:  # the data holds negative NaNs, so the rule is exercised
        assert (np.signbit(key.astype(np.float32)) & np.isnan(key.astype(np.float32))).any()
    got = _quantise_both_same_bits(rng, key, value, layout, cache, per_head, NB, BS)
    if nan:
        u = got["key_cache"].view(np.uint8)
        assert 0xFF not in u and 0x7F in u


@gpu
@pytest.mark.parametrize("src", SOURCES)
@pytest.mark.parametrize("case", ["unaligned", "odd head size"])
def test_quantise_narrow_chunks(rng, src, case):
    """Addresses or head sizes that rule out 16-byte source vectors convert one element
    at a time: same bits."""
    T, H, NB, BS = 9, 3, 4, 5
    D = 16 if case == "unaligned" else 7
    kw = dict(
        key=wide_values(rng, (T, H, D), src, nan=True),
        value=None,
        key_cache=sentinel((NB, BS, H, D), E4M3),
        value_cache=None,
        slot_mapping=_slots(rng, T, NB * BS),
        k_scale=_scale(rng, True, H),
    )
    want, got = run_both(kw, offset_elems=1 if case == "unaligned" else 0)
    assert_same_bits(got["key_cache"], want["key_cache"], "key_cache")


@gpu
def test_quantise_key_only_beside_a_plain_value_in_nz(rng):
    """nz lets key and value differ: a quantised key and a byte-copied bfloat16 value
    (one launch each)."""
    T, H, D, NB, BS = 11, 2, 32, 3, 8
    kw = dict(
        key=wide_values(rng, (T, H, D), "bfloat16", nan=True),
        value=wide_values(rng, (T, H, D), "bfloat16", nan=True),
        key_cache=sentinel(cache_shape("nz", NB, BS, H, D, E4M3), E4M3),
        value_cache=sentinel(cache_shape("nz", NB, BS, H, D, "bfloat16"), "bfloat16"),
        slot_mapping=_slots(rng, T, NB * BS),
        cache_layout="nz",
        k_scale=_scale(rng, False, H),
    )
    want, got = run_both(kw)
    assert_same_bits(got["key_cache"], want["key_cache"], "key_cache")
    assert_same_bits(got["value_cache"], want["value_cache"], "value_cache")


@gpu
def test_quantise_nan_into_int8_writes_zero_and_validate_refuses_bad_scales(rng):
    """The kernels trust the data: a NaN quantised into int8 becomes 0 (the reference
    refuses it). validate=True reads the scales back and refuses a zero scale."""
    from pytrt_kv import ops

    key = np.full((2, 1, 16), np.nan, np.float32)
    cache = dv.to_device(sentinel((1, 4, 1, 16), "int8"))
    ops.scatter_pa_kv_cache(dv.to_device(key), None, cache, None,
                            dv.to_device(np.array([1, 3], np.int32)),
                            k_scale=dv.to_device(np.array(2.0, np.float32)))  # fmt: skip
    got = dv.to_numpy(cache).reshape(4, 16)
    assert not got[[1, 3]].any()
    assert (got[[0, 2]] == sentinel((2, 16), "int8")).all()
    with pytest.raises(ValueError, match="k_scale: expected finite scales > 0"):
        ops.scatter_pa_kv_cache(dv.to_device(key), None, cache, None,
                                dv.to_device(np.array([1, 3], np.int32)),
                                k_scale=dv.to_device(np.array(0.0, np.float32)),
                                validate=True)  # fmt: skip


def test_ops_refuses_bad_scales_before_launch():
    """Shape and dtype checks run on the host (no device needed)."""
    from pytrt_kv import ops
    from support.arrays import FakeCudaArray

    key = FakeCudaArray((4, 2, 8), "<f2")
    cache = FakeCudaArray((2, 4, 2, 8), "|i1", ptr=0x7F0000100000)
    slots = FakeCudaArray((4,), "<i4", ptr=0x7F0000200000)
    scale = FakeCudaArray((3,), "<f4", ptr=0x7F0000300000)
    with pytest.raises(ValueError, match=r"k_scale: expected shape \[\] \(per tensor\)"):
        ops.scatter_pa_kv_cache(key, None, cache, None, slots, k_scale=scale)
    with pytest.raises(ValueError, match="or give k_scale"):
        ops.scatter_pa_kv_cache(key, None, cache, None, slots)


def test_data_loader_feeds_valid_scales():
    """The Polygraphy data loader (make_feeds) gives scales the reference accepts (finite,
    > 0) and the CPU runtime quantises with them."""
    from pytrt_kv import runtime
    from pytrt_kv.graph.feeds import make_feeds
    from support.models import QUANT_MODELS, quant_model

    for name, args in QUANT_MODELS.items():
        model = quant_model(*args)
        feeds = make_feeds(model, seed=1)
        scales = [feeds[n] for n in ("k_scale", "v_scale") if n in feeds]
        assert scales and all(np.isfinite(s).all() and (s > 0).all() for s in scales), name
        out = runtime.run(model, feeds)
        assert np.any(out["key_cache_out"].view(np.uint8)), name
