"""LlmDataDist on both backends (docs/SPEC.md D): equal to the NumPy reference on random
caches, refused calls move nothing, and the protocol (links, unlink, stale caches,
timeouts, tags). Two nodes live in this process, linked over 127.0.0.1; the NIXL tests
skip only where ``import nixl`` fails (CI installs it)."""

from __future__ import annotations

import dataclasses
import importlib.abc
import subprocess
import sys
import time

import ml_dtypes
import numpy as np
import pytest

from pytrt_kv.datadist import (
    CacheDesc,
    CacheIndex,
    KvCacheExtParam,
    LinkResult,
    LlmDataDist,
    LLMException,
    LLMParamInvalid,
    LLMStatus,
    links,
    llm_datadist,
    nixl_unavailable_reason,
    plans,
    push_kv_blocks_reference,
    transport,
)
from support.datadist import BACKENDS, NIXL_ONLY
from support.datadist_faults import deaf_to_drops

DTYPES = [np.float16, ml_dtypes.bfloat16, np.int8, np.int32]
SENTINEL = 99
#: One tensor per layer (the caches below with num_tensors 1).
ONE = KvCacheExtParam(tensor_num_per_layer=1)


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint8)


def _same(xs, ys):
    return all(_bits(x).tobytes() == _bits(y).tobytes() for x, y in zip(xs, ys))


def _fill(cache, rng):
    for t in cache.tensors:
        if t.dtype.kind in "iu":
            t[...] = rng.integers(-120, 120, t.shape)
        else:
            t[...] = rng.standard_normal(t.shape)


def _sentinel(cache):
    for t in cache.tensors:
        t[...] = SENTINEL


def _snapshot(cache):
    return [t.copy() for t in cache.tensors]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture
def nodes(backend):
    p = LlmDataDist(1, "prompt", backend=backend, options={"timeout_s": 10.0})
    d = LlmDataDist(2, "decoder", backend=backend, options={"timeout_s": 10.0})
    p.initialize("127.0.0.1", 0)
    d.initialize("127.0.0.1", 0)
    yield p, d
    p.finalize()
    d.finalize()


def _linked(nodes):
    p, d = nodes
    assert p.link_clusters([d.listen_address], timeout_s=5) == [
        LinkResult(LLMStatus.SUCCESS, 2, "")
    ]
    assert d.linked_clusters() == [1]
    return p, d


# --- equal to the reference ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
def test_push_equals_reference_on_random_caches(nodes, dtype):
    p, d = _linked(nodes)
    rng = np.random.default_rng(np.dtype(dtype).itemsize)
    for trial in range(4):
        tnpl = int(rng.integers(1, 3))
        s_layers, d_layers = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        row = tuple(int(v) for v in rng.integers(1, 6, size=int(rng.integers(1, 3))))
        src = p.allocate_cache(CacheDesc(s_layers * tnpl, (int(rng.integers(3, 12)),) + row, dtype))
        dst = d.allocate_cache(CacheDesc(d_layers * tnpl, (int(rng.integers(3, 12)),) + row, dtype))
        _fill(src, rng)
        _sentinel(dst)
        n_layers = int(rng.integers(1, min(s_layers, d_layers) + 1))
        f = int(rng.integers(0, s_layers - n_layers + 1))
        g = int(rng.integers(0, d_layers - n_layers + 1))
        ext = KvCacheExtParam((f, f + n_layers - 1), (g, g + n_layers - 1), tnpl)
        n = int(rng.integers(0, dst.cache_desc.num_blocks + 1))
        db = rng.permutation(dst.cache_desc.num_blocks)[:n]
        if trial % 2:  # runs consecutive on both sides (merged into larger copies)
            db = np.arange(n) + int(rng.integers(0, dst.cache_desc.num_blocks - n + 1))
            sb = (np.arange(n) + int(rng.integers(0, 2))) % src.cache_desc.num_blocks
        else:
            sb = rng.integers(0, src.cache_desc.num_blocks, n)
        before = _snapshot(dst)
        expected = push_kv_blocks_reference(_snapshot(src), before, sb.tolist(), db.tolist(), ext)
        tag = p.push_kv_blocks(
            src, CacheIndex(2, dst.cache_id), sb.tolist(), db.tolist(), ext, tag=f"t{trial}"
        )
        d.wait_received(tag, timeout_s=5)
        assert _same(dst.tensors, expected), f"trial {trial}"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
def test_pull_equals_reference(nodes, dtype):
    p, d = _linked(nodes)
    rng = np.random.default_rng(7)
    src = p.allocate_cache(CacheDesc(4, (10, 3, 8), dtype))
    dst = d.allocate_cache(CacheDesc(6, (7, 24), dtype))  # same block bytes, other shape
    _fill(src, rng)
    _sentinel(dst)
    ext = KvCacheExtParam((1, 1), (2, 2), 2)
    sb, db = [9, 0, 1, 2, 9], [6, 0, 1, 2, 3]
    expected = push_kv_blocks_reference(_snapshot(src), _snapshot(dst), sb, db, ext)
    tag = d.pull_kv_blocks(CacheIndex(1, src.cache_id), dst, sb, db, ext)
    assert _same(dst.tensors, expected)
    p.wait_received(tag, timeout_s=5)  # the source learns its blocks were read


def test_register_numpy_and_torch_tensors(nodes):
    p, d = _linked(nodes)
    rng = np.random.default_rng(3)
    desc = CacheDesc(2, (6, 4, 8), "bfloat16")
    mine = [rng.standard_normal((6, 4, 8)).astype(ml_dtypes.bfloat16) for _ in range(2)]
    src = p.register_cache(desc, mine)
    assert src.tensors[0] is mine[0]
    torch = pytest.importorskip("torch", reason="torch not installed (PYTRT_KV_TEST_TORCH=0)")
    theirs = [torch.full((6, 4, 8), 5.0, dtype=torch.bfloat16) for _ in range(2)]
    dst = d.register_cache(desc, theirs)
    p.push_kv_blocks(src, CacheIndex(2, dst.cache_id), [5, 0], [1, 4])
    got = theirs[1].view(torch.int16).numpy()
    assert (got[1] == mine[1][5].view(np.int16)).all()
    assert (got[4] == mine[1][0].view(np.int16)).all()
    assert (got[[0, 2, 3, 5]] == np.array(5.0, ml_dtypes.bfloat16).view(np.int16)).all()


@pytest.mark.parametrize(
    "tensors, exc, match",
    [
        (lambda: [np.zeros((6, 8), np.float16)], ValueError, "expected 2 tensors"),
        (
            lambda: [np.zeros((6, 8), np.float16), np.zeros((6, 9), np.float16)],
            ValueError,
            r"tensors\[1\]: expected shape \[6, 8\]",
        ),
        (
            lambda: [np.zeros((6, 8), np.float16), np.zeros((6, 8), np.float32)],
            ValueError,
            r"tensors\[1\]: expected dtype float16",
        ),
        (
            lambda: [np.zeros((6, 8), np.float16), np.zeros((8, 6), np.float16).T],
            ValueError,
            "C-contiguous",
        ),
        (lambda: (lambda a: [a[0], a[0]])(np.zeros((2, 6, 8), np.float16)), ValueError, "overlap"),
        (lambda: [np.zeros((6, 8), np.float16), "x"], TypeError, r"tensors\[1\]"),
        (lambda: [np.zeros((6, 8), np.float16), 0], ValueError, "non-null"),
    ],
)
def test_register_refusals(nodes, tensors, exc, match):
    p, _ = nodes
    with pytest.raises(exc, match=match):
        p.register_cache(CacheDesc(2, (6, 8), "float16"), tensors())


