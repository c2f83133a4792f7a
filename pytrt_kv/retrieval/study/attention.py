"""The study's retrieval attention: a ``transformers.AttentionInterface`` function that
decodes every row after ``sparse_from`` over init + the k blocks its method selects +
local (docs/SPEC.md R3, R4, R6), with the model's own scaling. What it does is the
model's own :class:`AttentionState`, attached to the model and its attention layers."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..config import RetrievalConfig
from .scores import HEAD_SELECTORS, selector_scores

ATTENTION_NAME = "pytrt_kv_retrieval"
#: The attribute of the model and of each of its attention layers holding their state.
STATE_ATTR = "pytrt_kv_retrieval"


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
    #: Study candidates beyond the keys (docs/RETRIEVAL.md, the exploration): with
    #: ``heavy_window > 0`` a dense prefill records, per layer, the attention each key
    #: received from the ``heavy_window`` queries after it (``heavy4``); ``inv_freq``:
    #: the model's RoPE frequencies (``prerope``), set by ``load_model``.
    heavy_window: int = 0
    importance: dict = field(default_factory=dict)
    inv_freq: object = None
    #: ``*_cal`` candidates: per layer ``{"post": [Hkv, D, r], "pre": [Hkv, D, r]}``
    #: (:func:`calibrate`); ``record``: a dict that a dense prefill fills with each
    #: layer's keys ``[Hkv, L, D]`` (what :func:`calibrate` reads).
    basis: dict = field(default_factory=dict)
    record: dict | None = None


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


def use_retrieval_attention(model) -> AttentionState:
    """Give ``model`` (any transformers decoder) this attention, dense until its state
    says otherwise; returns its :class:`AttentionState` (the one it has, else a new one)."""
    register_attention()
    model.set_attn_implementation(ATTENTION_NAME)
    state = getattr(model, STATE_ATTR, None)
    if isinstance(state, AttentionState):
        return state
    return use_attention_state(model, AttentionState())


def register_attention() -> None:
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
            if st.record is not None:
                st.record[getattr(module, "layer_idx", 0)] = k[0].detach().float()
            if st.heavy_window > 0:
                st.importance[getattr(module, "layer_idx", 0)] = received_attention(
                    q[0], k[0], G, scale, st.heavy_window
                )
        else:
            pos = torch.arange(start + n_dense, device=q.device)
            mask = pos[None, :] <= (start + torch.arange(n_dense, device=q.device))[:, None]
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


def calibrate(st: AttentionState, keys: dict, rank: int, skip: int = 0) -> None:
    """Fill ``st.basis`` from a dense prefill's keys (``st.record``, per layer ``[Hkv, L,
    D]``): the top-``rank`` right singular vectors of each KV head's keys after the first
    ``skip`` tokens, post-RoPE (``"post"``) and with RoPE undone (``"pre"``, needs
    ``st.inv_freq``)."""
    from .scores import rope, top_basis

    for layer, k in keys.items():
        b = {"post": top_basis(k[:, skip:], rank)}
        if st.inv_freq is not None:
            b["pre"] = top_basis(rope(k, st.inv_freq, -1.0)[:, skip:], rank)
        st.basis[layer] = b


def received_attention(q, k, G: int, scale: float, window: int, chunk: int = 512):
    """``[Hkv, L]``: the causal attention each key received from the ``window`` queries
    after it, summed over them and over its KV head's query heads (q ``[Hq, L, D]``, k
    ``[Hkv, L, D]``, the same positions): InfLLM's measure of a block's representative
    keys."""
    import torch

    Hq, L, D = q.shape
    Hkv = k.shape[0]
    out = torch.zeros(Hkv, L, device=q.device)
    for i0 in range(0, L, chunk):
        i1 = min(L, i0 + chunk)
        i = torch.arange(i0, i1, device=q.device)[:, None]
        j = torch.arange(i1, device=q.device)[None, :]
        s = torch.matmul(
            q[:, i0:i1].float().reshape(Hkv, G, i1 - i0, D),
            k[:, None, :i1].float().transpose(-1, -2),
        )
        p = torch.softmax(s.mul(scale).masked_fill(j > i, float("-inf")), dim=-1)
        near = (j < i) & (j >= i - window)
        out[:, :i1] += (p * near).sum(dim=(1, 2))
    return out


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
    dev = q.device
    t = t0 + torch.arange(c, device=dev)  # absolute positions
    L = t + 1
    nb = torch.clamp((L - cfg.local_tokens - init) // Bs, min=0)  # R3 per row
    nb_max = int(nb.max())
    j = torch.arange(Lk, device=dev)
    causal = j[None, :] <= t[:, None]
    allowed = causal & ((j[None, :] < min(init, Lk)) | (j[None, :] >= (init + nb * Bs)[:, None]))
    if nb_max:
        ksel = torch.tensor([cfg.num_selected(int(n)) for n in nb.tolist()], device=dev)
        valid = torch.arange(nb_max, device=dev)[None, :] < nb[:, None]
        seed = st.seed * 1_000_003 + t0 + (0 if st.method == "random_fixed" else layer * 8191)
        extra = {
            "importance": st.importance.get(layer),
            "inv_freq": st.inv_freq,
            "basis": st.basis.get(layer),
        }
        scores = selector_scores(
            st.method, cfg, q, k, causal, allowed, valid, G, scale, seed, reps_cache, extra
        )
        scores = scores.masked_fill(~valid, float("-inf"))
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
        rank = torch.empty_like(order)
        rank.scatter_(-1, order, torch.arange(nb_max, device=dev).expand(order.shape).contiguous())
        chosen = rank < ksel[:, None]  # [(Hkv,) c, nb_max]; ties to the lower id (R4)
        tok = torch.zeros(*chosen.shape[:-1], Lk, dtype=torch.bool, device=dev)
        tok[..., init : init + nb_max * Bs] = chosen.repeat_interleave(Bs, dim=-1)
        allowed = allowed | (tok & causal)
        if st.method in HEAD_SELECTORS:  # per KV head: each query head uses its group's
            allowed = allowed.repeat_interleave(G, dim=0)
    out = torch.nn.functional.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=allowed, scale=scale, enable_gqa=True
    )
    return out[0]
