"""The block-push contract (docs/SPEC.md D2-D4) on the NumPy reference: the API page's own
example byte for byte, an independent vectorized oracle on random cases, and every
PARAM_INVALID rule (a refused call changes nothing)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pytrt_kv.datadist import (
    CacheDesc,
    KvCacheExtParam,
    LLMException,
    LLMParamInvalid,
    LLMRole,
    LLMStatus,
    check_transfer,
    push_kv_blocks_reference,
)

SENTINEL = -77


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


def _cache(rng, n, shape, dtype, fill=None):
    if fill is not None:
        return [np.full(shape, fill, dtype) for _ in range(n)]
    if np.dtype(dtype).kind in "iu":
        return [rng.integers(-100, 100, shape).astype(dtype) for _ in range(n)]
    return [rng.standard_normal(shape).astype(dtype) for _ in range(n)]


def oracle(src, dst, sb, db, src_tensors, dst_tensors):
    """D3 by fancy indexing on stacked caches (independent of the reference's loops)."""
    s, d = np.stack(src), np.stack(dst).copy()
    st_, dt_ = np.asarray(src_tensors)[:, None], np.asarray(dst_tensors)[:, None]
    sb, db = np.asarray(sb, np.int64), np.asarray(db, np.int64)
    d[dt_, db[None, :]] = s[st_, sb[None, :]]
    return list(d)


def test_api_page_example_byte_for_byte():
    # The seed's own call: int32 [4, 16] x 4 tensors, layer 3 with one tensor per layer,
    # prompt blocks 0..3 -> decoder blocks 3..0.
    src = [np.arange(64, dtype=np.int32).reshape(4, 16) * 7 + 1000 * t for t in range(4)]
    dst = [np.full((4, 16), SENTINEL, np.int32) for _ in range(4)]
    ext = KvCacheExtParam(src_layer_range=(3, 3), dst_layer_range=(3, 3), tensor_num_per_layer=1)
    out = push_kv_blocks_reference(src, dst, [0, 1, 2, 3], [3, 2, 1, 0], ext)
    expected = [np.full((4, 16), SENTINEL, np.int32) for _ in range(3)]
    expected.append(np.stack([src[3][3], src[3][2], src[3][1], src[3][0]]))
    for o, e in zip(out, expected):
        assert _bits(o).tobytes() == _bits(e).tobytes()
    assert all((d == SENTINEL).all() for d in dst), "the reference modified its input"


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.int8, np.int32])
def test_default_ranges_all_layers(dtype):
    rng = np.random.default_rng(1)
    src = _cache(rng, 6, (5, 3, 4), dtype)
    dst = _cache(rng, 6, (9, 3, 4), dtype, fill=3)
    sb, db = [4, 0, 0, 2], [8, 1, 2, 0]  # a repeated source is allowed
    out = push_kv_blocks_reference(src, dst, sb, db)
    ref = oracle(src, dst, sb, db, range(6), range(6))
    assert all(_bits(a).tobytes() == _bits(b).tobytes() for a, b in zip(out, ref))


@st.composite
def cases(draw):
    tnpl = draw(st.integers(1, 3))
    s_layers, d_layers = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    n_layers = draw(st.integers(1, min(s_layers, d_layers)))
    if n_layers == s_layers == d_layers and draw(st.booleans()):
        sr = dr = (-1, -1)
    else:
        f = draw(st.integers(0, s_layers - n_layers))
        g = draw(st.integers(0, d_layers - n_layers))
        sr, dr = (f, f + n_layers - 1), (g, g + n_layers - 1)
    s_nb, d_nb = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    n = draw(st.integers(0, d_nb))
    db = draw(st.permutations(range(d_nb)))[:n]
    sb = draw(st.lists(st.integers(0, s_nb - 1), min_size=n, max_size=n))
    width = draw(st.sampled_from([1, 3, 8]))
    dtype = draw(st.sampled_from([np.float16, ml_dtypes.bfloat16, np.int8, np.int32]))
    seed = draw(st.integers(0, 2**31))
    return tnpl, s_layers, d_layers, sr, dr, s_nb, d_nb, sb, db, width, dtype, seed


