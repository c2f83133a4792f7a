"""Gemma (1): RMSNorm times ``1 + weight`` computed in float32, embeddings multiplied by
``sqrt(hidden_size)`` (rounded to the activation dtype, as transformers does), GELU-tanh
MLP (``hidden_act``), ``attention_bias``; bidirectional attention is refused."""

from __future__ import annotations

import math
from typing import Any

from .spec import Family, full_rotary, refuse_unless


def _build(config: Any) -> dict[str, Any]:
    why = full_rotary(config)
    if why:
        raise NotImplementedError(f"config.rope_parameters: {why}")
    bias = bool(getattr(config, "attention_bias", False))
    return dict(
        norm_offset=1.0, embed_scale=math.sqrt(int(config.hidden_size)), qkv_bias=bias, o_bias=bias
    )


FAMILY = Family(
    name="gemma",
    model_types=("gemma",),
    implemented=frozenset({"head_dim", "attention_bias"}),
    refused={
        "use_bidirectional_attention": refuse_unless(
            "use_bidirectional_attention", lambda v: not v, "None or False (causal)"
        )
    },
    build=_build,
)
