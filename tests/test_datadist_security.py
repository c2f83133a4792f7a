"""docs/SPEC.md D7 (trust) and D8 (reuse safety), attacked as issue 30 did: a stranger on
127.0.0.1 that never linked (a raw socket, a client with the wrong secret, a replayed
handshake, a bare NIXL agent) cannot read the cache table, link, unlink, forge notices,
or stall the control plane; an unlink the peer did not hear fences it, so its next push
never writes a reused cache. Every socket is on 127.0.0.1 and every loop is bounded."""

from __future__ import annotations

import errno
import json
import os
import socket
import struct
import threading
import time

import numpy as np
import pytest

from pytrt_kv.datadist import (
    CacheDesc,
    CacheIndex,
    LlmDataDist,
    LLMException,
    LLMParamInvalid,
    LLMStatus,
    control,
)
from pytrt_kv.datadist.node_base import DACK, FAIL, NOTIF
from support.datadist import BACKENDS, NIXL_ONLY

SECRET = "correct horse battery staple"
DESC = CacheDesc(2, (4, 64), "int32")


def _node(cid, role, backend="local", secret=SECRET, **options):
    n = LlmDataDist(
        cid,
        role,
        backend=backend,
        options={"llm_datadist.auth_secret": secret, "timeout_s": 5.0, **options},
    )
    n.initialize("127.0.0.1", 0)
    return n


@pytest.fixture(params=BACKENDS)
def pair(request):
    p = _node(1, "prompt", request.param)
    d = _node(2, "decoder", request.param)
    yield p, d
    p.finalize()
    d.finalize()


def _frame(data: bytes) -> bytes:
    return struct.pack("!I", len(data)) + data


def _read_all(sock: socket.socket, timeout_s: float = 2.0) -> bytes:
    """Everything the server sends until it closes (bounded)."""
    sock.settimeout(timeout_s)
    out = b""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            part = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            break
        if not part:
            break
        out += part
    return out


# --- D7: nothing served before the handshake --------------------------------------------


def test_a_stranger_reads_no_table_and_no_agent_metadata(pair):
    """The old protocol's ``{"op": "table"}`` (and a hello) from a raw socket get only
    the server's challenge, never the table, agent metadata or addresses."""
    p, d = pair
    cache = d.allocate_cache(DESC)
    for msg in ({"op": "table"}, {"op": "hello", "md": {}}, {"op": "bye", "from": 1}):
        with socket.create_connection(d.listen_address, timeout=2) as s:
            s.sendall(_frame(json.dumps(msg).encode()))
            got = _read_all(s)
        assert b"nonce" in got and len(got) < 200, got  # the challenge, nothing else
        assert b"caches" not in got and b"transport" not in got and b"agent" not in got
        assert str(cache.tensor_addrs[0]).encode() not in got
    assert d.control_alive and d.linked_clusters() == []


def test_the_wrong_secret_links_nothing_and_learns_nothing(pair):
    p, d = pair
    d.allocate_cache(DESC)
    stranger = _node(1, "prompt", "local", secret="guess")
    try:
        (r,) = stranger.link_clusters([d.listen_address], timeout_s=2)
        assert r.status is LLMStatus.FAILED and r.cluster_id is None
        assert "secret" in r.message or "authentication" in r.message, r
        assert d.linked_clusters() == [] and stranger.linked_clusters() == []
        # ... and a node with the secret does not talk to a server without it
        (r,) = p.link_clusters([stranger.listen_address], timeout_s=2)
        assert r.status is LLMStatus.FAILED and stranger.linked_clusters() == []
        with pytest.raises(control.AuthError):
            control.request(d.listen_address, {"op": "table"}, 2, control.Auth(1, b"guess"))
    finally:
        stranger.finalize()


def test_a_replayed_handshake_fails(pair):
    """A recorded proof answers one challenge only: replayed on a new connection (a new
    nonce) it is refused."""
    _, d = pair
    secret = SECRET.encode()
    deadline = control._Deadline(2)
    with socket.create_connection(d.listen_address, timeout=2) as s:
        ch = json.loads(control._read_frame(s, 1024, deadline))
        ns, nc = bytes.fromhex(ch["nonce"]), os.urandom(16)
        mac = control._mac(secret, b"c", ns, nc, b"1")
        answer = json.dumps({"nonce": nc.hex(), "from": 1, "mac": mac.hex()}).encode()
        s.sendall(_frame(answer))
        assert b"cluster_id" in _read_all(s, 0.5)  # accepted on its own connection
    with socket.create_connection(d.listen_address, timeout=2) as s:
        control._read_frame(s, 1024, control._Deadline(2))  # a new challenge
        s.sendall(_frame(answer))
        got = _read_all(s)
    assert b"authentication failed" in got and b"cluster_id" not in got


