"""The control channel: authenticated link handshakes and cache-table messages over TCP.

Data never goes through here (NIXL moves it); this carries only the small metadata a
link needs, like the side channel vLLM and SGLang use next to NIXL: each node listens on
``listen_ip:listen_port`` (``initialize``), and a request is one short connection, so no
state outlives a call and every wait is bounded.

A connection starts with a mutual challenge-response (docs/SPEC.md D7,
docs/DATADIST.md "Security"): the server sends a fresh nonce, the client answers with its
own nonce, its cluster id and ``HMAC-SHA256(secret, "c" | both nonces | its id)``, the
server proves itself with ``HMAC-SHA256(secret, "s" | both nonces | both ids)``; nothing
else is read or served before. The request and its reply then each carry an HMAC under a
key derived from both nonces, checked before the JSON is parsed, so every message is
bound to the authenticated peer of this connection (and a recorded one cannot be
replayed on another). Standard library only (``hmac``, ``hashlib``, ``secrets``).

The server (:class:`ControlServer`) cannot be killed by a client: a message over its size
cap, nested deeper than :data:`MAX_DEPTH`, slower than its whole-message deadline or
malformed costs that connection only; each connection has its own thread (at most
:data:`MAX_CONNECTIONS` at once; beyond :data:`MAX_UNAUTHENTICATED` connections still in
the handshake the oldest is cut), an ``accept`` that fails (EMFILE) backs off and
retries, and every exception is contained and logged (logger ``pytrt_kv.datadist``).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

log = logging.getLogger("pytrt_kv.datadist")

#: Refuse authenticated messages larger than this (a table of thousands of caches is far
#: below it); handshake messages are capped at :data:`MAX_HELLO`.
MAX_MESSAGE = 16 << 20
MAX_HELLO = 1024
#: Refuse JSON nested deeper than this (checked on the bytes, before parsing; a table is
#: 5 deep).
MAX_DEPTH = 16
#: Connections served at once; more are closed at once (their senders retry).
MAX_CONNECTIONS = 256
#: Connections still in the handshake; one more cuts the oldest of them, so that a client
#: flooding the port with idle connections cannot keep a peer from authenticating.
MAX_UNAUTHENTICATED = 32
_LEN = struct.Struct("!I")
_MAC = 32
_NONCE = 16


class AuthError(ConnectionError):
    """The peer did not prove it holds the cluster's secret (or proved another id)."""


class _Deadline:
    def __init__(self, timeout_s: float):
        self.end = time.monotonic() + timeout_s

    def left(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError("control channel: message not complete within its deadline")
        return left


def _recv_exact(sock: socket.socket, n: int, deadline: _Deadline) -> bytes:
    chunks = []
    while n:
        sock.settimeout(deadline.left())
        part = sock.recv(min(n, 1 << 20))
        if not part:
            raise ConnectionError("control channel: the peer closed the connection")
        chunks.append(part)
        n -= len(part)
    return b"".join(chunks)


def _frame(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_LEN.pack(len(data)) + data)


def _read_frame(sock: socket.socket, cap: int, deadline: _Deadline) -> bytes:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size, deadline))
    if n > cap:
        raise ConnectionError(f"control channel: message of {n} bytes refused (cap {cap})")
    return _recv_exact(sock, n, deadline)


_BRACKETS = bytes(range(256)).translate(None, b"[]{}")


def json_depth(data: bytes) -> int:
    """Nesting depth of JSON text, from its bytes (strings skipped), without parsing it."""
    if b"\\" in data:  # escaped quotes inside strings: drop every escape pair first
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    parts = data.split(b'"')
    outside = b"".join(parts[::2]).translate(None, _BRACKETS)
    if not outside:
        return 0
    a = np.frombuffer(outside, np.uint8)
    steps = np.where((a == ord("[")) | (a == ord("{")), 1, -1).astype(np.int32)
    return int(np.cumsum(steps).max())


def _parse(data: bytes) -> dict[str, Any]:
    if json_depth(data) > MAX_DEPTH:
        raise ConnectionError(f"control channel: JSON nested deeper than {MAX_DEPTH} refused")
    try:
        msg = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ConnectionError(f"control channel: malformed message ({exc})") from None
    if not isinstance(msg, dict):
        raise ConnectionError("control channel: malformed message (not an object)")
    return msg


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"|".join(parts), hashlib.sha256).digest()


def _hex(msg: dict[str, Any], key: str, n: int) -> bytes:
    v = msg.get(key)
    if not isinstance(v, str) or len(v) != 2 * n:
        raise AuthError(f"control channel: handshake field {key!r} malformed")
    try:
        return bytes.fromhex(v)
    except ValueError:
        raise AuthError(f"control channel: handshake field {key!r} malformed") from None


