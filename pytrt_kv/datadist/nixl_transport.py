"""The ``"nixl"`` backend: blocks move with NIXL (UCX by default), between processes and
machines, host (DRAM) or device (VRAM) memory.

Each cache is one prepared descriptor list with an entry per (tensor, block), built from
strided ``(address, block_bytes, device, block_bytes, NB)`` rows; a transfer is one
``make_prepped_xfer`` over the plan's indices, tensor-major so that blocks consecutive on
both sides are adjacent and NIXL merges them into one descriptor. Remote lists are
prepared on first use and dropped when the remote cache goes away.

NIXL is imported only when a ``"nixl"`` node is created (:func:`.nixl_agent.nixl_modules`).
"""

from __future__ import annotations

import base64
import threading
from typing import Any

import numpy as np

from .contract import TransferPlan
from .nixl_agent import _make_agent, _net_devices, _option, nixl_modules
from .nixl_prepared import _NixlXfer, _Prepared, _release
from .transport import WRITE, CacheInfo, Transport, Xfer
from .types import LLMException, LLMStatus


def _mem(info: CacheInfo) -> tuple[str, int]:
    if info.desc.placement == "device":
        return "VRAM", info.desc.device
    return "DRAM", 0


def _rows(info: CacheInfo) -> np.ndarray:
    """Nx5 strided rows: tensor t, block b -> descriptor t * NB + b."""
    _, dev = _mem(info)
    bb, nb = info.desc.block_bytes, info.desc.num_blocks
    return np.array([[a, bb, dev, bb, nb] for a in info.addrs], dtype=np.uint64)


