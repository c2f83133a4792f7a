"""Arguments that share memory with a tensor the op writes are refused up front, naming
both (pytrt_kv.contract.alias; reference and eager GPU API), and nothing is written."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from pytrt_kv.contract import alias as _alias
from pytrt_kv.reference import gather_selection_kv_cache, scatter_pa_kv_cache
from support.gather_cases import base_case, make_case


def _f16(rng, shape):
    return (rng.standard_normal(shape) * 3 + 0.5).astype(np.float16)


# --- ScatterPaKvCache -----------------------------------------------------------------


def _scatter_args(rng):
    return dict(
        key=_f16(rng, (4, 2, 8)),
        value=_f16(rng, (4, 2, 8)),
        key_cache=_f16(rng, (3, 4, 2, 8)),
        value_cache=_f16(rng, (3, 4, 2, 8)),
        slot_mapping=np.array([0, 5, -1, 9], np.int32),
    )


def _assert_scatter_refused(args, subject, other):
    caches = {k: args[k].copy() for k in ("key_cache", "value_cache") if args.get(k) is not None}
    with pytest.raises(ValueError) as exc:
        scatter_pa_kv_cache(**args)
    msg = str(exc.value)
    assert msg.startswith(f"{subject}: expected memory separate from {other}"), msg
    assert f"overlapping {other}" in msg
    for k, before in caches.items():
        assert np.array_equal(args[k].view(np.uint16), before.view(np.uint16)), k


def test_scatter_value_viewing_value_cache(rng):
    args = _scatter_args(rng)
    args["value"] = args["value_cache"][0, :, :, :].reshape(4, 2, 8)  # block 0
    _assert_scatter_refused(args, "value_cache", "value")


def test_scatter_key_viewing_value_cache(rng):
    args = _scatter_args(rng)
    args["key"] = args["value_cache"][1]
    _assert_scatter_refused(args, "value_cache", "key")


def test_scatter_4d_key_viewing_its_cache(rng):
    """A 4-D key [B, Smax, 1, D] that is the cache [NB, BS, 1, D] itself, reshaped."""
    cache = _f16(rng, (2, 4, 1, 8))
    args = dict(
        key=cache.reshape(2, 4, 1, 8)[:, :],
        value=None,
        key_cache=cache,
        value_cache=None,
        slot_mapping=np.array([[0], [4]], np.int32),
        compress_lens=np.array([[2], [1]], np.int32),
        seq_lens=np.array([3, 4], np.int32),
    )
    _assert_scatter_refused(args, "key_cache", "key")


def test_scatter_slot_mapping_inside_a_cache(rng):
    args = _scatter_args(rng)
    raw = args["key_cache"].view(np.int32).reshape(-1)
    raw[:4] = [0, 5, -1, 9]
    args["slot_mapping"] = raw[:4]
    _assert_scatter_refused(args, "key_cache", "slot_mapping")


def test_scatter_key_and_value_may_share_memory(rng):
    """Two read-only arguments viewing one buffer: allowed, and written correctly."""
    args = _scatter_args(rng)
    args["value"] = args["key"]
    want_k, want_v = args["key_cache"].copy(), args["value_cache"].copy()
    scatter_pa_kv_cache(args["key"], args["key"].copy(), want_k, want_v, args["slot_mapping"])
    scatter_pa_kv_cache(**args)
    assert np.array_equal(args["key_cache"], want_k)
    assert np.array_equal(args["value_cache"], want_v)


# --- GatherSelectionKvCache -------------------------------------------------------------


def _assert_gather_refused(case, subject, other):
    before = {k: v.copy() for k, v in case.args.items()}
    with pytest.raises(ValueError) as exc:
        case.call()
    msg = str(exc.value)
    assert msg.startswith(f"{subject}: expected memory separate from {other}"), msg
    for k, old in before.items():
        assert np.array_equal(case.args[k].view(np.uint8), old.view(np.uint8)), k


def test_gather_status_overlapping_topk(rng):
    case = base_case(rng)
    status = case.args["selection_kv_block_status"]
    topk = case.args["selection_topk_indices"]
    status[...] = -1
    status[..., : topk.shape[-1]] = topk  # topk now lives inside the status
    case.args["selection_topk_indices"] = status[..., : topk.shape[-1]]
    _assert_gather_refused(case, "selection_kv_block_status", "selection_topk_indices")


def test_gather_status_overlapping_block_table(rng):
    case = base_case(rng)
    table = case.args["selection_kv_block_table"]
    status = case.args["selection_kv_block_status"]
    # A table that is the tail of one int32 buffer whose head is the status.
    buf = np.full(status.size + table.size, -1, np.int32)
    buf[status.size :] = table.reshape(-1)
    case.args["selection_kv_block_status"] = buf[: status.size].reshape(status.shape)
    case.args["selection_kv_block_table"] = buf[status.size - 1 : -1].reshape(table.shape)
    _assert_gather_refused(case, "selection_kv_block_status", "selection_kv_block_table")


def test_gather_full_cache_overlapping_selection_cache(rng):
    case = make_case(rng, K=4, kv_lens=(8,), topk=[[5, 1, 7, -1]])
    sel = case.args["selection_kv_cache"]
    full = case.args["full_kv_cache"]
    both = np.concatenate([sel.reshape(-1), full.reshape(-1)])
    # The full cache starts one block before the selection cache ends.
    start = sel.size - sel[0].size
    case.args["selection_kv_cache"] = both[: sel.size].reshape(sel.shape)
    case.args["full_kv_cache"] = both[start : start + full.size].reshape(full.shape)
    _assert_gather_refused(case, "selection_kv_cache", "full_kv_cache")


def test_gather_two_outputs_overlapping(rng):
    case = make_case(rng, K=4, kv_lens=(8,), topk=[[5, 1, 7, -1]], rope_dim=3, kv_dim=3)
    case.args["selection_k_rope"] = case.args["selection_kv_cache"]
    _assert_gather_refused(case, "selection_kv_cache", "selection_k_rope")


def test_gather_interleaved_rope_and_kv_views_are_accepted(rng):
    """k_rope and kv as column slices of one [.., KV + R] buffer share no element."""
    ref = make_case(rng, K=4, kv_lens=(8,), topk=[[5, 1, 7, -1]], rope_dim=2, kv_dim=3)
    sel_kv, sel_rope = ref.args["selection_kv_cache"], ref.args["selection_k_rope"]
    packed = np.concatenate([sel_kv, sel_rope], axis=-1)
    packed[...] = _f16(rng, packed.shape)  # a sentinel that the ids do not overwrite
    ref.args["selection_kv_cache"][...] = packed[..., :3]
    ref.args["selection_k_rope"][...] = packed[..., 3:]
    case_args = {k: v.copy() for k, v in ref.args.items()}
    case_args.update(selection_kv_cache=packed[..., :3], selection_k_rope=packed[..., 3:])
    want = ref.call()
    got = gather_selection_kv_cache(**case_args, selection_topk_block_size=1)
    assert np.array_equal(got, want)
    assert np.array_equal(packed[..., :3], ref.args["selection_kv_cache"])
    assert np.array_equal(packed[..., 3:], ref.args["selection_k_rope"])


def test_gather_full_q_actual_seq_is_exempt(rng):
    """full_q_actual_seq is never read: sharing the status' memory is harmless."""
    case = make_case(rng, K=4, kv_lens=(8,), topk=[[5, 1, 7, -1]])
    case.args["full_q_actual_seq"] = case.args["selection_kv_block_status"].reshape(-1)[:1]
    assert case.call().tolist()[0] == 3


