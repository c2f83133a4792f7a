"""A kept plan's NIXL transfers posted again (:class:`_Prepared`, docs/DATADIST.md
decisions 13 and 14) and a posted NIXL transfer (:class:`_NixlXfer`), for
:class:`.nixl_transport.NixlTransport`. The C small-push path (``plugins/python/smallpush.c``,
decision 15) does what :meth:`_Prepared.push` does and calls its ``_after``, ``_keep``
and ``_drop`` where it does."""

from __future__ import annotations

import time
from typing import Any

from .contract import TransferPlan
from .transport import CacheInfo, Prepared, Xfer
from .types import LLMException, LLMStatus

#: Completed transfers a prepared plan keeps to post again: concurrent posts of one plan
#: each need their own, so a few; more are released.
_IDLE_PER_PLAN = 4


class _Prepared(Prepared):
    """A kept plan's completed NIXL transfers, posted again (see
    :meth:`.nixl_transport.NixlTransport.prepare`). A handle is in ``handles`` only while
    no transfer uses it; ``close`` (the plan is no longer kept, or its memory or peer
    went) releases them, and handles given back later are released too."""

    def __init__(
        self,
        t: Any,  # the NixlTransport (which imports this module)
        op: str,
        plan: TransferPlan,
        local: CacheInfo,
        local_state: Any,
        remote: CacheInfo,
        peer: str,
    ):
        self.t, self.op, self.plan, self.local, self.local_state = t, op, plan, local, local_state
        self.remote, self.peer = remote, peer
        self.what = f"{op} to {peer!r}"
        self.handles: list[Any] = []
        self.alive = True

    def post(self, notif: bytes) -> Xfer:
        # No lock: list.pop is atomic, and close() pops what it releases the same way, so
        # each idle handle goes to exactly one of them (a lock per push cost ~0.6 us on
        # the 2-core VM under load).
        try:
            h = self.handles.pop()
        except IndexError:
            h = None
        if h is None:
            h = self.t._make(
                self.op, self.plan, self.local, self.local_state, self.remote, self.peer, notif
            )
        return self.t._start(h, notif, self.what, self)

    def push(self, notif: bytes, spin_s: float) -> Xfer | None:
        # Prepared.push in one function (docs/DATADIST.md decision 14): the bindings'
        # post and status calls, an idle handle taken and given back without the lock,
        # and a _NixlXfer made only for a post that outlasts the spin or fails (handed
        # to the caller's wait). The C small-push path (plugins/python/smallpush.c,
        # decision 15) does the same and calls _after, _keep and _drop where this does.
        try:
            h = self.handles.pop()
        except IndexError:
            return super().push(notif, spin_s)  # none idle: made anew
        t = self.t
        raw = h._handle
        try:
            st = t._post(raw, notif)
        except BaseException as exc:
            return self._after(h, None, exc, False)
        # Each comparison of the bindings' status codes costs ~0.1 us: one per check.
        status, done, proc = t._status
        if st == proc:
            try:
                end = time.monotonic() + spin_s
                while True:
                    st = status(raw)
                    if st == done:
                        break
                    if st != proc or time.monotonic() >= end:
                        return self._after(h, st, None, True)  # failed, or still running
            except BaseException as exc:
                return self._after(h, None, exc, True)
        elif st != done:
            return self._after(h, st, None, False)  # refused
        self._keep(h)  # complete: kept for the next post
        return None

    def _after(self, h: Any, st: Any, exc: BaseException | None, posted: bool) -> Xfer:
        """What :meth:`push` returns or raises for the idle handle ``h`` when the post is
        not complete within the spin: ``exc`` raised by the post (``posted`` False) or by
        a status check (True), else the status ``st`` the post (False) or a check (True)
        returned, which is a failure or NIXL_IN_PROG at the end of the spin."""
        t = self.t
        if exc is not None:
            if not posted and isinstance(exc, Exception):
                _release(t, h)  # a failed handle is never kept
                raise t._error(exc, f"posting the {self.what}") from exc
            if posted and isinstance(exc, Exception):
                return _NixlXfer(t, h, self)  # the caller's wait checks it again, reports
            _release(t, h)  # interrupted: nothing waits for it any more
            raise exc
        xfer = _NixlXfer(t, h, self)
        if not posted and st != t._status[2]:
            xfer.first = "ERR"  # refused: as _start
        return xfer

    def _keep(self, h: Any) -> None:
        """Keep the completed handle ``h`` for the next post, or release it (closed, or
        ``_IDLE_PER_PLAN`` kept). Without the lock, as :meth:`post` pops: appended, then
        ``alive`` checked again (:meth:`_drop`)."""
        handles = self.handles
        if self.alive and len(handles) < _IDLE_PER_PLAN:
            handles.append(h)
            if self.alive:
                return None
            return self._drop(h)
        _release(self.t, h)
        return None

    def _drop(self, h: Any) -> None:
        """``h`` was appended as the plan closed: a close() that began meanwhile either
        took it from the list (remove fails) or missed it (removed and released here)."""
        try:
            self.handles.remove(h)
        except ValueError:
            return None
        _release(self.t, h)
        return None

    def give_back(self, handle: Any) -> bool:
        """Keep a completed handle for the next post; False: not kept (closed or full),
        the caller releases it."""
        with self.t._lock:
            if self.alive and len(self.handles) < _IDLE_PER_PLAN:
                self.handles.append(handle)
                return True
        return False

    def close(self) -> None:
        with self.t._lock:
            self.alive = False
            self.t._idle.pop(id(self), None)
            handles, self.handles = self.handles, []
        while True:  # popped one by one: a post may pop from the same list (see post)
            try:
                h = handles.pop()
            except IndexError:
                break
            try:
                self.t.agent.release_xfer_handle(h)
            except Exception:
                pass  # idle handles are complete; nothing of theirs is in use


