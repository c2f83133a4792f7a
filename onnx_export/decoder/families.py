"""The family registry: :func:`decoder_spec` picks a family by ``config.model_type`` and
lets it check every field (docs/YOUR_MODEL.md "Families")."""

from __future__ import annotations

from typing import Any

from . import gemma, llama, mistral, phi3, qwen2, qwen3
from .spec import DecoderSpec, Family

FAMILIES: tuple[Family, ...] = tuple(m.FAMILY for m in (llama, mistral, qwen2, qwen3, gemma, phi3))


def family_of(config: Any) -> Family:
    """The family serving ``config`` (by ``model_type``), or NotImplementedError naming
    the supported types."""
    model_type = getattr(config, "model_type", None)
    for fam in FAMILIES:
        if model_type in fam.model_types:
            return fam
    known = ", ".join(t for f in FAMILIES for t in f.model_types)
    raise NotImplementedError(f"config.model_type: got {model_type!r}; supported: {known}")


def decoder_spec(config: Any) -> DecoderSpec:
    """The :class:`DecoderSpec` of ``config`` (a transformers config), every field that
    changes the math implemented or refused here, before any export."""
    return family_of(config).spec(config)
