"""RetrievalKV configuration, mode and partition (docs/SPEC.md R1-R4).

Decisions where the specification is silent:

* ``from_env`` reads the seed's five names (``VLLM_RETRIEVAL_INIT_TOKENS_NUM``,
  ``..._LOCAL_TOKENS_NUM``, ``..._TOPK_PERCENT``, ``..._DENSE_BOUNDARY``,
  ``..._OFFLOAD_BOUNDARY``) plus two of our own for what the seed fixes elsewhere
  (``VLLM_RETRIEVAL_BLOCK_SIZE``, ``VLLM_RETRIEVAL_REPRESENTATION``). Token counts accept a
  ``K`` suffix (``32K`` = 32768), as the seed writes its defaults.
* ``topk_percent`` may be 0 (window only: init + local) up to 1 (every block: dense).
* ``local_tokens >= 1``: the current token is always in local, so it is always attended
  and every retrievable block is complete in the cache when the step scores it.
* ``num_selected`` is ``ceil(topk_percent * nb)`` computed so that a product that is an
  integer in decimal (``0.1 * 30``) is not rounded up by binary floating point.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from fractions import Fraction
from typing import Any

#: R2 modes.
DENSE = "dense"
SPARSE = "sparse"
SPARSE_OFFLOAD = "sparse_offload"
MODES = (DENSE, SPARSE, SPARSE_OFFLOAD)

#: R5 representations (the first is the default: the study's best, docs/RETRIEVAL.md).
LOWRANK = "lowrank"
MINMAX = "minmax"
MEAN = "mean"
MASS = "mass"
REPRESENTATIONS = (LOWRANK, MEAN, MINMAX, MASS)

#: Environment variable of each field (the first five are the seed's names).
ENV_NAMES = {
    "init_tokens": "VLLM_RETRIEVAL_INIT_TOKENS_NUM",
    "local_tokens": "VLLM_RETRIEVAL_LOCAL_TOKENS_NUM",
    "topk_percent": "VLLM_RETRIEVAL_TOPK_PERCENT",
    "dense_boundary": "VLLM_RETRIEVAL_DENSE_BOUNDARY",
    "offload_boundary": "VLLM_RETRIEVAL_OFFLOAD_BOUNDARY",
    "block_size": "VLLM_RETRIEVAL_BLOCK_SIZE",
    "representation": "VLLM_RETRIEVAL_REPRESENTATION",
    "rank": "VLLM_RETRIEVAL_LOWRANK_RANK",
}


def _int(arg: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{arg}: expected an int, got {v!r}")
    return v


@dataclass(frozen=True)
class RetrievalConfig:
    """R1 configuration (defaults from the seed).

    Attributes
    ----------
    init_tokens : int
        First tokens always attended (a multiple of ``block_size``).
    local_tokens : int
        Sliding window: the most recent tokens always attended (at least this many).
    topk_percent : float
        Fraction of the retrievable blocks recalled per step, in [0, 1].
    block_size : int
        B, tokens per retrievable block (GatherSelectionKvCache TBS).
    dense_boundary, offload_boundary : int
        R2 prompt-length boundaries.
    representation : str
        A name of :data:`REPRESENTATIONS` (R5); default "lowrank".
    rank : int
        r, numbers per key and KV head of the "lowrank" representation (its basis is
        ``[Hkv, D, r]``, r <= D; R5); default 32. Ignored by the other representations.

    Examples
    --------
    >>> cfg = RetrievalConfig(init_tokens=128, local_tokens=896, block_size=128)
    >>> p = cfg.partition(4096)
    >>> p.num_blocks, p.local_start, cfg.num_selected(p.num_blocks)
    (24, 3200, 5)
    """

    init_tokens: int = 1024
    local_tokens: int = 7192
    topk_percent: float = 0.2
    block_size: int = 128
    dense_boundary: int = 32768
    offload_boundary: int = 65536
    representation: str = LOWRANK
    rank: int = 32

    def __post_init__(self) -> None:
        for name in (
            "init_tokens",
            "local_tokens",
            "block_size",
            "dense_boundary",
            "offload_boundary",
            "rank",
        ):
            _int(name, getattr(self, name))
        if self.rank < 1:
            raise ValueError(f"rank: expected >= 1, got {self.rank}")
        if self.block_size < 1:
            raise ValueError(f"block_size: expected >= 1, got {self.block_size}")
        for name in ("init_tokens", "local_tokens", "dense_boundary", "offload_boundary"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected >= 0, got {getattr(self, name)}")
        if self.local_tokens < 1:
            raise ValueError(
                "local_tokens: expected >= 1 (the current token is always local: with 0, "
                "the block holding it would be retrievable, scored before its key is "
                f"cached and attended only when recalled), got {self.local_tokens}"
            )
        if self.init_tokens % self.block_size:
            raise ValueError(
                f"init_tokens: expected a multiple of block_size = "
                f"{self.block_size} (docs/SPEC.md R3), got {self.init_tokens}"
            )
        if isinstance(self.topk_percent, bool) or not isinstance(self.topk_percent, (int, float)):
            raise TypeError(f"topk_percent: expected a float, got {self.topk_percent!r}")
        if not 0.0 <= float(self.topk_percent) <= 1.0:
            raise ValueError(
                f"topk_percent: expected a fraction in [0, 1], got {self.topk_percent}"
            )
        if self.offload_boundary < self.dense_boundary:
            raise ValueError(
                f"offload_boundary: expected >= dense_boundary = "
                f"{self.dense_boundary}, got {self.offload_boundary}"
            )
        if self.representation not in REPRESENTATIONS:
            raise ValueError(
                f"representation: expected one of {list(REPRESENTATIONS)}, got "
                f"{self.representation!r}"
            )

    # --- construction ----------------------------------------------------------------

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> RetrievalConfig:
        """Defaults overridden by the ``VLLM_RETRIEVAL_*`` variables (see ``ENV_NAMES``),
        then by keyword ``overrides``.

        Raises
        ------
        ValueError
            A variable that does not parse; the message names it.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            var = ENV_NAMES[f.name]
            raw = env.get(var)
            if raw is None or raw.strip() == "":
                continue
            raw = raw.strip()
            try:
                if f.name == "topk_percent":
                    values[f.name] = float(raw)
                elif f.name == "representation":
                    values[f.name] = raw.lower()
                else:
                    values[f.name] = _parse_tokens(raw)
            except ValueError:
                want = {
                    "topk_percent": "a float in [0, 1]",
                    "representation": f"one of {list(REPRESENTATIONS)}",
                }.get(f.name, "a token count such as 1024 or 32K")
                raise ValueError(f"{var}: expected {want}, got {raw!r}") from None
        values.update(overrides)
        try:
            return cls(**values)
        except (TypeError, ValueError) as exc:
            name = str(exc).split(":", 1)[0]
            if name in values and name not in overrides:
                raise type(exc)(f"{ENV_NAMES[name]} ({exc})") from None
            raise

    def with_(self, **changes) -> RetrievalConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    # --- R2 - R4 -----------------------------------------------------------------------

    def mode_for(self, prompt_len: int) -> str:
        """R2: ``"dense"``, ``"sparse"`` or ``"sparse_offload"`` for a prompt of
        ``prompt_len`` tokens (prefill itself is always dense)."""
        _int("prompt_len", prompt_len)
        if prompt_len < 0:
            raise ValueError(f"prompt_len: expected >= 0, got {prompt_len}")
        if prompt_len < self.dense_boundary:
            return DENSE
        if prompt_len < self.offload_boundary:
            return SPARSE
        return SPARSE_OFFLOAD

    def partition(self, seq_len: int) -> Partition:
        """R3 partition of the current length ``seq_len`` (tokens cached, the current one
        included)."""
        _int("seq_len", seq_len)
        if seq_len < 0:
            raise ValueError(f"seq_len: expected >= 0, got {seq_len}")
        B = self.block_size
        nb = max(0, (seq_len - self.local_tokens - self.init_tokens) // B)
        return Partition(
            seq_len=seq_len,
            init_end=min(self.init_tokens, seq_len),
            num_blocks=nb,
            block_size=B,
            first_id=self.init_tokens // B,
            local_start=min(seq_len, self.init_tokens + nb * B),
        )

    def num_selected(self, num_blocks: int) -> int:
        """R4: ``k = ceil(topk_percent * nb)`` (exact for decimal fractions)."""
        _int("num_blocks", num_blocks)
        if num_blocks < 0:
            raise ValueError(f"num_blocks: expected >= 0, got {num_blocks}")
        frac = Fraction(repr(float(self.topk_percent)))
        return min(num_blocks, math.ceil(frac * num_blocks))

    def max_selected(self, max_len: int) -> int:
        """Largest ``k`` over every length up to ``max_len`` (a static TopK size)."""
        return self.num_selected(self.partition(max_len).num_blocks)


def _parse_tokens(raw: str) -> int:
    s = raw.strip()
    mult = 1
    if s[-1:] in ("k", "K"):
        s, mult = s[:-1], 1024
    value = int(s, 10)
    return value * mult


@dataclass(frozen=True)
class Partition:
    """R3 partition of a sequence of ``seq_len`` tokens.

    ``[0, init_end)`` is init; retrievable block j (``0 <= j < num_blocks``) covers
    ``[init_end + j*B, init_end + (j+1)*B)`` and is GatherSelectionKvCache id
    ``first_id + j`` (TBS = B); ``[local_start, seq_len)`` is local.
    """

    seq_len: int
    init_end: int
    num_blocks: int
    block_size: int
    first_id: int
    local_start: int

    def block_tokens(self, j: int) -> range:
        """Token positions of retrievable block j."""
        if not 0 <= j < self.num_blocks:
            raise ValueError(f"j: expected a block in [0, {self.num_blocks}), got {j}")
        start = self.init_end + j * self.block_size
        return range(start, start + self.block_size)

    @property
    def max_id(self) -> int:
        """Id (TBS units) of the block holding the newest token; -1 when empty."""
        return -(-self.seq_len // self.block_size) - 1

    def init_ids(self) -> range:
        """Ids (TBS units) of the init tokens."""
        return range(0, -(-self.init_end // self.block_size))

    def local_ids(self) -> range:
        """Ids (TBS units) of the local tokens (the last one may be partial)."""
        return (
            range(self.first_id + self.num_blocks, self.max_id + 1)
            if self.seq_len > self.init_end
            else range(0)
        )

    def attended(self, selected_blocks) -> list[int]:
        """Token positions attended with the given retrievable blocks (ascending)."""
        pos = list(range(self.init_end))
        for j in sorted(int(j) for j in selected_blocks):
            pos.extend(self.block_tokens(j))
        pos.extend(range(self.local_start, self.seq_len))
        return pos
