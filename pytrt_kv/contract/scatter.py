"""Contract of ScatterPaKvCache (docs/SPEC.md section S): every argument check.

:func:`validate_scatter` is the one check of a call, used identically by the NumPy
reference, :mod:`pytrt_kv.ops` and (through the reference) the CPU runtime; its parts are
:func:`check_scatter` (shapes, dtypes, attributes: never reads a value, so graph export
calls it alone), :func:`check_scatter_values`, :func:`check_scale_values` and
:func:`check_scatter_numpy`. Which part runs where: docs/DECISIONS.md "Validation".
:func:`run_segments` is the S6 run geometry, shared by the value checks and the write.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np

from . import specs
from .alias import array_range, check_no_alias
from .dtypes import name_of, numpy_dtype
from .errors import describe, type_error, value_error

__all__ = [
    "ScatterMeta",
    "validate_scatter",
    "run_segments",
    "SCATTER_WRITTEN",
    "check_scatter",
    "check_scatter_values",
    "check_scale_values",
    "check_scatter_numpy",
    "nz_last_dim",
]

_COMPRESS_ARGS = ("compress_lens", "compress_seq_offsets", "seq_lens")

#: The data tensors: a GPU call never copies them back to check values.
_DATA_ARGS = ("key", "value", "key_cache", "value_cache")

#: The arguments a scatter writes: no other argument may share their memory.
SCATTER_WRITTEN = ("key_cache", "value_cache")


@dataclass(frozen=True)
class ScatterMeta:
    """Everything :func:`check_scatter` learned from the shapes, dtypes and attributes.

    Attributes
    ----------
    compress : bool
        True for a 4-D key (docs/SPEC.md S6, compressing write).
    layout : {"nd", "nz", "hnd"} or None
        Cache layout of a 3-D key; None for a 4-D key.
    mode : {"rope", "omni", "alibi"} or None
        Compress mode of a 4-D key; None for a 3-D key.
    has_value : bool
        False for a key-only write (value and value_cache both None).
    key_dtype, value_dtype : str or None
        dtype names (``pytrt_kv.specs`` spelling); value_dtype is None without value.
    key_cache_dtype, value_cache_dtype : str or None
        The caches' dtypes: the key's / value's, or a quantised dtype (docs/SPEC.md S9).
    k_scale_count, v_scale_count : int
        docs/SPEC.md S9: 0 without a scale (bytes are copied), 1 for a per-tensor scale
        ``[]``, H for a per-head scale ``[H]``.
    index_dtype : {"int32", "int64"}
        The one dtype shared by slot_mapping and the compress tensors.
    num_tokens : int
        T of a 3-D key; 0 for a 4-D key.
    batch, max_seq_len : int
        B and Smax of a 4-D key; 0 for a 3-D key.
    num_heads, head_size_k, head_size_v : int
        H, Dk and Dv (Dv is 0 without value).
    num_blocks, block_size : int
        NB and BS, equal in both caches.
    """

    compress: bool
    layout: str | None
    mode: str | None
    has_value: bool
    key_dtype: str
    value_dtype: str | None
    index_dtype: str
    num_tokens: int
    batch: int
    max_seq_len: int
    num_heads: int
    head_size_k: int
    head_size_v: int
    num_blocks: int
    block_size: int
    key_cache_dtype: str | None = None
    value_cache_dtype: str | None = None
    k_scale_count: int = 0
    v_scale_count: int = 0

    @property
    def num_slots(self) -> int:
        """NB * BS: slots (cache rows) addressable by slot_mapping."""
        return self.num_blocks * self.block_size


def nz_last_dim(dtype: Any) -> int:
    """L of the "nz" layout for ``dtype``: 32 bytes of elements (docs/SPEC.md S4)."""
    return 32 // numpy_dtype(dtype).itemsize


# --- shape / dtype checks ------------------------------------------------------------------


def _shape(arg: str, x: Any) -> tuple[int, ...]:
    shape = getattr(x, "shape", None)
    if shape is None or getattr(x, "dtype", None) is None:
        raise type_error(arg, "an array or tensor (an object with .shape and .dtype)", describe(x))
    try:
        return tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        raise type_error(arg, "a shape of integers", repr(shape)) from None


def _dtype(arg: str, x: Any, allowed: Sequence[str], what: str, why: str = "") -> str:
    try:
        name: str | None = name_of(x.dtype)
    except TypeError:
        name = None
    if name is None or name not in allowed:
        raise type_error(
            arg, f"{what} dtype ({', '.join(allowed)}){why}", f"{x.dtype} ({describe(x)})"
        )
    return name


def _string_option(arg: str, value: Any, choices: Sequence[str]) -> str | None:
    """None or "" (the ONNX spelling of "not set") -> None; else one of ``choices``."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise type_error(arg, f"None or a string in {list(choices)}", repr(value))
    if value == "":
        return None
    if value not in choices:
        raise value_error(arg, f"one of {list(choices)} (or None)", repr(value))
    return value


