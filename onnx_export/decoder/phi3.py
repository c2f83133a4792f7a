"""Phi-3: fused ``qkv_proj`` (q, k, v rows in that order) and ``gate_up_proj`` (gate
rows, then up), RoPE on the leading ``partial_rotary_factor`` of each head, a sliding
window on every layer when ``sliding_window`` is set. "longrope" (Phi-3 128k) is refused
with the other sequence-dependent RoPE types."""

from __future__ import annotations

from typing import Any

from .spec import Family, layer_windows


def _build(config: Any) -> dict[str, Any]:
    return dict(fused_qkv=True, fused_gate_up=True, windows=layer_windows(config, None))


FAMILY = Family(
    name="phi3",
    model_types=("phi3",),
    # original_max_position_embeddings is read only by "longrope", which is refused.
    implemented=frozenset({"sliding_window", "original_max_position_embeddings"}),
    build=_build,
)
