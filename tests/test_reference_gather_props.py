"""Property tests of the GatherSelectionKvCache reference over random multi-step decoding
(docs/SPEC.md G3-G5).

Each step models speculative decoding: every batch's ``kv_len`` grows by 1..S, the newest
S positions of the full cache are (re)written with fresh bytes, random top-k rows mix
resident ids, new ids, padding and ids past ``max_id``, and now and then a batch starts
a new sequence (its status rows reset to -1). Every step runs twice on identical
arguments: once as is, and once on a copy whose full caches hold different "poison"
bytes, which tells copied tokens from kept ones.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pytrt_kv.contract import specs
from pytrt_kv.contract.dtypes import numpy_dtype
from pytrt_kv.reference import gather_selection_kv_cache
from support.op_names import GATHER_READ_ONLY

I32 = np.int32


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def random_bytes(rng: np.random.Generator, shape, dtype: str) -> np.ndarray:
    dt = numpy_dtype(dtype)
    count = int(np.prod(shape)) * dt.itemsize
    return rng.integers(1, 256, count, dtype=np.uint8).view(dt).reshape(shape)


def expected_plan(
    old: list[int], topk: list[int], kv_len: int, S: int, s: int, tbs: int
) -> tuple[list[int], set, dict[int, int]] | None:
    """An independent reading of G3-G5: ``(slot ids, kept slots, size of each id)``, or
    None for a skipped row. ``topk`` holds no duplicate valid id (the generator's
    promise)."""
    K = len(topk)
    eff = kv_len - (S - 1 - s)
    if kv_len <= 0 or eff <= 0:
        return None
    max_id = ceil_div(eff, tbs) - 1
    valid = [v for v in topk if 0 <= v <= max_id]
    n = len(valid)
    size = {v: (eff - max_id * tbs if v == max_id else tbs) for v in valid}
    old_ids = [v for v in old[:K] if v >= 0]
    tail = len(old_ids) - 1 if tbs > 1 and old[K] % tbs != 0 else None
    reserve = tbs > 1 and max_id in size
    kept = {
        j: v
        for j, v in enumerate(old_ids)
        if v in size
        and j < n
        and j != tail
        and (v + 1) * tbs <= kv_len - S
        and not (reserve and (j == n - 1 or v == max_id))
    }
    rest = iter(v for v in valid if v not in kept.values() and not (reserve and v == max_id))
    slots = [
        kept[j] if j in kept else (max_id if reserve and j == n - 1 else next(rest))
        for j in range(n)
    ]
    return slots, set(kept), size


class Sim:
    """One random decoding session: the ten gather arguments and how to advance them."""

    def __init__(
        self,
        rng: np.random.Generator,
        *,
        B: int,
        S: int,
        K: int,
        tbs: int,
        sbs: int,
        fbs: int,
        kv_dim: int,
        rope_dim: int,
        dtype: str,
        layout: str,
        steps: int,
    ) -> None:
        self.rng, self.B, self.S, self.K, self.tbs = rng, B, S, K, tbs
        self.sbs, self.fbs, self.dtype = sbs, fbs, dtype
        self.kv_hi = 2 * K * tbs  # largest kv_len a (re)started sequence begins with
        self.kv_lens = rng.integers(-2, self.kv_hi + 1, B)
        f_cols = ceil_div(self.kv_hi + steps * S, fbs)
        f_blocks = B * f_cols + 2
        # One trailing column of -1: never read, since no kv_len reaches it.
        full_table = np.full((B, f_cols + 1), -1, I32)
        full_table[:, :f_cols] = rng.permutation(f_blocks)[: B * f_cols].reshape(B, f_cols)
        s_cols = ceil_div(K * tbs, sbs)
        rows = B * S + int(rng.integers(0, 3))
        s_blocks = B * S * s_cols + 2
        # Rows >= B*S and columns past ceil(K*TBS/SBS) are never read: -1 there.
        sel_table = np.full((rows, s_cols + int(rng.integers(0, 2))), -1, I32)
        sel_table[: B * S, :s_cols] = rng.permutation(s_blocks)[: B * S * s_cols].reshape(
            B * S, s_cols
        )
        lead = (B, S, 1) if layout == "BSND" else (B * S, 1)
        dt = numpy_dtype(dtype)

        def rope(n, bs):
            return np.zeros((n, bs, rope_dim) if rope_dim else (0,), dt)

        full_rope = rope(f_blocks, fbs)
        if rope_dim:
            full_rope = random_bytes(rng, full_rope.shape, dtype)
        self.args: dict[str, np.ndarray] = dict(
            selection_k_rope=rope(s_blocks, sbs),
            selection_kv_cache=np.zeros((s_blocks, sbs, kv_dim), dt),  # zero sentinel
            selection_kv_block_table=sel_table,
            selection_kv_block_status=np.full(lead + (K + 1,), -1, I32),
            selection_topk_indices=np.full(lead + (K,), -1, I32),
            full_k_rope=full_rope,
            full_kv_cache=random_bytes(rng, (f_blocks, fbs, kv_dim), dtype),
            full_kv_block_table=full_table,
            full_kv_actual_seq=np.zeros(B, I32),
            full_q_actual_seq=rng.integers(0, 100, B).astype(I32),
        )
        self.stats: collections.Counter = collections.Counter()

    # --- views ---------------------------------------------------------------------
    def status(self, args=None) -> np.ndarray:
        a = (args or self.args)["selection_kv_block_status"]
        return a.reshape(self.B * self.S, self.K + 1)

    def topk(self) -> np.ndarray:
        return self.args["selection_topk_indices"].reshape(self.B * self.S, self.K)

    def caches(self, args, side: str) -> list[np.ndarray]:
        out = [args[f"{side}_kv_cache"]]
        if args[f"{side}_k_rope"].size:
            out.append(args[f"{side}_k_rope"])
        return out

    # --- advancing -------------------------------------------------------------------
    def advance(self) -> None:
        """New tokens: kv_len grows by 1..S (rejected speculative tokens are rewritten),
        or the batch starts a new sequence."""
        rng = self.rng
        for b in range(self.B):
            if rng.random() < 0.1:
                self.kv_lens[b] = rng.integers(-2, self.kv_hi + 1)
                self.status()[b * self.S : (b + 1) * self.S] = -1
                self.stats["reset"] += 1
            else:
                self.kv_lens[b] += rng.integers(1, self.S + 1)
            kv_len = int(self.kv_lens[b])
            for p in range(max(0, kv_len - self.S), max(0, kv_len)):
                blk = self.args["full_kv_block_table"][b, p // self.fbs]
                for x in self.caches(self.args, "full"):
                    x[blk, p % self.fbs] = random_bytes(rng, x.shape[2:], self.dtype)
        self.args["full_kv_actual_seq"][...] = self.kv_lens
        for r in range(self.B * self.S):
            self.topk()[r] = self._topk_row(r)

    def _topk_row(self, r: int) -> list[int]:
        rng, K, tbs = self.rng, self.K, self.tbs
        b, s = divmod(r, self.S)
        eff = int(self.kv_lens[b]) - (self.S - 1 - s)
        if eff <= 0:  # skipped row: anything, duplicates included
            return rng.integers(-3, 5, K).tolist()
        max_id = ceil_div(eff, tbs) - 1
        resident = [int(v) for v in self.status()[r, :K] if v >= 0]
        row, seen = [], set()
        for _ in range(K):
            u = rng.random()
            if u < 0.45 and resident:
                v = int(rng.choice(resident))
            elif u < 0.55:
                v = max_id  # the partial tail block is popular
            elif u < 0.65:
                v = int(rng.integers(-5, 0))
            elif u < 0.72:
                v = max_id + int(rng.integers(1, 4))
            else:
                v = int(rng.integers(0, max_id + 1))
            if 0 <= v <= max_id and v in seen:
                v = -1  # a valid id at most once per row
            seen.add(v)
            row.append(v)
        return row

    # --- one checked step ------------------------------------------------------------
    def step(self) -> None:
        args = self.args
        before = {k: v.copy() for k, v in args.items()}
        poisoned = {k: v.copy() for k, v in args.items()}
        for x in self.caches(poisoned, "full"):
            x[...] = random_bytes(self.rng, x.shape, self.dtype)
        tbs = self.tbs
        out_p = gather_selection_kv_cache(**poisoned, selection_topk_block_size=tbs)
        out = gather_selection_kv_cache(**args, selection_topk_block_size=tbs)

        # Placement never depends on cache bytes.
        assert np.array_equal(out, out_p)
        assert np.array_equal(self.status(), self.status(poisoned))
        assert out.dtype == I32 and out.shape == (args["selection_kv_block_table"].shape[0],)
        assert not out[self.B * self.S :].any(), "rows >= B*S must return 0"
        for name in GATHER_READ_ONLY:
            assert np.array_equal(args[name].view(np.uint8), before[name].view(np.uint8))

        written: list[tuple[int, int, int, int]] = []  # (sel blk, off, full blk, off)
        resident: list[tuple[int, int, int, int]] = []  # every slot token, real run
        sel_table = args["selection_kv_block_table"]
        full_table = args["full_kv_block_table"]
        old_status = before["selection_kv_block_status"].reshape(self.status().shape)
        for r in range(self.B * self.S):
            b, s = divmod(r, self.S)
            kv_len = int(self.kv_lens[b])
            new = self.status()[r].tolist()
            old = old_status[r].tolist()
            plan = expected_plan(old, self.topk()[r].tolist(), kv_len, self.S, s, tbs)
            if plan is None:  # G3: skipped row
                assert new == old and out[r] == 0
                self.stats["skipped"] += 1
                continue
            slots, kept, size = plan
            n, K = len(slots), self.K
            # Status = the valid ids (any order), then -1, then the token count.
            assert sorted(new[:n]) == sorted(size) and new[n:K] == [-1] * (K - n)
            assert new[K] == out[r] == sum(size.values())
            assert new[:n] == slots, f"row {r}: placement differs from G5"
            eff = kv_len - (self.S - 1 - s)
            max_id = ceil_div(eff, tbs) - 1
            if tbs > 1 and max_id in size:  # dense prefix [0, actual_seq)
                assert new[n - 1] == max_id and new[K] == (n - 1) * tbs + size[max_id]
                self.stats["reserved"] += 1
            else:
                assert new[K] == n * tbs if tbs > 1 else new[K] == n
            for j in kept:  # kept in place: same slot as before
                assert old[j] == new[j]
            self.stats["kept"] += len(kept)
            self.stats["recopied_resident"] += sum(
                1 for j, v in enumerate(slots) if j not in kept and v in old[:K]
            )
            for j, v in enumerate(slots):
                for i in range(size[v]):
                    q, p = j * tbs + i, v * tbs + i
                    addr = (
                        int(sel_table[r, q // self.sbs]),
                        q % self.sbs,
                        int(full_table[b, p // self.fbs]),
                        p % self.fbs,
                    )
                    resident.append(addr)
                    if j not in kept:
                        written.append(addr)

        # Brute force from the status alone: slot j holds the tokens of id status[j].
        self._compare(args, args, resident, "a slot does not hold its status id's tokens")
        # Poisoned run: copied tokens come from the (poisoned) full cache; every other
        # selection token, kept slots included, keeps its bytes.
        self._compare(poisoned, poisoned, written, "a copied token has the wrong bytes")
        for sel_p, sel_before in zip(
            self.caches(poisoned, "selection"), self.caches(before, "selection")
        ):
            mask = np.ones(sel_p.shape[:2], dtype=bool)
            if written:
                w = np.array(written)
                mask[w[:, 0], w[:, 1]] = False
            assert np.array_equal(sel_p.view(np.uint8)[mask], sel_before.view(np.uint8)[mask]), (
                "a selection token outside the copied slots changed"
            )
        self.stats["copied_tokens"] += len(written)

    def _compare(self, sel_args, full_args, addrs, what: str) -> None:
        if not addrs:
            return
        a = np.array(addrs)
        for sel, full in zip(self.caches(sel_args, "selection"), self.caches(full_args, "full")):
            got = sel.view(np.uint8)[a[:, 0], a[:, 1]]
            want = full.view(np.uint8)[a[:, 2], a[:, 3]]
            assert np.array_equal(got, want), what


def run_session(params: dict, seed: int) -> collections.Counter:
    sim = Sim(np.random.default_rng(seed), **params)
    for _ in range(params["steps"]):
        sim.advance()
        sim.step()
    return sim.stats


@st.composite
def sessions(draw):
    tbs = draw(st.sampled_from([1, 2, 4, 8]))
    return dict(
        tbs=tbs,
        K=draw(st.integers(1, 40 if tbs == 1 else 12)),
        B=draw(st.integers(1, 3)),
        S=draw(st.integers(1, 3)),
        sbs=tbs * draw(st.integers(1, 3)),
        fbs=tbs * draw(st.integers(1, 3)),
        kv_dim=draw(st.integers(1, 4)),
        rope_dim=draw(st.sampled_from([0, 2])),
        dtype=draw(st.sampled_from(specs.GATHER_CACHE_DTYPES)),
        layout=draw(st.sampled_from(["BSND", "TND"])),
        steps=draw(st.integers(2, 6)),
    )


@settings(max_examples=200, deadline=None)
@given(params=sessions(), seed=st.integers(0, 2**32 - 1))
def test_random_sessions(params, seed):
    run_session(params, seed)


@pytest.mark.parametrize("tbs", [1, 4])
def test_sessions_exercise_every_rule(tbs):
    """The generator is not vacuous: over a fixed set of sessions, ids are kept, resident
    ids are re-copied, the reserved tail slot is used, rows are skipped and reset."""
    total: collections.Counter = collections.Counter()
    for seed in range(12):
        params = dict(
            tbs=tbs,
            K=6,
            B=2,
            S=2,
            sbs=2 * tbs,
            fbs=3 * tbs,
            kv_dim=2,
            rope_dim=2,
            dtype="bfloat16",
            layout="TND",
            steps=5,
        )
        total += run_session(params, seed)
    for key in ("kept", "recopied_resident", "skipped", "reset", "copied_tokens"):
        assert total[key] > 0, key
    if tbs > 1:
        assert total["reserved"] > 0
