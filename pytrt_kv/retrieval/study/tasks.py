"""The study's tasks: needle-in-a-haystack (single, RULER-style multi-key and
multi-value) and next-token loss, each method fed the same prompt; the progress clock and
the time estimates."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .attention import attention_state
from .methods import Method, StudySettings, budget_tokens, set_method
from .model import StudyUnavailable, crop, forward, study_text

#: Keys of the needles ("the pass key for <key> is <5 digits>", RULER-style keys).
NEEDLE_KEYS = (
    "apple", "river", "candle", "garden", "falcon", "marble", "violin", "harbor",
    "pepper", "lantern", "meadow", "copper", "thunder", "saddle", "orchid", "glacier",
    "pillow", "walnut", "compass", "tractor", "velvet", "canyon", "mirror", "banjo",
)  # fmt: skip
#: Dense attention everywhere (prefill, and the dense reference).
DENSE = Method("dense")
NEVER = 1 << 62


@dataclass
class Trial:
    """One needle prompt: ``task`` ("single", "multikey", "multivalue"), its length and
    depth (fraction of the retrievable span; multi-needle tasks draw theirs)."""

    task: str
    length: int
    depth: float
    index: int  #: trial number within its task and length
    curves: bool  #: also run the curve settings


def retrievable_span(settings: StudySettings, prompt_tokens: int) -> tuple[int, int]:
    """Token range ``[lo, hi)`` that lies in retrievable blocks (not init, not local) for
    every setting and block size studied, at the first sparse query (sequence length
    prompt + 1)."""
    b = settings.max_block()
    init, local = settings.span_windows()
    nb = (prompt_tokens + 1 - local - init) // b
    return init, init + max(0, nb) * b


def place_needles(
    settings: StudySettings, hay: list[int], intro: list[int], needles: list[list[int]],
    depths: list[float], prompt_tokens: int,
) -> list[int]:  # fmt: skip
    """``intro`` + haystack with ``needles`` at ``depths`` (fractions of the retrievable
    span), ``prompt_tokens`` long. Raises ``ValueError`` if a needle would touch init or
    local at question time (for any setting studied) or if the haystack is short."""
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


def needle_prompt(tok, trial: Trial, settings: StudySettings, hay_ids: list[int], rng):
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


def make_trials(settings: StudySettings) -> list[Trial]:
    """Single needles: per length n trials at depths ``(i + 0.5) / n``, ``curve_trials``
    of them (evenly spread) with the curve settings; then multi-key and multi-value."""
    out = []
    for length in settings.lengths:
        n = settings.trials_at(length)
        c = min(settings.curve_trials, n)
        out += [
            Trial("single", length, (i + 0.5) / n, i, (i * c) % n < c and c > 0) for i in range(n)
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
LOAD_S = 20.0


def calibration_cost(settings: StudySettings) -> float:
    """Estimated seconds of the "lowrank" calibration (a dense prefill of the calibration
    text, ``calibration.CALIBRATION_TOKENS``), when the study runs that method."""
    from ..config import LOWRANK
    from .calibration import CALIBRATION_TOKENS

    return trial_cost(CALIBRATION_TOKENS, 0) if LOWRANK in settings.methods else 0.0


def estimate_seconds(settings: StudySettings) -> float:
    """Estimated seconds of the whole study on 2 idle CPU cores, model load included."""
    main, curves = len(settings.main_methods()), len(settings.curve_methods())
    return (
        LOAD_S
        + calibration_cost(settings)
        + loss_cost(settings)
        + sum(trial_cost(t.length, curves if t.curves else main) for t in make_trials(settings))
    )


class Clock:
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


def _budget(m: Method, length: int) -> float:
    return budget_tokens(m.config(), length) / length if m.name != "dense" else 1.0


def run_needles(model, tok, settings: StudySettings, progress=None, clock=None) -> list[dict]:
    """Every needle trial; one row per (trial, method) with the values found (a value is
    found when each of its tokens is the argmax given the answer's tokens before it:
    what greedy decoding would write, checked teacher-forced in one forward)."""
    import torch
    from transformers import DynamicCache

    st = attention_state(model)
    hay_ids = tok(study_text(settings.seed), add_special_tokens=False).input_ids
    trials = make_trials(settings)
    main, curves = settings.main_methods(), settings.curve_methods()
    cost = [trial_cost(t.length, len(curves if t.curves else main)) for t in trials]
    clock = clock or Clock(progress, sum(cost))
    rows: list[dict] = []
    for ti, trial in enumerate(trials):
        rng = np.random.default_rng([settings.seed, ti])
        prompt, question, answer, ranges = needle_prompt(tok, trial, settings, hay_ids, rng)
        P = len(prompt)
        cache = DynamicCache()
        set_method(st, DENSE, NEVER)
        forward(model, torch.tensor([prompt]), cache)
        feed = torch.tensor([question + answer[:-1]])
        for m in curves if trial.curves else main:
            set_method(st, m, P, seed=settings.seed * 7919 + ti)
            logits = forward(model, feed, cache).logits[0, len(question) - 1 :]
            crop(cache, P)
            ok = (logits.argmax(dim=-1) == torch.tensor(answer)).tolist()
            found = [all(ok[a:b]) for a, b in ranges]
            rows.append(
                {
                    "task": trial.task,
                    "length": trial.length,
                    "depth": trial.depth,
                    "trial": ti,
                    "method": m.label,
                    "name": m.name,
                    "setting": m.setting,
                    "percent": m.percent,
                    "block_size": m.block_size,
                    "budget": _budget(m, P + 1),
                    "found": int(sum(found)),
                    "values": len(found),
                }
            )
        clock.step(
            cost[ti],
            f"trial {ti + 1} of {len(trials)} ({trial.task} {trial.length} tokens depth "
            f"{trial.depth:.3g} #{trial.index})",
        )
    return rows


def run_loss(model, tok, settings: StudySettings, progress=None, clock=None) -> list[dict]:
    """Teacher-forced loss and top-1 agreement with dense over the last ``loss_tokens``
    tokens of a ``loss_context``-token text (:func:`study_text`, dense prefill of the
    rest), for the curve settings; per-token losses kept for the intervals."""
    import torch
    from transformers import DynamicCache

    from .statistics import segment_ci

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
    set_method(st, DENSE, NEVER)
    forward(model, torch.tensor([ids[: P - 1]]), cache)
    target = torch.tensor(ids[P:])
    rows, dense_top = [], None
    methods = settings.curve_methods()
    if "dense" not in settings.methods:
        methods = [DENSE] + methods
    clock = clock or Clock(progress, loss_cost(settings))
    pending = trial_cost(N, 0)  # the prefill, counted with the first pass
    for i, m in enumerate(methods):
        set_method(st, m, P - 1, seed=settings.seed * 7919)
        logits = forward(model, torch.tensor([ids[P - 1 : N - 1]]), cache).logits[0]
        crop(cache, P - 1)
        # Row i (token P-1+i, decoded sparse) predicts token P+i.
        nll = torch.nn.functional.cross_entropy(logits, target, reduction="none")
        top = logits.argmax(dim=-1)
        if dense_top is None:
            dense_top, dense_nll = top, nll
        rows.append(
            {
                "method": m.label,
                "name": m.name,
                "setting": m.setting,
                "percent": m.percent,
                "block_size": m.block_size,
                "budget": _budget(m, (P + N) // 2),
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
