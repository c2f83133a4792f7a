"""RetrievalKV (docs/SPEC.md R): config, partition, representations, scoring, the NumPy
reference, the host planner, and the ONNX decode step on the CPU runtime."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import onnx
import pytest

from onnx_export.retrieval import build_retrieval_decode_step
from pytrt_kv.cli.retrieval_demo import cpu_runner
from pytrt_kv.retrieval import (
    DENSE,
    LOWRANK,
    MASS,
    MEAN,
    MINMAX,
    REPRESENTATIONS,
    SPARSE,
    SPARSE_OFFLOAD,
    RetrievalConfig,
    block_representations,
    block_scores,
    calibrate_basis,
    dense_attention,
    group_query,
    score_blocks,
    select_blocks,
    sparse_decode_attention,
)
from pytrt_kv.retrieval.demo import VerificationError, calibration_basis, run_steps
from pytrt_kv.retrieval.planner import RetrievalPlanner, RetrievalSizes
from support.models import SMALL_RETRIEVAL
from support.onnx_builder import tiny_builder

#: The small windows, and a "lowrank" rank that fits the tests' head sizes (4 to 16).
SMALL = dict(SMALL_RETRIEVAL, rank=4)


def _basis(hkv: int, d: int, rank: int = 4) -> np.ndarray:
    """A "lowrank" basis calibrated on keys of their own generator (never the keys a test
    scores)."""
    return calibrate_basis(np.random.default_rng(99).standard_normal((256, hkv, d)), rank)


def _steps(cfg, sizes, prompt_lens, *, steps, seed, run=None):
    """``run_steps`` on the CPU runtime (or ``run``), with the demo's calibrated basis
    for "lowrank" (None for the others) in the step, the planner and the reference."""
    basis = calibration_basis(cfg, sizes)
    run = cpu_runner(cfg, sizes, basis) if run is None else run
    return run_steps(cfg, sizes, prompt_lens, steps, seed=seed, run=run, basis=basis)


# --- R1 / R2 -------------------------------------------------------------------------


def test_defaults_are_the_seeds():
    """R1: the seed's windows and boundaries; R5: "lowrank" of rank 32, the study's best
    selector (docs/RETRIEVAL.md "On a GPU: low-rank keys find what the oracle finds")."""
    cfg = RetrievalConfig()
    assert (
        cfg.init_tokens,
        cfg.local_tokens,
        cfg.topk_percent,
        cfg.block_size,
        cfg.dense_boundary,
        cfg.offload_boundary,
        cfg.representation,
        cfg.rank,
    ) == (1024, 7192, 0.2, 128, 32768, 65536, "lowrank", 32)


def test_from_env_reads_the_seed_names():
    env = {
        "VLLM_RETRIEVAL_INIT_TOKENS_NUM": "512",
        "VLLM_RETRIEVAL_LOCAL_TOKENS_NUM": "4096",
        "VLLM_RETRIEVAL_TOPK_PERCENT": "0.1",
        "VLLM_RETRIEVAL_DENSE_BOUNDARY": "16K",
        "VLLM_RETRIEVAL_OFFLOAD_BOUNDARY": "48k",
        "VLLM_RETRIEVAL_BLOCK_SIZE": "64",
        "VLLM_RETRIEVAL_REPRESENTATION": "MINMAX",  # not the default: really read
        "VLLM_RETRIEVAL_LOWRANK_RANK": "24",
        "UNRELATED": "x",
    }
    cfg = RetrievalConfig.from_env(env)
    assert (
        cfg.init_tokens,
        cfg.local_tokens,
        cfg.topk_percent,
        cfg.dense_boundary,
        cfg.offload_boundary,
        cfg.block_size,
        cfg.representation,
        cfg.rank,
    ) == (512, 4096, 0.1, 16384, 49152, 64, MINMAX, 24)
    assert RetrievalConfig.from_env({}) == RetrievalConfig()
    assert RetrievalConfig.from_env({}, block_size=64).block_size == 64


@pytest.mark.parametrize(
    "env,fragment",
    [
        ({"VLLM_RETRIEVAL_TOPK_PERCENT": "lots"}, "VLLM_RETRIEVAL_TOPK_PERCENT"),
        ({"VLLM_RETRIEVAL_TOPK_PERCENT": "1.5"}, "VLLM_RETRIEVAL_TOPK_PERCENT"),
        ({"VLLM_RETRIEVAL_INIT_TOKENS_NUM": "1000"}, "VLLM_RETRIEVAL_INIT_TOKENS_NUM"),
        ({"VLLM_RETRIEVAL_DENSE_BOUNDARY": "32Q"}, "VLLM_RETRIEVAL_DENSE_BOUNDARY"),
        ({"VLLM_RETRIEVAL_REPRESENTATION": "median"}, "VLLM_RETRIEVAL_REPRESENTATION"),
    ],
)
def test_from_env_names_the_bad_variable(env, fragment):
    with pytest.raises(ValueError, match=fragment):
        RetrievalConfig.from_env(env)


@pytest.mark.parametrize(
    "kwargs,exc,fragment",
    [
        (dict(init_tokens=100), ValueError, "init_tokens"),
        (dict(block_size=0), ValueError, "block_size"),
        (dict(topk_percent=-0.1), ValueError, "topk_percent"),
        (dict(topk_percent="0.2"), TypeError, "topk_percent"),
        (dict(local_tokens=1.5), TypeError, "local_tokens"),
        (dict(dense_boundary=10, offload_boundary=5), ValueError, "offload_boundary"),
        (dict(representation="max"), ValueError, "representation"),
        (dict(local_tokens=0), ValueError, "local_tokens: expected >= 1"),
        (dict(rank=0), ValueError, "rank"),
    ],
)
def test_config_refuses_bad_values(kwargs, exc, fragment):
    with pytest.raises(exc, match=fragment):
        RetrievalConfig(**kwargs)


@pytest.mark.parametrize("rep", REPRESENTATIONS)
def test_planner_scores_only_blocks_already_cached(rng, rep):
    # The smallest window, local_tokens = 1: at the step whose new token follows a block
    # boundary, the block that just became retrievable is complete in the full cache
    # (with local_tokens = 0 it would hold the new token, not cached before the step).
    cfg = RetrievalConfig(
        init_tokens=32, local_tokens=1, block_size=32, dense_boundary=0, offload_boundary=1024,
        representation=rep, rank=8,
    )  # fmt: skip
    basis = _basis(2, 16, 8)
    pl = RetrievalPlanner(cfg, RetrievalSizes(batch=1, max_len=512), basis=basis)
    caches = pl.empty_caches()
    keys = rng.standard_normal((64, 2, 16)).astype(np.float32)
    pl.start(0, keys, keys, caches)
    feeds = pl.step_feeds(caches["full_key_cache"])
    assert feeds["retrievable_blocks"].tolist() == [1]
    # L: the new token included.
    want = block_representations(keys, cfg.partition(65), rep, basis=basis)
    assert feeds["block_repr"].dtype == np.float32
    assert feeds["block_repr"].shape[2] == pl.layout.width == want.shape[1]
    np.testing.assert_array_equal(feeds["block_repr"][0, :1], want)


def test_mode_for_boundaries():
    cfg = RetrievalConfig()
    assert [cfg.mode_for(p) for p in (0, 32767, 32768, 65535, 65536, 1 << 20)] == [
        DENSE,
        DENSE,
        SPARSE,
        SPARSE,
        SPARSE_OFFLOAD,
        SPARSE_OFFLOAD,
    ]
    with pytest.raises(ValueError, match="prompt_len"):
        cfg.mode_for(-1)


# --- R3 / R4 -------------------------------------------------------------------------


@pytest.mark.parametrize("L", [0, 1, 63, 64, 200, 264, 295, 296, 297, 1000, 1023])
def test_partition_covers_every_token_once(L):
    cfg = RetrievalConfig(**SMALL)
    p = cfg.partition(L)
    assert p.num_blocks == max(0, (L - 200 - 64) // 32)
    every = p.attended(range(p.num_blocks))
    assert every == list(range(L))
    if p.num_blocks:
        assert L - p.local_start >= cfg.local_tokens
        assert L - p.local_start < cfg.local_tokens + cfg.block_size
        assert p.block_tokens(0) == range(64, 96)
    ids = list(p.init_ids()) + [p.first_id + j for j in range(p.num_blocks)] + list(p.local_ids())
    assert ids == list(range(-(-L // 32)))  # ids in TBS units tile [0, L)


def test_num_selected_is_exact_ceil():
    cfg = RetrievalConfig(topk_percent=0.1)
    assert [cfg.num_selected(n) for n in (0, 1, 10, 30, 31)] == [0, 1, 1, 3, 4]
    cfg = RetrievalConfig(topk_percent=0.2)
    assert [cfg.num_selected(n) for n in (5, 10, 11, 959)] == [1, 2, 3, 192]
    assert RetrievalConfig(topk_percent=0.0).num_selected(50) == 0
    assert RetrievalConfig(topk_percent=1.0).num_selected(50) == 50


def test_select_blocks_descending_ties_to_lower_id():
    s = np.array([0.5, 2.0, 0.5, 2.0, -1.0], np.float32)
    assert select_blocks(s, 4).tolist() == [1, 3, 0, 2]
    assert select_blocks(s, 0).tolist() == []
    with pytest.raises(ValueError, match="k"):
        select_blocks(s, 6)


# --- R5 --------------------------------------------------------------------------------


def test_representations_and_scores(rng):
    cfg = RetrievalConfig(**SMALL)
    keys = rng.standard_normal((500, 3, 8)).astype(np.float32)
    p = cfg.partition(500)
    mm = block_representations(keys, p, MINMAX)
    mean = block_representations(keys, p, MEAN)
    assert mm.shape == (p.num_blocks, 48) and mean.shape == (p.num_blocks, 24)
    blk = keys[64 + 32 : 64 + 64].reshape(32, 24)  # block 1, heads concatenated
    np.testing.assert_array_equal(mm[1], np.concatenate([blk.max(0), blk.min(0)]))
    np.testing.assert_allclose(mean[1], blk.astype(np.float64).mean(0), atol=1e-7)
    q = rng.standard_normal((6, 8)).astype(np.float32)  # 2 query heads per KV head
    qg = group_query(q, 3)
    np.testing.assert_allclose(
        qg, np.concatenate([q[0] + q[1], q[2] + q[3], q[4] + q[5]]), rtol=1e-6
    )
    s = block_scores(qg, mm, MINMAX)
    # Quest's bound: sum over dims of max(q*M, q*m) >= q . k for every key of the block.
    bound = np.maximum(qg * mm[:, :24], qg * mm[:, 24:]).sum(1)
    np.testing.assert_allclose(s, bound, rtol=1e-5, atol=1e-5)
    tokens = keys[64 : 64 + p.num_blocks * 32].reshape(p.num_blocks, 32, 24)
    assert (s[:, None] >= tokens @ qg - 1e-4).all()
    np.testing.assert_allclose(block_scores(qg, mean, MEAN), mean @ qg, rtol=1e-6)
    with pytest.raises(ValueError, match="reps"):
        block_scores(qg, mean, MINMAX)
    with pytest.raises(ValueError, match="keys"):
        block_representations(keys[:100], p)


def test_mass_scores_are_per_head_softmax_sums(rng):
    """R5 "mass": every query head's softmax over the blocks of scale * q_h . mean_b (its
    own KV head's part), summed over heads; a head with huge logits counts no more than
    one with small ones (unlike the GQA-summed "mean")."""
    cfg = RetrievalConfig(**SMALL)
    keys = rng.standard_normal((500, 3, 8)).astype(np.float32)
    p = cfg.partition(500)
    reps = block_representations(keys, p, MASS)
    np.testing.assert_array_equal(reps, block_representations(keys, p, MEAN))
    q = rng.standard_normal((6, 8)).astype(np.float32)
    s = score_blocks(q, reps, MASS, 3, scale=0.5)
    want = np.zeros(p.num_blocks)
    for h in range(6):
        logits = 0.5 * reps.reshape(-1, 3, 8)[:, h // 2] @ q[h].astype(np.float64)
        e = np.exp(logits - logits.max())
        want += e / e.sum()
    np.testing.assert_allclose(s, want, rtol=1e-5)
    assert abs(s.sum() - 6.0) < 1e-4  # each head's mass sums to one
    # A head scaled up 100x changes "mean"'s ranking toward it, "mass" only through its
    # own sharper softmax: still at most one unit of mass.
    q2 = q.copy()
    q2[0] *= 100
    assert score_blocks(q2, reps, MASS, 3).max() <= 6.0 + 1e-4
    np.testing.assert_allclose(
        score_blocks(q, reps, MEAN, 3), block_scores(group_query(q, 3), reps, MEAN)
    )
    with pytest.raises(ValueError, match="reps"):
        score_blocks(q, np.zeros((4, 48), np.float32), MASS, 3)
    with pytest.raises(ValueError, match="kind"):
        score_blocks(q, reps, "median", 3)


# --- R6 --------------------------------------------------------------------------------


@pytest.mark.parametrize("rep", REPRESENTATIONS)
@pytest.mark.parametrize("L", [50, 300, 777])
def test_topk_percent_one_equals_dense(rng, rep, L):
    cfg = RetrievalConfig(**SMALL, topk_percent=1.0, representation=rep)
    k, v = rng.standard_normal((2, L, 2, 16)).astype(np.float32)
    q = rng.standard_normal((4, 16)).astype(np.float32)
    r = sparse_decode_attention(q, k, v, cfg, basis=_basis(2, 16))
    assert len(r.selected) == r.partition.num_blocks
    assert r.positions.tolist() == list(range(L))
    np.testing.assert_allclose(r.out, dense_attention(q, k, v), atol=1e-6)


def test_sparse_attention_attends_exactly_the_partition(rng):
    cfg = RetrievalConfig(**SMALL, topk_percent=0.2)
    L = 777
    k, v = rng.standard_normal((2, L, 2, 16)).astype(np.float32)
    q = rng.standard_normal((4, 16)).astype(np.float32)
    r = sparse_decode_attention(q, k, v, cfg, scale=0.3, basis=_basis(2, 16))
    nb = r.partition.num_blocks
    assert nb == (777 - 264) // 32 and len(r.selected) == math.ceil(0.2 * nb)
    assert r.selected.tolist() == select_blocks(r.scores, len(r.selected)).tolist()
    pos = set(range(64)) | set(range(r.partition.local_start, L))
    for j in r.selected:
        pos |= set(range(64 + 32 * j, 96 + 32 * j))
    assert r.positions.tolist() == sorted(pos)
    np.testing.assert_allclose(r.out, dense_attention(q, k, v, 0.3, sorted(pos)), atol=1e-6)
    assert not np.allclose(r.out, dense_attention(q, k, v, 0.3), atol=1e-3)


def _attention_by_loops(q, k, v, scale, positions):
    """One query token, one head at a time, softmax by hand: query head h reads KV head
    h // (Hq / Hkv), the consecutive GQA grouping of group_query (docs/SPEC.md R5)."""
    hq, hkv = len(q), k.shape[1]
    out = []
    for h in range(hq):
        g = h // (hq // hkv)
        logits = [
            scale * sum(float(a) * float(b) for a, b in zip(q[h], k[t, g])) for t in positions
        ]
        top = max(logits)
        weights = [math.exp(x - top) for x in logits]
        total = sum(weights)
        out.append(
            [
                sum(w * float(v[t, g, d]) for w, t in zip(weights, positions)) / total
                for d in range(v.shape[2])
            ]
        )
    return np.array(out)


