"""What every ScatterPaKvCache check reads (docs/SPEC.md S): the meta that
:func:`~.shapes.check_scatter` returns, and the primitives that read one argument's
shape, dtype or string option and name it in the error."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..dtypes import name_of, numpy_dtype
from ..errors import describe, type_error, value_error
from ..layouts import nz_last_dim as _nz_last_dim

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
    return _nz_last_dim(numpy_dtype(dtype).itemsize)


def arg_shape(arg: str, x: Any) -> tuple[int, ...]:
    shape = getattr(x, "shape", None)
    if shape is None or getattr(x, "dtype", None) is None:
        raise type_error(arg, "an array or tensor (an object with .shape and .dtype)", describe(x))
    try:
        return tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        raise type_error(arg, "a shape of integers", repr(shape)) from None


def arg_dtype(arg: str, x: Any, allowed: Sequence[str], what: str, why: str = "") -> str:
    try:
        name: str | None = name_of(x.dtype)
    except TypeError:
        name = None
    if name is None or name not in allowed:
        raise type_error(
            arg, f"{what} dtype ({', '.join(allowed)}){why}", f"{x.dtype} ({describe(x)})"
        )
    return name


def string_option(arg: str, value: Any, choices: Sequence[str]) -> str | None:
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


def fmt(shape: Sequence[Any]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def require_same(arg: str, x: Any, got: str | None, expected: str | None, other: str) -> None:
    if got != expected:
        raise value_error(arg, f"dtype {expected} (same as {other})", f"{got} ({describe(x)})")
