"""The "lowrank" representation (docs/SPEC.md R5, the default; docs/RETRIEVAL.md "On a
GPU: low-rank keys find what the oracle finds" and "A basis fixed per model is as good"):
the calibrated basis, the NumPy reference (equal to the study's ``lowrank32_cal``, the
method the study measured), the ONNX subgraphs (equal to the reference), the refusals of
a missing or misshapen basis, and a needle that "lowrank" finds and "mean" does not. The
tests parametrized over every representation (reference, planner, decode step) are in
test_retrieval.py."""

from __future__ import annotations

import numpy as np
import pytest

from onnx_export.retrieval import build_retrieval_decode_step
from pytrt_kv.cli.retrieval_demo import cpu_runner
from pytrt_kv.retrieval import (
    LOWRANK,
    MEAN,
    RetrievalConfig,
    block_representations,
    calibrate_basis,
    score_blocks,
    sparse_decode_attention,
)
from pytrt_kv.retrieval.demo import run_steps
from pytrt_kv.retrieval.planner import RetrievalPlanner, RetrievalSizes
from pytrt_kv.retrieval.reference import (
    lowrank_representations,
    lowrank_scores,
    representation_width,
)
from support.models import SMALL_RETRIEVAL
from support.onnx_builder import tiny_builder


def _basis(rng, hkv: int, d: int, r: int) -> np.ndarray:
    """Orthonormal columns per KV head, as a calibration's SVD gives."""
    q, _ = np.linalg.qr(rng.standard_normal((hkv, d, d)))
    return q[..., :r].astype(np.float32)


def test_reference_equals_the_study_method(rng):
    """``lowrank_scores`` of ``lowrank_representations`` is the study's ``lowrank32_cal``
    score (torch) for the same basis, row by row; a KV head 10x larger keeps its weight
    per query head (a per-head mistake would show)."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from pytrt_kv.retrieval.study.scores import selector_scores

    hkv, g, d, B = 3, 2, 64, 8
    keys = rng.standard_normal((2 * B + 8 * B + 4 * B, hkv, d)).astype(np.float32)
    keys[:, 1] *= 10
    q = rng.standard_normal((hkv * g, d)).astype(np.float32)
    basis = _basis(rng, hkv, d, 32)
    cfg = RetrievalConfig(init_tokens=2 * B, local_tokens=4 * B, block_size=B)
    part = cfg.partition(keys.shape[0])
    got = lowrank_scores(q, lowrank_representations(keys, part, basis), basis, B, scale=0.125)
    study_cfg = SimpleNamespace(block_size=B, init_tokens=2 * B, local_tokens=4 * B)
    kt = torch.from_numpy(keys).permute(1, 0, 2).contiguous()  # [Hkv, L, D]
    qt = torch.from_numpy(q)[:, None]  # [Hq, 1, D]
    valid = torch.ones(1, part.num_blocks, dtype=torch.bool)
    extra = {"basis": {"post": torch.from_numpy(basis)}, "inv_freq": None}
    want = selector_scores(
        "lowrank32_cal", study_cfg, qt, kt, None, None, valid, g, 0.125, 0, {}, extra
    )[0].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    assert np.isclose(got.sum(), hkv * g, rtol=1e-5)  # a softmax per query head


def test_reference_refuses_what_does_not_fit(rng):
    basis = _basis(rng, 3, 8, 4)
    part = RetrievalConfig(init_tokens=8, local_tokens=8, block_size=8).partition(40)
    with pytest.raises(ValueError, match=r"^basis: expected shape \[3, 8, r\]"):
        lowrank_representations(np.zeros((40, 3, 8), np.float32), part, basis[:2])
    with pytest.raises(ValueError, match=r"^keys: expected at least"):
        lowrank_representations(np.zeros((20, 3, 8), np.float32), part, basis)
    with pytest.raises(ValueError, match=r"^reps: expected shape \[nb, 96\] for lowrank"):
        lowrank_scores(np.zeros((6, 8)), np.zeros((3, 95)), basis, 8)
    with pytest.raises(ValueError, match=r"^q: expected Hq a multiple"):
        lowrank_scores(np.zeros((4, 8)), np.zeros((3, 96)), basis, 8)


def test_scores_subgraph_equals_reference(rng):
    """``add_lowrank_scores`` (onnx.helper builder, ONNX reference evaluator) equals
    ``lowrank_scores`` on each row's retrievable blocks."""
    from onnx_export.retrieval import add_lowrank_scores

    hkv, g, d, B, r = 3, 2, 8, 4, 4
    basis = _basis(rng, hkv, d, r)
    cfg = RetrievalConfig(init_tokens=B, local_tokens=2 * B, block_size=B)
    keys = rng.standard_normal((2, 12 * B, hkv, d)).astype(np.float32)
    keys[:, :, 1] *= 10
    part = cfg.partition(12 * B)
    reps = np.stack([lowrank_representations(k, part, basis) for k in keys])
    q = rng.standard_normal((2, hkv * g, d)).astype(np.float32)
    valid = np.arange(part.num_blocks)[None] < np.array([[part.num_blocks], [5]])
    op, const, run = tiny_builder()
    out = add_lowrank_scores(
        op, const, "reps", "query", basis=basis, block_size=B, q_heads=hkv * g, scale=0.4,
        valid="valid",
    )  # fmt: skip
    got = run(out, {"reps": reps, "query": q, "valid": valid})
    for b, nb in enumerate((part.num_blocks, 5)):
        want = lowrank_scores(q[b], reps[b, :nb], basis, B, scale=0.4)
        np.testing.assert_allclose(got[b, :nb], want, rtol=2e-5, atol=1e-6, err_msg=f"row {b}")
    with pytest.raises(ValueError, match=r"^basis: expected shape \[Hkv, D, r\]"):
        add_lowrank_scores(
            op, const, "r", "q", basis=basis, block_size=B, q_heads=4, scale=1.0, valid="v"
        )