def _cid(msg: dict[str, Any], key: str) -> int:
    v = msg.get(key)
    if type(v) is not int or v < 0:
        raise AuthError(f"control channel: handshake field {key!r} malformed")
    return v


class Session:
    """An authenticated connection: the peer's cluster id and the per-connection key
    every message is MACed with (``"q"`` requests, ``"r"`` replies)."""

    def __init__(self, sock: socket.socket, peer: int, key: bytes, deadline: _Deadline):
        self.sock, self.peer, self._key, self.deadline = sock, peer, key, deadline

    def send(self, direction: bytes, msg: dict[str, Any]) -> None:
        data = json.dumps(msg).encode()
        # A reply after a slow handler still gets a short while to leave.
        self.sock.settimeout(max(0.5, self.deadline.end - time.monotonic()))
        _frame(self.sock, _mac(self._key, direction, data) + data)

    def recv(self, direction: bytes) -> dict[str, Any]:
        data = _read_frame(self.sock, MAX_MESSAGE + _MAC, self.deadline)
        mac, body = data[:_MAC], data[_MAC:]
        if not hmac.compare_digest(mac, _mac(self._key, direction, body)):
            raise AuthError("control channel: message not signed by the authenticated peer")
        return _parse(body)


def client_handshake(
    sock: socket.socket, secret: bytes, me: int, expect: int | None, deadline: _Deadline
) -> Session:
    """The client's half of the mutual handshake; ``expect``: the cluster id the server
    must prove (None: any, learnt here)."""
    challenge = _parse(_read_frame(sock, MAX_HELLO, deadline))
    ns = _hex(challenge, "nonce", _NONCE)
    nc = secrets.token_bytes(_NONCE)
    mac_c = _mac(secret, b"c", ns, nc, str(me).encode())
    _frame(sock, json.dumps({"nonce": nc.hex(), "from": me, "mac": mac_c.hex()}).encode())
    proof = _parse(_read_frame(sock, MAX_HELLO, deadline))
    if "error" in proof:
        raise AuthError(f"control channel: the peer refused: {str(proof['error'])[:200]}")
    server = _cid(proof, "cluster_id")
    want = _mac(secret, b"s", ns, nc, str(me).encode(), str(server).encode())
    if not hmac.compare_digest(_hex(proof, "mac", _MAC), want):
        raise AuthError(
            "control channel: the peer did not prove it holds the cluster's secret "
            "(docs/DATADIST.md, 'Security')"
        )
    if expect is not None and server != expect:
        raise AuthError(f"control channel: expected cluster {expect}, the peer is {server}")
    return Session(sock, server, _mac(secret, b"k", ns, nc), deadline)


def server_handshake(sock: socket.socket, secret: bytes, me: int, deadline: _Deadline) -> Session:
    """The server's half: a fresh challenge, the client's proof checked in constant time,
    then this node's proof."""
    ns = secrets.token_bytes(_NONCE)
    _frame(sock, json.dumps({"v": 1, "nonce": ns.hex()}).encode())
    answer = _parse(_read_frame(sock, MAX_HELLO, deadline))
    nc, client = _hex(answer, "nonce", _NONCE), _cid(answer, "from")
    want = _mac(secret, b"c", ns, nc, str(client).encode())
    if not hmac.compare_digest(_hex(answer, "mac", _MAC), want):
        try:
            _frame(sock, b'{"error": "authentication failed"}')
        except OSError:
            pass
        raise AuthError(f"control channel: a client claiming cluster {client} failed to prove it")
    mac_s = _mac(secret, b"s", ns, nc, str(client).encode(), str(me).encode())
    _frame(sock, json.dumps({"cluster_id": me, "mac": mac_s.hex()}).encode())
    return Session(sock, client, _mac(secret, b"k", ns, nc), deadline)


class Auth:
    """This node's identity on the control channel: its cluster id and the shared secret
    (empty: the loopback-only unauthenticated mode, docs/DATADIST.md "Security")."""

    def __init__(self, cluster_id: int, secret: bytes):
        self.cluster_id, self.secret = cluster_id, secret


def request(
    address: tuple[str, int],
    msg: dict[str, Any],
    timeout_s: float,
    auth: Auth,
    expect: int | None = None,
) -> tuple[int, dict[str, Any]]:
    """Authenticate to a node's control server, send ``msg``, return ``(its cluster id,
    its reply)``; the whole exchange is bounded by ``timeout_s``.

    Raises
    ------
    OSError
        Connection refused, reset or timed out (``TimeoutError``), a failed
        authentication (:class:`AuthError`) or a malformed reply (ConnectionError).
    """
    deadline = _Deadline(timeout_s)
    with socket.create_connection(address, timeout=timeout_s) as sock:
        session = client_handshake(sock, auth.secret, auth.cluster_id, expect, deadline)
        session.send(b"q", msg)
        return session.peer, session.recv(b"r")


