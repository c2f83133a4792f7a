"""docs/SPEC.md S2-S8: shapes, dtypes and attributes of one ScatterPaKvCache call
(:func:`check_scatter`: never reads a value, so graph export calls it alone). The two
write kinds each have their check: a 3-D key writes tokens into a layout (S2-S5), a 4-D
key writes runs of rows (S6)."""

from __future__ import annotations

from typing import Any, NamedTuple

from .. import specs
from ..args import index_inputs, op_call
from ..dtypes import itemsize
from ..errors import describe, type_error, value_error
from ..layouts import LAYOUTS
from .basics import ScatterMeta, arg_dtype, arg_shape, fmt, require_same, string_option
from .layout import Cache, pick_layout
from .quant import check_cache_dtype, check_scale

#: The arguments _check_data reads, in its order.
_DATA_ARGS = ("key", "value", "key_cache", "value_cache", "k_scale", "v_scale")
#: What both write kinds name in their messages.
_WRITE_ARGS = ("key", "value", "key_cache", "value_cache", "slot_mapping")

_COMPRESS_ARGS = ("compress_lens", "compress_seq_offsets", "seq_lens")


class _Data(NamedTuple):
    """Shapes and dtype names of the data tensors (value ones empty/None without value)."""

    k_shape: tuple[int, ...]
    k_dt: str
    kc_shape: tuple[int, ...]
    v_shape: tuple[int, ...]
    v_dt: str | None
    vc_shape: tuple[int, ...]
    kc_dt: str
    vc_dt: str | None

    @property
    def has_value(self) -> bool:
        return self.v_dt is not None


_DATA = "a 1-, 2- or 4-byte data"


def _check_data(call: dict[str, Any]) -> _Data:
    """docs/SPEC.md S2/S8/S9: ranks and dtypes of key, value and the two caches."""
    key, value, key_cache, value_cache, k_scale, v_scale = (call[n] for n in _DATA_ARGS)
    data = specs.SCATTER_DATA_DTYPES
    k_shape = arg_shape("key", key)
    k_dt = arg_dtype("key", key, data, _DATA)
    if len(k_shape) not in (3, 4):
        raise value_error("key", "a 3-D [T, H, Dk] or 4-D [B, Smax, H, Dk] tensor", describe(key))
    if (value is None) != (value_cache is None):
        missing, present = ("value", "value_cache") if value is None else ("value_cache", "value")
        raise value_error(missing, f"a tensor because {present} is given (both or neither)", "None")
    kc_shape = arg_shape("key_cache", key_cache)
    kc_dt = arg_dtype("key_cache", key_cache, data, _DATA)
    if len(kc_shape) != 4:
        raise value_error("key_cache", "a 4-D cache", describe(key_cache))
    v_shape: tuple[int, ...] = ()
    vc_shape: tuple[int, ...] = ()
    v_dt = vc_dt = None
    if value is not None:
        v_shape = arg_shape("value", value)
        v_dt = arg_dtype("value", value, data, _DATA)
        vc_shape = arg_shape("value_cache", value_cache)
        vc_dt = arg_dtype("value_cache", value_cache, data, _DATA)
        if len(vc_shape) != 4:
            raise value_error("value_cache", "a 4-D cache", describe(value_cache))
    elif v_scale is not None:
        raise value_error("v_scale", "None for a key-only write (no value)", describe(v_scale))
    check_cache_dtype("key_cache", key_cache, kc_dt, "key", k_dt, k_scale)
    if value is not None:
        check_cache_dtype("value_cache", value_cache, vc_dt, "value", v_dt, v_scale)
    return _Data(k_shape, k_dt, kc_shape, v_shape, v_dt, vc_shape, kc_dt, vc_dt)


def _check_indices(indices: dict[str, Any]) -> tuple[dict[str, tuple[int, ...]], str]:
    """Shapes of the given index tensors and their one shared dtype (int32 or int64)."""
    idx_shapes = {}
    idx_dt = None
    for arg, x in indices.items():
        if x is None:
            continue
        idx_shapes[arg] = arg_shape(arg, x)
        dt = arg_dtype(arg, x, specs.SCATTER_INDEX_DTYPES, "an index")
        if idx_dt is None:
            idx_dt = dt
        elif dt != idx_dt:
            raise value_error(
                arg,
                f"dtype {idx_dt} (all index tensors share slot_mapping's dtype)",
                f"{dt} ({describe(x)})",
            )
    if indices["slot_mapping"] is None or idx_dt is None:
        raise type_error("slot_mapping", "an int32 or int64 tensor", "None")
    return idx_shapes, idx_dt


