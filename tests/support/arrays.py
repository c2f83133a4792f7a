"""Array helpers shared by the tests: random non-zero data, sentinels, bit-exact
comparison, torch copies that keep every bit (bfloat16 / float8 have no NumPy twin), and a
stand-in for a device array."""

from __future__ import annotations

import numpy as np

from pytrt_kv.contract import dtypes

BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
SENTINEL = {1: 0xA5, 2: 0xA5C3, 4: 0xA5C3E1F7}


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(BITS[a.dtype.itemsize])


def random_data(rng, shape, dtype: str) -> np.ndarray:
    """Random values that are never zero; any bit pattern moves unchanged."""
    nd = dtypes.numpy_dtype(dtype)
    if dtype in ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"):
        x = rng.uniform(0.5, 4.0, shape) * rng.choice([-1, 1], shape)
        return x.astype(nd)
    if dtype.startswith("int") or dtype.startswith("uint"):
        info = np.iinfo(nd)
        x = rng.integers(max(info.min, -1000), min(info.max, 1000), shape, dtype=np.int64)
        x[x == 0] = 7
        return x.astype(nd)
    raise AssertionError(dtype)


def sentinel(shape, dtype: str) -> np.ndarray:
    nd = dtypes.numpy_dtype(dtype)
    return np.full(shape, SENTINEL[nd.itemsize], BITS[nd.itemsize]).view(nd)


def cache_shape(layout: str, nb: int, bs: int, heads: int, size: int, dtype) -> tuple[int, ...]:
    """A cache of ``nb`` blocks of ``bs`` rows of ``heads`` x ``size`` elements in the
    layout named (docs/SPEC.md S4): nz rows are segments of 32 bytes."""
    last = 32 // dtypes.numpy_dtype(dtype).itemsize
    return {
        "nd": (nb, bs, heads, size),
        "hnd": (nb, heads, bs, size),
        "nz": (nb, heads * size // last, bs, last),
    }[layout]


# --- torch conversions (bit views: bfloat16 / float8 have no NumPy equivalent) ------------


def torch_mod():
    import torch

    return torch


def to_torch(a: np.ndarray, device="cuda", pinned=False, offset_elems=0):
    """Copy of ``a`` as a torch tensor; ``offset_elems`` > 0 makes its address unaligned
    (a view into a larger buffer) to exercise the narrower vector widths."""
    torch = torch_mod()
    a = np.array(a, order="C", copy=None)  # keeps 0-d (ascontiguousarray makes it 1-d)
    signed = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.dtype.itemsize]
    raw = torch.from_numpy(
        a.view({1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[a.dtype.itemsize])
        .reshape(-1)
        .copy()
    )
    name = dtypes.name_of(a.dtype)
    tdt = getattr(torch, name)
    if offset_elems:
        big = torch.empty(raw.numel() + offset_elems, dtype=signed)
        big[offset_elems:] = raw
        raw = big[offset_elems:]
    t = raw.view(tdt).reshape(a.shape)
    if device == "cpu":
        return t.pin_memory() if pinned else t
    if offset_elems:
        big = big.to(device)
        return big[offset_elems:].view(tdt).reshape(a.shape)
    return t.to(device)


def to_numpy(t) -> np.ndarray:
    torch = torch_mod()
    name = str(t.dtype).replace("torch.", "")
    nd = dtypes.numpy_dtype(name)
    signed = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[nd.itemsize]
    return t.detach().contiguous().cpu().view(signed).numpy().view(nd)


def assert_same_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Same shape, same dtype and the same bytes (NaN payloads included)."""
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    g, w = bits(got), bits(want)
    bad = np.argwhere(g != w)
    assert bad.size == 0, f"{what}: {len(bad)} elements differ, first at {bad[:5].tolist()}"


class FakeCudaArray:
    """An object with only __cuda_array_interface__ (like a PyCUDA GPUArray)."""

    def __init__(self, shape, typestr, strides=None, ptr=0x7F0000000000):
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (ptr, False),
            "strides": strides,
            "version": 3,
        }
