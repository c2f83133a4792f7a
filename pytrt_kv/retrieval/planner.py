"""Host planner: per-step GatherSelectionKvCache feeds for RetrievalKV (docs/SPEC.md R).

One decode step of one layer, ``batch`` sequences, one new token each (S = 1, BSND):

* the full caches (every token of every sequence, paged in blocks of B = block size
  tokens) live in device memory ("sparse") or pinned host memory ("sparse_offload"),
  R2; the planner owns their block tables and the new token's slot;
* the selection caches are the device working set: one selection block (SBS = TBS = B)
  per slot, ``K = init blocks + max recalled blocks + max local blocks`` slots per row.
  Each step the row's ids are ``[init ids, recalled ids, local ids]`` in TBS units
  (R3: retrievable block j is id ``init_tokens/B + j``); GatherSelectionKvCache keeps
  every id already resident in place (G5), so a step copies only newly recalled blocks
  and the block holding the new token;
* block representations (R5) are computed on the host once per block, when it becomes
  retrievable, from the full key cache (the seed writes them to its vector store during
  prefill); the decode step scores them on the device. "lowrank" projects the keys on
  the planner's ``basis`` (a constant of the model, the same the step was built with);
* the status rows are kept between steps (fed back from the step's output) and reset
  when a row starts a sequence.

Decisions where the specification is silent: a sequence whose prompt is below
``dense_boundary`` ("dense" mode) recalls every retrievable block (attention equals
dense) and needs a graph whose ``max_selected`` covers its length, else the planner
refuses the step; keys and values share one set of tables (keys travel in the op's
``k_rope`` pair, values in its ``kv`` pair).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import numpy as np

from ..contract import dtypes, specs
from ..reference import plan_row
from .config import DENSE, LOWRANK, SPARSE_OFFLOAD, Partition, RetrievalConfig
from .reference import block_representations, check_basis, representation_width

#: Value written into caches before use: a slot the op was not meant to touch stays so.
SENTINEL = -7.25


@dataclass(frozen=True)
class RetrievalSizes:
    """Static sizes of one retrieval decode step (one layer)."""

    batch: int = 2  #: sequences decoded together
    q_heads: int = 4  #: Hq, query heads
    kv_heads: int = 2  #: Hkv, KV heads (Hq % Hkv == 0, GQA)
    head_dim: int = 16  #: D
    max_len: int = 1024  #: tokens one sequence may hold (full-cache capacity)
    dtype: str = specs.FLOAT32  #: cache dtype: float32 or float16
    max_selected: int | None = None  #: K_SEL; default cfg.max_selected(max_len)

    def validate(self, cfg: RetrievalConfig) -> RetrievalSizes:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("dtype", "max_selected"):
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f.name}: expected a positive int, got {v!r}")
        if self.dtype not in (specs.FLOAT32, specs.FLOAT16):
            raise ValueError(f"dtype: expected 'float32' or 'float16', got {self.dtype!r}")
        if self.q_heads % self.kv_heads:
            raise ValueError(
                f"q_heads: expected a multiple of kv_heads = {self.kv_heads}, got {self.q_heads}"
            )
        if cfg.representation == LOWRANK and cfg.rank > self.head_dim:
            raise ValueError(
                f"rank: expected <= head_dim = {self.head_dim} for 'lowrank' (the basis is "
                f"[kv_heads, head_dim, rank]), got {cfg.rank}"
            )
        if cfg.partition(self.max_len).num_blocks < 1:
            raise ValueError(
                f"max_len: expected >= init_tokens + local_tokens + block_size "
                f"= {cfg.init_tokens + cfg.local_tokens + cfg.block_size} (at "
                f"least one retrievable block), got {self.max_len}"
            )
        ms = self.max_selected
        if ms is not None and (isinstance(ms, bool) or not isinstance(ms, int) or ms < 0):
            raise ValueError(f"max_selected: expected an int >= 0, got {ms!r}")
        lay = StepLayout.of(self, cfg)
        if lay.topk > 2048:
            raise ValueError(
                f"max_len: K = {lay.topk} slots (init {lay.init_blocks} + "
                f"recalled {lay.max_selected} + local {lay.local_blocks}) exceeds "
                "2048 (docs/SPEC.md G2); use a larger block_size"
            )
        return self


@dataclass(frozen=True)
class StepLayout:
    """Sizes derived from :class:`RetrievalSizes` and the config."""

    block_size: int  #: B = FBS = SBS = TBS
    full_max_blocks: int  #: FMAX, full-table columns per sequence
    full_blocks: int  #: NBF = batch * FMAX
    max_blocks: int  #: NBMAX, retrievable blocks at max_len (rows of block_repr)
    max_selected: int  #: K_SEL
    init_blocks: int  #: init ids
    local_blocks: int  #: most local ids a row can have
    first_id: int  #: id of retrievable block 0
    width: int  #: representation width W
    topk: int  #: K = init_blocks + max_selected + local_blocks
    sel_blocks: int  #: SNB = batch * K

    @staticmethod
    def of(sizes: RetrievalSizes, cfg: RetrievalConfig) -> StepLayout:
        B = cfg.block_size
        fmax = -(-sizes.max_len // B)
        nbmax = cfg.partition(sizes.max_len).num_blocks
        ksel = (
            cfg.max_selected(sizes.max_len)
            if sizes.max_selected is None
            else min(sizes.max_selected, nbmax)
        )
        init_blocks = min(cfg.init_tokens // B, fmax)
        local_blocks = min(
            -(-(cfg.local_tokens + B - 1) // B), -(-max(0, sizes.max_len - cfg.init_tokens) // B)
        )
        K = init_blocks + ksel + local_blocks
        return StepLayout(
            block_size=B,
            full_max_blocks=fmax,
            full_blocks=sizes.batch * fmax,
            max_blocks=nbmax,
            max_selected=ksel,
            init_blocks=init_blocks,
            local_blocks=local_blocks,
            first_id=cfg.init_tokens // B,
            width=representation_width(
                cfg.representation, sizes.kv_heads, sizes.head_dim, block_size=B, rank=cfg.rank
            ),
            topk=K,
            sel_blocks=sizes.batch * K,
        )


@dataclass
class StepRecord:
    """What one row did in one step (from the G5 plan of its status and ids)."""

    length: int  #: L, tokens after the step
    mode: str
    selected: list[int]  #: recalled ids (TBS units), in R4 order
    kept: int  #: ids kept in place (no copy)
    copied: int  #: ids copied from the full cache
    copied_tokens: int  #: tokens copied
    resident_tokens: int  #: selection_kv_actual_seq


@dataclass
class RetrievalPlanner:
    """Feeds, tables, status rows and offload state of the retrieval decode step.

    Parameters
    ----------
    cfg : RetrievalConfig
    sizes : RetrievalSizes
    seed : int
        Permutes the block tables (a real allocator hands out any blocks).
    basis : numpy.ndarray ``[kv_heads, head_dim, cfg.rank]``, optional
        The "lowrank" basis (``reference.calibrate_basis``; the step's graph must be
        built with the same one); required for "lowrank", ignored by the other
        representations.

    Raises
    ------
    ValueError
        Sizes the config does not fit; "lowrank" without a basis or with one of another
        shape (the message names ``basis``).

    Examples
    --------
    >>> from pytrt_kv.retrieval.reference import calibrate_basis
    >>> cfg = RetrievalConfig(init_tokens=32, local_tokens=64, block_size=32, rank=8)
    >>> basis = calibrate_basis(np.random.default_rng(1).standard_normal((256, 2, 16)), 8)
    >>> pl = RetrievalPlanner(cfg, RetrievalSizes(batch=1, max_len=512), basis=basis)
    >>> pl.layout.topk, pl.layout.max_selected, pl.layout.width
    (7, 3, 512)
    """

    cfg: RetrievalConfig
    sizes: RetrievalSizes
    seed: int = 0  #: permutes the block tables (a real allocator hands out any blocks)
    basis: np.ndarray | None = field(default=None, repr=False)  #: lowrank ``[Hkv, D, r]``
    layout: StepLayout = field(init=False, repr=False)
    full_block_table: np.ndarray = field(init=False, repr=False)
    selection_block_table: np.ndarray = field(init=False, repr=False)
    status: np.ndarray = field(init=False, repr=False)
    lengths: np.ndarray = field(init=False, repr=False)
    modes: list[str] = field(init=False)
    block_repr: np.ndarray = field(init=False, repr=False)
    represented: np.ndarray = field(init=False, repr=False)
    history: list[list[StepRecord]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.sizes.validate(self.cfg)
        z, lay = self.sizes, StepLayout.of(self.sizes, self.cfg)
        if self.cfg.representation == LOWRANK:
            self.basis = check_basis(self.basis, z.kv_heads, z.head_dim, self.cfg.rank).copy()
        self.layout = lay
        rng = np.random.default_rng(self.seed)
        self.full_block_table = (
            rng.permutation(lay.full_blocks).astype(np.int32).reshape(z.batch, lay.full_max_blocks)
        )
        self.selection_block_table = (
            rng.permutation(lay.sel_blocks).astype(np.int32).reshape(z.batch, lay.topk)
        )
        self.status = np.full((z.batch, 1, 1, lay.topk + 1), -1, np.int32)
        self.lengths = np.zeros(z.batch, np.int32)
        self.modes = [DENSE] * z.batch
        self.block_repr = np.zeros((z.batch, lay.max_blocks, lay.width), np.float32)
        self.represented = np.zeros(z.batch, np.int64)
        self.history = [[] for _ in range(z.batch)]

    # --- caches ------------------------------------------------------------------------

    def empty_caches(self) -> dict[str, np.ndarray]:
        """Full and selection caches filled with :data:`SENTINEL`.

        Returns
        -------
        dict
            ``full_key_cache``/``full_value_cache`` ``[NBF, B, Hkv, D]``,
            ``selection_key_cache``/``selection_value_cache`` ``[SNB, B, Hkv*D]``.
        """
        z, lay = self.sizes, self.layout
        cdt = dtypes.numpy_dtype(z.dtype)
        full = (lay.full_blocks, lay.block_size, z.kv_heads, z.head_dim)
        sel = (lay.sel_blocks, lay.block_size, z.kv_heads * z.head_dim)
        return {
            "full_key_cache": np.full(full, SENTINEL, cdt),
            "full_value_cache": np.full(full, SENTINEL, cdt),
            "selection_key_cache": np.full(sel, SENTINEL, cdt),
            "selection_value_cache": np.full(sel, SENTINEL, cdt),
        }

    def slots(self, b: int, positions: Sequence[int] | np.ndarray) -> np.ndarray:
        """Full-cache slots (``block * B + offset``) of token positions of row b."""
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (pos.min() < 0 or pos.max() >= self.sizes.max_len):
            raise ValueError(
                f"positions: expected in [0, max_len = {self.sizes.max_len}), "
                f"got [{pos.min()}, {pos.max()}]"
            )
        B = self.layout.block_size
        return self.full_block_table[b, pos // B].astype(np.int64) * B + pos % B

    def start(
        self,
        b: int,
        prompt_keys: np.ndarray,
        prompt_values: np.ndarray,
        caches: dict[str, np.ndarray],
    ) -> str:
        """Start a sequence in row b after its (dense) prefill: writes the prompt's keys
        and values ``[P, Hkv, D]`` into the full caches, resets the row's status and
        representations; returns its R2 mode."""
        z = self.sizes
        k, v = np.asarray(prompt_keys), np.asarray(prompt_values)
        want = (z.kv_heads, z.head_dim)
        if k.ndim != 3 or k.shape[1:] != want or v.shape != k.shape:
            raise ValueError(
                f"prompt_keys, prompt_values: expected [P, {want[0]}, {want[1]}]"
                f" each, got {list(k.shape)} and {list(v.shape)}"
            )
        P = k.shape[0]
        if not 1 <= P < z.max_len:
            raise ValueError(
                f"prompt_keys: expected 1 <= P < max_len = {z.max_len} tokens, got {P}"
            )
        cdt = dtypes.numpy_dtype(z.dtype)
        slot = self.slots(b, np.arange(P))
        B = self.layout.block_size
        for name, x in (("full_key_cache", k), ("full_value_cache", v)):
            caches[name][slot // B, slot % B] = x.astype(cdt)
        self.status[b] = -1
        self.lengths[b] = P
        self.modes[b] = self.cfg.mode_for(P)
        self.represented[b] = 0
        self.block_repr[b] = 0.0
        self.history[b] = []
        return self.modes[b]

    def residency(self, b: int) -> str:
        """Where row b's full cache belongs: "host" (pinned, R2 offload) or "device"."""
        return "host" if self.modes[b] == SPARSE_OFFLOAD else "device"

    # --- one step ----------------------------------------------------------------------

    def _update_representations(self, b: int, nb: int, full_key_cache: np.ndarray) -> None:
        done = int(self.represented[b])
        if nb <= done:
            return
        B = self.layout.block_size
        end = self.cfg.init_tokens + nb * B
        # Blocks 0..nb-1 only (R3 ranges): the local tokens need not be complete yet.
        part = Partition(
            seq_len=end,
            init_end=self.cfg.init_tokens,
            num_blocks=nb,
            block_size=B,
            first_id=self.layout.first_id,
            local_start=end,
        )
        slot = self.slots(b, np.arange(end))
        keys = np.asarray(full_key_cache)[slot // B, slot % B]
        reps = block_representations(keys, part, self.cfg.representation, basis=self.basis)
        self.block_repr[b, done:nb] = reps[done:nb]
        self.represented[b] = nb

    def selected_count(self, b: int, nb: int) -> int:
        """k of row b for ``nb`` retrievable blocks (every block in "dense" mode)."""
        k = nb if self.modes[b] == DENSE else self.cfg.num_selected(nb)
        if k > self.layout.max_selected:
            raise ValueError(
                f"row {b}: {self.modes[b]} mode needs {k} recalled blocks at "
                f"length {self.lengths[b] + 1}, the step holds max_selected = "
                f"{self.layout.max_selected} (build it with a larger "
                "max_selected, or decode this row densely)"
            )
        return k

    def step_feeds(self, full_key_cache: np.ndarray) -> dict[str, np.ndarray]:
        """Planner-owned feeds of the next step (each row gains one token).

        Returns
        -------
        dict
            ``slot_mapping [batch]``, ``full_kv_block_table [batch, FMAX]``,
            ``full_kv_actual_seq [batch]`` (L, new token included), ``full_q_actual_seq``,
            ``block_repr [batch, NBMAX, W]``, ``retrievable_blocks [batch]``,
            ``selected_blocks [batch]``, ``selection_kv_block_table [batch, K]``,
            ``selection_kv_block_status [batch, 1, 1, K+1]`` (copies).
        """
        z = self.sizes
        L = self.lengths.astype(np.int64) + 1
        if (L > z.max_len).any() or (self.lengths < 1).any():
            raise ValueError(
                f"lengths: every row needs 1 <= length < max_len = {z.max_len} "
                f"(start() each row first), got {self.lengths.tolist()}"
            )
        nb = np.array([self.cfg.partition(int(x)).num_blocks for x in L], np.int32)
        k = np.array([self.selected_count(b, int(n)) for b, n in enumerate(nb)], np.int32)
        for b in range(z.batch):
            self._update_representations(b, int(nb[b]), full_key_cache)
        slot = np.array([self.slots(b, [int(L[b]) - 1])[0] for b in range(z.batch)], np.int32)
        return {
            "slot_mapping": slot,
            "full_kv_block_table": self.full_block_table.copy(),
            "full_kv_actual_seq": L.astype(np.int32),
            "full_q_actual_seq": np.arange(1, z.batch + 1, dtype=np.int32),
            "block_repr": self.block_repr.copy(),
            "retrievable_blocks": nb,
            "selected_blocks": k,
            "selection_kv_block_table": self.selection_block_table.copy(),
            "selection_kv_block_status": self.status.copy(),
        }

    def topk_rows(self, selected: Sequence[Sequence[int] | np.ndarray]) -> np.ndarray:
        """The ids a step feeds GatherSelectionKvCache for the given recalled blocks.

        Parameters
        ----------
        selected : per row, retrievable block indices j in R4 order

        Returns
        -------
        numpy.ndarray int32 ``[batch, 1, 1, K]``
            ``[init ids | first_id + j ... | local ids]``, each part padded with -1 to its
            static width (the layout of :func:`build_retrieval_decode_step`).
        """
        lay = self.layout
        out = np.full((self.sizes.batch, lay.topk), -1, np.int32)
        for b in range(self.sizes.batch):
            part = self.cfg.partition(int(self.lengths[b]) + 1)
            ids = list(part.init_ids())
            out[b, : len(ids)] = ids
            sel = [lay.first_id + int(j) for j in selected[b]]
            if len(sel) > lay.max_selected:
                raise ValueError(
                    f"selected[{b}]: expected at most {lay.max_selected} blocks, got {len(sel)}"
                )
            out[b, lay.init_blocks : lay.init_blocks + len(sel)] = sel
            loc = list(part.local_ids())
            out[
                b,
                lay.init_blocks + lay.max_selected : lay.init_blocks + lay.max_selected + len(loc),
            ] = loc
        return out.reshape(self.sizes.batch, 1, 1, lay.topk)

    def commit(
        self, topk_indices: np.ndarray, status_out: np.ndarray, actual_seq: np.ndarray
    ) -> list[StepRecord]:
        """Record a finished step: keep its status rows for the next one, count what was
        kept and copied (the G5 plan of the old status and the step's ids)."""
        lay, z = self.layout, self.sizes
        topk = np.asarray(topk_indices).reshape(z.batch, lay.topk)
        records = []
        for b in range(z.batch):
            L = int(self.lengths[b]) + 1
            plan = plan_row(
                self.status[b].reshape(-1).tolist(), topk[b].tolist(), L, 1, 0, lay.block_size
            )
            new = np.asarray(status_out).reshape(z.batch, lay.topk + 1)[b]
            if not np.array_equal(plan.status, new):
                raise ValueError(
                    f"status_out[{b}]: expected {plan.status.tolist()} (G5 plan "
                    f"of the old status and the step's ids), got {new.tolist()}"
                )
            ids = plan.status[: lay.topk]
            valid = ids >= 0
            copied = plan.copy & valid
            tail = L - (-(-L // lay.block_size) - 1) * lay.block_size
            max_id = -(-L // lay.block_size) - 1
            copied_tokens = int(sum(tail if v == max_id else lay.block_size for v in ids[copied]))
            sel = topk[b, lay.init_blocks : lay.init_blocks + lay.max_selected]
            rec = StepRecord(
                length=L,
                mode=self.modes[b],
                selected=[int(x) for x in sel if x >= 0],
                kept=int((valid & ~plan.copy).sum()),
                copied=int(copied.sum()),
                copied_tokens=copied_tokens,
                resident_tokens=int(np.asarray(actual_seq)[b]),
            )
            records.append(rec)
            self.history[b].append(rec)
        self.status[...] = np.asarray(status_out).reshape(self.status.shape)
        self.lengths += 1
        return records

    def offload_state(self) -> list[dict[str, object]]:
        """Per row: mode, where the full cache lives, tokens in it, tokens resident in
        the selection cache, blocks represented."""
        return [
            {
                "mode": self.modes[b],
                "full_cache": self.residency(b),
                "tokens": int(self.lengths[b]),
                "resident_tokens": int(self.status[b].reshape(-1)[-1])
                if self.status[b].reshape(-1)[-1] >= 0
                else 0,
                "represented_blocks": int(self.represented[b]),
            }
            for b in range(self.sizes.batch)
        ]