def test_register_host_array_as_device_refused(nodes):
    p, _ = nodes
    with pytest.raises(TypeError, match="expected device memory"):
        p.register_cache(CacheDesc(1, (6, 8), "float16", "device"), [np.zeros((6, 8), np.float16)])


# --- refused calls move nothing ------------------------------------------------------------

REFUSALS = [
    (dict(ext_param=KvCacheExtParam(tensor_num_per_layer=3)), "tensor_num_per_layer"),
    (dict(ext_param=KvCacheExtParam(tensor_num_per_layer=0)), "tensor_num_per_layer"),
    (dict(ext_param=KvCacheExtParam((0, 2), (0, 2))), "src_layer_range"),
    (dict(ext_param=KvCacheExtParam((0, 0), (0, 1))), "as many layers"),
    (dict(src_blocks=[0, 1], dst_blocks=[0]), "dst_blocks"),
    (dict(src_blocks=[8], dst_blocks=[0]), r"src_blocks\[0\]"),
    (dict(src_blocks=[0, 1], dst_blocks=[3, 3]), "more than once"),
    (dict(dst_index=lambda i: CacheIndex(2, i, batch_index=1)), "batch_index"),
    (dict(dst_index=lambda i: (2, i)), "CacheIndex"),
    (dict(tag=""), "tag"),
    (dict(tag="a\udc80"), "tag: expected a str that encodes as UTF-8"),  # a lone surrogate
]


@pytest.mark.parametrize("kw, match", REFUSALS)
def test_refused_push_transfers_nothing(nodes, kw, match):
    p, d = _linked(nodes)
    rng = np.random.default_rng(0)
    src = p.allocate_cache(CacheDesc(4, (8, 16), "int8"))
    dst = d.allocate_cache(CacheDesc(4, (4, 16), "int8"))
    _fill(src, rng)
    _sentinel(dst)
    index = kw.get("dst_index", lambda i: CacheIndex(2, i))(dst.cache_id)
    with pytest.raises(LLMParamInvalid, match=match) as info:
        p.push_kv_blocks(
            src,
            index,
            kw.get("src_blocks", [0, 1]),
            kw.get("dst_blocks", [2, 3]),
            kw.get("ext_param"),
            tag=kw.get("tag", "refused"),
        )
    assert info.value.status is LLMStatus.PARAM_INVALID
    time.sleep(0.05)
    assert all((t == SENTINEL).all() for t in dst.tensors)
    assert not d.received("refused")


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(data_type="uint8"), "data_type"),
        (dict(shape=(4, 17)), "block_bytes"),
    ],
)
def test_refused_mismatched_caches(nodes, kw, match):
    p, d = _linked(nodes)
    src = p.allocate_cache(CacheDesc(2, (4, 16), "int8"))
    dst = d.allocate_cache(CacheDesc(2, kw.get("shape", (4, 16)), kw.get("data_type", "int8")))
    _sentinel(dst)
    with pytest.raises(LLMParamInvalid, match=match):
        p.push_kv_blocks(src, CacheIndex(2, dst.cache_id), [0], [0])
    assert all((t == SENTINEL).all() for t in dst.tensors)


def test_roles(nodes):
    p, d = _linked(nodes)
    src = p.allocate_cache(CacheDesc(2, (4, 16), "int8"))
    dst = d.allocate_cache(CacheDesc(2, (4, 16), "int8"))
    with pytest.raises(LLMParamInvalid, match="push only from a prompt node"):
        d.push_kv_blocks(dst, CacheIndex(1, src.cache_id), [0], [0])
    with pytest.raises(LLMParamInvalid, match="pull only from a decoder node"):
        p.pull_kv_blocks(CacheIndex(2, dst.cache_id), src, [0], [0])


# --- protocol ------------------------------------------------------------------------------


def _pair(nodes, nb=4, desc=None, seed=5):
    """A source cache of random values on the prompt node and a destination of
    SENTINEL on the decoder, both ``desc`` (default 2 tensors of ``[nb, 16]`` int32)."""
    p, d = nodes
    desc = desc or CacheDesc(2, (nb, 16), "int32")
    src, dst = p.allocate_cache(desc), d.allocate_cache(desc)
    _fill(src, np.random.default_rng(seed))
    _sentinel(dst)
    return p, d, src, dst


def _status(fn):
    with pytest.raises(LLMException) as info:
        fn()
    return info.value.status


def test_no_link(nodes):
    p, d, src, dst = _pair(nodes)
    assert (
        _status(lambda: p.push_kv_blocks(src, CacheIndex(2, dst.cache_id), [0], [0]))
        is LLMStatus.NOT_YET_LINK
    )
    assert (
        _status(lambda: d.pull_kv_blocks(CacheIndex(1, src.cache_id), dst, [0], [0]))
        is LLMStatus.NOT_YET_LINK
    )
    assert _status(lambda: p.unlink_clusters([2])) is LLMStatus.NOT_YET_LINK


@pytest.mark.parametrize("side", ["initiator", "destination"])
def test_after_unlink(nodes, side):
    p, d, src, dst = _pair(nodes)
    _linked(nodes)
    p.push_kv_blocks(src, CacheIndex(2, dst.cache_id), [1], [1])
    (p.unlink_clusters([2]) if side == "initiator" else d.unlink_clusters([1]))
    assert p.linked_clusters() == [] and d.linked_clusters() == []
    _sentinel(dst)
    assert (
        _status(lambda: p.push_kv_blocks(src, CacheIndex(2, dst.cache_id), [0], [0]))
        is LLMStatus.NOT_YET_LINK
    )
    assert all((t == SENTINEL).all() for t in dst.tensors)
    # Linking again works.
    _linked(nodes)
    d.wait_received(p.push_kv_blocks(src, CacheIndex(2, dst.cache_id), [0], [0]), 5)
    assert (dst.tensors[1][0] == src.tensors[1][0]).all()


def test_unknown_and_deallocated_caches(nodes):
    p, d, src, dst = _pair(nodes)
    _linked(nodes)
    assert (
        _status(lambda: p.push_kv_blocks(src, CacheIndex(2, 999), [0], [0]))
        is LLMStatus.KV_CACHE_NOT_EXIST
    )
    p.deallocate_cache(src)
    assert (
        _status(lambda: p.push_kv_blocks(src, CacheIndex(2, dst.cache_id), [0], [0]))
        is LLMStatus.KV_CACHE_NOT_EXIST
    )
    assert _status(lambda: p.deallocate_cache(src)) is LLMStatus.KV_CACHE_NOT_EXIST