# --- the shared rule on device-style address ranges (what pytrt_kv.ops uses) ---------


def test_check_no_alias_on_address_ranges():
    r = _alias.buffer_range
    ranges = {"a": r(1000, 64), "b": r(2000, 16), "c": r(1060, 8), "d": r(0, 8)}
    _alias.check_no_alias(ranges, written=("b",))
    with pytest.raises(ValueError, match=r"^c: expected memory separate from a .*overlapping a"):
        _alias.check_no_alias(ranges, written=("c",))
    # Read-only overlaps are fine; empty and null buffers never overlap.
    _alias.check_no_alias(ranges, written=())
    assert r(0, 8) is None and r(1000, 0) is None
    with pytest.raises(ValueError, match=r"^out: .* separate from b"):
        _alias.check_no_alias({"b": r(2000, 16), "out": r(2012, 4)}, written=("out",))


# --- huge TBS with zero-block caches: refused before allocating ------------------------


def test_huge_tbs_with_zero_block_caches_is_refused_without_allocating():
    """SBS = FBS = TBS = 2**22 and no blocks at all: the call is refused by a range rule
    (no full block to read), and the check must not first build per-token index arrays
    (4M tokens -> tens of MiB here, GiBs with TBS = 2**26)."""
    tbs = 1 << 22
    i32 = np.int32
    args = dict(
        selection_k_rope=np.zeros((0,), np.float16),
        selection_kv_cache=np.zeros((0, tbs, 1), np.float16),
        selection_kv_block_table=np.zeros((1, 2), i32),
        selection_kv_block_status=np.full((1, 1, 1, 3), -1, i32),
        selection_topk_indices=np.array([0, -1], i32).reshape(1, 1, 1, 2),
        full_k_rope=np.zeros((0,), np.float16),
        full_kv_cache=np.zeros((0, tbs, 1), np.float16),
        full_kv_block_table=np.zeros((1, 1), i32),
        full_kv_actual_seq=np.array([tbs], i32),
        full_q_actual_seq=np.array([1], i32),
    )
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"full_kv_block_table\[0, 0\].*F_BLOCK_NUM = 0"):
            gather_selection_kv_cache(**args, selection_topk_block_size=tbs)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"peak {peak} bytes traced for a call on empty caches"


