"""``LlmDataDist``: one node (a prefill or a decode process) of a block-push deployment.

The facade owns the contract (docs/SPEC.md D1-D6); a transport (``"nixl"`` or
``"local"``, :mod:`pytrt_kv.datadist.transport`) only moves checked plans. What goes
where:

- caches: ``allocate_cache`` / ``register_cache`` give a :class:`Cache` with an id that
  is never reused and a generation; ``deallocate_cache`` tells every linked peer before
  the memory is deregistered, and keeps it (quarantine) while a peer has not
  acknowledged (docs/DATADIST.md, "Failure semantics").
- links: ``initialize`` starts the control server; ``link_clusters`` exchanges metadata
  with a peer (both sides then know each other: either may push or pull);
  ``unlink_clusters`` ends it on both sides.
- transfers: checked by :func:`pytrt_kv.datadist.contract.check_transfer` (D4) before
  anything moves; each carries a tag the destination sees with :meth:`received` once the
  blocks are in place (D6).
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..contract.errors import describe
from . import control, memory
from .backends import make_transport
from .contract import TransferPlan, check_transfer
from .transport import READ, WRITE, CacheInfo, Prepared, Transport, Xfer
from .types import (
    Cache,
    CacheDesc,
    CacheIndex,
    KvCacheExtParam,
    LinkResult,
    LLMException,
    LLMRole,
    LLMStatus,
    param_invalid,
)

#: Options and their defaults (``LlmDataDist(..., options={...})``).
DEFAULT_OPTIONS: dict[str, Any] = {
    # Default timeout of push/pull and wait(): None scales it with the bytes moved,
    # timeout_min_s + nbytes / timeout_floor_bytes_per_s (docs/DATADIST.md, "Failure semantics").
    "timeout_s": None,
    "timeout_min_s": 5.0,
    "timeout_floor_bytes_per_s": 64 << 20,  # 64 MiB/s: 2 GiB may take 37 s
    "wait_timeout_s": 60.0,  # default of wait_received (a failed push ends it earlier)
    "control_timeout_s": 2.0,  # each control-channel request (link, table, drop, bye)
    "local.latency_s": 0.0,  # "local" backend: simulated transfer latency
    "nixl.backends": ["UCX"],  # "nixl" backend: NIXL backends to create
    "nixl.num_threads": 0,
    # NIXL's progress thread: on, sleeping up to this long between idle checks (0: NIXL's
    # default, a busy loop that burns a core per node; docs/DATADIST.md "Idle CPU").
    "nixl.progress_thread": True,
    "nixl.progress_delay_us": 1000,
}
_NOTIF = "pytrt_kv.dd1"
#: In-band deallocate notice ``"|from|cache_id|generation"``, sent with the data path when
#: the control channel could not deliver it, and its acknowledgement (same fields).
_DROP = "pytrt_kv.dd1drop"
_DACK = "pytrt_kv.dd1dack"
#: A failure notice: ``_FAIL|status|tag`` (docs/DATADIST.md, "The receiver sees failures").
_FAIL = "pytrt_kv.dd1fail"
#: Failure notices kept for tags nobody waits on (a notice may outlive its tag's wait).
_MAX_FAILED = 4096
#: While a transfer is pending, check this often whether the peer is still there.
_PROBE_EVERY_S = 0.2
#: A repeated request (a kept plan) reads in-band notices only if none were read for this
#: long: reading them costs ~10% of a small push (docs/DATADIST.md decision 12).
_DRAIN_EVERY_S = 1e-3
#: Checked plans kept for repeated requests (:meth:`LlmDataDist._plan`), of at most
#: _PLAN_CACHE_BLOCKS blocks each: small pushes, whose D4 check costs as much as NIXL's
#: transfer (BENCHMARKS.md, "Small pushes").
_PLAN_CACHE_SIZE = 256
_PLAN_CACHE_BLOCKS = 256


def _ids_key(blocks: Any) -> tuple[Any, Any]:
    """``(key, ids)``: a plan-cache key that determines what :func:`check_transfer`
    sees of a block-id list (None: not cacheable) and what to pass it instead (the same
    list or array, so that the check sees the key's). An array's key is its dtype and
    bytes; a list's or tuple's, its values when every one is an exact int (a bool, a
    float or a NumPy scalar makes it uncacheable: the check decides on those)."""
    if type(blocks) is np.ndarray:
        if blocks.ndim != 1 or blocks.size > _PLAN_CACHE_BLOCKS:
            return None, blocks
        return (blocks.dtype, blocks.tobytes()), blocks
    if type(blocks) is list or type(blocks) is tuple:
        if len(blocks) > _PLAN_CACHE_BLOCKS:
            return None, blocks
        t = tuple(blocks)  # a snapshot: the list may change after the call
        for v in t:
            if type(v) is not int:
                return None, blocks
        return ("ints", t), t
    return None, blocks


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


@dataclass
class _Peer:
    cluster_id: int
    agent: str
    address: tuple[str, int]
    caches: dict[int, CacheInfo] = field(default_factory=dict)
    broken: bool = False
    #: Transport metadata not loaded yet (a link request is answered before it is).
    pending: str | None = None
    load_lock: threading.Lock = field(default_factory=threading.Lock)


class _Kept:
    """A checked plan kept for repeated requests (decision 12) with what its posts need,
    resolved once: the local cache, peer and remote :class:`CacheInfo` it was checked
    against (used only while they are still this node's, :meth:`LlmDataDist._kept`), the
    tag notification's prefix, and the transport's :class:`Prepared` (decision 13)."""

    __slots__ = ("local", "peer", "remote", "plan", "notif", "prepared", "closed")

    def __init__(self, local: Cache, peer: _Peer, remote: CacheInfo, plan: TransferPlan):
        self.local, self.peer, self.remote, self.plan = local, peer, remote, plan
        self.notif = f"{_NOTIF}|{remote.cache_id}|{remote.generation}|".encode()
        self.prepared: Prepared | None = None
        self.closed = False

    def close(self) -> None:
        """The node no longer keeps this plan: release what its transport kept."""
        self.closed = True
        if self.prepared is not None:
            self.prepared.close()


#: Pause between completion checks. Never spin for long: NIXL's progress threads need
#: the CPU (on a 2-core machine a spinning poll made a 4 KiB push take ~30 ms instead of
#: ~0.2 ms).
POLL_INTERVAL_S = 5e-5
#: ... except for the first POLL_SPIN_S of a wait: a small push completes within ~0.1 ms,
#: and the shortest sleep costs ~0.12 ms on Linux here (timer slack and wake-up), more
#: than the push. Checking a NIXL handle progresses its UCX worker from this thread.
POLL_SPIN_S = 2e-4


def _poll_sleep(start: float) -> None:
    if time.monotonic() - start >= POLL_SPIN_S:
        time.sleep(POLL_INTERVAL_S)


def _parse_address(arg: str, c: Any) -> tuple[str, int]:
    if isinstance(c, str) and ":" in c:
        host, _, port = c.rpartition(":")
        c = (host, port)
    try:
        host, port = c
        return str(host), int(port)
    except (TypeError, ValueError):
        raise TypeError(f"{arg}: expected an (ip, port) pair or 'ip:port', got {c!r}") from None


class TransferHandle:
    """An asynchronous push or pull (``push_kv_blocks_async``/``pull_kv_blocks_async``).

    ``done()`` polls; ``wait()`` blocks with a bound; ``cancel()`` aborts. The first two
    raise the transfer's :class:`LLMException`. The NIXL handle is released when the
    transfer completes, fails, times out or is cancelled; after a TIMEOUT the destination
    blocks are undefined (docs/SPEC.md D5).
    """

    def __init__(
        self,
        dd: LlmDataDist,
        xfer: Xfer | None,
        tag: str,
        peer: _Peer,
        timeout_s: float,
        local: tuple[str, Cache] | None = None,
    ):
        self._dd, self._xfer, self.tag, self._peer = dd, xfer, tag, peer
        #: The timeout ``wait()`` uses by default (the call's, or scaled with the bytes).
        self.timeout_s = timeout_s
        self._local = local  # (argument name, this node's cache) for failure reports
        self._error: LLMException | None = None
        self._done = xfer is None

    @property
    def released(self) -> bool:
        """True once the transport's handle is freed (always, after done/error/timeout)."""
        return self._xfer is None

    def _release(self) -> None:
        if self._xfer is not None:
            xfer, self._xfer = self._xfer, None
            xfer.release()

    def _fail(self, exc: LLMException) -> None:
        self._release()
        if exc.status == LLMStatus.NOT_YET_LINK:
            # NIXL's disconnect is a death only when the control plane is gone too.
            if self._dd._peer_alive(self._peer):
                exc = LLMException(
                    LLMStatus.FAILED,
                    f"{exc.message}; the peer's control channel still answers, so the link is kept",
                )
            else:
                self._peer.broken = True
        self._error = exc
        if exc.status != LLMStatus.NOT_YET_LINK:
            self._dd._send_failure(self._peer, exc.status, self.tag)
        raise exc

    def cancel(self) -> bool:
        """Abort the transfer: its handle is released (NIXL cancels what it can), the
        destination is sent a failure notice (its :meth:`LlmDataDist.wait_received`
        raises FAILED) and later ``done()``/``wait()`` raise FAILED. The destination blocks
        may hold partial data (docs/DATADIST.md, "Failure semantics").

        Returns
        -------
        bool
            False if the transfer had already completed or failed (nothing to cancel).
        """
        if self._done or self._error is not None:
            return False
        try:
            self._fail(LLMException(LLMStatus.FAILED, f"transfer {self.tag!r} cancelled"))
        except LLMException:
            pass
        return True

    def done(self) -> bool:
        """True when the transfer is complete (the initiator may reuse its blocks)."""
        if self._error is not None:
            raise self._error
        if self._done:
            return True
        xfer = self._xfer
        assert xfer is not None  # not done, so the transfer is still held
        try:
            state = xfer.state()
        except LLMException as exc:
            if self._local is not None:
                exc = self._dd._transfer_error(exc, *self._local, self._peer)
            self._fail(exc)
        if state == "DONE":
            self._done = True
            self._release()
        return self._done

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until complete, at most ``timeout_s`` (default: the call's timeout).

        Raises
        ------
        LLMException
            TIMEOUT (the handle is released), NOT_YET_LINK (the peer went away), FAILED.
        """
        if self.done():  # a small push is often complete at its first check
            return
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        start = time.monotonic()
        next_probe = start + _PROBE_EVERY_S
        while not self.done():
            now = time.monotonic()
            if now - start >= timeout:
                self._fail(
                    LLMException(
                        LLMStatus.TIMEOUT,
                        f"transfer {self.tag!r} not complete within {timeout} s; "
                        f"its handle was released and the destination blocks "
                        f"are undefined (docs/SPEC.md D5)",
                    )
                )
            if now >= next_probe:
                next_probe = now + _PROBE_EVERY_S
                if not self._dd._peer_alive(self._peer):
                    self._fail(
                        LLMException(
                            LLMStatus.NOT_YET_LINK,
                            f"cluster {self._peer.cluster_id} went away during "
                            f"transfer {self.tag!r}",
                        )
                    )
            _poll_sleep(start)


class LlmDataDist:
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
        opts = dict(DEFAULT_OPTIONS)
        unknown = sorted(set(options or {}) - set(DEFAULT_OPTIONS))
        if unknown:
            raise ValueError(
                f"options: unknown keys {unknown}; expected some of {sorted(DEFAULT_OPTIONS)}"
            )
        opts.update(options or {})
        for key, least in (("timeout_min_s", 0.0), ("timeout_floor_bytes_per_s", 1.0)):
            v = opts[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= least:
                raise ValueError(f"options[{key!r}]: expected a number >= {least}, got {v!r}")
        self.cluster_id = cluster_id
        self.role = LLMRole.of(role)
        self.backend = backend
        self.options = opts
        self._lock = threading.RLock()
        self._transport: Transport | None = None
        self._server: control.ControlServer | None = None
        self._caches: dict[int, Cache] = {}
        self._peers: dict[int, _Peer] = {}
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
        #: Plans of accepted small requests (see _plan, _kept).
        self._plans: dict[tuple, _Kept] = {}
        self._tag_prefix = ""  # "cluster:pid:", set by initialize
        self._drained_at = 0.0  # when _drain last read the notifications (see _kept)
        self._ext_memo: tuple[Any, Any] = (None, ())  # (last ext_param, its _ext_key)
        self.listen_address: tuple[str, int] | None = None

    # --- life cycle -----------------------------------------------------------------------

    def initialize(self, listen_ip: str = "127.0.0.1", listen_port: int = 0) -> None:
        """Create the transport and start listening for links on ``listen_ip:listen_port``
        (0: a free port; :attr:`listen_address` says which)."""
        if self._transport is not None:
            raise LLMException(LLMStatus.FAILED, "initialize: already initialized")
        name = f"pytrt_kv-{self.cluster_id}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        transport = make_transport(self.backend, name, self.options)
        try:
            self._server = control.ControlServer(
                listen_ip, int(listen_port), self._handle, float(self.options["control_timeout_s"])
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
        """Unlink every peer, deregister every cache and stop listening (idempotent)."""
        if self._transport is None:
            return
        with self._lock:
            peers = list(self._peers)
        for cid in peers:
            try:
                self.unlink_clusters([cid])
            except LLMException:
                pass
        for cache in list(self._caches.values()):
            self.deallocate_cache(cache)
        with self._lock:
            left, self._quarantine = [c for c, _ in self._quarantine.values()], {}
        for cache in left:  # every peer is unlinked now
            self._release_memory(cache)
        if self._server is not None:
            self._server.close()
            self._server = None
        self._transport.close()
        self._transport = None

    def __enter__(self) -> LlmDataDist:
        return self

    def __exit__(self, *exc) -> None:
        self.finalize()

    def _require(self) -> Transport:
        if self._transport is None:
            raise LLMException(LLMStatus.FAILED, "call initialize() first")
        return self._transport

    # --- caches ---------------------------------------------------------------------------

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
                            f"'Failure semantics'): retry once they have pushed or linked "
                            f"again, or unlink them"
                        )

    def _add_cache(
        self, desc: CacheDesc, tensors: list[Any], addrs: tuple[int, ...], owned: bool
    ) -> Cache:
        with self._lock:
            cache = Cache(next(self._ids), desc, addrs, tensors, next(self._generations), owned)
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
            # Its cached plans would keep the cache (and memory it allocated) alive.
            kept = [self._plans.pop(k) for k, v in list(self._plans.items()) if v.local is cache]
        for k in kept:
            k.close()
        msg = {
            "op": "drop",
            "from": self.cluster_id,
            "cache_id": cache.cache_id,
            "generation": cache.generation,
        }
        pending = set()
        for peer in peers:
            try:
                reply = control.request(peer.address, msg, float(self.options["control_timeout_s"]))
                if "error" not in reply:
                    continue
            except OSError:
                pass
            pending.add(peer.cluster_id)
            notice = f"{_DROP}|{self.cluster_id}|{cache.cache_id}|{cache.generation}"
            try:
                self._require().notify(peer.agent, notice.encode())
            except LLMException:
                pass  # the peer hears of it when it links again (or is unlinked)
        if pending:
            with self._lock:
                # A peer unlinked meanwhile cannot acknowledge: it no longer counts.
                pending &= set(self._peers)
                if pending:
                    self._quarantine[cache.cache_id] = (cache, pending)
                    return
        self._release_memory(cache)

    def _release_memory(self, cache: Cache) -> None:
        self._require().deregister(cache._backend_state)
        cache._backend_state = None
        if cache.owned:
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
        not acknowledged the deallocation (docs/DATADIST.md, "Failure semantics")."""
        if self._quarantine:
            self._drain()
        with self._lock:
            return sorted(self._quarantine)

    # --- metadata and links ---------------------------------------------------------------

    def _metadata(self) -> dict[str, Any]:
        transport = self._require()
        with self._lock:
            caches = [self._info(c).to_dict() for c in self._caches.values()]
        return {
            "version": 1,
            "cluster_id": self.cluster_id,
            "role": self.role.value,
            "backend": self.backend,
            "agent": transport.name,
            "address": list(self.listen_address or ()),  # initialized: an address
            "transport": transport.metadata(),
            "caches": caches,
        }

    def local_metadata(self) -> bytes:
        """This node as a peer sees it (JSON): cluster id, role, control address,
        transport metadata, and each cache's id, generation, layout and addresses."""
        return json.dumps(self._metadata()).encode()

    def _apply_metadata(self, md: dict[str, Any], defer: bool = False) -> _Peer:
        """Load a peer's metadata: (re)load its transport metadata and its cache table.
        ``defer``: leave the transport metadata pending (:meth:`_load` loads it)."""
        if md.get("version") != 1 or md.get("backend") != self.backend:
            raise LLMException(
                LLMStatus.FAILED,
                f"peer metadata: expected a version-1 {self.backend!r} node, "
                f"got version {md.get('version')} backend {md.get('backend')!r}",
            )
        cid = int(md["cluster_id"])
        if cid == self.cluster_id:
            raise LLMException(LLMStatus.FAILED, f"peer has this node's own cluster_id {cid}")
        if not defer:
            self._require().add_peer(md["agent"], md["transport"])
        caches = {int(c["cache_id"]): CacheInfo.from_dict(c) for c in md["caches"]}
        with self._lock:
            peer = self._peers.get(cid)
            if peer is None or peer.agent != md["agent"]:
                if peer is not None:  # the cluster restarted: a new agent
                    self._require().remove_peer(peer.agent)
                peer = _Peer(cid, md["agent"], tuple(md["address"]))
                self._peers[cid] = peer
            self._set_caches(peer, caches)
            peer.broken = False
            peer.pending = md["transport"] if defer else None
        return peer

    def _set_caches(self, peer: _Peer, caches: dict[int, CacheInfo]) -> None:
        for cid, old in list(peer.caches.items()):
            new = caches.get(cid)
            if new is None or new.generation != old.generation:
                self._require().forget_remote(peer.agent, old)
        peer.caches = caches

    def link_clusters(
        self, clusters: Iterable[Any], timeout_s: float | None = None
    ) -> list[LinkResult]:
        """Link to peers listening at ``clusters`` (``(ip, port)`` pairs or ``"ip:port"``).

        Both sides learn each other's caches and transport metadata. Each cluster is
        linked on its own: one that fails does not stop the others.

        Returns
        -------
        list of LinkResult
            One per cluster, in order (CANN's ``rets``): SUCCESS with the peer's cluster
            id, or FAILED with the reason (unreachable within ``timeout_s``, default
            ``control_timeout_s``; refused; the same cluster id; another backend).

        Raises
        ------
        TypeError
            A cluster that is not an address (checked before anything is linked).
        """
        self._require()
        timeout = float(self.options["control_timeout_s"] if timeout_s is None else timeout_s)
        addrs = [_parse_address(f"clusters[{i}]", c) for i, c in enumerate(list(clusters))]
        results = []
        for addr in addrs:
            try:
                reply = control.request(addr, {"op": "hello", "md": self._metadata()}, timeout)
                if "error" in reply:
                    raise LLMException(
                        LLMStatus.FAILED, f"link to {addr[0]}:{addr[1]} refused: {reply['error']}"
                    )
                peer = self._apply_metadata(reply["md"])
            except OSError as exc:
                results.append(
                    LinkResult(LLMStatus.FAILED, None, f"link to {addr[0]}:{addr[1]}: {exc}")
                )
                continue
            except LLMException as exc:
                results.append(LinkResult(exc.status, None, exc.message))
                continue
            # The peer applied this node's table before it answered: it knows every
            # deallocation (docs/DATADIST.md, "Failure semantics").
            self._acknowledged(peer.cluster_id)
            results.append(LinkResult(LLMStatus.SUCCESS, peer.cluster_id))
        return results

    def unlink_clusters(self, cluster_ids: Iterable[int], timeout_s: float | None = None) -> None:
        """End links on both sides (the peer is told, bounded by ``timeout_s``).

        Raises
        ------
        LLMException
            NOT_YET_LINK for a cluster id that is not linked.
        """
        self._require()
        timeout = float(self.options["control_timeout_s"] if timeout_s is None else timeout_s)
        for cid in list(cluster_ids):
            with self._lock:
                peer = self._peers.pop(cid, None)
            if peer is None:
                raise LLMException(LLMStatus.NOT_YET_LINK, f"cluster {cid} is not linked")
            self._require().remove_peer(peer.agent)
            self._acknowledged(cid)  # an unlinked peer is no longer told anything
            if not peer.broken:
                try:
                    control.request(
                        peer.address,
                        {"op": "bye", "from": self.cluster_id, "agent": self._require().name},
                        timeout,
                    )
                except OSError:
                    pass  # gone already: nothing to tell

    def linked_clusters(self) -> list[int]:
        """Cluster ids linked now (a broken link is listed until unlinked)."""
        with self._lock:
            return sorted(self._peers)

    def _handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Control requests from peers (server thread)."""
        op = msg.get("op")
        if op == "hello":
            # Answered without waiting for the NIXL agent, which a long post may hold
            # (issue 19 fault 3): the metadata is loaded on another thread.
            self._load_later(self._apply_metadata(msg["md"], defer=True))
            return {"md": self._metadata()}
        if op == "table":
            return {"md": self._metadata()}
        with self._lock:
            peer = self._peers.get(int(msg.get("from", -1)))
        if op == "drop":
            if peer is not None:
                self._forget_remote_cache(peer, int(msg["cache_id"]), int(msg["generation"]))
            return {}
        if op == "bye":
            if peer is not None and peer.agent == msg.get("agent"):
                with self._lock:
                    self._peers.pop(peer.cluster_id, None)
                self._require().remove_peer(peer.agent)
                self._acknowledged(peer.cluster_id)  # it forgot all of this node's caches
            return {}
        return {"error": f"unknown request {op!r}"}

    def _forget_remote_cache(self, peer: _Peer, cache_id: int, generation: int) -> None:
        with self._lock:
            old = peer.caches.get(cache_id)
            if old is not None and old.generation == generation:
                del peer.caches[old.cache_id]
                self._require().forget_remote(peer.agent, old)

    def _peer_alive(self, peer: _Peer) -> bool:
        """False when the peer's control port refuses connections (a dead process's port
        refuses at once). A connection that times out is not a death: a paused or busy
        process (SIGSTOP, a full accept backlog) still counts as alive."""
        try:
            with socket.create_connection(peer.address, timeout=_PROBE_EVERY_S):
                return True
        except (ConnectionRefusedError, ConnectionResetError):
            return False
        except OSError:
            return True

    def _send_failure(self, peer: _Peer, status: LLMStatus, tag: str) -> None:
        """Tell a transfer's other side that it failed (best effort: the notice is queued
        by NIXL; a peer that is gone gets nothing)."""
        try:
            self._require().notify(peer.agent, f"{_FAIL}|{status.name}|{tag}".encode())
        except LLMException:
            pass

    def _load(self, peer: _Peer) -> None:
        """Load the peer's transport metadata if a link request left it pending."""
        with peer.load_lock:
            with self._lock:
                if self._peers.get(peer.cluster_id) is not peer:
                    return  # unlinked or relinked meanwhile: nothing to load
            if peer.pending is not None:
                self._require().add_peer(peer.agent, peer.pending)
                peer.pending = None

    def _load_later(self, peer: _Peer) -> None:
        def load() -> None:
            try:
                self._load(peer)
            except LLMException:
                pass  # the next transfer to this peer tries again and reports it

        threading.Thread(target=load, name="pytrt_kv-datadist-link", daemon=True).start()

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

    def _remote_cache(self, arg: str, index: Any) -> tuple[_Peer, CacheInfo]:
        if not isinstance(index, CacheIndex):
            raise param_invalid(arg, "a CacheIndex(cluster_id, cache_id)", describe(index))
        if index.batch_index != 0:
            raise param_invalid(
                f"{arg}.batch_index", "0 (blocks are addressed by id)", index.batch_index
            )
        self._drain()  # deallocate notices that came with the data path (issue 19 item 1)
        with self._lock:
            peer = self._peers.get(index.cluster_id)
        if peer is None or peer.broken:
            raise LLMException(
                LLMStatus.NOT_YET_LINK,
                f"{arg}: cluster {index.cluster_id} is not linked"
                + (" (the link broke)" if peer is not None else ""),
            )
        info = peer.caches.get(index.cache_id)
        if info is None:  # created after the link? ask the peer once
            try:
                reply = control.request(
                    peer.address,
                    {"op": "table", "from": self.cluster_id},
                    float(self.options["control_timeout_s"]),
                )
            except TimeoutError as exc:  # paused or busy: not a death, the link stays
                raise LLMException(
                    LLMStatus.TIMEOUT,
                    f"{arg}: cluster {index.cluster_id} did not answer within "
                    f"{self.options['control_timeout_s']} s (control_timeout_s); the link "
                    f"is kept",
                ) from exc
            except OSError as exc:
                peer.broken = True
                raise LLMException(
                    LLMStatus.NOT_YET_LINK,
                    f"{arg}: cluster {index.cluster_id} does not answer: {exc}",
                ) from exc
            self._apply_metadata(reply["md"])
            info = peer.caches.get(index.cache_id)
        if info is None:
            raise LLMException(
                LLMStatus.KV_CACHE_NOT_EXIST,
                f"{arg}: cluster {index.cluster_id} has no cache {index.cache_id}",
            )
        if peer.pending is not None:  # the common case, linked and loaded, takes no lock
            self._load(peer)
        return peer, info

    def _request_key(
        self, op: str, cache: Any, index: Any, src_blocks: Any, dst_blocks: Any, ext_param: Any
    ) -> tuple[tuple | None, Any, Any]:
        """``(key, src_blocks, dst_blocks)``: the kept-plan key of a request (None: not
        kept) and the block ids to check instead of the arguments (the same arrays the key
        was taken from). A key fixes everything the D4 check sees: the local cache object
        (checked by identity on use), the remote cache's ids, the block ids' dtype and
        bytes, and exact-int ext params (docs/DATADIST.md decision 12)."""
        skey, src_blocks = _ids_key(src_blocks)
        dkey, dst_blocks = _ids_key(dst_blocks)
        memo = self._ext_memo  # frozen and checked to hold exact ints: its key is fixed
        if ext_param is not memo[0]:
            memo = self._ext_memo = (ext_param, _ext_key(ext_param))
        if (
            skey is None
            or dkey is None
            or memo[1] is None
            or type(cache) is not Cache
            or type(index) is not CacheIndex
            or type(index.cluster_id) is not int
            or type(index.cache_id) is not int
            or index.batch_index != 0
        ):
            return None, src_blocks, dst_blocks
        key = (op, cache.cache_id, index.cluster_id, index.cache_id, skey, dkey, memo[1])
        return key, src_blocks, dst_blocks

    def _kept(self, key: tuple, cache: Cache) -> _Kept | None:
        """The kept plan of ``key`` if everything it was checked against is still this
        node's: the local cache registered, the peer linked (not broken, its metadata
        loaded) and the remote cache's :class:`CacheInfo` the one the peer's table holds
        (a relinked peer or a reused cache id has a new one). In-band deallocate notices
        are read first unless they were read less than ``_DRAIN_EVERY_S`` ago (decision
        12, "Failure semantics")."""
        kept = self._plans.get(key)
        if kept is None:
            return None
        if time.monotonic() - self._drained_at >= _DRAIN_EVERY_S:
            self._drain()
        peer = kept.peer
        # Cache ids are never reused: the registered cache of the key's id is kept.local.
        if (
            self._caches.get(cache.cache_id) is cache
            and self._peers.get(peer.cluster_id) is peer
            and not peer.broken
            and peer.pending is None
            and peer.caches.get(kept.remote.cache_id) is kept.remote
        ):
            return kept
        return None

    def _plan(
        self,
        op: str,
        key: tuple | None,
        local: Cache,
        peer: _Peer,
        remote: CacheInfo,
        src_blocks: Any,
        dst_blocks: Any,
        ext_param: Any,
    ) -> tuple[TransferPlan, _Kept | None]:
        """The checked plan (docs/SPEC.md D4) of a push or pull, and, for a request with a
        ``key``, the :class:`_Kept` under which it is posted again for equal requests
        (decision 12): every new request is checked, and a refused one is never kept
        (BENCHMARKS.md, "Small pushes")."""
        src, dst = (
            (local.cache_desc, remote.desc) if op == "push" else (remote.desc, local.cache_desc)
        )
        plan = check_transfer(src, dst, src_blocks, dst_blocks, ext_param, op=op, role=self.role)
        if key is None:
            return plan, None
        kept = _Kept(local, peer, remote, plan)
        with self._lock:
            gone = [self._plans.pop(key)] if key in self._plans else []
            self._plans[key] = kept
            while len(self._plans) > _PLAN_CACHE_SIZE:
                gone.append(self._plans.pop(next(iter(self._plans))))
        for old in gone:
            old.close()
        return plan, kept

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
    ) -> tuple[Cache, _Peer, CacheInfo, TransferPlan, _Kept | None]:
        """``(local, peer, remote, plan, kept)`` of a push or pull: from the kept plan of
        a repeated request (checked before, nothing of it changed), else looked up and
        checked in decision 5's order (the plan kept if the request has a key)."""
        key, src_blocks, dst_blocks = self._request_key(
            op, cache, index, src_blocks, dst_blocks, ext_param
        )
        kept = None if key is None else self._kept(key, cache)
        if kept is not None:
            return kept.local, kept.peer, kept.remote, kept.plan, kept
        local = self._local_cache(local_arg, cache)
        peer, remote = self._remote_cache(remote_arg, index)
        plan, kept = self._plan(op, key, local, peer, remote, src_blocks, dst_blocks, ext_param)
        return local, peer, remote, plan, kept

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
        peer: _Peer,
        remote: CacheInfo,
        plan,
        tag: str,
        stream: Any,
        timeout_s: float | None,
        *,
        notify: bool = True,
        source_ready: bool = False,
        kept: _Kept | None = None,
    ) -> TransferHandle:
        """Post a checked plan. ``notify=False``: no tag at the destination (a layer of a
        layer-wise push, whose tag follows its last layer); ``source_ready``: the caller
        already waited for the source's writes (a layer's event), no stream sync;
        ``kept``: ``plan``'s kept entry, posted through its transport's
        :class:`Prepared` (decision 13)."""
        timeout = float(timeout_s) if timeout_s is not None else self._timeout(plan.nbytes, None)
        if op == WRITE and local.cache_desc.placement == "device" and not source_ready:
            memory.synchronize_stream(stream, local.tensors, local.cache_desc.device)
        if kept is not None:
            notif = kept.notif + tag.encode()
        elif notify:
            notif = f"{_NOTIF}|{remote.cache_id}|{remote.generation}|{tag}".encode()
        else:
            notif = b""
        try:
            if plan.num_copies == 0:
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
        except LLMException as exc:
            err = self._transfer_error(exc, arg, local, peer)
            if err.status == LLMStatus.NOT_YET_LINK:
                if self._peer_alive(peer):  # NIXL lost it, the control plane did not
                    raise LLMException(
                        LLMStatus.FAILED,
                        f"{exc.message}; the peer's control channel still answers, so "
                        f"the link is kept",
                    ) from exc
                peer.broken = True
            if err is exc:
                raise
            raise err from exc
        return TransferHandle(self, xfer, tag, peer, timeout, (arg, local))

    def _prepare(self, kept: _Kept, op: str) -> Prepared:
        """The kept plan's transport :class:`Prepared`, made once (one per plan, also
        when threads post it at once). A plan dropped meanwhile (:meth:`_Kept.close`)
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
        self, exc: LLMException, arg: str, local: Cache, peer: _Peer
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

    def _reconnect(self, peer: _Peer) -> None:
        """Load the peer's transport metadata again (a new NIXL connection)."""
        reply = control.request(
            peer.address,
            {"op": "table", "from": self.cluster_id},
            float(self.options["control_timeout_s"]),
        )
        if "md" not in reply:
            raise OSError(f"cluster {peer.cluster_id}: {reply.get('error')}")
        self._require().remove_peer(peer.agent)
        self._apply_metadata(reply["md"])

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
        # push_kv_blocks_async cost ~0.5 us of a ~40 us small push (decision 13).
        self._require()
        if self.role is not LLMRole.PROMPT:
            raise param_invalid("role", "push only from a prompt node", "a decoder node")
        local, peer, remote, plan, kept = self._resolve(
            "push", "src_cache", src_cache, "dst_cache_index", dst_cache_index,
            src_blocks, dst_blocks, ext_param,
        )  # fmt: skip
        return self._start(
            WRITE,
            "src_cache",
            local,
            peer,
            remote,
            plan,
            self._tag(tag),
            stream,
            timeout_s,
            kept=kept,
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
            KV_CACHE_NOT_EXIST, TIMEOUT, FAILED (docs/SPEC.md D4, D5).
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
        return self._start(
            READ,
            "dst_cache",
            local,
            peer,
            remote,
            plan,
            self._tag(tag),
            stream,
            timeout_s,
            kept=kept,
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

    # --- destination side -----------------------------------------------------------------

    def _drain(self) -> None:
        self._drained_at = time.monotonic()
        for agent, msg in self._require().poll():
            text = msg.decode(errors="replace")
            if text.startswith(_FAIL + "|"):
                status, sep, failed_tag = text[len(_FAIL) + 1 :].partition("|")
                if not sep:
                    continue
                with self._lock:
                    self._failed[failed_tag] = status
                    while len(self._failed) > _MAX_FAILED:
                        del self._failed[next(iter(self._failed))]
                continue
            parts = text.split("|", 3)
            if len(parts) == 4 and parts[0] in (_DROP, _DACK):
                self._notice(agent, parts[0], int(parts[1]), int(parts[2]), int(parts[3]))
                continue
            if len(parts) != 4 or parts[0] != _NOTIF:
                continue
            cache_id, gen, tag = int(parts[1]), int(parts[2]), parts[3]
            with self._lock:
                cache = self._caches.get(cache_id)
                live = cache is not None and cache.generation == gen
                (self._received if live else self._stale).add(tag)

    def _notice(self, agent: str, kind: str, cluster: int, cache_id: int, gen: int) -> None:
        """An in-band deallocate notice (forget the cache, acknowledge) or its
        acknowledgement (release the quarantined memory)."""
        if kind == _DACK:
            self._acknowledged(cluster, cache_id)
            return
        with self._lock:
            peer = self._peers.get(cluster)
        if peer is not None:
            self._forget_remote_cache(peer, cache_id, gen)
        try:
            self._require().notify(agent, f"{_DACK}|{self.cluster_id}|{cache_id}|{gen}".encode())
        except LLMException:
            pass  # gone: it releases the memory when it unlinks this node

    def received(self, tag: str) -> bool:
        """True once (then the tag is forgotten) when the transfer tagged ``tag`` has put
        its blocks into one of this node's caches (or, for a pull, has read them).

        Raises
        ------
        LLMException
            KV_CACHE_NOT_EXIST when that transfer targeted a cache this node deallocated
            or replaced before the data arrived (its generation differs); the source's
            status (TIMEOUT, FAILED) when it sent a failure notice for the tag.
        """
        self._drain()
        with self._lock:
            failed = self._failed.pop(tag, None)
            if tag in self._received:  # the data arrived (a late notice changes nothing)
                self._received.discard(tag)
                return True
            if failed is not None:
                status = LLMStatus[failed] if failed in LLMStatus.__members__ else None
                raise LLMException(
                    status or LLMStatus.FAILED,
                    f"transfer {tag!r} failed at the source ({failed}); the blocks it "
                    f"targets may hold partial data (docs/DATADIST.md, "
                    f'"Failure semantics")',
                )
            if tag in self._stale:
                self._stale.discard(tag)
                raise LLMException(
                    LLMStatus.KV_CACHE_NOT_EXIST,
                    f"transfer {tag!r} targeted a cache deallocated since",
                )
            if tag in self._received:
                self._received.discard(tag)
                return True
        return False

    def wait_received(self, tag: str, timeout_s: float | None = None) -> None:
        """Block until :meth:`received` is True for ``tag``, at most ``timeout_s``.

        ``timeout_s`` defaults to ``options["wait_timeout_s"]``.

        Raises
        ------
        LLMException
            TIMEOUT, or as :meth:`received` (a transfer that failed at its source ends
            the wait with the source's status).
        """
        timeout = float(self.options["wait_timeout_s"] if timeout_s is None else timeout_s)
        start = time.monotonic()
        while not self.received(tag):
            if time.monotonic() - start >= timeout:
                raise LLMException(
                    LLMStatus.TIMEOUT, f"tag {tag!r} not received within {timeout} s"
                )
            _poll_sleep(start)


__all__ = ["LlmDataDist", "TransferHandle", "DEFAULT_OPTIONS"]