def test_stale_remote_cache(nodes):
    """The destination deallocates after the link: the initiator's view (id, generation)
    is dropped, so the push is refused rather than written into freed memory; a cache
    registered later gets a new id and generation and is found by asking the peer."""
    p, d, src, dst = _pair(nodes)
    _linked(nodes)
    p.push_kv_blocks(src, CacheIndex(2, dst.cache_id), [0], [0])
    old_id, old_gen = dst.cache_id, dst.generation
    d.deallocate_cache(dst)
    assert (
        _status(lambda: p.push_kv_blocks(src, CacheIndex(2, old_id), [1], [1]))
        is LLMStatus.KV_CACHE_NOT_EXIST
    )
    new = d.allocate_cache(CacheDesc(2, (4, 16), "int32"))
    _sentinel(new)
    assert (new.cache_id, new.generation) != (old_id, old_gen)
    d.wait_received(p.push_kv_blocks(src, CacheIndex(2, new.cache_id), [3], [2]), 5)
    assert (new.tensors[0][2] == src.tensors[0][3]).all()


def test_tag_of_a_transfer_into_a_replaced_cache_is_refused():
    """A transfer in flight while the destination deallocates its (caller-owned) cache:
    the destination's generation check reports it instead of the tag (docs/SPEC.md D5)."""
    p = LlmDataDist(1, "prompt", backend="local", options={"local.latency_s": 0.3})
    d = LlmDataDist(2, "decoder", backend="local")
    p.initialize()
    d.initialize()
    try:
        src = p.allocate_cache(CacheDesc(1, (2, 8), "int8"))
        mine = [np.zeros((2, 8), np.int8)]
        dst = d.register_cache(CacheDesc(1, (2, 8), "int8"), mine)
        p.link_clusters([d.listen_address])
        h = p.push_kv_blocks_async(src, CacheIndex(2, dst.cache_id), [0], [1], ONE, tag="late")
        d.deallocate_cache(dst)
        h.wait(timeout_s=5)
        with pytest.raises(LLMException) as info:
            d.wait_received("late", timeout_s=5)
        assert info.value.status is LLMStatus.KV_CACHE_NOT_EXIST
    finally:
        p.finalize()
        d.finalize()


class _PollClock:
    """The local transport's clock, one tick per reading: its transfer completes on a
    given poll instead of at a wall-clock time (no timing in a unit test,
    docs/ARCHITECTURE.md habit 8)."""

    def __init__(self):
        self.ticks = 0.0

    def monotonic(self):
        self.ticks += 1.0
        return self.ticks


def test_the_timeout_options_are_checked():
    """Issue 19 fault 4: the scaled default timeout's options refuse what cannot work."""
    for key, bad in [
        ("timeout_min_s", -1.0),
        ("timeout_floor_bytes_per_s", 0),
        ("timeout_floor_bytes_per_s", float("nan")),
        ("timeout_min_s", "5"),
    ]:
        with pytest.raises(ValueError, match=key):
            LlmDataDist(1, "prompt", backend="local", options={key: bad})


def test_a_probe_that_times_out_is_not_a_death_local(monkeypatch):
    """Issue 19 fault 2: while a transfer waits, the liveness probe of a peer whose control
    port does not answer in time (a paused process with a full accept backlog) counts it
    alive: the wait ends in TIMEOUT and the link stays; only a refused port is a death."""
    p = LlmDataDist(1, "prompt", backend="local", options={"local.latency_s": 1e6})
    d = LlmDataDist(2, "decoder", backend="local")
    p.initialize()
    d.initialize()
    real = links.socket.create_connection
    paused = {"on": True}

    def connect(address, *args, **kw):
        if paused["on"] and tuple(address) == d.listen_address:
            raise TimeoutError("timed out")
        return real(address, *args, **kw)

    try:
        src = p.allocate_cache(CacheDesc(1, (2, 8), "int8"))
        dst = d.allocate_cache(CacheDesc(1, (2, 8), "int8"))
        p.link_clusters([d.listen_address])
        monkeypatch.setattr(links.socket, "create_connection", connect)
        h = p.push_kv_blocks_async(src, CacheIndex(2, dst.cache_id), [0], [0], ONE)
        with pytest.raises(LLMException) as info:
            h.wait(timeout_s=3 * llm_datadist._PROBE_EVERY_S)  # probes at least twice
        assert info.value.status is LLMStatus.TIMEOUT, info.value
        paused["on"] = False
        assert p.linked_clusters() == [2] and not p._peers[2].broken
    finally:
        p.finalize()
        d.finalize()


def test_a_transport_disconnect_is_a_death_only_without_control_local(monkeypatch):
    """Issue 19 fault 4: the transport's disconnect (NOT_YET_LINK, NIXL's
    nixlRemoteDisconnectError) from a peer whose control port still answers is FAILED and
    keeps the link (posting or while in flight); once the control port refuses, it is
    NOT_YET_LINK and the link is broken."""

    class Gone(transport.Xfer):
        def state(self):
            raise LLMException(LLMStatus.NOT_YET_LINK, "the peer disconnected")

        def release(self):
            pass

    def refuse(*args, **kw):
        raise LLMException(LLMStatus.NOT_YET_LINK, "the peer disconnected")

    p = LlmDataDist(1, "prompt", backend="local")
    d = LlmDataDist(2, "decoder", backend="local")
    p.initialize()
    d.initialize()
    try:
        src = p.allocate_cache(CacheDesc(1, (2, 8), "int8"))
        dst = d.allocate_cache(CacheDesc(1, (2, 8), "int8"))
        p.link_clusters([d.listen_address])
        index = CacheIndex(2, dst.cache_id)
        monkeypatch.setattr(p._transport, "post", refuse)
        assert _status(lambda: p.push_kv_blocks(src, index, [0], [0], ONE)) is LLMStatus.FAILED
        monkeypatch.setattr(p._transport, "post", lambda *a, **k: Gone())
        h = p.push_kv_blocks_async(src, index, [0], [0], ONE, tag="gone")
        assert _status(h.wait) is LLMStatus.FAILED and not p._peers[2].broken
        assert _status(lambda: d.received("gone")) is LLMStatus.FAILED  # the notice
        d._server.close()  # as if d died: its control port refuses, no "bye" sent
        h = p.push_kv_blocks_async(src, index, [0], [0], ONE)
        assert _status(h.wait) is LLMStatus.NOT_YET_LINK and p._peers[2].broken
    finally:
        p.finalize()
        d.finalize()


def test_cancel_tells_the_destination_local():
    """Issue 19 fault 5: ``cancel()`` releases a pending transfer, copies nothing, and the
    destination's received() raises FAILED once; a second cancel() has nothing to do."""
    p = LlmDataDist(1, "prompt", backend="local", options={"local.latency_s": 1e6})
    d = LlmDataDist(2, "decoder", backend="local")
    p.initialize()
    d.initialize()
    try:
        src = p.allocate_cache(CacheDesc(1, (2, 8), "int8"))
        src.tensors[0][...] = 1
        dst = d.allocate_cache(CacheDesc(1, (2, 8), "int8"))
        _sentinel(dst)
        p.link_clusters([d.listen_address])
        h = p.push_kv_blocks_async(src, CacheIndex(2, dst.cache_id), [0], [0], ONE, tag="c|1")
        assert h.cancel() and h.released and not h.cancel()
        assert _status(h.done) is LLMStatus.FAILED
        assert _status(lambda: d.received("c|1")) is LLMStatus.FAILED
        assert not d.received("c|1") and (dst.tensors[0] == SENTINEL).all()
    finally:
        p.finalize()
        d.finalize()