@pytest.mark.parametrize("scale", [None, 0.7])
def test_dense_attention_gqa_matches_per_head_loops(rng, scale):
    # 6 query heads over 2 KV heads (groups of 3), Dv != D, a subset of positions.
    L, hq, hkv, d, dv = 9, 6, 2, 4, 3
    q = rng.standard_normal((hq, d)).astype(np.float32)
    k = rng.standard_normal((L, hkv, d)).astype(np.float32)
    v = rng.standard_normal((L, hkv, dv)).astype(np.float32)
    positions = [0, 2, 3, 7]
    s = 1 / math.sqrt(d) if scale is None else scale
    want = _attention_by_loops(q, k, v, s, positions)
    got = dense_attention(q, k, v, scale, positions)
    assert got.shape == (hq, dv) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # Every position by default.
    np.testing.assert_allclose(
        dense_attention(q, k, v, scale), _attention_by_loops(q, k, v, s, range(L)), atol=1e-6
    )


# --- planner ---------------------------------------------------------------------------


def test_planner_layout_and_refusals():
    cfg = RetrievalConfig(**SMALL)
    pl = RetrievalPlanner(cfg, RetrievalSizes(batch=2, max_len=1024), basis=_basis(2, 16))
    lay = pl.layout
    assert (lay.block_size, lay.init_blocks, lay.max_blocks, lay.max_selected) == (32, 2, 23, 5)
    assert lay.local_blocks == 8 and lay.topk == 15  # ceil((200+31)/32) local ids
    assert lay.width == 32 * 2 * 4  # lowrank: B keys of Hkv*r numbers
    assert pl.block_repr.shape == (2, 23, 256) and pl.block_repr.dtype == np.float32
    caches = pl.empty_caches()
    with pytest.raises(ValueError, match="start"):
        pl.step_feeds(caches["full_key_cache"])
    with pytest.raises(ValueError, match="prompt_keys"):
        pl.start(0, np.ones((10, 3, 16), np.float32), np.ones((10, 3, 16), np.float32), caches)
    with pytest.raises(ValueError, match="max_len"):
        RetrievalPlanner(cfg, RetrievalSizes(max_len=200))
    with pytest.raises(ValueError, match="q_heads"):
        RetrievalPlanner(cfg, RetrievalSizes(q_heads=3, kv_heads=2))
    with pytest.raises(ValueError, match="2048"):
        RetrievalPlanner(
            RetrievalConfig(
                init_tokens=64, local_tokens=64, block_size=1, topk_percent=1.0, rank=4
            ),
            RetrievalSizes(max_len=4096),
            basis=_basis(2, 16),
        )


