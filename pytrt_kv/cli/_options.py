"""Option helpers shared by the command modules (not a command itself)."""

from __future__ import annotations

import argparse
from collections.abc import Iterable

#: One numeric option: its flag, type (int or float), default and what it counts.
Number = tuple[str, type, float, str]


def add_numbers(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, options: Iterable[Number]
) -> None:
    """Add one numeric option per row of ``options``; its help reads "what (default N)",
    so a help text never disagrees with the default it states."""
    for flag, kind, default, what in options:
        parser.add_argument(flag, type=kind, default=default, help=f"{what} (default {default:g})")
