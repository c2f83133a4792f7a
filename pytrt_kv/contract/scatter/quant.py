"""docs/SPEC.md S9 rules of ScatterPaKvCache (quantise on write): which cache dtype goes
with which source and scale, the scales' shapes, and their values. The quantised dtypes
themselves are the table of :mod:`pytrt_kv.contract.quant`."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import specs
from ..errors import describe, type_error, value_error
from ..quant import QUANT
from .basics import ScatterMeta, arg_dtype, arg_shape


def check_cache_dtype(
    arg: str, cache: Any, cache_dt: str | None, src: str, src_dt: str | None, scale: Any
) -> None:
    """docs/SPEC.md S8/S9: a cache has its source's dtype, or, with a scale, a quantised
    dtype fed from a float source."""
    scale_arg = "k_scale" if src == "key" else "v_scale"
    if scale is None:
        if cache_dt != src_dt:
            hint = ""
            if cache_dt in QUANT:
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
    if cache_dt not in tuple(QUANT):
        raise type_error(
            arg,
            f"a quantised dtype ({', '.join(QUANT)}) because {scale_arg} is given",
            f"{cache_dt} ({describe(cache)})",
        )


def check_scale(arg: str, scale: Any, heads: int) -> int:
    """docs/SPEC.md S9: a float32 scale of shape [] (per tensor) or [H] (per head); returns
    its number of values (0 when absent)."""
    if scale is None:
        return 0
    shape = arg_shape(arg, scale)
    arg_dtype(arg, scale, specs.SCATTER_SCALE_DTYPES, "a float32")
    if shape == ():
        return 1
    if shape == (heads,):
        return heads
    raise value_error(arg, f"shape [] (per tensor) or [H={heads}] (per head)", describe(scale))


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
        quantised = QUANT.get(cache_dt or "")
        if src is not None and quantised is not None and quantised.integer:
            nan = np.argwhere(np.isnan(src.astype(np.float32)))
            if nan.size:
                raise value_error(
                    src_arg,
                    f"no NaN when quantising into an {quantised.name} cache "
                    f"({quantised.name} has no NaN)",
                    f"NaN at {src_arg}[{', '.join(str(int(i)) for i in nan[0])}]",
                )