def test_planner_dense_mode_needs_capacity(rng):
    # prompt 300 < dense_boundary 400: every block is recalled, beyond max_selected 3.
    cfg = RetrievalConfig(**{**SMALL, "dense_boundary": 400, "offload_boundary": 800})
    pl = RetrievalPlanner(cfg, RetrievalSizes(batch=1, max_len=512), basis=_basis(2, 16))
    caches = pl.empty_caches()
    k = rng.standard_normal((390, 2, 16)).astype(np.float32)
    assert pl.start(0, k, k, caches) == DENSE and pl.residency(0) == "device"
    with pytest.raises(ValueError, match="max_selected"):
        pl.step_feeds(caches["full_key_cache"])


# --- the ONNX decode step --------------------------------------------------------------


def test_decode_step_model_is_checked():
    cfg = RetrievalConfig(**SMALL)
    model = build_retrieval_decode_step(RetrievalSizes(max_len=1024), cfg, basis=_basis(2, 16))
    onnx.checker.check_model(model, full_check=True)
    ops = [n.op_type for n in model.graph.node]
    for op in ("ScatterPaKvCache", "GatherSelectionKvCache", "TopK", "MatMul", "Where"):
        assert op in ops
    assert "ReduceLogSumExp" in ops  # the lowrank score (the default representation)
    assert "block_repr" in [i.name for i in model.graph.input]
    assert "basis" not in " ".join(i.name for i in model.graph.input)  # a constant
    gather = next(n for n in model.graph.node if n.op_type == "GatherSelectionKvCache")
    tbs = next(a.i for a in gather.attribute if a.name == "selection_topk_block_size")
    assert tbs == 32
    assert [o.name for o in model.graph.output][:2] == ["attn_out", "topk_indices"]


