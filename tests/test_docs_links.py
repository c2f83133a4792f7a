"""Every document the repository cites is in the repository.

Checked over the whole tree (code comments, docstrings, messages and docs alike):

- Markdown links (``[text](target)``, outside code) point at an existing file or folder,
  and a ``#anchor`` at a heading of the target (GitHub's slugs);
- no citation of documents kept outside the repository: ``OPS.md``, ``shared/...``,
  ``STYLE habit N``, the numbered upstream pages (``reference/001``);
- every cited document path (``docs/X.md``, or a capitalised ``NAME.md``) exists, next to
  the citing file, at the top level or in ``docs/``;
- every section a citation names (``docs/SPEC.md G5``, ``docs/SPEC.md S3-S5``) is a
  section of docs/SPEC.md.

``scripts/fix_spec_citations.py`` rewrites the old citations into this form.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _load_fix_script():
    spec = importlib.util.spec_from_file_location(
        "fix_spec_citations", REPO / "scripts" / "fix_spec_citations.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("fix_spec_citations", module)
    spec.loader.exec_module(module)
    return module


fix = _load_fix_script()

# --- Markdown structure ------------------------------------------------------------------

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
_LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def prose_lines(text: str) -> list[str]:
    """The lines of a Markdown text with fenced code blanked (line numbers kept)."""
    out, fence = [], None
    for line in text.splitlines():
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            out.append("")
        elif fence is not None:
            if line.strip().startswith(fence):
                fence = None
            out.append("")
        else:
            out.append(line)
    return out


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading (before de-duplication)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a Markdown text, duplicates suffixed -1, -2 as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(text):
        m = _HEADING.match(line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def spec_sections(root: Path) -> set[str]:
    """Section ids of docs/SPEC.md: headings ``S.``, ``S6.`` ... (empty when missing)."""
    path = root / "docs" / "SPEC.md"
    if not path.is_file():
        return set()
    ids = set()
    for line in prose_lines(path.read_text(encoding="utf-8")):
        m = re.match(r"^#{2,4}\s+([A-Z]\d*)\.\s", line)
        if m:
            ids.add(m.group(1))
    return ids


def style_habits(root: Path) -> set[int]:
    """Numbers of the house-style habits in docs/ARCHITECTURE.md ("## House style")."""
    path = root / "docs" / "ARCHITECTURE.md"
    if not path.is_file():
        return set()
    text = path.read_text(encoding="utf-8")
    section = text.split("## House style", 1)[1] if "## House style" in text else ""
    return {int(n) for n in re.findall(r"^(\d+)\. ", section, re.M)}


# --- the checks --------------------------------------------------------------------------

#: Documents that exist only outside the repository (the old design notes).
_OUTSIDE = [
    (re.compile(r"(?<![\w-])OPS\.md\b"), "OPS.md is not in the repository: cite docs/SPEC.md"),
    (
        re.compile(r"(?<![\w-])shared/(?:spec|design|reference)\b"),
        "shared/ is not in the repository: cite docs/",
    ),
    (
        re.compile(r"\bSTYLE(?:\.md)?,?\s+habit\b"),
        "the style notes are docs/ARCHITECTURE.md (habit N)",
    ),
    (
        re.compile(r"(?<![\w/-])reference/00\d\b"),
        "the numbered upstream pages are not in the repository: name the API (docs/SPEC.md)",
    ),
]
_DOC_PATH = re.compile(r"(?<![\w./-])((?:\.{1,2}/)*(?:[\w.-]+/)*[\w.-]+\.md)\b")
_CAPS_MD = re.compile(r"^[A-Z][A-Z0-9_]*\.md$")
_SPEC_CITE = re.compile(
    r"\bSPEC\.md[,:]?\s+(?:sections?\s+)?"
    r"((?:[A-Z]\d+|[SGODR])\b(?:(?:\s*[-\u2013/,]\s*|\s+and\s+)(?:[A-Z]?\d+|[SGODR])\b)*)"
)


_HABIT_CITE = re.compile(r"\bARCHITECTURE\.md,?\s+habits?\s+(\d+)")


def _doc_exists(token: str, file: Path, root: Path) -> bool:
    candidates = [root / token, file.parent / token]
    if "/" not in token:
        candidates.append(root / "docs" / token)
    return any(c.is_file() for c in candidates)


def _cited_ids(span: str) -> list[str]:
    """``S3-S5`` -> S3, S4, S5; ``G4/G5`` -> G4, G5; ``G3-5`` -> G3, G4, G5."""
    ids: list[str] = []
    letter = ""
    parts = re.split(r"(\s*[-\u2013]\s*|\s*[/,]\s*|\s+and\s+)", span)
    pending_range = False
    for part in parts:
        if re.fullmatch(r"\s*[-\u2013]\s*", part):
            pending_range = True
            continue
        m = re.fullmatch(r"([A-Z]?)(\d*)", part.strip())
        if not m or not part.strip():
            continue
        letter = m.group(1) or letter
        num = m.group(2)
        if pending_range and ids and num and re.fullmatch(r"[A-Z]\d+", ids[-1]):
            start = int(ids[-1][1:])
            ids.extend(f"{letter}{i}" for i in range(start + 1, int(num) + 1))
        else:
            ids.append(f"{letter}{num}")
        pending_range = False
    return ids


def reference_problems(
    path: Path, text: str, root: Path, sections: set[str], habits: set[int] = frozenset()
) -> list[str]:
    """Citations in ``text`` of documents or sections that do not exist."""
    rel = path.relative_to(root).as_posix()
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for pattern, why in _OUTSIDE:
            for m in pattern.finditer(line):
                out.append(f"{rel}:{lineno}: {m.group(0)!r}: {why}")
        for m in _DOC_PATH.finditer(line):
            token = m.group(1)
            name = token.rsplit("/", 1)[-1]
            if name == "OPS.md":
                continue  # reported above
            if not (_CAPS_MD.match(name) or token.startswith("docs/") or "/docs/" in token):
                continue  # a lowercase file name is an output (summary.md), not a document
            if not _doc_exists(token, path, root):
                out.append(f"{rel}:{lineno}: {token!r}: no such document in the repository")
        for m in _HABIT_CITE.finditer(line):
            if int(m.group(1)) not in habits:
                out.append(
                    f"{rel}:{lineno}: {m.group(0)!r}: docs/ARCHITECTURE.md has no "
                    f"habit {m.group(1)}"
                )
        for m in _SPEC_CITE.finditer(line):
            for sid in _cited_ids(m.group(1)):
                if sid not in sections:
                    out.append(f"{rel}:{lineno}: {m.group(0)!r}: docs/SPEC.md has no section {sid}")
    return out


def link_problems(path: Path, text: str, root: Path) -> list[str]:
    """Markdown links of ``path`` to missing files, folders or anchors."""
    rel = path.relative_to(root).as_posix()
    out = []
    for lineno, line in enumerate(prose_lines(text), 1):
        for m in _LINK.finditer(_INLINE_CODE.sub("", line)):
            target = m.group(1)
            if _SCHEME.match(target):
                continue
            where, _, anchor = target.partition("#")
            dest = (path.parent / where).resolve() if where else path
            if root.resolve() not in (dest, *dest.parents):
                out.append(f"{rel}:{lineno}: link {target!r} leaves the repository")
                continue
            if not dest.exists():
                out.append(f"{rel}:{lineno}: link {target!r}: no such file")
                continue
            if anchor and dest.suffix == ".md":
                if anchor not in anchors(dest.read_text(encoding="utf-8")):
                    out.append(
                        f"{rel}:{lineno}: link {target!r}: no heading #{anchor} in "
                        f"{dest.relative_to(root.resolve()).as_posix()}"
                    )
    return out


def all_problems(root: Path) -> list[str]:
    root = root.resolve()
    sections = spec_sections(root)
    habits = style_habits(root)
    out = []
    if not sections:
        out.append("docs/SPEC.md: missing, or without section headings")
    for path, text in fix.text_files(root):
        out += reference_problems(path, text, root, sections, habits)
        if path.suffix == ".md":
            out += link_problems(path, text, root)
    return out


# --- tests -------------------------------------------------------------------------------


def test_spec_has_every_section_id():
    want = {
        "S",
        "G",
        "O",
        "D",
        "R",
        *(f"S{i}" for i in range(1, 10)),
        *(f"G{i}" for i in range(1, 8)),
        *(f"D{i}" for i in range(1, 9)),
        *(f"R{i}" for i in range(1, 7)),
    }
    assert spec_sections(REPO) == want


def test_repository_cites_only_documents_it_contains():
    problems = all_problems(REPO)
    assert not problems, (
        f"{len(problems)} citation(s) of missing documents or sections "
        "(`python3 scripts/fix_spec_citations.py` rewrites the old ones):\n" + "\n".join(problems)
    )


def pyproject_extras(text: str) -> set[str]:
    """Names of ``[project.optional-dependencies]`` (no tomllib: Python 3.10 has none)."""
    m = re.search(r"^\[project\.optional-dependencies\]\n(.*?)(?=^\[)", text, re.M | re.S)
    return set(re.findall(r"^([A-Za-z0-9][\w.-]*)\s*=", m.group(1), re.M)) if m else set()


def test_readme_lists_exactly_the_extras_pyproject_declares():
    declared = pyproject_extras((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `\[([\w-]+)\]` \|", readme, re.M))
    assert declared, "pyproject.toml: no [project.optional-dependencies]"
    assert listed == declared, (
        f"README extras table {sorted(listed)} != pyproject.toml extras {sorted(declared)}"
    )


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    (tmp_path / "docs").mkdir(exist_ok=True)
    (tmp_path / "docs" / "SPEC.md").write_text(
        "# Spec\n\n## S. Scatter\n\n### S1. Signature\n\n### S2. Choosing\n\n## O. ONNX\n"
    )
    for name, text in files.items():
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    "name,text,expect",
    [
        ("a.py", "# see OPS.md S3\n", "OPS.md"),
        ("a.py", "'''shared/spec/OPS.md section G'''\n", "shared/"),
        ("a.cpp", "// house style (STYLE habit 3)\n", "ARCHITECTURE"),
        ("a.py", "# reference/001 single-op example\n", "upstream"),
        ("a.py", "# docs/MISSING.md explains\n", "no such document"),
        ("a.h", "//! see NOTES.md\n", "no such document"),
        ("a.py", "# docs/SPEC.md S9\n", "no section S9"),
        ("a.py", "# docs/SPEC.md S1-S3\n", "no section S3"),
        ("a.py", "# docs/SPEC.md S1/G2\n", "no section G2"),
        ("docs/a.md", "see SPEC.md G3\n", "no section G3"),
        ("a.cpp", "// docs/ARCHITECTURE.md habit 13\n", "no habit 13"),
        ("README.md", "[x](docs/none.md)\n", "no such file"),
        ("README.md", "[x](docs/SPEC.md#s9-nothing)\n", "no heading"),
        ("docs/a.md", "[x](#nowhere)\n", "no heading"),
        ("docs/a.md", "[x](../../outside.md)\n", "leaves the repository"),
    ],
)
def test_checker_reports(tmp_path, name, text, expect):
    problems = all_problems(_tree(tmp_path, {name: text}))
    assert problems and all(p.startswith(f"{name}:1: ") for p in problems), problems
    assert any(expect in p for p in problems), problems


@pytest.mark.parametrize(
    "name,text",
    [
        ("a.py", "# docs/SPEC.md S1-S2, O; docs/SPEC.md section S\n"),
        ("README.md", "[spec](docs/SPEC.md#s2-choosing) and [top](#title)\n\n# Title\n"),
        ("docs/a.md", "[s](SPEC.md#o-onnx) `[not](a/link.md)`\n\n```\n[x](none.md)\n```\n"),
        ("a.sh", "# writes out/summary.md and https://example.com/X/README.md\n"),
    ],
)
def test_checker_accepts(tmp_path, name, text):
    assert all_problems(_tree(tmp_path, {name: text})) == []


def test_fix_script_output_passes_the_checker(tmp_path):
    root = _tree(
        tmp_path,
        {
            "pkg/a.py": '"""Reference (shared/spec/OPS.md section S; OPS.md S1, S2).\n\n'
            'House style (shared/design/STYLE.md habit 3; ARCHITECTURE.md)."""\n',
            "tests/t.py": '"""reference/001 single-op example; never zeros (STYLE habit 7)."""\n',
            "docs/ops/X.md": "the contract is [OPS.md section S](../../shared/spec/OPS.md)\n",
            "docs/ARCHITECTURE.md": "# Arch\n\n## House style\n\n3. Errors.\n7. Random.\n",
        },
    )
    before = all_problems(root)
    assert {p.split(":")[0] for p in before} == {"pkg/a.py", "tests/t.py", "docs/ops/X.md"}
    assert fix.main(["--root", str(root)]) == 0
    assert all_problems(root) == []
    assert (root / "docs/ops/X.md").read_text() == (
        "the contract is [docs/SPEC.md section S](../SPEC.md)\n"
    )
    assert "docs/SPEC.md section S; docs/SPEC.md S1, S2" in (root / "pkg/a.py").read_text()
    assert "docs/ARCHITECTURE.md habit 3; docs/ARCHITECTURE.md" in (root / "pkg/a.py").read_text()
    assert fix.main(["--root", str(root), "--check"]) == 0  # idempotent: nothing left