def _fmt(shape: Sequence[Any]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _layout_pattern(layout: str, heads: int, size: int, last: int) -> str:
    """Human-readable expected cache shape of ``layout`` for H=heads, D=size."""
    if layout == "nd":
        return _fmt(["NB", "BS", heads, size])
    if layout == "hnd":
        return _fmt(["NB", heads, "BS", size])
    cols = heads * size // last if (heads * size) % last == 0 else f"{heads}*{size}/{last}"
    return _fmt(["NB", cols, "BS", last])


def _fit(
    layout: str, shape: tuple[int, ...], heads: int, size: int, last: int
) -> tuple[int, int] | None:
    """(NB, BS) when a 4-D cache ``shape`` is ``layout`` for H=heads, D=size; else None."""
    n0, n1, n2, n3 = shape
    if layout == "nd" and (n2, n3) == (heads, size):
        return n0, n1
    if layout == "hnd" and (n1, n3) == (heads, size):
        return n0, n2
    if layout == "nz" and n3 == last and n1 * last == heads * size:
        return n0, n2
    return None


def _pick_layout(
    requested: str | None, caches: list[tuple[str, Any, tuple[int, ...], int, int]], heads: int
) -> str:
    """docs/SPEC.md S2: the layout every cache fits (or the requested one, checked)."""
    if requested is not None:
        for arg, x, shape, size, last in caches:
            if requested == "nz" and (heads * size) % last:
                raise value_error(
                    arg,
                    f"H*D*itemsize divisible by 32 for cache_layout='nz' "
                    f"(H={heads}, D={size}, L={last})",
                    describe(x),
                )
            if _fit(requested, shape, heads, size, last) is None:
                raise value_error(
                    arg,
                    f"{_layout_pattern(requested, heads, size, last)} for "
                    f"cache_layout={requested!r}",
                    describe(x),
                )
        return requested
    fitting = [
        layout
        for layout in specs.CACHE_LAYOUTS
        if all(
            _fit(layout, shape, heads, size, last) is not None for _, _, shape, size, last in caches
        )
    ]
    if len(fitting) == 1:
        return fitting[0]
    if fitting:
        arg, x = caches[0][:2]
        raise value_error(
            "cache_layout",
            f"one of {fitting} to be given, because the cache shapes fit several layouts",
            f"None with {arg} {describe(x)}",
        )
    for arg, x, shape, size, last in caches:
        if not any(_fit(lay, shape, heads, size, last) for lay in specs.CACHE_LAYOUTS):
            options = ", ".join(
                f"{lay} {_layout_pattern(lay, heads, size, last)}" for lay in specs.CACHE_LAYOUTS
            )
            raise value_error(arg, f"the shape of one layout: {options}", describe(x))
    raise value_error(
        "value_cache",
        "the layout of key_cache",
        f"value_cache {describe(caches[1][1])} fits no layout that key_cache "
        f"{describe(caches[0][1])} fits",
    )


def _require_same(arg: str, x: Any, got: str | None, expected: str | None, other: str) -> None:
    if got != expected:
        raise value_error(arg, f"dtype {expected} (same as {other})", f"{got} ({describe(x)})")


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


def _check_cache_dtype(
    arg: str, cache: Any, cache_dt: str | None, src: str, src_dt: str | None, scale: Any
) -> None:
    """docs/SPEC.md S8/S9: a cache has its source's dtype, or, with a scale, a quantised
    dtype fed from a float source."""
    scale_arg = "k_scale" if src == "key" else "v_scale"
    if scale is None:
        if cache_dt != src_dt:
            hint = ""
            if cache_dt in specs.SCATTER_QUANT_CACHE_DTYPES:
                hint = f", or give {scale_arg} to quantise {src} on write (docs/SPEC.md S9)"
            raise value_error(
                arg, f"dtype {src_dt} (same as {src}){hint}", f"{cache_dt} ({describe(cache)})"
            )
        return
    if src_dt not in specs.SCATTER_QUANT_SOURCE_DTYPES:
        raise type_error(
            src,
            f"a float dtype ({', '.join(specs.SCATTER_QUANT_SOURCE_DTYPES)}) to quantise with "
            f"{scale_arg}",
            f"{src_dt}",
        )
    if cache_dt not in specs.SCATTER_QUANT_CACHE_DTYPES:
        raise type_error(
            arg,
            f"a quantised dtype ({', '.join(specs.SCATTER_QUANT_CACHE_DTYPES)}) because "
            f"{scale_arg} is given",
            f"{cache_dt} ({describe(cache)})",
        )


def _check_scale(arg: str, scale: Any, heads: int) -> int:
    """docs/SPEC.md S9: a float32 scale of shape [] (per tensor) or [H] (per head); returns
    its number of values (0 when absent)."""
    if scale is None:
        return 0
    shape = _shape(arg, scale)
    _dtype(arg, scale, specs.SCATTER_SCALE_DTYPES, "a float32")
    if shape == ():
        return 1
    if shape == (heads,):
        return heads
    raise value_error(arg, f"shape [] (per tensor) or [H={heads}] (per head)", describe(scale))


def _check_data(
    key: Any,
    value: Any,
    key_cache: Any,
    value_cache: Any,
    k_scale: Any = None,
    v_scale: Any = None,
) -> _Data:
    """docs/SPEC.md S2/S8/S9: ranks and dtypes of key, value and the two caches."""
    data = specs.SCATTER_DATA_DTYPES
    k_shape = _shape("key", key)
    k_dt = _dtype("key", key, data, _DATA)
    if len(k_shape) not in (3, 4):
        raise value_error("key", "a 3-D [T, H, Dk] or 4-D [B, Smax, H, Dk] tensor", describe(key))
    if (value is None) != (value_cache is None):
        missing, present = ("value", "value_cache") if value is None else ("value_cache", "value")
        raise value_error(missing, f"a tensor because {present} is given (both or neither)", "None")
    kc_shape = _shape("key_cache", key_cache)
    kc_dt = _dtype("key_cache", key_cache, data, _DATA)
    if len(kc_shape) != 4:
        raise value_error("key_cache", "a 4-D cache", describe(key_cache))
    v_shape: tuple[int, ...] = ()
    vc_shape: tuple[int, ...] = ()
    v_dt = vc_dt = None
    if value is not None:
        v_shape = _shape("value", value)
        v_dt = _dtype("value", value, data, _DATA)
        vc_shape = _shape("value_cache", value_cache)
        vc_dt = _dtype("value_cache", value_cache, data, _DATA)
        if len(vc_shape) != 4:
            raise value_error("value_cache", "a 4-D cache", describe(value_cache))
    elif v_scale is not None:
        raise value_error("v_scale", "None for a key-only write (no value)", describe(v_scale))
    _check_cache_dtype("key_cache", key_cache, kc_dt, "key", k_dt, k_scale)
    if value is not None:
        _check_cache_dtype("value_cache", value_cache, vc_dt, "value", v_dt, v_scale)
    return _Data(k_shape, k_dt, kc_shape, v_shape, v_dt, vc_shape, kc_dt, vc_dt)


def _check_indices(indices: dict[str, Any]) -> tuple[dict[str, tuple[int, ...]], str]:
    """Shapes of the given index tensors and their one shared dtype (int32 or int64)."""
    idx_shapes = {}
    idx_dt = None
    for arg, x in indices.items():
        if x is None:
            continue
        idx_shapes[arg] = _shape(arg, x)
        dt = _dtype(arg, x, specs.SCATTER_INDEX_DTYPES, "an index")
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


def _check_token_write(
    d: _Data,
    key: Any,
    value: Any,
    key_cache: Any,
    value_cache: Any,
    slot_mapping: Any,
    indices: dict[str, Any],
    idx_shapes: dict[str, tuple[int, ...]],
    layout: str | None,
    mode: str | None,
) -> _Sizes:
    """docs/SPEC.md S2-S5: a 3-D key [T, H, Dk], one slot per token."""
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
    caches = [("key_cache", key_cache, d.kc_shape, dk, nz_last_dim(d.kc_dt))]
    if d.has_value:
        caches.append(("value_cache", value_cache, d.vc_shape, dv, nz_last_dim(d.vc_dt)))
    layout = _pick_layout(layout, caches, heads)
    if layout != "nz" and d.has_value:
        _require_same(
            "value",
            value,
            d.v_dt,
            d.k_dt,
            f"key; only cache_layout='nz' allows different key and value "
            f"dtypes, layout is {layout!r}",
        )
        _require_same(
            "value_cache",
            value_cache,
            d.vc_dt,
            d.kc_dt,
            f"key_cache; only cache_layout='nz' allows different key and value "
            f"dtypes, layout is {layout!r}",
        )
    blocks = []
    for arg, x, shape, size, last in caches:
        fit = _fit(layout, shape, heads, size, last)
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
                raise value_error(arg, f"a tensor of shape {_fmt(expected)} for a 4-D key", "None")
        elif idx_shapes[arg] != expected:
            raise value_error(arg, f"shape {_fmt(expected)}", describe(indices[arg]))


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


def _check_compress_write(
    d: _Data,
    key: Any,
    value: Any,
    key_cache: Any,
    value_cache: Any,
    slot_mapping: Any,
    indices: dict[str, Any],
    idx_shapes: dict[str, tuple[int, ...]],
    layout: str | None,
    mode: str | None,
) -> _Sizes:
    """docs/SPEC.md S6: a 4-D key [B, Smax, H, Dk], one run of rows per (b, h)."""
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
        _require_same(
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
            _dtype(
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


def check_scatter(
    key: Any,
    value: Any,
    key_cache: Any,
    value_cache: Any,
    slot_mapping: Any,
    compress_lens: Any = None,
    compress_seq_offsets: Any = None,
    seq_lens: Any = None,
    cache_layout: str | None = None,
    compress_mode: str | None = None,
    k_scale: Any = None,
    v_scale: Any = None,
) -> ScatterMeta:
    """Validate shapes, dtypes and attributes of one ScatterPaKvCache call (docs/SPEC.md S2-S9).

    Never reads a value, so the arguments may be NumPy arrays, torch or cupy tensors on any
    device, or any object with ``.shape`` and ``.dtype``.

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
    indices = {
        "slot_mapping": slot_mapping,
        "compress_lens": compress_lens,
        "compress_seq_offsets": compress_seq_offsets,
        "seq_lens": seq_lens,
    }
    d = _check_data(key, value, key_cache, value_cache, k_scale, v_scale)
    idx_shapes, idx_dt = _check_indices(indices)
    layout = _string_option("cache_layout", cache_layout, specs.CACHE_LAYOUTS)
    mode = _string_option("compress_mode", compress_mode, specs.COMPRESS_MODES)
    check = _check_token_write if len(d.k_shape) == 3 else _check_compress_write
    z = check(
        d, key, value, key_cache, value_cache, slot_mapping, indices, idx_shapes, layout, mode
    )
    nb, bs = _check_blocks(z.blocks)
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
        k_scale_count=_check_scale("k_scale", k_scale, z.heads),
        v_scale_count=_check_scale("v_scale", v_scale, z.heads),
    )


# --- value checks --------------------------------------------------------------------------


def _as_index(arg: str, x: Any, shape: tuple[int, ...]) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        raise type_error(arg, "a NumPy array", describe(x))
    if x.shape != shape:
        raise value_error(arg, f"shape {_fmt(shape)}", describe(x))
    return x.astype(np.int64)  # a copy: the caller's array is never touched


def run_segments(
    mode: str, seq_len: int, width: int, offset: int
) -> tuple[list[tuple[int, int, int]], tuple[int, int] | None]:
    """docs/SPEC.md S6 geometry of one (b, h) run: the copies [(first row, first token,
    count)] and the mean row (row, first token of the w averaged ones) or None; rows are
    relative to the run's base slot. ``offset`` is -1 for "alibi" (values ignored)."""
    if mode == "alibi":  # keep the last w tokens
        return [(0, seq_len - width, width)], None
    if offset == -1 or width == 0 or offset == seq_len:  # an uncompressed head
        return [(0, 0, seq_len)], None
    rest = seq_len - offset - width  # tokens after the w compressed ones
    if mode == "rope":  # the w tokens become their mean, in row o
        return [(0, 0, offset), (offset + 1, offset + width, rest)], (offset, offset)
    return [(0, 0, offset), (offset, offset + width, rest)], None  # "omni": dropped


def _run_rows(
    meta: ScatterMeta,
    base: np.ndarray,
    lens: np.ndarray,
    offsets: np.ndarray | None,
    seq: np.ndarray,
) -> np.ndarray:
    """Rows each (b, h) run writes, [B, H] int64, after checking the S6 constraints."""
    active = base >= 0
    seq_bh = np.broadcast_to(seq[:, None], base.shape)

    def first(bad: np.ndarray) -> tuple[int, int]:
        b, h = np.argwhere(bad)[0]
        return int(b), int(h)

    bad = active & ((seq_bh < 0) | (seq_bh > meta.max_seq_len))
    if bad.any():
        b, h = first(bad)
        raise value_error(
            "seq_lens",
            f"0 <= seq_lens[b] <= Smax={meta.max_seq_len} for every batch b with a non-padding run",
            f"seq_lens[{b}] = {seq[b]} (run (b, h) = ({b}, {h}))",
        )
    if meta.mode == "alibi":
        bad = active & ((lens < 0) | (lens > seq_bh))
        if bad.any():
            b, h = first(bad)
            raise value_error(
                "compress_lens",
                "0 <= w <= seq_lens[b] for compress_mode='alibi'",
                f"compress_lens[{b}, {h}] = {lens[b, h]} with seq_lens[{b}] = {seq[b]}",
            )
    else:
        assert offsets is not None  # rope and omni: check_scatter_values required them
        uncompressed = (offsets == -1) | (lens == 0) | (offsets == seq_bh)
        comp = active & ~uncompressed
        bad = comp & ((offsets < 0) | (offsets > seq_bh))
        if bad.any():
            b, h = first(bad)
            raise value_error(
                "compress_seq_offsets",
                "-1 or 0 <= o <= seq_lens[b]",
                f"compress_seq_offsets[{b * meta.num_heads + h}] = {offsets[b, h]} "
                f"(b={b}, h={h}) with seq_lens[{b}] = {seq[b]}",
            )
        # o is in [0, L] here, so L - o cannot overflow.
        bad = comp & ((lens < 0) | (lens > seq_bh - offsets))
        if bad.any():
            b, h = first(bad)
            raise value_error(
                "compress_lens",
                "0 <= w and o + w <= seq_lens[b] for a compressed head",
                f"compress_lens[{b}, {h}] = {lens[b, h]} with compress_seq_offsets"
                f"[{b * meta.num_heads + h}] = {offsets[b, h]}, seq_lens[{b}] = {seq[b]}",
            )
    rows = np.zeros(base.shape, np.int64)
    for b, h in np.argwhere(active):
        offset = -1 if offsets is None else int(offsets[b, h])
        copies, mean = run_segments(str(meta.mode), int(seq[b]), int(lens[b, h]), offset)
        rows[b, h] = sum(count for _, _, count in copies) + (mean is not None)
    return rows


def check_scatter_values(
    meta: ScatterMeta,
    slot_mapping: np.ndarray,
    compress_lens: np.ndarray | None = None,
    compress_seq_offsets: np.ndarray | None = None,
    seq_lens: np.ndarray | None = None,
) -> None:
    """Validate the index values of one call (docs/SPEC.md S6 constraints and S7).

    Parameters
    ----------
    meta : ScatterMeta
        What :func:`check_scatter` returned for the same call.
    slot_mapping : numpy.ndarray, [T] or [B, H]
        Negative = padding (skipped).
    compress_lens, compress_seq_offsets, seq_lens : numpy.ndarray or None
        [B, H], [B*H], [B] for a 4-D key, as check_scatter accepted them.

    Raises
    ------
    ValueError
        A slot (or a row of an S6 run) >= NB*BS, a duplicate non-negative slot,
        overlapping runs, or a broken S6 constraint; the message names the token (or
        (b, h)) and the value.

    Examples
    --------
    >>> import numpy as np
    >>> from pytrt_kv.contract.scatter import check_scatter, check_scatter_values
    >>> key = np.zeros((2, 1, 4), np.float32)
    >>> cache = np.zeros((2, 3, 1, 4), np.float32)     # 6 slots, nd
    >>> slots = np.array([5, 6], np.int32)
    >>> meta = check_scatter(key, None, cache, None, slots)
    >>> check_scatter_values(meta, slots)
    Traceback (most recent call last):
    ...
    ValueError: slot_mapping: expected every non-negative slot < NB*BS = 6, got slot 6 for token 1
    """
    n_slots = meta.num_slots
    if not meta.compress:
        slots = _as_index("slot_mapping", slot_mapping, (meta.num_tokens,))
        over = np.flatnonzero(slots >= n_slots)
        if over.size:
            t = int(over[0])
            raise value_error(
                "slot_mapping",
                f"every non-negative slot < NB*BS = {n_slots}",
                f"slot {slots[t]} for token {t}",
            )
        used = slots[slots >= 0]
        values, counts = np.unique(used, return_counts=True)
        if (counts > 1).any():
            s = values[np.argmax(counts > 1)]
            t0, t1 = np.flatnonzero(slots == s)[:2]
            raise value_error(
                "slot_mapping", "distinct non-negative slots", f"slot {s} for tokens {t0} and {t1}"
            )
        return

    shape_bh = (meta.batch, meta.num_heads)
    base = _as_index("slot_mapping", slot_mapping, shape_bh)
    for arg, x in (("compress_lens", compress_lens), ("seq_lens", seq_lens)):
        if x is None:
            raise value_error(arg, "a tensor for a 4-D key", "None")
    lens = _as_index("compress_lens", compress_lens, shape_bh)
    seq = _as_index("seq_lens", seq_lens, (meta.batch,))
    offsets = None
    if meta.mode != "alibi":
        if compress_seq_offsets is None:
            raise value_error(
                "compress_seq_offsets", f"a tensor for compress_mode={meta.mode!r}", "None"
            )
        offsets = _as_index(
            "compress_seq_offsets", compress_seq_offsets, (meta.batch * meta.num_heads,)
        ).reshape(shape_bh)

    rows = _run_rows(meta, base, lens, offsets, seq)
    # docs/SPEC.md S7: a run of zero rows (omni with L - w == 0, alibi with w == 0,
    # L == 0) writes nothing, so its base slot is not checked.
    bad = np.argwhere((rows > 0) & (base >= n_slots))
    if bad.size:
        b, h = (int(i) for i in bad[0])
        raise value_error(
            "slot_mapping",
            f"every row of a run < NB*BS = {n_slots}",
            f"slot_mapping[{b}, {h}] = {base[b, h]} for (b, h) = ({b}, {h})",
        )
    # Live runs have base < NB*BS and rows <= Smax + 1: no overflow; empty runs end at 0.
    end = np.where(rows > 0, np.minimum(base, n_slots) + rows, 0)
    bad = np.argwhere((rows > 0) & (end > n_slots))
    if bad.size:
        b, h = (int(i) for i in bad[0])
        raise value_error(
            "slot_mapping",
            f"every row of a run < NB*BS = {n_slots}",
            f"(b, h) = ({b}, {h}) writing rows [{base[b, h]}, {end[b, h]}) from slot {base[b, h]}",
        )
    live = np.argwhere(rows > 0)
    if len(live) > 1:
        starts = base[live[:, 0], live[:, 1]]
        order = np.argsort(starts, kind="stable")
        live, starts = live[order], starts[order]
        ends = end[live[:, 0], live[:, 1]]
        clash = np.flatnonzero(starts[1:] < ends[:-1])
        if clash.size:
            i = int(clash[0])
            (b0, h0), (b1, h1) = live[i], live[i + 1]
            raise value_error(
                "slot_mapping",
                "runs of different (b, h) that do not overlap",
                f"(b, h) = ({b0}, {h0}) writing rows [{starts[i]}, {ends[i]}) "
                f"and (b, h) = ({b1}, {h1}) writing rows [{starts[i + 1]}, "
                f"{ends[i + 1]})",
            )


def check_scale_values(
    meta: ScatterMeta,
    k_scale: np.ndarray | None,
    v_scale: np.ndarray | None,
    key: np.ndarray | None = None,
    value: np.ndarray | None = None,
) -> None:
    """docs/SPEC.md S9 value rules: every scale finite and > 0; a source quantised into an
    int8 cache holds no NaN (checked when ``key`` / ``value`` are given).

    Raises
    ------
    ValueError
        Naming the scale (and head) or the source and the first NaN's index.
    """
    for arg, scale, src_arg, src, cache_dt in (
        ("k_scale", k_scale, "key", key, meta.key_cache_dtype),
        ("v_scale", v_scale, "value", value, meta.value_cache_dtype),
    ):
        if scale is None:
            continue
        if not isinstance(scale, np.ndarray):
            raise type_error(arg, "a NumPy array", describe(scale))
        flat = scale.reshape(-1).astype(np.float32)
        bad = np.flatnonzero(~(np.isfinite(flat) & (flat > 0)))
        if bad.size:
            i = int(bad[0])
            where = f"{arg}[{i}]" if scale.ndim else arg
            raise value_error(arg, "finite scales > 0", f"{where} = {float(flat[i])!r}")
        if src is not None and cache_dt == specs.INT8:
            nan = np.argwhere(np.isnan(src.astype(np.float32)))
            if nan.size:
                raise value_error(
                    src_arg,
                    "no NaN when quantising into an int8 cache (int8 has no NaN)",
                    f"NaN at {src_arg}[{', '.join(str(int(i)) for i in nan[0])}]",
                )


def check_scatter_numpy(args: dict[str, Any]) -> None:
    """The NumPy reference's extra rules: NumPy arrays, writeable C-contiguous caches, no
    argument sharing memory with a cache (``args``: argument name -> argument)."""
    for arg, x in args.items():
        if x is not None and not isinstance(x, np.ndarray):
            raise type_error(
                arg,
                "a NumPy array (the reference runs on the CPU; use pytrt_kv.ops for GPU tensors)",
                describe(x),
            )
    for arg in ("key_cache", "value_cache"):
        x = args[arg]
        if x is None:
            continue
        if not x.flags.c_contiguous:
            raise value_error(
                arg,
                "a C-contiguous NumPy array (it is updated in place)",
                f"a non-contiguous {describe(x)}",
            )
        if not x.flags.writeable:
            raise value_error(
                arg,
                "a writeable NumPy array (it is updated in place)",
                f"a read-only {describe(x)}",
            )
    check_no_alias({arg: array_range(x) for arg, x in args.items()}, SCATTER_WRITTEN, args)


#: How :func:`validate_scatter` / ``validate_gather`` reach the index values: "numpy"
#: (the arguments are the NumPy reference's arrays), a function returning a host copy of
#: one tensor (:mod:`pytrt_kv.ops` with ``validate=True``), or None (shapes only).
Read = Literal["numpy"] | Callable[[Any], np.ndarray] | None


def validate_scatter(
    key: Any,
    value: Any,
    key_cache: Any,
    value_cache: Any,
    slot_mapping: Any,
    *,
    compress_lens: Any = None,
    compress_seq_offsets: Any = None,
    seq_lens: Any = None,
    cache_layout: str | None = None,
    compress_mode: str | None = None,
    k_scale: Any = None,
    v_scale: Any = None,
    read: Read = "numpy",
) -> ScatterMeta:
    """Every rule of docs/SPEC.md S on one call, before anything is written.

    Arguments as :func:`pytrt_kv.reference.scatter_pa_kv_cache`; ``read`` as :data:`Read`.
    With "numpy" the arguments must also be NumPy arrays, the caches writeable and
    C-contiguous, and no argument may share memory with a cache (:func:`check_scatter_numpy`),
    and a source quantised into an int8 cache must hold no NaN.

    Raises
    ------
    TypeError, ValueError
        Naming the argument, what was expected and what came.
    """
    named = {
        "key": key,
        "value": value,
        "key_cache": key_cache,
        "value_cache": value_cache,
        "slot_mapping": slot_mapping,
        "compress_lens": compress_lens,
        "compress_seq_offsets": compress_seq_offsets,
        "seq_lens": seq_lens,
        "k_scale": k_scale,
        "v_scale": v_scale,
    }
    meta = check_scatter(
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        compress_lens=compress_lens,
        compress_seq_offsets=compress_seq_offsets,
        seq_lens=seq_lens,
        cache_layout=cache_layout,
        compress_mode=compress_mode,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    if read is None:
        return meta
    if read == "numpy":
        check_scatter_numpy(named)
        host = named
        sources = (key, value)
    else:
        fetch = read  # a GPU call: only the index tensors and scales are copied back
        host = {
            k: (None if x is None else fetch(x)) for k, x in named.items() if k not in _DATA_ARGS
        }
        sources = (None, None)
    check_scale_values(meta, host["k_scale"], host["v_scale"], *sources)
    check_scatter_values(
        meta,
        host["slot_mapping"],
        compress_lens=host["compress_lens"],
        compress_seq_offsets=host["compress_seq_offsets"],
        seq_lens=host["seq_lens"],
    )
    return meta