@pytest.mark.parametrize("rep", REPRESENTATIONS)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_decode_steps_match_reference_sparse_and_offload(rep, dtype):
    """Rows in both sparse modes (R2) for several steps: ids, slots and attention equal
    the NumPy reference, status rows carry over, resident blocks are kept in place."""
    cfg = RetrievalConfig(**SMALL, representation=rep)
    sizes = RetrievalSizes(batch=2, q_heads=6, kv_heads=2, head_dim=8, max_len=1024, dtype=dtype)
    checks = _steps(cfg, sizes, [300, 700], steps=5, seed=7)
    assert {c.record.mode for c in checks} == {SPARSE, SPARSE_OFFLOAD}
    later = [c for c in checks if c.step > 0]
    assert all(c.record.kept > 0 for c in later)  # init and local blocks stay resident
    assert all(c.record.copied_tokens < c.record.resident_tokens for c in later)
    assert max(c.err_dense for c in checks) > 1e-3  # sparse really differs from dense


def test_decode_steps_cross_block_boundaries_and_k_over_32(rng):
    """Lengths crossing block boundaries (the tail block completes, a block becomes
    retrievable) and K > 32 slots with TBS 8 (docs/SPEC.md G2, lifted)."""
    cfg = RetrievalConfig(
        init_tokens=16,
        local_tokens=40,
        block_size=8,
        topk_percent=0.8,
        dense_boundary=0,
        offload_boundary=100,
        rank=2,
    )
    sizes = RetrievalSizes(batch=2, q_heads=2, kv_heads=1, head_dim=4, max_len=384)
    pl = RetrievalPlanner(cfg, sizes, basis=calibration_basis(cfg, sizes))
    assert pl.layout.topk > 32
    checks = _steps(cfg, sizes, [63, 350], steps=10, seed=3)
    lengths = sorted({c.record.length for c in checks if c.row == 0})
    assert lengths[0] == 64 and lengths[-1] == 73  # nb goes 0 -> 1 at L = 64


