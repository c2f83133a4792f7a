"""Links of a node: the authenticated control plane (docs/SPEC.md D7), peers' metadata,
``link_clusters`` / ``unlink_clusters``, fences (D8) and what a peer's failure means.

Every control request is authenticated both ways (:mod:`.control`) and bound to the
peer that proved it: a request is handled as coming from the cluster id its connection
authenticated, whatever it says inside, and a link's metadata must name that cluster.
"""

from __future__ import annotations

import json
import numbers
import secrets
import socket
import threading
import time
from collections.abc import Iterable
from typing import Any

from ..contract.errors import describe
from . import control
from .node_base import Fence, NodeState, Peer, seconds
from .transport import CacheInfo
from .types import CacheIndex, LinkResult, LLMException, LLMStatus, param_invalid


def _parse_address(arg: str, c: Any) -> tuple[str, int]:
    if isinstance(c, str) and ":" in c:
        host, _, port = c.rpartition(":")
        c = (host, port)
    try:
        host, port = c
        return str(host), int(port)
    except (TypeError, ValueError):
        raise TypeError(f"{arg}: expected an (ip, port) pair or 'ip:port', got {c!r}") from None


def _malformed(what: str) -> LLMException:
    return LLMException(LLMStatus.FAILED, f"peer metadata: malformed {what}")


def _epoch(v: Any) -> str:
    if not isinstance(v, str) or len(v) != 16 or any(c not in "0123456789abcdef" for c in v):
        raise _malformed("link epoch")
    return v


