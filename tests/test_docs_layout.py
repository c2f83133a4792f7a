"""README's "Layout" section names every package folder and every docs page.

The section is README.md from ``## Layout`` to the next ``## `` heading (the folder map and
the table of docs pages). A folder counts as named when its path with a trailing slash
(``pytrt_kv/graph/``) appears there; a page when its path (``docs/SPEC.md``) does.

Folders checked: each top-level source folder (:data:`ROOTS`) and each folder directly
inside one that holds a file (``pytrt_kv/graph/``, ``onnx_export/decoder/``,
``benchmarks/results/``, ``tests/support/``); deeper folders (``contract/scatter/``) are
their parent's business. Pages checked: ``docs/*.md``, ``docs/ops/*.md`` and the
top-level ``*.md`` other than README itself and LICENSE.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: The top-level folders of the repository's own sources and results.
ROOTS = (
    "pytrt_kv",
    "onnx_export",
    "plugins",
    "scripts",
    "benchmarks",
    "examples",
    "tests",
    "cmake",
)

#: Folders never named: caches and build outputs a checkout may hold.
_IGNORED = re.compile(r"^(__pycache__|\..*|.*\.egg-info|build|dist)$")


def layout_section(readme: str) -> str:
    """README's ``## Layout`` section (empty when there is none)."""
    m = re.search(r"^## Layout\s*$(.*?)(?=^## |\Z)", readme, re.M | re.S)
    return m.group(1) if m else ""


def _has_file(folder: Path) -> bool:
    for path in folder.rglob("*"):
        if path.is_file() and not any(_IGNORED.match(p) for p in path.relative_to(folder).parts):
            return True
    return False


def package_folders(root: Path) -> list[str]:
    """``ROOT/`` and ``ROOT/SUB/`` for every root of :data:`ROOTS` and its subfolders."""
    out = []
    for name in ROOTS:
        top = root / name
        if not top.is_dir():
            continue
        out.append(f"{name}/")
        for sub in sorted(top.iterdir()):
            if sub.is_dir() and not _IGNORED.match(sub.name) and _has_file(sub):
                out.append(f"{name}/{sub.name}/")
    return out


def docs_pages(root: Path) -> list[str]:
    pages = [p for p in root.glob("*.md") if p.name != "README.md"]
    pages += [*(root / "docs").glob("*.md"), *(root / "docs" / "ops").glob("*.md")]
    return sorted(p.relative_to(root).as_posix() for p in pages)


def unnamed(root: Path) -> list[str]:
    """Package folders and docs pages that README's layout section does not name."""
    section = layout_section((root / "README.md").read_text(encoding="utf-8"))
    if not section:
        return ["README.md: no '## Layout' section"]
    return [
        f"{path} is not named in README.md's Layout section"
        for path in [*package_folders(root), *docs_pages(root)]
        if not re.search(rf"(?<![\w/.-]){re.escape(path)}", section)
    ]


def test_readme_layout_names_every_folder_and_page():
    problems = unnamed(REPO)
    assert not problems, "\n".join(problems)


def test_the_repository_has_what_the_check_looks_for():
    folders = package_folders(REPO)
    assert {"pytrt_kv/graph/", "onnx_export/decoder/", "tests/support/"} <= set(folders)
    assert {"docs/SPEC.md", "docs/ops/ScatterPaKvCache.md", "BENCHMARKS.md"} <= set(
        docs_pages(REPO)
    )


def _tree(tmp_path: Path, readme: str, files: list[str]) -> Path:
    (tmp_path / "README.md").write_text(readme)
    for name in files:
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("x\n")
    return tmp_path


#: The fake tree's pages, spelt so that test_docs_links does not take them for citations.
_SPEC, _OP = "/".join(("docs", "SPEC.md")), "/".join(("docs", "ops", "y.md"))
_FILES = ["pytrt_kv/__init__.py", "pytrt_kv/graph/check.py", _SPEC, _OP]
_FULL = f"# p\n\n## Layout\n\npytrt_kv/ pytrt_kv/graph/ {_SPEC} {_OP}\n\n## Next\n"


def test_checker_accepts_a_complete_section(tmp_path):
    assert unnamed(_tree(tmp_path, _FULL, [*_FILES, "pytrt_kv/__pycache__/a.pyc"])) == []


@pytest.mark.parametrize(
    "readme,missing",
    [
        (_FULL.replace("pytrt_kv/graph/ ", ""), "pytrt_kv/graph/"),
        (_FULL.replace(f" {_OP}", ""), _OP),
        (_FULL.replace(_SPEC, "my" + _SPEC), _SPEC),
        # named only outside the section does not count
        (_FULL.replace(f" {_SPEC}", "") + _SPEC + "\n", _SPEC),
        (_FULL.replace("## Layout", "## Other"), "no '## Layout'"),
    ],
)
def test_checker_reports_what_is_missing(tmp_path, readme, missing):
    problems = unnamed(_tree(tmp_path, readme, _FILES))
    assert len(problems) == 1 and missing in problems[0], problems