#: (NB, BS) of one cache, with the argument's name and the argument (for messages).
_Blocks = tuple[tuple[int, int], str, Any]


class _Sizes(NamedTuple):
    """What one of the two write kinds found: layout or mode, sizes, (NB, BS) per cache."""

    layout: str | None
    mode: str | None
    tokens: int
    batch: int
    max_seq: int
    heads: int
    dk: int
    dv: int
    blocks: list[_Blocks]


class _Write(NamedTuple):
    """One call as the two write kinds read it: the data's shapes and dtypes, the
    arguments by name, the index tensors' shapes, the layout and mode options."""

    d: _Data
    call: dict[str, Any]
    idx_shapes: dict[str, tuple[int, ...]]
    layout: str | None
    mode: str | None


def _check_token_write(w: _Write) -> _Sizes:
    """docs/SPEC.md S2-S5: a 3-D key [T, H, Dk], one slot per token."""
    d, indices, idx_shapes, layout, mode = w
    key, value, key_cache, value_cache, slot_mapping = (indices[n] for n in _WRITE_ARGS)
    for arg in _COMPRESS_ARGS:
        if indices[arg] is not None:
            raise value_error(
                arg,
                "None with a 3-D key (compression needs a 4-D key [B, Smax, H, Dk])",
                describe(indices[arg]),
            )
    if mode is not None:
        raise value_error(
            "compress_mode",
            "None with a 3-D key (compression needs a 4-D key [B, Smax, H, Dk])",
            repr(mode),
        )
    tokens, heads, dk = d.k_shape
    if heads < 1 or dk < 1:
        raise value_error("key", "[T, H >= 1, Dk >= 1]", describe(key))
    dv = 0
    if d.has_value:
        if len(d.v_shape) != 3 or d.v_shape[:2] != (tokens, heads) or d.v_shape[2] < 1:
            raise value_error(
                "value", f"[T={tokens}, H={heads}, Dv >= 1] (same T and H as key)", describe(value)
            )
        dv = d.v_shape[2]
    if idx_shapes["slot_mapping"] != (tokens,):
        raise value_error(
            "slot_mapping", f"shape [T={tokens}] for a 3-D key", describe(slot_mapping)
        )
    caches: list[Cache] = [("key_cache", key_cache, d.kc_shape, dk, itemsize(d.kc_dt))]
    if d.has_value and d.vc_dt is not None:
        caches.append(("value_cache", value_cache, d.vc_shape, dv, itemsize(d.vc_dt)))
    layout = pick_layout(layout, caches, heads)
    if layout != "nz" and d.has_value:
        require_same(
            "value",
            value,
            d.v_dt,
            d.k_dt,
            f"key; only cache_layout='nz' allows different key and value "
            f"dtypes, layout is {layout!r}",
        )
        require_same(
            "value_cache",
            value_cache,
            d.vc_dt,
            d.kc_dt,
            f"key_cache; only cache_layout='nz' allows different key and value "
            f"dtypes, layout is {layout!r}",
        )
    blocks = []
    for arg, x, shape, size, item in caches:
        fit = LAYOUTS[layout].fit(shape, heads, size, item)
        assert fit is not None  # _pick_layout checked every cache against the layout
        blocks.append((fit, arg, x))
    return _Sizes(layout, None, tokens, 0, 0, heads, dk, dv, blocks)


def _check_run_indices(
    slot_mapping: Any,
    indices: dict[str, Any],
    idx_shapes: dict[str, tuple[int, ...]],
    batch: int,
    heads: int,
) -> None:
    """docs/SPEC.md S6 index shapes: slot_mapping and compress_lens [B, H], seq_lens [B]
    (both required), compress_seq_offsets [B*H] (optional here)."""
    if idx_shapes["slot_mapping"] != (batch, heads):
        raise value_error(
            "slot_mapping", f"shape [B={batch}, H={heads}] for a 4-D key", describe(slot_mapping)
        )
    for arg, expected in (
        ("compress_lens", (batch, heads)),
        ("seq_lens", (batch,)),
        ("compress_seq_offsets", (batch * heads,)),
    ):
        if indices[arg] is None:
            if arg != "compress_seq_offsets":
                raise value_error(arg, f"a tensor of shape {fmt(expected)} for a 4-D key", "None")
        elif idx_shapes[arg] != expected:
            raise value_error(arg, f"shape {fmt(expected)}", describe(indices[arg]))


