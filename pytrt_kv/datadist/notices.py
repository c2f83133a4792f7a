"""The destination side of a node: in-band notices (NIXL notifications) and tags
(docs/SPEC.md D6). Every notice names its link epoch and is accepted only from the NIXL
agent authenticated for that epoch (docs/SPEC.md D7, D8): a forged, replayed, stale or
malformed notice is ignored, and never costs a legitimate one."""

from __future__ import annotations

import logging
import time

from .handles import _poll_sleep
from .node_base import BACK, BYE, DACK, DROP, FAIL, MAX_FAILED, NOTIF, NodeState, Peer, seconds
from .types import LLMException, LLMStatus

log = logging.getLogger("pytrt_kv.datadist")


class NoticeMixin(NodeState):
    """Reading notices; ``received`` / ``wait_received``."""

    def _send_failure(self, peer: Peer, status: LLMStatus, tag: str) -> None:
        """Tell a transfer's other side that it failed (best effort: the notice is queued
        by NIXL; a peer that is gone gets nothing)."""
        try:
            self._require().notify(peer.agent, f"{FAIL}|{peer.epoch}|{status.name}|{tag}".encode())
        except LLMException:
            pass

    def _drain(self) -> None:
        self._drained_at = time.monotonic()
        for agent, msg in self._require().poll():
            try:
                self._one_notice(agent, msg)
            except Exception as exc:  # a malformed notice is ignored, never raised
                log.warning("datadist: notice from %r ignored: %r", agent[:80], exc)

    def _one_notice(self, agent: str, msg: bytes) -> None:
        text = msg.decode(errors="replace")
        kind, _, rest = text.partition("|")
        epoch, _, rest = rest.partition("|")
        peer = self._by_agent.get(agent)
        if peer is None or not epoch or peer.epoch != epoch:
            if kind == BACK:
                self._unlink_acknowledged(agent, epoch, rest)
            return  # not from the agent of a current link: ignored (docs/SPEC.md D7, D8)
        if kind == NOTIF:
            cid_text, gen_text, tag = rest.split("|", 2)
            cache = self._caches.get(int(cid_text))
            live = cache is not None and cache.generation == int(gen_text)
            with self._lock:
                (self._received if live else self._stale).add(tag)
        elif kind == FAIL:
            status, sep, failed_tag = rest.partition("|")
            if sep:
                with self._lock:
                    self._failed[failed_tag] = status
                    while len(self._failed) > MAX_FAILED:
                        del self._failed[next(iter(self._failed))]
        elif kind in (DROP, DACK):
            cluster, cache_id, gen = (int(v) for v in rest.split("|", 2))
            if cluster != peer.cluster_id:
                return  # names another cluster than the one its agent authenticated as
            if kind == DACK:
                self._acknowledged(cluster, cache_id)
                return
            self._forget_remote_cache(peer, cache_id, gen)
            try:
                notice = f"{DACK}|{epoch}|{self.cluster_id}|{cache_id}|{gen}"
                self._require().notify(agent, notice.encode())
            except LLMException:
                pass  # gone: it releases the memory when it unlinks this node
        elif kind == BYE and int(rest) == peer.cluster_id:
            # The peer unlinked this node without reaching its control server: drop the
            # link (its plans go with it) and acknowledge, then forget its agent.
            try:
                self._require().notify(agent, f"{BACK}|{epoch}|{self.cluster_id}".encode())
            except LLMException:
                pass
            self._unlink_peer(peer, heard=True)

    def _unlink_acknowledged(self, agent: str, epoch: str, cluster: str) -> None:
        """A fenced peer acknowledged the unlink in-band: release its fence."""
        with self._lock:
            fence = self._fences.get(int(cluster))
        if fence is not None and fence.peer.agent == agent and fence.peer.epoch == epoch:
            self._release_fence(fence.peer.cluster_id)

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
            the wait with the source's status); PARAM_INVALID: ``timeout_s`` is not a
            number > 0.
        """
        timeout = (
            float(self.options["wait_timeout_s"])
            if timeout_s is None
            else seconds("timeout_s", timeout_s)
        )
        start = time.monotonic()
        while not self.received(tag):
            if time.monotonic() - start >= timeout:
                raise LLMException(
                    LLMStatus.TIMEOUT, f"tag {tag!r} not received within {timeout} s"
                )
            _poll_sleep(start)
