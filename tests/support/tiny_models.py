"""Small random-weight transformers decoders built from configs (nothing downloaded):
the families' tests (tests/test_decoder_families.py) and the lowrank calibration's."""

from __future__ import annotations

#: The config fields every tiny model shares (2 layers, hidden 64, head_dim 16, GQA 2).
SMALL = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def tiny_model(cls_name: str, dtype: str = "float32", seed: int = 0, **overrides):
    """A random-weight model of the config class (weights large enough that the logits
    are far from uniform)."""
    import torch
    import transformers

    cfg = getattr(transformers, cls_name)(**{**SMALL, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.to(getattr(torch, dtype))