def test_a_peer_cannot_speak_for_another_cluster(pair):
    """A node holding the secret but claiming in its hello to be cluster 7 while it
    authenticated as 1 is refused; a bye naming another cluster ends nothing."""
    p, d = pair
    md = p._metadata()
    md["cluster_id"] = 7
    auth = control.Auth(1, SECRET.encode())
    hello = {"op": "hello", "md": md, "epoch": "0" * 16}
    _, reply = control.request(d.listen_address, hello, 2, auth)
    assert "error" in reply and "authenticated as cluster 1" in reply["error"]
    assert d.linked_clusters() == []
    assert p.link_clusters([d.listen_address])[0].ok
    # Cluster 3, with the secret, sends a bye "from" 1 (the old protocol's field).
    _, reply = control.request(
        d.listen_address,
        {"op": "bye", "from": 1, "agent": md["agent"]},
        2,
        control.Auth(3, SECRET.encode()),
    )
    assert d.linked_clusters() == [1] and p.linked_clusters() == [2]


def test_no_secret_refuses_a_non_loopback_address(monkeypatch):
    monkeypatch.delenv("PYTRT_KV_DATADIST_SECRET", raising=False)
    n = LlmDataDist(1, "prompt", backend="local")
    with pytest.raises(LLMException, match=r"llm_datadist.allow_unauthenticated") as e:
        n.initialize("0.0.0.0", 0)  # refused before anything listens
    assert e.value.status is LLMStatus.FAILED and n.listen_address is None
    n.initialize("127.0.0.1", 0)  # loopback without a secret: allowed
    n.finalize()
    # The environment variable is the secret when the option is not set.
    monkeypatch.setenv("PYTRT_KV_DATADIST_SECRET", SECRET)
    a, b = LlmDataDist(1, "prompt", backend="local"), _node(2, "decoder")
    a.initialize()
    try:
        assert a.link_clusters([b.listen_address])[0].ok
    finally:
        a.finalize()
        b.finalize()


# --- D7: notices bound to the authenticated agent and link epoch --------------------------


def _inject(node, agent: str, msg) -> None:
    node._transport._inbox.append((agent, msg if isinstance(msg, bytes) else msg.encode()))


def test_forged_and_malformed_notices_are_ignored_and_lose_no_tag():
    """Failure notices and deallocate acknowledgements from an agent that is not the
    linked peer's, or of another link epoch, or malformed, are ignored; a legitimate tag
    that arrives among them is reported."""
    p, d = _node(1, "prompt"), _node(2, "decoder", control_timeout_s=0.3)
    try:
        src, dst = p.allocate_cache(DESC), d.allocate_cache(DESC)
        assert p.link_clusters([d.listen_address])[0].ok
        agent, epoch = p._transport.name, d._peers[1].epoch
        forged = [
            ("pytrt_kv-evil", f"{FAIL}|{epoch}|FAILED|t1"),  # another agent
            (agent, f"{FAIL}|{'0' * 16}|FAILED|t1"),  # another epoch
            (agent, f"{NOTIF}|{epoch}|x|y|t1"),  # malformed
            (agent, f"{NOTIF}|{epoch}"),
            (agent, f"{DACK}|{epoch}|1|zz|1"),
            (agent, b"\xff|garbage"),
        ]
        for a, m in forged:
            _inject(d, a, m)
        tag = p.push_kv_blocks(src, CacheIndex(2, dst.cache_id), [0], [1], tag="t1")
        d.wait_received(tag, 2)  # the real tag, after the forged notices
        # A forged acknowledgement does not release a quarantine: d's drop is unheard.
        d_dst2 = d.allocate_cache(DESC)
        real = p._server._handler
        p._server._handler = lambda who, msg: time.sleep(0.5) or {}
        d.deallocate_cache(d_dst2)
        assert d.quarantined_caches() == [d_dst2.cache_id]
        _inject(d, "pytrt_kv-evil", f"{DACK}|{epoch}|1|{d_dst2.cache_id}|{d_dst2.generation}")
        _inject(d, agent, f"{DACK}|{'1' * 16}|1|{d_dst2.cache_id}|{d_dst2.generation}")
        _inject(d, agent, f"{DACK}|{epoch}|3|{d_dst2.cache_id}|{d_dst2.generation}")
        assert d.quarantined_caches() == [d_dst2.cache_id]
        p._server._handler = real
    finally:
        p.finalize()
        d.finalize()