class NixlTransport(Transport):
    """Options: ``"nixl.backends"`` (list, default ``["UCX"]``), ``"nixl.num_threads"``
    (int, default 0: the backend's default), ``"nixl.progress_thread"`` (bool, default
    True) and ``"nixl.progress_delay_us"`` (int, default 1000): see :func:`_make_agent`."""

    def __init__(self, name: str, options: dict[str, Any], listen_ip: str | None = None):
        self._api, self._b = nixl_modules()
        self.name = name
        backends = list(options.get("nixl.backends", ["UCX"]))
        # Bad option values are the caller's error (TypeError naming the key), not NIXL's.
        _option(options, "nixl.progress_thread", bool, True)
        _option(options, "nixl.progress_delay_us", int, 1000)
        _option(options, "nixl.num_threads", int, 0)
        try:
            with _net_devices(listen_ip):
                self.agent = _make_agent(self._api, self._b, name, options, backends)
        except LLMException:
            raise
        except Exception as exc:
            raise self._error(exc, "creating the NIXL agent") from exc
        if not self.agent.backends:
            raise LLMException(
                LLMStatus.FAILED,
                f"NIXL has none of the backends "
                f"{backends} (available: "
                f"{self.agent.get_plugin_list()})",
            )
        self._remote: dict[tuple[str, int, int], Any] = {}
        #: Peers' metadata loaded in the agent, also after an unlink (reused on relink).
        self._loaded: dict[str, str] = {}
        self._dormant: dict[str, None] = {}  # loaded, unlinked: oldest first
        # Prepared transfers of repeated requests, kept to be posted again (docs/DATADIST.md
        # decision 13), by id, so that what goes drops them (memory, peer, remote cache).
        self._idle: dict[int, _Prepared] = {}
        self._lock = threading.Lock()
        self.unreleased: list[Any] = []
        # Cached, refreshed when registrations change: the control thread answers links
        # without waiting for the agent, which a long post holds (issue 19 fault 3).
        self._metadata = self._read_metadata()
        # What _NixlXfer.state polls: the bindings' status call (the C++ agent is fixed
        # once made) and its codes; and the bindings' post (nixl_agent.transfer wraps it).
        self._status = (self.agent.agent.getXferStatus, self._b.NIXL_SUCCESS, self._b.NIXL_IN_PROG)
        self._post = self.agent.agent.postXferReq
        self._notifs = self.agent.agent.getNotifs

    # --- errors ---------------------------------------------------------------------------

    def _error(self, exc: BaseException, what: str) -> LLMException:
        b = self._b
        if isinstance(exc, LLMException):
            return exc
        if isinstance(exc, getattr(b, "nixlRemoteDisconnectError", ())):
            return LLMException(LLMStatus.NOT_YET_LINK, f"{what}: the peer disconnected ({exc})")
        if isinstance(exc, getattr(b, "nixlNotFoundError", ())):
            return LLMException(
                LLMStatus.KV_CACHE_NOT_EXIST,
                f"{what}: NIXL does not know this memory or agent ({exc})",
            )
        return LLMException(LLMStatus.FAILED, f"{what}: {type(exc).__name__}: {exc}")

    # --- memory ---------------------------------------------------------------------------

    def _read_metadata(self) -> str:
        return base64.b64encode(self.agent.get_agent_metadata()).decode()

    def metadata(self) -> str:
        return self._metadata

    def register(self, info: CacheInfo) -> Any:
        mem, dev = _mem(info)
        nbytes = info.desc.tensor_bytes
        try:
            reg = self.agent.register_memory([(a, nbytes, dev, "") for a in info.addrs], mem)
        except Exception as exc:
            raise self._error(exc, f"registering cache {info.cache_id}") from exc
        try:
            dlist = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", _rows(info), mem)
        except Exception as exc:
            self.agent.deregister_memory(reg)
            raise self._error(exc, f"preparing cache {info.cache_id}") from exc
        self._metadata = self._read_metadata()
        return reg, dlist

    def deregister(self, state: Any) -> None:
        self._drop_idle(lambda e: e.local_state is state)
        reg, dlist = state
        dlist.release()
        self.agent.deregister_memory(reg)
        self._metadata = self._read_metadata()

    # --- peers ----------------------------------------------------------------------------

    def add_peer(self, peer: str, metadata: str) -> None:
        """Load a peer's metadata; the same metadata loaded before (a relink after an
        unlink) is reused: NIXL/UCX keep a connection per load (see :meth:`remove_peer`)."""
        with self._lock:
            self._dormant.pop(peer, None)
            if self._loaded.get(peer) == metadata:
                return
        try:
            name = self.agent.add_remote_agent(base64.b64decode(metadata))
        except Exception as exc:
            raise self._error(exc, f"loading the metadata of {peer!r}") from exc
        name = name.decode() if isinstance(name, bytes) else name
        if name != peer:
            raise LLMException(LLMStatus.FAILED, f"the metadata of {peer!r} names agent {name!r}")
        with self._lock:
            self._loaded[peer] = metadata

    def remove_peer(self, peer: str, forget: bool = False) -> None:
        """Drop what was prepared for ``peer``. Its NIXL metadata stays loaded (dormant)
        unless ``forget`` (it restarted, or a new connection is wanted): with nixl 1.5.1
        over UCX, ``remove_remote_agent`` leaves the TCP connection of each load open, so
        every link/unlink cycle leaked one socket per side (docs/DATADIST.md, "File
        descriptors"); a relink of the same agent reuses the loaded metadata instead."""
        self._drop_idle(lambda e: e.peer == peer)
        with self._lock:
            for key in [k for k in self._remote if k[0] == peer]:
                self._remote.pop(key).release()
            gone = [peer] if forget else []
            if forget:
                self._loaded.pop(peer, None)
                self._dormant.pop(peer, None)
            elif peer in self._loaded:
                self._dormant[peer] = None
                while len(self._dormant) > _MAX_DORMANT:  # the oldest dormant peer goes
                    old = next(iter(self._dormant))
                    del self._dormant[old]
                    self._loaded.pop(old, None)
                    gone.append(old)
        for name in gone:
            self._remove_agent(name)

    def _remove_agent(self, peer: str) -> None:
        try:
            self.agent.remove_remote_agent(peer)
        except Exception:
            pass  # already gone: nothing left to disconnect

    def forget_remote(self, peer: str, info: CacheInfo) -> None:
        self._drop_idle(
            lambda e: (
                e.peer == peer
                and (e.remote.cache_id, e.remote.generation) == (info.cache_id, info.generation)
            )
        )
        with self._lock:
            h = self._remote.pop((peer, info.cache_id, info.generation), None)
        if h is not None:
            h.release()

    def _remote_dlist(self, peer: str, info: CacheInfo) -> Any:
        key = (peer, info.cache_id, info.generation)
        h = self._remote.get(key)  # a dict read is atomic; writers hold the lock
        if h is None:
            mem, _ = _mem(info)
            try:
                h = self.agent.prep_xfer_dlist(peer, _rows(info), mem)
            except Exception as exc:
                raise self._error(
                    exc, f"preparing remote cache {info.cache_id} of {peer!r}"
                ) from exc
            with self._lock:
                self._remote[key] = h
        return h

    # --- transfers ------------------------------------------------------------------------

    def _drop_idle(self, match: Any) -> None:
        """Release the kept transfers whose prepared plan matches (its memory or peer
        goes)."""
        with self._lock:
            gone = [k for k, e in self._idle.items() if match(e)]
            entries = [self._idle.pop(k) for k in gone]
        for e in entries:
            e.close()

    def _make(
        self,
        op: str,
        plan: TransferPlan,
        local: CacheInfo,
        local_state: Any,
        remote: CacheInfo,
        peer: str,
        notif: bytes,
    ) -> Any:
        """A new NIXL transfer (``make_prepped_xfer``) of ``plan``."""
        src, dst = (local, remote) if op == WRITE else (remote, local)
        si, di = plan.descriptor_indices(src.desc.num_blocks, dst.desc.num_blocks)
        li, ri = (si, di) if op == WRITE else (di, si)
        rdl = self._remote_dlist(peer, remote)
        try:
            return self.agent.make_prepped_xfer(op, local_state[1], li, rdl, ri, notif_msg=notif)
        except Exception as exc:
            raise self._error(exc, f"{op} to {peer!r}") from exc

    def _start(self, h: Any, notif: bytes, what: str, entry: _Prepared | None) -> _NixlXfer:
        """Post the transfer ``h`` with ``notif``; ``entry``: where ``h`` goes back to once
        complete (None: released)."""
        try:
            st = self._post(h._handle, notif)
        except Exception as exc:
            _release(self, h)  # a failed handle is never kept
            raise self._error(exc, f"posting the {what}") from exc
        # Made after the post: the transfer is under way meanwhile (a small push's
        # latency is the Python before the post plus NIXL's time).
        xfer = _NixlXfer(self, h, entry)
        if st == self._b.NIXL_SUCCESS:
            xfer.first = "DONE"
        elif st != self._b.NIXL_IN_PROG:
            xfer.first = "ERR"
        return xfer

    def post(
        self,
        op: str,
        plan: TransferPlan,
        local: CacheInfo,
        local_state: Any,
        remote: CacheInfo,
        peer: str,
        notif: bytes,
    ) -> Xfer:
        h = self._make(op, plan, local, local_state, remote, peer, notif)
        return self._start(h, notif, f"{op} to {peer!r}", None)

    def prepare(
        self,
        op: str,
        plan: TransferPlan,
        local: CacheInfo,
        local_state: Any,
        remote: CacheInfo,
        peer: str,
    ) -> _Prepared:
        """Decision 13: the kept plan's completed NIXL transfers are posted again, each
        time with the new request's notification, instead of made anew."""
        e = _Prepared(self, op, plan, local, local_state, remote, peer)
        with self._lock:
            self._idle[id(e)] = e
        return e

    def notify(self, peer: str, notif: bytes) -> None:
        try:
            self.agent.send_notif(peer, notif)
        except Exception as exc:
            raise self._error(exc, f"notifying {peer!r}") from exc

    def poll(self) -> list[tuple[str, bytes]]:
        try:  # the bindings' call (nixl_agent.get_new_notifs wraps it): once per push
            notifs = self._notifs({}, [])
        except Exception as exc:
            raise self._error(exc, "reading notifications") from exc
        if not notifs:
            return []
        return [
            (k.decode() if isinstance(k, bytes) else k, m)
            for k, msgs in notifs.items()
            for m in msgs
        ]

    def close(self) -> None:
        self._drop_idle(lambda e: True)
        with self._lock:
            remote, self._remote = list(self._remote.values()), {}
        for h in remote + self.unreleased:
            try:
                h.release()
            except Exception:
                pass
        self.unreleased = []


#: Unlinked peers whose NIXL metadata stays loaded to be reused (the oldest are removed:
#: each removal may leave one socket open, see NixlTransport.remove_peer).
_MAX_DORMANT = 64
