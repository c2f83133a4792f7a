"""``LlmDataDist``: one node (a prefill or a decode process) of a block-push deployment.

The facade owns the contract (docs/SPEC.md D1-D8); a transport (:mod:`.transport`) only
moves checked plans. The node is made of parts, one module each:

- :mod:`.caches`: ``allocate_cache`` / ``register_cache`` / ``deallocate_cache`` and the
  quarantine of memory a peer may still write (D8).
- :mod:`.links`: the authenticated control plane (D7), ``link_clusters`` /
  ``unlink_clusters``, fences (D8), peers' health.
- :mod:`.plans`: kept plans of repeated small requests (decisions 12, 13).
- :mod:`.notices`: in-band notices bound to their link, ``received`` / ``wait_received``.
- here: the life cycle and the transfers (checked by
  :func:`pytrt_kv.datadist.contract.check_transfer`, D4, before anything moves).
"""

from __future__ import annotations

import itertools
import os
import threading
import uuid
from collections.abc import Sequence
from typing import Any

from ..contract.errors import describe
from . import control, memory
from .backends import make_transport
from .caches import CacheMixin
from .handles import POLL_INTERVAL_S, POLL_SPIN_S, TransferHandle, _poll_sleep  # noqa: F401
from .inflight import Writes, span
from .links import LinkMixin
from .node_base import (
    DEFAULT_OPTIONS,
    NOTIF,
    PROBE_EVERY_S,
    SECRET_ENV,
    Kept,
    Peer,
    checked_options,
    dst_key,
    loopback,
    secret_of,
)
from .notices import NoticeMixin
from .plans import PlanMixin
from .transport import READ, WRITE, CacheInfo, Prepared, Transport
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


class LlmDataDist(CacheMixin, LinkMixin, PlanMixin, NoticeMixin):
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
        self._writes = Writes()  # transfers in flight, by destination (docs/SPEC.md D8)
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

    def _tag(self, tag: Any) -> str:
        if tag is None:
            return f"{self._tag_prefix}{next(self._tags)}"
        if not isinstance(tag, str) or not tag:
            raise param_invalid("tag", "a non-empty str", repr(tag))
        return tag

    def _start(
        self,
        op: str,
        arg: str,
        local: Cache,
        peer: Peer,
        remote: CacheInfo,
        plan,
        tag: str,
        stream: Any,
        timeout_s: float | None,
        *,
        notify: bool = True,
        source_ready: bool = False,
        kept: Kept | None = None,
    ) -> TransferHandle:
        """Post a checked plan. ``notify=False``: no tag at the destination (a layer of a
        layer-wise push, whose tag follows its last layer); ``source_ready``: the caller
        already waited for the source's writes (a layer's event), no stream sync;
        ``kept``: ``plan``'s kept entry, posted through its transport's
        :class:`Prepared` (decision 13)."""
        timeout = float(timeout_s) if timeout_s is not None else self._timeout(plan.nbytes, None)
        if op == WRITE and local.cache_desc.placement == "device" and not source_ready:
            memory.synchronize_stream(stream, local.tensors, local.cache_desc.device)
        # Refused before anything is posted when a transfer of this node still writes
        # these blocks (docs/SPEC.md D8); released by the handle when the transfer ends.
        if kept is not None:
            notif = kept.notif + tag.encode()
            claim = self._writes.claim(kept.dst_key, plan, kept.span) if kept.copies else None
        else:
            text = f"{NOTIF}|{peer.epoch}|{remote.cache_id}|{remote.generation}|{tag}"
            notif = text.encode() if notify else b""
            key = dst_key(op, self.cluster_id, local, peer, remote)
            claim = self._writes.claim(key, plan, span(plan)) if plan.num_copies else None
        try:
            if claim is None:
                self._require().notify(peer.agent, notif)
                xfer = None
            elif kept is not None:
                prepared = kept.prepared
                if prepared is None or not prepared.alive:
                    prepared = self._prepare(kept, op)
                xfer = prepared.post(notif)
            else:
                xfer = self._require().post(
                    op, plan, local._info, local._backend_state, remote, peer.agent, notif
                )
        except BaseException as exc:
            if claim is not None:
                self._writes.release(claim)
            if not isinstance(exc, LLMException):
                raise
            err = self._transfer_error(exc, arg, local, peer)
            if err is exc:
                err = self._backend_failure(exc, peer)
            if err is exc:
                raise
            raise err from exc
        return TransferHandle(self, xfer, tag, peer, timeout, (arg, local), claim)

    def _prepare(self, kept: Kept, op: str) -> Prepared:
        """The kept plan's transport :class:`Prepared`, made once (one per plan, also
        when threads post it at once). A plan dropped meanwhile (:meth:`Kept.close`)
        gets one that keeps nothing: its post is released when complete."""
        with self._lock:
            prepared = kept.prepared
            if prepared is None or not prepared.alive:
                local = kept.local
                prepared = kept.prepared = self._require().prepare(
                    op, kept.plan, local._info, local._backend_state, kept.remote, kept.peer.agent
                )
        if kept.closed:
            prepared.close()
        return prepared

    def _transfer_error(
        self, exc: LLMException, arg: str, local: Cache, peer: Peer
    ) -> LLMException:
        """What a failed transfer is: memory of ``local`` that the caller freed while it
        was registered is KV_CACHE_NOT_EXIST, and the link is loaded again (NIXL marks the
        connection failed after any error); anything else stays as the transport said
        (issue 19 item 6; docs/DATADIST.md, "Failure semantics")."""
        if exc.status not in (LLMStatus.NOT_YET_LINK, LLMStatus.FAILED):
            return exc
        d = local.cache_desc
        gone = memory.unmapped(local.tensor_addrs, d.tensor_bytes, d.placement)
        if gone is None:
            return exc
        try:
            self._reconnect(peer)
        except (OSError, LLMException):
            pass  # the peer does not answer either: the link stays as the error left it
        return LLMException(
            LLMStatus.KV_CACHE_NOT_EXIST,
            f"{arg}: the memory of tensors[{gone}] of cache {local.cache_id} is no longer "
            f"mapped (freed by the caller while registered; docs/DATADIST.md, 'Failure "
            f"semantics'); the link to cluster {peer.cluster_id} is kept ({exc.message})",
        )

    def _timeout(self, nbytes: int, timeout_s: float | None) -> float:
        """The call's ``timeout_s``, else ``options["timeout_s"]``, else scaled with the
        bytes: ``timeout_min_s + nbytes / timeout_floor_bytes_per_s``."""
        if timeout_s is not None:
            return float(timeout_s)
        if self.options["timeout_s"] is not None:
            return float(self.options["timeout_s"])
        o = self.options
        return float(o["timeout_min_s"]) + nbytes / float(o["timeout_floor_bytes_per_s"])

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
        h = self._push(
            src_cache, dst_cache_index, src_blocks, dst_blocks, ext_param, timeout_s, tag, stream
        )
        h.wait()
        return h.tag

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
