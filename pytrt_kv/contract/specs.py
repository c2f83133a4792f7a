"""Single source of truth for the identity of pytrt_kv's operators.

Every layer reads op names, tensor names, attribute names/defaults and allowed dtypes
from here: the ONNX schemas, the export helpers, the CPU runtime, the TensorRT helpers
and the tests that check the C++ plugin creators (docs/SPEC.md, section O).

Nothing here imports numpy, onnx, torch or tensorrt, so it is safe to import anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

#: TensorRT plugin namespace, equal to the ONNX domain of our custom ops.
NAMESPACE = "pytrt_kv"
#: ONNX domain (same string as the plugin namespace).
DOMAIN = NAMESPACE
#: TensorRT plugin version string, written into every node as ``plugin_version``.
PLUGIN_VERSION = "1"
#: Version of the ``pytrt_kv`` ONNX opset.
DOMAIN_VERSION = 1
#: ONNX IR version written into models (ONNX Runtime 1.31 rejects newer IR).
ONNX_IR_VERSION = 10
#: Standard ONNX opset the models import.
ONNX_OPSET = 17

# --- dtypes --------------------------------------------------------------------------
# Names follow NumPy / ml_dtypes spelling. ``dtypes.py`` maps them to NumPy, ONNX and
# TensorRT types.
FLOAT32 = "float32"
FLOAT16 = "float16"
BFLOAT16 = "bfloat16"
INT8 = "int8"
UINT8 = "uint8"
FLOAT8_E4M3 = "float8_e4m3fn"
FLOAT8_E5M2 = "float8_e5m2"
INT32 = "int32"
INT64 = "int64"

#: docs/SPEC.md S8: scatter moves bytes of any of these (1, 2 or 4 bytes wide).
SCATTER_DATA_DTYPES: tuple[str, ...] = (
    FLOAT32,
    FLOAT16,
    BFLOAT16,
    INT8,
    UINT8,
    FLOAT8_E4M3,
    FLOAT8_E5M2,
    INT32,
)
#: docs/SPEC.md S6: the "rope" compress mode averages, so it needs a float type.
SCATTER_ROPE_DTYPES: tuple[str, ...] = (FLOAT16, BFLOAT16, FLOAT32)
#: docs/SPEC.md S8: slot_mapping and the compress tensors.
SCATTER_INDEX_DTYPES: tuple[str, ...] = (INT32, INT64)
#: docs/SPEC.md S9: quantise on write, float key/value into one of these caches.
SCATTER_QUANT_SOURCE_DTYPES: tuple[str, ...] = (FLOAT16, BFLOAT16, FLOAT32)
SCATTER_QUANT_CACHE_DTYPES: tuple[str, ...] = (FLOAT8_E4M3, INT8)
#: docs/SPEC.md S9: largest magnitude each quantised cache dtype takes (the clamp bound).
SCATTER_QUANT_MAX: Mapping[str, float] = {FLOAT8_E4M3: 448.0, INT8: 127.0}
#: docs/SPEC.md S9: the byte a NaN is written as, whatever its sign (the GPU's canonical
#: e4m3 NaN); int8 has none (a NaN source is refused).
SCATTER_QUANT_NAN: Mapping[str, int] = {FLOAT8_E4M3: 0x7F}
#: docs/SPEC.md S9: k_scale / v_scale dtype.
SCATTER_SCALE_DTYPES: tuple[str, ...] = (FLOAT32,)
#: docs/SPEC.md G2: the four cache tensors of the gather share one of these.
GATHER_CACHE_DTYPES: tuple[str, ...] = (
    FLOAT16,
    BFLOAT16,
    INT8,
    FLOAT32,
    FLOAT8_E4M3,
    FLOAT8_E5M2,
)
#: docs/SPEC.md G2: every index tensor of the gather is int32.
GATHER_INDEX_DTYPES: tuple[str, ...] = (INT32,)

# --- attribute values ----------------------------------------------------------------
CACHE_LAYOUTS: tuple[str, ...] = ("nd", "nz", "hnd")
COMPRESS_MODES: tuple[str, ...] = ("rope", "omni", "alibi")


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of an op.

    ``dtype_group`` names the set of dtypes allowed; tensors with the same group name in
    one op must share one dtype (docs/SPEC.md: "key and key_cache share one dtype").
    """

    name: str
    dtypes: tuple[str, ...]
    optional: bool = False
    dtype_group: str | None = None
    doc: str = ""