def _compress_mode(mode: str | None, offsets: Any, runs: int) -> str:
    """The mode of a compressing write: the given one, else "rope" with offsets and "alibi"
    without; "rope" and "omni" need the offsets."""
    if mode is None:
        mode = "rope" if offsets is not None else "alibi"
    if mode in ("rope", "omni") and offsets is None:
        raise value_error(
            "compress_seq_offsets",
            f"a tensor of shape [B*H={runs}] for compress_mode={mode!r}",
            "None",
        )
    return mode


def _check_compress_write(w: _Write) -> _Sizes:
    """docs/SPEC.md S6: a 4-D key [B, Smax, H, Dk], one run of rows per (b, h)."""
    d, indices, idx_shapes, layout, mode = w
    key, value, key_cache, value_cache, slot_mapping = (indices[n] for n in _WRITE_ARGS)
    if layout is not None:
        raise value_error(
            "cache_layout",
            "None with a 4-D key (the compressing write has one cache layout, [NB, BS, 1, D])",
            repr(layout),
        )
    batch, max_seq, heads, dk = d.k_shape
    if heads < 1 or dk < 1:
        raise value_error("key", "[B, Smax, H >= 1, Dk >= 1]", describe(key))
    dv = 0
    if d.has_value:
        if len(d.v_shape) != 4 or d.v_shape[:3] != d.k_shape[:3] or d.v_shape[3] < 1:
            raise value_error(
                "value",
                f"[B={batch}, Smax={max_seq}, H={heads}, Dv >= 1] (same first three dims as key)",
                describe(value),
            )
        dv = d.v_shape[3]
        require_same(
            "value",
            value,
            d.v_dt,
            d.k_dt,
            "key; only cache_layout='nz' allows different key and value dtypes",
        )
    blocks = []
    for arg, x, shape, size in (
        ("key_cache", key_cache, d.kc_shape, dk),
        ("value_cache", value_cache, d.vc_shape, dv),
    )[: 1 + d.has_value]:
        if shape[2:] != (1, size):
            raise value_error(arg, f"[NB, BS, 1, {size}] for a 4-D key", describe(x))
        blocks.append(((shape[0], shape[1]), arg, x))
    _check_run_indices(slot_mapping, indices, idx_shapes, batch, heads)
    mode = _compress_mode(mode, indices["compress_seq_offsets"], batch * heads)
    if mode == "rope":
        for arg, x in (("key", key), ("value", value))[: 1 + d.has_value]:
            arg_dtype(
                arg,
                x,
                specs.SCATTER_ROPE_DTYPES,
                "a float",
                " for compress_mode='rope' (it averages tokens)",
            )
    return _Sizes(None, mode, 0, batch, max_seq, heads, dk, dv, blocks)


def _check_blocks(blocks: list[_Blocks]) -> tuple[int, int]:
    """NB >= 1 blocks of BS >= 1 slots, equal in both caches."""
    (nb, bs), _, _ = blocks[0]
    for (nb_x, bs_x), arg, x in blocks:
        if nb_x < 1 or bs_x < 1:
            raise value_error(
                arg, "at least one block (NB >= 1) of at least one slot (BS >= 1)", describe(x)
            )
        if (nb_x, bs_x) != (nb, bs):
            raise value_error(
                arg,
                f"NB={nb} blocks of BS={bs} slots, as key_cache",
                f"NB={nb_x}, BS={bs_x} ({describe(x)})",
            )
    return nb, bs


