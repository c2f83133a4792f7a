"""Hand-computed cases of the GatherSelectionKvCache reference (docs/SPEC.md G).

Every full cache holds random non-zero bytes and every selection cache starts as the
all-zero sentinel, so a token that was copied and a token that was left alone are both
visible; data is compared byte for byte (``.view(np.uint8)``).
"""

from __future__ import annotations

import copy as copy_module
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from pytrt_kv.contract import specs
from pytrt_kv.contract.dtypes import numpy_dtype
from pytrt_kv.contract.gather import (
    GatherMeta,
    check_gather,
    check_gather_values,
    validate_gather,
)
from pytrt_kv.reference import gather_selection_kv_cache, plan_row
from support.gather_cases import I32, Case, base_case, make_case


def snapshot(case: Case) -> dict[str, np.ndarray]:
    return {k: v.copy() for k, v in case.args.items()}


def assert_args_equal(case: Case, before: dict[str, np.ndarray]) -> None:
    for name, x in before.items():
        y = case.args[name]
        assert y.shape == x.shape and y.dtype == x.dtype, name
        assert np.array_equal(y.view(np.uint8), x.view(np.uint8)), f"{name} was modified"


def assert_slot(case: Case, r: int, j: int, v: int, size: int) -> None:
    """Slot j of row r holds the current full-cache tokens of id v."""
    b = r // case.S
    for i in range(size):
        for got, want in zip(
            case.sel_token(r, j * case.tbs + i), case.full_token(b, v * case.tbs + i)
        ):
            assert np.array_equal(got, want), f"row {r} slot {j} token {i} (id {v})"


def assert_slot_bytes(
    case: Case, r: int, j: int, size: int, before: list[list[np.ndarray]]
) -> None:
    for i in range(size):
        for got, want in zip(case.sel_token(r, j * case.tbs + i), before[i]):
            assert np.array_equal(got, want), f"row {r} slot {j} token {i} changed"


def slot_bytes(case: Case, r: int, j: int, size: int) -> list[list[np.ndarray]]:
    return [case.sel_token(r, j * case.tbs + i) for i in range(size)]


def selection_bytes(case: Case) -> list[np.ndarray]:
    return [x.view(np.uint8).copy() for x in case._pair("selection")]


def changed_tokens(case: Case, before: list[np.ndarray]) -> int:
    """Number of selection-cache token rows whose bytes differ from ``before``."""
    diff = None
    for x, old in zip(case._pair("selection"), before):
        d = np.any(x.view(np.uint8) != old, axis=-1)
        diff = d if diff is None else diff | d
    return int(diff.sum())


# --- docs/SPEC.md G6 ---------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_g6_tbs1(rng, layout):
    # SBS = 3: the four slots span two selection blocks.
    case = make_case(
        rng, K=4, tbs=1, sbs=3, fbs=4, kv_lens=[10], f_max=3, layout=layout, topk=[[5, 9, 2, -1]]
    )
    out = case.call()
    assert out.dtype == I32 and out.tolist() == [3, 0]
    assert case.status_rows().tolist() == [[5, 9, 2, -1, 3]]
    for j, v in enumerate([5, 9, 2]):
        assert_slot(case, 0, j, v, 1)
    assert all(not t.any() for t in case.sel_token(0, 3)), "unused slot 3 was written"

    kept = {1: slot_bytes(case, 0, 1, 1), 2: slot_bytes(case, 0, 2, 1)}
    case.refresh_full(rng)
    before = selection_bytes(case)
    case.set_kv_lens([11])
    case.set_topk([[2, 7, 9, 1]])
    out = case.call()
    assert out.tolist() == [4, 0]
    assert case.status_rows().tolist() == [[7, 9, 2, 1, 4]]
    assert_slot(case, 0, 0, 7, 1)
    assert_slot(case, 0, 3, 1, 1)
    for j, old in kept.items():  # 9 and 2 keep their slots and their (old) bytes
        assert_slot_bytes(case, 0, j, 1, old)
    assert changed_tokens(case, before) == 2  # "only two tokens are copied"


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_g6_tbs4(rng, layout):
    case = make_case(
        rng, K=3, tbs=4, sbs=8, fbs=4, kv_lens=[10], f_max=3, layout=layout, topk=[[0, 2, 1]]
    )
    out = case.call()
    assert out.tolist() == [10, 0]
    assert case.status_rows().tolist() == [[0, 1, 2, 10]]
    assert_slot(case, 0, 0, 0, 4)
    assert_slot(case, 0, 1, 1, 4)
    assert_slot(case, 0, 2, 2, 2)  # slot 2 reserved for max_id 2 (partial: 2 tokens)
    for q in (10, 11):
        assert all(not t.any() for t in case.sel_token(0, q))

    slot0 = slot_bytes(case, 0, 0, 4)
    slot1_tail = case.sel_token(0, 7)
    case.refresh_full(rng)
    before = selection_bytes(case)
    case.set_kv_lens([11])
    case.set_topk([[2, 0, -1]])
    out = case.call()
    assert out.tolist() == [7, 0]
    assert case.status_rows().tolist() == [[0, 2, -1, 7]]
    assert_slot_bytes(case, 0, 0, 4, slot0)  # 0 stays, not copied
    assert_slot(case, 0, 1, 2, 3)  # 2 re-copied into the reserved slot 1, 3 tokens now
    for got, want in zip(case.sel_token(0, 7), slot1_tail):  # past size(2): untouched
        assert np.array_equal(got, want)
    assert changed_tokens(case, before) == 3


