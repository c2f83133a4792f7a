"""NumPy reference of ScatterPaKvCache against docs/SPEC.md section S.

The expected caches are built by a second, independent implementation: explicit Python
loops over the docs/SPEC.md formulas, moving the bytes of one element at a time. Caches are
pre-filled with random bytes (a sentinel), so positions that must stay untouched are
checked too; data movement is compared byte for byte.
"""

from __future__ import annotations

import sys
import zlib
from collections import namedtuple

import ml_dtypes
import numpy as np
import pytest

from pytrt_kv.contract import specs
from pytrt_kv.contract.dtypes import numpy_dtype
from pytrt_kv.contract.scatter import (
    ScatterMeta,
    check_scatter,
    check_scatter_values,
    validate_scatter,
)
from pytrt_kv.reference import scatter_pa_kv_cache
from support.arrays import cache_shape

DATA_DTYPES = specs.SCATTER_DATA_DTYPES
ROPE_DTYPES = specs.SCATTER_ROPE_DTYPES
INDEX_DTYPES = specs.SCATTER_INDEX_DTYPES
LAYOUTS = specs.CACHE_LAYOUTS

# H=2 with Dk=48, Dv=80 fits "nz" for every element size and no head size equals an L,
# so with BS != H the three layouts have distinct shapes (auto-detection is unambiguous).
H, DK, DV, T, NB = 2, 48, 80, 7, 3


# --- helpers ---------------------------------------------------------------------------------


@pytest.fixture
def case_rng(request):
    """Seeded per test case, so every point of a parameter grid sees different indices."""
    return np.random.default_rng([20261121, zlib.crc32(request.node.name.encode())])


def random_bits(rng, shape, dtype):
    """Random bytes viewed as ``dtype``: NaN payloads, infinities and all, never zeros."""
    dt = numpy_dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    return rng.integers(0, 256, count, dtype=np.uint8).view(dt).reshape(shape)


def random_floats(rng, shape, dtype):
    return (rng.standard_normal(shape) * 3 + 0.5).astype(numpy_dtype(dtype))


def as_bytes(a):
    return np.ascontiguousarray(a).view(np.uint8)


def assert_same_bytes(got, expected):
    assert got.dtype == expected.dtype and got.shape == expected.shape
    np.testing.assert_array_equal(as_bytes(got), as_bytes(expected))


def element_bytes(a):
    """[..., itemsize] uint8 view: one element = one byte vector (an independent mover)."""
    return np.ascontiguousarray(a).view(np.uint8).reshape(a.shape + (a.dtype.itemsize,))


