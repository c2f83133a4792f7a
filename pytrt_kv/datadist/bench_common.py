"""What both datadist benchmarks (:mod:`.bench`, :mod:`.bench_latency`) share: the
targets, the rotation of a timing loop's order, and a raw NIXL push polled as the wrapper
polls (the baseline the wrapper is measured against)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from .handles import _poll_sleep

TARGETS = {"wrapper_vs_raw": 0.90, "gpu_vs_memcpy": 0.80}


def raw_agent(name: str) -> Any:
    """A bare NIXL agent made as the wrapper's nodes make theirs on 127.0.0.1: the same
    progress thread, delay and thread safety (:func:`.nixl_agent._make_agent`) and UCX
    on the loopback interface only (:func:`.nixl_agent._net_devices`, the security work
    of issue 30), so that wrapper / raw is the wrapper's own cost, not a configuration
    difference (agents made with and without ``UCX_NET_DEVICES=lo`` took 60 against
    380 us per repost, median, one process pair on the loaded 2-core VM, 2026-11-27)."""
    from .nixl_agent import _make_agent, _net_devices, nixl_modules

    api, bindings = nixl_modules()
    with _net_devices("127.0.0.1"):
        return _make_agent(api, bindings, name, {}, ["UCX"])


def _rotated(items: list[Any], r: int) -> list[Any]:
    """``items`` starting at its ``r``-th (mod len): repeat r of a timing loop starts with
    another of them, since the first timing after a pause (the progress threads asleep,
    another process pair's turn) is slower and a fixed order charges that to one."""
    k = r % len(items)
    return items[k:] + items[:k]


def _raw_post(a: Any, h: Any, notif: bytes = b"") -> None:
    """Post a raw NIXL transfer and poll it as the wrapper polls until it is done."""
    st, start = a.transfer(h, notif), time.monotonic()
    while st == "PROC":
        _poll_sleep(start)
        st = a.check_xfer_state(h)
    if st != "DONE":
        raise RuntimeError("raw NIXL transfer failed")


def _raw_push(a: Any, local: Any, remote: Any, li: np.ndarray, ri: np.ndarray) -> None:
    """One raw NIXL push: ``make_prepped_xfer`` + ``transfer`` + polling as the wrapper
    polls + ``release``."""
    h = a.make_prepped_xfer("WRITE", local, li, remote, ri, notif_msg=b"raw")
    _raw_post(a, h)
    h.release()
