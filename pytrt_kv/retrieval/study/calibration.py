"""The basis of the "lowrank" representation (docs/SPEC.md R5): a constant of the model,
calibrated once on a text of another kind than the contexts it will score
(docs/RETRIEVAL.md "A basis fixed per model is as good"; Loki's calibration).

Per layer and KV head, the top-r right singular vectors of the post-RoPE keys of one
dense prefill of the calibration text, its first :data:`CALIBRATION_SKIP` tokens left out
(the first keys of a sequence are outliers: attention sinks). The default text is the
source code of the standard library's ``argparse`` module, its first
:data:`CALIBRATION_TOKENS` tokens: shipped with every CPython, and code, where the
study's haystack is English prose.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: The module whose source is the default calibration text.
CALIBRATION_MODULE = "argparse"
#: Tokens of the calibration text used (its first ones).
CALIBRATION_TOKENS = 4096
#: Leading tokens whose keys the basis leaves out.
CALIBRATION_SKIP = 128


def calibration_ids(tok: Any, tokens: int = CALIBRATION_TOKENS) -> list[int]:
    """The first ``tokens`` token ids of the calibration text under tokenizer ``tok``."""
    import importlib
    import inspect

    source = inspect.getsource(importlib.import_module(CALIBRATION_MODULE))
    ids = list(tok(source, add_special_tokens=False).input_ids[:tokens])
    if len(ids) <= CALIBRATION_SKIP:
        raise ValueError(
            f"tokens: expected more than {CALIBRATION_SKIP} calibration tokens, got {len(ids)}"
        )
    return ids


def _config_head_dim(config: Any) -> int | None:
    """A transformers config's head dimension (``head_dim``, else hidden size over
    heads); None when it names neither."""
    hd = getattr(config, "head_dim", None)
    if isinstance(hd, int) and hd > 0:
        return hd
    hidden, heads = (
        getattr(config, "hidden_size", None),
        getattr(config, "num_attention_heads", None),
    )
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return None


def calibrate_lowrank(
    model: Any, ids: list[int] | np.ndarray, rank: int, skip: int = CALIBRATION_SKIP
) -> list[np.ndarray]:
    """The "lowrank" basis of ``model`` (any transformers decoder): one dense prefill of
    ``ids``; per layer a float32 ``[Hkv, D, rank]`` array (orthonormal columns per KV
    head), the top-``rank`` right singular vectors of the layer's post-RoPE keys after the
    first ``skip`` tokens. Also sets the model's study state (``AttentionState.basis``),
    so that the study's "lowrank" method uses this basis. The model's attention
    implementation is restored afterwards.

    Raises
    ------
    ValueError
        ``rank`` not in ``[1, min(D, tokens after skip)]``, or ids too short.
    """
    import torch

    from .attention import use_retrieval_attention
    from .scores import top_basis

    ids = [int(x) for x in np.asarray(ids).reshape(-1)]
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank: expected an int >= 1, got {rank!r}")
    if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
        raise ValueError(f"skip: expected an int >= 0, got {skip!r}")
    if len(ids) - skip < rank:
        raise ValueError(
            f"ids: expected at least skip + rank = {skip + rank} calibration tokens, got {len(ids)}"
        )
    head_dim = _config_head_dim(model.config)
    if head_dim is not None and rank > head_dim:  # refused before the prefill
        raise ValueError(f"rank: expected <= head_dim = {head_dim}, got {rank}")
    before = model.config._attn_implementation
    st = use_retrieval_attention(model)
    method, st.method, st.record = st.method, "dense", {}
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            model(torch.tensor([ids], device=device), use_cache=False)
        keys = st.record
    finally:
        st.method, st.record = method, None
        model.set_attn_implementation(before)
    if not keys:
        raise ValueError("model: its attention layers recorded no keys (not a decoder?)")
    out = []
    for layer in sorted(keys):
        k = keys[layer][:, skip:]  # [Hkv, L - skip, D]
        if rank > k.shape[-1]:  # a config whose head_dim is not its keys'
            raise ValueError(f"rank: expected <= head_dim = {k.shape[-1]}, got {rank}")
        basis = top_basis(k, rank)  # [Hkv, D, r]
        st.basis[layer] = {"post": basis}
        out.append(basis.detach().cpu().numpy().astype(np.float32))
    return out
