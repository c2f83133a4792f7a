"""Two processes over 127.0.0.1 with NIXL (docs/SPEC.md D5, D6): link, push, verify on the
destination, pull, then kill the destination and get NOT_YET_LINK within 1 s; a peer that
stops answering gives TIMEOUT with the handle released; the faults of issue 19 (a paused
peer, a link during a long push, the scaled timeout, failure notices; docs/DATADIST.md
"Failure semantics"); and the two-process example
(prefill pushes, decode runs the example decode step on the CPU runtime). Every wait is
bounded; a node that misbehaves is killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

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
    push_kv_blocks_reference,
)
from support.datadist_faults import deaf_to_drops
from support.datadist_procs import NIXL_SKIP, REPO, _env, _tensors, spawn_fixture  # noqa: F401

pytestmark = pytest.mark.skipif(NIXL_SKIP is not None, reason=str(NIXL_SKIP))
HERE = Path(__file__).resolve().parent
SENTINEL = 99


def test_push_pull_verify_then_kill_the_destination(spawn):
    desc = CacheDesc(4, (12, 3, 16), "bfloat16")
    dst_node = spawn("--cluster-id", "2", "--role", "decoder", "--cache", "4,12x3x16,bfloat16")
    p = LlmDataDist(1, "prompt", backend="nixl")
    p.initialize("127.0.0.1", 0)
    try:
        src = p.allocate_cache(CacheDesc(4, (20, 3, 16), "bfloat16"))
        rng = np.random.default_rng(11)
        for t in src.tensors:
            t[...] = rng.standard_normal(t.shape)
        assert p.link_clusters([tuple(dst_node.hello["addr"])], timeout_s=5) == [
            LinkResult(LLMStatus.SUCCESS, 2, "")
        ]
        index = CacheIndex(2, dst_node.hello["cache"])
        dst0 = [np.full(desc.shape, SENTINEL, desc.dtype) for _ in range(4)]

        ext = KvCacheExtParam((1, 1), (0, 0), 2)
        sb, db = [19, 0, 1, 2, 7, 7], [0, 5, 6, 7, 11, 1]
        tag = p.push_kv_blocks(src, index, sb, db, ext, tag="first")
        got = _tensors(dst_node.ask(cmd="read", tag=tag)["data"], desc)
        expected = push_kv_blocks_reference([t.copy() for t in src.tensors], dst0, sb, db, ext)
        assert all(
            a.view(np.uint16).tobytes() == b.view(np.uint16).tobytes()
            for a, b in zip(got, expected)
        )

        # The decoder pulls from the prompt node over the link the prompt node made.
        sb2, db2 = [3, 4, 5], [2, 3, 4]
        got = _tensors(
            dst_node.ask(cmd="pull", cluster=1, cache=src.cache_id, src=sb2, dst=db2)["data"], desc
        )
        expected = push_kv_blocks_reference([t.copy() for t in src.tensors], expected, sb2, db2)
        assert all(
            a.view(np.uint16).tobytes() == b.view(np.uint16).tobytes()
            for a, b in zip(got, expected)
        )

        dst_node.kill()
        # The dead peer is found by the liveness probe, not waited out: a push that sat
        # out its timeout would end in TIMEOUT (no timing here: docs/ARCHITECTURE.md
        # habit 8).
        with pytest.raises(LLMException) as info:
            p.push_kv_blocks(src, index, [0], [0], timeout_s=5)
        assert info.value.status is LLMStatus.NOT_YET_LINK, info.value
        with pytest.raises(LLMException) as info:  # and it stays so
            p.push_kv_blocks(src, index, [0], [0], timeout_s=5)
        assert info.value.status is LLMStatus.NOT_YET_LINK
    finally:
        p.finalize()


def test_timeout_with_a_stopped_peer_releases_the_handle(spawn, monkeypatch):
    """UCX over TCP to a stopped process: the socket buffers fill, the transfer stays in
    progress, and the push times out with its NIXL handle released."""
    # Read when each agent's UCX context is created; TCP over the loopback device only.
    ucx = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
    for k, v in ucx.items():
        monkeypatch.setenv(k, v)
    nb = 4096
    dst_node = spawn(
        "--cluster-id", "2", "--role", "decoder", "--cache", f"1,{nb}x8192,int8", env=_env(**ucx)
    )
    p = LlmDataDist(1, "prompt", backend="nixl")
    p.initialize("127.0.0.1", 0)
    try:
        src = p.allocate_cache(CacheDesc(1, (nb, 8192), "int8"))
        src.tensors[0][...] = 3
        p.link_clusters([tuple(dst_node.hello["addr"])], timeout_s=5)
        index = CacheIndex(2, dst_node.hello["cache"])
        one = KvCacheExtParam(tensor_num_per_layer=1)
        p.push_kv_blocks(src, index, [0], [0], one)  # connected and working
        os.kill(dst_node.proc.pid, signal.SIGSTOP)
        h = p.push_kv_blocks_async(src, index, np.arange(nb), np.arange(nb), one)
        with pytest.raises(LLMException) as info:
            h.wait(timeout_s=0.5)
        assert info.value.status is LLMStatus.TIMEOUT, info.value
        assert h.released
        assert p._transport.unreleased == [], "NIXL could not cancel the transfer"
    finally:
        os.kill(dst_node.proc.pid, signal.SIGCONT)
        p.finalize()


def test_unheard_deallocate_never_writes_the_new_cache(spawn):
    """Issue 19 item 1: the prompt node does not hear the decoder's deallocate notice; the
    decoder registers the same buffers again as a new cache (refused while the old memory
    is quarantined: then it allocates new memory) and the prompt node pushes to the old
    cache. The push is KV_CACHE_NOT_EXIST or NOT_YET_LINK, no byte of the new cache
    changes, and both nodes go on working."""
    desc = CacheDesc(2, (16, 4096), "int8")
    dst_node = spawn(
        "--cluster-id", "2", "--role", "decoder", "--cache", "2,16x4096,int8", "--register",
        "--options", json.dumps({"control_timeout_s": 0.5}),
    )  # fmt: skip
    p = LlmDataDist(1, "prompt", backend="nixl")
    deaf_to_drops(p, 1.0)
    p.initialize("127.0.0.1", 0)
    try:
        src = p.allocate_cache(desc)
        for i, t in enumerate(src.tensors):
            t[...] = np.arange(16, dtype=np.int8)[:, None] + 10 * i
        p.link_clusters([tuple(dst_node.hello["addr"])], timeout_s=5)
        old = CacheIndex(2, dst_node.hello["cache"])
        dst_node.ask(cmd="read", tag=p.push_kv_blocks(src, old, [0], [0]))
        new = dst_node.ask(cmd="realloc", timeout_s=20)
        assert new["cache"] != old.cache_id
        before = new["data"]
        deadline = time.monotonic() + 5
        while True:
            try:
                p.push_kv_blocks(src, old, np.arange(16), np.arange(16), timeout_s=5)
            except LLMException as exc:
                assert exc.status in (LLMStatus.KV_CACHE_NOT_EXIST, LLMStatus.NOT_YET_LINK), exc
                break
            # Posted before the notice (sent again with the data path) arrived: it went
            # into the quarantined old memory (docs/DATADIST.md, "Failure semantics").
            state = dst_node.ask(cmd="state")
            assert state["data"] == before, "the push to the old cache wrote into the new one"
            assert time.monotonic() < deadline, "the deallocate notice never arrived"
            time.sleep(0.01)
        state = dst_node.ask(cmd="state")
        assert state["data"] == before, "the push to the old cache wrote into the new one"
        # The decoder kept the old memory: registering it again was refused.
        assert "not yet acknowledged by cluster(s) [1]" in (new["refused"] or ""), new
        assert state["quarantined"] in ([], [old.cache_id])
        # Both nodes go on: a push to the new cache lands, and the old memory is released
        # once the prompt node's acknowledgement is back.
        index = CacheIndex(2, new["cache"])
        got = _tensors(
            dst_node.ask(cmd="read", tag=p.push_kv_blocks(src, index, [5], [9]))["data"], desc
        )
        dst0 = [np.full(desc.shape, SENTINEL, desc.dtype) for _ in range(2)]
        expected = push_kv_blocks_reference([t.copy() for t in src.tensors], dst0, [5], [9])
        assert all((a == b).all() for a, b in zip(got, expected))
        deadline = time.monotonic() + 5
        while state["quarantined"] and time.monotonic() < deadline:
            time.sleep(0.05)
            state = dst_node.ask(cmd="state")
        assert state["quarantined"] == []
    finally:
        p.finalize()


def _libc():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 3 + [ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def test_freed_source_memory_is_kv_cache_not_exist_and_keeps_the_link(spawn):
    """Issue 19 item 6: the caller unmaps the memory of a registered source cache and
    pushes from it. Not a link failure: KV_CACHE_NOT_EXIST naming the cache, nothing
    written, and the link still carries the next push."""
    import mmap

    desc = CacheDesc(2, (8, 4096), "int8")
    dst_node = spawn("--cluster-id", "2", "--role", "decoder", "--cache", "2,8x4096,int8")
    p = LlmDataDist(1, "prompt", backend="nixl")
    p.initialize("127.0.0.1", 0)
    libc = _libc()
    prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    addrs = [libc.mmap(None, desc.tensor_bytes, prot, flags, -1, 0) for _ in range(2)]
    try:
        assert all(a not in (None, 2**64 - 1) for a in addrs)
        freed = p.register_cache(desc, addrs)
        good = p.allocate_cache(desc)
        for t in good.tensors:
            t[...] = 5
        p.link_clusters([tuple(dst_node.hello["addr"])], timeout_s=5)
        index = CacheIndex(2, dst_node.hello["cache"])
        dst_node.ask(cmd="read", tag=p.push_kv_blocks(freed, index, [0], [0]))
        before = dst_node.ask(cmd="state")["data"]
        for a in addrs:
            assert libc.munmap(a, desc.tensor_bytes) == 0
        with pytest.raises(LLMException) as info:
            p.push_kv_blocks(freed, index, [1, 2], [1, 2], timeout_s=5)
        assert info.value.status is LLMStatus.KV_CACHE_NOT_EXIST, info.value
        assert "src_cache" in str(info.value) and "no longer mapped" in str(info.value)
        assert dst_node.ask(cmd="state")["data"] == before
        assert p.linked_clusters() == [2]
        got = _tensors(
            dst_node.ask(cmd="read", tag=p.push_kv_blocks(good, index, [3], [4]))["data"], desc
        )
        assert (got[0][4] == 5).all() and (got[1][4] == 5).all()
    finally:
        p.finalize()


def test_link_results_one_tensor_cache_and_empty_lists_deliver_the_tag(spawn):
    """Over two processes: one LinkResult per cluster (issue 19 item 8: a refused address
    beside a live node, the live one is linked); a 1-tensor cache is refused with the
    default KvCacheExtParam and pushed with tensor_num_per_layer=1 (docs/SPEC.md D4); an
    empty push delivers its tag and changes nothing (D6)."""
    import socket

    desc = CacheDesc(1, (8, 64), "float16")
    dst_node = spawn("--cluster-id", "2", "--role", "decoder", "--cache", "1,8x64,float16")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = s.getsockname()
    s.close()  # nothing listens there now
    p = LlmDataDist(1, "prompt", backend="nixl")
    p.initialize("127.0.0.1", 0)
    try:
        results = p.link_clusters([dead, tuple(dst_node.hello["addr"])], timeout_s=5)
        assert [(r.status, r.cluster_id) for r in results] == [
            (LLMStatus.FAILED, None),
            (LLMStatus.SUCCESS, 2),
        ], results
        src = p.allocate_cache(desc)
        src.tensors[0][...] = np.arange(8 * 64).reshape(8, 64)
        index = CacheIndex(2, dst_node.hello["cache"])
        with pytest.raises(LLMParamInvalid, match="tensor_num_per_layer"):
            p.push_kv_blocks(src, index, [7, 1], [0, 6])
        one = KvCacheExtParam(tensor_num_per_layer=1)
        got = _tensors(
            dst_node.ask(cmd="read", tag=p.push_kv_blocks(src, index, [7, 1], [0, 6], one))["data"],
            desc,
        )
        dst0 = [np.full(desc.shape, SENTINEL, desc.dtype)]
        expected = push_kv_blocks_reference([src.tensors[0].copy()], dst0, [7, 1], [0, 6], one)
        assert (got[0] == expected[0]).all()
        assert p.push_kv_blocks(src, index, [], [], one, tag="empty") == "empty"
        after = _tensors(dst_node.ask(cmd="read", tag="empty")["data"], desc)
        assert (after[0] == expected[0]).all()  # the tag arrived; nothing was written
    finally:
        p.finalize()


TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}


def _tcp(monkeypatch):
    """UCX over TCP on the loopback (read when each agent's UCX context is created): a
    stopped receiver leaves a large push in progress instead of finishing it by shm."""
    for k, v in TCP.items():
        monkeypatch.setenv(k, v)
    return _env(**TCP)


def _stop(node):
    """SIGSTOP a node and wait until it is stopped (the signal is asynchronous)."""
    os.kill(node.proc.pid, signal.SIGSTOP)
    for _ in range(1000):
        with open(f"/proc/{node.proc.pid}/stat") as f:
            if f.read().rpartition(")")[2].split()[0] in "Tt":
                return
        threading.Event().wait(0.005)
    raise AssertionError("the node did not stop")


def _ask_status(node, reply_s=10.0, **cmd):
    """A command's reply within ``reply_s``, errors included (``status`` names the
    LLMStatus)."""
    node.proc.stdin.write(json.dumps(cmd) + "\n")
    node.proc.stdin.flush()
    return node.reply(reply_s)


def test_a_paused_peer_times_out_and_the_link_recovers(spawn, monkeypatch):
    """Issue 19 fault 2: a decoder stopped for a moment gives TIMEOUT, not a broken link
    (a control request that times out, a transfer that times out), and after SIGCONT the
    same link pushes again without relinking."""
    nb = 2048
    dst = spawn(
        "--cluster-id", "2", "--role", "decoder", "--cache", f"1,{nb}x8192,int8",
        env=_tcp(monkeypatch),
    )  # fmt: skip
    p = LlmDataDist(1, "prompt", backend="nixl", options={"control_timeout_s": 0.3})
    p.initialize("127.0.0.1", 0)
    try:
        src = p.allocate_cache(CacheDesc(1, (nb, 8192), "int8"))
        src.tensors[0][...] = 7
        p.link_clusters([tuple(dst.hello["addr"])], timeout_s=5)
        one = KvCacheExtParam(tensor_num_per_layer=1)
        index = CacheIndex(2, dst.hello["cache"])
        p.push_kv_blocks(src, index, [0], [0], one)
        later = CacheIndex(2, dst.ask(cmd="alloc")["cache"])  # unknown to p until asked
        _stop(dst)
        # The cache table request times out: TIMEOUT, the link stays.
        with pytest.raises(LLMException) as info:
            p.push_kv_blocks(src, later, [0], [0], one, timeout_s=0.3)
        assert info.value.status is LLMStatus.TIMEOUT, info.value
        # A transfer that cannot finish while the peer is stopped: TIMEOUT.
        with pytest.raises(LLMException) as info:
            p.push_kv_blocks(src, index, np.arange(nb), np.arange(nb), one, timeout_s=0.5)
        assert info.value.status is LLMStatus.TIMEOUT, info.value
        assert p.linked_clusters() == [2]
        os.kill(dst.proc.pid, signal.SIGCONT)
        tag = p.push_kv_blocks(src, index, [1, 2], [5, 6], one, timeout_s=10, tag="resumed")
        got = _tensors(dst.ask(cmd="read", tag=tag)["data"], CacheDesc(1, (nb, 8192), "int8"))
        assert (got[0][[5, 6]] == 7).all()
        p.push_kv_blocks(src, later, [0], [0], one, timeout_s=10, tag="later")
        dst.ask(cmd="read", tag="later")
    finally:
        os.kill(dst.proc.pid, signal.SIGCONT)
        p.finalize()


def test_a_new_peer_links_while_a_long_push_is_posted(spawn):
    """Issue 19 fault 3: the control channel answers while the node's agent is busy
    posting a long push (shared memory: NIXL copies inside the post, ~0.3 s for these
    512 MiB on an idle VM), so a new decoder links within a link timeout of a third of a
    post. The bound follows the post's measured time: on a loaded machine both the post
    and the link slow down, and a fixed 0.1 s failed there. A control thread that waits
    for the agent links only when the post it meets is in its last third: each of the
    five links then fails with probability 2/3."""
    nb = 512
    a = spawn("--cluster-id", "2", "--role", "decoder", "--cache", f"1,{nb}x1048576,int8")
    b = spawn("--cluster-id", "3", "--role", "decoder", "--cache", "1,4x64,int8")
    p = LlmDataDist(1, "prompt", backend="nixl")
    p.initialize("127.0.0.1", 0)
    try:
        src = p.allocate_cache(CacheDesc(1, (nb, 1 << 20), "int8"))
        p.link_clusters([tuple(a.hello["addr"])], timeout_s=5)
        one = KvCacheExtParam(tensor_num_per_layer=1)
        index = CacheIndex(2, a.hello["cache"])
        stop = threading.Event()
        pushes: list[float] = []  # seconds per push (the post holds the agent throughout)

        def push():
            while not stop.is_set():
                t0 = time.monotonic()
                p.push_kv_blocks(src, index, np.arange(nb), np.arange(nb), one, timeout_s=60)
                pushes.append(time.monotonic() - t0)

        t = threading.Thread(target=push, daemon=True)
        t.start()
        try:
            while len(pushes) < 2:  # the agent is warm and pushing; a post's time known
                threading.Event().wait(0.01)
            limit = max(0.1, min(pushes) / 3)
            for _ in range(5):
                r = _ask_status(b, cmd="link", addr=list(p.listen_address), timeout_s=limit)
                assert r.get("linked") == [1], (r, limit, pushes)
        finally:
            stop.set()
            t.join(60)
        # Both links work.
        small = p.allocate_cache(CacheDesc(1, (4, 64), "int8"))
        small.tensors[0][...] = 5
        tag = p.push_kv_blocks(small, CacheIndex(3, b.hello["cache"]), [1], [2], one)
        got = _tensors(b.ask(cmd="read", tag=tag)["data"], CacheDesc(1, (4, 64), "int8"))
        assert (got[0][2] == 5).all() and (got[0][1] == SENTINEL).all()
    finally:
        p.finalize()


def test_the_default_timeout_scales_with_the_bytes(spawn, monkeypatch):
    """Issue 19 fault 4: with no timeout given, a push may take ``timeout_min_s`` plus its
    bytes at ``timeout_floor_bytes_per_s``; here a floor of 4 MiB/s gives a 16 MiB push
    4 s, so a receiver paused for 1 s slows it down without failing it."""
    nb = 2048
    dst = spawn(
        "--cluster-id", "2", "--role", "decoder", "--cache", f"1,{nb}x8192,int8",
        env=_tcp(monkeypatch),
    )  # fmt: skip
    opts = {"timeout_min_s": 0.2, "timeout_floor_bytes_per_s": 4 << 20}
    p = LlmDataDist(1, "prompt", backend="nixl", options=opts)
    p.initialize("127.0.0.1", 0)
    try:
        src = p.allocate_cache(CacheDesc(1, (nb, 8192), "int8"))
        src.tensors[0][...] = 4
        p.link_clusters([tuple(dst.hello["addr"])], timeout_s=5)
        one = KvCacheExtParam(tensor_num_per_layer=1)
        index = CacheIndex(2, dst.hello["cache"])
        h = p.push_kv_blocks_async(src, index, [0], [0], one)
        assert h.timeout_s == pytest.approx(0.2 + 8192 / (4 << 20))
        h.wait()
        _stop(dst)
        h = p.push_kv_blocks_async(src, index, np.arange(nb), np.arange(nb), one, tag="big")
        assert h.timeout_s == pytest.approx(0.2 + 4.0)
        threading.Event().wait(1.0)
        os.kill(dst.proc.pid, signal.SIGCONT)
        h.wait()
        got = _tensors(dst.ask(cmd="read", tag="big")["data"], CacheDesc(1, (nb, 8192), "int8"))
        assert (got[0] == 4).all()
    finally:
        os.kill(dst.proc.pid, signal.SIGCONT)
        p.finalize()


@pytest.mark.parametrize("how", ["timeout", "cancel"])
def test_the_receiver_learns_of_a_failed_push(spawn, monkeypatch, how):
    """Issue 19 fault 5: a push that times out or is cancelled sends a failure notice, so
    the decoder's wait_received ends with the source's status at once instead of waiting
    out its own timeout; the link then pushes again."""
    nb = 2048
    dst = spawn(
        "--cluster-id", "2", "--role", "decoder", "--cache", f"1,{nb}x8192,int8",
        env=_tcp(monkeypatch),
    )  # fmt: skip
    p = LlmDataDist(1, "prompt", backend="nixl")
    p.initialize("127.0.0.1", 0)
    try:
        src = p.allocate_cache(CacheDesc(1, (nb, 8192), "int8"))
        src.tensors[0][...] = 9
        p.link_clusters([tuple(dst.hello["addr"])], timeout_s=5)
        one = KvCacheExtParam(tensor_num_per_layer=1)
        index = CacheIndex(2, dst.hello["cache"])
        p.push_kv_blocks(src, index, [0], [0], one)
        _stop(dst)
        h = p.push_kv_blocks_async(src, index, np.arange(nb), np.arange(nb), one, tag="lost")
        if how == "timeout":
            with pytest.raises(LLMException) as info:
                h.wait(timeout_s=0.3)
            assert info.value.status is LLMStatus.TIMEOUT
            expected = "TIMEOUT"
        else:
            h.cancel()
            with pytest.raises(LLMException) as info:
                h.done()
            assert info.value.status is LLMStatus.FAILED and "cancel" in str(info.value)
            expected = "FAILED"
        assert h.released
        os.kill(dst.proc.pid, signal.SIGCONT)
        # The decoder would wait 60 s; the notice ends its wait before the 20 s reply bound.
        r = _ask_status(dst, reply_s=20, cmd="read", tag="lost", timeout_s=60)
        assert r.get("status") == expected and "source" in r.get("error", ""), r
        tag = p.push_kv_blocks(src, index, [3], [4], one, timeout_s=10)
        got = _tensors(dst.ask(cmd="read", tag=tag)["data"], CacheDesc(1, (nb, 8192), "int8"))
        assert (got[0][4] == 9).all()
    finally:
        os.kill(dst.proc.pid, signal.SIGCONT)
        p.finalize()


def test_example_prefill_decode(tmp_path):
    """examples/datadist_prefill_decode.py: a prefill process pushes the prompt's KV blocks
    into a decode process, which runs the example decode step on the CPU runtime."""
    r = subprocess.run(
        [sys.executable, str(REPO / "examples" / "datadist_prefill_decode.py"), "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "decode PASSED" in r.stdout, r.stdout[-3000:]
