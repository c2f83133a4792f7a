"""The NumPy reference's extra rules for ScatterPaKvCache: NumPy arrays, writeable
C-contiguous caches, no argument sharing memory with a cache."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..alias import array_range, check_no_alias
from ..errors import describe, type_error, value_error
from .basics import SCATTER_WRITTEN


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
