"""Valid GatherSelectionKvCache calls to start tests from (docs/SPEC.md G): permuted block
tables, random full caches, zeroed selection caches (the sentinel)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pytrt_kv.contract.dtypes import name_of, numpy_dtype
from pytrt_kv.reference import gather_selection_kv_cache
from support.op_names import GATHER_INPUTS

I32 = np.int32
NAMES = GATHER_INPUTS


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def random_bytes(rng: np.random.Generator, shape: Sequence[int], dtype: str) -> np.ndarray:
    """Random bytes 1..255 (never the zero sentinel) viewed as ``dtype``."""
    dt = numpy_dtype(dtype)
    count = int(np.prod(shape)) * dt.itemsize
    return rng.integers(1, 256, count, dtype=np.uint8).view(dt).reshape(shape)


@dataclass
class Case:
    args: dict[str, np.ndarray]
    B: int
    S: int
    K: int
    tbs: int
    sbs: int
    fbs: int

    def call(self) -> np.ndarray:
        return gather_selection_kv_cache(**self.args, selection_topk_block_size=self.tbs)

    def status_rows(self) -> np.ndarray:
        return self.args["selection_kv_block_status"].reshape(self.B * self.S, self.K + 1)

    def set_kv_lens(self, kv_lens: Sequence[int]) -> None:
        self.args["full_kv_actual_seq"][...] = kv_lens

    def set_topk(self, topk: Sequence[Sequence[int]]) -> None:
        view = self.args["selection_topk_indices"]
        view[...] = np.asarray(topk, dtype=I32).reshape(view.shape)

    def refresh_full(self, rng: np.random.Generator) -> None:
        """New random bytes in the full caches: a token copied from now on is told apart
        from one copied before."""
        for name in ("full_kv_cache", "full_k_rope"):
            x = self.args[name]
            if x.size:
                x[...] = random_bytes(rng, x.shape, name_of(x.dtype))

    def full_token(self, b: int, p: int) -> list[np.ndarray]:
        table = self.args["full_kv_block_table"]
        blk, off = table[b, p // self.fbs], p % self.fbs
        return [x.view(np.uint8)[blk, off].copy() for x in self._pair("full")]

    def sel_token(self, r: int, q: int) -> list[np.ndarray]:
        table = self.args["selection_kv_block_table"]
        blk, off = table[r, q // self.sbs], q % self.sbs
        return [x.view(np.uint8)[blk, off].copy() for x in self._pair("selection")]

    def _pair(self, side: str) -> list[np.ndarray]:
        out = [self.args[f"{side}_kv_cache"]]
        if self.args[f"{side}_k_rope"].size:
            out.append(self.args[f"{side}_k_rope"])
        return out


def make_case(
    rng: np.random.Generator,
    *,
    B: int = 1,
    S: int = 1,
    K: int = 4,
    tbs: int = 1,
    sbs: int = 4,
    fbs: int = 4,
    kv_dim: int = 3,
    rope_dim: int = 2,
    dtype: str = "float16",
    layout: str = "BSND",
    kv_lens: Sequence[int] = (8,),
    topk: Sequence[Sequence[int]] | None = None,
    status: Sequence[Sequence[int]] | None = None,
    extra_rows: int = 1,
    f_max: int | None = None,
    extra_sel_cols: int = 0,
) -> Case:
    """A valid call with permuted block tables, random full caches and zeroed selection
    caches. Table rows >= B*S and columns past what K needs hold -1 (never read)."""
    f_max = f_max if f_max is not None else max(1, ceil_div(max(kv_lens), fbs))
    f_blocks = B * f_max + 2
    full_table = rng.permutation(f_blocks)[: B * f_max].astype(I32).reshape(B, f_max)
    s_max = ceil_div(K * tbs, sbs)
    rows = B * S + extra_rows
    s_blocks = B * S * s_max + 3
    sel_table = np.full((rows, s_max + extra_sel_cols), -1, dtype=I32)
    sel_table[: B * S, :s_max] = rng.permutation(s_blocks)[: B * S * s_max].reshape(B * S, s_max)
    idx_shape = (B, S, 1) if layout == "BSND" else (B * S, 1)
    if topk is None:
        topk = [[-1] * K] * (B * S)
    if status is None:
        status = [[-1] * (K + 1)] * (B * S)
    rope = (
        (lambda n, bs: np.zeros((n, bs, rope_dim), numpy_dtype(dtype)))
        if rope_dim
        else (lambda n, bs: np.zeros((0,), numpy_dtype(dtype)))
    )
    full_rope = rope(f_blocks, fbs)
    if rope_dim:
        full_rope = random_bytes(rng, full_rope.shape, dtype)
    args = dict(
        selection_k_rope=rope(s_blocks, sbs),
        selection_kv_cache=np.zeros((s_blocks, sbs, kv_dim), numpy_dtype(dtype)),
        selection_kv_block_table=sel_table,
        selection_kv_block_status=np.asarray(status, I32).reshape(idx_shape + (K + 1,)),
        selection_topk_indices=np.asarray(topk, I32).reshape(idx_shape + (K,)),
        full_k_rope=full_rope,
        full_kv_cache=random_bytes(rng, (f_blocks, fbs, kv_dim), dtype),
        full_kv_block_table=full_table,
        full_kv_actual_seq=np.asarray(kv_lens, I32),
        # Cumulative values, as production callers pass: validated, then ignored.
        full_q_actual_seq=np.cumsum(np.full(B, S)).astype(I32),
    )
    return Case(args=args, B=B, S=S, K=K, tbs=tbs, sbs=sbs, fbs=fbs)


def base_case(rng: np.random.Generator, **kw) -> Case:
    """B=2, S=2, K=4, TBS=2, SBS=4, FBS=6 with a resident row 0; valid as is."""
    opts = dict(
        B=2,
        S=2,
        K=4,
        tbs=2,
        sbs=4,
        fbs=6,
        kv_lens=[9, 6],
        topk=[[0, 3, -1, 1], [4, 0, 2, -1], [1, -1, 0, 2], [2, 0, -1, -1]],
        status=[[0, 1, -1, -1, 4], [-1] * 5, [-1] * 5, [-1] * 5],
    )
    opts.update(kw)
    return make_case(rng, **opts)


def gather_skeleton(
    dt, *, B=2, S=1, K=5, tbs=1, layout="BSND", k_rope=4, SBS=8, FBS=8, FMAX=4, extra_rows=1
):
    """Zeroed gather inputs of consistent shapes (for graph export; values set later)."""
    rows = B * S
    smax = -(-K * tbs // SBS)
    R = rows + extra_rows
    snb = R * smax
    fnb = B * FMAX + 2
    kr_sel = (snb, SBS, k_rope) if k_rope else (0,)
    kr_full = (fnb, FBS, k_rope) if k_rope else (0,)
    lead = (B, S, 1) if layout == "BSND" else (rows, 1)
    i32 = np.int32
    return {
        "selection_k_rope": np.zeros(kr_sel, dt),
        "selection_kv_cache": np.zeros((snb, SBS, 32), dt),
        "selection_kv_block_table": np.zeros((R, smax), i32),
        "selection_kv_block_status": np.zeros(lead + (K + 1,), i32),
        "selection_topk_indices": np.zeros(lead + (K,), i32),
        "full_k_rope": np.zeros(kr_full, dt),
        "full_kv_cache": np.zeros((fnb, FBS, 32), dt),
        "full_kv_block_table": np.zeros((B, FMAX), i32),
        "full_kv_actual_seq": np.zeros(B, i32),
        "full_q_actual_seq": np.zeros(B, i32),
    }
