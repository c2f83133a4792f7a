"""Refusal of arguments that share memory with a tensor the op writes (private).

Both operators update some arguments in place. When another argument views the same
memory (a scatter ``value`` that is a slice of a cache, a gather status that overlaps an
index table, two outputs on one buffer), the result would depend on the order of the
writes: the reference would write part of its output and then fail, or silently copy
the wrong block. So every layer refuses such a call up front, with a ValueError naming
both arguments. The rule works on byte ranges ``[start, end)``, which the NumPy
reference takes from the arrays and ``pytrt_kv.ops`` from the buffers' addresses: the
same check for host and device memory. For NumPy arrays whose ranges overlap, the exact
test (``numpy.shares_memory``) decides, so interleaved views that share no element
(``k_rope`` and ``kv`` as column slices of one buffer) are accepted by the reference;
the GPU API takes dense buffers only, whose ranges are exact.

Reading one memory through two read-only arguments (e.g. ``key`` and ``value`` as views
of one projection) is allowed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .errors import value_error

#: A byte range [start, end), or None for a tensor that holds no bytes.
Range = tuple[int, int] | None

try:  # NumPy >= 2
    from numpy.lib.array_utils import byte_bounds as _byte_bounds
except ImportError:  # NumPy 1.x
    _byte_bounds = np.byte_bounds  # type: ignore[attr-defined]

_TOO_HARD = getattr(np, "exceptions", np).TooHardError


def array_range(x: Any) -> Range:
    """Byte range spanned by a NumPy array (any strides); None for None, a non-array or
    no elements."""
    if not isinstance(x, np.ndarray) or x.size == 0:
        return None
    lo, hi = _byte_bounds(x)
    return int(lo), int(hi)


def buffer_range(ptr: int | None, nbytes: int) -> Range:
    """Byte range of a dense buffer at address ``ptr``; None when empty or null."""
    if not ptr or nbytes <= 0:
        return None
    return int(ptr), int(ptr) + int(nbytes)


def _share(x: Any, y: Any) -> bool:
    """Exact answer for two NumPy arrays whose byte ranges overlap; True otherwise."""
    if not (isinstance(x, np.ndarray) and isinstance(y, np.ndarray)):
        return True
    try:
        # numpy's stubs only allow -1 / 0, the runtime takes any bound (NumPy docs: max_work).
        return bool(np.shares_memory(x, y, max_work=1 << 20))  # type: ignore[arg-type]
    except _TOO_HARD:
        return True  # not decidable cheaply: refuse rather than risk racing writes


def check_no_alias(
    ranges: Mapping[str, Range], written: Sequence[str], arrays: Mapping[str, Any] | None = None
) -> None:
    """Refuse any two arguments whose memory overlaps when at least one is written.

    Parameters
    ----------
    ranges : mapping argument name -> byte range or None
        Every argument of the call, in signature order (None: holds no bytes).
    written : sequence of str
        The arguments the call writes (in place, or as outputs).
    arrays : mapping argument name -> array, optional
        The arguments themselves: two NumPy arrays whose ranges overlap are then tested
        element by element (``numpy.shares_memory``).

    Raises
    ------
    ValueError
        ``"<written>: expected memory separate from <other> (...), got an array
        overlapping <other>"`` for the first offending pair in argument order.
    """
    names = [n for n, r in ranges.items() if r is not None]
    for j, b in enumerate(names):
        lo_b, hi_b = ranges[b]  # type: ignore[misc]
        for a in names[:j]:
            if a not in written and b not in written:
                continue
            lo_a, hi_a = ranges[a]  # type: ignore[misc]
            if (
                lo_a < hi_b
                and lo_b < hi_a
                and (arrays is None or _share(arrays.get(a), arrays.get(b)))
            ):
                subject, other = (b, a) if b in written else (a, b)
                raise value_error(
                    subject,
                    f"memory separate from {other} ({subject} is written by the "
                    f"op, so no other argument may share its memory)",
                    f"an array overlapping {other}",
                )