def test_g6_plan_row():
    p = plan_row([-1] * 5, [5, 9, 2, -1], 10, 1, 0, 1)
    assert p.status.tolist() == [5, 9, 2, -1, 3] and p.actual_seq == 3
    assert p.copy.tolist() == [True, True, True, False] and not p.skipped
    p = plan_row(p.status, [2, 7, 9, 1], 11, 1, 0, 1)
    assert p.status.tolist() == [7, 9, 2, 1, 4] and p.actual_seq == 4
    assert p.copy.tolist() == [True, False, False, True]
    p = plan_row([-1] * 4, [0, 2, 1], 10, 1, 0, 4)
    assert p.status.tolist() == [0, 1, 2, 10] and p.copy.tolist() == [True] * 3
    p = plan_row(p.status, [2, 0, -1], 11, 1, 0, 4)
    assert p.status.tolist() == [0, 2, -1, 7] and p.actual_seq == 7
    assert p.copy.tolist() == [False, True, False]


def test_plan_row_skipped_returns_old_status_unvalidated():
    corrupted = [-1, 4, -1, 7, 9]
    for kv_len, S, s in [(0, 1, 0), (-3, 1, 0), (2, 4, 0), (1, 3, 1)]:
        p = plan_row(corrupted, [0, 1, 0, 1], kv_len, S, s, 1)
        assert p.skipped and p.actual_seq == 0
        assert p.status.tolist() == corrupted and p.status.dtype == I32
        assert not p.copy.any()


@pytest.mark.parametrize(
    "old, topk, match",
    [
        ([3, -1, 4, -1, 2], [0, 1, 2, 3], "prefix"),
        ([3, 3, -1, -1, 2], [0, 1, 2, 3], "distinct ids"),
        ([-1] * 5, [1, 2, 1, -1], "distinct valid ids"),
    ],
)
def test_plan_row_raises(old, topk, match):
    with pytest.raises(ValueError, match=match):
        plan_row(old, topk, 8, 1, 0, 1)


# --- hand cases ----------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_multi_token_rows(rng, layout):
    """S = 3: query token s sees eff = kv_len - (S-1-s) tokens."""
    topk = [
        [6, 4, -1, 0],  # b0 s0: eff 5 -> 6 and... 6 dropped, valid [4, 0]
        [5, 6, 1, 2],  # b0 s1: eff 6 -> 6 dropped
        [6, 5, 4, 3],  # b0 s2: eff 7
        [0, 0, 0, 0],  # b1 s0: eff 0 -> skipped (duplicates never looked at)
        [1, 0, -1, 2],  # b1 s1: eff 1 -> valid [0]
        [-1, -1, 1, 0],
    ]  # b1 s2: eff 2
    status = [[-1] * 5] * 3 + [[-1, 5, -1, -1, 9]] + [[-1] * 5] * 2  # skipped row: junk
    case = make_case(
        rng,
        B=2,
        S=3,
        K=4,
        tbs=1,
        sbs=4,
        fbs=3,
        kv_lens=[7, 2],
        layout=layout,
        topk=topk,
        status=status,
        extra_rows=2,
    )
    out = case.call()
    assert out.tolist() == [2, 3, 4, 0, 1, 2, 0, 0]
    want = [
        [4, 0, -1, -1, 2],
        [5, 1, 2, -1, 3],
        [6, 5, 4, 3, 4],
        [-1, 5, -1, -1, 9],
        [0, -1, -1, -1, 1],
        [1, 0, -1, -1, 2],
    ]
    assert case.status_rows().tolist() == want
    for r, row in enumerate(want):
        if r == 3:
            for j in range(4):
                assert all(not t.any() for t in case.sel_token(r, j))
            continue
        for j, v in enumerate(row[:4]):
            if v >= 0:
                assert_slot(case, r, j, v, 1)


def test_recent_tokens_are_recopied(rng):
    """G5.2: an id touching the newest S positions is re-copied even if resident."""
    case = make_case(
        rng, S=2, K=3, tbs=1, sbs=2, fbs=4, kv_lens=[6], f_max=2, topk=[[4, 1, 0], [5, 4, 2]]
    )
    assert case.call().tolist() == [3, 3, 0]
    assert case.status_rows().tolist() == [[4, 1, 0, 3], [5, 4, 2, 3]]
    keep = {
        (0, 0): slot_bytes(case, 0, 0, 1),
        (0, 1): slot_bytes(case, 0, 1, 1),
        (1, 1): slot_bytes(case, 1, 1, 1),
    }
    # One speculative token rejected: kv_len grows by 1, positions [5, 7) were rewritten.
    case.refresh_full(rng)
    before = selection_bytes(case)
    case.set_kv_lens([7])
    case.set_topk([[4, 1, 5], [5, 4, 6]])
    assert case.call().tolist() == [3, 3, 0]
    assert case.status_rows().tolist() == [[4, 1, 5, 3], [5, 4, 6, 3]]
    for (r, j), old in keep.items():
        assert_slot_bytes(case, r, j, 1, old)
    assert_slot(case, 0, 2, 5, 1)
    assert_slot(case, 1, 0, 5, 1)  # 5 was resident in row 1 but is among the newest S
    assert_slot(case, 1, 2, 6, 1)
    assert changed_tokens(case, before) == 3