def test_timeout_releases_the_handle_local(monkeypatch):
    # wait(timeout_s=T) sleeps at least POLL_INTERVAL_S between polls after its first
    # POLL_SPIN_S (a few hundred polls at most), so it polls at most about
    # T / POLL_INTERVAL_S + 1 times, fewer under load; the transfer completes only on the
    # 10x later poll, so a wait that outlived its timeout would see it done (no TIMEOUT).
    timeout = 0.05
    polls = timeout / llm_datadist.POLL_INTERVAL_S + 1
    monkeypatch.setattr(transport, "time", _PollClock())
    p = LlmDataDist(1, "prompt", backend="local", options={"local.latency_s": 10 * polls})
    d = LlmDataDist(2, "decoder", backend="local")
    p.initialize()
    d.initialize()
    try:
        src = p.allocate_cache(CacheDesc(1, (2, 8), "int8"))
        src.tensors[0][...] = 1
        dst = d.allocate_cache(CacheDesc(1, (2, 8), "int8"))
        _sentinel(dst)
        p.link_clusters([d.listen_address])
        h = p.push_kv_blocks_async(src, CacheIndex(2, dst.cache_id), [0], [0], ONE, tag="slow")
        with pytest.raises(LLMException) as info:
            h.wait(timeout_s=timeout)
        assert info.value.status is LLMStatus.TIMEOUT and h.released
        # Polled past its completion tick, the released handle still copies nothing.
        for _ in range(int(11 * polls)):
            assert _status(h.done) is LLMStatus.TIMEOUT
        assert (dst.tensors[0] == SENTINEL).all()
        # The destination hears of the failure (issue 19 fault 5), once.
        assert _status(lambda: d.received("slow")) is LLMStatus.TIMEOUT
        assert not d.received("slow")
    finally:
        p.finalize()
        d.finalize()


# The NIXL timeout needs a peer that stops answering: tests/test_datadist_processes.py.


def test_empty_lists_deliver_the_tag(nodes):
    """docs/SPEC.md D6: empty block lists post no transfer and still deliver the tag."""
    p, d, src, dst = _pair(nodes)
    _linked(nodes)
    tag = p.push_kv_blocks(src, CacheIndex(2, dst.cache_id), [], [], tag="nothing")
    assert tag == "nothing"
    d.wait_received("nothing", timeout_s=5)
    assert not d.received("nothing"), "a tag is reported once"
    assert all((t == SENTINEL).all() for t in dst.tensors)
    tag = d.pull_kv_blocks(CacheIndex(1, src.cache_id), dst, [], [])
    p.wait_received(tag, timeout_s=5)


def test_one_tensor_cache_needs_tensor_num_per_layer_1(nodes):
    """docs/SPEC.md D4: tnpl must divide num_tensors also with the default ranges, so a
    1-tensor cache with the default KvCacheExtParam (tnpl 2) is PARAM_INVALID, moves
    nothing and sends no tag; with KvCacheExtParam(tensor_num_per_layer=1) it moves."""
    p, d, src, dst = _pair(_linked(nodes), desc=CacheDesc(1, (6, 8), "int32"), seed=3)
    index = CacheIndex(2, dst.cache_id)
    for ext in (None, KvCacheExtParam()):
        with pytest.raises(LLMParamInvalid, match=r"tensor_num_per_layer: .*\[1, 1\], got 2"):
            p.push_kv_blocks(src, index, [5, 0], [1, 4], ext, tag="refused")
    assert not d.received("refused")
    assert all((t == SENTINEL).all() for t in dst.tensors)
    one = KvCacheExtParam(tensor_num_per_layer=1)
    d.wait_received(p.push_kv_blocks(src, index, [5, 0], [1, 4], one), 5)
    ref = push_kv_blocks_reference(
        _snapshot(src), [np.full((6, 8), SENTINEL, np.int32)], [5, 0], [1, 4], one
    )
    assert _same(dst.tensors, ref)


def test_a_repeated_request_reuses_its_checked_plan(nodes, monkeypatch):
    """A small request equal to an accepted one skips the D4 check (BENCHMARKS.md,
    "Small pushes"); any other request is still checked: the same ids as bools or
    floats, an id array changed in place, bool layer ranges are refused and move nothing,
    and a reused plan moves the source's current data."""
    p, d = _linked(nodes)
    src = p.allocate_cache(CacheDesc(4, (6, 8), "int32"))
    dst = d.allocate_cache(CacheDesc(4, (6, 8), "int32"))
    index = CacheIndex(2, dst.cache_id)
    calls = []
    check = plans.check_transfer
    monkeypatch.setattr(plans, "check_transfer", lambda *a, **k: calls.append(1) or check(*a, **k))
    ext = KvCacheExtParam((1, 1), (0, 0))
    ids = np.array([2, 3])
    rng = np.random.default_rng(4)
    for i in range(3):  # a list and a tuple of the same ints: one check; an array: one more
        _fill(src, rng)
        _sentinel(dst)
        sb = ([0, 5], (0, 5), np.array([0, 5]))[i]
        d.wait_received(p.push_kv_blocks(src, index, sb, ids, ext), 5)
        ref = push_kv_blocks_reference(
            _snapshot(src), [np.full((6, 8), SENTINEL, np.int32)] * 4, [0, 5], [2, 3], ext
        )
        assert _same(dst.tensors, ref), i
    assert len(calls) == 2
    listed = [0, 5]  # a list changed after the call: its kept plan saw a snapshot
    d.wait_received(p.push_kv_blocks(src, index, listed, ids, ext), 5)
    listed[1] = 6
    with pytest.raises(LLMParamInvalid, match=r"src_blocks\[1\]"):
        p.push_kv_blocks(src, index, listed, ids, ext, tag="refused")
    assert len(calls) == 3
    _sentinel(dst)
    refused = [
        (dict(sb=[False, True]), "src_blocks"),
        (dict(sb=[np.int64(0), 5.0]), "src_blocks"),
        (dict(sb=np.array([0.0, 5.0])), "src_blocks"),
        (dict(ext=KvCacheExtParam((True, True), (0, 0))), "src_layer_range"),
        (dict(ext=KvCacheExtParam((1, 1), (0, 0), 4)), "src_layer_range"),
        # equal indexes of other types (the kept key of an index is memoized per object)
        (dict(index=CacheIndex(2.0, dst.cache_id)), "cluster_id"),
        (dict(index=CacheIndex(2, float(dst.cache_id))), "cache_id"),
        (dict(index=CacheIndex(2, dst.cache_id, batch_index=1)), "batch_index"),
    ]
    refused.append(refused[-1])  # the same refused index object again
    for kw, match in refused:
        with pytest.raises(LLMParamInvalid, match=match):
            p.push_kv_blocks(
                src,
                kw.get("index", index),
                kw.get("sb", [0, 5]),
                ids,
                kw.get("ext", ext),
                tag="refused",
            )
    ids[1] = 2  # the accepted array, changed in place: now a duplicate
    with pytest.raises(LLMParamInvalid, match="more than once"):
        p.push_kv_blocks(src, index, [0, 5], ids, ext, tag="refused")
    time.sleep(0.05)
    assert not d.received("refused")
    assert all((t == SENTINEL).all() for t in dst.tensors)


