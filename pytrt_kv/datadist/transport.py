"""What a data backend implements, and the in-process ``"local"`` backend.

:class:`~pytrt_kv.datadist.LlmDataDist` owns everything the contract decides (checks,
links, cache tables, generations, tags, timeouts); a transport only moves the blocks of
an already checked :class:`~pytrt_kv.datadist.contract.TransferPlan` and delivers
notification messages. ``"local"`` copies with ``memmove`` (or ``cudaMemcpy``) between
nodes of one process: the oracle the NIXL backend is compared with, and a way to run the
protocol without NIXL.
"""

from __future__ import annotations

import collections
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

from .contract import TransferPlan
from .memory import copy_bytes
from .types import CacheDesc, LLMException, LLMStatus

WRITE, READ = "WRITE", "READ"


@dataclass(frozen=True)
class CacheInfo:
    """A cache as its peers see it: id, generation, layout and tensor addresses."""

    cache_id: int
    generation: int
    desc: CacheDesc
    addrs: tuple[int, ...]

    def to_dict(self) -> dict:
        return {
            "cache_id": self.cache_id,
            "generation": self.generation,
            "desc": self.desc.to_dict(),
            "addrs": list(self.addrs),
        }

    @classmethod
    def from_dict(cls, d: Any) -> CacheInfo:
        """An entry of a peer's cache table (from the wire: exact JSON types, no
        coercion). Raises ValueError naming the field."""
        if type(d) is not dict or type(d.get("desc")) is not dict:
            raise ValueError("expected {cache_id, generation, desc: {...}, addrs}")
        desc = d["desc"]
        for name, v, top in (
            ("cache_id", d.get("cache_id"), 1 << 63),
            ("generation", d.get("generation"), 1 << 63),
            ("desc.num_tensors", desc.get("num_tensors"), 1 << 31),
            ("desc.device", desc.get("device", 0), 1 << 31),
        ):
            if type(v) is not int or not 0 <= v < top:
                raise ValueError(f"{name}: expected an int in [0, {top}), got {str(v)[:40]}")
        shape, addrs = desc.get("shape"), d.get("addrs")
        if type(shape) is not list or not all(type(x) is int for x in shape):
            raise ValueError(f"desc.shape: expected a list of ints, got {str(shape)[:60]}")
        if type(desc.get("data_type")) is not str or type(desc.get("placement")) is not str:
            raise ValueError("desc.data_type, desc.placement: expected strings")
        if (
            type(addrs) is not list
            or len(addrs) != desc["num_tensors"]
            or not all(type(a) is int and 0 < a < 1 << 64 for a in addrs)
        ):
            raise ValueError(
                f"addrs: expected one address in (0, 2**64) per tensor, got {str(addrs)[:60]}"
            )
        return cls(d["cache_id"], d["generation"], CacheDesc.from_dict(desc), tuple(addrs))


class Xfer:
    """A posted transfer. ``state()`` is "DONE" or "PROC" (errors raise LLMException);
    ``release()`` frees it (cancelling it if it is still running)."""

    def state(self) -> str:
        raise NotImplementedError

    def spin(self, seconds: float) -> str:
        """:meth:`state`, checked again without a pause while "PROC" for up to ``seconds``
        (the first phase of a wait, :meth:`.handles.TransferHandle.wait`). This base
        checks once."""
        return self.state()

    def release(self) -> None:
        raise NotImplementedError


class Prepared:
    """A plan prepared for repeated posts (:meth:`Transport.prepare`). ``alive`` turns
    False when the backend dropped what it kept (its memory or peer went): prepare anew.
    This base posts through :meth:`Transport.post` each time."""

    alive = True

    def __init__(self, post: Any = None):
        self._post = post

    def post(self, notif: bytes) -> Xfer:
        """Post the plan with the notification ``notif``."""
        return self._post(notif)

    def push(self, notif: bytes, spin_s: float) -> Xfer | None:
        """:meth:`post`, then checked without a pause for up to ``spin_s``
        (:meth:`Xfer.spin`). None: complete within it and released (the small-push path
        of ``push_kv_blocks``, docs/DATADIST.md decision 14); else the transfer, still
        running or failed, for the caller's wait to check again and report."""
        xfer = self.post(notif)
        try:
            state = xfer.spin(spin_s)
        except LLMException:
            return xfer
        except BaseException:  # interrupted: nothing waits for it any more
            xfer.release()
            raise
        if state != "DONE":
            return xfer
        xfer.release()
        return None

    def close(self) -> None:
        """Release what is kept (the plan is no longer kept by its node)."""


