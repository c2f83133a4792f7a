"""Kept plans: repeated small requests reuse their checked plan (docs/DATADIST.md
decisions 12 and 13). A kept plan's key fixes everything the D4 check sees; it is used
only while what it was checked against is still this node's."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from .contract import TransferPlan, check_transfer
from .node_base import Kept, NodeState, Peer, dst_key
from .transport import CacheInfo
from .types import Cache, CacheIndex, KvCacheExtParam

#: A repeated request (a kept plan) reads in-band notices only if none were read for this
#: long: reading them costs ~10% of a small push (docs/DATADIST.md decision 12).
_DRAIN_EVERY_S = 1e-3
#: Checked plans kept for repeated requests (:meth:`PlanMixin._plan`), of at most
#: _PLAN_CACHE_BLOCKS blocks each: small pushes, whose D4 check costs as much as NIXL's
#: transfer (BENCHMARKS.md, "Small pushes").
_PLAN_CACHE_SIZE = 256
_PLAN_CACHE_BLOCKS = 256


def _ids_key(blocks: Any) -> tuple[Any, Any]:
    """``(key, ids)``: a plan-cache key that determines what :func:`check_transfer`
    sees of a block-id list or tuple (None: not cacheable) and what to pass it instead: a
    tuple of its values when every one is an exact int (a bool, a float or a NumPy scalar
    makes it uncacheable: the check decides on those). Arrays: :meth:`PlanMixin._kept`."""
    if type(blocks) is list or type(blocks) is tuple:
        if len(blocks) > _PLAN_CACHE_BLOCKS:
            return None, blocks
        t = tuple(blocks)  # a snapshot: the list may change after the call
        for v in t:
            if type(v) is not int:
                return None, blocks
        return ("ints", t), t
    return None, blocks


_ndarray = np.ndarray


def _index_key(index: Any) -> Any:
    """A plan-cache key for a CacheIndex (None: not cacheable): exact ints only."""
    if type(index) is not CacheIndex:
        return None
    c, k = index.cluster_id, index.cache_id
    if type(c) is not int or type(k) is not int or index.batch_index != 0:
        return None
    return (c, k)


def _ext_key(ext: Any) -> Any:
    """A plan-cache key for ``ext_param`` (None: not cacheable): exact ints only, so
    that values the check refuses (True for 1) never match an accepted one."""
    if ext is None:
        return ()
    if type(ext) is not KvCacheExtParam:
        return None
    s, d, t = ext.src_layer_range, ext.dst_layer_range, ext.tensor_num_per_layer
    if type(t) is not int or type(s) is not tuple or type(d) is not tuple:
        return None
    if len(s) != 2 or len(d) != 2 or any(type(v) is not int for v in s + d):
        return None
    return (s, d, t)


class PlanMixin(NodeState):
    """Finding, checking and keeping the plan of a request."""

    _ext_memo: tuple[Any, Any]
    _index_memo: tuple[Any, Any]

    def _plan(
        self,
        op: str,
        key: tuple | None,
        local: Cache,
        peer: Peer,
        remote: CacheInfo,
        src_blocks: Any,
        dst_blocks: Any,
        ext_param: Any,
    ) -> tuple[TransferPlan, Kept | None]:
        """The checked plan (docs/SPEC.md D4) of a push or pull, and, for a request with a
        ``key``, the :class:`Kept` under which it is posted again for equal requests
        (decision 12): every new request is checked, and a refused one is never kept
        (BENCHMARKS.md, "Small pushes")."""
        src, dst = (
            (local.cache_desc, remote.desc) if op == "push" else (remote.desc, local.cache_desc)
        )
        plan = check_transfer(src, dst, src_blocks, dst_blocks, ext_param, op=op, role=self.role)
        if key is None:
            return plan, None
        kept = Kept(local, peer, remote, plan, dst_key(op, self.cluster_id, local, peer, remote))
        with self._lock:
            gone = [self._plans.pop(key)] if key in self._plans else []
            self._plans[key] = kept
            while len(self._plans) > _PLAN_CACHE_SIZE:
                gone.append(self._plans.pop(next(iter(self._plans))))
        for old in gone:
            old.close()
        return plan, kept

    def _kept(
        self,
        op: str,
        cache: Any,
        index: Any,
        src_blocks: Any,
        dst_blocks: Any,
        ext_param: Any,
    ) -> tuple[tuple | None, Any, Any, Kept | None]:
        """``(key, src_blocks, dst_blocks, kept)``: the kept-plan key of a request (None:
        not kept), the block ids to check instead of the arguments (what the key was
        taken from), and the plan kept for the key if everything it was checked against
        is still this node's (else None).

        A key fixes everything the D4 check sees: the local cache object (checked by
        identity on use), the remote cache's ids, the block ids (an array's dtype and
        bytes, 1-D and at most _PLAN_CACHE_BLOCKS; a list's exact ints, :func:`_ids_key`)
        and exact-int ext params and cache ids (the last ext_param's and CacheIndex's
        keys memoized per object: frozen; docs/DATADIST.md decision 12). One function,
        arrays keyed inline: this is the small-push path (docs/DATADIST.md,
        "Performance")."""
        if type(src_blocks) is _ndarray:
            ok = src_blocks.ndim == 1 and src_blocks.size <= _PLAN_CACHE_BLOCKS
            skey = (src_blocks.dtype, src_blocks.tobytes()) if ok else None
        else:
            skey, src_blocks = _ids_key(src_blocks)
        if type(dst_blocks) is _ndarray:
            ok = dst_blocks.ndim == 1 and dst_blocks.size <= _PLAN_CACHE_BLOCKS
            dkey = (dst_blocks.dtype, dst_blocks.tobytes()) if ok else None
        else:
            dkey, dst_blocks = _ids_key(dst_blocks)
        memo = self._ext_memo  # frozen and checked to hold exact ints: its key is fixed
        if ext_param is not memo[0]:
            memo = self._ext_memo = (ext_param, _ext_key(ext_param))
        imemo = self._index_memo  # the same for the destination/source index
        if index is not imemo[0]:
            imemo = self._index_memo = (index, _index_key(index))
        if (
            skey is None
            or dkey is None
            or memo[1] is None
            or imemo[1] is None
            or type(cache) is not Cache
        ):
            return None, src_blocks, dst_blocks, None
        key = (op, cache.cache_id, imemo[1], skey, dkey, memo[1])
        kept = self._plans.get(key)
        if kept is not None:
            # Used if everything it was checked against is still this node's: the local
            # cache registered (cache ids are never reused: the registered cache of the
            # key's id is kept.local), the peer linked (not broken, its metadata loaded,
            # the same link epoch) and the remote cache's CacheInfo the one the peer's
            # table holds (a relinked peer or a reused cache id has a new one). In-band
            # deallocate and unlink notices are read first unless they were read less
            # than _DRAIN_EVERY_S ago (decision 12, "Failure semantics"). Inline: this
            # is the small-push path (docs/DATADIST.md, "Performance").
            if time.monotonic() - self._drained_at >= _DRAIN_EVERY_S:
                self._drain()
            peer = kept.peer
            if not (
                self._caches.get(cache.cache_id) is cache
                and self._peers.get(peer.cluster_id) is peer
                and not peer.broken
                and peer.pending is None
                and peer.epoch is kept.epoch
                and peer.caches.get(kept.remote.cache_id) is kept.remote
            ):
                kept = None
        return key, src_blocks, dst_blocks, kept

    def _resolve(
        self,
        op: str,
        local_arg: str,
        cache: Any,
        remote_arg: str,
        index: Any,
        src_blocks: Any,
        dst_blocks: Any,
        ext_param: Any,
    ) -> tuple[Cache, Peer, CacheInfo, TransferPlan, Kept | None]:
        """``(local, peer, remote, plan, kept)`` of a push or pull: from the kept plan of
        a repeated request (checked before, nothing of it changed), else looked up and
        checked in decision 5's order (the plan kept if the request has a key)."""
        key, src_blocks, dst_blocks, kept = self._kept(
            op, cache, index, src_blocks, dst_blocks, ext_param
        )
        if kept is not None:
            return kept.local, kept.peer, kept.remote, kept.plan, kept
        local = self._local_cache(local_arg, cache)
        peer, remote = self._remote_cache(remote_arg, index)
        plan, kept = self._plan(op, key, local, peer, remote, src_blocks, dst_blocks, ext_param)
        return local, peer, remote, plan, kept

    def _drop_plans(self, match: Any) -> None:
        """Stop keeping the plans ``match(kept)`` selects (their cache or peer went)."""
        with self._lock:
            gone = [self._plans.pop(k) for k, v in list(self._plans.items()) if match(v)]
            self._fast[-1].clear()  # the C path's memo (plugins/python/smallpush.c)
        for k in gone:
            k.close()
