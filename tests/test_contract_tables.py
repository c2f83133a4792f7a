"""The layout table (pytrt_kv/contract/layouts.py) and the quantised-dtype table
(pytrt_kv/contract/quant.py) against docs/SPEC.md S3-S5 and S9, written out here by hand."""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest

from pytrt_kv.contract import dtypes, limits, specs
from pytrt_kv.contract.layouts import LAYOUTS, get_layout
from pytrt_kv.contract.quant import QUANT


def _spec_shape(layout, nb, bs, heads, size, item):
    L = 32 // item
    return {
        "nd": (nb, bs, heads, size),
        "hnd": (nb, heads, bs, size),
        "nz": (nb, heads * size // L, bs, L),
    }[layout]


def _spec_index(layout, blk, row, h, d, heads, size, item):
    f, L = h * size + d, 32 // item
    return {
        "nd": (blk, row, h, d),
        "hnd": (blk, h, row, d),
        "nz": (blk, f // L, row, f % L),
    }[layout]


GRID = list(itertools.product(["nd", "hnd", "nz"], [1, 2, 4], [(1, 32), (2, 48), (4, 8)]))


@pytest.mark.parametrize("name, item, hd", GRID)
def test_layout_shape_fit_and_addressing_follow_the_spec(name, item, hd):
    heads, size = hd
    lay = LAYOUTS[name]
    nb, bs = 3, 5
    if name == "nz" and (heads * size * item) % 32:
        assert not lay.fits_heads(heads, size, item)
        assert lay.fit((nb, 1, bs, 32 // item), heads, size, item) is None
        return
    shape = _spec_shape(name, nb, bs, heads, size, item)
    assert lay.shape(nb, bs, heads, size, item) == shape
    assert lay.fit(shape, heads, size, item) == (nb, bs)
    assert lay.blocks(shape) == (nb, bs)
    cache = np.zeros(shape, np.dtype(f"u{item}"))
    view = lay.segments(cache, heads, size)
    assert np.shares_memory(view, cache)
    for blk, row, h, d in [
        (0, 0, 0, 0),
        (2, 4, heads - 1, size - 1),
        (1, 3, heads // 2, size // 3),
    ]:
        want = int(
            np.ravel_multi_index(_spec_index(name, blk, row, h, d, heads, size, item), shape)
        )
        got = lay.element_offset(blk, row, h, d, bs=bs, heads=heads, size=size, itemsize=item)
        assert got == want, (name, blk, row, h, d)
        seg = lay.segment_elems(heads, size, item)
        f = h * size + d
        view[blk, f // seg, row, f % seg] = 7
        assert cache[_spec_index(name, blk, row, h, d, heads, size, item)] == 7


def test_layout_fit_refuses_other_shapes():
    nd, hnd = LAYOUTS["nd"], LAYOUTS["hnd"]
    assert nd.fit((3, 5, 2, 8), 2, 8, 2) == (3, 5)
    assert nd.fit((3, 5, 2, 9), 2, 8, 2) is None
    assert hnd.fit((3, 5, 2, 8), 2, 8, 2) is None
    assert nd.fit((3, 5, 16), 2, 8, 2) is None
    assert LAYOUTS["nz"].pattern(3, 5, 2) == "[NB, 3*5/16, BS, 16]"
    assert nd.pattern(2, 8, 2) == "[NB, BS, 2, 8]"
    with pytest.raises(KeyError, match="expected one of"):
        get_layout("nhd")


def test_layout_table_is_the_contract_and_abi_list():
    assert tuple(LAYOUTS) == specs.CACHE_LAYOUTS
    assert {n: lay.code for n, lay in LAYOUTS.items()} == limits.LAYOUT_CODES
    assert sorted(limits.LAYOUT_CODES.values()) == list(range(len(LAYOUTS)))


def test_quant_table_follows_spec_s9():
    assert tuple(QUANT) == specs.SCATTER_QUANT_CACHE_DTYPES
    e4m3, int8 = QUANT[specs.FLOAT8_E4M3], QUANT[specs.INT8]
    assert (e4m3.max, int8.max) == (448.0, 127.0)
    # The largest finite e4m3 and the symmetric int8 bound (docs/SPEC.md S9).
    assert e4m3.max == float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
    assert int8.max == float(np.iinfo(np.int8).max)
    assert (e4m3.integer, int8.integer) == (False, True)
    nan = np.array([e4m3.nan_bits], np.uint8).view(ml_dtypes.float8_e4m3fn)
    assert np.isnan(nan.astype(np.float32))[0] and e4m3.nan_bits == 0x7F
    assert int8.nan_bits == 0
    for q in QUANT.values():
        assert q.numpy == dtypes.NUMPY[q.name]
        assert q.onnx == dtypes.ONNX[q.name]
        assert q.tensorrt == dtypes.TENSORRT[q.name]
        assert q.code == limits.DTYPE_CODES[q.name]
