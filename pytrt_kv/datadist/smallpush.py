"""The small-push path in C (``plugins/python/smallpush.c``, installed as
``pytrt_kv/datadist/_smallpush.abi3.so``; docs/DATADIST.md decision 15), when built.

:func:`load` gives the extension module set up with the Python path's types, helper and
constants (one source), or None where it is not built (a source checkout, an interpreter
older than the stable ABI it targets) or ``PYTRT_KV_DATADIST_C=0`` turns it off: the
Python path in ``llm_datadist.py`` is then taken, with the same results (the tests run
both)."""

from __future__ import annotations

import importlib
import os
from typing import Any

import numpy as np

from .handles import POLL_SPIN_S
from .nixl_prepared import _IDLE_PER_PLAN
from .plans import _DRAIN_EVERY_S, _PLAN_CACHE_BLOCKS, _ids_key
from .types import Cache

#: The environment variable that turns the C path off ("0").
ENV = "PYTRT_KV_DATADIST_C"


def load() -> Any:
    """The set-up ``_smallpush`` module, or None (not built, or turned off).

    Raises
    ------
    ValueError
        ``PYTRT_KV_DATADIST_C`` holds anything but ``0``, ``1`` or nothing.
    """
    value = os.environ.get(ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENV}: expected '0' (off) or '1' (on; or unset), got {value!r}")
    if value == "0":
        return None
    try:
        _smallpush = importlib.import_module("._smallpush", __package__)
    except ImportError:
        return None
    _smallpush.setup(
        Cache, np.ndarray, _ids_key, _PLAN_CACHE_BLOCKS, _DRAIN_EVERY_S, POLL_SPIN_S,
        _IDLE_PER_PLAN,
    )  # fmt: skip
    return _smallpush
