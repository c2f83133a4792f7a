"""Qwen2 / Qwen2.5: Llama's block with q/k/v biases (o without) and per-layer sliding
windows (``layer_types``, from ``use_sliding_window`` / ``max_window_layers``)."""

from __future__ import annotations

from typing import Any

from .spec import Family, full_rotary, layer_windows

#: The sliding-window fields Qwen2 and Qwen3 read (through ``layer_types``).
WINDOW_FIELDS = frozenset(
    {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}
)


def windows(config: Any) -> tuple[int | None, ...]:
    return layer_windows(config, getattr(config, "layer_types", None))


def _build(config: Any) -> dict[str, Any]:
    why = full_rotary(config)
    if why:
        raise NotImplementedError(f"config.rope_parameters: {why}")
    return dict(qkv_bias=True, windows=windows(config))


FAMILY = Family(
    name="qwen2",
    model_types=("qwen2",),
    implemented=WINDOW_FIELDS,
    build=_build,
)
