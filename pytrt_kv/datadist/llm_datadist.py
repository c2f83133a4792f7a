"""``LlmDataDist``: one node (a prefill or a decode process) of a block-push deployment.

The facade owns the contract (docs/SPEC.md D1-D8); a transport (:mod:`.transport`) only
moves checked plans. The node is made of parts, one module each:

- :mod:`.caches`: ``allocate_cache`` / ``register_cache`` / ``deallocate_cache`` and the
  quarantine of memory a peer may still write (D8).
- :mod:`.links`: the authenticated control plane (D7), ``link_clusters`` /
  ``unlink_clusters``, fences (D8), peers' health.
- :mod:`.plans`: kept plans of repeated small requests (decisions 12, 13).
- :mod:`.transfers`: posting a checked plan, what a failed post or transfer is.
- :mod:`.notices`: in-band notices bound to their link, ``received`` / ``wait_received``.
- here: the life cycle, the public push and pull calls (checked by
  :func:`pytrt_kv.datadist.contract.check_transfer`, D4, before anything moves) and the
  small-push path of ``push_kv_blocks`` (docs/DATADIST.md decision 14).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from ..contract.errors import describe
from . import control
from .backends import make_transport
from .caches import CacheMixin
from .handles import POLL_INTERVAL_S, POLL_SPIN_S, TransferHandle, _poll_sleep  # noqa: F401
from .inflight import _BUSY, _ID, Writes
from .links import LinkMixin
from .node_base import (
    DEFAULT_OPTIONS,
    NOTIF,
    PROBE_EVERY_S,
    SECRET_ENV,
    Kept,
    Peer,
    checked_options,
    loopback,
    secret_of,
)
from .notices import NoticeMixin
from .smallpush import load as _load_smallpush
from .transfers import TransferMixin
from .transport import READ, WRITE, Transport
from .types import (
    Cache,
    CacheIndex,
    KvCacheExtParam,
    LLMException,
    LLMRole,
    LLMStatus,
    param_invalid,
)

#: Reached through this module by the tests (the polling constants above too).
_NOTIF, _PROBE_EVERY_S = NOTIF, PROBE_EVERY_S


#: The small-push path in C, or None (docs/DATADIST.md decision 15).
_smallpush = _load_smallpush()


class LlmDataDist(CacheMixin, LinkMixin, TransferMixin, NoticeMixin):
    """A node that pushes or pulls KV-cache blocks (docs/SPEC.md D; LLM-DataDist's API).

    Parameters
    ----------
    cluster_id : int
        This node's id; peers name its caches ``CacheIndex(cluster_id, cache_id)``.
    role : LLMRole or {"prompt", "decoder"}
        A prompt (prefill) node pushes, a decoder node pulls (D4).
    backend : {"nixl", "local"}
        ``"nixl"``: NIXL (UCX), across processes and machines. ``"local"``: nodes of one
        process, copies with memmove (tests, and the oracle of the NIXL backend).
    options : dict, optional
        See :data:`DEFAULT_OPTIONS`.

    Examples
    --------
    >>> from pytrt_kv.datadist import CacheDesc, CacheIndex, LlmDataDist
    >>> p = LlmDataDist(1, "prompt", backend="local"); p.initialize()
    >>> d = LlmDataDist(2, "decoder", backend="local"); d.initialize()
    >>> src = p.allocate_cache(CacheDesc(2, (8, 16), "float16"))
    >>> dst = d.allocate_cache(CacheDesc(2, (8, 16), "float16"))
    >>> src.tensors[0][:] = 1.5
    >>> [r.cluster_id for r in p.link_clusters([d.listen_address]) if r.ok]
    [2]
    >>> tag = p.push_kv_blocks(src, CacheIndex(2, dst.cache_id), [0, 1], [5, 6])
    >>> d.received(tag), float(dst.tensors[0][6, 0])
    (True, 1.5)
    >>> p.finalize(); d.finalize()
    """

    def __init__(
        self,
        cluster_id: int,
        role: Any,
        *,
        backend: str = "nixl",
        options: dict[str, Any] | None = None,
    ):
        if isinstance(cluster_id, bool) or not isinstance(cluster_id, int) or cluster_id < 0:
            raise TypeError(f"cluster_id: expected an int >= 0, got {cluster_id!r}")
        if backend not in ("nixl", "local"):
            raise ValueError(f"backend: expected 'nixl' or 'local', got {backend!r}")
        opts = checked_options(options)
        self.cluster_id = cluster_id
        self.role = LLMRole.of(role)
        self.backend = backend
        self.options = opts
        self._lock = threading.RLock()
        self._transport: Transport | None = None
        self._server: control.ControlServer | None = None
        self._auth: control.Auth | None = None
        self._by_agent: dict[str, Peer] = {}
        self._fences = {}
        self._last_generation = 0
        self._caches: dict[int, Cache] = {}
        self._peers: dict[int, Peer] = {}
        self._ids = itertools.count(1)
        self._generations = itertools.count(1)
        self._tags = itertools.count(1)
        self._received: set = set()
        self._stale: set = set()
        #: Deallocated caches some linked peers have not acknowledged: cache id ->
        #: (cache, the clusters still to acknowledge). Their memory stays registered and
        #: owned (docs/DATADIST.md, "Failure semantics").
        self._quarantine: dict[int, tuple[Cache, set[int]]] = {}
        self._failed: dict[str, str] = {}  # tag -> the source's status name
        #: Plans of accepted small requests (see _plan, _resolve).
        self._plans: dict[tuple, Kept] = {}
        self._tag_prefix = ""  # "cluster:pid:", set by initialize
        self._drained_at = 0.0  # when _drain last read the notifications (see _resolve)
        self._ext_memo: tuple[Any, Any] = (None, ())  # (last ext_param, its _ext_key)
        self._index_memo: tuple[Any, Any] = (None, None)  # (last CacheIndex, _index_key)
        self._writes = Writes()  # transfers in flight, by destination (docs/SPEC.md D8)
        #: What the C small-push path (plugins/python/smallpush.c) reads of this node: objects fixed
        #: for its life, one attribute instead of one each.
        #: (The last member: the C path's memo of the last request whose plan it found,
        #: emptied by _drop_plans, so that it keeps no dropped cache alive.)
        self._fast = (
            self._plans, self._caches, self._peers, self._writes._by_dst, self._writes._ids,
            self._tags, [],
        )  # fmt: skip
        self.listen_address: tuple[str, int] | None = None

    # --- life cycle -----------------------------------------------------------------------

    def initialize(self, listen_ip: str = "127.0.0.1", listen_port: int = 0) -> None:
        """Create the transport and start listening for links on ``listen_ip:listen_port``
        (0: a free port; :attr:`listen_address` says which).

        Peers must prove they hold the cluster's secret (``llm_datadist.auth_secret``,
        else the environment variable ``PYTRT_KV_DATADIST_SECRET``; docs/SPEC.md D7).

        Raises
        ------
        LLMException
            FAILED: already initialized, the address cannot be listened on, or no secret
            is set and ``listen_ip`` is not a loopback address (unless
            ``llm_datadist.allow_unauthenticated`` is True).
        """
        if self._transport is not None:
            raise LLMException(LLMStatus.FAILED, "initialize: already initialized")
        secret = secret_of(self.options)
        if not secret and not loopback(str(listen_ip)):
            if self.options["llm_datadist.allow_unauthenticated"] is not True:
                raise LLMException(
                    LLMStatus.FAILED,
                    f"initialize: listen_ip: expected a loopback address when no secret is "
                    f"set, got {listen_ip!r}: anyone who reaches the port could read and "
                    f"write every registered cache; set options['llm_datadist.auth_secret'] "
                    f"or {SECRET_ENV} (docs/DATADIST.md, 'Security'), or opt out with "
                    f"options['llm_datadist.allow_unauthenticated'] = True",
                )
        self._auth = control.Auth(self.cluster_id, secret)
        name = f"pytrt_kv-{self.cluster_id}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        transport = make_transport(self.backend, name, self.options, str(listen_ip))
        try:
            self._server = control.ControlServer(
                listen_ip, int(listen_port), self._handle, self._auth, self._control_timeout()
            )
        except OSError as exc:
            transport.close()
            raise LLMException(
                LLMStatus.FAILED, f"initialize: cannot listen on {listen_ip}:{listen_port}: {exc}"
            ) from exc
        self._transport = transport
        self._tag_prefix = f"{self.cluster_id}:{os.getpid()}:"
        self.listen_address = self._server.address

    def finalize(self) -> None:
        """Unlink every peer, deregister every cache and stop listening (idempotent); memory
        a fenced peer may still write (D8) is never freed (``caches.RETAINED``)."""
        if self._transport is None:
            return
        with self._lock:
            peers = list(self._peers)
        for cid in peers:
            try:
                self.unlink_clusters([cid])
            except LLMException:
                pass
        self._review_fences(force=True)  # fenced peers that answer now, or are gone
        for cache in list(self._caches.values()):
            self.deallocate_cache(cache)
        with self._lock:
            left, self._quarantine, self._fences = [c for c, _ in self._quarantine.values()], {}, {}
        for cache in left:  # only fenced peers may still write: never freed (D8)
            self._release_memory(cache, retain=True)
        if self._server is not None:
            self._server.close()
            self._server = None
        self._transport.close()
        self._transport = None

    def __enter__(self) -> LlmDataDist:
        return self

    def __exit__(self, *exc) -> None:
        self.finalize()

    # --- transfers ------------------------------------------------------------------------

    def _local_cache(self, arg: str, cache: Any) -> Cache:
        if not isinstance(cache, Cache):
            raise param_invalid(arg, "a Cache from allocate_cache/register_cache", describe(cache))
        with self._lock:
            if self._caches.get(cache.cache_id) is not cache:
                raise LLMException(
                    LLMStatus.KV_CACHE_NOT_EXIST,
                    f"{arg}: cache {cache.cache_id} is not registered in cluster "
                    f"{self.cluster_id} (deallocated?)",
                )
        return cache

    def push_kv_blocks_async(
        self,
        src_cache: Cache,
        dst_cache_index: CacheIndex,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        ext_param: KvCacheExtParam | None = None,
        *,
        timeout_s: float | None = None,
        tag: str | None = None,
        stream: Any = None,
    ) -> TransferHandle:
        """:meth:`push_kv_blocks` without waiting: returns a :class:`TransferHandle`."""
        return self._push(
            src_cache, dst_cache_index, src_blocks, dst_blocks, ext_param, timeout_s, tag, stream
        )

    def _push(
        self,
        src_cache: Any,
        dst_cache_index: Any,
        src_blocks: Any,
        dst_blocks: Any,
        ext_param: Any,
        timeout_s: float | None,
        tag: str | None,
        stream: Any,
    ) -> TransferHandle:
        # push_kv_blocks calls this directly, positional: keyword forwarding through
        # push_kv_blocks_async cost ~0.5 us of a ~40 us small push (decision 13); the
        # checks below are inline for the same reason (docs/DATADIST.md, "Performance").
        if self._transport is None:
            self._require()  # raises
        if self.role is not LLMRole.PROMPT:
            raise param_invalid("role", "push only from a prompt node", "a decoder node")
        local, peer, remote, plan, kept = self._resolve(
            "push", "src_cache", src_cache, "dst_cache_index", dst_cache_index,
            src_blocks, dst_blocks, ext_param,
        )  # fmt: skip
        tag = f"{self._tag_prefix}{next(self._tags)}" if tag is None else self._tag(tag)
        return self._start(
            WRITE, "src_cache", local, peer, remote, plan, tag, stream, timeout_s, kept=kept
        )

    def push_kv_blocks(
        self,
        src_cache: Cache,
        dst_cache_index: CacheIndex,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        ext_param: KvCacheExtParam | None = None,
        *,
        timeout_s: float | None = None,
        tag: str | None = None,
        stream: Any = None,
    ) -> str:
        """Push blocks of a local cache into a linked decoder's cache (docs/SPEC.md D3).

        For each i and each tensor offset u of the layer ranges,
        ``dst[dst_first*tnpl + u][dst_blocks[i]] = src[src_first*tnpl + u][src_blocks[i]]``.

        Parameters
        ----------
        src_cache : Cache
            This node's cache.
        dst_cache_index : CacheIndex
            ``(cluster_id, cache_id)`` of the destination (a linked peer's cache).
        src_blocks, dst_blocks : sequence of int, length N
            Block ids; destinations distinct, sources may repeat. Empty lists deliver
            only the tag.
        ext_param : KvCacheExtParam, optional
            Layer ranges and ``tensor_num_per_layer`` (default 2).
        timeout_s : float, optional
            Default ``options["timeout_s"]``.
        tag : str, optional
            What the destination's :meth:`received` reports once the blocks are in place;
            default a unique ``"cluster:pid:n"``.
        stream : optional
            For a device source: the stream that wrote it, synchronized before the post
            (docs/SPEC.md D6).

        Returns
        -------
        str
            The tag.

        Raises
        ------
        LLMException
            PARAM_INVALID (nothing transferred; also a ValueError), NOT_YET_LINK,
            KV_CACHE_NOT_EXIST, TIMEOUT, FAILED (docs/SPEC.md D4, D5); REPEAT_REQUEST
            (nothing transferred): a transfer of this node still writes some of these
            destination blocks (D8).
        """
        kept = None
        if stream is None:
            if _smallpush is not None:
                # The small-push path in C (docs/DATADIST.md decision 15): the tag once
                # complete, None when the request is not a kept small push (nothing done).
                done = _smallpush.push(
                    self, src_cache, dst_cache_index, src_blocks, dst_blocks, ext_param,
                    timeout_s, tag,
                )  # fmt: skip
                if done is not None:
                    return done
            kept = self._kept(
                "push", src_cache, dst_cache_index, src_blocks, dst_blocks, ext_param
            )[3]
        if kept is not None and kept.small and self._transport is not None:
            # The small-push path (docs/DATADIST.md decision 14), and the reference of the
            # C one: a kept plan of host memory (kept only on a prompt node) posted and
            # checked for the first POLL_SPIN_S here, with the tag, timeout, claim, errors
            # and release of _start and the handle's wait; a handle only for a transfer
            # that outlasts the spin or fails. Inline: between back-to-back small pushes
            # each us of Python before the post cost ~3 us of NIXL's ("Performance").
            tag = f"{self._tag_prefix}{next(self._tags)}" if tag is None else self._tag(tag)
            plan = kept.plan
            if (type(timeout_s) is float or type(timeout_s) is int) and timeout_s > 0:
                timeout = timeout_s  # a number > 0 (NaN is not): as _timeout, inline
            else:
                timeout = self._timeout(plan.nbytes, timeout_s)  # None, or PARAM_INVALID
            claim = self._writes.claim(kept.dst_key, plan, kept.span)  # REPEAT_REQUEST (D8)
            try:
                prepared = kept.prepared
                if prepared is None or not prepared.alive:
                    prepared = self._prepare(kept, WRITE)
                spin = POLL_SPIN_S if timeout > POLL_SPIN_S else timeout
                xfer = prepared.push(kept.notif + tag.encode(), spin)
            except BaseException as exc:
                self._post_failed(exc, claim, "src_cache", kept.local, kept.peer)
            if xfer is None:  # complete within the spin
                claim[_BUSY].pop(claim[_ID], None)  # Writes.release, inline (per push)
                return tag
            return self._small_wait(xfer, tag, kept, timeout, claim, spin)
        h = self._push(
            src_cache, dst_cache_index, src_blocks, dst_blocks, ext_param, timeout_s, tag, stream
        )
        h.wait()
        return h.tag

    def _small_wait(
        self, xfer: Any, tag: str, kept: Any, timeout: float, claim: Any, spin: float
    ) -> str:
        """The rest of a small push that outlasted its spin of ``spin`` s or failed: its
        handle, waiting what is left of ``timeout`` (raises its error)."""
        handle = TransferHandle(
            self, xfer, tag, kept.peer, timeout, ("src_cache", kept.local), claim
        )
        handle._wait(timeout, 0.0, time.monotonic() - spin)  # the rest of the wait
        return tag

    def pull_kv_blocks_async(
        self,
        src_cache_index: CacheIndex,
        dst_cache: Cache,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        ext_param: KvCacheExtParam | None = None,
        *,
        timeout_s: float | None = None,
        tag: str | None = None,
        stream: Any = None,
    ) -> TransferHandle:
        """:meth:`pull_kv_blocks` without waiting: returns a :class:`TransferHandle`."""
        self._require()
        if self.role is not LLMRole.DECODER:
            raise param_invalid("role", "pull only from a decoder node", "a prompt node")
        local, peer, remote, plan, kept = self._resolve(
            "pull", "dst_cache", dst_cache, "src_cache_index", src_cache_index,
            src_blocks, dst_blocks, ext_param,
        )  # fmt: skip
        tag = self._tag(tag)
        return self._start(
            READ, "dst_cache", local, peer, remote, plan, tag, stream, timeout_s, kept=kept
        )

    def pull_kv_blocks(
        self,
        src_cache_index: CacheIndex,
        dst_cache: Cache,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        ext_param: KvCacheExtParam | None = None,
        *,
        timeout_s: float | None = None,
        tag: str | None = None,
        stream: Any = None,
    ) -> str:
        """Pull blocks of a linked prompt node's cache into a local cache: the mirror of
        :meth:`push_kv_blocks` (same rules; only a decoder node pulls). When it returns,
        the local blocks are in place; the source node sees the tag with
        :meth:`received` once its blocks have been read (it may then reuse them).
        ``stream`` is accepted for symmetry; a device destination is written by NIXL, not
        by a stream."""
        h = self.pull_kv_blocks_async(
            src_cache_index,
            dst_cache,
            src_blocks,
            dst_blocks,
            ext_param,
            timeout_s=timeout_s,
            tag=tag,
            stream=stream,
        )
        h.wait()
        return h.tag


__all__ = ["LlmDataDist", "TransferHandle", "DEFAULT_OPTIONS"]
