"""The small-push path of ``push_kv_blocks`` (docs/DATADIST.md, "Performance"): a
repeated request of host memory is posted and checked for the first POLL_SPIN_S without a
TransferHandle. What it does when the transfer outlasts that spin, fails in it, times out,
is interrupted or meets a transfer in flight must be what the general path does: the
same statuses, the claim on the destination blocks released, the NIXL handle kept only
after a success, the destination told of a failure. NIXL's status call is replaced after
the plan is kept, so that each outcome happens at a chosen point of the spin.

Each test runs on both implementations of the path (docs/DATADIST.md decision 15): the C
one (``plugins/python/smallpush.c``; a test that it never took a push fails) and the
Python one it mirrors; and the two are compared request by request at the end."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import time

import numpy as np
import pytest

from pytrt_kv import _lib
from pytrt_kv.datadist import (
    CacheDesc,
    CacheIndex,
    LlmDataDist,
    LLMException,
    LLMStatus,
    llm_datadist,
    smallpush,
)
from pytrt_kv.datadist.handles import POLL_SPIN_S
from support.datadist import NIXL_ONLY

pytestmark = NIXL_ONLY

#: The C small-push module as this package loads it (None: not built here).
C_PATH = smallpush.load()
NOT_BUILT = (
    "the C small-push path is not built in this checkout (pytrt_kv/datadist/_smallpush*.so; "
    "an installed package has it: see test_the_c_path_is_loaded_where_it_was_built)"
)


class Spy:
    """The C module, counting the pushes it took (returned a tag or raised) and the
    requests it left to the Python path (returned None)."""

    def __init__(self, module):
        self.module, self.taken, self.left = module, 0, 0

    def push(self, *args):
        try:
            out = self.module.push(*args)
        except BaseException:
            self.taken += 1
            raise
        if out is None:
            self.left += 1
        else:
            self.taken += 1
        return out


@pytest.fixture(params=["c", "python"])
def path(request, monkeypatch):
    """Which small-push path the nodes take: the C one (a Spy; the test fails if it took
    no push), or the Python one."""
    if request.param == "python":
        monkeypatch.setattr(llm_datadist, "_smallpush", None)
        yield None
        return
    if C_PATH is None:
        pytest.skip(NOT_BUILT)
    spy = Spy(C_PATH)
    monkeypatch.setattr(llm_datadist, "_smallpush", spy)
    yield spy
    assert spy.taken > 0, "the C path took no push: the test ran the Python path only"


@contextlib.contextmanager
def _kept_plan():
    """A prompt and a decoder node linked over NIXL, and a kept 1-block plan: the first
    push checked it (the general path); the next equal push takes the small-push path."""
    p = LlmDataDist(1, "prompt", backend="nixl", options={"timeout_s": 10.0})
    d = LlmDataDist(2, "decoder", backend="nixl", options={"timeout_s": 10.0})
    p.initialize("127.0.0.1", 0)
    d.initialize("127.0.0.1", 0)
    try:
        src = p.allocate_cache(CacheDesc(2, (4, 16), "int32"))
        dst = d.allocate_cache(CacheDesc(2, (4, 16), "int32"))
        src.tensors[0][...] = np.arange(64, dtype=np.int32).reshape(4, 16)
        src.tensors[1][...] = -src.tensors[0]
        assert [r.ok for r in p.link_clusters([d.listen_address], timeout_s=5)] == [True]
        index = CacheIndex(2, dst.cache_id)
        d.wait_received(p.push_kv_blocks(src, index, [1], [2]), 5)
        assert len(p._plans) == 1
        yield p, d, src, dst, index
    finally:
        p.finalize()
        d.finalize()


@pytest.fixture
def kept(path):
    """:func:`_kept_plan`, on the small-push path ``path`` chose."""
    with _kept_plan() as k:
        yield k


class Status:
    """NIXL's post and status calls, replaced: the post really posts (``fake`` False) or
    posts nothing (True: nothing moves, the decoder gets no tag); the status is IN_PROG
    until ``busy_s`` after the post (forever if None), then ``then``: an exception to
    raise, a status code, or (None) the real call."""

    def __init__(self, monkeypatch, t, busy_s=None, then=None, fake=False):
        self.real, self.done, self.proc = t._status
        self.busy_s, self.then, self.calls = busy_s, then, []
        monkeypatch.setattr(t, "_status", (self, self.done, self.proc))
        post = t._post

        def posted(h, notif):
            self.t0 = time.monotonic()
            if not fake:
                st = post(h, notif)
                if st not in (self.done, self.proc):
                    return st
            return self.proc

        monkeypatch.setattr(t, "_post", posted)

    def __call__(self, h):
        now = time.monotonic()
        self.calls.append(now)
        if self.busy_s is None or now - self.t0 < self.busy_s:
            return self.proc
        if self.then is None:
            return self.real(h)
        if isinstance(self.then, BaseException):
            raise self.then
        return self.then


def _idle(p):
    return [len(e.handles) for e in p._transport._idle.values()]


def _released(p, monkeypatch):
    t, calls = p._transport, []
    real = t.agent.release_xfer_handle
    monkeypatch.setattr(t.agent, "release_xfer_handle", lambda h: calls.append(h) or real(h))
    return calls


def test_a_push_that_outlasts_the_spin_completes_and_polls_without_spinning(kept, monkeypatch):
    """Complete 20 ms after the post: the call waits (the handle's polling, with pauses:
    no second spin), returns the tag, the blocks arrive, the claim is released and the
    NIXL handle kept for the next post."""
    p, d, src, dst, index = kept
    s = Status(monkeypatch, p._transport, busy_s=0.02)
    tag = p.push_kv_blocks(src, index, [1], [2], tag="slow")
    d.wait_received(tag, 5)
    assert tag == "slow" and time.monotonic() - s.t0 >= 0.02
    assert (dst.tensors[0][2] == src.tensors[0][1]).all()
    assert len(p._writes) == 0 and _idle(p) == [1]
    # Checked without a pause (gaps of a few us) for at most POLL_SPIN_S in all (less if
    # the thread was preempted meanwhile), then paced by POLL_INTERVAL_S sleeps (each
    # >= 50 us): the handle's wait does not spin again (that doubles the sum).
    gaps = np.diff(s.calls)
    spun = gaps[gaps < 20e-6].sum()
    assert 0.1 * POLL_SPIN_S < spun < 1.5 * POLL_SPIN_S, spun
    assert (gaps >= 20e-6).sum() >= 10  # the 20 ms were waited with pauses
    assert p.push_kv_blocks(src, index, [1], [2]) and _idle(p) == [1]


@pytest.mark.parametrize(
    "failure",
    ["status code", "exception in the spin", "exception after the spin"],
)
def test_a_push_that_fails_is_failed_released_and_told(kept, monkeypatch, failure):
    """NIXL reports an error, or its status call raises, within the spin or after it: the
    push raises FAILED (not a bare exception), the claim is released, the failed NIXL
    handle is released (never kept), the decoder learns the tag failed, and the next push
    works."""
    p, d, src, dst, index = kept
    released = _released(p, monkeypatch)
    b = p._transport._b
    then = b.NIXL_ERR_BACKEND if failure == "status code" else RuntimeError("injected")
    busy = 0.005 if failure == "exception after the spin" else 0.0
    Status(monkeypatch, p._transport, busy_s=busy, then=then, fake=True)
    with pytest.raises(LLMException) as info:
        p.push_kv_blocks(src, index, [1], [2], tag="bad")
    assert info.value.status is LLMStatus.FAILED, info.value
    assert len(p._writes) == 0 and len(released) == 1 and _idle(p) == [0]
    with pytest.raises(LLMException) as told:
        d.wait_received("bad", 5)
    assert told.value.status is LLMStatus.FAILED and "source" in str(told.value)
    monkeypatch.undo()
    dst.tensors[0][...] = 0
    d.wait_received(p.push_kv_blocks(src, index, [1], [2], tag="after"), 5)
    assert (dst.tensors[0][2] == src.tensors[0][1]).all() and _idle(p) == [1]


def test_a_push_that_times_out_is_released_and_told(kept, monkeypatch):
    """Never complete: TIMEOUT after the call's timeout (counted from the post, the spin
    included), the handle released, the claim released, the decoder told."""
    p, d, src, dst, index = kept
    released = _released(p, monkeypatch)
    s = Status(monkeypatch, p._transport, fake=True)
    with pytest.raises(LLMException) as info:
        p.push_kv_blocks(src, index, [1], [2], tag="late", timeout_s=0.05)
    waited = time.monotonic() - s.t0
    assert info.value.status is LLMStatus.TIMEOUT and 0.05 <= waited < 1.0, waited
    assert len(p._writes) == 0 and len(released) == 1 and _idle(p) == [0]
    with pytest.raises(LLMException) as told:
        d.wait_received("late", 5)
    assert told.value.status is LLMStatus.TIMEOUT


def test_a_push_interrupted_in_its_spin_releases_its_blocks_and_handle(kept, monkeypatch):
    """A KeyboardInterrupt inside the spin propagates; nothing stays claimed or held:
    the same push then works."""
    p, d, src, dst, index = kept
    released = _released(p, monkeypatch)
    Status(monkeypatch, p._transport, busy_s=0.0, then=KeyboardInterrupt(), fake=True)
    with pytest.raises(KeyboardInterrupt):
        p.push_kv_blocks(src, index, [1], [2])
    assert len(p._writes) == 0 and len(released) == 1 and _idle(p) == [0]
    monkeypatch.undo()
    d.wait_received(p.push_kv_blocks(src, index, [1], [2], tag="after"), 5)
    assert _idle(p) == [1]


def test_a_push_into_blocks_in_flight_is_refused_before_its_post(kept, monkeypatch):
    """While an asynchronous push of the same request is in flight, the small-push path
    refuses REPEAT_REQUEST and posts nothing (docs/SPEC.md D8); once that one is done,
    the push goes."""
    p, d, src, dst, index = kept
    s = Status(monkeypatch, p._transport, busy_s=0.3)
    first = p.push_kv_blocks_async(src, index, [1], [2], tag="first")
    t0 = s.t0
    with pytest.raises(LLMException) as info:
        p.push_kv_blocks(src, index, [1], [2], tag="second")
    assert info.value.status is LLMStatus.REPEAT_REQUEST and s.t0 == t0  # nothing posted
    assert len(p._writes) == 1
    first.wait(5)
    d.wait_received("first", 5)
    assert not d.received("second")
    d.wait_received(p.push_kv_blocks(src, index, [1], [2], tag="third"), 5)
    assert len(p._writes) == 0


def test_the_c_path_is_loaded_where_it_was_built():
    """An install whose build made the C module (build_info.json) loads it: a build that
    made it and a package that silently runs the Python path would pass every test
    above in its "python" half only."""
    if os.environ.get(smallpush.ENV, "").strip() == "0":
        pytest.skip(f"{smallpush.ENV}=0 turns the C path off in this run")
    info = _lib.build_info()
    if info.get("datadist_smallpush") != "ON":
        pytest.skip(f"this build did not make the C small-push path (build_info: {info})")
    assert importlib.util.find_spec("pytrt_kv.datadist._smallpush") is not None
    assert C_PATH is not None and llm_datadist._smallpush is C_PATH


def _outcome(p, d, dst, call):
    """What a push gives: ("ok", tag, the destination's bytes) or ("raised", the error's
    type, status and message)."""
    for t in dst.tensors:  # none once deallocated
        t[...] = -1
    try:
        tag = call()
    except LLMException as exc:
        return ("raised", "LLMException", exc.status, str(exc))
    except Exception as exc:
        return ("raised", type(exc).__name__, None, str(exc))
    d.wait_received(tag, 5)
    return ("ok", tag, b"".join(t.tobytes() for t in dst.tensors))


def _requests(p, d, src, dst):
    """Requests after a 1-block plan is kept: the kept one, and the ones beside it that
    the C path must hand to the Python path, or answer as it does."""
    index = CacheIndex(2, dst.cache_id)
    ids = np.array([1]), np.array([2])

    def push(*args, **kwargs):
        return lambda: p.push_kv_blocks(*args, **kwargs)

    yield push(src, index, *ids)
    yield push(src, index, *ids, tag="mine")
    for tag in ("", 5, b"t", "a\udc80"):
        yield push(src, index, *ids, tag=tag)
    for t in (None, 2, 2.5, 10**400, float("inf"), 0, -1.0, float("nan"), True, "1"):
        yield push(src, index, *ids, timeout_s=t)
    for s_ids in ([1], (1,), np.array([1], np.int32), np.array([[1]]), np.array([1.0])):
        yield push(src, index, s_ids, [2])
    yield push(src, index, [1, 3], [2, 0])  # another plan, kept on its first push
    yield push(src, index, [1, 3], [2, 0])
    yield push(src, CacheIndex(2, dst.cache_id, 0), *ids)  # an equal index, another object
    yield push(src, CacheIndex(2, 99), *ids)
    yield push(src, (2, dst.cache_id), *ids)
    yield push(dst, index, *ids)  # the decoder's cache as the source
    yield push(src, index, *ids)
    d.deallocate_cache(dst)  # the kept plan's destination goes
    yield push(src, index, *ids)


def test_the_c_and_python_paths_answer_every_request_alike(monkeypatch):
    """The same requests, in the same order, on two fresh node pairs, one on each path:
    the same tags (the C path takes the tag counter's numbers in the same order), the same
    destination bytes, the same errors with the same messages."""
    if C_PATH is None:
        pytest.skip(NOT_BUILT)
    answers, spy = {}, Spy(C_PATH)
    for name, module in (("python", None), ("c", spy)):
        monkeypatch.setattr(llm_datadist, "_smallpush", module)
        with _kept_plan() as (p, d, src, dst, _):
            answers[name] = [_outcome(p, d, dst, call) for call in _requests(p, d, src, dst)]
    for i, (py, c) in enumerate(zip(answers["python"], answers["c"])):
        assert py == c, (i, py, c)
    kinds = [a[0] for a in answers["c"]]
    assert kinds.count("ok") >= 8 and kinds.count("raised") >= 8, answers["c"]
    assert spy.taken >= 8 and spy.left >= 8, (spy.taken, spy.left)
