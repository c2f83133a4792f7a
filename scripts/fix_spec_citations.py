#!/usr/bin/env python3
"""Rewrite citations of documents that are not in this repository into citations of the
ones that are.

The code was written against design notes kept outside the repository; the repository
now carries its own versions, with the same section ids:

=======================================================  ====================================
cited as                                                 becomes
=======================================================  ====================================
``OPS.md S6``, ``shared/spec/OPS.md``, ``../spec/OPS.md``  ``docs/SPEC.md S6``, ``docs/SPEC.md``
``ARCHITECTURE.md``, ``shared/design/ARCHITECTURE.md``   ``docs/ARCHITECTURE.md``
``STYLE habit 7``, ``shared/design/STYLE.md habit 3``    ``docs/ARCHITECTURE.md habit 7`` ...
``shared/reference/001_<hash>.txt``, ``reference/001``    the upstream API's name
=======================================================  ====================================

In Markdown files a link target is rewritten relative to the file
(``[S](../../shared/spec/OPS.md)`` in ``docs/ops/`` becomes ``[S](../SPEC.md)``).
The rewrite is idempotent. ``tests/test_docs_links.py`` checks the result.

Usage::

    python3 scripts/fix_spec_citations.py            # rewrite in place, list the files
    python3 scripts/fix_spec_citations.py --check    # list what would change; exit 1 if any
    python3 scripts/fix_spec_citations.py --root DIR # another checkout
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

#: Folders never scanned: build outputs, virtual environments, caches, VCS data.
SKIP_DIRS = {
    ".git",
    "build",
    "_skbuild",
    "dist",
    "out",
    "__pycache__",
    ".pytest_cache",
    ".hypothesis",
    ".trt-headers",
    "node_modules",
}
SKIP_DIR_PREFIXES = (".venv", "build-", "build_")
#: Files that name the old documents on purpose (this script and the test that checks).
SKIP_FILES = {"scripts/fix_spec_citations.py", "tests/test_docs_links.py"}
MAX_BYTES = 2_000_000

#: The Ascend / vLLM pages the operators come from, by their number in the old notes.
UPSTREAM = {
    "000": "the custom.npu_gather_selection_kv_cache API page",
    "001": "the torch_npu.npu_scatter_pa_kv_cache API page",
    "002": "the CANN/GE PushKvBlocks API page",
    "003": "the vllm-ascend RetrievalKV design page",
}

# A path ending in OPS.md / ARCHITECTURE.md / STYLE.md, with any folder prefix.
_PREFIX = r"(?:[\w.-]+/)*"
_OPS = re.compile(_PREFIX + r"(?<![\w-])OPS\.md\b")
_ARCH = re.compile(_PREFIX + r"(?<![\w-])ARCHITECTURE\.md\b")
_STYLE_HABIT = re.compile(_PREFIX + r"(?:\bSTYLE\.md|\bSTYLE)(?:,)?\s+habit\b")
_STYLE = re.compile(_PREFIX + r"(?<![\w-])STYLE\.md\b")
_UPSTREAM = re.compile(r"(?:[\w.-]+/)*reference/(00[0-3])(?:_[0-9a-f]+\.txt)?\b")
_MD_LINK = re.compile(r"(\]\()([^)\s]+)(\))")


def _replace_target(target: str, file: Path, root: Path) -> str:
    """A Markdown link target to an outside document -> the repository's, relative."""
    path, sep, anchor = target.partition("#")
    name = path.rsplit("/", 1)[-1]
    new = {
        "OPS.md": "docs/SPEC.md",
        "ARCHITECTURE.md": "docs/ARCHITECTURE.md",
        "STYLE.md": "docs/ARCHITECTURE.md",
    }.get(name)
    if new is None or (root / path).resolve() == (root / new).resolve():
        return target
    if (file.parent / path).resolve() == (root / new).resolve():
        return target
    rel = os.path.relpath(root / new, file.parent).replace(os.sep, "/")
    return rel + (sep + anchor if sep else "")


def rewrite(text: str, file: Path, root: Path) -> str:
    """``text`` of ``file`` with every outside citation replaced (idempotent)."""
    if file.suffix == ".md":
        text = _MD_LINK.sub(
            lambda m: m.group(1) + _replace_target(m.group(2), file, root) + m.group(3), text
        )
    # After a Markdown link target became relative (e.g. ``../SPEC.md``) the patterns
    # below no longer match it: they only touch the old names.
    text = _OPS.sub("docs/SPEC.md", text)
    text = _STYLE_HABIT.sub("docs/ARCHITECTURE.md habit", text)
    text = _STYLE.sub("docs/ARCHITECTURE.md", text)
    text = _ARCH.sub(
        lambda m: m.group(0) if _resolves(m.group(0), file, root) else "docs/ARCHITECTURE.md", text
    )
    text = _UPSTREAM.sub(lambda m: UPSTREAM[m.group(1)], text)
    return text


def _resolves(path: str, file: Path, root: Path) -> bool:
    return (root / path).is_file() or (file.parent / path).is_file()


def _candidates(root: Path) -> Iterator[Path]:
    """Files of the checkout: git's tracked and untracked-but-not-ignored files when
    ``root`` is a git work tree, else every file; never inside the skipped folders."""
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z", "-co", "--exclude-standard"],
            capture_output=True,
            timeout=60,
        )
        names = out.stdout.decode("utf-8", "replace").split("\0") if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        names = None
    if names is None:
        names = [
            str((Path(d) / f).relative_to(root)) for d, _, files in os.walk(root) for f in files
        ]
    for name in sorted(n for n in names if n):
        parts = Path(name).parts
        if any(
            p in SKIP_DIRS or p.startswith(SKIP_DIR_PREFIXES) or p.endswith(".egg-info")
            for p in parts[:-1]
        ):
            continue
        yield root / name


def text_files(root: Path) -> Iterator[tuple[Path, str]]:
    """(path, text) of every UTF-8 file of the checkout at ``root`` (see
    :func:`_candidates`), except :data:`SKIP_FILES`, links and binaries."""
    for path in _candidates(root):
        rel = path.relative_to(root).as_posix()
        if rel in SKIP_FILES or path.is_symlink() or not path.is_file():
            continue
        try:
            if path.stat().st_size > MAX_BYTES:
                continue
            data = path.read_bytes()
        except OSError:
            continue
        if b"\0" in data:
            continue
        try:
            yield path, data.decode("utf-8")
        except UnicodeDecodeError:
            continue


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--root",
        type=Path,
        default=Path(__file__).resolve().parents[1],
        help="checkout to rewrite (default: this script's repository)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="change nothing; list the files that would change, exit 1 if any",
    )
    args = parser.parse_args(argv)
    root = args.root.resolve()
    if not (root / "docs" / "SPEC.md").is_file():
        print(f"--root: expected a checkout with docs/SPEC.md, got {root}", file=sys.stderr)
        return 2
    changed = []
    for path, text in text_files(root):
        new = rewrite(text, path, root)
        if new != text:
            changed.append(path.relative_to(root).as_posix())
            if not args.check:
                path.write_text(new, encoding="utf-8")
    verb = "would change" if args.check else "rewrote"
    for rel in changed:
        print(f"{verb} {rel}")
    print(f"{len(changed)} file(s) {verb if changed else 'to change: none'}")
    return 1 if (args.check and changed) else 0


if __name__ == "__main__":
    sys.exit(main())