@dataclass(frozen=True)
class AttrSpec:
    """One node attribute / plugin field.

    ``type`` is ``"int"`` or ``"string"``. ``choices`` lists the allowed values of a
    string attribute; the empty string means "not set" where ``default`` is ``""``.
    """

    name: str
    type: str
    default: object
    choices: tuple[object, ...] = ()
    doc: str = ""


@dataclass(frozen=True)
class OpSpec:
    """Identity of one operator: ONNX op_type = TensorRT plugin name."""

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    attributes: tuple[AttrSpec, ...]
    #: output name -> input name it is the in-place updated version of.
    aliases: Mapping[str, str] = field(default_factory=dict)
    doc: str = ""

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.outputs)

    @property
    def attribute_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.attributes)

    def input(self, name: str) -> TensorSpec:
        for t in self.inputs:
            if t.name == name:
                return t
        raise KeyError(f"{self.name} has no input {name!r}; inputs are {self.input_names}")

    def output(self, name: str) -> TensorSpec:
        for t in self.outputs:
            if t.name == name:
                return t
        raise KeyError(f"{self.name} has no output {name!r}; outputs are {self.output_names}")

    def attribute(self, name: str) -> AttrSpec:
        for a in self.attributes:
            if a.name == name:
                return a
        raise KeyError(
            f"{self.name} has no attribute {name!r}; attributes are {self.attribute_names}"
        )

    def input_index(self, name: str) -> int:
        return self.input_names.index(name)

    def output_index(self, name: str) -> int:
        return self.output_names.index(name)

    def aliased_input_index(self, output_index: int) -> int:
        """Index of the input that output ``output_index`` updates in place, or -1."""
        src = self.aliases.get(self.outputs[output_index].name)
        return -1 if src is None else self.input_index(src)


#: Attributes every pytrt_kv node carries so the TensorRT ONNX parser finds the plugin.
#: They are consumed by the parser, not passed to the creator as fields.
PLUGIN_NODE_ATTRIBUTES: Mapping[str, str] = {
    "plugin_namespace": NAMESPACE,
    "plugin_version": PLUGIN_VERSION,
}

#: Shape of the zero-element tensor that stands for an absent optional input where inputs
#: are positional: TensorRT plugins cannot receive an empty ONNX input, so
#: ``pytrt_kv.trt.prepare_for_tensorrt`` writes this shape, and the plugins and the CPU
#: runtime read it as "absent" (``value``, ``value_cache``, ``compress_seq_offsets``).
ABSENT_INPUT_SHAPE: tuple[int, ...] = (0,)


def absent_placeholders(shapes) -> tuple[str, ...]:
    """Names of the ScatterPaKvCache inputs that are placeholders for absent optional
    inputs (:data:`ABSENT_INPUT_SHAPE`) in ``shapes`` (input name -> shape or None).

    ``value``, ``value_cache``, ``compress_seq_offsets``, ``k_scale`` and ``v_scale``
    qualify (a real scale is ``[]`` or ``[H >= 1]``); with a static ``B`` or ``H`` of 0 a
    real ``compress_seq_offsets [B*H]`` has the placeholder's shape and stays. Dims may be
    symbolic (str or None), as in shape inference.
    """
    key = shapes.get("key")
    # B or H statically 0 (a symbolic dim is a name or None: it may be anything, so the
    # zero-element tensor is read as the placeholder).
    no_runs = key is not None and len(key) == 4 and any(key[a] == 0 for a in (0, 2))
    # A 3-D key has no compress tensors: with the scales, prepare_for_tensorrt fills
    # positions 5-7 with placeholders too.
    token_write = key is not None and len(key) == 3
    out = []
    for name in (
        "value",
        "value_cache",
        "compress_lens",
        "compress_seq_offsets",
        "seq_lens",
        "k_scale",
        "v_scale",
    ):
        if shapes.get(name) is not None and tuple(shapes[name]) == ABSENT_INPUT_SHAPE:
            if name == "compress_seq_offsets" and no_runs:
                continue
            if name in ("compress_lens", "seq_lens") and not token_write:
                continue
            out.append(name)
    return tuple(out)


