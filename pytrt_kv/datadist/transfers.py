"""The transfers of a node: posting a checked plan (:meth:`TransferMixin._start`), the
what a failed post or transfer
is, and a transfer's timeout (docs/SPEC.md D4-D6, D8)."""

from __future__ import annotations

from typing import Any, NoReturn

from . import memory
from .handles import TransferHandle
from .inflight import Claim, span
from .node_base import NOTIF, Kept, Peer, dst_key, seconds
from .plans import PlanMixin
from .transport import WRITE, CacheInfo, Prepared
from .types import Cache, LLMException, LLMStatus, param_invalid


class TransferMixin(PlanMixin):
    """Posting transfers (the facade's push and pull methods call these)."""

    _tags: Any  # itertools.count
    _tag_prefix: str

    def _tag(self, tag: Any) -> str:
        if tag is None:
            return f"{self._tag_prefix}{next(self._tags)}"
        if not isinstance(tag, str) or not tag:
            raise param_invalid("tag", "a non-empty str", repr(tag))
        try:
            tag.encode()  # it travels in the transfer's notification, as UTF-8
        except UnicodeEncodeError:
            raise param_invalid("tag", "a str that encodes as UTF-8", repr(tag)) from None
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
        timeout = self._timeout(plan.nbytes, timeout_s)
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
            self._post_failed(exc, claim, arg, local, peer)
        return TransferHandle(self, xfer, tag, peer, timeout, (arg, local), claim)

    def _post_failed(
        self, exc: BaseException, claim: Claim | None, arg: str, local: Cache, peer: Peer
    ) -> NoReturn:
        """Raise what a failed post is (the claim released: nothing was posted)."""
        if claim is not None:
            self._writes.release(claim)
        if not isinstance(exc, LLMException):
            raise exc
        err = self._transfer_error(exc, arg, local, peer)
        if err is exc:
            err = self._backend_failure(exc, peer)
        if err is exc:
            raise exc
        raise err from exc

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
            return seconds("timeout_s", timeout_s)
        if self.options["timeout_s"] is not None:
            return float(self.options["timeout_s"])
        o = self.options
        return float(o["timeout_min_s"]) + nbytes / float(o["timeout_floor_bytes_per_s"])
