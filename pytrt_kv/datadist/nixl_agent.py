"""Making the NIXL agent of a ``"nixl"`` node: importing NIXL (:func:`nixl_modules`), an
agent whose progress thread sleeps when idle (:func:`_make_agent`), and UCX listening only
on the node's interface (:func:`_net_devices`, docs/SPEC.md D7)."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import sys
from typing import Any

from .types import LLMException, LLMStatus

#: NIXL's per-CUDA-version wheels (the ``nixl`` meta package picks one of them).
_VARIANTS = ("nixl_cu13", "nixl_cu12")


def nixl_modules():
    """``(nixl._api, nixl._bindings)`` of the installed NIXL wheel.

    Where exactly one variant wheel is installed it is imported directly: the ``nixl``
    meta package would otherwise find the CUDA version by importing torch when torch is
    installed without CUDA (seconds per process, and torch in every node). With several
    variants the meta package chooses, as it would for any NIXL user.

    Raises
    ------
    LLMException
        FAILED, saying how to install NIXL, when it does not import.
    """
    try:
        found = [m for m in _VARIANTS if importlib.util.find_spec(m) is not None]
        if "nixl" in sys.modules or len(found) != 1:
            import nixl  # noqa: F401
            from nixl import _api, _bindings
        else:
            _api = importlib.import_module(f"{found[0]}._api")
            _bindings = importlib.import_module(f"{found[0]}._bindings")
        if not os.environ.get("NIXL_LOG_LEVEL"):
            # nixl logs every agent and backend creation at INFO on stdout, which is the
            # caller's channel (a process's protocol, a CLI's output): warnings only,
            # unless NIXL_LOG_LEVEL asks for more.
            logging.getLogger("nixl").setLevel(logging.WARNING)
    except Exception as exc:
        raise LLMException(
            LLMStatus.FAILED,
            f"the 'nixl' backend needs the nixl package: {exc} (install "
            f"nixl==1.5.1 and nixl-cu13==1.5.1 with --no-deps; see "
            f"docs/DATADIST.md), or use backend='local'",
        ) from exc
    return _api, _bindings


def _option(options: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    value = options.get(key, default)
    if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise TypeError(f"options[{key!r}]: expected an int >= 0, got {value!r}")
    if kind is bool and not isinstance(value, bool):
        raise TypeError(f"options[{key!r}]: expected a bool, got {value!r}")
    return value


def _make_agent(api: Any, b: Any, name: str, options: dict[str, Any], backends: list[str]) -> Any:
    """A ``nixl_agent`` whose progress thread sleeps when idle (docs/DATADIST.md, "Idle
    CPU").

    NIXL's Python ``nixl_agent`` always passes ``pthrDelay = 0`` to the C++ agent: the UCX
    progress thread then ``poll()``s its workers with a zero timeout and burns a core per
    node for as long as the node lives, transfers or not. With ``"nixl.progress_delay_us"``
    = d > 0 the thread blocks on the workers' event fds and wakes up at least every
    ceil(d / 1000) ms: work still wakes it at once, an idle node costs ~1% of a core.
    ``nixl_agent`` creates its backends after the C++ agent, so the agent is made with no
    backends, its C++ agent replaced by one with the delay, and then the backends created
    as ``nixl_agent`` would (nixl 1.5.1's ``_api.py``). ``"nixl.progress_thread": False``
    runs no progress thread at all: a transfer then only moves while one of its two nodes
    polls (``wait``/``received``), which stalls pushes into a decoder that is busy.
    """
    thread = _option(options, "nixl.progress_thread", bool, True)
    delay = _option(options, "nixl.progress_delay_us", int, 1000)
    num_threads = _option(options, "nixl.num_threads", int, 0)
    # The control thread loads peers' metadata while the caller transfers.
    sync = api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    conf = api.nixl_agent_config(
        enable_prog_thread=thread, enable_listen_thread=False, sync_mode=sync, backends=[]
    )
    agent = api.nixl_agent(name, conf)
    if thread and delay > 0:
        cpp = b.nixlAgentConfig()
        cpp.useProgThread, cpp.useListenThread = True, False
        cpp.syncMode, cpp.pthrDelay, cpp.lthrDelay = sync.value, delay, 100000
        agent.agent = b.nixlAgent(name, cpp)
    for backend in backends:
        if backend in agent.plugin_list:
            use = num_threads > 0 and backend in ("UCX", "OBJ", "LIBFABRIC")
            params = {"num_threads": str(num_threads)} if use else {}
            agent.create_backend(backend, params)
    return agent


def interface_of(ip: str) -> str | None:
    """The network interface whose IPv4 address is ``ip`` (None: none, or not Linux)."""
    import fcntl
    import socket
    import struct

    try:
        want = socket.inet_aton(socket.gethostbyname(ip))
    except OSError:
        return None
    if want[0] == 127:
        return "lo"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                addr = fcntl.ioctl(s.fileno(), 0x8915, req)[20:24]  # SIOCGIFADDR
            except OSError:
                continue
            if addr == want:
                return name
    return None


@contextlib.contextmanager
def _net_devices(listen_ip: str | None):
    """UCX listens (its TCP transport) on every interface unless ``UCX_NET_DEVICES`` names
    some, and NIXL 1.5.1's ``ucx_devices`` backend parameter did not change that here: while
    the agent's backends are created, ``UCX_NET_DEVICES`` names the interface of
    ``listen_ip`` (docs/SPEC.md D7), unless the caller set it or listens on every address
    (0.0.0.0)."""
    dev = None
    if listen_ip and listen_ip != "0.0.0.0" and "UCX_NET_DEVICES" not in os.environ:
        dev = interface_of(listen_ip)
    if dev is None:
        yield
        return
    os.environ["UCX_NET_DEVICES"] = dev
    try:
        yield
    finally:
        os.environ.pop("UCX_NET_DEVICES", None)
