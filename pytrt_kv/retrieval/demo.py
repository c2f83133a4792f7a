"""The steps and checks of ``pytrt-kv retrieval-demo`` (the command:
:mod:`pytrt_kv.cli.retrieval_demo`): RetrievalKV decode steps end to end, verified.

1. builds the retrieval decode step
   (:func:`onnx_export.retrieval.build_retrieval_decode_step`), checked by ``onnx.checker``;
   for "lowrank" (the default representation) with the basis of
   :func:`calibration_basis`: :func:`.reference.calibrate_basis` of calibration keys drawn
   from their own random stream (seed ``[seed, 1]``), never the decoded sequences' keys
   (seed ``seed``), as a real basis comes from a calibration text, not the context;
2. starts each row with a random prompt (written into the full caches as a dense prefill
   would) and runs decode steps on the CPU runtime, feeding each step's caches and status
   back, the planner supplying tables, slots, representations and counts;
3. verifies every step against an independent computation: the new token lands in its
   full-cache slot and nothing else there changes; the step's ids are those of the NumPy
   reference's selection (:func:`.reference.sparse_decode_attention`); every selection
   slot holds its block's bytes; the attention output equals the reference;
4. reports, per step and row (through ``log``), the recalled, kept and copied blocks and
   the error against dense attention (the price of sparsity, not a defect).

A mismatch raises :class:`VerificationError`: explicit checks, not ``assert`` (which
``python -O`` strips).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..contract import dtypes
from .config import DENSE, LOWRANK, RetrievalConfig
from .planner import RetrievalPlanner, RetrievalSizes, StepRecord
from .reference import calibrate_basis, dense_attention, sparse_decode_attention

#: float32 attention in another order than the graph's: rounding only.
ATOL = {"float32": 2e-5, "float16": 2e-3}

#: Calibration keys per KV head behind the demo's "lowrank" basis.
CALIBRATION_KEYS = 512


def calibration_basis(
    cfg: RetrievalConfig, sizes: RetrievalSizes, seed: int = 0
) -> np.ndarray | None:
    """The "lowrank" basis of a demo run (None for the other representations):
    :func:`.reference.calibrate_basis` of :data:`CALIBRATION_KEYS` keys drawn with seed
    ``[seed, 1]``, a random stream of its own, so never the keys of the sequences
    :func:`run_steps` decodes with seed ``seed`` (a real basis is calibrated once on a
    text of another kind than the contexts it scores, docs/RETRIEVAL.md "A basis fixed
    per model is as good"). The calibration keys' dimensions have unequal spreads (keys
    are anisotropic), so the top ``cfg.rank`` directions are well defined."""
    if cfg.representation != LOWRANK:
        return None
    sizes.validate(cfg)
    rng = np.random.default_rng([seed, 1])
    spread = np.linspace(2.0, 0.25, sizes.head_dim)
    keys = rng.standard_normal((CALIBRATION_KEYS, sizes.kv_heads, sizes.head_dim)) * spread
    return calibrate_basis(keys, cfg.rank)


class VerificationError(Exception):
    """A decode step's result differs from the independent computation (the message names
    the step, the row and what differs)."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise VerificationError(message)


@dataclass
class StepCheck:
    """One row of one verified step."""

    step: int
    row: int
    record: StepRecord
    err_reference: float  #: max |graph - NumPy reference|
    err_dense: float  #: max |graph - dense attention|


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.uint8)


