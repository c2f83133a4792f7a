"""The "lowrank" representation's configuration and its basis calibrated on a model
(docs/SPEC.md R1, R5; ``pytrt_kv.retrieval.study.calibration``)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from pytrt_kv.retrieval import RetrievalConfig
from pytrt_kv.retrieval.config import LOWRANK, REPRESENTATIONS


def test_lowrank_is_the_default_with_rank_32():
    cfg = RetrievalConfig()
    assert cfg.representation == LOWRANK == REPRESENTATIONS[0] and cfg.rank == 32


@pytest.mark.parametrize(
    "rank, err, match",
    [
        (0, ValueError, r"^rank: expected >= 1, got 0"),
        (2.0, TypeError, r"^rank: expected an int, got 2.0"),
        (True, TypeError, r"^rank: expected an int, got True"),
    ],
)
def test_rank_is_checked_by_name(rank, err, match):
    with pytest.raises(err, match=match):
        RetrievalConfig(rank=rank)


def test_rank_and_representation_from_the_environment():
    env = {"VLLM_RETRIEVAL_LOWRANK_RANK": "16", "VLLM_RETRIEVAL_REPRESENTATION": "LowRank"}
    cfg = RetrievalConfig.from_env(env)
    assert (cfg.representation, cfg.rank) == ("lowrank", 16)
    with pytest.raises(ValueError, match=r"^VLLM_RETRIEVAL_LOWRANK_RANK: expected a token count"):
        RetrievalConfig.from_env({"VLLM_RETRIEVAL_LOWRANK_RANK": "many"})
    with pytest.raises(ValueError, match=r"^VLLM_RETRIEVAL_LOWRANK_RANK \(rank: expected >= 1"):
        RetrievalConfig.from_env({"VLLM_RETRIEVAL_LOWRANK_RANK": "0"})


_NO_TORCH = (
    importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None
)


@pytest.mark.skipif(_NO_TORCH, reason="torch and transformers are not installed (extra 'study')")
def test_calibrated_basis_is_the_top_singular_vectors_of_the_keys():
    """``calibrate_lowrank``: per layer the top-r right singular vectors of the layer's
    post-RoPE keys after ``skip`` tokens (checked against keys recomputed by transformers'
    own cache), orthonormal; the model's attention implementation comes back; the study
    state holds the same basis; bad arguments are refused by name."""
    import torch
    from transformers import DynamicCache

    from pytrt_kv.retrieval.study import attention_state
    from pytrt_kv.retrieval.study.calibration import calibrate_lowrank
    from support.tiny_models import tiny_model

    model = tiny_model("LlamaConfig")
    before = model.config._attn_implementation
    ids = np.random.default_rng(1).integers(3, model.config.vocab_size, 96)
    basis = calibrate_lowrank(model, ids, rank=4, skip=16)
    assert model.config._attn_implementation == before
    cfg = model.config
    hkv, d = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    assert len(basis) == cfg.num_hidden_layers
    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    st = attention_state(model)
    for i, b in enumerate(basis):
        assert b.shape == (hkv, d, 4) and b.dtype == np.float32
        np.testing.assert_allclose(
            np.einsum("hdr,hds->hrs", b, b), np.eye(4)[None].repeat(hkv, 0), atol=1e-5
        )
        keys = cache.layers[i].keys[0, :, 16:].float().numpy()  # [Hkv, L - skip, D]
        for h in range(hkv):
            v = np.linalg.svd(keys[h].astype(np.float64), full_matrices=False)[2][:4].T
            # The same subspace (signs and order within equal values may differ).
            np.testing.assert_allclose(b[h] @ b[h].T, v @ v.T, atol=1e-4)
        np.testing.assert_array_equal(st.basis[i]["post"].numpy(), b)
    # rank > head_dim: refused from the config, before the prefill runs.
    prefill = model.forward
    model.forward = lambda *a, **k: pytest.fail("the prefill ran for a refused rank")
    try:
        with pytest.raises(ValueError, match=r"^rank: expected <= head_dim = 16, got 17"):
            calibrate_lowrank(model, ids, rank=17, skip=16)
    finally:
        model.forward = prefill
    with pytest.raises(ValueError, match=r"^ids: expected at least skip \+ rank = 20"):
        calibrate_lowrank(model, ids[:19], rank=4, skip=16)
    with pytest.raises(ValueError, match=r"^rank: expected an int >= 1, got 0"):
        calibrate_lowrank(model, ids, rank=0)
