"""Format (or check) every C++/CUDA source of the project with the pinned clang-format.

The formatter is the ``clang-format`` wheel of the ``test`` extra (pyproject.toml), run
from the Python environment that runs this script, never a clang-format found on PATH:
formatting must not depend on which LLVM a machine happens to have. Style: .clang-format
at the repository root (TensorRT OSS's settings).

Usage (from the repository root)::

    python scripts/format_cpp.py           # rewrite the files in place
    python scripts/format_cpp.py --check   # exit 1 and list the files that differ

``tests/test_clang_format.py`` runs the check.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Folders holding C/C++/CUDA sources, and the suffixes formatted (.c: the one CPython
#: extension module, plugins/python/smallpush.c, in PEP 7 style: plugins/python/.clang-format).
SOURCE_DIRS = ("plugins",)
SUFFIXES = (".h", ".hpp", ".cpp", ".cc", ".c", ".cu", ".cuh")


def sources() -> list[Path]:
    """Every C++/CUDA source under :data:`SOURCE_DIRS`, sorted."""
    return sorted(
        p
        for d in SOURCE_DIRS
        for p in (ROOT / d).rglob("*")
        if p.is_file() and p.suffix in SUFFIXES
    )


def executable() -> str:
    """The clang-format binary of the ``clang-format`` wheel installed in this Python."""
    try:
        import clang_format
    except ImportError:
        raise SystemExit(
            "clang-format: the 'clang-format' wheel is not installed in "
            f"{sys.executable}; install the test extra: pip install -e '.[test]'"
        ) from None
    return clang_format.get_executable("clang-format")


def run(check: bool, files: list[Path]) -> subprocess.CompletedProcess:
    """clang-format over ``files``: ``--dry-run --Werror`` when ``check``, else ``-i``."""
    args = ["--dry-run", "--Werror"] if check else ["-i"]
    return subprocess.run(
        [executable(), "--style=file", *args, *map(str, files)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 if any file is not formatted"
    )
    args = parser.parse_args(argv)
    r = run(args.check, sources())
    sys.stdout.write(r.stdout)
    sys.stderr.write(r.stderr)
    return 0 if r.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