@pytest.mark.parametrize("tbs", [1, 2, 4, 16, 64])
@pytest.mark.parametrize("rope_dim", [0, 3])
def test_block_sizes(rng, tbs, rope_dim):
    """Odd multiples SBS = 3*TBS, FBS = 5*TBS; a partial last block when TBS > 1."""
    h = tbs // 2 if tbs > 1 else 1
    kv1 = 3 * tbs + h
    case = make_case(
        rng,
        K=4,
        tbs=tbs,
        sbs=3 * tbs,
        fbs=5 * tbs,
        rope_dim=rope_dim,
        dtype="int8" if rope_dim == 0 else "bfloat16",
        kv_lens=[kv1],
        topk=[[3, 0, -1, 2]],
        f_max=2,
    )
    out = case.call()
    if tbs == 1:
        want, sizes = [3, 0, 2, -1, 3], [1, 1, 1]
    else:  # max_id 3 is partial (h tokens) and takes the reserved slot n-1 = 2
        want, sizes = [0, 2, 3, -1, 2 * tbs + h], [tbs, tbs, h]
    assert case.status_rows().tolist() == [want] and out.tolist() == [want[-1], 0]
    for j, (v, size) in enumerate(zip(want[:3], sizes)):
        assert_slot(case, 0, j, v, size)
    # Dense prefix: selection positions [0, actual) are exactly the selected tokens.
    tokens = [t for v, size in zip(want[:3], sizes) for t in range(v * tbs, v * tbs + size)]
    for q, p in enumerate(tokens):
        for got, ref in zip(case.sel_token(0, q), case.full_token(0, p)):
            assert np.array_equal(got, ref)

    kept = {j: slot_bytes(case, 0, j, tbs) for j in (0, 1)}
    case.refresh_full(rng)
    before = selection_bytes(case)
    case.set_kv_lens([kv1 + 1])
    case.set_topk([[1, 2, 3, 0]])
    out = case.call()
    if tbs == 1:  # max_id 4 not selected; 3, 0, 2 keep slots 0..2
        want, copied = [3, 0, 2, 1, 4], {3: (1, 1)}
    else:  # old slot 2 was the partial tail; slot 3 reserved for max_id 3
        want, copied = [0, 2, 1, 3, kv1 + 1], {2: (1, tbs), 3: (3, h + 1)}
    assert case.status_rows().tolist() == [want] and out.tolist() == [want[-1], 0]
    for j, old in kept.items():
        assert_slot_bytes(case, 0, j, tbs, old)
    for j, (v, size) in copied.items():
        assert_slot(case, 0, j, v, size)
    assert changed_tokens(case, before) == sum(size for _, size in copied.values())


@pytest.mark.parametrize("dtype", specs.GATHER_CACHE_DTYPES)
@pytest.mark.parametrize("rope_dim", [0, 5])
def test_every_cache_dtype(rng, dtype, rope_dim):
    case = make_case(
        rng,
        B=2,
        K=5,
        tbs=1,
        sbs=3,
        fbs=2,
        kv_dim=7,
        rope_dim=rope_dim,
        dtype=dtype,
        kv_lens=[9, 4],
        topk=[[8, 0, 3, -1, 7], [3, 2, 1, 0, 9]],
    )
    before = selection_bytes(case)
    out = case.call()
    assert out.tolist() == [4, 4, 0]
    rows = case.status_rows().tolist()
    assert rows == [[8, 0, 3, 7, -1, 4], [3, 2, 1, 0, -1, 4]]
    for r, row in enumerate(rows):
        for j, v in enumerate(row[:4]):
            assert_slot(case, r, j, v, 1)
    assert changed_tokens(case, before) == 8
    assert case.args["selection_kv_cache"].dtype == numpy_dtype(dtype)


def test_padding_anywhere_and_ids_past_max_dropped(rng):
    case = make_case(
        rng, K=6, tbs=2, sbs=4, fbs=6, kv_lens=[9], topk=[[-1, 3, -7, 9, 0, 5]]
    )  # max_id 4: 9 and 5 dropped
    assert case.call().tolist() == [4, 0]
    assert case.status_rows().tolist() == [[3, 0, -1, -1, -1, -1, 4]]
    assert_slot(case, 0, 0, 3, 2)
    assert_slot(case, 0, 1, 0, 2)


def test_no_valid_ids_clears_row(rng):
    """A processed row whose topk holds no valid id ends with n = 0 (status all -1)."""
    case = make_case(rng, K=3, tbs=1, kv_lens=[4], f_max=2, topk=[[0, 1, 2]])
    case.call()
    before = selection_bytes(case)
    case.set_kv_lens([5])
    case.set_topk([[-1, 7, -1]])
    assert case.call().tolist() == [0, 0]
    assert case.status_rows().tolist() == [[-1, -1, -1, 0]]
    assert changed_tokens(case, before) == 0


