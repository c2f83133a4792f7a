"""Writes in flight from this node (docs/SPEC.md D8, "Two writers"): a push or pull whose
destination blocks overlap those of a transfer this node still has in flight is refused
with REPEAT_REQUEST before anything is posted.

Cheap on the small-push path: a claim into a destination with nothing else in flight is
a few atomic dict operations without a lock, and its release one ``dict.pop`` (a lock
cycle cost 0.6 us on the 2-core VM under load, as much as the rest); block sets are built
only when two transfers to one destination cache meet, once per plan.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any

from .contract import TransferPlan
from .types import LLMException, LLMStatus

#: A claim: ``[destination key, first tensor, end tensor, plan, handle, its destination's
#: claims, its id there]``. A list, not an object: one is made per transfer (~0.1 us
#: instead of ~0.4 us for a class instance). ``handle`` is None while the transfer is
#: being posted, then a weak reference to its :class:`~.handles.TransferHandle`, which
#: releases the claim when the transfer ends.
Claim = list
_KEY, _LO, _HI, _PLAN, _HANDLE, _BUSY, _ID = range(7)
#: Destinations kept with no claim before the empty ones are dropped (under the lock).
_MAX_IDLE_DESTINATIONS = 1024


def span(plan: TransferPlan) -> tuple[int, int]:
    """The destination tensors ``[lo, hi)`` of a plan (a layer range: consecutive)."""
    t = plan.dst_tensors
    return (t[0], t[-1] + 1) if t else (0, 0)


def _block_set(plan: TransferPlan) -> frozenset:
    """The plan's destination block ids as a set, made once per plan (a kept plan is
    reused, its set with it)."""
    s = plan._indices.get("dst_set")
    if s is None:
        s = plan._indices["dst_set"] = frozenset(plan.dst_blocks.tolist())
    return s


def _overlap(a: Claim, b: Claim) -> int | None:
    """A destination block both claims write in a common tensor (None: disjoint)."""
    if a[_LO] >= b[_HI] or b[_LO] >= a[_HI]:
        return None
    x, y = _block_set(a[_PLAN]), _block_set(b[_PLAN])
    common = x & y if len(x) <= len(y) else y & x
    return min(common) if common else None


def _running(c: Claim) -> bool:
    """True while the claim's transfer may still write: being posted, or posted and its
    handle neither released (complete, failed, timed out, cancelled: each releases the
    claim too) nor dropped by the caller unreleased (garbage: the blocks are not held
    forever). Never calls into the transport (another thread may be releasing it)."""
    ref = c[_HANDLE]
    if ref is None:
        return True
    h = ref()
    return h is not None and not h.released


def posted(c: Claim, handle: Any) -> None:
    c[_HANDLE] = weakref.ref(handle)


class Writes:
    """This node's transfers in flight, by destination cache.

    A claim is inserted first and checked after, against a snapshot of its destination's
    claims: of two overlapping claims made at once, the later one to be inserted sees the
    earlier (at worst both see each other and both are refused; never neither). The
    common case, a destination with nothing in flight, takes no lock: insert into its
    (empty) dict, then find that dict still holds only this claim and is still the
    destination's. Everything else (a first transfer to a destination, one with others
    in flight, dropping empty dicts) runs under the lock; a dict is dropped only when it
    is empty after being unlisted, so a claim is never left in an unlisted dict.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: destination key -> {claim id: claim}; releases pop from the claim's own dict.
        self._by_dst: dict[tuple, dict[int, Claim]] = {}
        self._ids = itertools.count()

    def claim(self, key: tuple, plan: TransferPlan, lo_hi: tuple[int, int]) -> Claim:
        """Record a transfer of ``plan`` into destination ``key`` (a cache: ``(cluster,
        cache id, generation)``, :func:`.node_base.dst_key`), tensors ``lo_hi``
        (:func:`span`), or refuse it when it overlaps one in flight.

        Raises
        ------
        LLMException
            REPEAT_REQUEST: a transfer of this node into the same blocks (of a common
            tensor) of that cache is still in flight; nothing was posted.
        """
        cid = next(self._ids)
        busy = self._by_dst.get(key)
        if busy is not None and not busy:  # nothing in flight there: no lock
            c = busy[cid] = [key, lo_hi[0], lo_hi[1], plan, None, busy, cid]
            if len(busy) == 1 and self._by_dst.get(key) is busy:
                return c
            busy.pop(cid, None)  # another claim came in at once, or the dict was unlisted
        with self._lock:
            busy = self._by_dst.get(key)
            if busy is None:
                if len(self._by_dst) >= _MAX_IDLE_DESTINATIONS:
                    self._drop_empty()
                busy = self._by_dst[key] = {}
            c = busy[cid] = [key, lo_hi[0], lo_hi[1], plan, None, busy, cid]
            try:
                self._check(c, busy)
            except LLMException:
                busy.pop(cid, None)
                raise
        return c

    def _drop_empty(self) -> None:
        """Unlist the destinations with nothing in flight (under the lock): each dict is
        unlisted first and listed again if a claim got into it meanwhile."""
        for k in [k for k, v in self._by_dst.items() if not v]:
            d = self._by_dst.pop(k)
            if d:
                self._by_dst[k] = d

    @staticmethod
    def _check(c: Claim, busy: dict[int, Claim]) -> None:
        key = c[_KEY]
        for cid, other in list(busy.items()):
            if other is c:
                continue
            block = _overlap(c, other)
            if block is None:
                continue
            if not _running(other):  # its handle was dropped unreleased
                busy.pop(cid, None)
                continue
            raise LLMException(
                LLMStatus.REPEAT_REQUEST,
                f"dst_blocks: block {block} of cache {key[1]} of cluster {key[0]} is "
                f"written by a transfer of this node still in flight; wait for it first "
                f"(docs/SPEC.md D8)",
            )

    @staticmethod
    def release(c: Claim) -> None:
        """The transfer ended (complete, failed, timed out, cancelled or never posted).
        No lock: one atomic pop from the claim's own destination dict."""
        c[_BUSY].pop(c[_ID], None)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._by_dst.values())


__all__ = ["Claim", "Writes", "posted", "span"]
