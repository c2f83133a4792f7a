"""Fault injection for the datadist tests (test only; docs/DATADIST.md "Failure
semantics")."""

from __future__ import annotations

import time


def deaf_to_drops(node, for_s: float) -> None:
    """``node``'s control server loses every deallocate notice: it answers after the sender
    gave up and applies nothing. Set before ``initialize``, which hands ``_handle`` to the
    server."""
    real = node._handle

    def handle(who, msg):
        if msg.get("op") == "drop":
            time.sleep(for_s)
            return {}
        return real(who, msg)

    node._handle = handle