@pytest.mark.parametrize("kv_lens", [[0, 5], [-4, 5]])
def test_skipped_rows_untouched(rng, kv_lens):
    status = [[2, 0, -1, 5], [-1, -1, -1, -1]]
    case = make_case(
        rng, B=2, K=3, tbs=1, kv_lens=kv_lens, topk=[[1, 0, 0], [4, 0, 1]], status=status
    )
    before = snapshot(case)
    out = case.call()
    assert out.tolist() == [0, 3, 0]
    assert case.status_rows().tolist()[0] == [2, 0, -1, 5]
    table = case.args["selection_kv_block_table"]
    for name in ("selection_kv_cache", "selection_k_rope"):
        assert np.array_equal(
            case.args[name][table[0]].view(np.uint8), before[name][table[0]].view(np.uint8)
        )


def test_rows_past_batch_get_zero(rng):
    case = make_case(rng, B=1, S=1, K=2, kv_lens=[3], topk=[[0, 2]], extra_rows=4)
    out = case.call()
    assert out.shape == (5,) and out.dtype == I32
    assert out.tolist() == [2, 0, 0, 0, 0]


def test_bsnd_and_tnd_agree(rng):
    topk = [[3, 1, -1, 8], [0, 2, 5, 6], [7, -1, 4, 1], [2, 3, 9, 0]]
    results = []
    for layout in ("BSND", "TND"):
        case = make_case(
            np.random.default_rng(5),
            B=2,
            S=2,
            K=4,
            tbs=1,
            sbs=3,
            fbs=5,
            kv_lens=[9, 7],
            layout=layout,
            topk=topk,
        )
        out = case.call()
        results.append(
            (out, case.status_rows().copy(), case.args["selection_kv_cache"].view(np.uint8).copy())
        )
    for a, b in zip(*results):
        assert np.array_equal(a, b)


def test_full_q_actual_seq_is_ignored(rng):
    outs = []
    for q in ([1, 2], [-9, 12345]):
        case = make_case(
            np.random.default_rng(3), B=2, K=3, kv_lens=[5, 6], topk=[[0, 4, 2], [5, 1, -1]]
        )
        case.args["full_q_actual_seq"][...] = q
        outs.append((case.call(), case.args["selection_kv_cache"].copy()))
    assert np.array_equal(outs[0][0], outs[1][0])
    assert np.array_equal(outs[0][1].view(np.uint8), outs[1][1].view(np.uint8))


def test_unused_table_entries_are_not_checked(rng):
    """Decision 4: only dereferenced table entries are range-checked."""
    case = make_case(
        rng, K=4, tbs=1, sbs=2, fbs=2, kv_lens=[5], f_max=4, topk=[[0, 1, -1, -1]], extra_sel_cols=1
    )
    case.args["full_kv_block_table"][0, 1:] = [-1, 999, -5]  # tokens 2.. are not read
    case.args["selection_kv_block_table"][0, 1:] = -1  # slots 2, 3 are not written
    assert case.call().tolist() == [2, 0]
    assert_slot(case, 0, 0, 0, 1)
    assert_slot(case, 0, 1, 1, 1)


def test_kept_ids_do_not_need_valid_full_table(rng):
    """A kept id is not read, so its full-table entry is not checked."""
    case = make_case(rng, K=2, tbs=1, sbs=2, fbs=2, kv_lens=[5], f_max=3, topk=[[0, 4]])
    case.call()
    case.set_kv_lens([6])
    case.args["full_kv_block_table"][0, 0] = -1  # token 0 (kept) lives there
    case.set_topk([[0, 5]])
    assert case.call().tolist() == [2, 0]
    assert case.status_rows().tolist() == [[0, 5, 2]]


def test_check_gather_meta(rng):
    case = make_case(
        rng,
        B=2,
        S=3,
        K=5,
        tbs=1,
        sbs=3,
        fbs=7,
        kv_dim=6,
        rope_dim=4,
        kv_lens=[9, 2],
        layout="TND",
        extra_rows=2,
    )
    meta = check_gather(**case.args, selection_topk_block_size=1)
    a = case.args
    assert meta == GatherMeta(
        cache_dtype="float16",
        layout="TND",
        batch=2,
        seq=3,
        heads=1,
        topk=5,
        tbs=1,
        rows=8,
        sel_block_num=a["selection_kv_cache"].shape[0],
        sel_block_size=3,
        sel_max_block_num=2,
        full_block_num=a["full_kv_cache"].shape[0],
        full_block_size=7,
        full_max_block_num=2,
        k_rope_dim=4,
        kv_dim=6,
    )


def test_check_gather_never_reads_values():
    """check_gather works on tensors without data (torch meta device)."""
    torch = pytest.importorskip("torch")

    def t(*shape, dtype=torch.int32):
        return torch.empty(*shape, dtype=dtype, device="meta")

    meta = check_gather(
        t(0, dtype=torch.bfloat16),
        t(10, 8, 16, dtype=torch.bfloat16),
        t(4, 4),
        t(4, 1, 33),
        t(4, 1, 32),
        t(0, dtype=torch.bfloat16),
        t(20, 16, 16, dtype=torch.bfloat16),
        t(2, 5),
        t(2),
        t(2),
        selection_topk_block_size=1,
    )
    assert (meta.layout, meta.batch, meta.seq, meta.topk, meta.k_rope_dim) == ("TND", 2, 2, 32, 0)
    assert meta.cache_dtype == "bfloat16"


