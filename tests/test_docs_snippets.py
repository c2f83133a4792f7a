"""Every code snippet in README.md and docs/ that can run here runs as written.

- every ```python block is a complete program: it runs in a fresh interpreter, in an
  empty folder, and must exit 0 (``assert`` statements in it are the checks);
- a ```bash block tagged ``run`` (```bash run) is run with bash, with PATH reduced to the
  system's own folders and ``.venv`` standing for the virtual environment the README
  creates (this test's own environment), so a snippet cannot lean on a tool on PATH;
- tags name what a block needs and skip it, with that reason, only where it is absent:
  ``gpu`` (a CUDA GPU and the kernels), ``trt`` (TensorRT and a GPU), ``torch`` (the
  torch extra), ``rtx`` (the TensorRT-RTX wheel and the built plugins: engine builds
  without a GPU), ``llama`` (the study extra and the SmolLM2 model wheel). Any other tag
  is an error, so a misspelt tag cannot hide a snippet.

Other shell blocks (installs, builds, trtexec) are instructions: they are only checked to
be valid bash (``bash -n``).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.env import (
    gpu_unavailable_reason,
    llama_unavailable_reason,
    polygraphy_command,
    rtx_unavailable_reason,
    trt_unavailable_reason,
)

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
PYTHON = {"python", "py", "python3"}
SHELL = {"bash", "sh", "shell"}
TAGS = {"run", "gpu", "trt", "torch", "rtx", "llama"}
TIMEOUT = 600
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass
class Snippet:
    path: Path
    line: int
    lang: str
    tags: tuple[str, ...]
    code: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(REPO).as_posix()}:{self.line}"


def snippets() -> list[Snippet]:
    out = []
    for path in DOCS:
        lines = path.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            m = re.match(r"^(\s*)(```+|~~~+)\s*([\w+-]*)\s*(.*)$", lines[i])
            if not m:
                i += 1
                continue
            indent, fence, lang, rest = m.groups()
            start, body = i + 1, []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith(fence):
                body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
                i += 1
            i += 1
            out.append(Snippet(path, start, lang.lower(), tuple(rest.split()), "\n".join(body)))
    return out


ALL = snippets()
RUNNABLE = [s for s in ALL if s.lang in PYTHON or (s.lang in SHELL and "run" in s.tags)]


def _skip_reason(s: Snippet) -> str:
    if "trt" in s.tags and trt_unavailable_reason():
        return trt_unavailable_reason()
    if "gpu" in s.tags and gpu_unavailable_reason():
        return gpu_unavailable_reason()
    if "rtx" in s.tags and rtx_unavailable_reason():
        return rtx_unavailable_reason()
    if "llama" in s.tags and llama_unavailable_reason():
        return llama_unavailable_reason()
    if "torch" in s.tags:
        for module in ("torch", "onnxscript"):
            if importlib.util.find_spec(module) is None:
                return f"{module} not installed (extra 'torch')"
    return ""


def test_snippets_are_found_and_tagged_correctly():
    assert len([s for s in ALL if s.lang in PYTHON]) >= 8
    readme_shell = [s for s in RUNNABLE if s.path.name == "README.md" and s.lang in SHELL]
    assert any("polygraphy run" in s.code for s in readme_shell), "README's Polygraphy one-liner"
    bad = [
        f"{s.id}: {s.lang} {' '.join(s.tags)}"
        for s in ALL
        if (s.lang in PYTHON or s.lang in SHELL) and set(s.tags) - TAGS
    ]
    assert not bad, f"unknown tags (known: {sorted(TAGS)}):\n" + "\n".join(bad)
    bad = [s.id for s in ALL if s.lang in PYTHON and ">>>" in s.code]
    assert not bad, f"python blocks must be programs, not console sessions: {bad}"
    bad = [s.id for s in ALL if s.lang in PYTHON and "run" in s.tags]
    assert not bad, f"'run' is for shell blocks (every python block runs): {bad}"


@pytest.mark.parametrize("snippet", [s for s in ALL if s.lang in SHELL], ids=lambda s: s.id)
def test_shell_block_parses(snippet: Snippet, tmp_path):
    """Shell blocks that are not run here (installs, builds, trtexec) are at least valid
    bash, as a reader would paste them."""
    script = tmp_path / "snippet.sh"
    script.write_text(snippet.code + "\n")
    r = subprocess.run(["/bin/bash", "-n", str(script)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"{snippet.id}: not valid bash:\n{r.stderr}\n{snippet.code}"


def _venv(tmp_path: Path) -> dict:
    """``tmp_path/.venv`` = this test's environment; returns the environment to run in.

    Where the package is installed (scripts/test.sh) it is the real virtual environment,
    console scripts and all. From a plain checkout (PYTHONPATH) the console scripts do
    not exist: small stand-ins run the same entry points, and Polygraphy finds our
    extension through an equivalent entry-point record.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIRTUAL_ENV")}
    env["PATH"] = SYSTEM_PATH
    prefix = Path(sys.prefix)
    if (prefix / "bin" / "pytrt-kv").is_file() and (prefix / "bin" / "polygraphy").is_file():
        (tmp_path / ".venv").symlink_to(prefix, target_is_directory=True)
        return env
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    stand_ins = {
        "python": [sys.executable],
        "python3": [sys.executable],
        "pytrt-kv": [sys.executable, "-m", "pytrt_kv"],
        "polygraphy": polygraphy_command(),
    }
    for name, argv in stand_ins.items():
        script = bin_dir / name
        quoted = " ".join("'" + a.replace("'", "'\\''") + "'" for a in argv)
        script.write_text(f'#!/bin/sh\nexec {quoted} "$@"\n')
        script.chmod(0o755)
    dist = tmp_path / "ep" / "pytrt_kv_docs_test-0.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: pytrt-kv-docs-test\nVersion: 0.0\n"
    )
    (dist / "entry_points.txt").write_text(
        "[polygraphy.run.plugins]\npytrt-kv = pytrt_kv.polygraphy:export_argument_groups\n"
    )
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in [str(REPO), str(tmp_path / "ep"), env.get("PYTHONPATH", "")] if p
    )
    return env


@pytest.mark.parametrize("snippet", RUNNABLE, ids=lambda s: s.id)
def test_snippet_runs(snippet: Snippet, tmp_path):
    reason = _skip_reason(snippet)
    if reason:
        pytest.skip(f"{snippet.id} needs {'/'.join(snippet.tags)}: {reason}")
    if snippet.lang in PYTHON:
        script = tmp_path / "snippet.py"
        script.write_text(snippet.code + "\n")
        cmd, env = [sys.executable, str(script)], dict(os.environ)
    else:
        script = tmp_path / "snippet.sh"
        script.write_text(snippet.code + "\n")
        env = _venv(tmp_path)
        cmd = ["/bin/bash", "-euo", "pipefail", str(script)]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, (
        f"{snippet.id} exited {r.returncode}\n--- snippet\n{snippet.code}"
        f"\n--- stdout\n{r.stdout[-4000:]}\n--- stderr\n{r.stderr[-4000:]}"
    )