@NIXL_ONLY
def test_a_bare_nixl_agent_cannot_fail_a_tag():
    """Even holding the decoder's metadata and the link epoch (a leak), a bare NIXL agent
    that is not the linked prompt node's cannot fail or complete its tags."""
    from pytrt_kv.datadist.nixl_transport import nixl_modules

    api, _ = nixl_modules()
    p, d = _node(1, "prompt", "nixl"), _node(2, "decoder", "nixl")
    evil = api.nixl_agent("pytrt_kv-evil", api.nixl_agent_config(backends=["UCX"]))
    try:
        src, dst = p.allocate_cache(DESC), d.allocate_cache(DESC)
        assert p.link_clusters([d.listen_address])[0].ok
        md = json.loads(d.local_metadata())
        import base64

        name = evil.add_remote_agent(base64.b64decode(md["transport"]))
        epoch = d._peers[1].epoch
        for m in (
            f"{FAIL}|{epoch}|FAILED|t2",
            f"{NOTIF}|{epoch}|{dst.cache_id}|{dst.generation}|t3",
        ):
            evil.send_notif(name, m.encode())
        time.sleep(0.2)
        assert not d.received("t3")
        d.wait_received(p.push_kv_blocks(src, CacheIndex(2, dst.cache_id), [0], [0], tag="t2"), 5)
    finally:
        p.finalize()
        d.finalize()


# --- D7: a control plane that cannot be killed ------------------------------------------


def test_json_depth_is_measured_without_parsing():
    assert control.json_depth(b'{"a": [1, {"b": "[[[[{{"}]}') == 3
    assert control.json_depth(b'{"a": "\\"[[[["}') == 1
    assert control.json_depth(b"[" * 200_000 + b"]" * 200_000) == 200_000


def test_bad_clients_cost_their_connection_only(pair):
    """400 KB of nested JSON (before and after authenticating), garbage, an oversized
    length, a slowloris client and connections left open: a real peer still links and
    pushes while they hang on, and the control server stays alive."""
    p, d = pair
    dst = d.allocate_cache(DESC)
    src = p.allocate_cache(DESC)
    bad = []
    nested = b"[" * 200_000 + b"]" * 200_000
    for payload in (_frame(nested), b"\x00\x01garbage\xff" * 100, struct.pack("!I", 2**31)):
        s = socket.create_connection(d.listen_address, timeout=2)
        s.sendall(payload)
        bad.append(s)
    slow = socket.create_connection(d.listen_address, timeout=2)
    slow.sendall(b"\x00")  # 1 byte, then nothing: the slowloris
    bad.append(slow)
    idle = [socket.create_connection(d.listen_address, timeout=2) for _ in range(8)]
    # Authenticated, with the secret, and then a deeply nested request.
    with socket.create_connection(d.listen_address, timeout=2) as s:
        session = control.client_handshake(s, SECRET.encode(), 9, 2, control._Deadline(2))
        body = json.dumps({"op": "table", "x": 0}).encode()[:-1] + b', "y": ' + nested + b"}"
        s.sendall(_frame(control._mac(session._key, b"q", body) + body))
        assert _read_all(s) == b""  # dropped, no reply
    t0 = time.monotonic()
    assert p.link_clusters([d.listen_address], timeout_s=2)[0].ok
    assert time.monotonic() - t0 < 1.5, "a link waited for a slow client"
    d.wait_received(p.push_kv_blocks(src, CacheIndex(2, dst.cache_id), [0], [0]), 5)
    assert d.control_alive and p.control_alive
    for s in bad + idle:
        s.close()
    assert d._server.dropped.get("malformed", 0) >= 3


def test_accept_failures_back_off_and_the_server_lives(pair):
    """``accept`` failing with EMFILE (the fd limit) does not end the server."""
    p, d = pair
    real = d._server._sock
    fails = {"n": 0}

    class Flaky:
        def accept(self):
            if fails["n"] < 5:
                fails["n"] += 1
                raise OSError(errno.EMFILE, "Too many open files")
            return real.accept()

        def close(self):
            real.close()

    d._server._sock = Flaky()
    deadline = time.monotonic() + 5
    while fails["n"] < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert p.link_clusters([d.listen_address], timeout_s=5)[0].ok
    assert fails["n"] == 5 and d.control_alive
    assert d._server.dropped.get("EMFILE") == 5