@op_call(specs.SCATTER_PA_KV_CACHE)
def check_scatter(call: dict[str, Any]) -> ScatterMeta:
    """Validate shapes, dtypes and attributes of one ScatterPaKvCache call (docs/SPEC.md S2-S9).

    Never reads a value, so the arguments may be NumPy arrays, torch or cupy tensors on any
    device, or any object with ``.shape`` and ``.dtype``. The signature is the op spec's
    (:func:`pytrt_kv.contract.args.op_call`): the first five positional, the rest keywords.

    Parameters
    ----------
    key : array, [T, H, Dk] or [B, Smax, H, Dk]
    value : array or None, [T, H, Dv] or [B, Smax, H, Dv]
    key_cache : array
        nd ``[NB, BS, H, Dk]``, nz ``[NB, H*Dk/L, BS, L]``, hnd ``[NB, H, BS, Dk]``, or
        ``[NB, BS, 1, Dk]`` for a 4-D key.
    value_cache : array or None
        As key_cache with Dv; None exactly when value is None.
    slot_mapping : array, [T] or [B, H], int32 or int64
    compress_lens : array or None, [B, H]
        Required for a 4-D key, refused for a 3-D key (as are the next two).
    compress_seq_offsets : array or None, [B*H]
        Required by the "rope" and "omni" modes; "alibi" ignores its values.
    seq_lens : array or None, [B]
        Required for a 4-D key.
    cache_layout : {"nd", "nz", "hnd"} or None
        3-D key only; None (or "") detects it from the shapes.
    compress_mode : {"rope", "omni", "alibi"} or None
        4-D key only; None (or "") means "rope" when compress_seq_offsets is given,
        else "alibi".
    k_scale, v_scale : array or None, float32 ``[]`` or ``[H]``
        3-D key only (docs/SPEC.md S9): quantise key (value) into a float8_e4m3fn or int8
        cache; a quantised cache needs its scale.

    Returns
    -------
    ScatterMeta

    Raises
    ------
    TypeError
        An argument is not an array, or has a dtype the op does not accept.
    ValueError
        Any other broken rule. Every message names the argument, what was expected and
        what came.

    Examples
    --------
    >>> import numpy as np
    >>> from pytrt_kv.contract.scatter import check_scatter
    >>> key = np.zeros((3, 4, 8), np.float16)          # [T, H, Dk]
    >>> cache = np.zeros((5, 2, 8, 16), np.float16)    # [NB, H*Dk/16, BS, 16]
    >>> check_scatter(key, None, cache, None, np.zeros(3, np.int32)).layout
    'nz'
    """
    d = _check_data(call)
    idx_shapes, idx_dt = _check_indices(
        {n: call[n] for n in index_inputs(specs.SCATTER_PA_KV_CACHE)}
    )
    layout = string_option("cache_layout", call["cache_layout"], specs.CACHE_LAYOUTS)
    mode = string_option("compress_mode", call["compress_mode"], specs.COMPRESS_MODES)
    check = _check_token_write if len(d.k_shape) == 3 else _check_compress_write
    z = check(_Write(d, call, idx_shapes, layout, mode))
    nb, bs = _check_blocks(z.blocks)
    return _meta(d, z, idx_dt, nb, bs, call["k_scale"], call["v_scale"])


def _meta(
    d: _Data, z: _Sizes, idx_dt: str, nb: int, bs: int, k_scale: Any, v_scale: Any
) -> ScatterMeta:
    """The ScatterMeta of a call whose shapes passed, after the S9 scale checks."""
    if len(d.k_shape) == 4:
        for arg, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scale is not None:
                raise value_error(
                    arg,
                    "None with a 4-D key (quantise on write applies to a 3-D key, docs/SPEC.md S9)",
                    describe(scale),
                )
    return ScatterMeta(
        compress=len(d.k_shape) == 4,
        layout=z.layout,
        mode=z.mode,
        has_value=d.has_value,
        key_dtype=d.k_dt,
        value_dtype=d.v_dt,
        index_dtype=idx_dt,
        num_tokens=z.tokens,
        batch=z.batch,
        max_seq_len=z.max_seq,
        num_heads=z.heads,
        head_size_k=z.dk,
        head_size_v=z.dv,
        num_blocks=nb,
        block_size=bs,
        key_cache_dtype=d.kc_dt,
        value_cache_dtype=d.vc_dt,
        k_scale_count=check_scale("k_scale", k_scale, z.heads),
        v_scale_count=check_scale("v_scale", v_scale, z.heads),
    )