def test_topk_percent_one_graph_equals_dense():
    cfg = RetrievalConfig(**SMALL, topk_percent=1.0)
    sizes = RetrievalSizes(batch=1, q_heads=4, kv_heads=2, head_dim=8, max_len=640)
    checks = _steps(cfg, sizes, [500], steps=3, seed=1)
    assert max(c.err_dense for c in checks) < 2e-5


def test_retrieval_demo_cli(capsys):
    from pytrt_kv.cli import main

    assert main(["retrieval-demo", "--steps", "3", "--dtype", "float16"]) == 0
    out = capsys.readouterr().out
    assert "sparse_offload" in out and "recalled" in out and "kept" in out
    assert "OK: 6 row-steps match the NumPy reference" in out
    assert "lowrank basis [2, 16, 8]: calibrated on random keys of seed [0, 1]" in out
    assert main(["retrieval-demo", "--init-tokens", "50"]) == 1
    assert "init_tokens: expected a multiple of block_size" in capsys.readouterr().err
    assert main(["retrieval-demo", "--rank", "17"]) == 1
    assert "rank: expected <= head_dim = 16" in capsys.readouterr().err


@pytest.mark.parametrize("rep", REPRESENTATIONS)
def test_retrieval_demo_cli_every_representation(capsys, rep):
    from pytrt_kv.cli import main

    assert main(["retrieval-demo", "--steps", "2", "--representation", rep]) == 0
    out = capsys.readouterr().out
    assert f"representation='{rep}'" in out and "OK: 4 row-steps" in out
    assert ("lowrank basis" in out) == (rep == LOWRANK)