def test_a_handler_exception_is_contained(pair, monkeypatch):
    p, d = pair
    monkeypatch.setattr(d, "_metadata", lambda: (_ for _ in ()).throw(RecursionError("deep")))
    (r,) = p.link_clusters([d.listen_address], timeout_s=2)
    assert r.status is LLMStatus.FAILED and "RecursionError" in r.message
    monkeypatch.undo()
    assert d.control_alive and p.link_clusters([d.listen_address], timeout_s=2)[0].ok


def test_a_malformed_link_reply_fails_that_cluster_only(pair):
    """A server with the secret that answers a hello with a malformed table, a table of
    another cluster, or no metadata: one FAILED LinkResult each; the real peer links."""
    p, d = pair
    replies = iter(
        [
            {
                "md": {
                    "version": 1,
                    "backend": p.backend,
                    "cluster_id": 5,
                    "agent": "a",
                    "transport": "t",
                    "address": ["127.0.0.1", 1],
                    "caches": [{"cache_id": "x"}],
                }
            },
            {
                "md": {
                    "version": 1,
                    "backend": p.backend,
                    "cluster_id": 6,
                    "agent": "a",
                    "transport": "t",
                    "address": ["127.0.0.1", 1],
                    "caches": [],
                }
            },
            {"nothing": 1},
            {"md": [[[]]]},
        ]
    )
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    addr = srv.getsockname()

    def serve():
        for _ in range(4):
            conn, _ = srv.accept()
            with conn:
                s = control.server_handshake(conn, SECRET.encode(), 5, control._Deadline(2))
                s.recv(b"q")
                s.send(b"r", next(replies))

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    results = p.link_clusters([addr, addr, addr, addr, d.listen_address], timeout_s=2)
    srv.close()
    assert [r.status for r in results] == [LLMStatus.FAILED] * 4 + [LLMStatus.SUCCESS]
    assert (
        "cache table" in results[0].message and "authenticated as cluster 5" in results[1].message
    )
    assert p.linked_clusters() == [2]


def _entry(**change):
    from pytrt_kv.datadist.transport import CacheInfo

    good = CacheInfo(3, 1, CacheDesc(2, (4, 16), "int8"), (4096, 8192)).to_dict()
    desc = change.pop("desc", {})
    if isinstance(desc, dict):
        desc = {**good["desc"], **desc}
    return {**good, "desc": desc, **change}


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(cache_id=1.5), "cache_id"),
        (dict(cache_id="3"), "cache_id"),
        (dict(cache_id=True), "cache_id"),
        (dict(cache_id=-1), "cache_id"),
        (dict(generation=None), "generation"),
        (dict(addrs=[4096]), "addrs"),  # one address for two tensors
        (dict(addrs=[4096, 0]), "addrs"),
        (dict(addrs=[4096, 1 << 64]), "addrs"),
        (dict(addrs=[4096, 8192.0]), "addrs"),
        (dict(addrs="4096"), "addrs"),
        (dict(desc=dict(num_tensors=2.0)), "num_tensors"),
        (dict(desc=dict(shape=[4, 16.5])), "shape"),
        (dict(desc=dict(shape="4,16")), "shape"),
        (dict(desc=dict(device=-1)), "device"),
        (dict(desc=dict(data_type=5)), "data_type"),
        (dict(desc=[]), "desc"),
    ],
)
def test_a_peer_table_entry_is_taken_exactly_or_refused(change, field):
    """A peer's cache table comes from the wire: exact JSON ints (no 1.5 -> 1, "3" -> 3,
    True -> 1), an address per tensor in (0, 2**64), or ValueError naming the field (the
    link then fails with FAILED, test_a_malformed_link_reply_fails_that_cluster_only)."""
    from pytrt_kv.datadist.transport import CacheInfo

    assert CacheInfo.from_dict(_entry()).addrs == (4096, 8192)
    with pytest.raises(ValueError, match=field):
        CacheInfo.from_dict(_entry(**change))


# --- D8: an unlink the peer did not hear ------------------------------------------------


def _deaf(node):
    """``node``'s control port closes (its server gone) while its process lives on."""
    node._server.close()