@pytest.mark.parametrize("bad", ["1", float("nan"), 0, -1.0, True, [5]])
def test_a_bad_timeout_is_refused_by_name_and_moves_nothing(nodes, bad):
    """``timeout_s`` is a number of seconds > 0 (inf: no limit) on every path: a fresh
    request, a kept plan's (the small-push path), a pull, a handle's wait, a tag's wait
    and the options; refused by name before anything is posted or claimed. A control
    request's (link, unlink) is finite as well: a socket's timeout cannot be inf."""
    p, d, src, dst = _pair(_linked(nodes), desc=CacheDesc(1, (4, 16), "int8"), seed=1)
    index = CacheIndex(2, dst.cache_id)
    match = r"timeout_s: expected a number of seconds > 0 \(inf: no limit\), got"
    with pytest.raises(LLMParamInvalid, match=match):  # checked afresh
        p.push_kv_blocks(src, index, [0], [0], ONE, timeout_s=bad, tag="refused")
    for _ in range(2):  # kept, then taken from the kept plans
        d.wait_received(p.push_kv_blocks(src, index, [1], [1], ONE, timeout_s=float("inf")), 5)
    with pytest.raises(LLMParamInvalid, match=match):
        p.push_kv_blocks(src, index, [1], [1], ONE, timeout_s=bad, tag="refused")
    with pytest.raises(LLMParamInvalid, match=match):
        p.push_kv_blocks_async(src, index, [2], [2], ONE, timeout_s=bad, tag="refused")
    with pytest.raises(LLMParamInvalid, match=match):
        d.pull_kv_blocks(CacheIndex(1, src.cache_id), dst, [3], [3], ONE, timeout_s=bad)
    h = p.push_kv_blocks_async(src, index, [1], [1], ONE)
    with pytest.raises(LLMParamInvalid, match=match):
        h.wait(bad)
    h.wait()
    assert len(p._writes) == 0  # no claim left behind
    time.sleep(0.05)
    assert not d.received("refused")
    assert (dst.tensors[0][[0, 2, 3]] == SENTINEL).all()
    assert (dst.tensors[0][1] == src.tensors[0][1]).all()
    with pytest.raises(LLMParamInvalid, match=match):
        d.wait_received("never", timeout_s=bad)
    finite = r"timeout_s: expected a finite number of seconds > 0, got"
    for t in (bad, float("inf")):  # a socket's timeout cannot be inf
        with pytest.raises(LLMParamInvalid, match=finite):
            p.unlink_clusters([2], timeout_s=t)
        with pytest.raises(LLMParamInvalid, match=finite):
            p.link_clusters([d.listen_address], timeout_s=t)
    assert p.linked_clusters() == [2]
    for key in ("timeout_s", "wait_timeout_s", "control_timeout_s"):
        with pytest.raises(ValueError, match=rf"options\['{key}'\]: expected a"):
            LlmDataDist(3, "prompt", options={key: bad})
    with pytest.raises(ValueError, match=r"options\['control_timeout_s'\]: expected a fin"):
        LlmDataDist(3, "prompt", options={"control_timeout_s": float("inf")})


def test_a_local_peer_table_with_other_addresses_copies_nothing():
    """The local backend copies with memmove: a peer's cache table (from its metadata)
    that names addresses the peer did not register for that cache is refused at the
    post (FAILED), not copied to, for a push and a pull alike; NIXL checks the same by
    its registrations."""
    p = LlmDataDist(1, "prompt", backend="local")
    d = LlmDataDist(2, "decoder", backend="local")
    try:
        p.initialize("127.0.0.1", 0)
        d.initialize("127.0.0.1", 0)
        src = p.allocate_cache(CacheDesc(1, (4, 16), "int8"))
        dst = d.allocate_cache(CacheDesc(1, (4, 16), "int8"))
        assert p.link_clusters([d.listen_address], timeout_s=5)[0].ok
        _fill(src, np.random.default_rng(2))
        _sentinel(dst)
        victim = np.full((4, 16), 7, np.int8)  # memory nobody registered
        peer = p._peers[2]
        info = peer.caches[dst.cache_id]
        peer.caches[dst.cache_id] = dataclasses.replace(info, addrs=(victim.ctypes.data,))
        index = CacheIndex(2, dst.cache_id)
        assert _status(lambda: p.push_kv_blocks(src, index, [0], [1], ONE)) is LLMStatus.FAILED
        pulled = d.allocate_cache(CacheDesc(1, (4, 16), "int8"))
        _sentinel(pulled)
        dp = d._peers[1]
        sinfo = dp.caches[src.cache_id]
        dp.caches[src.cache_id] = dataclasses.replace(sinfo, addrs=(victim.ctypes.data,))
        pull = lambda: d.pull_kv_blocks(CacheIndex(1, src.cache_id), pulled, [0], [0], ONE)  # noqa: E731
        assert _status(pull) is LLMStatus.FAILED
        assert (victim == 7).all()
        assert (dst.tensors[0] == SENTINEL).all() and (pulled.tensors[0] == SENTINEL).all()
        peer.caches[dst.cache_id] = info  # the registered table again: copied
        d.wait_received(p.push_kv_blocks(src, index, [0], [1], ONE), 5)
        assert (dst.tensors[0][1] == src.tensors[0][0]).all()
    finally:
        p.finalize()
        d.finalize()


def test_a_kept_plan_is_not_used_for_another_nodes_cache(backend):
    """Cache ids are per node: a Cache of another node that has a kept plan's id is not
    this node's cache, and a request naming it is refused (KV_CACHE_NOT_EXIST), not
    posted from this node's cache of that id."""
    p = LlmDataDist(1, "prompt", backend=backend)
    other = LlmDataDist(3, "prompt", backend=backend)
    d = LlmDataDist(2, "decoder", backend=backend)
    try:
        for n in (p, other, d):
            n.initialize("127.0.0.1", 0)
        src = p.allocate_cache(CacheDesc(2, (8, 8), "int8"))
        foreign = other.allocate_cache(CacheDesc(2, (8, 8), "int8"))
        assert foreign.cache_id == src.cache_id
        dst = d.allocate_cache(CacheDesc(2, (8, 8), "int8"))
        assert p.link_clusters([d.listen_address], timeout_s=5)[0].ok
        index = CacheIndex(2, dst.cache_id)
        d.wait_received(p.push_kv_blocks(src, index, [0], [5]), 5)
        _sentinel(dst)
        assert _status(lambda: p.push_kv_blocks(dataclasses.replace(src), index, [0], [5])) is (
            LLMStatus.KV_CACHE_NOT_EXIST
        )
        assert _status(lambda: p.push_kv_blocks(foreign, index, [0], [5])) is (
            LLMStatus.KV_CACHE_NOT_EXIST
        )
        time.sleep(0.05)
        assert all((t == SENTINEL).all() for t in dst.tensors)
    finally:
        for n in (p, other, d):
            n.finalize()