_ALIAS_IO = AttrSpec(
    "alias_io",
    "int",
    1,
    (0, 1),
    "1: declare each *_out as an alias of its input to TensorRT (in place). The plugin "
    "copies input to output first whenever the two addresses differ, so 0 and 1 give the "
    "same results.",
)

SCATTER_PA_KV_CACHE = OpSpec(
    name="ScatterPaKvCache",
    inputs=(
        TensorSpec(
            "key",
            SCATTER_DATA_DTYPES,
            dtype_group="key",
            doc="[T, H, Dk] (3-D) or [B, Smax, H, Dk] (compressing write)",
        ),
        TensorSpec(
            "value",
            SCATTER_DATA_DTYPES,
            optional=True,
            dtype_group="value",
            doc="[T, H, Dv] or [B, Smax, H, Dv]; absent for a key-only write",
        ),
        TensorSpec(
            "key_cache",
            SCATTER_DATA_DTYPES,
            dtype_group="key_cache",
            doc="nd [NB, BS, H, Dk] | nz [NB, H*Dk/L, BS, L] | hnd [NB, H, BS, Dk] "
            "| compress [NB, BS, 1, Dk]",
        ),
        TensorSpec(
            "value_cache",
            SCATTER_DATA_DTYPES,
            optional=True,
            dtype_group="value_cache",
            doc="as key_cache with Dv; present exactly when value is",
        ),
        TensorSpec(
            "slot_mapping",
            SCATTER_INDEX_DTYPES,
            dtype_group="index",
            doc="[T] (3-D key) or [B, H] (4-D key); -1 = padding",
        ),
        TensorSpec(
            "compress_lens",
            SCATTER_INDEX_DTYPES,
            optional=True,
            dtype_group="index",
            doc="[B, H] (4-D key only)",
        ),
        TensorSpec(
            "compress_seq_offsets",
            SCATTER_INDEX_DTYPES,
            optional=True,
            dtype_group="index",
            doc="[B*H] (4-D key only)",
        ),
        TensorSpec(
            "seq_lens",
            SCATTER_INDEX_DTYPES,
            optional=True,
            dtype_group="index",
            doc="[B] (4-D key only)",
        ),
        TensorSpec(
            "k_scale",
            SCATTER_SCALE_DTYPES,
            optional=True,
            dtype_group="k_scale",
            doc="[] or [H] float32 (3-D key only): quantise key into a float8_e4m3fn or "
            "int8 key_cache (docs/SPEC.md S9)",
        ),
        TensorSpec(
            "v_scale",
            SCATTER_SCALE_DTYPES,
            optional=True,
            dtype_group="v_scale",
            doc="[] or [H] float32: quantise value into value_cache (docs/SPEC.md S9)",
        ),
    ),
    outputs=(
        TensorSpec(
            "key_cache_out",
            SCATTER_DATA_DTYPES,
            dtype_group="key_cache",
            doc="key_cache updated in place",
        ),
        TensorSpec(
            "value_cache_out",
            SCATTER_DATA_DTYPES,
            optional=True,
            dtype_group="value_cache",
            doc="value_cache updated in place",
        ),
    ),
    attributes=(
        AttrSpec(
            "cache_layout",
            "string",
            "",
            ("", *CACHE_LAYOUTS),
            "nd | nz | hnd for a 3-D key (required in a model, resolved at export "
            "time); empty for a 4-D key",
        ),
        AttrSpec(
            "compress_mode",
            "string",
            "",
            ("", *COMPRESS_MODES),
            "rope | omni | alibi for a 4-D key; empty: rope when "
            "compress_seq_offsets is given, else alibi",
        ),
        _ALIAS_IO,
    ),
    aliases={"key_cache_out": "key_cache", "value_cache_out": "value_cache"},
    doc="Write the current step's key/value tokens into a paged KV cache (docs/SPEC.md S).",
)