def test_unheard_unlink_fences_the_peer_and_keeps_the_memory(pair):
    """The decoder unlinks the prompt node whose control port is closed: the prompt node
    is fenced, the cache it knew stays quarantined once deallocated (its buffers cannot
    be registered again), its next push is refused (it hears the unlink in-band) and
    writes nothing; its in-band acknowledgement then ends the fence and the quarantine."""
    p, d = pair
    src = p.allocate_cache(DESC)
    for t in src.tensors:
        t[...] = 7
    arrays = [np.zeros(DESC.shape, np.int32) for _ in range(2)]
    dst = d.register_cache(DESC, arrays)
    assert p.link_clusters([d.listen_address])[0].ok
    old = CacheIndex(2, dst.cache_id)
    d.wait_received(p.push_kv_blocks(src, old, [0], [0]), 5)
    _deaf(p)
    d.unlink_clusters([1], timeout_s=0.3)
    assert d.linked_clusters() == [] and list(d._fences) == [1]
    d.deallocate_cache(dst)
    assert d.quarantined_caches() == [dst.cache_id]
    with pytest.raises(ValueError, match=r"not yet acknowledged by cluster\(s\) \[1\]"):
        d.register_cache(DESC, arrays)
    new = d.allocate_cache(DESC)  # other memory: the old is held
    for t in new.tensors:
        t[...] = 0
    assert not {a for a in new.tensor_addrs} & {a for a in dst.tensor_addrs}
    deadline = time.monotonic() + 5
    while True:  # the kept plan's fast path; over NIXL the notice may still be on its way
        try:
            p.push_kv_blocks(src, old, [0, 1, 2, 3], [0, 1, 2, 3])
        except LLMException as e:
            assert e.status is LLMStatus.NOT_YET_LINK, e
            break
        assert d.backend == "nixl" and time.monotonic() < deadline
        time.sleep(0.01)
    assert all((t == 0).all() for t in new.tensors), "a fenced peer wrote a live cache"
    with pytest.raises(LLMException) as e:
        p.push_kv_blocks(src, CacheIndex(2, new.cache_id), [0], [0])
    assert e.value.status is LLMStatus.NOT_YET_LINK and p.linked_clusters() == []
    deadline = time.monotonic() + 5
    while d.quarantined_caches() and time.monotonic() < deadline:
        time.sleep(0.01)  # the acknowledgement comes back in-band
    assert d.quarantined_caches() == [] and d._fences == {}
    d.register_cache(DESC, arrays)  # free again


def test_a_fence_is_bounded_for_a_peer_that_never_answers():
    """A fenced peer that never reads its notices holds the memory only for
    ``llm_datadist.fence_timeout_s``."""
    p = _node(1, "prompt")
    d = _node(2, "decoder", **{"llm_datadist.fence_timeout_s": 0.5})
    try:
        dst = d.allocate_cache(DESC)
        assert p.link_clusters([d.listen_address])[0].ok
        _deaf(p)
        d.unlink_clusters([1], timeout_s=0.3)
        d.deallocate_cache(dst)
        assert d.quarantined_caches() == [dst.cache_id]
        time.sleep(0.6)
        assert d.quarantined_caches() == [] and d._fences == {}
    finally:
        p.finalize()
        d.finalize()


def test_a_heard_unlink_frees_at_once(pair):
    p, d = pair
    dst = d.allocate_cache(DESC)
    assert p.link_clusters([d.listen_address])[0].ok
    d.unlink_clusters([1])
    assert d._fences == {} and p.linked_clusters() == []
    d.deallocate_cache(dst)
    assert d.quarantined_caches() == []


# --- issue 31: the kept plan never takes bools for ints --------------------------------


def test_a_kept_plan_for_ints_is_not_used_for_equal_bools(pair):
    """``[False, True] == [0, 1]`` in Python: a request of bools must not match the plan
    kept for the ints (a fresh request of bools is refused)."""
    p, d = pair
    src, dst = p.allocate_cache(DESC), d.allocate_cache(DESC)
    assert p.link_clusters([d.listen_address])[0].ok
    index = CacheIndex(2, dst.cache_id)
    d.wait_received(p.push_kv_blocks(src, index, [0, 1], [0, 1]), 5)
    for sb, db in (([False, True], [0, 1]), ([0, 1], [False, True]), ((False, True), (0, 1))):
        with pytest.raises(LLMParamInvalid, match="blocks"):
            p.push_kv_blocks(src, index, sb, db, tag="refused")
    time.sleep(0.05)
    assert not d.received("refused")