def _corrupting(cfg, sizes, name, at_call=2, basis=None):
    """The CPU runtime, with output ``name`` wrong at call ``at_call``."""
    real = cpu_runner(cfg, sizes, basis)
    calls = {"n": 0}

    def run(feeds):
        out = real(feeds)
        calls["n"] += 1
        if calls["n"] == at_call:
            x = out[name].copy()
            if name == "topk_indices":
                x.reshape(-1)[0] += 1
            elif name == "attn_out":
                x.reshape(-1)[0] += 1e-2
            else:
                x.reshape(-1).view(np.uint8)[:] ^= 1  # every slot, used or not
            out[name] = x
        return out

    return run


@pytest.mark.parametrize(
    "name, what",
    [
        ("topk_indices", "ids"),
        ("full_key_cache_out", "beyond the new token's slot"),
        ("selection_value_cache_out", "selection_value_cache_out is wrong"),
        ("attn_out", "attention differs"),
    ],
)
def test_verifier_raises_on_a_wrong_result(name, what):
    """The demo's verifier raises VerificationError (explicit checks, not assert), naming
    the step and what differs (issue 21 item 3)."""
    cfg = RetrievalConfig(**SMALL)
    sizes = RetrievalSizes(batch=1, q_heads=4, kv_heads=2, head_dim=8, max_len=640)
    run = _corrupting(cfg, sizes, name, basis=calibration_basis(cfg, sizes))
    with pytest.raises(VerificationError, match=what) as exc:
        _steps(cfg, sizes, [500], steps=3, seed=1, run=run)
    assert "step 1" in str(exc.value)


