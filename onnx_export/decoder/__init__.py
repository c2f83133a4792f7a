"""Decoder LLMs as ONNX graphs over paged KV caches, from a transformers model.

One family module per architecture (:mod:`.llama`, :mod:`.mistral`, :mod:`.qwen2`,
:mod:`.qwen3`, :mod:`.gemma`, :mod:`.phi3`) declares which config fields it implements
and which it refuses (:mod:`.spec`); all share one block (:mod:`.block`): every layer
writes its key (after RoPE) and value with ``ScatterPaKvCache`` (nd layout, in place:
``key_cache_<i>`` -> ``key_cache_<i>_out``); the prefill attends over the batch's own
fresh keys/values, the decode step over the pages its block table names. The inputs are
what a serving engine has (docs/LLAMA.md):

- prefill: ``input_ids [T]``, ``positions [T]``, ``token_batch [T]`` (the sequence of each
  flattened token), ``slot_mapping [T]``, ``block_tables [B, W]``, ``last_token [B]`` (the
  flattened index of each sequence's last prompt token) -> ``logits [B, V]``;
- decode: ``input_ids [B]``, ``positions [B]``, ``slot_mapping [B]`` (one token each),
  ``block_tables [B, W]``, ``seq_lens [B]`` -> ``logits [B, V]``;

both with the 2 x L caches ``[NB, BS, H_kv, D]`` as inputs and outputs. T, B, W and NB
are dynamic. Token t attends to the positions of its sequence up to its own (and inside
its layer's sliding window). Rooms: :mod:`.load` (local folder / GGUF), :mod:`.export`
(the graphs), :mod:`.sparse` (RetrievalKV), :mod:`.runner` (paged cache, greedy
generation), :mod:`.oracle` (transformers references).
"""

from .export import KV_CACHE_DTYPES, export_decoder
from .families import FAMILIES, decoder_spec, family_of
from .load import ModelUnavailable, find_model, load_model, load_tokenizer
from .oracle import reference_decode_step, reference_greedy, reference_sparse_greedy
from .runner import (
    LOGIT_RTOL,
    BlockAllocator,
    DecoderRunner,
    Generation,
    check_capacity,
    compare_greedy,
    logit_bound,
    save_graphs,
)
from .sparse import selection_width
from .spec import NON_MATH, DecoderSpec, Family

__all__ = [
    "FAMILIES",
    "KV_CACHE_DTYPES",
    "LOGIT_RTOL",
    "compare_greedy",
    "logit_bound",
    "NON_MATH",
    "BlockAllocator",
    "DecoderRunner",
    "DecoderSpec",
    "Family",
    "Generation",
    "ModelUnavailable",
    "check_capacity",
    "decoder_spec",
    "export_decoder",
    "family_of",
    "find_model",
    "load_model",
    "load_tokenizer",
    "reference_decode_step",
    "reference_greedy",
    "reference_sparse_greedy",
    "save_graphs",
    "selection_width",
]