GATHER_SELECTION_KV_CACHE = OpSpec(
    name="GatherSelectionKvCache",
    inputs=(
        TensorSpec(
            "selection_k_rope",
            GATHER_CACHE_DTYPES,
            dtype_group="cache",
            doc="[S_BLOCK_NUM, SBS, K_ROPE] or zero-element",
        ),
        TensorSpec(
            "selection_kv_cache",
            GATHER_CACHE_DTYPES,
            dtype_group="cache",
            doc="[S_BLOCK_NUM, SBS, KV]",
        ),
        TensorSpec(
            "selection_kv_block_table", GATHER_INDEX_DTYPES, doc="[R >= B*S*H, S_MAX_BLOCK_NUM]"
        ),
        TensorSpec(
            "selection_kv_block_status",
            GATHER_INDEX_DTYPES,
            doc="BSND [B, S, H, K+1] or TND [B*S, H, K+1]",
        ),
        TensorSpec(
            "selection_topk_indices",
            GATHER_INDEX_DTYPES,
            doc="BSND [B, S, H, K] or TND [B*S, H, K]",
        ),
        TensorSpec(
            "full_k_rope",
            GATHER_CACHE_DTYPES,
            dtype_group="cache",
            doc="[F_BLOCK_NUM, FBS, K_ROPE] or zero-element",
        ),
        TensorSpec(
            "full_kv_cache", GATHER_CACHE_DTYPES, dtype_group="cache", doc="[F_BLOCK_NUM, FBS, KV]"
        ),
        TensorSpec("full_kv_block_table", GATHER_INDEX_DTYPES, doc="[B, F_MAX_BLOCK_NUM]"),
        TensorSpec("full_kv_actual_seq", GATHER_INDEX_DTYPES, doc="[B]"),
        TensorSpec(
            "full_q_actual_seq", GATHER_INDEX_DTYPES, doc="[B]; validated, otherwise ignored"
        ),
    ),
    outputs=(
        TensorSpec("selection_k_rope_out", GATHER_CACHE_DTYPES, dtype_group="cache"),
        TensorSpec("selection_kv_cache_out", GATHER_CACHE_DTYPES, dtype_group="cache"),
        TensorSpec("selection_kv_block_status_out", GATHER_INDEX_DTYPES),
        TensorSpec("selection_kv_actual_seq", GATHER_INDEX_DTYPES, doc="[R]"),
    ),
    attributes=(
        AttrSpec(
            "selection_topk_block_size",
            "int",
            64,
            (),
            "TBS: tokens per top-k id (1 = token-level selection)",
        ),
        _ALIAS_IO,
    ),
    aliases={
        "selection_k_rope_out": "selection_k_rope",
        "selection_kv_cache_out": "selection_kv_cache",
        "selection_kv_block_status_out": "selection_kv_block_status",
    },
    doc="Gather top-k selected KV into a compact selection cache, reusing resident "
    "entries (docs/SPEC.md G).",
)

#: Every op, by name.
OPS: Mapping[str, OpSpec] = {
    SCATTER_PA_KV_CACHE.name: SCATTER_PA_KV_CACHE,
    GATHER_SELECTION_KV_CACHE.name: GATHER_SELECTION_KV_CACHE,
}


def get_op(name: str) -> OpSpec:
    """Return the :class:`OpSpec` named ``name`` or raise a ValueError listing the ops."""
    try:
        return OPS[name]
    except KeyError:
        raise ValueError(f"op_type: expected one of {sorted(OPS)}, got {name!r}") from None
