"""The cache registry of a node: caches, their deallocation, and the quarantine of memory
a peer may still write (docs/SPEC.md D8; docs/DATADIST.md, "Failure semantics").

A deallocated cache's memory stays registered and owned while any peer that knew it may
still write into it: a linked peer that did not acknowledge the deallocation, or a
fenced one (unlinked without hearing it, :class:`~.node_base.Fence`) until it
acknowledges, links again, is found gone, or ``llm_datadist.fence_timeout_s`` passes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ..contract.errors import describe
from . import control, memory
from .node_base import BYE, DROP, NodeState
from .transport import CacheInfo
from .types import Cache, CacheDesc, LLMException, LLMStatus

#: Allocations a node finalized while a fenced peer might still write them (docs/SPEC.md
#: D8): never freed. A fenced peer that never answers is rare (it would have to outlive
#: both its control server and fence_timeout_s); each entry is one cache's tensors.
RETAINED: list[list[Any]] = []


class CacheMixin(NodeState):
    """Caches and quarantine."""

    def allocate_cache(self, cache_desc: CacheDesc) -> Cache:
        """Allocate and register a cache; ``cache.tensors`` are its arrays (NumPy for a host
        cache, :class:`pytrt_kv.trt.DeviceArray`-style for a device one)."""
        if not isinstance(cache_desc, CacheDesc):
            raise TypeError(f"cache_desc: expected a CacheDesc, got {describe(cache_desc)}")
        self._require()
        tensors, addrs = memory.allocate(cache_desc)
        return self._add_cache(cache_desc, tensors, addrs, owned=True)

    def register_cache(self, cache_desc: CacheDesc, tensors: Sequence[Any]) -> Cache:
        """Register memory the caller owns (engine buffers, torch/CuPy tensors, the
        project's device or pinned arrays, NumPy arrays, or int addresses) as a cache.

        Each of the ``num_tensors`` tensors must be C-contiguous with ``cache_desc``'s
        shape and dtype, in the placement it names; keep them alive until
        :meth:`deallocate_cache`.

        Raises
        ------
        TypeError, ValueError
            Naming the tensor that does not fit, or two tensors that overlap.
        """
        if not isinstance(cache_desc, CacheDesc):
            raise TypeError(f"cache_desc: expected a CacheDesc, got {describe(cache_desc)}")
        self._require()
        if isinstance(tensors, (str, bytes)) or not isinstance(tensors, Sequence):
            raise TypeError(
                f"tensors: expected a list of {cache_desc.num_tensors} tensors, got "
                f"{describe(tensors)}"
            )
        if len(tensors) != cache_desc.num_tensors:
            raise ValueError(
                f"tensors: expected {cache_desc.num_tensors} tensors "
                f"(cache_desc.num_tensors), got {len(tensors)}"
            )
        addrs = tuple(
            memory.tensor_address(f"tensors[{i}]", t, cache_desc) for i, t in enumerate(tensors)
        )
        order = sorted(range(len(addrs)), key=lambda i: addrs[i])
        for a, b in zip(order, order[1:]):
            if addrs[a] + cache_desc.tensor_bytes > addrs[b]:
                raise ValueError(
                    f"tensors[{b}]: expected memory of its own, got an overlap with tensors[{a}]"
                )
        self._check_not_quarantined(cache_desc, addrs)
        return self._add_cache(cache_desc, list(tensors), addrs, owned=False)

    def _check_not_quarantined(self, desc: CacheDesc, addrs: tuple[int, ...]) -> None:
        """Refuse memory a peer may still write: that of a deallocated cache some peer has
        not acknowledged (issue 19 item 1)."""
        if not self._quarantine:
            return
        self._drain()  # acknowledgements that came with the data path
        self._review_fences()
        with self._lock:
            held = [(c, sorted(p)) for c, p in self._quarantine.values()]
        for cache, pending in held:
            d = cache.cache_desc
            if (d.placement, d.device if d.placement == "device" else 0) != (
                desc.placement,
                desc.device if desc.placement == "device" else 0,
            ):
                continue
            for i, a in enumerate(addrs):
                for b in cache.tensor_addrs:
                    if a < b + d.tensor_bytes and b < a + desc.tensor_bytes:
                        raise ValueError(
                            f"tensors[{i}]: expected memory no peer may still write, got "
                            f"memory of cache {cache.cache_id}, deallocated but not yet "
                            f"acknowledged by cluster(s) {pending} (docs/DATADIST.md, "
                            f"'Failure semantics'; docs/SPEC.md D8): retry once they have "
                            f"pushed or linked again, or unlink them"
                        )

    def _add_cache(
        self, desc: CacheDesc, tensors: list[Any], addrs: tuple[int, ...], owned: bool
    ) -> Cache:
        with self._lock:
            cache = Cache(next(self._ids), desc, addrs, tensors, next(self._generations), owned)
            self._last_generation = cache.generation
            cache._info = self._info(cache)
            cache._backend_state = self._require().register(cache._info)
            self._caches[cache.cache_id] = cache
        return cache

    @staticmethod
    def _info(cache: Cache) -> CacheInfo:
        return CacheInfo(cache.cache_id, cache.generation, cache.cache_desc, cache.tensor_addrs)

    def deallocate_cache(self, cache: Cache) -> None:
        """Forget a cache: every linked peer is told first (bounded by
        ``control_timeout_s`` each), then its memory is deregistered (and freed if this
        node allocated it).

        A peer that could not be told may still write into the cache, so its memory stays
        registered and owned (:meth:`quarantined_caches`) until every such peer
        acknowledged or was unlinked; the notice is sent again with the data path, and a
        peer acknowledges it at its next transfer call (docs/DATADIST.md, "Failure
        semantics").

        Raises
        ------
        LLMException
            KV_CACHE_NOT_EXIST if the cache is not (or no longer) registered here.
        """
        with self._lock:
            if not isinstance(cache, Cache) or self._caches.get(cache.cache_id) is not cache:
                what = cache.cache_id if isinstance(cache, Cache) else describe(cache)
                raise LLMException(
                    LLMStatus.KV_CACHE_NOT_EXIST,
                    f"cache: not a live cache of cluster {self.cluster_id}: {what}",
                )
            del self._caches[cache.cache_id]
            peers = list(self._peers.values())
            # Fenced peers that knew it may still write into it (docs/SPEC.md D8).
            pending = {c for c, f in self._fences.items() if f.generation >= cache.generation}
        # Its kept plans would keep the cache (and memory it allocated) alive.
        self._drop_plans(lambda k: k.local is cache)
        msg = {"op": "drop", "cache_id": cache.cache_id, "generation": cache.generation}
        for peer in peers:
            try:
                _, reply = control.request(
                    peer.address, msg, self._control_timeout(), self._auth_of(), peer.cluster_id
                )
                if "error" not in reply:
                    continue
            except OSError:
                pass
            pending.add(peer.cluster_id)
            notice = f"{DROP}|{peer.epoch}|{self.cluster_id}|{cache.cache_id}|{cache.generation}"
            try:
                self._require().notify(peer.agent, notice.encode())
            except LLMException:
                pass  # the peer hears of it when it links again (or is unlinked)
        if pending:
            with self._lock:
                # A peer unlinked (and heard it) meanwhile no longer counts.
                pending &= set(self._peers) | set(self._fences)
                if pending:
                    self._quarantine[cache.cache_id] = (cache, pending)
                    return
        self._release_memory(cache)

    def _release_memory(self, cache: Cache, retain: bool = False) -> None:
        """Deregister a cache's memory and free what this node allocated; ``retain``: a
        fenced peer may still write it, keep the allocation for the life of the process
        (:data:`RETAINED`)."""
        self._require().deregister(cache._backend_state)
        cache._backend_state = None
        if cache.owned and retain:
            RETAINED.append(cache.tensors)
            cache.tensors = []
        elif cache.owned:
            for t in cache.tensors:
                if hasattr(t, "free"):
                    t.free()
            cache.tensors = []

    def _acknowledged(self, cluster_id: int, cache_id: int | None = None) -> None:
        """``cluster_id`` no longer knows ``cache_id`` (None: any of this node's former
        caches): release what no peer may write any more."""
        with self._lock:
            free = []
            for cid, (cache, pending) in list(self._quarantine.items()):
                if cache_id is None or cid == cache_id:
                    pending.discard(cluster_id)
                    if not pending:
                        del self._quarantine[cid]
                        free.append(cache)
        for cache in free:
            self._release_memory(cache)

    def quarantined_caches(self) -> list[int]:
        """Ids of deallocated caches whose memory is still held because a linked peer has
        not acknowledged the deallocation, or a fenced one has not answered yet
        (docs/DATADIST.md, "Failure semantics"; docs/SPEC.md D8)."""
        if self._quarantine or self._fences:
            self._drain()
            self._review_fences()
        with self._lock:
            return sorted(self._quarantine)

    # --- fences (docs/SPEC.md D8) -----------------------------------------------------------

    def _auth_of(self) -> control.Auth:
        assert self._auth is not None  # set by initialize
        return self._auth

    def _review_fences(self, force: bool = False) -> None:
        """Release the fences whose peer acknowledged the unlink over the control channel
        (a ``bye`` retried at most once a second), whose NIXL connection is gone while its
        control port refuses (the process is gone), or whose ``fence_timeout_s`` passed;
        the others are told in-band again (:data:`~.node_base.BYE`)."""
        if not self._fences:
            return
        now = time.monotonic()
        with self._lock:
            due = [f for f in self._fences.values() if force or now >= f.next_try or now >= f.until]
            for f in due:
                f.next_try = now + 1.0
        for f in due:
            peer = f.peer
            if now >= f.until:
                self._release_fence(peer.cluster_id)
                continue
            try:
                control.request(
                    peer.address,
                    {"op": "bye", "agent": self._require().name, "epoch": peer.epoch},
                    min(0.5, self._control_timeout()),
                    self._auth_of(),
                    peer.cluster_id,
                )
                self._release_fence(peer.cluster_id)  # it heard the unlink now
                continue
            except ConnectionRefusedError:
                refused = True
            except OSError:
                refused = False
            try:
                self._tell_unlink(peer)
            except LLMException:
                if refused:  # neither channel reaches it: the process is gone
                    self._release_fence(peer.cluster_id)

    def _tell_unlink(self, peer: Any) -> None:
        self._require().notify(peer.agent, f"{BYE}|{peer.epoch}|{self.cluster_id}".encode())