@settings(max_examples=150, deadline=None)
@given(cases())
def test_reference_matches_oracle(case):
    tnpl, sl, dl, sr, dr, s_nb, d_nb, sb, db, width, dtype, seed = case
    rng = np.random.default_rng(seed)
    src = _cache(rng, sl * tnpl, (s_nb, width), dtype)
    dst = _cache(rng, dl * tnpl, (d_nb, width), dtype)
    ext = KvCacheExtParam(sr, dr, tnpl)
    out = push_kv_blocks_reference(src, dst, sb, db, ext)
    s_t = range(sl * tnpl) if sr == (-1, -1) else range(sr[0] * tnpl, (sr[1] + 1) * tnpl)
    d_t = range(dl * tnpl) if dr == (-1, -1) else range(dr[0] * tnpl, (dr[1] + 1) * tnpl)
    ref = oracle(src, dst, sb, db, list(s_t), list(d_t))
    assert all(_bits(a).tobytes() == _bits(b).tobytes() for a, b in zip(out, ref))
    # The plan's runs move exactly the planned pairs, once each.
    plan = check_transfer(
        CacheDesc(sl * tnpl, (s_nb, width), dtype),
        CacheDesc(dl * tnpl, (d_nb, width), dtype),
        sb,
        db,
        ext,
    )
    pairs = [(s, d, sb_ + k, db_ + k) for s, d, sb_, db_, n in plan.runs() for k in range(n)]
    assert pairs == [(s, d, a, b) for s, d in zip(s_t, d_t) for a, b in zip(sb, db)]
    si, di = plan.descriptor_indices(s_nb, d_nb)
    assert si.tolist() == [s * s_nb + a for s in s_t for a in sb]
    assert di.tolist() == [d * d_nb + b for d in d_t for b in db]


# --- every PARAM_INVALID rule (docs/SPEC.md D4) -------------------------------------------


def _refused(src, dst, sb, db, ext, match):
    before = [d.copy() for d in dst]
    with pytest.raises(LLMParamInvalid, match=match) as info:
        push_kv_blocks_reference(src, dst, sb, db, ext)
    assert info.value.status is LLMStatus.PARAM_INVALID
    assert isinstance(info.value, ValueError) and isinstance(info.value, LLMException)
    assert "docs/SPEC.md D4" in str(info.value)
    assert all((a == b).all() for a, b in zip(dst, before))


def _two(n_src=4, n_dst=4, s_shape=(4, 16), d_shape=(4, 16), s_dt=np.int32, d_dt=np.int32):
    rng = np.random.default_rng(0)
    return _cache(rng, n_src, s_shape, s_dt), _cache(rng, n_dst, d_shape, d_dt, fill=SENTINEL)


@pytest.mark.parametrize("tnpl", [0, -1, 5, 3, True, 2.0])
def test_tensor_num_per_layer_refused(tnpl):
    # 4 tensors: tnpl must be an int in [1, 4] dividing 4, even with the default ranges.
    src, dst = _two()
    _refused(src, dst, [0], [0], KvCacheExtParam(tensor_num_per_layer=tnpl), "tensor_num_per_layer")


@pytest.mark.parametrize("num_tensors", [1, 3])
def test_default_tensor_num_per_layer_refused_with_default_ranges(num_tensors):
    """docs/SPEC.md D4: tnpl must divide num_tensors always, also with both ranges
    (-1, -1); a 1-tensor cache with the default tnpl 2 is PARAM_INVALID naming the
    argument, the expected range and the value, and moves with tnpl 1."""
    rng = np.random.default_rng(num_tensors)
    src = _cache(rng, num_tensors, (4, 16), np.int32)
    dst = _cache(rng, num_tensors, (4, 16), np.int32, fill=SENTINEL)
    match = rf"ext_param\.tensor_num_per_layer: expected .*\[1, {num_tensors}\], got 2 "
    for ext in (None, KvCacheExtParam()):
        _refused(src, dst, [0, 3], [2, 1], ext, match)
    out = push_kv_blocks_reference(
        src, dst, [0, 3], [2, 1], KvCacheExtParam(tensor_num_per_layer=1)
    )
    ref = oracle(src, dst, [0, 3], [2, 1], range(num_tensors), range(num_tensors))
    assert all(_bits(a).tobytes() == _bits(b).tobytes() for a, b in zip(out, ref))


def test_tensor_num_per_layer_checked_on_each_side():
    src, dst = _two(n_src=4, n_dst=6)  # 2 divides both; 4 divides only the source
    push_kv_blocks_reference(src, dst, [0], [0], KvCacheExtParam((0, 1), (1, 2), 2))
    _refused(src, dst, [0], [0], KvCacheExtParam((0, 0), (0, 0), 4), "destination")


@pytest.mark.parametrize(
    "rng_", [(-1, 0), (0, -1), (2, 1), (0, 4), (-2, -2), (4, 4), (0,), "ab", None, (0.5, 1)]
)
@pytest.mark.parametrize("side", ["src", "dst"])
def test_layer_range_refused(rng_, side):
    src, dst = _two()  # 4 tensors, tnpl 1: layers 0..3
    ranges = {"src_layer_range": (0, 0), "dst_layer_range": (0, 0)}
    ranges[f"{side}_layer_range"] = rng_
    _refused(
        src, dst, [0], [0], KvCacheExtParam(tensor_num_per_layer=1, **ranges), f"{side}_layer_range"
    )


def test_layer_range_checked_against_its_own_side():
    src, dst = _two(n_src=2, n_dst=8)  # tnpl 2: source layer 0 only, destination 0..3
    push_kv_blocks_reference(src, dst, [1], [2], KvCacheExtParam((0, 0), (3, 3)))
    _refused(src, dst, [1], [2], KvCacheExtParam((1, 1), (3, 3)), "src_layer_range")
    _refused(src, dst, [1], [2], KvCacheExtParam((0, 0), (4, 4)), "dst_layer_range")


