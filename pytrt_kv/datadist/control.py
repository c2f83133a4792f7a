"""The control channel: link handshakes and cache-table messages over TCP.

Data never goes through here (NIXL moves it); this carries only the small metadata a
link needs, like the side channel vLLM and SGLang use next to NIXL: each node listens on
``listen_ip:listen_port`` (``initialize``), and a request is one short connection (one
length-prefixed JSON message each way), so no state outlives a call and every wait is
bounded by a socket timeout.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

#: Refuse messages larger than this (a table of thousands of caches is far below it).
MAX_MESSAGE = 64 << 20
_LEN = struct.Struct("!I")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        part = sock.recv(min(n, 1 << 20))
        if not part:
            raise ConnectionError("control channel: the peer closed the connection")
        chunks.append(part)
        n -= len(part)
    return b"".join(chunks)


def send_message(sock: socket.socket, msg: dict[str, Any]) -> None:
    data = json.dumps(msg).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_message(sock: socket.socket) -> dict[str, Any]:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_MESSAGE:
        raise ConnectionError(f"control channel: message of {n} bytes refused")
    msg = json.loads(_recv_exact(sock, n))
    if not isinstance(msg, dict):
        raise ConnectionError("control channel: malformed message")
    return msg


def request(address: tuple[str, int], msg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Send ``msg`` to a node's control server and return its reply.

    Raises
    ------
    OSError
        Connection refused, reset or timed out (``socket.timeout`` is an OSError), or a
        malformed reply (ConnectionError).
    """
    with socket.create_connection(address, timeout=timeout_s) as sock:
        sock.settimeout(timeout_s)
        send_message(sock, msg)
        return recv_message(sock)


class ControlServer:
    """Serves requests on a background thread: ``handler(msg) -> reply``.

    Parameters
    ----------
    host : str
    port : int
        0 picks a free port; :attr:`address` tells which.
    handler : callable
        Called on the server thread for each request; an exception becomes
        ``{"error": message}``.
    """

    def __init__(
        self,
        host: str,
        port: int,
        handler: Callable[[dict[str, Any]], dict[str, Any]],
        timeout_s: float = 5.0,
    ):
        self._handler = handler
        self._timeout = timeout_s
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
            self._sock.listen(64)
        except OSError:
            self._sock.close()
            raise
        # Bounded accept so that close() is noticed promptly.
        self._sock.settimeout(0.1)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, name=f"pytrt_kv-datadist-control-{self.address[1]}", daemon=True
        )
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(self._timeout)
                try:
                    msg = recv_message(conn)
                except (OSError, ValueError):
                    continue
                try:
                    reply = self._handler(msg)
                except Exception as exc:  # the peer gets the reason, the server lives on
                    reply = {"error": f"{type(exc).__name__}: {exc}"}
                try:
                    send_message(conn, reply)
                except OSError:
                    continue

    def close(self, timeout_s: float | None = 2.0) -> None:
        self._stop.set()
        try:
            self._sock.close()
        except OSError:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