def test_a_kept_plan_is_not_reused_for_a_relinked_peers_cache(backend):
    """A peer that restarts under the same cluster id reuses its cache ids: a plan kept
    for the old cache is not applied to the new one (here smaller: the id is refused)."""
    p = LlmDataDist(1, "prompt", backend=backend)
    d = LlmDataDist(2, "decoder", backend=backend)
    d2 = LlmDataDist(2, "decoder", backend=backend)
    try:
        for n in (p, d, d2):
            n.initialize("127.0.0.1", 0)
        src = p.allocate_cache(CacheDesc(2, (8, 8), "int8"))
        dst = d.allocate_cache(CacheDesc(2, (8, 8), "int8"))
        assert p.link_clusters([d.listen_address], timeout_s=5)[0].ok
        d.wait_received(p.push_kv_blocks(src, CacheIndex(2, dst.cache_id), [0], [5]), 5)
        d.finalize()
        new = d2.allocate_cache(CacheDesc(2, (4, 8), "int8"))
        assert new.cache_id == dst.cache_id
        _sentinel(new)
        assert p.link_clusters([d2.listen_address], timeout_s=5)[0].ok
        with pytest.raises(LLMParamInvalid, match=r"dst_blocks\[0\]"):
            p.push_kv_blocks(src, CacheIndex(2, new.cache_id), [0], [5], tag="refused")
        time.sleep(0.05)
        assert not d2.received("refused")
        assert all((t == SENTINEL).all() for t in new.tensors)
    finally:
        for n in (p, d, d2):
            n.finalize()


def test_a_deallocated_cache_leaves_no_plan_behind(nodes):
    """Plans kept for repeated requests do not keep a deallocated cache (and the memory it
    allocated) alive."""
    import gc
    import weakref

    p, d = _linked(nodes)
    src = p.allocate_cache(CacheDesc(2, (4, 8), "int8"))
    dst = d.allocate_cache(CacheDesc(2, (4, 8), "int8"))
    d.wait_received(p.push_kv_blocks(src, CacheIndex(2, dst.cache_id), [0], [1]), 5)
    ref = weakref.ref(src)
    p.deallocate_cache(src)
    del src
    gc.collect()
    assert ref() is None


@pytest.fixture
def nixl_nodes():
    p = LlmDataDist(1, "prompt", backend="nixl", options={"timeout_s": 10.0})
    d = LlmDataDist(2, "decoder", backend="nixl", options={"timeout_s": 10.0})
    p.initialize("127.0.0.1", 0)
    d.initialize("127.0.0.1", 0)
    yield p, d
    p.finalize()
    d.finalize()


def _count(monkeypatch, obj, name):
    calls = []
    fn = getattr(obj, name)
    monkeypatch.setattr(obj, name, lambda *a, **k: calls.append(1) or fn(*a, **k))
    return calls


@NIXL_ONLY
def test_a_repeated_request_posts_its_kept_nixl_transfer_again(nixl_nodes, monkeypatch):
    """Decision 13: a repeated small request posts the NIXL transfer prepared for its
    first post again. Each post moves the source's current data and delivers its own
    tag (not the first post's), a second post of it while the first is in flight is
    refused (it writes the same blocks), and a request with other blocks prepares its
    own."""
    p, d, src, dst = _pair(nixl_nodes, nb=8)
    _linked(nixl_nodes)
    t = p._transport
    made = _count(monkeypatch, t.agent, "make_prepped_xfer")
    index, rng = CacheIndex(2, dst.cache_id), np.random.default_rng(13)
    for i in range(4):
        _fill(src, rng)
        _sentinel(dst)
        tag = p.push_kv_blocks(src, index, [1, 6], [4, 0], tag=f"again-{i}")
        d.wait_received(tag, 5)
        want = push_kv_blocks_reference(
            _snapshot(src), [np.full((8, 16), SENTINEL, np.int32)] * 2, [1, 6], [4, 0]
        )
        assert _same(dst.tensors, want), i
    assert len(made) == 1
    assert [len(e.handles) for e in t._idle.values()] == [1]
    # Concurrent posts of the same request write the same blocks: the second is refused
    # while the first is in flight (docs/SPEC.md D8), nothing made or posted for it.
    first = p.push_kv_blocks_async(src, index, [1, 6], [4, 0])
    again = _status(lambda: p.push_kv_blocks_async(src, index, [1, 6], [4, 0]))
    assert again is LLMStatus.REPEAT_REQUEST
    first.wait(5)
    d.wait_received(first.tag, 5)
    assert len(made) == 1
    assert [len(e.handles) for e in t._idle.values()] == [1]
    d.wait_received(p.push_kv_blocks(src, index, [2], [3], tag="other"), 5)
    assert len(made) == 2 and len(t._idle) == 2
    assert (dst.tensors[1][3] == src.tensors[1][2]).all()


@NIXL_ONLY
def test_kept_nixl_transfers_go_with_their_caches_and_a_failed_one_is_not_kept(
    nixl_nodes, monkeypatch
):
    """A kept transfer is released when its remote cache goes (the next push to it is
    KV_CACHE_NOT_EXIST, nothing written), when its local cache is deallocated, and is
    never kept after a failed post."""
    p, d, src, dst = _pair(nixl_nodes, nb=8)
    _linked(nixl_nodes)
    t = p._transport
    released = _count(monkeypatch, t.agent, "release_xfer_handle")
    index = CacheIndex(2, dst.cache_id)
    d.wait_received(p.push_kv_blocks(src, index, [0], [1]), 5)
    assert len(t._idle) == 1 and not released
    d.deallocate_cache(dst)
    new = d.allocate_cache(CacheDesc(2, (8, 16), "int32"))
    _sentinel(new)
    assert _status(lambda: p.push_kv_blocks(src, index, [0], [1])) is LLMStatus.KV_CACHE_NOT_EXIST
    assert not t._idle and len(released) == 1
    index = CacheIndex(2, new.cache_id)
    d.wait_received(p.push_kv_blocks(src, index, [0], [1]), 5)
    assert (new.tensors[0][1] == src.tensors[0][0]).all()
    assert len(t._idle) == 1

    def refuse(*a, **k):
        raise RuntimeError("injected post failure")

    monkeypatch.setattr(t, "_post", refuse)
    assert _status(lambda: p.push_kv_blocks(src, index, [0], [1])) is LLMStatus.FAILED
    assert len(released) == 2 and [len(e.handles) for e in t._idle.values()] == [0]
    monkeypatch.undo()
    released = _count(monkeypatch, t.agent, "release_xfer_handle")
    d.wait_received(p.push_kv_blocks(src, index, [0], [1], tag="after"), 5)
    p.deallocate_cache(src)
    assert not t._idle and len(released) == 1


