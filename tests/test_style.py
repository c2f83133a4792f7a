"""Enforced style and types (docs/ARCHITECTURE.md): ruff lint, ruff format and mypy.

The tools are the pinned ones of the ``test`` extra (pyproject.toml), run with this
interpreter (``python -m ruff``, ``python -m mypy``), never whatever is on PATH. Their
configuration is pyproject.toml; the fix for a failure here is usually
``python -m ruff check --fix . && python -m ruff format .``.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(tool: str, *args: str) -> subprocess.CompletedProcess:
    if importlib.util.find_spec(tool) is None:
        pytest.fail(
            f"{tool} is not installed in {sys.executable}: install the test extra "
            f"(pip install '.[test]'; scripts/test.sh does)"
        )
    return subprocess.run(
        [sys.executable, "-m", tool, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_ruff_lint_is_clean():
    r = _run("ruff", "check", "--no-cache", ".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_format_is_clean():
    r = _run("ruff", "format", "--check", "--no-cache", ".")
    assert r.returncode == 0, "run `python -m ruff format .`:\n" + r.stdout + r.stderr


def test_mypy_is_clean(tmp_path):
    r = _run("mypy", "--cache-dir", str(tmp_path / "mypy"), "pytrt_kv")
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_pinned_tools_are_the_ones_running():
    # A tool of another version formats and checks differently: the test extra pins them.
    # (pyproject.toml read with a regex: tomllib needs Python 3.11, the package 3.10)
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    test_extra = re.search(r"^test = \[(.*?)^\]", text, re.M | re.S).group(1)
    pins = dict(re.findall(r'"([\w-]+)==([\w.]+)"', test_extra))
    assert {"ruff", "mypy"} <= set(pins)
    for tool in ("ruff", "mypy"):
        out = _run(tool, "--version").stdout.split()
        assert pins[tool] in out, f"{tool}: pinned {pins[tool]}, running {' '.join(out)}"


def test_the_package_ships_its_type_information():
    # PEP 561: py.typed in the package; scikit-build-core puts every file of the
    # wheel.packages directories into the wheel.
    assert (REPO / "pytrt_kv" / "py.typed").is_file()
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    packages = re.search(r"^wheel\.packages = \[(.*?)\]", text, re.M).group(1)
    assert '"pytrt_kv"' in packages


def test_mypy_passes_without_the_optional_extras():
    # `.[test]` alone lacks the optional runtimes (torch, transformers, TensorRT, ...):
    # every third-party module pytrt_kv imports that is not a required dependency must
    # be in a mypy ignore_missing_imports override, or test_mypy_is_clean fails there.
    import ast

    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    deps = re.search(r"^dependencies = \[(.*?)^\]", text, re.M | re.S).group(1)
    required = {re.split(r"[<>=!~ ]", d)[0].replace("-", "_") for d in re.findall(r'"(.*?)"', deps)}
    overrides = re.search(r"^\[\[tool\.mypy\.overrides\]\]\nmodule = \[(.*?)\]", text, re.M | re.S)
    ignored = {m.removesuffix(".*") for m in re.findall(r'"([\w.*]+)"', overrides.group(1))}
    imported = set()
    for path in (REPO / "pytrt_kv").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    ours = {"pytrt_kv", "onnx_export", "__future__"}
    optional = imported - set(sys.stdlib_module_names) - ours - required
    assert optional and optional <= ignored, sorted(optional - ignored)
