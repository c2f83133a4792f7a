"""docs/SPEC.md S2: which cache layout a 3-D key write uses, read from the layout table
(:mod:`pytrt_kv.contract.layouts`): the requested one, checked, or the one every cache
fits."""

from __future__ import annotations

from typing import Any

from ..errors import describe, value_error
from ..layouts import LAYOUTS, NZ_SEGMENT_BYTES

#: One cache as the layout rules see it: (argument name, argument, shape, D, itemsize).
Cache = tuple[str, Any, tuple[int, ...], int, int]


def pick_layout(requested: str | None, caches: list[Cache], heads: int) -> str:
    """docs/SPEC.md S2: the layout every cache fits (or the requested one, checked)."""
    if requested is not None:
        lay = LAYOUTS[requested]
        for arg, x, shape, size, item in caches:
            if not lay.fits_heads(heads, size, item):
                raise value_error(
                    arg,
                    f"H*D*itemsize divisible by {NZ_SEGMENT_BYTES} for cache_layout="
                    f"{requested!r} (H={heads}, D={size}, "
                    f"L={lay.segment_elems(heads, size, item)})",
                    describe(x),
                )
            if lay.fit(shape, heads, size, item) is None:
                raise value_error(
                    arg,
                    f"{lay.pattern(heads, size, item)} for cache_layout={requested!r}",
                    describe(x),
                )
        return requested
    fitting = [
        name
        for name, lay in LAYOUTS.items()
        if all(lay.fit(shape, heads, size, item) is not None for _, _, shape, size, item in caches)
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
    for arg, x, shape, size, item in caches:
        if not any(lay.fit(shape, heads, size, item) for lay in LAYOUTS.values()):
            options = ", ".join(
                f"{name} {lay.pattern(heads, size, item)}" for name, lay in LAYOUTS.items()
            )
            raise value_error(arg, f"the shape of one layout: {options}", describe(x))
    raise value_error(
        "value_cache",
        "the layout of key_cache",
        f"value_cache {describe(caches[1][1])} fits no layout that key_cache "
        f"{describe(caches[0][1])} fits",
    )
