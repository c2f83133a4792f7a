"""The import direction between layers (docs/ARCHITECTURE.md, "What may import what").

Every import statement of ``pytrt_kv/`` and ``onnx_export/`` is read with ``ast`` (lazy
imports inside functions included; relative imports resolved), so a new module that
breaks a rule fails here, naming the file, the line and the import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: pytrt_kv modules allowed to import onnx_export: the CLI, which ties the example model
#: to its commands.
CLI = {"pytrt_kv.__main__", "pytrt_kv.demo", "pytrt_kv.retrieval.demo"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``source``; ``from a import b``
    yields both ``a`` and ``a.b`` (b may be a submodule)."""
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((node.lineno, target))
            out += [
                (node.lineno, f"{target}.{alias.name}") for alias in node.names if alias.name != "*"
            ]
    return out


def all_imports() -> list[tuple[str, str, int, str]]:
    """(module, file, line, imported module) for every import of both packages."""
    out = []
    for top in ("pytrt_kv", "onnx_export"):
        for path in sorted((REPO / top).rglob("*.py")):
            mod = module_name(path)
            rel = str(path.relative_to(REPO))
            for line, target in imports(
                path.read_text(encoding="utf-8"), mod, path.name == "__init__.py"
            ):
                out.append((mod, rel, line, target))
    return out


def _in(target: str, *packages: str) -> bool:
    return any(target == p or target.startswith(p + ".") for p in packages)


def violations(found: list[tuple[str, str, int, str]]) -> list[str]:
    bad = []
    for mod, rel, line, target in found:
        where = f"{rel}:{line}: imports {target}"
        ours = _in(target, "pytrt_kv")
        if _in(mod, "pytrt_kv.contract") and (
            (ours and not _in(target, "pytrt_kv.contract")) or _in(target, "onnx_export")
        ):
            bad.append(f"{where} (the contract imports nothing else of pytrt_kv)")
        if mod == "pytrt_kv.reference" and ours and not _in(target, "pytrt_kv.contract"):
            bad.append(f"{where} (the reference imports only the contract)")
        if _in(mod, "pytrt_kv.graph") and (
            (ours and not _in(target, "pytrt_kv.contract", "pytrt_kv.reference", "pytrt_kv.graph"))
            or _in(target, "onnx_export")
        ):
            bad.append(
                f"{where} (the graph layer imports only the contract, the reference and itself)"
            )
        if _in(mod, "pytrt_kv") and mod not in CLI and _in(target, "onnx_export"):
            bad.append(
                f"{where} (onnx_export builds on pytrt_kv, not the other way; only "
                "the CLI may import it)"
            )
        if (
            _in(mod, "onnx_export")
            and ours
            and any(part.startswith("_") for part in target.split(".")[1:])
        ):
            bad.append(f"{where} (onnx_export uses public pytrt_kv modules only)")
    return bad


def test_imports_follow_the_layers():
    found = all_imports()
    assert len(found) > 100  # the walk saw the packages
    bad = violations(found)
    assert not bad, "imports against docs/ARCHITECTURE.md:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "mod, source, broken",
    [
        ("pytrt_kv.contract.x", "from .. import ops\n", "contract imports nothing else"),
        ("pytrt_kv.contract.x", "from . import specs\n", None),
        ("pytrt_kv.reference", "from .graph import feeds\n", "reference imports only"),
        ("pytrt_kv.graph.x", "def f():\n    from ..trt import build\n", "graph layer imports"),
        ("pytrt_kv.graph.x", "import onnx_export.models\n", "graph layer imports"),
        ("pytrt_kv.graph.x", "from ..contract.specs import OPS\nimport onnx\n", None),
        ("pytrt_kv.trt.x", "def f():\n    import onnx_export\n", "only the CLI"),
        ("pytrt_kv.demo", "def f():\n    from onnx_export.example import x\n", None),
        ("onnx_export.x", "from pytrt_kv._scatter import check_scatter\n", "public pytrt_kv"),
        ("onnx_export.x", "from pytrt_kv.graph.check import TensorInfo\n", None),
    ],
)
def test_rules_catch_a_broken_import(mod, source, broken):
    found = [(mod, "f.py", line, target) for line, target in imports(source, mod, is_package=False)]
    bad = violations(found)
    if broken is None:
        assert bad == []
    else:
        assert bad and broken in bad[0], bad


def test_tests_share_helpers_only_through_support():
    test_modules = {p.stem for p in (REPO / "tests").glob("test_*.py")} | {"conftest"}
    bad = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        for line, target in imports(path.read_text(encoding="utf-8"), path.stem, False):
            if target.split(".")[0] in test_modules:
                bad.append(f"{path.relative_to(REPO)}:{line}: imports {target}")
    assert not bad, "tests import other test modules (use tests/support/):\n" + "\n".join(bad)