# --- the eager GPU API applies the same rule before any launch (no GPU needed) -----------


class _DeviceLike:
    """An object with ``__cuda_array_interface__`` at a made-up device address."""

    def __init__(self, ptr, shape, dtype):
        self.__cuda_array_interface__ = {
            "shape": tuple(shape),
            "typestr": np.dtype(dtype).str,
            "data": (ptr, False),
            "strides": None,
            "version": 3,
        }


def _no_placement(monkeypatch):
    import pytrt_kv.ops as ops

    # Placement asks the driver where memory lives; the addresses here are made up, and
    # the aliasing rule runs right after placement.
    monkeypatch.setattr(ops, "_place", lambda bufs, host_ok=(): 0)
    return ops


def test_ops_scatter_refuses_value_inside_value_cache(monkeypatch):
    ops = _no_placement(monkeypatch)
    base = 1 << 40
    key = _DeviceLike(base, (4, 2, 8), np.float16)
    kc = _DeviceLike(base + 4096, (3, 4, 2, 8), np.float16)
    vc = _DeviceLike(base + 8192, (3, 4, 2, 8), np.float16)
    value = _DeviceLike(base + 8192 + 256, (4, 2, 8), np.float16)  # inside value_cache
    slots = _DeviceLike(base + 16384, (4,), np.int32)
    with pytest.raises(ValueError, match=r"^value_cache: expected memory separate from value"):
        ops.prepare_scatter(key, value, kc, vc, slots)


def test_ops_gather_refuses_out_on_the_status(monkeypatch):
    ops = _no_placement(monkeypatch)
    i32 = np.int32
    addr = iter(range(1 << 40, 1 << 41, 1 << 20))
    args = [
        _DeviceLike(next(addr), (0,), np.float16),  # selection_k_rope
        _DeviceLike(next(addr), (4, 8, 16), np.float16),
        _DeviceLike(next(addr), (2, 1), i32),
        _DeviceLike(next(addr), (2, 1, 1, 5), i32),
        _DeviceLike(next(addr), (2, 1, 1, 4), i32),
        _DeviceLike(next(addr), (0,), np.float16),
        _DeviceLike(next(addr), (6, 8, 16), np.float16),
        _DeviceLike(next(addr), (2, 3), i32),
        _DeviceLike(next(addr), (2,), i32),
        _DeviceLike(next(addr), (2,), i32),
    ]
    status_ptr = args[3].__cuda_array_interface__["data"][0]
    out = _DeviceLike(status_ptr + 8, (2,), i32)
    with pytest.raises(
        ValueError,
        match=r"^out: expected memory separate from "
        r"selection_kv_block_status",
    ):
        ops.prepare_gather(*args, selection_topk_block_size=1, out=out)
    table_ptr = args[7].__cuda_array_interface__["data"][0]
    args[3] = _DeviceLike(table_ptr, (2, 1, 1, 5), i32)  # status on the table
    with pytest.raises(
        ValueError,
        match=r"^selection_kv_block_status: expected memory "
        r"separate from full_kv_block_table",
    ):
        ops.prepare_gather(*args, selection_topk_block_size=1)