def run_steps(
    cfg: RetrievalConfig,
    sizes: RetrievalSizes,
    prompt_lens: Sequence[int],
    steps: int,
    *,
    run: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]],
    seed: int = 0,
    log: Callable[[str], None] | None = None,
    basis: np.ndarray | None = None,
) -> list[StepCheck]:
    """Run and verify ``steps`` decode steps; raises :class:`VerificationError` on a
    mismatch.

    Parameters
    ----------
    cfg, sizes : the step's configuration
    prompt_lens : prompt length of each row (``len == sizes.batch``)
    steps : decode steps
    run : feeds -> outputs of one step, e.g. the CPU runtime on
        :func:`onnx_export.retrieval.build_retrieval_decode_step` (``pytrt-kv
        retrieval-demo`` passes that; this layer does not import onnx_export)
    log : called with one line per step and row
    basis : the "lowrank" basis ``[kv_heads, head_dim, cfg.rank]`` the step was built
        with (e.g. :func:`calibration_basis`); required for "lowrank", ignored otherwise.
        The planner and the NumPy reference use it too.
    """
    if len(prompt_lens) != sizes.batch:
        raise ValueError(f"prompt_lens: expected {sizes.batch} lengths, got {list(prompt_lens)}")
    rng = np.random.default_rng(seed)
    cdt = dtypes.numpy_dtype(sizes.dtype)
    planner = RetrievalPlanner(cfg, sizes, seed=seed, basis=basis)
    caches = planner.empty_caches()
    Hq, Hkv, D = sizes.q_heads, sizes.kv_heads, sizes.head_dim
    hist_k, hist_v = [], []
    for b, P in enumerate(prompt_lens):
        k = rng.standard_normal((P, Hkv, D)).astype(cdt)
        v = rng.standard_normal((P, Hkv, D)).astype(cdt)
        planner.start(b, k, v, caches)
        hist_k.append(k)
        hist_v.append(v)
    B = planner.layout.block_size
    checks: list[StepCheck] = []
    atol = ATOL[sizes.dtype]
    for step in range(steps):
        q = rng.standard_normal((sizes.batch, Hq, D)).astype(cdt)
        k_new = rng.standard_normal((sizes.batch, Hkv, D)).astype(cdt)
        v_new = rng.standard_normal((sizes.batch, Hkv, D)).astype(cdt)
        feeds = planner.step_feeds(caches["full_key_cache"])
        feeds.update(caches)
        feeds.update(query=q, key=k_new, value=v_new)
        out = run(feeds)

        # The reference, row by row, from the histories (never from the caches).
        results = []
        for b in range(sizes.batch):
            hist_k[b] = np.concatenate([hist_k[b], k_new[b : b + 1]])
            hist_v[b] = np.concatenate([hist_v[b], v_new[b : b + 1]])
            row_cfg = cfg.with_(topk_percent=1.0) if planner.modes[b] == DENSE else cfg
            results.append(
                sparse_decode_attention(q[b], hist_k[b], hist_v[b], row_cfg, basis=planner.basis)
            )
        want_ids = planner.topk_rows([r.selected for r in results])
        got_ids = out["topk_indices"]
        _check(
            np.array_equal(got_ids, want_ids),
            f"step {step}: ids {got_ids.reshape(sizes.batch, -1).tolist()} != reference "
            f"{want_ids.reshape(sizes.batch, -1).tolist()}",
        )

        _check_full_caches(step, out, caches, feeds["slot_mapping"], k_new, v_new, B)

        records = planner.commit(
            got_ids, out["selection_kv_block_status_out"], out["selection_kv_actual_seq"]
        )
        status = out["selection_kv_block_status_out"].reshape(sizes.batch, -1)
        for b, (res, rec) in enumerate(zip(results, records)):
            _check_slots(step, b, out, status[b], planner, hist_k[b], hist_v[b])
            _check(
                rec.resident_tokens == len(res.positions),
                f"step {step} row {b}: {rec.resident_tokens} resident tokens, reference "
                f"attends {len(res.positions)}",
            )
            got = out["attn_out"][b]
            err_ref = float(np.abs(got - res.out).max())
            _check(
                err_ref <= atol,
                f"step {step} row {b}: attention differs from the reference by {err_ref} > {atol}",
            )
            err_dense = float(np.abs(got - dense_attention(q[b], hist_k[b], hist_v[b])).max())
            checks.append(StepCheck(step, b, rec, err_ref, err_dense))
            if log:
                log(
                    f"step {step} row {b}: L={rec.length} {rec.mode:<14} recalled "
                    f"{rec.selected} kept {rec.kept} copied {rec.copied} blocks "
                    f"({rec.copied_tokens} tokens), resident {rec.resident_tokens}; "
                    f"|out - reference| {err_ref:.1e}, |out - dense| {err_dense:.2e}"
                )
        caches = {name: out[name + "_out"] for name in caches}
    return checks


def _check_slots(step: int, b: int, out: dict, status_row: np.ndarray, planner, hist_k, hist_v):
    """Every selection slot of row b holds its id's tokens, bit for bit (keys and values)."""
    B, K, L = planner.layout.block_size, planner.layout.topk, hist_k.shape[0]
    for j, v in enumerate(status_row[:K].tolist()):
        if v < 0:
            continue
        size = min(B, L - v * B)
        blk = planner.selection_block_table[b, j]
        for name, hist in (
            ("selection_key_cache_out", hist_k),
            ("selection_value_cache_out", hist_v),
        ):
            got = out[name][blk, :size]
            want = hist[v * B : v * B + size].reshape(size, -1)
            _check(
                np.array_equal(_bits(got), _bits(want)),
                f"step {step} row {b}: slot {j} (id {v}) of {name} is wrong",
            )


def _check_full_caches(step: int, out: dict, caches: dict, slot_mapping, k_new, v_new, B: int):
    """Full caches: the new token at its slot, nothing else changed."""
    slot = np.asarray(slot_mapping).astype(np.int64)
    for name, new in (("full_key_cache", k_new), ("full_value_cache", v_new)):
        want = caches[name].copy()
        want[slot // B, slot % B] = new
        _check(
            np.array_equal(_bits(out[name + "_out"]), _bits(want)),
            f"step {step}: {name}_out differs beyond the new token's slot",
        )