def test_verifier_checks_survive_python_O():
    """Under ``python -O`` (asserts stripped) a wrong attention output still fails."""
    code = (
        "import numpy as np\n"
        "from pytrt_kv.cli.retrieval_demo import cpu_runner\n"
        "from pytrt_kv.retrieval import RetrievalConfig, RetrievalSizes\n"
        "from pytrt_kv.retrieval.demo import calibration_basis, run_steps\n"
        f"cfg = RetrievalConfig(**{SMALL!r})\n"
        "sizes = RetrievalSizes(batch=1, q_heads=4, kv_heads=2, head_dim=8, max_len=640)\n"
        "basis = calibration_basis(cfg, sizes)\n"
        "real = cpu_runner(cfg, sizes, basis)\n"
        "def run(feeds):\n"
        "    out = real(feeds)\n"
        "    out['attn_out'] = out['attn_out'] + np.float32(0.01)\n"
        "    return out\n"
        "try:\n"
        "    run_steps(cfg, sizes, [500], steps=1, run=run, basis=basis)\n"
        "except Exception as exc:\n"
        "    print('RAISED', type(exc).__name__)\n"
        "else:\n"
        "    print('NO ERROR')\n"
    )
    r = subprocess.run(
        [sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    assert "RAISED VerificationError" in r.stdout, r.stdout


def test_retrieval_demo_cli_reports_a_failure(capsys, monkeypatch):
    """The command prints FAILED: and the verifier's message, exit status 1."""
    from pytrt_kv.cli import main, retrieval_demo

    def corrupt(cfg, sizes, basis=None):
        return _corrupting(cfg, sizes, "attn_out", at_call=1, basis=basis)

    monkeypatch.setattr(retrieval_demo, "cpu_runner", corrupt)
    assert main(["retrieval-demo", "--steps", "2"]) == 1
    assert "FAILED: step 0 row 0: attention differs" in capsys.readouterr().out


@pytest.mark.parametrize("rep", REPRESENTATIONS)
def test_representation_scores_subgraph_equals_reference(rng, rep):
    """The R5 scores subgraph the decode step and the real-model graph share
    (``add_representation_scores``; ``add_lowrank_scores`` for "lowrank") built with a
    plain onnx.helper builder equals ``score_blocks`` on each row's retrievable blocks;
    one KV head's keys are 10x larger, so a per-head mistake shows."""
    from onnx_export.retrieval import add_lowrank_scores, add_representation_scores

    cfg = RetrievalConfig(**SMALL, representation=rep)
    basis = _basis(3, 8)
    keys = rng.standard_normal((2, 700, 3, 8)).astype(np.float32)
    keys[:, :, 1] *= 10
    p = cfg.partition(700)
    reps = np.stack([block_representations(k, p, rep, basis=basis) for k in keys])
    q = rng.standard_normal((2, 6, 8)).astype(np.float32)
    valid = np.arange(p.num_blocks)[None] < np.array([[p.num_blocks], [5]])
    op, const, run = tiny_builder()
    if rep == LOWRANK:
        out = add_lowrank_scores(
            op, const, "reps", "query", basis=basis, block_size=32, q_heads=6, scale=0.4,
            valid="valid",
        )  # fmt: skip
    else:
        out = add_representation_scores(
            op, const, rep, "reps", "query", kv_heads=3, q_heads=6, head_dim=8, scale=0.4,
            valid="valid",
        )  # fmt: skip
    got = run(out, {"reps": reps, "query": q, "valid": valid})
    for b, nb in enumerate((p.num_blocks, 5)):
        want = score_blocks(q[b], reps[b, :nb], rep, 3, scale=0.4, basis=basis)
        np.testing.assert_allclose(got[b, :nb], want, rtol=2e-5, atol=1e-6, err_msg=f"row {b}")
    with pytest.raises(ValueError, match="representation"):
        add_representation_scores(op, const, "median", "r", "q", kv_heads=3, q_heads=6,
                                  head_dim=8, scale=1.0)  # fmt: skip


def test_linear_subgraphs_refuse_lowrank():
    """The subgraphs of the basis-free representations refuse "lowrank" by name, pointing
    to its own (they would compute another representation than the one named)."""
    from onnx_export.retrieval import (
        add_block_representations,
        add_representation_scores,
        add_representation_update,
    )

    op, const, _ = tiny_builder()
    with pytest.raises(ValueError, match="^representation: 'lowrank'.*add_lowrank_scores"):
        add_representation_scores(op, const, LOWRANK, "r", "q", kv_heads=2, q_heads=4,
                                  head_dim=8, scale=1.0, valid="v")  # fmt: skip
    with pytest.raises(ValueError, match="add_lowrank_block_representations"):
        add_block_representations(op, const, LOWRANK, "p", "v", block_size=8)
    with pytest.raises(ValueError, match="add_lowrank_update"):
        add_representation_update(op, const, LOWRANK, "c", "k", "f", kv_width=16, block_size=8)


@pytest.mark.parametrize("rep", REPRESENTATIONS)
def test_representation_update_streams_to_the_block_representation(rng, rep):
    """The decode step's update subgraph (``add_representation_update``;
    ``add_lowrank_update`` for "lowrank") fed a block's keys one by one (the first one
    marked fresh, over a stale row) ends at ``block_representations`` of that block."""
    from onnx_export.retrieval import add_lowrank_update, add_representation_update

    B, kd = 8, 12
    basis = _basis(3, 4, 2)
    keys = rng.standard_normal((B, 3, 4)).astype(np.float32)
    width = {MINMAX: 2 * kd, LOWRANK: B * 3 * 2}.get(rep, kd)
    op, const, run = tiny_builder()
    if rep == LOWRANK:
        out = add_lowrank_update(op, const, "cur", "key", "slot", basis=basis, block_size=B)
    else:
        out = add_representation_update(
            op, const, rep, "cur", "key", "fresh", kv_width=kd, block_size=B
        )
    row = np.full((1, width), 99.0, np.float32)  # stale: the fresh key must replace it
    for i in range(B):
        feeds = {"cur": row, "key": keys[i].reshape(1, kd)}
        if rep == LOWRANK:
            feeds["slot"] = np.array([[i]], np.int64)
        else:
            feeds["fresh"] = np.array([[i == 0]])
        row = run(out, feeds)
    part = RetrievalConfig(init_tokens=0, local_tokens=1, block_size=B).partition(B + 1)
    want = block_representations(keys, part, rep, basis=basis)
    np.testing.assert_allclose(row, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rep", REPRESENTATIONS)
def test_centring_the_keys_changes_no_selection(rng, rep):
    """docs/SPEC.md R5: subtracting the layer's mean key (any fixed vector) shifts every
    block's score by the same amount (mean, minmax) or leaves it unchanged (mass and
    lowrank, whose per-head softmax ignores a shift of every logit of the head): the
    selection is the same."""
    cfg = RetrievalConfig(**SMALL, representation=rep)
    basis = _basis(3, 8)
    keys = rng.standard_normal((900, 3, 8)).astype(np.float32) + 3.0 * rng.standard_normal(8)
    p = cfg.partition(900)
    mu = keys.astype(np.float64).mean(axis=0).astype(np.float32)
    q = rng.standard_normal((6, 8)).astype(np.float32)

    def scores(k):
        return score_blocks(q, block_representations(k, p, rep, basis=basis), rep, 3, basis=basis)

    raw, centred = scores(keys), scores(keys - mu)
    shift = raw - centred
    assert np.ptp(shift) < 1e-3 * max(1.0, np.abs(raw).max()), np.ptp(shift)
    k = cfg.num_selected(p.num_blocks)
    assert select_blocks(raw, k).tolist() == select_blocks(centred, k).tolist()


@pytest.mark.parametrize("rep", REPRESENTATIONS)
def test_block_representations_subgraph_equals_reference(rng, rep):
    """The prefill's subgraph (``add_block_representations``;
    ``add_lowrank_block_representations`` for "lowrank") over pages of keys equals
    ``block_representations`` on complete blocks; a block without keys gives zeros."""
    from onnx_export.retrieval import add_block_representations, add_lowrank_block_representations

    B, kd, nb = 8, 12, 5
    basis = _basis(3, 4, 2)
    keys = rng.standard_normal((nb * B, 3, 4)).astype(np.float32)
    pages = keys.reshape(1, nb, B, kd)
    valid = np.ones((1, nb, B, 1), bool)
    valid[0, -1] = False  # an empty page
    op, const, run = tiny_builder()
    if rep == LOWRANK:
        out = add_lowrank_block_representations(op, const, "pages", "valid", basis=basis)
    else:
        out = add_block_representations(op, const, rep, "pages", "valid", block_size=B)
    got = run(out, {"pages": pages, "valid": valid}, rank=3)
    part = RetrievalConfig(init_tokens=0, local_tokens=1, block_size=B).partition(nb * B + 1)
    want = block_representations(keys, part, rep, basis=basis)
    np.testing.assert_allclose(got[0, :-1], want[:-1], rtol=1e-5, atol=1e-6)
    assert not got[0, -1].any()