def test_a_repeated_pull_reuses_its_plan_and_reads_current_data(nodes, monkeypatch):
    """A pull repeated with equal arguments is checked once (decision 12), reads the
    source's current blocks each time and tells the source each tag; once the source
    cache is deallocated, the same pull is KV_CACHE_NOT_EXIST and moves nothing."""
    p, d, src, dst = _pair(nodes, nb=8)
    _linked(nodes)
    calls = _count(monkeypatch, plans, "check_transfer")
    index, rng = CacheIndex(1, src.cache_id), np.random.default_rng(21)
    for i in range(3):
        _fill(src, rng)
        _sentinel(dst)
        tag = d.pull_kv_blocks(index, dst, np.array([3, 0]), np.array([5, 7]), tag=f"pull-{i}")
        want = push_kv_blocks_reference(
            _snapshot(src), [np.full((8, 16), SENTINEL, np.int32)] * 2, [3, 0], [5, 7]
        )
        assert _same(dst.tensors, want), i
        p.wait_received(tag, 5)
    assert len(calls) == 1
    p.deallocate_cache(src)
    _sentinel(dst)
    pull = lambda: d.pull_kv_blocks(index, dst, np.array([3, 0]), np.array([5, 7]))  # noqa: E731
    assert _status(pull) is LLMStatus.KV_CACHE_NOT_EXIST
    assert all((t == SENTINEL).all() for t in dst.tensors)


@NIXL_ONLY
def test_a_plan_no_longer_kept_releases_its_nixl_transfers(nixl_nodes, monkeypatch):
    """The node keeps 256 plans; the oldest one's prepared transfers are released when a
    257th request is kept (decision 13), and its request is checked again."""
    p, d, src, dst = _pair(nixl_nodes, nb=17)
    _linked(nixl_nodes)
    t = p._transport
    released = _count(monkeypatch, t.agent, "release_xfer_handle")
    calls = _count(monkeypatch, plans, "check_transfer")
    index = CacheIndex(2, dst.cache_id)
    pairs = [(s, x) for s in range(16) for x in range(16)]  # 256 requests
    for s, x in pairs:
        p.push_kv_blocks(src, index, [s], [x])
    assert len(t._idle) == 256 and not released
    p.push_kv_blocks(src, index, [16], [16])
    assert len(t._idle) == 256 and len(released) == 1  # the first request's transfer
    p.push_kv_blocks(src, index, [0], [0])  # no longer kept: checked again
    assert len(calls) == 258 and len(released) == 2
    d.wait_received(p.push_kv_blocks(src, index, [16], [2], tag="last"), 5)
    assert (dst.tensors[1][2] == src.tensors[1][16]).all()


def test_async_handle_and_default_tags(nodes):
    p, d, src, dst = _pair(nodes, nb=64)
    _linked(nodes)
    handles = [
        p.push_kv_blocks_async(src, CacheIndex(2, dst.cache_id), [i], [63 - i]) for i in range(8)
    ]
    assert len({h.tag for h in handles}) == 8
    for h in handles:
        h.wait(timeout_s=5)
        assert h.done() and h.released
    for h in handles:
        d.wait_received(h.tag, timeout_s=5)
    assert all((dst.tensors[1][63 - i] == src.tensors[1][i]).all() for i in range(8))
    with pytest.raises(LLMException) as info:
        d.wait_received("never", timeout_s=0.05)
    assert info.value.status is LLMStatus.TIMEOUT