def expected_tokens(layout, src, cache, slots):
    """docs/SPEC.md S3/S4/S5, one element at a time."""
    out = cache.copy()
    ob, sb = element_bytes(out), element_bytes(src)
    tokens, heads, size = src.shape
    bs = cache.shape[1] if layout == "nd" else cache.shape[2]
    last = 32 // src.dtype.itemsize
    for t in range(tokens):
        s = int(slots[t])
        if s < 0:
            continue
        for h in range(heads):
            for d in range(size):
                if layout == "nd":
                    ob[s // bs, s % bs, h, d] = sb[t, h, d]
                elif layout == "hnd":
                    ob[s // bs, h, s % bs, d] = sb[t, h, d]
                else:
                    f = h * size + d
                    ob[s // bs, f // last, s % bs, f % last] = sb[t, h, d]
    return out.reshape(cache.shape)


def expected_runs(mode, src, cache, slots, lens, offsets, seq):
    """docs/SPEC.md S6, one row at a time, the mean with explicit float32 adds in token order."""
    out = cache.copy()
    ob, sb = element_bytes(out), element_bytes(src)
    bs = cache.shape[1]
    batch, _, heads, size = src.shape
    for b in range(batch):
        for h in range(heads):
            base = int(slots[b, h])
            if base < 0:
                continue
            length, w = int(seq[b]), int(lens[b, h])

            def put(q, t):
                ob[q // bs, q % bs, 0] = sb[b, t, h]

            if mode == "alibi":
                for i in range(w):
                    put(base + i, length - w + i)
                continue
            o = int(offsets[b * heads + h])
            if o == -1 or w == 0 or o == length:
                for t in range(length):
                    put(base + t, t)
                continue
            for t in range(o):
                put(base + t, t)
            shift = 0
            if mode == "rope":
                acc = np.zeros(size, np.float32)
                for t in range(o, o + w):
                    acc = (acc + src[b, t, h].astype(np.float32)).astype(np.float32)
                mean = (acc / np.float32(w)).astype(np.float32).astype(src.dtype)
                q = base + o
                out[q // bs, q % bs, 0] = mean
                shift = 1
            for i in range(length - o - w):
                put(base + o + shift + i, o + w + i)
    return out


def token_slots(rng, tokens, n_slots, dtype, padding=2):
    slots = rng.permutation(n_slots)[:tokens].astype(dtype)
    slots[rng.permutation(tokens)[:padding]] = -1
    return slots


def snapshot(kwargs):
    return {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in kwargs.items()}


def assert_untouched(kwargs, before):
    for name, v in kwargs.items():
        if isinstance(v, np.ndarray):
            assert_same_bytes(v, before[name])


def assert_refused(kwargs, exc, arg, *fragments):
    """The call raises ``exc`` naming ``arg`` and leaves every argument untouched."""
    before = snapshot(kwargs)
    with pytest.raises(exc) as info:
        scatter_pa_kv_cache(**kwargs)
    msg = str(info.value)
    assert msg.startswith(f"{arg}: expected "), msg
    assert ", got " in msg, msg
    for fragment in fragments:
        assert fragment in msg, msg
    assert_untouched(kwargs, before)
    return msg


# --- 3-D key: nd / nz / hnd ------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [5, 3])
@pytest.mark.parametrize("with_value", [True, False], ids=["kv", "key_only"])
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("dtype", DATA_DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("explicit", [False, True], ids=["detect", "explicit"])
def test_token_write_matches_formulas(
    case_rng, explicit, layout, dtype, index_dtype, with_value, block_size
):
    rng = case_rng
    key = random_bits(rng, (T, H, DK), dtype)
    key_cache = random_bits(rng, cache_shape(layout, NB, block_size, H, DK, dtype), dtype)
    value = random_bits(rng, (T, H, DV), dtype) if with_value else None
    value_cache = (
        random_bits(rng, cache_shape(layout, NB, block_size, H, DV, dtype), dtype)
        if with_value
        else None
    )
    slots = token_slots(rng, T, NB * block_size, index_dtype)
    kwargs = dict(
        key=key,
        value=value,
        key_cache=key_cache,
        value_cache=value_cache,
        slot_mapping=slots,
        cache_layout=layout if explicit else None,
    )
    want_k = expected_tokens(layout, key, key_cache, slots)
    want_v = expected_tokens(layout, value, value_cache, slots) if with_value else None
    inputs = snapshot({"key": key, "value": value, "slot_mapping": slots})

    meta = check_scatter(
        key, value, key_cache, value_cache, slots, cache_layout=layout if explicit else None
    )
    assert (meta.layout, meta.compress, meta.mode, meta.has_value) == (
        layout,
        False,
        None,
        with_value,
    )
    assert (meta.num_blocks, meta.block_size, meta.num_tokens, meta.num_heads) == (
        NB,
        block_size,
        T,
        H,
    )
    assert (meta.head_size_k, meta.head_size_v) == (DK, DV if with_value else 0)
    assert (meta.key_dtype, meta.value_dtype, meta.index_dtype) == (
        dtype,
        dtype if with_value else None,
        index_dtype,
    )

    assert scatter_pa_kv_cache(**kwargs) is None
    assert_same_bytes(key_cache, want_k)
    if with_value:
        assert_same_bytes(value_cache, want_v)
    assert_untouched({"key": key, "value": value, "slot_mapping": slots}, inputs)


@pytest.mark.parametrize(
    "key_dtype,value_dtype",
    [
        ("float16", "int8"),
        ("float32", "bfloat16"),
        ("float8_e4m3fn", "float32"),
        ("uint8", "float8_e5m2"),
    ],
)
def test_nz_key_and_value_dtypes_may_differ(rng, key_dtype, value_dtype):
    bs = 4
    key = random_bits(rng, (T, H, DK), key_dtype)
    value = random_bits(rng, (T, H, DV), value_dtype)
    key_cache = random_bits(rng, cache_shape("nz", NB, bs, H, DK, key_dtype), key_dtype)
    value_cache = random_bits(rng, cache_shape("nz", NB, bs, H, DV, value_dtype), value_dtype)
    slots = token_slots(rng, T, NB * bs, np.int32)
    want_k = expected_tokens("nz", key, key_cache, slots)
    want_v = expected_tokens("nz", value, value_cache, slots)
    scatter_pa_kv_cache(key, value, key_cache, value_cache, slots)
    assert_same_bytes(key_cache, want_k)
    assert_same_bytes(value_cache, want_v)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hand_computed_token_positions(layout):
    """Literal positions: H=1, Dk=16 float16 (L=16), BS=3; token 0 -> slot 4, token 1 pad,
    token 2 -> slot 0."""
    key = (np.arange(3 * 16, dtype=np.float16) + 1).reshape(3, 1, 16)
    shape = {"nd": (2, 3, 1, 16), "hnd": (2, 1, 3, 16), "nz": (2, 1, 3, 16)}[layout]
    cache = np.full(shape, -7, np.float16)
    scatter_pa_kv_cache(key, None, cache, None, np.array([4, -1, 0], np.int64), cache_layout=layout)
    want = np.full(shape, -7, np.float16)
    if layout == "nd":
        want[1, 1, 0, :], want[0, 0, 0, :] = key[0, 0], key[2, 0]
    else:  # hnd and nz coincide for H=1, Dk=L
        want[1, 0, 1, :], want[0, 0, 0, :] = key[0, 0], key[2, 0]
    assert_same_bytes(cache, want)


def test_nz_hand_computed_multi_column():
    """H=2, Dk=8 float16 -> f = h*8 + d, L=16: head 1 lands in columns 8..15 of chunk 0."""
    key = (np.arange(2 * 2 * 8, dtype=np.float32) + 1).astype(np.float16).reshape(2, 2, 8)
    cache = np.full((1, 1, 4, 16), 99, np.float16)
    scatter_pa_kv_cache(key, None, cache, None, np.array([3, 1], np.int32), cache_layout="nz")
    want = np.full((1, 1, 4, 16), 99, np.float16)
    want[0, 0, 3] = key[0].reshape(16)
    want[0, 0, 1] = key[1].reshape(16)
    assert_same_bytes(cache, want)


def test_torch_npu_example_scenario_1(rng):
    """the torch_npu.npu_scatter_pa_kv_cache API page single-op example: bs=16, H=4, Dk=32,
    Dv=64, NB=2, BS=32, L=16."""
    bs, num_head, k_head_size, v_head_size, num_blocks, last_dim, block_size = (
        16,
        4,
        32,
        64,
        2,
        16,
        32,
    )
    key = rng.standard_normal((bs, num_head, k_head_size)).astype(np.float16)
    value = rng.standard_normal((bs, num_head, v_head_size)).astype(np.float16)
    key_cache = rng.standard_normal(
        (num_blocks, num_head * k_head_size // last_dim, block_size, last_dim)
    ).astype(np.float16)
    value_cache = np.zeros(
        (num_blocks, num_head * v_head_size // last_dim, block_size, last_dim)
    ).astype(np.float16)
    slot_mapping = rng.choice(num_blocks * block_size, bs, replace=False).astype(np.int32)
    assert check_scatter(key, value, key_cache, value_cache, slot_mapping).layout == "nz"
    want_k = expected_tokens("nz", key, key_cache, slot_mapping)
    want_v = expected_tokens("nz", value, value_cache, slot_mapping)
    scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping)
    assert_same_bytes(key_cache, want_k)
    assert_same_bytes(value_cache, want_v)
    # Untouched slots of the zero-filled value cache stay zero.
    untouched = np.setdiff1d(np.arange(num_blocks * block_size), slot_mapping)
    assert not value_cache[untouched // block_size, :, untouched % block_size].any()


def test_all_padding_and_empty_calls_write_nothing(rng):
    key_cache = random_bits(rng, (NB, 5, H, DK), "float16")
    before = key_cache.copy()
    scatter_pa_kv_cache(
        random_bits(rng, (T, H, DK), "float16"), None, key_cache, None, np.full(T, -1, np.int32)
    )
    scatter_pa_kv_cache(
        random_bits(rng, (0, H, DK), "float16"), None, key_cache, None, np.zeros(0, np.int64)
    )
    assert_same_bytes(key_cache, before)


def test_non_contiguous_key_is_read_correctly(rng):
    wide = random_bits(rng, (T, H, 2 * DK), "bfloat16")
    key = wide[:, :, ::2]
    key_cache = random_bits(rng, (NB, 5, H, DK), "bfloat16")
    slots = token_slots(rng, T, NB * 5, np.int32)
    want = expected_tokens("nd", np.ascontiguousarray(key), key_cache, slots)
    scatter_pa_kv_cache(key, None, key_cache, None, slots)
    assert_same_bytes(key_cache, want)


# --- layout detection ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key_shape,cache_shape_,fitting",
    [
        ((3, 2, 8), (4, 2, 2, 8), ["nd", "hnd"]),  # BS == H
        ((3, 2, 16), (4, 2, 5, 16), ["nz", "hnd"]),  # Dk == L, H*Dk/L == H
        ((3, 4, 16), (4, 4, 4, 16), ["nd", "nz", "hnd"]),  # all three
    ],
)
def test_ambiguous_layout_asks_for_cache_layout(rng, key_shape, cache_shape_, fitting):
    key = random_bits(rng, key_shape, "float16")
    key_cache = random_bits(rng, cache_shape_, "float16")
    kwargs = dict(
        key=key,
        value=None,
        key_cache=key_cache,
        value_cache=None,
        slot_mapping=np.array([0, 1, -1], np.int32),
    )
    msg = assert_refused(kwargs, ValueError, "cache_layout", str(fitting))
    assert "several layouts" in msg
    for layout in fitting:  # an explicit layout resolves it
        assert check_scatter(**kwargs, cache_layout=layout).layout == layout
        assert check_scatter(**kwargs, cache_layout=layout).block_size == (
            cache_shape_[1] if layout == "nd" else cache_shape_[2]
        )


def test_value_cache_disambiguates_detection(rng):
    """key_cache [4, 2, 5, 16] fits nz and hnd (Dk == L == 16); value_cache decides."""
    key = random_bits(rng, (3, 2, 16), "float16")
    value = random_bits(rng, (3, 2, 32), "float16")
    key_cache = np.empty((4, 2, 5, 16), np.float16)
    slots = np.zeros(3, np.int32)
    for value_cache_shape, layout in (((4, 4, 5, 16), "nz"), ((4, 2, 5, 32), "hnd")):
        meta = check_scatter(key, value, key_cache, np.empty(value_cache_shape, np.float16), slots)
        assert (meta.layout, meta.block_size, meta.num_blocks) == (layout, 5, 4)


def test_empty_string_attributes_mean_unset(rng):
    key = random_bits(rng, (T, H, DK), "int8")
    meta = check_scatter(
        key,
        None,
        np.empty((NB, 5, H, DK), np.int8),
        None,
        np.zeros(T, np.int32),
        cache_layout="",
        compress_mode="",
    )
    assert meta.layout == "nd"


# --- check_scatter on non-NumPy arguments ----------------------------------------------------

Desc = namedtuple("Desc", "shape dtype")


def test_check_scatter_on_descriptors():
    meta = check_scatter(
        Desc((16, 4, 32), "float16"),
        Desc((16, 4, 64), "float16"),
        Desc((2, 8, 32, 16), "float16"),
        Desc((2, 16, 32, 16), "float16"),
        Desc((16,), "int32"),
    )
    assert meta == ScatterMeta(
        compress=False,
        layout="nz",
        mode=None,
        has_value=True,
        key_dtype="float16",
        value_dtype="float16",
        index_dtype="int32",
        num_tokens=16,
        batch=0,
        max_seq_len=0,
        num_heads=4,
        head_size_k=32,
        head_size_v=64,
        num_blocks=2,
        block_size=32,
        key_cache_dtype="float16",
        value_cache_dtype="float16",
    )
    meta = check_scatter(
        Desc((3, 9, 2, 8), "bfloat16"),
        None,
        Desc((6, 4, 1, 8), "bfloat16"),
        None,
        Desc((3, 2), "int64"),
        compress_lens=Desc((3, 2), "int64"),
        compress_seq_offsets=Desc((6,), "int64"),
        seq_lens=Desc((3,), "int64"),
    )
    assert meta == ScatterMeta(
        compress=True,
        layout=None,
        mode="rope",
        has_value=False,
        key_dtype="bfloat16",
        value_dtype=None,
        index_dtype="int64",
        num_tokens=0,
        batch=3,
        max_seq_len=9,
        num_heads=2,
        head_size_k=8,
        head_size_v=0,
        num_blocks=6,
        block_size=4,
        key_cache_dtype="bfloat16",
    )
    assert meta.num_slots == 24


def test_check_scatter_on_torch_tensors():
    torch = pytest.importorskip("torch")
    key = torch.empty(5, 2, 8, dtype=torch.bfloat16)
    cache = torch.empty(3, 4, 2, 8, dtype=torch.bfloat16)
    meta = check_scatter(key, key, cache, cache.clone(), torch.zeros(5, dtype=torch.int64))
    assert (meta.layout, meta.key_dtype, meta.index_dtype) == ("nd", "bfloat16", "int64")
    with pytest.raises(TypeError, match="^key: expected"):
        check_scatter(key.double(), None, cache, None, torch.zeros(5, dtype=torch.int64))
    # The reference itself needs NumPy caches and says so.
    kwargs = dict(
        key=np.zeros((5, 2, 8), ml_dtypes.bfloat16),
        value=None,
        key_cache=cache,
        value_cache=None,
        slot_mapping=np.zeros(5, np.int64),
    )
    assert_refused(kwargs, TypeError, "key_cache", "NumPy")


# --- 4-D key: compressing write --------------------------------------------------------------


def make_runs(rng, mode, batch, heads, smax, bs, index_dtype):
    """Index tensors covering every S6 case, runs laid out with gaps in random order.

    rope/omni kinds per (b, h): compressed with a prefix, w >= 2 and a suffix ("mid"),
    compressed anywhere, o == -1 (with a garbage w), w == 0,
    o == L (with w > 0), padding (garbage o and w). alibi: 0 < w < L (twice), w == L,
    w == 0, any w, padding.
    """
    kinds = (
        ["mid", "comp", "o=-1", "w=0", "o=L", "pad"]
        if mode != "alibi"
        else ["alibi_mid", "alibi_w=L", "alibi_w=0", "alibi", "pad", "alibi_mid"]
    )
    seq = rng.integers(smax // 2, smax + 1, batch)
    lens = np.zeros((batch, heads), np.int64)
    offs = np.zeros((batch, heads), np.int64)
    rows = np.zeros((batch, heads), np.int64)
    pad = np.zeros((batch, heads), bool)
    for i, (b, h) in enumerate(np.ndindex(batch, heads)):
        kind, length = kinds[i % len(kinds)], int(seq[b])
        w = o = 0
        if kind == "mid":  # needs L >= 4: seq_lens >= smax // 2
            w = int(rng.integers(2, length - 1))
            o = int(rng.integers(1, length - w))
        elif kind == "comp":
            w = int(rng.integers(1, length + 1))
            o = int(rng.integers(0, length - w + 1))
        if kind in ("mid", "comp"):
            rows[b, h] = length - w + (1 if mode == "rope" else 0)
        elif kind in ("o=-1", "w=0", "o=L"):
            w = {"o=-1": 3, "w=0": 0, "o=L": 2}[kind]
            o = {"o=-1": -1, "w=0": int(rng.integers(0, length + 1)), "o=L": length}[kind]
            rows[b, h] = length
        elif kind.startswith("alibi"):
            w = {
                "alibi": int(rng.integers(0, length + 1)),
                "alibi_w=L": length,
                "alibi_w=0": 0,
                "alibi_mid": int(rng.integers(1, length)),
            }[kind]
            rows[b, h] = w
        else:
            w, o, pad[b, h] = 10**6, -5, True
        lens[b, h], offs[b, h] = w, o
    slots = np.full((batch, heads), -1, np.int64)
    cursor = int(rng.integers(0, bs))
    for flat in rng.permutation(batch * heads):
        b, h = divmod(int(flat), heads)
        if not pad[b, h]:
            slots[b, h] = cursor
            cursor += rows[b, h] + int(rng.integers(0, 3))
    num_blocks = cursor // bs + 1
    cast = numpy_dtype(index_dtype)
    return (
        slots.astype(cast),
        lens.astype(cast),
        offs.reshape(-1).astype(cast),
        seq.astype(cast),
        num_blocks,
    )


@pytest.mark.parametrize("block_size", [4, 3])
@pytest.mark.parametrize("with_value", [True, False], ids=["kv", "key_only"])
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize(
    "explicit_mode,mode,dtype",
    [
        (explicit, mode, dtype)
        for mode, dtypes in (("rope", ROPE_DTYPES), ("omni", DATA_DTYPES), ("alibi", DATA_DTYPES))
        for dtype in dtypes
        for explicit in ((True,) if mode == "omni" else (False, True))
    ],
)  # omni is never default
def test_compressing_write_matches_formulas(
    case_rng, explicit_mode, mode, dtype, index_dtype, with_value, block_size
):
    rng = case_rng
    batch, heads, smax, dk, dv = 3, 2, 9, 8, 12
    slots, lens, offs, seq, nb = make_runs(rng, mode, batch, heads, smax, block_size, index_dtype)
    make = random_floats if mode == "rope" else random_bits
    key = make(rng, (batch, smax, heads, dk), dtype)
    value = make(rng, (batch, smax, heads, dv), dtype) if with_value else None
    key_cache = random_bits(rng, (nb, block_size, 1, dk), dtype)
    value_cache = random_bits(rng, (nb, block_size, 1, dv), dtype) if with_value else None
    offsets = None if mode == "alibi" and not explicit_mode else offs
    kwargs = dict(
        key=key,
        value=value,
        key_cache=key_cache,
        value_cache=value_cache,
        slot_mapping=slots,
        compress_lens=lens,
        compress_seq_offsets=offsets,
        seq_lens=seq,
        compress_mode=mode if explicit_mode else None,
    )
    want_k = expected_runs(mode, key, key_cache, slots, lens, offs, seq)
    want_v = expected_runs(mode, value, value_cache, slots, lens, offs, seq) if with_value else None
    meta = check_scatter(**{k: v for k, v in kwargs.items()})
    assert (meta.compress, meta.mode, meta.layout, meta.batch, meta.max_seq_len) == (
        True,
        mode,
        None,
        batch,
        smax,
    )
    inputs = snapshot({k: v for k, v in kwargs.items() if "cache" not in k})

    scatter_pa_kv_cache(**kwargs)
    assert_same_bytes(key_cache, want_k)
    if with_value:
        assert_same_bytes(value_cache, want_v)
    assert_untouched({k: v for k, v in kwargs.items() if "cache" not in k}, inputs)


@pytest.mark.parametrize(
    "mode,want_rows",
    [
        # Rows 3..6 from base 3 with BS=4: the run crosses from block 0 into block 1.
        ("rope", {3: "x0", 4: "mean", 5: "x3", 6: "x4"}),
        ("omni", {3: "x0", 4: "x3", 5: "x4"}),
        ("alibi", {3: "x3", 4: "x4"}),
    ],
)
def test_hand_computed_runs(mode, want_rows):
    """L=5, o=1, w=2, base 3; head 1 of the same batch is padding."""
    tokens = np.array([[1, 2], [3, 5], [8, 13], [21, 34], [55, 89]], np.float32)
    key = np.zeros((1, 6, 2, 2), np.float32)
    key[0, :5, 0] = tokens
    key[0, 5] = 1e9  # beyond seq_lens: never read
    key[0, :, 1] = -1e9
    cache = np.full((3, 4, 1, 2), -0.5, np.float32)
    scatter_pa_kv_cache(
        key,
        None,
        cache,
        None,
        np.array([[3, -1]], np.int32),
        compress_lens=np.array([[2, 7]], np.int32),
        compress_seq_offsets=np.array([1, 9], np.int32),
        seq_lens=np.array([5], np.int32),
        compress_mode=mode,
    )
    rows = cache.reshape(12, 2)
    values = {f"x{i}": tokens[i] for i in range(5)}
    values["mean"] = np.array([5.5, 9.0], np.float32)  # (3 + 8) / 2, (5 + 13) / 2
    for q in range(12):
        want = values[want_rows[q]] if q in want_rows else np.array([-0.5, -0.5], np.float32)
        np.testing.assert_array_equal(rows[q], want, err_msg=f"row {q}")


@pytest.mark.parametrize(
    "dtype,tokens,want_bits",
    [
        # float16 accumulation would give 2048 + 1 = 2048 (tie, even) three times -> 512;
        # float32 gives 2051 / 4 = 512.75, a tie between 512.5 and 513 -> even mantissa 513.
        ("float16", [2048, 1, 1, 1], 0x6002),
        # bfloat16: 256 + 1 = 256 in bf16; float32: 259 / 4 = 64.75, tie -> 65 (0x4282).
        ("bfloat16", [256, 1, 1, 1], 0x4282),
        # float32 in token order: 2**24 + 1 == 2**24 fifteen times -> 2**24 / 16 = 2**20; a
        # pairwise (8-accumulator) sum would keep 14 of the ones: 1048576.875.
        ("float32", [2.0**24] + [1.0] * 15, 0x49800000),
    ],
)
def test_rope_mean_is_float32_in_token_order_rounded_to_nearest_even(dtype, tokens, want_bits):
    w = len(tokens)
    key = np.empty((1, w, 1, 1), numpy_dtype(dtype))
    key[0, :, 0, 0] = np.array(tokens, np.float32).astype(numpy_dtype(dtype))
    cache = np.full((1, 2, 1, 1), 3, numpy_dtype(dtype))
    scatter_pa_kv_cache(
        key,
        None,
        cache,
        None,
        np.array([[0]], np.int64),
        compress_lens=np.array([[w]], np.int64),
        compress_seq_offsets=np.array([0], np.int64),
        seq_lens=np.array([w], np.int64),
    )
    bits = cache.view({2: np.uint16, 4: np.uint32}[cache.dtype.itemsize])
    assert int(bits[0, 0, 0, 0]) == want_bits
    assert cache[0, 1, 0, 0] == 3  # one row written: L - w + 1


def test_padding_runs_are_not_validated(rng):
    """A (b, h) with a negative slot is skipped, whatever its other values are."""
    key = random_floats(rng, (2, 4, 1, 4), "float16")
    cache = random_bits(rng, (2, 4, 1, 4), "float16")
    before = cache.copy()
    scatter_pa_kv_cache(
        key,
        None,
        cache,
        None,
        np.array([[-1], [-3]], np.int32),
        compress_lens=np.array([[99], [-4]], np.int32),
        compress_seq_offsets=np.array([-9, 50], np.int32),
        seq_lens=np.array([4, 4], np.int32),
    )
    assert_same_bytes(cache, before)


def test_adjacent_runs_are_allowed(rng):
    key = random_bits(rng, (2, 4, 1, 4), "int8")
    cache = random_bits(rng, (2, 4, 1, 4), "int8")
    slots, lens, seq = (
        np.array([[0], [3]], np.int32),
        np.array([[3], [4]], np.int32),
        np.array([4, 4], np.int32),
    )
    want = expected_runs("alibi", key, cache, slots, lens, None, seq)
    scatter_pa_kv_cache(key, None, cache, None, slots, compress_lens=lens, seq_lens=seq)
    assert_same_bytes(cache, want)


@pytest.mark.parametrize(
    "mode,seq_len,width,offset",
    [
        ("omni", 3, 3, 0),  # L - w == 0
        ("alibi", 3, 0, 0),  # w == 0
        ("rope", 0, 0, 0),  # L == 0
        ("omni", 0, 0, -1),  # L == 0, uncompressed
    ],
)
@pytest.mark.parametrize("base", [16, 17, 2**62])
def test_zero_row_run_base_is_not_checked(rng, mode, seq_len, width, offset, base):
    """docs/SPEC.md S7: a run of zero rows writes nothing, so a base >= NB*BS is no error;
    the other run is still written as usual."""
    key = random_floats(rng, (2, 4, 1, 4), "float16")
    cache = random_bits(rng, (4, 4, 1, 4), "float16")  # NB*BS = 16
    slots = np.array([[base], [5]], np.int64)
    lens = np.array([[width], [1]], np.int64)
    offsets = np.array([offset, 1], np.int64)
    seq = np.array([seq_len, 3], np.int64)
    want = expected_runs(
        mode,
        key,
        cache,
        np.array([[-1], [5]], np.int64),
        lens,
        None if mode == "alibi" else offsets,
        seq,
    )
    scatter_pa_kv_cache(
        key,
        None,
        cache,
        None,
        slots,
        compress_lens=lens,
        compress_seq_offsets=None if mode == "alibi" else offsets,
        seq_lens=seq,
        compress_mode=mode,
    )
    assert_same_bytes(cache, want)


def test_one_row_run_base_is_still_checked(rng):
    """The S7 exemption is for empty runs only: one row at NB*BS is refused."""
    key = random_floats(rng, (1, 4, 1, 4), "float16")
    cache = random_bits(rng, (4, 4, 1, 4), "float16")
    before = cache.copy()
    with pytest.raises(ValueError, match=r"slot_mapping\[0, 0\] = 16"):
        scatter_pa_kv_cache(
            key,
            None,
            cache,
            None,
            np.array([[16]], np.int64),
            compress_lens=np.array([[1]], np.int64),
            seq_lens=np.array([3], np.int64),
            compress_mode="alibi",
        )
    assert_same_bytes(cache, before)


# --- validation: one test per rule -----------------------------------------------------------


def base_3d(rng, layout="nd"):
    bs = 5
    return dict(
        key=random_bits(rng, (6, H, DK), "float16"),
        value=random_bits(rng, (6, H, DV), "float16"),
        key_cache=random_bits(rng, cache_shape(layout, NB, bs, H, DK, "float16"), "float16"),
        value_cache=random_bits(rng, cache_shape(layout, NB, bs, H, DV, "float16"), "float16"),
        slot_mapping=np.array([0, 14, -1, 7, 3, 9], np.int32),
    )


def base_4d(rng):
    """rope, B=2, Smax=6, H=2, NB*BS=16: runs [0,4), [4,10), [10,14), (1,1) padding."""
    return dict(
        key=random_floats(rng, (2, 6, 2, 8), "float16"),
        value=random_floats(rng, (2, 6, 2, 4), "float16"),
        key_cache=random_bits(rng, (4, 4, 1, 8), "float16"),
        value_cache=random_bits(rng, (4, 4, 1, 4), "float16"),
        slot_mapping=np.array([[0, 4], [10, -1]], np.int64),
        compress_lens=np.array([[3, 0], [2, 1]], np.int64),
        compress_seq_offsets=np.array([1, -1, 0, 0], np.int64),
        seq_lens=np.array([6, 5], np.int64),
    )


def test_validation_bases_are_valid(rng):
    for kwargs in (base_3d(rng), base_3d(rng, "nz"), base_3d(rng, "hnd"), base_4d(rng)):
        scatter_pa_kv_cache(**kwargs)


def _with(kwargs, **changes):
    out = dict(kwargs)
    out.update(changes)
    return out


def f16(rng, shape):
    return random_bits(rng, shape, "float16")


def _bad_cache(name: str, which: str, shape: tuple, needles: list):
    """A rule: the cache ``which`` given as random float16 bytes of ``shape``, refused with
    a ValueError that names it and says each of ``needles``."""
    return (name, lambda k, r: {which: f16(r, shape)}, ValueError, which, needles)


RULES_3D = [
    # (id, change(kwargs, rng) -> changes, exception, argument, fragments)
    ("key_not_array", lambda k, r: {"key": k["key"].tolist()}, TypeError, "key", ["list"]),
    (
        "key_float64",
        lambda k, r: {"key": k["key"].astype(np.float64)},
        TypeError,
        "key",
        ["float64"],
    ),
    (
        "key_int64",
        lambda k, r: {"key": k["key"].view(np.int16).astype(np.int64)},
        TypeError,
        "key",
        ["int64"],
    ),
    ("key_rank_2", lambda k, r: {"key": k["key"][:, 0]}, ValueError, "key", ["3-D"]),
    ("key_zero_heads", lambda k, r: {"key": k["key"][:, :0]}, ValueError, "key", ["H >= 1"]),
    (
        "value_without_cache",
        lambda k, r: {"value_cache": None},
        ValueError,
        "value_cache",
        ["both or neither"],
    ),
    ("cache_without_value", lambda k, r: {"value": None}, ValueError, "value", ["both or neither"]),
    (
        "key_cache_unsupported_dtype",
        lambda k, r: {"key_cache": k["key_cache"].view(np.int16)},
        TypeError,
        "key_cache",
        ["int16"],
    ),
    (
        "key_cache_dtype_int8",
        lambda k, r: {"key_cache": random_bits(r, (3, 5, 2, 48), "int8")},
        ValueError,
        "key_cache",
        ["dtype float16 (same as key)", "int8"],
    ),
    (
        "key_cache_dtype_bf16",
        lambda k, r: {"key_cache": k["key_cache"].view(ml_dtypes.bfloat16)},
        ValueError,
        "key_cache",
        ["same as key", "bfloat16"],
    ),
    (
        "value_cache_dtype",
        lambda k, r: {"value_cache": k["value_cache"].view(ml_dtypes.bfloat16)},
        ValueError,
        "value_cache",
        ["same as value"],
    ),
    (
        "key_cache_rank",
        lambda k, r: {"key_cache": k["key_cache"][0]},
        ValueError,
        "key_cache",
        ["4-D"],
    ),
    (
        "value_cache_rank",
        lambda k, r: {"value_cache": k["value_cache"][None]},
        ValueError,
        "value_cache",
        ["4-D"],
    ),
    ("value_tokens", lambda k, r: {"value": k["value"][:5]}, ValueError, "value", ["T=6"]),
    ("value_heads", lambda k, r: {"value": k["value"][:, :1]}, ValueError, "value", ["H=2"]),
    (
        "value_dtype_nd",
        lambda k, r: {
            "value": k["value"].view(ml_dtypes.bfloat16),
            "value_cache": k["value_cache"].view(ml_dtypes.bfloat16),
        },
        ValueError,
        "value",
        ["nz"],
    ),
    (
        "slot_float",
        lambda k, r: {"slot_mapping": k["slot_mapping"].astype(np.float32)},
        TypeError,
        "slot_mapping",
        ["int32"],
    ),
    (
        "slot_int16",
        lambda k, r: {"slot_mapping": k["slot_mapping"].astype(np.int16)},
        TypeError,
        "slot_mapping",
        ["int16"],
    ),
    ("slot_none", lambda k, r: {"slot_mapping": None}, TypeError, "slot_mapping", ["None"]),
    (
        "slot_shape",
        lambda k, r: {"slot_mapping": np.zeros(7, np.int32)},
        ValueError,
        "slot_mapping",
        ["T=6"],
    ),
    (
        "slot_rank",
        lambda k, r: {"slot_mapping": np.zeros((6, 1), np.int32)},
        ValueError,
        "slot_mapping",
        ["T=6"],
    ),
    (
        "layout_unknown",
        lambda k, r: {"cache_layout": "bsnd"},
        ValueError,
        "cache_layout",
        ["'bsnd'"],
    ),
    ("layout_type", lambda k, r: {"cache_layout": 1}, TypeError, "cache_layout", ["1"]),
    (
        "layout_explicit_mismatch",
        lambda k, r: {"cache_layout": "hnd"},
        ValueError,
        "key_cache",
        ["hnd", "[NB, 2, BS, 48]"],
    ),
    (
        "layout_nz_mismatch",
        lambda k, r: {"cache_layout": "nz"},
        ValueError,
        "key_cache",
        ["nz", "[NB, 6, BS, 16]"],
    ),
    _bad_cache(
        "no_layout_fits",
        "key_cache",
        (3, 5, 2, 47),
        ["nd [NB, BS, 2, 48]", "hnd [NB, 2, BS, 48]", "nz [NB, 6, BS, 16]"],
    ),
    _bad_cache("value_cache_no_layout_fits", "value_cache", (3, 5, 2, 81), ["[NB, BS, 2, 80]"]),
    _bad_cache("value_cache_other_layout", "value_cache", (3, 2, 5, 80), ["layout of key_cache"]),
    _bad_cache("value_cache_blocks", "value_cache", (4, 5, 2, 80), ["NB=3", "NB=4"]),
    _bad_cache("value_cache_block_size", "value_cache", (3, 6, 2, 80), ["BS=5", "BS=6"]),
    (
        "zero_block_size",
        lambda k, r: {"key_cache": f16(r, (3, 0, 2, 48)), "value": None, "value_cache": None},
        ValueError,
        "key_cache",
        ["BS >= 1"],
    ),
    (
        "compress_lens_3d",
        lambda k, r: {"compress_lens": np.zeros((6, 2), np.int32)},
        ValueError,
        "compress_lens",
        ["4-D key"],
    ),
    (
        "offsets_3d",
        lambda k, r: {"compress_seq_offsets": np.zeros(12, np.int32)},
        ValueError,
        "compress_seq_offsets",
        ["4-D key"],
    ),
    (
        "seq_lens_3d",
        lambda k, r: {"seq_lens": np.zeros(6, np.int32)},
        ValueError,
        "seq_lens",
        ["4-D key"],
    ),
    (
        "compress_mode_3d",
        lambda k, r: {"compress_mode": "rope"},
        ValueError,
        "compress_mode",
        ["4-D key"],
    ),
    (
        "slot_out_of_range",
        lambda k, r: {"slot_mapping": np.array([0, 14, -1, 15, 3, 9], np.int32)},
        ValueError,
        "slot_mapping",
        ["slot 15 for token 3", "NB*BS = 15"],
    ),
    (
        "slot_huge_int64",
        lambda k, r: {"slot_mapping": np.array([0, 2**62, -1, 1, 3, 9])},
        ValueError,
        "slot_mapping",
        ["token 1"],
    ),
    (
        "slot_duplicate",
        lambda k, r: {"slot_mapping": np.array([0, 14, -1, 7, 14, 9], np.int32)},
        ValueError,
        "slot_mapping",
        ["slot 14 for tokens 1 and 4"],
    ),
    (
        "key_cache_read_only",
        lambda k, r: {
            "key_cache": np.lib.stride_tricks.as_strided(k["key_cache"], writeable=False)
        },
        ValueError,
        "key_cache",
        ["writeable"],
    ),
    (
        "value_cache_non_contiguous",
        lambda k, r: {"value_cache": np.asfortranarray(k["value_cache"])},
        ValueError,
        "value_cache",
        ["C-contiguous"],
    ),
    (
        "value_cache_aliases_key_cache",
        lambda k, r: {"value": k["key"], "value_cache": k["key_cache"]},
        ValueError,
        "value_cache",
        ["overlapping key_cache"],
    ),
    (
        "value_not_numpy",
        lambda k, r: {"value": Desc((6, 2, 80), "float16")},
        TypeError,
        "value",
        ["NumPy"],
    ),
    ("no_dtype_object", lambda k, r: {"key_cache": object()}, TypeError, "key_cache", ["object"]),
]


@pytest.mark.parametrize("rule", RULES_3D, ids=[r[0] for r in RULES_3D])
def test_refused_3d(rng, rule):
    _, change, exc, arg, fragments = rule
    kwargs = base_3d(rng)
    assert_refused(_with(kwargs, **change(kwargs, rng)), exc, arg, *fragments)


def test_refused_nz_alignment(rng):
    """H*Dk*itemsize % 32 != 0: the nz cache cannot be formed."""
    kwargs = dict(
        key=f16(rng, (4, 3, 5)),
        value=None,
        key_cache=f16(rng, (2, 1, 4, 16)),
        value_cache=None,
        slot_mapping=np.arange(4, dtype=np.int32),
        cache_layout="nz",
    )
    assert_refused(kwargs, ValueError, "key_cache", "divisible by 32", "H=3, D=5, L=16")


def set_4d(key, index):
    """Change of one element of a 4-D base index tensor (a fresh copy)."""

    def change(k, r):
        arr = k[key].copy()
        arr[index[0]] = index[1]
        return {key: arr}

    return change


RULES_4D = [
    (
        "cache_layout_4d",
        lambda k, r: {"cache_layout": "nd"},
        ValueError,
        "cache_layout",
        ["4-D key"],
    ),
    ("value_shape", lambda k, r: {"value": k["value"][:, :5]}, ValueError, "value", ["Smax=6"]),
    (
        "value_dtype",
        lambda k, r: {
            "value": k["value"].astype(np.float32),
            "value_cache": k["value_cache"].view(np.float16).astype(np.float32),
        },
        ValueError,
        "value",
        ["nz"],
    ),
    _bad_cache("cache_heads_dim", "key_cache", (4, 2, 2, 8), ["[NB, BS, 1, 8]"]),
    _bad_cache("value_cache_size", "value_cache", (4, 4, 1, 8), ["[NB, BS, 1, 4]"]),
    _bad_cache("value_cache_blocks", "value_cache", (5, 4, 1, 4), ["NB=4"]),
    (
        "slot_shape",
        lambda k, r: {"slot_mapping": k["slot_mapping"].reshape(4)},
        ValueError,
        "slot_mapping",
        ["[B=2, H=2]"],
    ),
    (
        "lens_missing",
        lambda k, r: {"compress_lens": None},
        ValueError,
        "compress_lens",
        ["[2, 2]", "None"],
    ),
    ("seq_lens_missing", lambda k, r: {"seq_lens": None}, ValueError, "seq_lens", ["[2]", "None"]),
    (
        "lens_shape",
        lambda k, r: {"compress_lens": k["compress_lens"].T.copy()[:1]},
        ValueError,
        "compress_lens",
        ["[2, 2]"],
    ),
    (
        "seq_lens_shape",
        lambda k, r: {"seq_lens": k["seq_lens"][None]},
        ValueError,
        "seq_lens",
        ["[2]"],
    ),
    (
        "offsets_shape",
        lambda k, r: {"compress_seq_offsets": k["compress_seq_offsets"].reshape(2, 2)},
        ValueError,
        "compress_seq_offsets",
        ["[4]"],
    ),
    (
        "index_dtypes_mixed",
        lambda k, r: {"compress_lens": k["compress_lens"].astype(np.int32)},
        ValueError,
        "compress_lens",
        ["int64", "int32"],
    ),
    (
        "index_dtype_uint",
        lambda k, r: {"seq_lens": k["seq_lens"].astype(np.uint32)},
        TypeError,
        "seq_lens",
        ["uint32"],
    ),
    (
        "rope_needs_offsets",
        lambda k, r: {"compress_seq_offsets": None, "compress_mode": "rope"},
        ValueError,
        "compress_seq_offsets",
        ["'rope'"],
    ),
    (
        "omni_needs_offsets",
        lambda k, r: {"compress_seq_offsets": None, "compress_mode": "omni"},
        ValueError,
        "compress_seq_offsets",
        ["'omni'"],
    ),
    (
        "rope_int8",
        lambda k, r: {
            "key": k["key"].view(np.int8)[..., :8].copy(),
            "key_cache": k["key_cache"].view(np.int8)[..., :8].copy(),
            "value": None,
            "value_cache": None,
        },
        TypeError,
        "key",
        ["float16, bfloat16, float32", "int8"],
    ),
    (
        "mode_unknown",
        lambda k, r: {"compress_mode": "mean"},
        ValueError,
        "compress_mode",
        ["'mean'"],
    ),
    (
        "offset_below_minus_one",
        set_4d("compress_seq_offsets", (0, -2)),
        ValueError,
        "compress_seq_offsets",
        ["compress_seq_offsets[0] = -2"],
    ),
    (
        "offset_beyond_len",
        set_4d("compress_seq_offsets", (0, 7)),
        ValueError,
        "compress_seq_offsets",
        ["b=0, h=0"],
    ),
    (
        "offset_plus_width_beyond_len",
        set_4d("compress_lens", ((0, 0), 6)),
        ValueError,
        "compress_lens",
        ["compress_lens[0, 0] = 6"],
    ),
    (
        "negative_width",
        set_4d("compress_lens", ((1, 0), -1)),
        ValueError,
        "compress_lens",
        ["compress_lens[1, 0] = -1"],
    ),
    (
        "seq_len_beyond_smax",
        set_4d("seq_lens", (1, 7)),
        ValueError,
        "seq_lens",
        ["seq_lens[1] = 7", "Smax=6"],
    ),
    ("negative_seq_len", set_4d("seq_lens", (0, -1)), ValueError, "seq_lens", ["seq_lens[0] = -1"]),
    (
        "run_start_out_of_range",
        set_4d("slot_mapping", ((1, 0), 16)),
        ValueError,
        "slot_mapping",
        ["slot_mapping[1, 0] = 16", "(b, h) = (1, 0)"],
    ),
    (
        "run_end_out_of_range",
        set_4d("slot_mapping", ((1, 0), 13)),
        ValueError,
        "slot_mapping",
        ["(b, h) = (1, 0)", "[13, 17)", "NB*BS = 16"],
    ),
    (
        "runs_overlap",
        set_4d("slot_mapping", ((0, 1), 3)),
        ValueError,
        "slot_mapping",
        ["(b, h) = (0, 0)", "[0, 4)", "(b, h) = (0, 1)", "[3, 9)"],
    ),
    (
        "duplicate_run_start",
        set_4d("slot_mapping", ((1, 0), 4)),
        ValueError,
        "slot_mapping",
        ["overlap"],
    ),
    (
        "read_only_key_cache",
        lambda k, r: {
            "key_cache": np.lib.stride_tricks.as_strided(k["key_cache"], writeable=False)
        },
        ValueError,
        "key_cache",
        ["writeable"],
    ),
]


@pytest.mark.parametrize("rule", RULES_4D, ids=[r[0] for r in RULES_4D])
def test_refused_4d(rng, rule):
    _, change, exc, arg, fragments = rule
    kwargs = base_4d(rng)
    assert_refused(_with(kwargs, **change(kwargs, rng)), exc, arg, *fragments)


@pytest.mark.parametrize(
    "lens,fragment",
    [
        ([[5, 0], [2, 1]], "compress_lens[0, 0] = 5"),
        ([[-1, 0], [2, 1]], "compress_lens[0, 0] = -1"),
    ],
)
def test_refused_alibi_width(rng, lens, fragment):
    kwargs = _with(
        base_4d(rng),
        compress_seq_offsets=None,
        seq_lens=np.array([4, 5], np.int64),
        compress_lens=np.array(lens, np.int64),
    )
    msg = assert_refused(kwargs, ValueError, "compress_lens", fragment)
    assert "alibi" in msg


def test_check_scatter_values_direct(rng):
    kwargs = base_3d(rng)
    meta = check_scatter(**kwargs)
    check_scatter_values(meta, kwargs["slot_mapping"])
    with pytest.raises(ValueError, match=r"^slot_mapping: expected .* got slot 15 for token 0"):
        check_scatter_values(meta, np.array([15, -1, -1, -1, -1, -1], np.int32))
    kwargs = base_4d(rng)
    meta = check_scatter(**kwargs)
    index = {
        k: kwargs[k] for k in ("slot_mapping", "compress_lens", "compress_seq_offsets", "seq_lens")
    }
    check_scatter_values(meta, **index)
    with pytest.raises(ValueError, match="^compress_seq_offsets: expected a tensor"):
        check_scatter_values(meta, **_with(index, compress_seq_offsets=None))


def test_validate_scatter_read_modes(rng):
    """Issue 21: one validate_scatter for the reference ("numpy"), pytrt_kv.ops (a read-back
    function, called on the index tensors only) and shape-only callers (None)."""
    kwargs = _with(base_3d(rng), slot_mapping=np.array([0, 99, -1, 7, 3, 9], np.int32))
    assert validate_scatter(**kwargs, read=None).layout == "nd"  # values never read
    with pytest.raises(ValueError, match="^slot_mapping: .* got slot 99 for token 1$"):
        validate_scatter(**kwargs)
    seen = []

    def read(x):
        seen.append(id(x))
        return np.array(x)

    with pytest.raises(ValueError, match="^slot_mapping: .* got slot 99 for token 1$"):
        validate_scatter(**kwargs, read=read)
    assert seen == [id(kwargs["slot_mapping"])]
    # The NumPy-only rules apply to "numpy" alone: a read-only cache is fine on a GPU path.
    ok = base_3d(rng)
    ok["key_cache"].flags.writeable = False
    assert validate_scatter(**ok, read=np.array).layout == "nd"
    with pytest.raises(ValueError, match="^key_cache: expected a writeable"):
        validate_scatter(**ok)


# --- vectorised (no per-token Python work) ---------------------------------------------------
# Speed belongs to the benchmarks (BENCHMARKS.md); what a unit test can guard without a clock
# is the structure that makes the reference fast: the number of Python lines one call runs
# (in the reference, the contract checks, NumPy's Python layer) does not grow with the number
# of tokens, as a per-token loop would make it.


def count_lines(fn):
    """Python lines executed by fn() (sys.settrace line events)."""
    n = 0

    def trace(frame, event, arg):
        nonlocal n
        n += event == "line"
        return trace

    previous = sys.gettrace()  # a coverage tracer, say: put back afterwards
    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(previous)
    return n


@pytest.mark.parametrize("layout", LAYOUTS)
def test_token_writes_do_no_per_token_python_work(rng, layout):
    heads, size, bs = 2, 8, 16
    lines = []
    for tokens in (8, 40, 520):
        nb = tokens // bs + 2
        key = random_bits(rng, (tokens, heads, size), "float16")
        cache = random_bits(rng, cache_shape(layout, nb, bs, heads, size, "float16"), "float16")
        slots = rng.permutation(nb * bs)[:tokens].astype(np.int32)
        lines.append(
            count_lines(
                lambda: scatter_pa_kv_cache(
                    key, key, cache, cache.copy(), slots, cache_layout=layout
                )
            )
        )
        t = tokens - 1
        s = int(slots[t])
        got = cache[s // bs, s % bs] if layout == "nd" else cache[s // bs, :, s % bs]
        assert_same_bytes(got.reshape(heads, size), key[t])
    # A few lines of slack for data-dependent branches; a per-token loop adds hundreds.
    assert max(lines) - min(lines) <= 20, f"lines for 8, 40, 520 tokens: {lines}"


def test_compressing_writes_do_no_per_token_python_work(rng):
    def lines(batch, heads, smax):
        size = 16
        key = random_floats(rng, (batch, smax, heads, size), "bfloat16")
        cache = random_bits(rng, (batch * heads * smax // 16 + 1, 16, 1, size), "bfloat16")
        slots = (np.arange(batch * heads) * smax).reshape(batch, heads)
        lens = np.full((batch, heads), smax // 2)
        offs = np.full(batch * heads, 3)
        seq = np.full(batch, smax)
        return count_lines(
            lambda: scatter_pa_kv_cache(
                key,
                key,
                cache,
                cache.copy(),
                slots,
                compress_lens=lens,
                compress_seq_offsets=offs,
                seq_lens=seq,
            )
        )

    # Runs of 16 and of 128 compressed tokens (mean rows included) run the same lines.
    short, long = lines(2, 3, 32), lines(2, 3, 256)
    assert abs(long - short) <= 20, (short, long)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_rope_reference_on_random_bytes(dtype):
    """Issue 16 C2 (docs/SPEC.md S6) on random bit patterns (NaN payloads, inf,
    denormals): the prefix and suffix rows are the tokens' exact bits; the mean row is the
    float32 mean rounded to the dtype, or any NaN where that mean is NaN."""
    rng = np.random.default_rng(16)
    nd = numpy_dtype(dtype)
    L, H, D, o, w = 12, 2, 32, 3, 5
    key = rng.integers(0, 256, L * H * D * nd.itemsize, dtype=np.uint8).view(nd)
    key = key.reshape(1, L, H, D)
    cache = np.zeros((4, 8, 1, D), nd)
    base = np.array([[0, 12]])
    with np.errstate(all="raise"):  # the reference raises no floating-point warning
        scatter_pa_kv_cache(
            key,
            None,
            cache,
            None,
            base.astype(np.int32),
            compress_lens=np.full((1, H), w, np.int32),
            compress_seq_offsets=np.full(H, o, np.int32),
            seq_lens=np.array([L], np.int32),
            compress_mode="rope",
        )
    rows = cache.reshape(-1, D)
    for h in range(H):
        b = int(base[0, h])
        copied = [(b + t, t) for t in range(o)] + [
            (b + o + 1 + i, o + w + i) for i in range(L - o - w)
        ]
        for slot, t in copied:
            assert rows[slot].tobytes() == key[0, t, h].tobytes(), (h, slot)
        acc = np.zeros(D, np.float32)
        with np.errstate(all="ignore"):
            for t in range(o, o + w):
                acc = acc + key[0, t, h].astype(np.float32)
            mean = (acc / np.float32(w)).astype(nd)
        nan = np.isnan(mean.astype(np.float32))
        assert np.isnan(rows[b + o][nan].astype(np.float32)).all()
        assert rows[b + o][~nan].tobytes() == mean[~nan].tobytes()