def test_layer_ranges_of_unequal_length_refused():
    src, dst = _two()
    _refused(src, dst, [0], [0], KvCacheExtParam((0, 1), (2, 2), 1), "as many layers")
    # (-1, -1) on one side counts all of its layers.
    _refused(src, dst, [0], [0], KvCacheExtParam((-1, -1), (0, 2), 1), "as many layers")
    src8, dst = _two(n_src=8)
    _refused(src8, dst, [0], [0], KvCacheExtParam(), "as many layers")


def test_block_list_lengths_must_match():
    src, dst = _two()
    _refused(src, dst, [0, 1], [0], None, "dst_blocks")


@pytest.mark.parametrize("side, ids", [("src", [4]), ("src", [-1]), ("dst", [0, 4]), ("dst", [-3])])
def test_block_ids_out_of_range_refused(side, ids):
    src, dst = _two(d_shape=(4, 16))
    other = list(range(len(ids)))
    sb, db = (ids, other) if side == "src" else (other, ids)
    _refused(src, dst, sb, db, None, rf"{side}_blocks\[\d\]: expected a block id in \[0, 4\)")


@pytest.mark.parametrize("bad", [[0.0], [[0]], "0", 3, [True], None])
def test_block_ids_must_be_ints(bad):
    src, dst = _two()
    _refused(src, dst, bad, [0], None, "src_blocks")


def test_block_ids_are_checked_on_their_own_side():
    src, dst = _two(s_shape=(2, 16), d_shape=(8, 16))
    push_kv_blocks_reference(src, dst, [1, 1], [7, 6])
    _refused(src, dst, [7], [1], None, r"src_blocks\[0\]")


def test_duplicate_destination_refused_duplicate_source_allowed():
    src, dst = _two()
    _refused(src, dst, [0, 1], [2, 2], None, "block 2 more than once")
    out = push_kv_blocks_reference(src, dst, [1, 1], [2, 3])
    assert (out[0][2] == src[0][1]).all() and (out[0][3] == src[0][1]).all()


def test_dtype_mismatch_refused():
    src, dst = _two(s_dt=np.float16, d_dt=ml_dtypes.bfloat16)  # same itemsize
    _refused(src, dst, [0], [0], None, "data_type")


def test_block_bytes_mismatch_refused_equal_bytes_accepted():
    src, dst = _two(s_shape=(4, 16), d_shape=(4, 15))
    _refused(src, dst, [0], [0], None, "block_bytes")
    # Same block bytes in another shape: D4 asks only for equal dtype and block_bytes.
    src, dst = _two(s_shape=(4, 16), d_shape=(6, 4, 4))
    out = push_kv_blocks_reference(src, dst, [3], [5])
    assert (out[1][5].reshape(-1) == src[1][3]).all()


def test_roles():
    d = CacheDesc(2, (4, 8), np.int8)
    check_transfer(d, d, [0], [0], op="push", role=LLMRole.PROMPT)
    check_transfer(d, d, [0], [0], op="pull", role=LLMRole.DECODER)
    with pytest.raises(LLMParamInvalid, match="push only from a prompt node"):
        check_transfer(d, d, [0], [0], op="push", role=LLMRole.DECODER)
    with pytest.raises(LLMParamInvalid, match="pull only from a decoder node"):
        check_transfer(d, d, [0], [0], op="pull", role=LLMRole.PROMPT)


def test_ext_param_type_and_reference_arguments():
    src, dst = _two()
    _refused(src, dst, [0], [0], {"tensor_num_per_layer": 1}, "ext_param")
    with pytest.raises(ValueError, match=r"dst_cache\[1\]"):
        push_kv_blocks_reference(src, [dst[0], dst[1][:2]], [0], [0])
    with pytest.raises(TypeError, match="src_cache"):
        push_kv_blocks_reference(np.stack(src), dst, [0], [0])


def test_empty_block_lists_accepted():
    src, dst = _two()
    out = push_kv_blocks_reference(src, dst, [], [])
    assert all((o == SENTINEL).all() for o in out)
    assert (
        check_transfer(
            CacheDesc(4, (4, 16), np.int32),
            CacheDesc(4, (4, 16), np.int32),
            np.zeros(0, np.int64),
            [],
            None,
        ).num_copies
        == 0
    )


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"num_tensors": 0, "shape": (4, 4)}, "num_tensors"),
        ({"num_tensors": 1, "shape": (0, 4)}, "shape"),
        ({"num_tensors": 1, "shape": (4, 0)}, "shape"),
        ({"num_tensors": 1, "shape": (4, 4), "placement": "gpu"}, "placement"),
    ],
)
def test_cache_desc_refusals(kw, match):
    with pytest.raises(ValueError, match=match):
        CacheDesc(**kw)
    with pytest.raises(TypeError, match="dtype"):
        CacheDesc(1, (4, 4), "complex64")
    assert CacheDesc(1, (4, 4, 2), "bfloat16").block_bytes == 16