class Transport:
    """Interface of a data backend (see the module docstring)."""

    name: str

    def metadata(self) -> str:
        """What a peer needs to reach this node's registered memory (a JSON-safe str)."""
        raise NotImplementedError

    def register(self, info: CacheInfo) -> Any:
        raise NotImplementedError

    def deregister(self, state: Any) -> None:
        raise NotImplementedError

    def add_peer(self, peer: str, metadata: str) -> None:
        raise NotImplementedError

    def remove_peer(self, peer: str, forget: bool = False) -> None:
        """Forget what was prepared for ``peer``; ``forget``: also its metadata (it
        restarted, or a new connection is wanted)."""
        raise NotImplementedError

    def forget_remote(self, peer: str, info: CacheInfo) -> None:
        """Drop what was prepared for a remote cache (it was deallocated or replaced)."""

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
        """Post ``plan``, with ``notif`` for the other side (b"": none)."""
        raise NotImplementedError

    def prepare(
        self,
        op: str,
        plan: TransferPlan,
        local: CacheInfo,
        local_state: Any,
        remote: CacheInfo,
        peer: str,
    ) -> Prepared:
        """What posts ``plan`` again and again (a kept plan of repeated requests,
        docs/DATADIST.md decision 13): a backend may keep what it prepared in it."""
        return Prepared(lambda notif: self.post(op, plan, local, local_state, remote, peer, notif))

    def notify(self, peer: str, notif: bytes) -> None:
        raise NotImplementedError

    def poll(self) -> list[tuple[str, bytes]]:
        """Notifications received since the last poll: (peer name, message)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


# --- local --------------------------------------------------------------------------------

_LOCAL: weakref.WeakValueDictionary[str, LocalTransport] = weakref.WeakValueDictionary()
_LOCAL_LOCK = threading.Lock()


class _LocalXfer(Xfer):
    def __init__(self, copy, ready_at: float, deliver):
        self._copy, self._ready_at, self._deliver = copy, ready_at, deliver
        self._done = False
        self.released = False

    def state(self) -> str:
        if self._done:
            return "DONE"
        if self.released:
            raise LLMException(LLMStatus.FAILED, "transfer handle already released")
        if time.monotonic() < self._ready_at:
            return "PROC"
        self._copy()
        self._deliver()
        self._done = True
        return "DONE"

    def release(self) -> None:
        self.released = True


class LocalTransport(Transport):
    """In-process backend: peers must live in this process.

    Options: ``"local.latency_s"`` (float, default 0): a transfer completes only this
    long after it is posted (how the timeout path is exercised without a slow network);
    a handle released earlier copies nothing.
    """

    def __init__(self, name: str, options: dict[str, Any]):
        self.name = name
        self._latency = float(options.get("local.latency_s", 0.0))
        self._inbox: collections.deque[tuple[str, bytes]] = collections.deque()
        self._peers: dict[str, LocalTransport] = {}
        #: The caches registered here, by id: a peer's advertised table is checked
        #: against it before a copy (what NIXL's registration does for the nixl backend).
        self._caches: dict[int, CacheInfo] = {}
        with _LOCAL_LOCK:
            _LOCAL[name] = self

    def metadata(self) -> str:
        return f"local:{os.getpid()}"

    def register(self, info: CacheInfo) -> Any:
        self._caches[info.cache_id] = info
        return info

    def deregister(self, state: Any) -> None:
        cache_id = state.cache_id
        if self._caches.get(cache_id) is state:
            del self._caches[cache_id]

    def add_peer(self, peer: str, metadata: str) -> None:
        if metadata != self.metadata():
            raise LLMException(
                LLMStatus.FAILED,
                f"the local backend links only nodes of one process; peer {peer!r} is {metadata!r}",
            )
        with _LOCAL_LOCK:
            transport = _LOCAL.get(peer)
        if transport is None:
            raise LLMException(LLMStatus.NOT_YET_LINK, f"peer {peer!r} is not in this process")
        self._peers[peer] = transport

    def remove_peer(self, peer: str, forget: bool = False) -> None:
        self._peers.pop(peer, None)

    def _peer(self, peer: str) -> LocalTransport:
        transport = self._peers.get(peer)
        if transport is None or _LOCAL.get(peer) is not transport:
            raise LLMException(LLMStatus.NOT_YET_LINK, f"peer {peer!r} is gone")
        return transport

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
        target = self._peer(peer)
        # memmove trusts addresses: the remote cache must be one the peer registered, as
        # it registered it (a table that names other addresses copies nothing).
        if target._caches.get(remote.cache_id) != remote:
            raise LLMException(
                LLMStatus.FAILED,
                f"peer {peer!r} has no registered cache {remote.cache_id} at the addresses "
                f"its table gives",
            )
        src, dst = (local, remote) if op == WRITE else (remote, local)
        host = src.desc.placement == "host" and dst.desc.placement == "host"
        device = dst.desc.device if dst.desc.placement == "device" else src.desc.device
        bb = plan.block_bytes
        runs = plan.runs()

        def copy():
            for st, dt, sb, db, n in runs:
                copy_bytes(dst.addrs[dt] + db * bb, src.addrs[st] + sb * bb, n * bb, host, device)

        xfer = _LocalXfer(
            copy, time.monotonic() + self._latency, lambda: target._inbox.append((self.name, notif))
        )
        xfer.state()  # completes now unless a latency is simulated
        return xfer

    def notify(self, peer: str, notif: bytes) -> None:
        self._peer(peer)._inbox.append((self.name, notif))

    def poll(self) -> list[tuple[str, bytes]]:
        out = []
        while self._inbox:
            out.append(self._inbox.popleft())
        return out

    def close(self) -> None:
        with _LOCAL_LOCK:
            if _LOCAL.get(self.name) is self:
                del _LOCAL[self.name]
        self._peers.clear()
