"""What the study runs: its methods (a selector at one budget setting) and its settings
(:class:`StudySettings`, the presets :data:`SIZES`), the attended budget of a setting, and
the time estimates behind the progress lines."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..config import LOWRANK, MEAN, MINMAX, REPRESENTATIONS, RetrievalConfig
from .attention import AttentionState
from .scores import ALL_SELECTORS

#: The default methods: dense, the baselines and the selectors the full study compares.
SELECTORS = ("window", "random", "random_fixed", LOWRANK, MEAN, MINMAX, "mass", "oracle")
METHODS = ("dense",) + SELECTORS
ALL_METHODS = ("dense",) + ALL_SELECTORS


@dataclass(frozen=True)
class Method:
    """A selector at one budget setting (recall fraction, block size, init and local
    tokens), or ``dense``."""

    name: str  #: one of ALL_METHODS
    percent: float = 0.0  #: recall fraction (selectors)
    block_size: int = 128
    init_tokens: int = 128
    local_tokens: int = 896

    @property
    def setting(self) -> str:
        """``"10% B32 i128 l896"``: the budget setting (empty for dense)."""
        if self.name == "dense":
            return ""
        return (
            f"{self.percent * 100:g}% B{self.block_size} i{self.init_tokens} l{self.local_tokens}"
        )

    @property
    def label(self) -> str:
        return f"{self.name} {self.setting}" if self.setting else "dense"

    def config(self) -> RetrievalConfig:
        """The R1 configuration of this method (dense: no retrievable block recalled)."""
        base = self.name.removesuffix("_head")
        return RetrievalConfig(
            init_tokens=self.init_tokens,
            local_tokens=self.local_tokens,
            block_size=self.block_size,
            topk_percent=self.percent if self.name != "dense" else 0.0,
            dense_boundary=0,
            offload_boundary=0,
            representation=base if base in REPRESENTATIONS else MEAN,
        )


def budget_tokens(cfg: RetrievalConfig, length: int) -> int:
    """Tokens a sparse step attends at sequence length ``length``: init + k blocks + the
    local part (R3, R4, R6); the same for every selector of one configuration."""
    nb = max(0, (length - cfg.local_tokens - cfg.init_tokens) // cfg.block_size)
    return length - (nb - cfg.num_selected(nb)) * cfg.block_size


#: A budget setting: (recall fraction, block size, init tokens, local tokens).
Setting = tuple[float, int, int, int]


@dataclass
class StudySettings:
    """What to run. The defaults are the full study of docs/RETRIEVAL.md (the estimate:
    :func:`estimate_seconds`); :data:`SIZES` holds the smaller ones.

    Trial i of the n at a length puts its needle at depth ``(i + 0.5) / n`` of the
    retrievable span: depths spread evenly over all of it. Every trial runs every
    method at each of ``settings``; the trials spread evenly over ``curve_trials`` per
    length also run the curve settings (recall fractions and block sizes around the
    first setting)."""

    lengths: Sequence[int] = (2048, 4096, 8000)  #: needle-grid context lengths (tokens)
    trials: Sequence[int] = (30, 30, 80)  #: single-needle trials per length
    #: Budget settings run on every trial: the main one (22% attended at 8000 tokens)
    #: and a tight one (init 64 + local 448 + 512 recalled: 12.8% at 8000 tokens).
    settings: Sequence[Setting] = ((0.1, 32, 128, 896), (0.068, 32, 64, 448))
    curve_percents: Sequence[float] = (0.05, 0.2, 0.3, 0.5)  #: at the first setting
    curve_block_sizes: Sequence[int] = (8, 16, 64, 128)  #: at the first setting
    curve_trials: int = 6  #: per length, evenly spread, also run the curve settings
    multi_lengths: Sequence[int] = (4096,)  #: multi-key and multi-value contexts
    multi_trials: int = 10  #: per length and task
    num_keys: int = 4  #: multi-key: needles with different keys, one asked
    num_values: int = 3  #: multi-value: needles with one key, all values asked
    methods: Sequence[str] = METHODS
    loss_context: int = 0  #: tokens of the loss text; 0 (default): no loss task
    loss_tokens: int = 1024  #: tokens scored at the end of the loss text
    seed: int = 0

    @property
    def main(self) -> Setting:
        return self.settings[0]

    def trials_at(self, length: int) -> int:
        """Single-needle trials at ``length`` (``trials`` has one per length, or one)."""
        t = list(self.trials)
        if len(t) == 1:
            return int(t[0])
        if len(t) != len(self.lengths):
            raise ValueError(
                f"trials: expected one count or one per length ({len(self.lengths)}), got {t}"
            )
        return int(t[list(self.lengths).index(length)])

    def main_methods(self) -> list[Method]:
        return self._methods(list(dict.fromkeys(self.settings)))

    def curve_methods(self) -> list[Method]:
        p, b, init, local = self.main
        grid: list[Setting] = list(self.settings)
        grid += [(x, b, init, local) for x in self.curve_percents]
        grid += [(p, x, init, local) for x in self.curve_block_sizes]
        return self._methods(list(dict.fromkeys(grid)))

    def _methods(self, grid: list) -> list[Method]:
        for name in self.methods:
            if name not in ALL_METHODS:
                raise ValueError(f"methods: expected names in {list(ALL_METHODS)}, got {name!r}")
        out = [Method("dense")] if "dense" in self.methods else []
        for p, b, init, local in grid:
            if not 0 < p <= 1 or b < 1 or init % b or local < 1:
                raise ValueError(
                    f"settings: expected 0 < percent <= 1, a block size dividing init_tokens "
                    f"and local_tokens >= 1, got {p}, {b}, {init}, {local}"
                )
            out += [Method(n, p, b, init, local) for n in self.methods if n in ALL_SELECTORS]
        return out

    def max_block(self) -> int:
        return max([s[1] for s in self.settings] + list(self.curve_block_sizes))

    def span_windows(self) -> tuple[int, int]:
        """The largest init and local tokens of the settings: needles lie outside both."""
        return max(s[2] for s in self.settings), max(s[3] for s in self.settings)


#: ``pytrt-kv study --size``: the full study is the default.
SIZES = {
    "full": {},
    "medium": dict(trials=(10, 10, 20), curve_trials=2, multi_trials=4),
    "quick": dict(
        lengths=(2048,), trials=(6,), curve_trials=1, multi_lengths=(2048,), multi_trials=2,
    ),
}  # fmt: skip


def set_method(st: AttentionState, m: Method, sparse_from: int, seed: int = 0) -> None:
    """Point the model's attention at method ``m`` from position ``sparse_from``."""
    st.method = m.name
    st.cfg = m.config()
    st.sparse_from = sparse_from
    st.seed = seed