class ControlServer:
    """Serves authenticated requests: ``handler(peer_cluster_id, msg) -> reply``, one
    thread per connection.

    Parameters
    ----------
    host : str
    port : int
        0 picks a free port; :attr:`address` tells which.
    handler : callable
        Called for each authenticated request; an exception becomes
        ``{"error": message}`` (and is logged).
    auth : Auth
    timeout_s : float
        Whole-connection deadline: handshake, request and reply.
    """

    def __init__(
        self,
        host: str,
        port: int,
        handler: Callable[[int, dict[str, Any]], dict[str, Any]],
        auth: Auth,
        timeout_s: float = 5.0,
    ):
        self._handler, self._auth, self._timeout = handler, auth, timeout_s
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
            self._sock.listen(128)
        except OSError:
            self._sock.close()
            raise
        # Bounded accept so that close() is noticed promptly.
        self._sock.settimeout(0.1)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._stop = threading.Event()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._pending: dict[socket.socket, None] = {}  # in the handshake, oldest first
        self._plock = threading.Lock()
        #: Connections refused or dropped, by reason (observability, tests).
        self.dropped: dict[str, int] = {}
        self._thread = threading.Thread(
            target=self._serve, name=f"pytrt_kv-datadist-control-{self.address[1]}", daemon=True
        )
        self._thread.start()

    @property
    def alive(self) -> bool:
        """True while the server accepts connections."""
        return self._thread.is_alive() and not self._stop.is_set()

    def _count(self, why: str) -> None:
        self.dropped[why] = self.dropped.get(why, 0) + 1

    def _serve(self) -> None:
        backoff = 0.0
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
                backoff = 0.0
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stop.is_set() or exc.errno == errno.EBADF:
                    return
                # EMFILE/ENFILE/ENOBUFS/ENOMEM, ECONNABORTED...: wait and retry.
                backoff = min(1.0, max(0.01, 2 * backoff))
                self._count(errno.errorcode.get(exc.errno or 0, "accept"))
                log.warning(
                    "datadist control: accept failed (%s); retrying in %.2f s", exc, backoff
                )
                self._stop.wait(backoff)
                continue
            except Exception:  # never lose the server
                log.exception("datadist control: accept loop")
                self._stop.wait(0.01)
                continue
            if not self._slots.acquire(blocking=False):
                self._count("busy")
                conn.close()
                continue
            self._admit(conn)
            try:
                threading.Thread(target=self._connection, args=(conn,), daemon=True).start()
            except Exception:
                self._authenticated(conn)
                self._slots.release()
                conn.close()
                self._count("thread")
                log.exception("datadist control: cannot start a connection thread")

    def _admit(self, conn: socket.socket) -> None:
        """Count ``conn`` as unauthenticated; past the cap, cut the oldest such one."""
        with self._plock:
            self._pending[conn] = None
            victim = None
            if len(self._pending) > MAX_UNAUTHENTICATED:
                victim = next(iter(self._pending))
                del self._pending[victim]
        if victim is not None:
            self._count("evicted")
            try:
                victim.shutdown(socket.SHUT_RDWR)  # its thread's recv ends at once
            except OSError:
                pass

    def _authenticated(self, conn: socket.socket) -> None:
        with self._plock:
            self._pending.pop(conn, None)

    def _connection(self, conn: socket.socket) -> None:
        try:
            with conn:
                deadline = _Deadline(self._timeout)
                try:
                    session = server_handshake(
                        conn, self._auth.secret, self._auth.cluster_id, deadline
                    )
                    self._authenticated(conn)
                    msg = session.recv(b"q")
                except AuthError as exc:
                    self._count("auth")
                    log.warning("datadist control: %s", exc)
                    return
                except (OSError, ValueError, RecursionError) as exc:
                    self._count("malformed")
                    log.info("datadist control: connection dropped: %s", exc)
                    return
                try:
                    reply = self._handler(session.peer, msg)
                except Exception as exc:  # the peer gets the reason, the server lives on
                    log.warning("datadist control: request %r failed: %r", msg.get("op"), exc)
                    reply = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
                try:
                    session.send(b"r", reply)
                except OSError:
                    pass
        except Exception:
            log.exception("datadist control: connection")
        finally:
            self._authenticated(conn)
            self._slots.release()

    def close(self, timeout_s: float | None = 2.0) -> None:
        self._stop.set()
        try:
            self._sock.close()
        except OSError:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