def test_block_representations_and_update_subgraphs_equal_reference(rng):
    """``add_lowrank_block_representations`` over pages (the prefill's way) and
    ``add_lowrank_update`` fed a block's keys one by one over a stale row (the decode
    step's way) both end at ``lowrank_representations``; a page without keys gives
    zeros."""
    from onnx_export.retrieval import add_lowrank_block_representations, add_lowrank_update

    hkv, d, B, r, nb = 3, 8, 4, 4, 5
    basis = _basis(rng, hkv, d, r)
    keys = rng.standard_normal((nb * B, hkv, d)).astype(np.float32)
    part = RetrievalConfig(init_tokens=0, local_tokens=1, block_size=B).partition(nb * B + 1)
    want = lowrank_representations(keys, part, basis)

    op, const, run = tiny_builder()
    out = add_lowrank_block_representations(op, const, "pages", "valid", basis=basis)
    valid = np.ones((1, nb, B, 1), bool)
    valid[0, -1] = False  # an empty page
    got = run(out, {"pages": keys.reshape(1, nb, B, hkv * d), "valid": valid}, rank=3)
    np.testing.assert_allclose(got[0, :-1], want[:-1], rtol=1e-5, atol=1e-6)
    assert not got[0, -1].any()

    op, const, run = tiny_builder()
    out = add_lowrank_update(op, const, "cur", "key", "slot", basis=basis, block_size=B)
    row = np.full((1, B * hkv * r), 99.0, np.float32)  # stale: slot 0 must clear it
    for i in range(B):
        slot = np.array([[i]], np.int64)
        row = run(out, {"cur": row, "key": keys[B + i].reshape(1, -1), "slot": slot})
        if i == 0:
            assert not row[0, hkv * r :].any()  # the rest of a started block: zeros
    np.testing.assert_allclose(row[0], want[1], rtol=1e-5, atol=1e-6)


# --- the basis -------------------------------------------------------------------------


def test_calibrate_basis_is_the_top_singular_subspace(rng):
    """Per KV head, orthonormal columns spanning the keys' top directions (here planted:
    3 directions of large spread per head, another 3 for the other head)."""
    hkv, d, n = 2, 16, 400
    keys = 0.01 * rng.standard_normal((n, hkv, d))
    planted = [np.linalg.qr(rng.standard_normal((d, 3)))[0] for _ in range(hkv)]
    for g in range(hkv):
        keys[:, g] += rng.standard_normal((n, 3)) * [9.0, 6.0, 4.0] @ planted[g].T
    basis = calibrate_basis(keys.astype(np.float32), 3)
    assert basis.shape == (hkv, d, 3) and basis.dtype == np.float32
    for g in range(hkv):
        np.testing.assert_allclose(basis[g].T @ basis[g], np.eye(3), atol=1e-6)
        # Same subspace: the projector of one onto the other's columns keeps them.
        proj = basis[g] @ basis[g].T
        np.testing.assert_allclose(proj @ planted[g], planted[g], atol=1e-3)


