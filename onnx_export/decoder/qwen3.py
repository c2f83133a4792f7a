"""Qwen3: RMSNorm over each query and key head (``q_norm``/``k_norm``) before RoPE,
``attention_bias`` (q, k, v, o), per-layer sliding windows as Qwen2."""

from __future__ import annotations

from typing import Any

from .qwen2 import WINDOW_FIELDS, windows
from .spec import Family, full_rotary


def _build(config: Any) -> dict[str, Any]:
    why = full_rotary(config)
    if why:
        raise NotImplementedError(f"config.rope_parameters: {why}")
    bias = bool(getattr(config, "attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias, qk_norm=True, windows=windows(config))


FAMILY = Family(
    name="qwen3",
    model_types=("qwen3",),
    implemented=WINDOW_FIELDS | {"head_dim", "attention_bias"},
    build=_build,
)
