"""The "lowrank" block scores (work in progress, issue 35; docs/RETRIEVAL.md "On a GPU:
low-rank keys find what the oracle finds"): the NumPy reference equals the study's
``lowrank32_cal`` (the method the study measured), and the ONNX subgraphs the graphs will
use equal the reference."""

from __future__ import annotations

import numpy as np
import pytest
from test_retrieval import _tiny_builder

from pytrt_kv.retrieval import RetrievalConfig
from pytrt_kv.retrieval.reference import lowrank_representations, lowrank_scores


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
    op, const, run = _tiny_builder()
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

    op, const, run = _tiny_builder()
    out = add_lowrank_block_representations(op, const, "pages", "valid", basis=basis)
    valid = np.ones((1, nb, B, 1), bool)
    valid[0, -1] = False  # an empty page
    got = run(out, {"pages": keys.reshape(1, nb, B, hkv * d), "valid": valid}, rank=3)
    np.testing.assert_allclose(got[0, :-1], want[:-1], rtol=1e-5, atol=1e-6)
    assert not got[0, -1].any()

    op, const, run = _tiny_builder()
    out = add_lowrank_update(op, const, "cur", "key", "slot", basis=basis, block_size=B)
    row = np.full((1, B * hkv * r), 99.0, np.float32)  # stale: slot 0 must clear it
    for i in range(B):
        slot = np.array([[i]], np.int64)
        row = run(out, {"cur": row, "key": keys[B + i].reshape(1, -1), "slot": slot})
        if i == 0:
            assert not row[0, hkv * r :].any()  # the rest of a started block: zeros
    np.testing.assert_allclose(row[0], want[1], rtol=1e-5, atol=1e-6)
