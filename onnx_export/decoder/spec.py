"""What the graphs need from a transformers config: :class:`DecoderSpec`, decided per
family from the config (``model_type`` and the fields, not the class), and the one rule
every family follows: each config field that changes the math is implemented or refused
before anything is exported, with one line naming the field, its value and what is
supported (docs/YOUR_MODEL.md "Families").

A family module (``llama``, ``mistral``, ...) declares a :class:`Family`: the
``model_type`` values it serves, the fields it implements, the fields it refuses
(checked in :meth:`Family.spec`) and the weight names of its block.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

#: Config fields that never change the forward math of an inference run (bookkeeping,
#: training-only or tokenizer settings). tests/test_decoder_fields.py fails on a field of
#: a family's config class that is neither here nor implemented nor refused.
NON_MATH = frozenset(
    {
        "_name_or_path",
        "architectures",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "chunk_size_feed_forward",
        "dtype",
        "id2label",
        "label2id",
        "initializer_range",
        "is_encoder_decoder",
        "model_type",
        "output_attentions",
        "output_hidden_states",
        "problem_type",
        "return_dict",
        "transformers_version",
        "use_cache",
        # Dropout is off in an inference run (model.eval()); pretraining_tp is read by
        # no forward of transformers 5 (it was a training-time slicing of the matmuls).
        "attention_dropout",
        "resid_pdrop",
        "embd_pdrop",
        "pretraining_tp",
    }
)

#: Fields every family reads the same way (the shapes, the norm epsilon, RoPE, the head).
COMMON = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_parameters",
        "tie_word_embeddings",
        "hidden_act",
    }
)

#: RoPE types whose cos/sin tables do not depend on the sequence length within
#: ``max_position_embeddings`` ("dynamic" grows its base only past it, which the runner
#: refuses), so one table per model is exact.
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")

#: ``hidden_act`` values (transformers' ACT2FN names) and the formula the graph writes.
ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_python": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu_python_tanh": "gelu_tanh",
    "quick_gelu": "quick_gelu",
    "relu": "relu",
}


@dataclass(frozen=True)
class DecoderSpec:
    """The dimensions and the math variants of one model, from its config.

    ``windows[i]``: the sliding window of layer ``i`` (token t sees positions
    ``p > t - window``), ``None`` for full attention. ``rotary_dim``: the leading
    dimensions of each head that RoPE rotates (Phi-3's partial rotary factor), the rest
    pass through. ``norm_offset``: RMSNorm multiplies by ``offset + weight`` (Gemma: 1).
    ``embed_scale``: the embeddings are multiplied by it (Gemma: sqrt(hidden)).
    """

    family: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float
    max_positions: int
    act: str = "silu"
    rotary_dim: int = 0
    windows: tuple[int | None, ...] = ()
    norm_offset: float = 0.0
    embed_scale: float | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    fused_qkv: bool = False
    fused_gate_up: bool = False
    tied: bool = False
    rope_type: str = "default"

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def kd(self) -> int:
        return self.kv_heads * self.head_dim


@dataclass(frozen=True)
class Family:
    """One decoder family: which configs it serves and which fields it reads.

    ``implemented``: fields (beyond :data:`COMMON`) whose every supported value the graph
    computes; ``refused``: ``{field: check}`` where ``check(config)`` returns the line
    to raise for an unsupported value (or None); ``build(config, spec_kwargs)`` returns
    the family's :class:`DecoderSpec` overrides."""

    name: str
    model_types: tuple[str, ...]
    implemented: frozenset[str]
    refused: dict[str, Callable[[Any], str | None]] = field(default_factory=dict)
    build: Callable[[Any], dict[str, Any]] = lambda config: {}

    @property
    def fields(self) -> frozenset[str]:
        return COMMON | self.implemented | frozenset(self.refused)

    def spec(self, config: Any) -> DecoderSpec:
        """The spec of ``config``, or ValueError/NotImplementedError naming the first
        field this family cannot compute exactly."""
        for name, check in self.refused.items():
            why = check(config)
            if why:
                raise NotImplementedError(f"config.{name}: {why}")
        base = common_spec(config, self.name)
        return DecoderSpec(**{**base, **self.build(config)})


def refuse_unless(name: str, ok: Callable[[Any], bool], supported: str):
    """A refusal check: the field's value when ``ok(value)`` is false."""

    def check(config: Any) -> str | None:
        value = getattr(config, name, None)
        return None if ok(value) else f"got {value!r}; supported: {supported}"

    return check


def _positive(config: Any, name: str) -> int:
    value = getattr(config, name, None)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config.{name}: expected a positive int, got {value!r}")
    return value


def rope_parameters(config: Any) -> dict[str, Any]:
    rope = getattr(config, "rope_parameters", None) or {}
    if not isinstance(rope, dict):
        raise ValueError(f"config.rope_parameters: expected a dict, got {rope!r}")
    return rope


def common_spec(config: Any, family: str) -> dict[str, Any]:
    """The :class:`DecoderSpec` fields every family reads alike, checked."""
    heads = _positive(config, "num_attention_heads")
    kv = getattr(config, "num_key_value_heads", None) or heads
    if heads % kv:
        raise ValueError(
            f"config.num_key_value_heads: expected a divisor of num_attention_heads {heads}, "
            f"got {kv}"
        )
    hidden = _positive(config, "hidden_size")
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    rope = rope_parameters(config)
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise NotImplementedError(
            f"config.rope_parameters: rope_type {rope_type!r} is not supported (its cos/sin "
            f"depend on the sequence length); supported: {', '.join(ROPE_TYPES)}"
        )
    act = getattr(config, "hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise NotImplementedError(
            f"config.hidden_act: got {act!r}; supported: {', '.join(ACTIVATIONS)}"
        )
    eps = getattr(config, "rms_norm_eps", None)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0:
        raise ValueError(f"config.rms_norm_eps: expected a positive float, got {eps!r}")
    partial = float(rope.get("partial_rotary_factor", 1.0))
    return dict(
        family=family,
        layers=_positive(config, "num_hidden_layers"),
        hidden=hidden,
        heads=heads,
        kv_heads=int(kv),
        head_dim=int(head_dim),
        intermediate=_positive(config, "intermediate_size"),
        vocab=_positive(config, "vocab_size"),
        eps=float(eps),
        max_positions=_positive(config, "max_position_embeddings"),
        act=ACTIVATIONS[act],
        rotary_dim=int(int(head_dim) * partial),
        windows=(None,) * int(config.num_hidden_layers),
        tied=bool(getattr(config, "tie_word_embeddings", False)),
        rope_type=rope_type,
    )


def full_rotary(config: Any) -> str | None:
    """Refusal of a partial rotary factor where the family's transformers code rotates
    the whole head (its apply_rotary_pos_emb would fail on a shorter table)."""
    partial = rope_parameters(config).get("partial_rotary_factor", 1.0)
    return None if partial == 1.0 else f"partial_rotary_factor {partial!r}; supported: 1.0"


def layer_windows(config: Any, layer_types: Iterable[str] | None) -> tuple[int | None, ...]:
    """Per-layer windows from ``layer_types`` ("full_attention" / "sliding_attention")."""
    n = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    if layer_types is None:
        return (window,) * n if window is not None else (None,) * n
    types = list(layer_types)
    bad = [t for t in types if t not in ("full_attention", "sliding_attention")]
    if len(types) != n or bad:
        raise NotImplementedError(
            f"config.layer_types: got {types!r}; supported: {n} entries of "
            "'full_attention' / 'sliding_attention'"
        )
    if "sliding_attention" in types and not (isinstance(window, int) and window >= 1):
        raise ValueError(
            f"config.sliding_window: expected an int >= 1 for sliding layers, got {window!r}"
        )
    return tuple(window if t == "sliding_attention" else None for t in types)
