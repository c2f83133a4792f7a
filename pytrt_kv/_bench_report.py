"""Writing a benchmark's results (the kernel and the datadist benchmarks share it).

Below both benchmark modules, so neither imports the other to reach it
(docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def write_results(args: argparse.Namespace, text: str, raw: dict[str, Any]) -> None:
    """Print the Markdown table and write it to ``--output`` and ``raw`` to ``--json``
    (shared by the kernel and the datadist benchmarks)."""
    print()
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)