@pytest.mark.parametrize(
    "shape, rank, fragment",
    [
        ((64, 2, 8), 9, r"^rank: expected <= head_dim D = 8, got 9"),
        ((5, 2, 8), 6, r"^rank: expected <= the 5 calibration keys, got 6"),
        ((64, 2, 8), 0, r"^rank: expected an int >= 1"),
        ((64, 16), 4, r"^keys: expected shape \[N, Hkv, D\]"),
    ],
)
def test_calibrate_basis_refuses_by_name(shape, rank, fragment):
    with pytest.raises(ValueError, match=fragment):
        calibrate_basis(np.ones(shape, np.float32), rank)


def test_representation_width_of_lowrank():
    assert representation_width(LOWRANK, 2, 16, block_size=32, rank=8) == 32 * 2 * 8
    assert representation_width(MEAN, 2, 16) == 32  # block_size, rank: lowrank only
    with pytest.raises(ValueError, match="^block_size: expected an int >= 1 for 'lowrank'"):
        representation_width(LOWRANK, 2, 16, rank=8)
    with pytest.raises(ValueError, match="^rank: expected an int >= 1 for 'lowrank'"):
        representation_width(LOWRANK, 2, 16, block_size=32)


# --- refusals: no basis, a basis of another shape, a rank larger than the head ----------

SIZES = RetrievalSizes(batch=1, q_heads=4, kv_heads=2, head_dim=16, max_len=1024)
CFG = RetrievalConfig(**SMALL_RETRIEVAL, rank=8)  # "lowrank", the default


def test_missing_basis_is_refused_by_name(rng):
    """No silent fallback to another representation: every layer names ``basis``."""
    assert CFG.representation == LOWRANK
    keys = rng.standard_normal((700, 2, 16)).astype(np.float32)
    q = rng.standard_normal((4, 16)).astype(np.float32)
    part = CFG.partition(700)
    reps = block_representations(keys, part, LOWRANK, basis=calibrate_basis(keys, 8))
    no_basis = r"^basis: expected a \[2, 16, 8\] array for 'lowrank'"
    with pytest.raises(ValueError, match=r"^basis: expected a \[Hkv, D, r\] array"):
        block_representations(keys, part, LOWRANK)
    with pytest.raises(ValueError, match=r"^basis: expected a \[2, 16, r\] array"):
        score_blocks(q, reps, LOWRANK, 2)
    with pytest.raises(ValueError, match=no_basis):
        sparse_decode_attention(q, keys, keys, CFG)
    with pytest.raises(ValueError, match=no_basis):
        sparse_decode_attention(q, keys, keys, CFG, reps=reps)  # scoring needs it too
    with pytest.raises(ValueError, match=no_basis):
        RetrievalPlanner(CFG, SIZES)
    with pytest.raises(ValueError, match=no_basis):
        build_retrieval_decode_step(SIZES, CFG)
    with pytest.raises(ValueError, match=no_basis):
        run_steps(CFG, SIZES, [700], 1, run=lambda feeds: {})
    nan = calibrate_basis(keys, 8)
    nan[1, 3, 2] = np.nan  # a basis with a NaN would score every block NaN
    for call in (
        lambda: block_representations(keys, part, LOWRANK, basis=nan),
        lambda: RetrievalPlanner(CFG, SIZES, basis=nan),
        lambda: build_retrieval_decode_step(SIZES, CFG, basis=nan),
    ):
        with pytest.raises(ValueError, match=r"^basis: expected finite values, got NaN or inf"):
            call()


@pytest.mark.parametrize(
    "shape, want",
    [
        ((2, 16, 4), r"\[2, 16, 8\], got \[2, 16, 4\]"),  # another rank than cfg.rank
        ((1, 16, 8), r"\[2, 16, 8\], got \[1, 16, 8\]"),  # another number of KV heads
        ((2, 8, 8), r"\[2, 16, 8\], got \[2, 8, 8\]"),  # another head size
        ((16, 8), r"\[2, 16, 8\], got \[16, 8\]"),
    ],
)
def test_misshapen_basis_is_refused_by_name(rng, shape, want):
    basis = np.zeros(shape, np.float32)
    keys = rng.standard_normal((700, 2, 16)).astype(np.float32)
    q = rng.standard_normal((4, 16)).astype(np.float32)
    match = r"^basis: expected shape " + want
    with pytest.raises(ValueError, match=match):
        sparse_decode_attention(q, keys, keys, CFG, basis=basis)
    with pytest.raises(ValueError, match=match):
        RetrievalPlanner(CFG, SIZES, basis=basis)
    with pytest.raises(ValueError, match=match):
        build_retrieval_decode_step(SIZES, CFG, basis=basis)