def test_link_results_per_cluster(backend):
    """Issue 19 item 8: link_clusters returns one LinkResult per cluster, in order (CANN's
    rets), and links the others when one fails: a refused port (FAILED at once, not waited
    out) and a node with this node's own cluster id (FAILED) beside a good peer."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    a = LlmDataDist(1, "prompt", backend=backend)
    a.initialize()
    b = LlmDataDist(1, "decoder", backend=backend)  # the same cluster id
    b.initialize()
    c = LlmDataDist(3, "decoder", backend=backend)
    c.initialize()
    try:
        results = a.link_clusters(
            [("127.0.0.1", port), b.listen_address, "{}:{}".format(*c.listen_address)], timeout_s=1
        )
        assert [r.status for r in results] == [
            LLMStatus.FAILED,
            LLMStatus.FAILED,
            LLMStatus.SUCCESS,
        ], results
        assert "Connection refused" in results[0].message
        assert "own cluster_id" in results[1].message
        assert [r.cluster_id for r in results] == [None, None, 3]
        assert [r.ok for r in results] == [False, False, True]
        assert a.linked_clusters() == [3] and c.linked_clusters() == [1]
        # Bad arguments are refused before anything is linked.
        with pytest.raises(TypeError, match=r"clusters\[1\]"):
            a.link_clusters([c.listen_address, 12])
    finally:
        for n in (a, b, c):
            n.finalize()


def test_argument_refusals():
    with pytest.raises(ValueError, match="backend"):
        LlmDataDist(1, "prompt", backend="tcp")
    with pytest.raises(TypeError, match="role"):
        LlmDataDist(1, "router", backend="local")
    with pytest.raises(ValueError, match="options"):
        LlmDataDist(1, "prompt", backend="local", options={"timeout": 1})
    with pytest.raises(TypeError, match="cluster_id"):
        LlmDataDist(-1, "prompt", backend="local")
    n = LlmDataDist(1, "prompt", backend="local")
    assert _status(lambda: n.allocate_cache(CacheDesc(1, (1, 1), "int8"))) is LLMStatus.FAILED
    n.finalize()  # never initialized: nothing to do


def test_local_metadata_lists_caches(nodes):
    import json

    p, _ = nodes
    c = p.allocate_cache(CacheDesc(2, (4, 16), "bfloat16"))
    md = json.loads(p.local_metadata())
    assert md["cluster_id"] == 1 and md["role"] == "prompt"
    assert md["caches"] == [
        {
            "cache_id": c.cache_id,
            "generation": c.generation,
            "desc": c.cache_desc.to_dict(),
            "addrs": list(c.tensor_addrs),
        }
    ]


def test_import_does_not_load_nixl():
    code = (
        "import sys, pytrt_kv, pytrt_kv.datadist\n"
        "from pytrt_kv.datadist import LlmDataDist\n"
        "n = LlmDataDist(1, 'prompt', backend='local'); n.initialize(); n.finalize()\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('nixl'))\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_device_source_stream_synchronized_before_the_post():
    """docs/SPEC.md D6: a device source's stream is synchronized before the post. (Device
    memory cannot be moved on this machine; the stream object records the call, and what
    follows it, the copy, may fail without a GPU.)"""
    events = []

    class Stream:
        def synchronize(self):
            events.append("synchronize")

    p = LlmDataDist(1, "prompt", backend="local")
    d = LlmDataDist(2, "decoder", backend="local")
    p.initialize()
    d.initialize()
    try:
        host = [np.zeros((4, 8), np.int8) for _ in range(2)]
        src = p.register_cache(
            CacheDesc(2, (4, 8), "int8", "device"), [int(a.ctypes.data) for a in host]
        )
        dst = d.allocate_cache(CacheDesc(2, (4, 8), "int8"))
        p.link_clusters([d.listen_address])
        try:
            p.push_kv_blocks(src, CacheIndex(2, dst.cache_id), [0], [0], stream=Stream())
        except Exception:  # noqa: BLE001 - no CUDA here: the copy itself may fail
            pass
        assert events == ["synchronize"]
        # A host source has no stream to wait for.
        events.clear()
        src_h = p.allocate_cache(CacheDesc(2, (4, 8), "int8"))
        p.push_kv_blocks(src_h, CacheIndex(2, dst.cache_id), [0], [0], stream=Stream())
        assert events == []
    finally:
        p.finalize()
        d.finalize()


def test_pushes_while_the_peer_changes_its_caches(nodes):
    """The control thread updates the initiator's view of the peer (a deallocation
    notice releases prepared remote lists) while the caller keeps pushing to another
    cache of that peer: every push lands, nothing crashes."""
    import threading

    p, d, src, dst = _pair(nodes, nb=16)
    _linked(nodes)
    errors = []
    stop = threading.Event()

    def churn():
        try:
            while not stop.is_set():
                extra = d.allocate_cache(CacheDesc(2, (16, 16), "int32"))
                p.push_kv_blocks(src, CacheIndex(2, extra.cache_id), [0], [0])
                d.deallocate_cache(extra)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=churn)
    t.start()
    try:
        rng = np.random.default_rng(9)
        for i in range(40):
            db = rng.permutation(16)[:5]
            sb = rng.integers(0, 16, 5)
            _sentinel(dst)
            d.wait_received(p.push_kv_blocks(src, CacheIndex(2, dst.cache_id), sb, db), 5)
            for u in range(2):
                assert (dst.tensors[u][db] == src.tensors[u][sb]).all(), i
    finally:
        stop.set()
        t.join(timeout=30)
    assert not t.is_alive() and not errors, errors


class _FakeCudaArray:
    """Anything with ``__cuda_array_interface__`` (CuPy, Numba, PyCUDA): read, never
    dereferenced, so no GPU is needed to register it."""

    def __init__(self, shape, typestr, ptr):
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (ptr, False),
            "strides": None,
            "version": 3,
        }


def test_register_cuda_array_interface_objects():
    n = LlmDataDist(1, "prompt", backend="local")
    n.initialize()
    try:
        desc = CacheDesc(2, (4, 8), "float16", "device")
        arrs = [_FakeCudaArray((4, 8), "<f2", 0x7F0000000000 + i * 4096) for i in range(2)]
        cache = n.register_cache(desc, arrs)
        assert cache.tensor_addrs == (0x7F0000000000, 0x7F0000001000)
        with pytest.raises(TypeError, match="expected host memory"):
            n.register_cache(CacheDesc(2, (4, 8), "float16"), arrs)
        with pytest.raises(ValueError, match=r"tensors\[0\]: expected shape"):
            n.register_cache(CacheDesc(2, (4, 9), "float16", "device"), arrs)
        with pytest.raises(ValueError, match="expected dtype"):
            n.register_cache(CacheDesc(2, (4, 8), "bfloat16", "device"), arrs)
        n.deallocate_cache(cache)
    finally:
        n.finalize()


def test_nixl_unavailable_reason_is_one_clean_line(monkeypatch):
    # A skip reason (and `pytrt-kv bench datadist`'s error) says why NIXL does not import,
    # on one line, without the LLMException status prefix ("FAILED: ...").
    class Broken(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "nixl" or name.startswith("nixl"):
                raise ImportError("libnixl.so: cannot open shared object file\n(second line)")

    for name in [m for m in sys.modules if m == "nixl" or m.startswith("nixl")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [Broken(), *sys.meta_path])
    reason = nixl_unavailable_reason()
    assert reason is not None and "\n" not in reason, reason
    assert not reason.startswith(LLMStatus.FAILED.name), reason
    assert "libnixl.so: cannot open shared object file (second line)" in reason
    assert "nixl==1.5.1" in reason


def test_unheard_deallocate_quarantines_the_memory(backend):
    """Issue 19 item 1 in one process: the decoder cannot tell the prompt node that a cache
    is gone, so it keeps the memory registered and refuses to register it again until the
    prompt node acknowledged (the notice also travels with the transfers): the prompt
    node's next push to it is KV_CACHE_NOT_EXIST, and then the memory is free again."""
    p = LlmDataDist(1, "prompt", backend=backend)
    d = LlmDataDist(2, "decoder", backend=backend, options={"control_timeout_s": 0.3})
    deaf_to_drops(p, 0.6)
    p.initialize()
    d.initialize()
    try:
        desc = CacheDesc(2, (4, 16), "int32")
        src = p.allocate_cache(desc)
        _fill(src, np.random.default_rng(2))
        arrays = [np.full(desc.shape, SENTINEL, np.int32) for _ in range(2)]
        dst = d.register_cache(desc, arrays)
        p.link_clusters([d.listen_address])
        d.wait_received(p.push_kv_blocks(src, CacheIndex(2, dst.cache_id), [0], [0]), 5)
        d.deallocate_cache(dst)  # the notice is lost
        assert d.quarantined_caches() == [dst.cache_id]
        with pytest.raises(ValueError, match=r"tensors\[0\].*not yet acknowledged by cluster"):
            d.register_cache(desc, arrays)
        # Over NIXL the notice may still be on its way: then the push goes into the
        # quarantined memory, which nothing else uses.
        deadline = time.monotonic() + 5
        while True:
            try:
                p.push_kv_blocks(src, CacheIndex(2, dst.cache_id), [1], [1])
            except LLMException as exc:
                assert exc.status is LLMStatus.KV_CACHE_NOT_EXIST, exc
                break
            assert backend == "nixl" and time.monotonic() < deadline
            time.sleep(0.01)
        for a in arrays:
            a[...] = SENTINEL
        deadline = time.monotonic() + 5
        while d.quarantined_caches() and time.monotonic() < deadline:
            time.sleep(0.01)  # the acknowledgement travels back with the data path
        assert d.quarantined_caches() == []
        again = d.register_cache(desc, arrays)
        d.wait_received(p.push_kv_blocks(src, CacheIndex(2, again.cache_id), [3], [2]), 5)
        assert (arrays[1][2] == src.tensors[1][3]).all()
    finally:
        p.finalize()
        d.finalize()


def test_quarantine_ends_when_the_peer_is_unlinked():
    """Issue 19 item 1: a peer that never acknowledges holds the memory only while it is
    linked."""
    p = LlmDataDist(1, "prompt", backend="local")
    d = LlmDataDist(2, "decoder", backend="local", options={"control_timeout_s": 0.3})
    deaf_to_drops(p, 0.6)
    p.initialize()
    d.initialize()
    try:
        desc = CacheDesc(1, (4, 16), "int32")
        dst = d.allocate_cache(desc)
        p.link_clusters([d.listen_address])
        d.deallocate_cache(dst)
        assert d.quarantined_caches() == [dst.cache_id] and dst.tensors
        d.unlink_clusters([1])
        assert d.quarantined_caches() == [] and dst.tensors == []
    finally:
        p.finalize()
        d.finalize()