class _NixlXfer(Xfer):
    def __init__(self, transport: Any, handle: Any, entry: _Prepared | None = None):
        self._t, self._h = transport, handle
        self.entry = entry  # where the handle goes back to once complete (None: released)
        self.first = "PROC"
        self.released = False
        # The bindings' status call and codes, bound once: a small push is polled tens of
        # times, and nixl_agent.check_xfer_state (nixl 1.5.1's _api.py) wraps the same
        # getXferStatus in two more Python calls per poll.
        self._raw = handle._handle
        self._status, self._done_code, self._proc_code = transport._status

    def state(self) -> str:
        return self.spin(0.0)

    def spin(self, seconds: float) -> str:
        # The bindings' status call in a loop of its own: a small push completes within
        # the spin, and each check through state() cost two Python calls more.
        first = self.first
        if first == "DONE":
            return "DONE"
        if first == "ERR":
            raise LLMException(LLMStatus.FAILED, "NIXL refused to post the transfer")
        status, raw, proc = self._status, self._raw, self._proc_code
        try:
            st = status(raw)
            if seconds > 0:
                end = time.monotonic() + seconds
                while st == proc and time.monotonic() < end:
                    st = status(raw)
        except Exception as exc:
            raise self._t._error(exc, "transfer") from exc
        if st == proc:
            return "PROC"
        if st == self._done_code:
            self.first = "DONE"
            return "DONE"
        raise LLMException(LLMStatus.FAILED, "NIXL reports the transfer failed")

    def release(self) -> None:
        if not self.released:
            self.released = True
            # A completed handle of a repeated request is kept to be posted again; one
            # that failed, was cancelled or is still running is released.
            if self.entry is not None and self.first == "DONE":
                if self.entry.give_back(self._h):
                    return
            _release(self._t, self._h)


def _release(t: Any, h: Any) -> None:
    """Release the NIXL transfer ``h`` of the transport ``t``. Not cancellable right now:
    keep the handle alive (its memory may still be in use) and retry when the node
    closes (``t.unreleased``)."""
    try:
        t.agent.release_xfer_handle(h)
    except Exception:
        t.unreleased.append(h)
