"""Transfer handles: :class:`TransferHandle` (``push_kv_blocks_async``...) and how a
wait polls (docs/DATADIST.md, "Completion")."""

from __future__ import annotations

import time
import weakref
from typing import NoReturn

from .inflight import _BUSY, _HANDLE, _ID, Claim
from .node_base import PROBE_EVERY_S, NodeState, Peer, seconds
from .transport import Xfer
from .types import Cache, LLMException, LLMStatus

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


class TransferHandle:
    """An asynchronous push or pull (``push_kv_blocks_async``/``pull_kv_blocks_async``).

    ``done()`` polls; ``wait()`` blocks with a bound; ``cancel()`` aborts. The first two
    raise the transfer's :class:`LLMException`. The NIXL handle is released when the
    transfer completes, fails, times out or is cancelled; after a TIMEOUT the destination
    blocks are undefined (docs/SPEC.md D5).
    """

    def __init__(
        self,
        dd: NodeState,
        xfer: Xfer | None,
        tag: str,
        peer: Peer,
        timeout_s: float,
        local: tuple[str, Cache] | None = None,
        claim: Claim | None = None,
    ):
        self._dd, self._xfer, self.tag, self._peer = dd, xfer, tag, peer
        #: The timeout ``wait()`` uses by default (the call's, or scaled with the bytes).
        self.timeout_s = timeout_s
        self._local = local  # (argument name, this node's cache) for failure reports
        self._error: LLMException | None = None
        self._done = xfer is None
        # The destination blocks this transfer writes (:mod:`.inflight`), released with
        # the transport's handle.
        self._claim = claim
        if claim is not None:
            claim[_HANDLE] = weakref.ref(self)  # inflight.posted, inline (per push)

    @property
    def released(self) -> bool:
        """True once the transport's handle is freed (always, after done/error/timeout)."""
        return self._xfer is None

    def _release(self) -> None:
        if self._xfer is not None:
            xfer, self._xfer = self._xfer, None
            xfer.release()
        if self._claim is not None:
            claim, self._claim = self._claim, None
            claim[_BUSY].pop(claim[_ID], None)  # Writes.release, inline (per push)

    def _failed(self, exc: LLMException) -> NoReturn:
        """The transport reported ``exc`` for the transfer: fail with what it is."""
        if self._local is not None:
            exc = self._dd._transfer_error(exc, *self._local, self._peer)
        self._fail(self._dd._backend_failure(exc, self._peer))

    def _fail(self, exc: LLMException) -> NoReturn:
        self._release()
        if exc.status == LLMStatus.NOT_YET_LINK:
            self._peer.broken = True  # gone or restarted (LlmDataDist._backend_failure)
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
        return self._check(0.0)

    def _check(self, spin_s: float) -> bool:
        """:meth:`done`, the transport checking again for up to ``spin_s`` without a
        pause while the transfer runs (:meth:`.transport.Xfer.spin`)."""
        if self._error is not None:
            raise self._error
        if self._done:
            return True
        xfer = self._xfer
        assert xfer is not None  # not done, so the transfer is still held
        try:
            state = xfer.spin(spin_s) if spin_s > 0 else xfer.state()
        except LLMException as exc:
            self._failed(exc)
        if state == "DONE":
            self._done = True
            self._release()
        return self._done

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until complete, at most ``timeout_s`` (default: the call's timeout).

        Raises
        ------
        LLMException
            TIMEOUT (the handle is released), NOT_YET_LINK (the peer went away), FAILED;
            PARAM_INVALID: ``timeout_s`` is not a number > 0 (nothing waited for).
        """
        timeout = self.timeout_s if timeout_s is None else seconds("timeout_s", timeout_s)
        # A small push is complete within the first POLL_SPIN_S, checked without a pause.
        self._wait(timeout, min(POLL_SPIN_S, timeout), time.monotonic())

    def _wait(self, timeout: float, spin_s: float, start: float) -> None:
        """:meth:`wait` from ``start`` (a monotonic time), the first ``spin_s`` checked
        without a pause. The small-push path passes 0 and the time its own spin began:
        a second spin would take the CPU from the progress threads."""
        if self._check(spin_s):
            return
        next_probe = start + PROBE_EVERY_S
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
                next_probe = now + PROBE_EVERY_S
                if not self._dd._peer_alive(self._peer):
                    self._fail(
                        LLMException(
                            LLMStatus.NOT_YET_LINK,
                            f"cluster {self._peer.cluster_id} went away during "
                            f"transfer {self.tag!r}",
                        )
                    )
            _poll_sleep(start)