def test_validate_gather_read_modes(rng):
    """Issue 21: one validate_gather for the reference ("numpy"), pytrt_kv.ops (a read-back
    function, called on the five index tensors only) and shape-only callers (None)."""
    case = make_case(rng, B=2, K=3, kv_lens=[4, 0], topk=[[3, 3, -1], [0, 1, 2]])
    a = case.args
    meta, plans = validate_gather(**a, selection_topk_block_size=1, read=None)
    assert (meta.batch, meta.topk, plans) == (2, 3, [])  # values never read
    with pytest.raises(TypeError, match="^place: expected the G5 placement"):
        validate_gather(**a, selection_topk_block_size=1)
    with pytest.raises(ValueError, match="^row 0 .*selection_topk_indices: expected distinct"):
        validate_gather(**a, selection_topk_block_size=1, place=plan_row)
    seen = []

    def read(x):
        seen.append(id(x))
        return np.array(x)

    good = dict(a, selection_topk_indices=np.array([3, 1, -1, 0, 1, 2], I32).reshape(2, 1, 1, 3))
    _, plans = validate_gather(**good, selection_topk_block_size=1, place=plan_row, read=read)
    assert [p.status.tolist() for p in plans] == [[3, 1, -1, 2], [-1, -1, -1, -1]]
    index = (
        "selection_kv_block_table",
        "selection_kv_block_status",
        "selection_topk_indices",
        "full_kv_block_table",
        "full_kv_actual_seq",
    )
    assert sorted(seen) == sorted(id(good[k]) for k in index)


def test_check_gather_values_returns_plans(rng):
    case = make_case(rng, B=2, K=3, kv_lens=[4, 0], topk=[[3, 1, -1], [0, 1, 2]])
    meta = check_gather(**case.args, selection_topk_block_size=1)
    a = case.args
    plans = check_gather_values(
        meta,
        selection_kv_block_table=a["selection_kv_block_table"],
        selection_kv_block_status=a["selection_kv_block_status"],
        selection_topk_indices=a["selection_topk_indices"],
        full_kv_block_table=a["full_kv_block_table"],
        full_kv_actual_seq=a["full_kv_actual_seq"],
        place=plan_row,
    )
    assert [p.status.tolist() for p in plans] == [[3, 1, -1, 2], [-1, -1, -1, -1]]
    assert [p.skipped for p in plans] == [False, True]


# --- validation: one rule per case; the refused call modifies nothing ----------------


def _set(name: str, value) -> Callable[[Case], None]:
    def mutate(case: Case) -> None:
        case.args[name] = value(case.args[name]) if callable(value) else value

    return mutate


def _status_row(r: int, row: Sequence[int]) -> Callable[[Case], None]:
    def mutate(case: Case) -> None:
        case.status_rows()[r] = row

    return mutate


def _topk_row(r: int, row: Sequence[int]) -> Callable[[Case], None]:
    def mutate(case: Case) -> None:
        a = case.args["selection_topk_indices"]
        a.reshape(case.B * case.S, case.K)[r] = row

    return mutate


def _tbs(value) -> Callable[[Case], None]:
    def mutate(case: Case) -> None:
        case.tbs = value

    return mutate


def _both(f, g):
    def mutate(case: Case) -> None:
        f(case)
        g(case)

    return mutate


def _cast(dtype):
    return lambda x: np.ones(x.shape, dtype)


class ShapedNotNumpy:
    """Has ``.shape`` and ``.dtype`` (passes check_gather) but is no numpy.ndarray."""

    def __init__(self, x: np.ndarray) -> None:
        self.shape, self.dtype = x.shape, x.dtype

    def __eq__(self, other) -> bool:
        return isinstance(other, ShapedNotNumpy) and (self.shape, self.dtype) == (
            other.shape,
            other.dtype,
        )


def _entry(name: str, index, value) -> Callable[[Case], None]:
    def mutate(case: Case) -> None:
        case.args[name][index] = value

    return mutate


