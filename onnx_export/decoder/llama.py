"""Llama 1/2/3 (and SmolLM2): RoPE of every type in ``spec.ROPE_TYPES`` (llama3,
linear, dynamic, yarn from the model's own inverse frequencies), ``attention_bias`` (q,
k, v and o), ``mlp_bias`` (gate, up, down), ``hidden_act`` of the SiLU/GELU family."""

from __future__ import annotations

from typing import Any

from .spec import Family, full_rotary


def _build(config: Any) -> dict[str, Any]:
    why = full_rotary(config)
    if why:
        raise NotImplementedError(f"config.rope_parameters: {why}")
    bias = bool(getattr(config, "attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)))


FAMILY = Family(
    name="llama",
    model_types=("llama",),
    implemented=frozenset({"head_dim", "attention_bias", "mlp_bias"}),
    build=_build,
)
