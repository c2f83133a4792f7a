"""Mistral: Llama's block with a sliding window on every layer (``sliding_window``:
token t sees positions p with ``t - window < p <= t``, also when the window is shorter
than the prompt)."""

from __future__ import annotations

from typing import Any

from .spec import Family, full_rotary, layer_windows


def _build(config: Any) -> dict[str, Any]:
    why = full_rotary(config)
    if why:
        raise NotImplementedError(f"config.rope_parameters: {why}")
    return dict(windows=layer_windows(config, None))


FAMILY = Family(
    name="mistral",
    model_types=("mistral",),
    implemented=frozenset({"head_dim", "sliding_window"}),
    build=_build,
)
