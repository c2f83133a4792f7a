"""The transformers oracle the graphs are checked against: greedy generation with the
whole sequence recomputed each step (nothing of ours shared), one decode step read from
paged caches, and the RetrievalKV study's sparse attention."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np

from .families import decoder_spec


def reference_greedy(model: Any, prompt: list[int], tokens: int) -> tuple[list[int], np.ndarray]:
    """transformers' greedy decoding of ``tokens`` tokens (no early stop at EOS): the
    whole sequence is run again at each step (no cache), so nothing of ours is shared.
    Returns the tokens and the float32 logits ``[tokens, V]`` that chose them."""
    import torch  # noqa: PLC0415

    seq, logits = list(prompt), []
    with torch.no_grad():
        for _ in range(tokens):
            row = model(torch.tensor([seq]), use_cache=False).logits[0, -1].float().numpy()
            logits.append(row)
            seq.append(int(row.argmax()))
    return seq[len(prompt) :], np.stack(logits)


def reference_decode_step(model: Any, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The decode graph's outputs for ``feeds`` (any valid paged state, e.g. from
    ``pytrt_kv.graph.feeds.make_feeds``), computed by transformers and NumPy indexing, not
    by the graph: each sequence's past keys/values (positions ``< seq_lens[b] - 1``) are
    read from its pages into a ``DynamicCache``, the model runs its token at its position,
    and the new key/value rows transformers computes are written at ``slot_mapping[b]``
    of copies of the caches. float32 caches only. Returns ``logits`` and every
    ``*_cache_<i>_out``."""
    import torch  # noqa: PLC0415
    from transformers import DynamicCache  # noqa: PLC0415

    s = decoder_spec(model.config)
    tables, lens = feeds["block_tables"], feeds["seq_lens"]
    bs = feeds["key_cache_0"].shape[1]
    out = {f"{n}_out": feeds[n].copy() for n in feeds if "_cache_" in n}
    flat = {n: v.reshape(-1, s.kv_heads, s.head_dim) for n, v in out.items()}
    # transformers 5.x renames past_key_values to cache (the old name warns).
    arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    logits = []
    for b in range(len(lens)):
        past = np.arange(int(lens[b]) - 1)
        rows = tables[b, past // bs].astype(np.int64) * bs + past % bs
        cache = DynamicCache(config=model.config)
        for i in range(s.layers):
            # [rows, H, D] -> [1, H, rows, D], as transformers keeps them (keys after RoPE).
            kv = [
                torch.from_numpy(
                    np.ascontiguousarray(
                        feeds[f"{k}_cache_{i}"]
                        .reshape(-1, s.kv_heads, s.head_dim)[rows]
                        .transpose(1, 0, 2)[None]
                    )
                )
                for k in ("key", "value")
            ]
            cache.update(kv[0], kv[1], i)
        with torch.no_grad():
            res = model(
                input_ids=torch.tensor([[int(feeds["input_ids"][b])]]),
                position_ids=torch.tensor([[int(feeds["positions"][b])]]),
                use_cache=True,
                **{arg: cache},
            )
        logits.append(res.logits[0, -1].float().numpy())
        slot = int(feeds["slot_mapping"][b])
        for i in range(s.layers):
            layer: Any = cache.layers[i]  # updated in place with the token's key and value
            flat[f"key_cache_{i}_out"][slot] = layer.keys[0, :, -1].numpy()
            flat[f"value_cache_{i}_out"][slot] = layer.values[0, :, -1].numpy()
    return {"logits": np.stack(logits).astype(np.float32), **out}


def use_retrieval_attention(model: Any) -> Any:
    """Give ``model`` (any family) the RetrievalKV study's attention (dense until its
    state says otherwise); returns the state to set."""
    from pytrt_kv.retrieval.study import use_retrieval_attention  # noqa: PLC0415

    return use_retrieval_attention(model)


def reference_sparse_greedy(
    prompt: list[int],
    tokens: int,
    retrieval: Any,
    path: str | None = None,
    model: Any = None,
    basis: Any = None,
) -> tuple[list[int], np.ndarray]:
    """The RetrievalKV study's own implementation (transformers with its retrieval
    attention, method ``retrieval.representation``) generating ``tokens`` greedy tokens
    after ``prompt``: dense prompt rows, sparse rows after it, the whole sequence
    recomputed each step (no cache). ``model``: a transformers model to use (its
    attention is switched to the study's here), else SmolLM2 is loaded from ``path``.
    ``basis``: for "lowrank", the per-layer ``[Hkv, D, r]`` basis the graphs hold (the
    study then scores with the identical basis; without it, the one
    ``calibrate_lowrank`` left in the model's study state)."""
    import torch  # noqa: PLC0415

    if model is None:
        from .load import load_model  # noqa: PLC0415

        model, _ = load_model(path, cache=False)
    before = model.config._attn_implementation
    st = use_retrieval_attention(model)
    saved = st.basis
    if basis is not None:
        st.basis = {
            i: {"post": torch.from_numpy(np.array(b, np.float32))} for i, b in enumerate(basis)
        }
    st.method = retrieval.representation
    st.cfg = retrieval
    st.sparse_from = len(prompt)
    try:
        return reference_greedy(model, prompt, tokens)
    finally:
        st.method = "dense"
        st.basis = saved
        model.set_attn_implementation(before)  # the model's own attention again
