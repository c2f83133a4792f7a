"""Choosing a transport: the local one, or NIXL where it imports (docs/DATADIST.md).

Above both :mod:`.transport` (the base class and the in-process transport) and
:mod:`.nixl_transport` (which builds on that base), so neither imports the other back.
"""

from __future__ import annotations

from typing import Any

from .transport import LocalTransport, Transport
from .types import LLMException


def make_transport(
    backend: str, name: str, options: dict[str, Any], listen_ip: str | None = None
) -> Transport:
    """``listen_ip``: the address the node listens on; the NIXL backend's own listeners
    bind it only (docs/SPEC.md D7)."""
    if backend == "local":
        return LocalTransport(name, options)
    if backend == "nixl":
        from .nixl_transport import NixlTransport

        return NixlTransport(name, options, listen_ip)
    raise ValueError(f"backend: expected 'nixl' or 'local', got {backend!r}")


def nixl_unavailable_reason() -> str | None:
    """None when NIXL imports here, else why not: one line (a skip reason, a CLI error),
    the cause and how to install NIXL, without the LLMException status prefix."""
    from .nixl_transport import nixl_modules

    try:
        nixl_modules()
    except LLMException as exc:
        return " ".join(exc.message.split())
    return None