def _full_entry_for_id(b: int, v: int, value: int) -> Callable[[Case], None]:
    def mutate(case: Case) -> None:
        case.args["full_kv_block_table"][b, v * case.tbs // case.fbs] = value

    return mutate


def _read_only(name: str) -> Callable[[Case], None]:
    def mutate(case: Case) -> None:
        case.args[name].flags.writeable = False

    return mutate


F16 = np.float16
RULES = [
    # (id, mutation, exception, fragment of the message naming the argument)
    (
        "not a tensor",
        _set("selection_kv_cache", lambda x: x.tolist()),
        TypeError,
        "selection_kv_cache",
    ),
    ("not numpy", _set("full_kv_actual_seq", ShapedNotNumpy), TypeError, "full_kv_actual_seq"),
    (
        "cache dtype not in G2",
        _both(
            _set("selection_kv_cache", _cast(np.int32)),
            _both(
                _set("selection_k_rope", _cast(np.int32)),
                _both(_set("full_kv_cache", _cast(np.int32)), _set("full_k_rope", _cast(np.int32))),
            ),
        ),
        TypeError,
        "selection_kv_cache",
    ),
    ("unknown dtype", _set("full_kv_cache", _cast(np.complex64)), TypeError, "full_kv_cache"),
    ("caches differ", _set("full_kv_cache", _cast(np.float32)), TypeError, "full_kv_cache"),
    (
        "rope dtype differs",
        _set("selection_k_rope", _cast(np.float32)),
        TypeError,
        "selection_k_rope",
    ),
    *[
        (f"int64 {n}", _set(n, _cast(np.int64)), TypeError, n)
        for n in (
            "selection_kv_block_table",
            "selection_kv_block_status",
            "selection_topk_indices",
            "full_kv_block_table",
            "full_kv_actual_seq",
            "full_q_actual_seq",
        )
    ],
    ("tbs float", _tbs(2.0), TypeError, "selection_topk_block_size"),
    ("tbs bool", _tbs(True), TypeError, "selection_topk_block_size"),
    ("tbs zero", _tbs(0), ValueError, "selection_topk_block_size"),
    ("SBS % TBS", _tbs(3), ValueError, "SBS = 4"),
    ("FBS % TBS", _tbs(4), ValueError, "FBS = 6"),
    # G2 as lifted by pytrt_kv: K <= 2048 for every TBS (no "TBS == 1 when K > 32").
    *[
        (
            name,
            _both(
                _tbs(tbs),
                _both(
                    _set(
                        "selection_topk_indices", lambda x: np.full(x.shape[:-1] + (2049,), -1, I32)
                    ),
                    _set(
                        "selection_kv_block_status",
                        lambda x: np.full(x.shape[:-1] + (2050,), -1, I32),
                    ),
                ),
            ),
            ValueError,
            "selection_topk_indices",
        )
        for name, tbs in (("K > 2048 with TBS 2", 2), ("K > 2048", 1))
    ],
    (
        "H != 1",
        _both(
            _set("selection_topk_indices", lambda x: np.concatenate([x, x], 2)),
            _set("selection_kv_block_status", lambda x: np.concatenate([x, x], 2)),
        ),
        ValueError,
        "selection_topk_indices",
    ),
    (
        "R < B*S",
        _set("selection_kv_block_table", lambda x: x[:3].copy()),
        ValueError,
        "selection_kv_block_table",
    ),
    (
        "S_MAX too small",
        _set("selection_kv_block_table", lambda x: x[:, :1].copy()),
        ValueError,
        "selection_kv_block_table",
    ),
    (
        "table rank",
        _set("selection_kv_block_table", lambda x: x.reshape(-1)),
        ValueError,
        "selection_kv_block_table",
    ),
    (
        "TND T % B",
        _both(
            _set("selection_topk_indices", lambda x: x.reshape(4, 1, 4)[:3].copy()),
            _set("selection_kv_block_status", lambda x: x.reshape(4, 1, 5)[:3].copy()),
        ),
        ValueError,
        "selection_topk_indices",
    ),
    (
        "layouts disagree",
        _set("selection_kv_block_status", lambda x: x.reshape(4, 1, 5)),
        ValueError,
        "selection_kv_block_status",
    ),
    (
        "status last dim",
        _set("selection_kv_block_status", lambda x: x[..., :4].copy()),
        ValueError,
        "selection_kv_block_status",
    ),
    (
        "topk rank",
        _set("selection_topk_indices", lambda x: x.reshape(4, 4)),
        ValueError,
        "selection_topk_indices",
    ),
    (
        "BSND B",
        _both(
            _set("selection_topk_indices", lambda x: x.reshape(1, 4, 1, 4)),
            _set("selection_kv_block_status", lambda x: x.reshape(1, 4, 1, 5)),
        ),
        ValueError,
        "selection_topk_indices",
    ),
    (
        "selection rope absent, full present",
        _set("selection_k_rope", lambda x: np.zeros((0,), F16)),
        ValueError,
        "selection_k_rope",
    ),
    (
        "full rope absent, selection present",
        _set("full_k_rope", lambda x: np.zeros((0,), F16)),
        ValueError,
        "full_k_rope",
    ),
    ("K_ROPE differs", _set("full_k_rope", lambda x: x[..., :1].copy()), ValueError, "full_k_rope"),
    (
        "rope blocks differ",
        _set("selection_k_rope", lambda x: x[:-1].copy()),
        ValueError,
        "selection_k_rope",
    ),
    ("KV differs", _set("full_kv_cache", lambda x: x[..., :2].copy()), ValueError, "full_kv_cache"),
    (
        "cache rank",
        _set("selection_kv_cache", lambda x: x.reshape(x.shape[0], -1)),
        ValueError,
        "selection_kv_cache",
    ),
    (
        "full_kv_actual_seq rank",
        _set("full_kv_actual_seq", lambda x: x.reshape(2, 1)),
        ValueError,
        "full_kv_actual_seq",
    ),
    (
        "full_q_actual_seq shape",
        _set("full_q_actual_seq", lambda x: x[:1].copy()),
        ValueError,
        "full_q_actual_seq",
    ),
    (
        "full table batch",
        _set("full_kv_block_table", lambda x: x[:1].copy()),
        ValueError,
        "full_kv_block_table",
    ),
    # value rules
    (
        "status not a prefix",
        _status_row(0, [0, -1, 1, -1, 4]),
        ValueError,
        "selection_kv_block_status",
    ),
    (
        "status duplicate id",
        _status_row(0, [1, 1, -1, -1, 4]),
        ValueError,
        "selection_kv_block_status",
    ),
    ("duplicate valid id", _topk_row(1, [4, 0, 4, -1]), ValueError, "selection_topk_indices"),
    (
        "kv_len past the full table",
        _entry("full_kv_actual_seq", 1, 13),
        ValueError,
        "full_kv_actual_seq[1]",
    ),
    ("full entry negative", _full_entry_for_id(0, 3, -1), ValueError, "full_kv_block_table[0, 1]"),
    (
        "full entry >= F_BLOCK_NUM",
        _full_entry_for_id(1, 2, 1000),
        ValueError,
        "full_kv_block_table[1, 0]",
    ),
    (
        "selection entry negative",
        _entry("selection_kv_block_table", (2, 0), -1),
        ValueError,
        "selection_kv_block_table[2, 0]",
    ),
    (
        "selection entry >= S_BLOCK_NUM",
        _entry("selection_kv_block_table", (1, 1), 1000),
        ValueError,
        "selection_kv_block_table[1, 1]",
    ),
    (
        "selection write collision",
        lambda c: c.args["selection_kv_block_table"].__setitem__(
            (3, 0), c.args["selection_kv_block_table"][1, 0]
        ),
        ValueError,
        "selection_kv_block_table",
    ),
    (
        "read-only selection cache",
        _read_only("selection_kv_cache"),
        ValueError,
        "selection_kv_cache",
    ),
    (
        "read-only status",
        _read_only("selection_kv_block_status"),
        ValueError,
        "selection_kv_block_status",
    ),
    ("read-only rope", _read_only("selection_k_rope"), ValueError, "selection_k_rope"),
]


def test_base_case_is_valid(rng):
    case = base_case(rng)
    out = case.call()
    # Row 0: eff 8 (kv 9, S 2, s 0), max_id 3, ids [0, 3, 1]: 0 and 1 stay in slots 0
    # and 1, max_id 3 takes the reserved slot n-1 = 2. Other rows are fresh: max_id
    # (when selected) goes last, the rest in topk order.
    assert case.status_rows().tolist() == [
        [0, 1, 3, -1, 6],
        [0, 2, 4, -1, 5],
        [1, 0, 2, -1, 5],
        [0, 2, -1, -1, 4],
    ]
    assert out.tolist() == [6, 5, 5, 4, 0]


@pytest.mark.parametrize("mutate, exc, fragment", [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_validation_rule(rng, mutate, exc, fragment):
    case = base_case(rng)
    mutate(case)
    before = {k: copy_module.deepcopy(v) for k, v in case.args.items()}
    with pytest.raises(exc) as info:
        case.call()
    message = str(info.value)
    assert fragment in message
    assert "expected" in message and "got" in message
    for name, old in before.items():
        new = case.args[name]
        if isinstance(old, np.ndarray):
            assert new.shape == old.shape and new.dtype == old.dtype
            assert np.array_equal(new.view(np.uint8), old.view(np.uint8)), name
        else:
            assert new == old, name


def test_skipped_row_is_not_value_checked(rng):
    """Decision 1: a skipped row may hold a corrupted status and duplicate ids."""
    case = base_case(rng, kv_lens=[9, 0])
    case.status_rows()[2] = [-1, 3, -1, 3, 7]
    case.args["selection_topk_indices"].reshape(4, 4)[3] = [1, 1, 1, 1]
    case.args["selection_kv_block_table"][2:4] = -7
    out = case.call()
    assert out.tolist()[2:] == [0, 0, 0]
    assert case.status_rows()[2].tolist() == [-1, 3, -1, 3, 7]


def test_repeated_padding_and_dropped_ids_are_not_duplicates(rng):
    case = base_case(rng)
    case.args["selection_topk_indices"].reshape(4, 4)[1] = [-1, 9, -1, 9]
    case.call()
    assert case.status_rows()[1].tolist() == [-1] * 4 + [0]


def test_k_over_32_with_tbs_1_is_valid(rng):
    case = make_case(rng, K=33, tbs=1, sbs=8, fbs=8, kv_lens=[40], topk=[list(range(39, 6, -1))])
    assert case.call().tolist() == [33, 0]


@pytest.mark.parametrize(
    "K,tbs,sbs,fbs,tail", [(33, 2, 4, 6, 1), (40, 4, 8, 8, 2), (190, 128, 128, 256, 5)]
)
def test_k_over_32_with_tbs_over_1_is_valid(rng, K, tbs, sbs, fbs, tail):
    """docs/SPEC.md G2: pytrt_kv accepts any TBS with K <= 2048 (retrieval recalls ~190
    blocks of 128 tokens at 128K); the row gets every selected block, in two steps."""
    kv_len = (K - 1) * tbs + tail  # max_id = K-1 holds `tail` tokens
    order = list(rng.permutation(K))
    case = make_case(
        rng, K=K, tbs=tbs, sbs=sbs, fbs=fbs, kv_lens=[kv_len], rope_dim=0, topk=[order]
    )
    assert case.call().tolist() == [kv_len, 0]
    status = case.status_rows()[0]
    assert status[K - 1] == K - 1 and status[K] == kv_len  # max_id in the reserved slot
    assert sorted(status[:K].tolist()) == list(range(K))
    for j, v in enumerate(status[: K - 1].tolist()):
        assert_slot(case, 0, j, v, tbs)
    assert_slot(case, 0, K - 1, K - 1, tail)
    before = selection_bytes(case)
    case.set_kv_lens([kv_len + 1])  # one new token: only the tail block is copied again
    case.set_topk([order])
    assert case.call().tolist() == [kv_len + 1, 0]
    assert changed_tokens(case, before) <= tail + 1


def test_old_partial_tail_is_recopied(rng):
    """G5.1/G5.2: the old row's partial tail slot never keeps its id."""
    case = make_case(rng, K=3, tbs=4, sbs=4, fbs=8, kv_lens=[10], f_max=3, topk=[[0, 2, -1]])
    assert case.call().tolist() == [6, 0]
    assert case.status_rows().tolist() == [[0, 2, -1, 6]]  # slot 1 holds 2 of id 2's 4
    slot0 = slot_bytes(case, 0, 0, 4)
    case.refresh_full(rng)
    before = selection_bytes(case)
    case.set_kv_lens([20])  # max_id 4 is not selected: no reserved slot this time
    case.set_topk([[0, 2, -1]])
    assert case.call().tolist() == [8, 0]
    assert case.status_rows().tolist() == [[0, 2, -1, 8]]
    assert_slot_bytes(case, 0, 0, 4, slot0)
    assert_slot(case, 0, 1, 2, 4)
    assert changed_tokens(case, before) == 4


def test_resident_id_in_reserved_slot_moves(rng):
    """G5.2/G5.3: an id resident in slot n-1 yields it to max_id and is re-copied."""
    case = make_case(rng, K=3, tbs=2, sbs=2, fbs=4, kv_lens=[6], f_max=3, topk=[[0, 1, 2]])
    assert case.call().tolist() == [6, 0]
    assert case.status_rows().tolist() == [[0, 1, 2, 6]]
    case.refresh_full(rng)
    before = selection_bytes(case)
    case.set_kv_lens([9])  # max_id 4 (1 token)
    case.set_topk([[1, 4, -1]])
    assert case.call().tolist() == [3, 0]
    assert case.status_rows().tolist() == [[1, 4, -1, 3]]
    assert_slot(case, 0, 0, 1, 2)
    assert_slot(case, 0, 1, 4, 1)
    assert changed_tokens(case, before) == 3


@pytest.mark.parametrize("batch,seq,layout", [(0, 1, "BSND"), (2, 0, "BSND"), (0, 0, "TND")])
def test_empty_batch_reads_and_writes_nothing(batch, seq, layout):
    """B*S == 0 (docs/SPEC.md G2): an empty batch succeeds like the kernels and plugins do
    (TensorRT may hand a plugin an empty dynamic batch): output zeros, nothing written."""
    rng = np.random.default_rng(batch * 10 + seq)
    K, rows = 4, 3
    lead = (batch, seq, 1) if layout == "BSND" else (batch * seq, 1)
    sel = rng.standard_normal((4, 4, 8)).astype(np.float16)
    status = np.full(lead + (K + 1,), 7, np.int32)
    before = sel.copy()
    out = gather_selection_kv_cache(
        np.zeros(0, np.float16),
        sel,
        rng.integers(0, 4, (rows, 4)).astype(np.int32),
        status,
        rng.integers(0, 9, lead + (K,)).astype(np.int32),
        np.zeros(0, np.float16),
        rng.standard_normal((4, 4, 8)).astype(np.float16),
        np.zeros((batch, 4), np.int32),
        np.full(batch, 5, np.int32),
        np.zeros(batch, np.int32),
        selection_topk_block_size=1,
    )
    assert out.tolist() == [0] * rows
    assert np.array_equal(sel.view(np.uint16), before.view(np.uint16))
    assert (status == 7).all()


def test_empty_tnd_batch_needs_no_token_rows():
    with pytest.raises(ValueError, match=r"selection_topk_indices: expected TND \[T = 0"):
        gather_selection_kv_cache(
            np.zeros(0, np.float16),
            np.zeros((4, 4, 8), np.float16),
            np.zeros((2, 4), np.int32),
            np.full((2, 1, 5), -1, np.int32),
            np.zeros((2, 1, 4), np.int32),
            np.zeros(0, np.float16),
            np.ones((4, 4, 8), np.float16),
            np.zeros((0, 4), np.int32),
            np.zeros(0, np.int32),
            np.zeros(0, np.int32),
            selection_topk_block_size=1,
        )


def test_topk_times_tbs_over_int32_is_refused():
    """K*TBS > 2^31-1 cannot be a row's int32 token count (docs/SPEC.md G2); K*TBS at the
    limit's side passes this rule."""
    from pytrt_kv.contract.gather import check_gather

    def call(topk, tbs):
        i32, f16 = np.int32, np.float16
        sel = np.zeros((0, tbs, 8), f16)
        return check_gather(
            sel, np.zeros((0, tbs, 16), f16),
            np.zeros((1, -(-topk * tbs // tbs)), i32),
            np.zeros((1, 1, 1, topk + 1), i32), np.zeros((1, 1, 1, topk), i32),
            sel, np.zeros((0, tbs, 16), f16),
            np.zeros((1, 1), i32), np.zeros(1, i32), np.zeros(1, i32),
            selection_topk_block_size=tbs,
        )  # fmt: skip

    with pytest.raises(ValueError, match=r"selection_topk_block_size: expected K\*TBS"):
        call(2048, 1 << 20)
    assert call(2047, 1 << 20).topk == 2047
