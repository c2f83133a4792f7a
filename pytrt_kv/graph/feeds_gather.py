"""Feeds of GatherSelectionKvCache's index inputs (docs/SPEC.md G2-G5) and of the full
cache's block table, which a scatter in the same step writes through too: the query
geometry (B, S, K), private full blocks and a kv_len per batch, then selection rows with
valid top-k ids and status rows a previous step could have left."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..contract.errors import value_error
from .feeds_common import Shape, at_least, need, node_attr

Info = Mapping[str, tuple[Shape, np.dtype]]


def _shape(info: Info, name: str) -> Shape:
    return info[name][0]


def _dt(info: Info, name: str) -> np.dtype:
    return info[name][1]


def query_geometry(info: Info) -> tuple[Any, Any, Any]:
    """(B, S, K) read from the selection status / top-k and full_kv_actual_seq shapes
    (None where no input decides it)."""
    B = S = K = None
    if "selection_kv_block_status" in info or "selection_topk_indices" in info:
        ref = (
            "selection_kv_block_status"
            if "selection_kv_block_status" in info
            else "selection_topk_indices"
        )
        sh = _shape(info, ref)
        if len(sh) not in (3, 4):
            raise value_error(ref, "BSND [B, S, 1, *] or TND [B*S, 1, *]", list(sh))
        K = sh[-1] - 1 if ref == "selection_kv_block_status" else sh[-1]
        at_least(ref, "K (last dim" + (" - 1)" if ref.endswith("status") else ")"), K, 1, sh)
        if "full_kv_actual_seq" in info:
            B = at_least(
                "full_kv_actual_seq",
                "B",
                _shape(info, "full_kv_actual_seq")[0],
                1,
                _shape(info, "full_kv_actual_seq"),
            )
        if len(sh) == 4:
            if B is not None and sh[0] != B:
                raise value_error(ref, f"B = {B} (of full_kv_actual_seq) as dim 0", list(sh))
            B, S = at_least(ref, "B", sh[0], 1, sh), at_least(ref, "S", sh[1], 1, sh)
        else:
            B = B or at_least(ref, "T", sh[0], 1, sh)
            if sh[0] % B or sh[0] == 0:
                raise value_error(ref, f"TND T = B*S with B = {B}, S >= 1", list(sh))
            S = sh[0] // B
    elif "full_kv_actual_seq" in info:
        B, S = _shape(info, "full_kv_actual_seq")[0], 1
        at_least("full_kv_actual_seq", "B", B, 1, _shape(info, "full_kv_actual_seq"))
    return B, S, K


def full_table(
    info: Info, rng: np.random.Generator, B: Any, S: Any, feeds: dict[str, np.ndarray]
) -> tuple[Any, Any, Any, Any]:
    """docs/SPEC.md G2: private full blocks per batch and a kv_len per batch that fits
    them (into ``feeds``); returns (B, S, table, kv_len), table and kv_len None without a
    full_kv_block_table input."""
    kv_len = table = None
    if "full_kv_block_table" in info:
        fshape, _ = need(info, "full_kv_cache", "its dims 0 and 1 size full_kv_block_table")
        if len(fshape) < 2:
            raise value_error("full_kv_cache", "[F_BLOCK_NUM, FBS, ...]", list(fshape))
        fnb, fbs = fshape[:2]
        at_least("full_kv_cache", "FBS (dim 1)", fbs, 1, fshape)
        tshape = _shape(info, "full_kv_block_table")
        if len(tshape) != 2:
            raise value_error("full_kv_block_table", "[B, F_MAX_BLOCK_NUM]", list(tshape))
        B = B or at_least("full_kv_block_table", "B", tshape[0], 1, tshape)
        fmax = at_least("full_kv_block_table", "F_MAX_BLOCK_NUM", tshape[1], 1, tshape)
        if B * fmax > fnb:
            # Shared blocks would make two batches' tokens collide (duplicate slots, S7).
            raise value_error(
                "full_kv_cache",
                f"at least B*F_MAX_BLOCK_NUM = {B * fmax} blocks "
                "so every batch gets private blocks",
                f"{fnb} blocks",
            )
        table = rng.permutation(fnb)[: B * fmax].reshape(B, fmax)
        feeds["full_kv_block_table"] = table.astype(_dt(info, "full_kv_block_table"))
        S = S or 1
        cap = fmax * fbs
        if cap < S:
            raise value_error(
                "full_kv_block_table",
                f"room for S = {S} tokens per batch (F_MAX_BLOCK_NUM * FBS >= S)",
                f"{fmax} * {fbs} = {cap}",
            )
        kv_len = rng.integers(S, cap + 1, size=B)
        if B > 1:
            kv_len[rng.integers(B)] = cap  # the full table is exercised every time
        if "full_kv_actual_seq" in info:
            feeds["full_kv_actual_seq"] = kv_len.astype(_dt(info, "full_kv_actual_seq"))
    return B, S, table, kv_len


def q_actual_seq(info: Info, B: Any, S: Any, feeds: dict[str, np.ndarray]) -> Any:
    """full_q_actual_seq: cumulative query counts (into ``feeds``); returns B."""
    if "full_q_actual_seq" in info:
        if B is None:
            B = at_least(
                "full_q_actual_seq",
                "B",
                _shape(info, "full_q_actual_seq")[0],
                1,
                _shape(info, "full_q_actual_seq"),
            )
        feeds["full_q_actual_seq"] = (np.arange(1, B + 1) * (S or 1)).astype(
            _dt(info, "full_q_actual_seq")
        )
    return B


def gather_indices(model, info: Info, rng, B, S, K, kv_len) -> dict[str, np.ndarray]:
    """The selection table, status and top-k feeds (none without those inputs)."""
    for name in ("selection_kv_block_status", "selection_topk_indices", "selection_kv_block_table"):
        if name in info:
            if kv_len is None:
                need(
                    info,
                    "full_kv_block_table",
                    f"the data loader derives the kv_len that {name} must agree with from it",
                )
            return _gather_indices(model, info, rng, B, S, K, kv_len)
    return {}


def _gather_indices(model, info, rng, B, S, K, kv_len) -> dict[str, np.ndarray]:
    from ..reference import plan_row

    if K is None:
        need(info, "selection_kv_block_status", "the data loader reads K from it")
    tbs = node_attr(model, "GatherSelectionKvCache", "selection_topk_block_size", 64)
    if isinstance(tbs, bool) or not isinstance(tbs, int) or tbs < 1:
        raise value_error("selection_topk_block_size", "an int >= 1", repr(tbs))
    out: dict[str, np.ndarray] = {}
    cshape, _ = need(info, "selection_kv_cache", "its dims 0 and 1 size the selection block table")
    tshape, _ = need(
        info, "selection_kv_block_table", "the data loader writes private selection blocks into it"
    )
    if len(cshape) != 3 or len(tshape) != 2:
        bad, sh = (
            ("selection_kv_cache", cshape)
            if len(cshape) != 3
            else ("selection_kv_block_table", tshape)
        )
        raise value_error(bad, "a 3-D cache and a 2-D table", list(sh))
    snb, sbs = cshape[:2]
    at_least("selection_kv_cache", "SBS (dim 1)", sbs, 1, cshape)
    R, smax = tshape
    cols = -(-K * tbs // sbs)
    rows = B * S
    if R < rows or smax < cols:
        raise value_error(
            "selection_kv_block_table",
            f"[R >= B*S = {rows}, S_MAX_BLOCK_NUM >= ceil(K*TBS/SBS) = {cols}]",
            list(tshape),
        )
    if rows * cols > snb:
        raise ValueError(
            f"selection_kv_cache: expected at least rows*ceil(K*TBS/SBS) = "
            f"{rows * cols} blocks for private selection rows, got {snb}"
        )
    sel = rng.integers(0, snb, size=(R, smax))
    sel[:rows, :cols] = rng.permutation(snb)[: rows * cols].reshape(rows, cols)
    out["selection_kv_block_table"] = sel.astype(np.int32)
    status = np.full((rows, K + 1), -1, np.int64)
    topk = np.full((rows, K), -1, np.int64)
    for r in range(rows):
        b, s = divmod(r, S)
        eff = int(kv_len[b]) - (S - 1 - s)
        if eff <= 0:
            continue
        n_ids = -(-eff // tbs)
        old_ids: list = []
        if eff > 1 and rng.random() < 0.7:
            # A previous step's state (kv_len one shorter), planned like the op would.
            old_n_ids = -(-(eff - 1) // tbs)
            prev = rng.permutation(old_n_ids)[: int(rng.integers(1, min(K, old_n_ids) + 1))]
            prev_topk = np.full(K, -1, np.int64)
            prev_topk[rng.permutation(K)[: len(prev)]] = prev
            plan = plan_row([-1] * (K + 1), prev_topk.tolist(), int(kv_len[b]) - 1, S, s, tbs)
            status[r] = plan.status
            old_ids = [int(v) for v in plan.status[:K] if v >= 0]
        n = int(rng.integers(max(1, min(K, n_ids) // 2), min(K, n_ids) + 1))
        reuse = [v for v in old_ids if v < n_ids and rng.random() < 0.6][:n]
        rest = [int(v) for v in rng.permutation(n_ids) if int(v) not in reuse]
        ids = reuse + rest[: n - len(reuse)]
        ids = [ids[i] for i in rng.permutation(len(ids))]
        topk[r, np.sort(rng.permutation(K)[: len(ids)])] = ids
    if "selection_kv_block_status" in info:
        out["selection_kv_block_status"] = status.reshape(
            info["selection_kv_block_status"][0]
        ).astype(np.int32)
    if "selection_topk_indices" in info:
        out["selection_topk_indices"] = topk.reshape(info["selection_topk_indices"][0]).astype(
            np.int32
        )
    return out