def test_a_server_without_the_secret_gets_no_metadata(pair):
    """A fake server that accepts any client but cannot prove the secret: the link fails
    before this node sends its hello (its agent metadata and cache table)."""
    p, _ = pair
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    got = []

    def serve():
        conn, _ = srv.accept()
        with conn:
            dl = control._Deadline(3)
            conn.sendall(_frame(json.dumps({"v": 1, "nonce": "00" * 16}).encode()))
            control._read_frame(conn, 1024, dl)  # the client's proof: not checked
            conn.sendall(_frame(json.dumps({"cluster_id": 5, "mac": "11" * 32}).encode()))
            got.append(_read_all(conn, 1.0))

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    (r,) = p.link_clusters([srv.getsockname()], timeout_s=2)
    t.join(5)
    srv.close()
    assert r.status is LLMStatus.FAILED and "secret" in r.message, r
    assert got == [b""], got  # nothing after the handshake: no hello, no metadata


@NIXL_ONLY
def test_link_unlink_cycles_leak_no_fd():
    """200 link/unlink cycles (both sides in this process) end with the fds they started
    with: NIXL leaves a socket per removed remote agent, so a relink reuses the loaded
    metadata (docs/DATADIST.md, "File descriptors")."""
    p, d = _node(1, "prompt", "nixl"), _node(2, "decoder", "nixl")
    try:
        p.allocate_cache(DESC)
        d.allocate_cache(DESC)

        def cycle():
            assert p.link_clusters([d.listen_address])[0].ok
            p.unlink_clusters([2])

        for _ in range(3):
            cycle()
        time.sleep(0.2)
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(200):
            cycle()
        time.sleep(0.2)  # connection threads end
        assert len(os.listdir("/proc/self/fd")) <= before
    finally:
        p.finalize()
        d.finalize()


@pytest.mark.parametrize(
    "options, exc, match",
    [
        ({"llm_datadist.auth_secret": 1234}, TypeError, "auth_secret.*str or bytes"),
        ({"llm_datadist.fence_timeout_s": -1}, ValueError, "fence_timeout_s.*>= 0"),
        ({"llm_datadist.allow_unauthenticated": "yes"}, TypeError, "expected a bool"),
    ],
)
def test_security_options_are_checked(options, exc, match):
    with pytest.raises(exc, match=match):
        LlmDataDist(1, "prompt", backend="local", options=options)


def test_a_flood_of_idle_connections_does_not_keep_a_peer_out(pair):
    """300 connections (more than MAX_CONNECTIONS) that never answer the challenge: the
    oldest unauthenticated ones are cut beyond a cap, and a real peer links at once while
    they stay open (without the cut, every slot is held and the link is refused)."""
    p, d = pair
    flood = [socket.create_connection(d.listen_address, timeout=2) for _ in range(300)]
    try:
        dropped = d._server.dropped
        deadline = time.monotonic() + 3
        while dropped.get("evicted", 0) + dropped.get("busy", 0) < 300 - control.MAX_CONNECTIONS:
            assert time.monotonic() < deadline, dropped  # every flood connection accepted
            time.sleep(0.01)
        t0 = time.monotonic()
        assert p.link_clusters([d.listen_address], timeout_s=1)[0].ok
        assert time.monotonic() - t0 < 1.0
        assert d._server.dropped.get("evicted", 0) >= 300 - control.MAX_UNAUTHENTICATED - 1
        assert d.control_alive
    finally:
        for s in flood:
            s.close()


def test_finalize_never_frees_memory_a_fenced_peer_may_write():
    """A node finalized while a fenced peer has not answered keeps its allocation of the
    memory that peer knew (docs/SPEC.md D8): deregistered, never freed."""
    from pytrt_kv.datadist import caches

    p, d = _node(1, "prompt"), _node(2, "decoder")
    try:
        dst = d.allocate_cache(DESC)
        tensors = list(dst.tensors)
        assert p.link_clusters([d.listen_address])[0].ok
        _deaf(p)
        p._transport._inbox.clear()
        d.unlink_clusters([1], timeout_s=0.3)
        p._transport.poll = lambda: []  # p never reads the in-band unlink either
        d.finalize()
        assert any(all(a is b for a, b in zip(kept, tensors)) for kept in caches.RETAINED)
    finally:
        p.finalize()
        d.finalize()