def test_rank_larger_than_the_head_is_refused():
    cfg = CFG.with_(rank=17)
    want = r"^rank: expected <= head_dim = 16 for 'lowrank'.*got 17"
    with pytest.raises(ValueError, match=want):
        SIZES.validate(cfg)
    with pytest.raises(ValueError, match=want):
        RetrievalPlanner(cfg, SIZES, basis=np.zeros((2, 16, 17), np.float32))
    with pytest.raises(ValueError, match=want):
        build_retrieval_decode_step(SIZES, cfg, basis=np.zeros((2, 16, 17), np.float32))
    SIZES.validate(cfg.with_(representation=MEAN))  # the rank is lowrank's only


# --- a needle: lowrank finds the block, mean does not ----------------------------------


def _needle_case(rng):
    """One sequence of 904 tokens (20 retrievable blocks of 32, one recalled), keys mostly
    small noise. Block 7 holds one needle key along the query (8x its direction) among
    31 keys pointing the other way (its mean points away from the query); block 12 is a
    decoy whose every key leans slightly toward the query (the largest mean). The basis
    is calibrated on other keys, whose largest spread is along the query's direction."""
    L, D, needle, decoy = 904, 16, 7, 12
    keys = 0.1 * rng.standard_normal((L, 1, D)).astype(np.float32)
    start = 64 + 32 * needle
    keys[start : start + 32, 0, 0] = -0.5
    keys[start + 10, 0, 0] = 8.0
    keys[64 + 32 * decoy : 64 + 32 * decoy + 32, 0, 0] = 0.3
    values = rng.standard_normal((L, 1, D)).astype(np.float32)
    q = np.zeros((2, D), np.float32)
    q[:, 0] = 4.0
    spread = np.r_[5.0, np.ones(D - 1)]
    cal = np.random.default_rng(5).standard_normal((512, 1, D)) * spread
    return keys, values, q, calibrate_basis(cal, 4), needle, decoy


def _step_selection(cfg, sizes, keys, values, q, basis) -> list[int]:
    """The blocks j the ONNX decode step (CPU runtime) recalls for the last token."""
    pl = RetrievalPlanner(cfg, sizes, basis=basis)
    caches = pl.empty_caches()
    pl.start(0, keys[:-1], values[:-1], caches)
    feeds = pl.step_feeds(caches["full_key_cache"])
    feeds.update(caches)
    feeds.update(query=q[None], key=keys[-1:], value=values[-1:])
    ids = cpu_runner(cfg, sizes, basis)(feeds)["topk_indices"].reshape(-1)
    lay = pl.layout
    picked = ids[lay.init_blocks : lay.init_blocks + lay.max_selected]
    return [int(i) - lay.first_id for i in picked if i >= 0]


def test_lowrank_step_finds_a_needle_that_mean_misses(rng):
    """The decode step with "lowrank" recalls the needle's block, with "mean" the decoy
    (the same data, the same budget of one block): the representations really select
    differently, each as its NumPy reference does."""
    keys, values, q, basis, needle, decoy = _needle_case(rng)
    sizes = RetrievalSizes(batch=1, q_heads=2, kv_heads=1, head_dim=16, max_len=1024)
    picked = {}
    for rep in (LOWRANK, MEAN):
        cfg = RetrievalConfig(
            **dict(SMALL_RETRIEVAL, dense_boundary=0), topk_percent=0.05, rank=4,
            representation=rep,
        )  # fmt: skip
        ref = sparse_decode_attention(q, keys, values, cfg, basis=basis)
        assert ref.partition.num_blocks == 20 and len(ref.selected) == 1
        picked[rep] = _step_selection(cfg, sizes, keys, values, q, basis)
        assert picked[rep] == ref.selected.tolist(), rep
    assert picked == {LOWRANK: [needle], MEAN: [decoy]}