class LinkMixin(NodeState):
    """Links, the control plane and peers' health."""

    # --- metadata -------------------------------------------------------------------------

    def _metadata(self) -> dict[str, Any]:
        transport = self._require()
        with self._lock:
            caches = [
                CacheInfo(c.cache_id, c.generation, c.cache_desc, c.tensor_addrs).to_dict()
                for c in self._caches.values()
            ]
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
        transport metadata, and each cache's id, generation, layout and addresses. It
        gives access to every registered cache: a node sends it only to authenticated
        peers (docs/DATADIST.md, "Security")."""
        return json.dumps(self._metadata()).encode()

    def _apply_metadata(
        self, md: Any, authenticated: int, epoch: str | None = None, defer: bool = False
    ) -> Peer:
        """Load a peer's metadata: (re)load its transport metadata and its cache table.
        ``authenticated``: the cluster id its connection proved (the metadata must name
        it); ``epoch``: a new link's epoch (None: the link's own, a table refresh);
        ``defer``: leave the transport metadata pending (:meth:`_load` loads it).

        Raises
        ------
        LLMException
            FAILED for metadata that is malformed, of another backend or version, or of
            another cluster than the authenticated one.
        """
        if not isinstance(md, dict):
            raise _malformed("reply (no metadata)")
        if md.get("version") != 1 or md.get("backend") != self.backend:
            raise LLMException(
                LLMStatus.FAILED,
                f"peer metadata: expected a version-1 {self.backend!r} node, "
                f"got version {str(md.get('version'))[:20]} "
                f"backend {str(md.get('backend'))[:20]!r}",
            )
        cid, agent, address, transport = (
            md.get(k) for k in ("cluster_id", "agent", "address", "transport")
        )
        if cid == self.cluster_id:
            raise LLMException(LLMStatus.FAILED, f"peer has this node's own cluster_id {cid}")
        if cid != authenticated or type(cid) is not int:
            raise LLMException(
                LLMStatus.FAILED,
                f"peer metadata: names cluster {str(cid)[:20]}, but the peer authenticated as "
                f"cluster {authenticated} (docs/SPEC.md D7)",
            )
        if not isinstance(agent, str) or not agent or not isinstance(transport, str):
            raise _malformed("agent")
        try:
            addr = _parse_address("address", address)
            caches = {}
            for c in md.get("caches") or []:
                info = CacheInfo.from_dict(c)
                caches[info.cache_id] = info
        except Exception as exc:  # anything malformed in the table: this link fails
            raise _malformed(f"cache table ({type(exc).__name__}: {str(exc)[:200]})") from None
        with self._lock:
            other = self._by_agent.get(agent)
            if other is not None and other.cluster_id != cid:
                raise LLMException(
                    LLMStatus.FAILED,
                    f"peer metadata: agent {agent!r} belongs to cluster {other.cluster_id}",
                )
        if not defer:
            self._require().add_peer(agent, transport)
        with self._lock:
            peer = self._peers.get(cid)
            if peer is None or peer.agent != agent:
                if peer is not None:  # the cluster restarted: a new agent
                    self._by_agent.pop(peer.agent, None)
                    self._drop_plans(lambda k, old=peer: k.peer is old)
                    self._require().remove_peer(peer.agent, forget=True)
                peer = Peer(cid, agent, addr, epoch or "")
                self._peers[cid] = peer
                self._by_agent[agent] = peer
            elif epoch is not None:
                peer.epoch = epoch
            self._set_caches(peer, caches)
            peer.broken = False
            peer.pending = transport if defer else None
        if cid in self._fences:  # it links again: it has this node's current table
            self._release_fence(cid, keep_agent=True)
        return peer

    def _set_caches(self, peer: Peer, caches: dict[int, CacheInfo]) -> None:
        for cid, old in list(peer.caches.items()):
            new = caches.get(cid)
            if new is None or new.generation != old.generation:
                self._require().forget_remote(peer.agent, old)
        peer.caches = caches

    # --- links ----------------------------------------------------------------------------

    def _request(self, peer_or_addr: Any, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        """One authenticated control request; to a linked peer it must prove its id."""
        assert self._auth is not None
        if isinstance(peer_or_addr, Peer):
            _, reply = control.request(
                peer_or_addr.address, msg, timeout, self._auth, peer_or_addr.cluster_id
            )
            return reply
        _, reply = control.request(peer_or_addr, msg, timeout, self._auth)
        return reply

    def link_clusters(
        self, clusters: Iterable[Any], timeout_s: float | None = None
    ) -> list[LinkResult]:
        """Link to peers listening at ``clusters`` (``(ip, port)`` pairs or ``"ip:port"``).

        Each link starts with the mutual authentication of docs/SPEC.md D7; then both
        sides learn each other's caches and transport metadata. Each cluster is linked on
        its own: one that fails does not stop the others.

        Returns
        -------
        list of LinkResult
            One per cluster, in order (CANN's ``rets``): SUCCESS with the peer's cluster
            id, or FAILED with the reason (unreachable within ``timeout_s``, default
            ``control_timeout_s``; authentication failed; refused; a malformed reply; the
            same cluster id; another backend).

        Raises
        ------
        TypeError
            A cluster that is not an address (checked before anything is linked).
        LLMParamInvalid
            ``timeout_s`` is not a finite number > 0 (nothing is linked).
        """
        self._require()
        timeout = (
            float(self.options["control_timeout_s"])
            if timeout_s is None
            else seconds("timeout_s", timeout_s, finite=True)
        )
        addrs = [_parse_address(f"clusters[{i}]", c) for i, c in enumerate(list(clusters))]
        results = []
        for addr in addrs:
            where = f"link to {addr[0]}:{addr[1]}"
            epoch = secrets.token_hex(8)
            try:
                assert self._auth is not None
                who, reply = control.request(
                    addr,
                    {"op": "hello", "md": self._metadata(), "epoch": epoch},
                    timeout,
                    self._auth,
                )
                if "error" in reply:
                    raise LLMException(
                        LLMStatus.FAILED, f"{where} refused: {str(reply['error'])[:300]}"
                    )
                peer = self._apply_metadata(reply.get("md"), who, epoch)
            except OSError as exc:
                results.append(LinkResult(LLMStatus.FAILED, None, f"{where}: {exc}"))
                continue
            except LLMException as exc:
                results.append(LinkResult(exc.status, None, f"{where}: {exc.message}"))
                continue
            except Exception as exc:  # never out of the API: this cluster fails
                results.append(
                    LinkResult(LLMStatus.FAILED, None, f"{where}: {type(exc).__name__}: {exc}")
                )
                continue
            # The peer applied this node's table before it answered: it knows every
            # deallocation (docs/DATADIST.md, "Failure semantics").
            self._acknowledged(peer.cluster_id)
            results.append(LinkResult(LLMStatus.SUCCESS, peer.cluster_id))
        return results

    def unlink_clusters(self, cluster_ids: Iterable[int], timeout_s: float | None = None) -> None:
        """End links on both sides (the peer is told, bounded by ``timeout_s``).

        A peer that could not be told is fenced (docs/SPEC.md D8): its notices are
        ignored from now on, it is told in-band, and the memory of every cache it knew
        stays quarantined, once deallocated, until it acknowledges.

        Raises
        ------
        LLMException
            NOT_YET_LINK for a cluster id that is not linked; PARAM_INVALID: ``timeout_s``
            is not a finite number > 0 (nothing is unlinked).
        """
        self._require()
        timeout = (
            float(self.options["control_timeout_s"])
            if timeout_s is None
            else seconds("timeout_s", timeout_s, finite=True)
        )
        for cid in list(cluster_ids):
            with self._lock:
                peer = self._peers.get(cid)
            if peer is None:
                raise LLMException(LLMStatus.NOT_YET_LINK, f"cluster {cid} is not linked")
            heard = False
            try:
                reply = self._request(
                    peer, {"op": "bye", "agent": self._require().name, "epoch": peer.epoch}, timeout
                )
                heard = "error" not in reply
            except OSError:
                pass  # fenced below
            self._unlink_peer(peer, heard)

    def _unlink_peer(self, peer: Peer, heard: bool) -> None:
        """Forget ``peer``; one that did not hear it is fenced (docs/SPEC.md D8)."""
        with self._lock:
            if self._peers.get(peer.cluster_id) is peer:
                del self._peers[peer.cluster_id]
            self._by_agent.pop(peer.agent, None)
            if not heard:
                self._fences[peer.cluster_id] = Fence(
                    peer,
                    self._last_generation,
                    time.monotonic() + float(self.options["llm_datadist.fence_timeout_s"]),
                )
        self._drop_plans(lambda k: k.peer is peer)
        if heard:
            self._require().remove_peer(peer.agent)
            self._acknowledged(peer.cluster_id)  # it forgot every cache of this node
            return
        try:  # the NIXL connection stays loaded so that the peer can be told in-band
            self._tell_unlink(peer)
        except LLMException:
            pass

    def _release_fence(self, cluster_id: int, keep_agent: bool = False) -> None:
        with self._lock:
            fence = self._fences.pop(cluster_id, None)
        if fence is None:
            return
        if not keep_agent:
            with self._lock:
                linked = self._peers.get(cluster_id)
            if linked is None or linked.agent != fence.peer.agent:
                self._require().remove_peer(fence.peer.agent)
        self._acknowledged(cluster_id)

    def linked_clusters(self) -> list[int]:
        """Cluster ids linked now (a broken link is listed until unlinked)."""
        with self._lock:
            return sorted(self._peers)

    @property
    def control_alive(self) -> bool:
        """True while this node's control server accepts connections (docs/SPEC.md D7:
        no peer's message can stop it)."""
        server = self._server
        return server is not None and server.alive

    # --- the control server (its threads) -------------------------------------------------

    def _handle(self, who: int, msg: dict[str, Any]) -> dict[str, Any]:
        """Control requests from peers, ``who`` being the cluster id the connection
        authenticated (server threads). A malformed request gets an error."""
        op = msg.get("op")
        if op == "hello":
            # Answered without waiting for the NIXL agent, which a long post may hold
            # (issue 19 fault 3): the metadata is loaded on another thread.
            epoch = _epoch(msg.get("epoch"))
            self._load_later(self._apply_metadata(msg.get("md"), who, epoch, defer=True))
            return {"md": self._metadata()}
        with self._lock:
            peer = self._peers.get(who)
        if peer is None:
            if op == "bye":
                return {}  # not linked (or fenced and now told): nothing to undo
            return {"error": f"cluster {who} is not linked"}
        if op == "table":
            return {"md": self._metadata()}
        if op == "drop":
            cache_id, gen = msg.get("cache_id"), msg.get("generation")
            if type(cache_id) is not int or type(gen) is not int:
                return {"error": "drop: expected int cache_id and generation"}
            self._forget_remote_cache(peer, cache_id, gen)
            return {}
        if op == "bye":
            if peer.agent != msg.get("agent") or peer.epoch != msg.get("epoch"):
                return {"error": "bye: not the current link"}  # the sender fences it
            self._unlink_peer(peer, heard=True)
            return {}
        return {"error": f"unknown request {str(op)[:40]!r}"}

    def _forget_remote_cache(self, peer: Peer, cache_id: int, generation: int) -> None:
        with self._lock:
            old = peer.caches.get(cache_id)
            if old is not None and old.generation == generation:
                del peer.caches[old.cache_id]
                self._require().forget_remote(peer.agent, old)

    def _load(self, peer: Peer) -> None:
        """Load the peer's transport metadata if a link request left it pending."""
        with peer.load_lock:
            with self._lock:
                if self._peers.get(peer.cluster_id) is not peer:
                    return  # unlinked or relinked meanwhile: nothing to load
            if peer.pending is not None:
                self._require().add_peer(peer.agent, peer.pending)
                peer.pending = None

    def _load_later(self, peer: Peer) -> None:
        def load() -> None:
            try:
                self._load(peer)
            except LLMException:
                pass  # the next transfer to this peer tries again and reports it

        threading.Thread(target=load, name="pytrt_kv-datadist-link", daemon=True).start()

    # --- remote caches ---------------------------------------------------------------------

    def _remote_cache(self, arg: str, index: Any) -> tuple[Peer, CacheInfo]:
        if not isinstance(index, CacheIndex):
            raise param_invalid(arg, "a CacheIndex(cluster_id, cache_id)", describe(index))
        if index.batch_index != 0:
            raise param_invalid(
                f"{arg}.batch_index", "0 (blocks are addressed by id)", index.batch_index
            )
        ids = []
        for name in ("cluster_id", "cache_id"):  # 2.0 or True is not taken for an id
            v = getattr(index, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                got = repr(v) if isinstance(v, (int, float)) else describe(v)
                raise param_invalid(f"{arg}.{name}", "an int", got)
            ids.append(int(v))
        cluster_id, cache_id = ids
        self._drain()  # deallocate notices that came with the data path (issue 19 item 1)
        with self._lock:
            peer = self._peers.get(cluster_id)
        if peer is None or peer.broken:
            raise LLMException(
                LLMStatus.NOT_YET_LINK,
                f"{arg}: cluster {index.cluster_id} is not linked"
                + (" (the link broke)" if peer is not None else ""),
            )
        info = peer.caches.get(cache_id)
        if info is None:  # created after the link? ask the peer once
            try:
                reply = self._request(peer, {"op": "table"}, self._control_timeout())
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
            if "md" not in reply:  # it no longer has this link (it unlinked, restarted)
                peer.broken = True
                raise LLMException(
                    LLMStatus.NOT_YET_LINK,
                    f"{arg}: cluster {index.cluster_id} refused: "
                    f"{str(reply.get('error'))[:200]}; link it again",
                )
            try:
                self._apply_metadata(reply.get("md"), peer.cluster_id)
            except LLMException as exc:
                raise LLMException(exc.status, f"{arg}: {exc.message}") from None
            info = peer.caches.get(cache_id)
        if info is None:
            raise LLMException(
                LLMStatus.KV_CACHE_NOT_EXIST,
                f"{arg}: cluster {index.cluster_id} has no cache {index.cache_id}",
            )
        if peer.pending is not None:  # the common case, linked and loaded, takes no lock
            self._load(peer)
        return peer, info

    def _reconnect(self, peer: Peer) -> None:
        """Load the peer's transport metadata again (a new NIXL connection)."""
        reply = self._request(peer, {"op": "table"}, self._control_timeout())
        if "md" not in reply:
            raise OSError(f"cluster {peer.cluster_id}: {str(reply.get('error'))[:200]}")
        self._require().remove_peer(peer.agent, forget=True)
        self._apply_metadata(reply["md"], peer.cluster_id)

    # --- peers' health --------------------------------------------------------------------

    def _peer_alive(self, peer: Peer) -> bool:
        """False when the peer's control port refuses connections (a dead process's port
        refuses at once). A connection that times out is not a death: a paused or busy
        process (SIGSTOP, a full accept backlog) still counts as alive."""
        try:
            with socket.create_connection(peer.address, timeout=PROBE_TIMEOUT_S):
                return True
        except (ConnectionRefusedError, ConnectionResetError):
            return False
        except OSError:
            return True

    def _peer_restarted(self, peer: Peer) -> bool:
        """True when the peer's control port is answered by another node than the one
        linked: another cluster or secret, or the same cluster with a new NIXL agent (it
        restarted on the same port) or without this link."""
        try:
            reply = self._request(peer, {"op": "table"}, min(1.0, self._control_timeout()))
        except control.AuthError:
            return True
        except OSError:
            return False  # paused or busy: not known to be another node
        md = reply.get("md")
        return not isinstance(md, dict) or md.get("agent") != peer.agent

    def _backend_failure(self, exc: LLMException, peer: Peer) -> LLMException:
        """What a transport failure means for the link: NOT_YET_LINK (the link broken)
        when the peer is gone or restarted (relink it), else FAILED with the link kept
        (NIXL lost the connection, the control plane did not)."""
        if exc.status not in (LLMStatus.NOT_YET_LINK, LLMStatus.FAILED):
            return exc
        if not self._peer_alive(peer):
            peer.broken = True
            return LLMException(LLMStatus.NOT_YET_LINK, f"{exc.message}; the peer is gone")
        if self._peer_restarted(peer):
            peer.broken = True
            return LLMException(
                LLMStatus.NOT_YET_LINK,
                f"{exc.message}; cluster {peer.cluster_id} restarted (another node answers "
                f"at {peer.address[0]}:{peer.address[1]}): link it again",
            )
        if exc.status == LLMStatus.NOT_YET_LINK:
            return LLMException(
                LLMStatus.FAILED,
                f"{exc.message}; the peer's control channel still answers, so the link is kept",
            )
        return exc


#: A liveness probe's connect timeout (a paused peer's full backlog times out).
PROBE_TIMEOUT_S = 0.2
