"""docs/SPEC.md D7/D8 between processes over 127.0.0.1 (issue 30): a node in its own
process with the secret from ``PYTRT_KV_DATADIST_SECRET``; a stranger in this process
cannot read its table or unlink it; an unlink the prompt node did not hear never lets its
next push write the reused cache; a receiver restarted on the same port gives
NOT_YET_LINK, then a relink works; link/unlink cycles leak no fd. Every wait is bounded."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import numpy as np
import pytest

from pytrt_kv.datadist import CacheDesc, CacheIndex, LlmDataDist, LLMException, LLMStatus, control
from support.datadist_procs import NIXL_SKIP, _env, _tensors, spawn_fixture  # noqa: F401

pytestmark = pytest.mark.skipif(NIXL_SKIP is not None, reason=str(NIXL_SKIP))
SECRET = "s3cret-for-the-tests"
DESC = CacheDesc(2, (16, 4096), "int8")
CACHE = "2,16x4096,int8"


def _prompt(**options):
    p = LlmDataDist(
        1, "prompt", backend="nixl", options={"llm_datadist.auth_secret": SECRET, **options}
    )
    p.initialize("127.0.0.1", 0)
    src = p.allocate_cache(DESC)
    for i, t in enumerate(src.tensors):
        t[...] = np.arange(16, dtype=np.int8)[:, None] + 10 * i
    return p, src


def test_a_stranger_process_cannot_read_or_unlink(spawn):
    env = _env(PYTRT_KV_DATADIST_SECRET=SECRET)
    d = spawn("--cluster-id", "2", "--role", "decoder", "--cache", CACHE, env=env)
    addr = tuple(d.hello["addr"])
    p, src = _prompt()
    try:
        assert p.link_clusters([addr], timeout_s=5)[0].ok
        with socket.create_connection(addr, timeout=2) as s:  # the old protocol
            data = json.dumps({"op": "table"}).encode()
            s.sendall(len(data).to_bytes(4, "big") + data)
            s.settimeout(2)
            got = s.recv(65536)
        assert b"nonce" in got and b"caches" not in got
        for secret in (b"", b"guess"):
            with pytest.raises(control.AuthError):
                control.request(addr, {"op": "bye"}, 2, control.Auth(1, secret))
        tag = p.push_kv_blocks(src, CacheIndex(2, d.hello["cache"]), [3], [4])
        got = _tensors(d.ask(cmd="read", tag=tag)["data"], DESC)
        assert (got[1][4] == src.tensors[1][3]).all()
    finally:
        p.finalize()


def test_an_unheard_unlink_never_lets_the_next_push_write_the_reused_cache(spawn):
    """The decoder unlinks the prompt node while the prompt node's control port is
    closed, deallocates the cache and registers its buffers again (refused: fenced, so it
    allocates), and the prompt node pushes to the old cache again and again (its kept
    plan): NOT_YET_LINK once it reads the in-band unlink, never a byte in the new cache;
    the in-band acknowledgement then ends the quarantine."""
    env = _env(PYTRT_KV_DATADIST_SECRET=SECRET)
    d = spawn("--cluster-id", "2", "--role", "decoder", "--cache", CACHE, "--register", env=env)
    p, src = _prompt()
    try:
        assert p.link_clusters([tuple(d.hello["addr"])], timeout_s=5)[0].ok
        old = CacheIndex(2, d.hello["cache"])
        blocks = np.arange(16)
        d.ask(cmd="read", tag=p.push_kv_blocks(src, old, blocks, blocks))
        p._server.close()  # the prompt node's control port closes; the process lives on
        r = d.ask(cmd="unlink", cluster=1, timeout_s=0.5)
        assert r["linked"] == []
        new = d.ask(cmd="realloc", timeout_s=20)
        assert "not yet acknowledged by cluster(s) [1]" in (new["refused"] or ""), new
        assert new["quarantined"] == [old.cache_id]
        before = new["data"]
        deadline = time.monotonic() + 5
        while True:
            try:
                p.push_kv_blocks(src, old, blocks, blocks, timeout_s=5)
            except LLMException as exc:
                assert exc.status is LLMStatus.NOT_YET_LINK, exc
                break
            assert d.ask(cmd="state")["data"] == before, "a fenced push wrote the new cache"
            assert time.monotonic() < deadline, "the in-band unlink never arrived"
            time.sleep(0.01)
        state = d.ask(cmd="state")
        assert state["data"] == before, "a fenced push wrote the new cache"
        deadline = time.monotonic() + 5
        while state["quarantined"] and time.monotonic() < deadline:
            time.sleep(0.05)
            state = d.ask(cmd="state")
        assert state["quarantined"] == []
    finally:
        p.finalize()


def test_a_receiver_restarted_on_the_same_port_is_not_yet_link_then_relinks(spawn):
    env = _env(PYTRT_KV_DATADIST_SECRET=SECRET)
    d = spawn("--cluster-id", "2", "--role", "decoder", "--cache", CACHE, env=env)
    addr = tuple(d.hello["addr"])
    p, src = _prompt()
    try:
        assert p.link_clusters([addr], timeout_s=5)[0].ok
        index = CacheIndex(2, d.hello["cache"])
        d.ask(cmd="read", tag=p.push_kv_blocks(src, index, [0], [0]))
        d.kill()
        d2 = spawn(
            "--cluster-id", "2", "--role", "decoder", "--cache", CACHE,
            "--port", str(addr[1]), env=env,
        )  # fmt: skip
        assert tuple(d2.hello["addr"]) == addr
        statuses = []
        for _ in range(3):
            try:
                p.push_kv_blocks(src, index, [1], [1], timeout_s=5)
                statuses.append("SUCCESS")
            except LLMException as exc:
                statuses.append(exc.status.name)
        assert statuses == ["NOT_YET_LINK"] * 3, statuses
        assert p.link_clusters([addr], timeout_s=5)[0].ok
        index = CacheIndex(2, d2.hello["cache"])
        got = _tensors(d2.ask(cmd="read", tag=p.push_kv_blocks(src, index, [2], [5]))["data"], DESC)
        assert (got[0][5] == src.tensors[0][2]).all()
    finally:
        p.finalize()


def _listeners(pid: int) -> list[str]:
    """``ip:port`` (hex, as /proc writes them) of every TCP socket ``pid`` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[9] in inodes and f[3] == "0A":  # LISTEN
                found.append(f[1])
    return found


def test_every_listener_binds_the_configured_address(spawn):
    """The control server and NIXL's UCX transport of a node initialized on 127.0.0.1
    listen on 127.0.0.1 only (UCX alone listened on eth0 too)."""
    env = _env(PYTRT_KV_DATADIST_SECRET=SECRET)
    d = spawn("--cluster-id", "2", "--role", "decoder", "--cache", CACHE, env=env)
    p, src = _prompt()
    try:
        assert p.link_clusters([tuple(d.hello["addr"])], timeout_s=5)[0].ok
        d.ask(cmd="read", tag=p.push_kv_blocks(src, CacheIndex(2, d.hello["cache"]), [0], [0]))
        found = _listeners(d.hello["pid"])
        assert len(found) >= 2, found  # the control port and UCX's
        assert all(a.startswith("0100007F:") for a in found), found
        assert f"0100007F:{d.hello['addr'][1]:04X}" in found
    finally:
        p.finalize()
