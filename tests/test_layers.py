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

#: The CLI (docs/ARCHITECTURE.md, "The CLI"): the only pytrt_kv code that may import
#: onnx_export, and only inside a function (the command's ``add_arguments``/``run``).
CLI = "pytrt_kv.cli"
#: The one module outside the graph layer it may import: the build record of the kernels
#: (their CUDA architectures, for check_model's targets; pure Python, no GPU).
GRAPH_LIB = "pytrt_kv._lib"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _nodes(tree: ast.AST, lazy: bool):
    """Every node of ``tree`` (``lazy``), or those run on import: not inside a function."""
    if lazy:
        yield from ast.walk(tree)
        return
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))


def imports(source: str, module: str, is_package: bool, lazy: bool = True) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``source`` (``lazy=False``: only
    those outside functions, run on import); ``from a import b`` yields both ``a`` and
    ``a.b`` (b may be a submodule)."""
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in _nodes(ast.parse(source), lazy):
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


def all_imports(lazy: bool = True) -> list[tuple[str, str, int, str]]:
    """(module, file, line, imported module) for every import of both packages
    (``lazy=False``: only the module-level ones)."""
    out = []
    for top in ("pytrt_kv", "onnx_export"):
        for path in sorted((REPO / top).rglob("*.py")):
            mod = module_name(path)
            rel = str(path.relative_to(REPO))
            for line, target in imports(
                path.read_text(encoding="utf-8"), mod, path.name == "__init__.py", lazy
            ):
                out.append((mod, rel, line, target))
    return out


def _in(target: str, *packages: str) -> bool:
    return any(target == p or target.startswith(p + ".") for p in packages)


def violations(
    found: list[tuple[str, str, int, str]], module_level: list[tuple[str, str, int, str]]
) -> list[str]:
    """``found``: every import (lazy ones included); ``module_level``: those run on import."""
    bad = []
    for mod, rel, line, target in module_level:
        if _in(mod, CLI) and _in(target, "onnx_export"):
            bad.append(
                f"{rel}:{line}: imports {target} (the CLI imports onnx_export inside "
                "functions only, never on import)"
            )
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
            (
                ours
                and not _in(
                    target, "pytrt_kv.contract", "pytrt_kv.reference", "pytrt_kv.graph", GRAPH_LIB
                )
            )
            or _in(target, "onnx_export")
        ):
            bad.append(
                f"{where} (the graph layer imports only the contract, the reference, itself "
                f"and {GRAPH_LIB} for the kernels' build record)"
            )
        if _in(mod, "pytrt_kv") and not _in(mod, CLI) and _in(target, "onnx_export"):
            bad.append(
                f"{where} (onnx_export builds on pytrt_kv, not the other way; only "
                "pytrt_kv.cli may import it, lazily)"
            )
        if (
            _in(mod, "onnx_export")
            and ours
            and any(part.startswith("_") for part in target.split(".")[1:])
        ):
            bad.append(f"{where} (onnx_export uses public pytrt_kv modules only)")
    return bad


#: Command modules (parse, call the library, print): pytrt_kv.cli and its shim
#: ``python -m pytrt_kv``. No library module imports them.
def is_command(mod: str) -> bool:
    return _in(mod, CLI) or mod == "pytrt_kv.__main__"


#: Old import paths kept for users (each IS the new module): our own code uses the new one.
COMPAT = {
    "pytrt_kv.specs": "pytrt_kv.contract.specs",
    "pytrt_kv.dtypes": "pytrt_kv.contract.dtypes",
    "pytrt_kv.runtime._evaluator": "pytrt_kv.runtime",
    "pytrt_kv.trt.model": "pytrt_kv.graph.tensorrt",
    "onnx_export.schemas": "pytrt_kv.graph.schemas",
    "onnx_export._check": "pytrt_kv.graph.check",
}


def direction_violations(found: list[tuple[str, str, int, str]]) -> list[str]:
    """Upward imports (a library module importing a command module) and imports of the
    compatibility paths by our own code."""
    bad = []
    for mod, rel, line, target in found:
        where = f"{rel}:{line}: imports {target}"
        if not is_command(mod) and is_command(target):
            bad.append(f"{where} (a command module: library code must not import it)")
        if mod not in COMPAT and target in COMPAT:
            bad.append(f"{where} (an old import path: use {COMPAT[target]})")
    return bad


def module_files() -> dict[str, Path]:
    return {
        module_name(p): p for top in ("pytrt_kv", "onnx_export") for p in (REPO / top).rglob("*.py")
    }


def import_edges(files: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (anywhere, lazy imports included), from
    ``files`` (module name -> source; a name ending in ``.__init__`` is a package).
    ``from pkg import sub`` is an edge to ``pkg.sub`` when that is a module, else to
    ``pkg``; a package's submodule reaching its package this way is no cycle."""
    names = {m.removesuffix(".__init__") for m in files}
    edges: dict[str, set[str]] = {}
    for key, source in files.items():
        mod = key.removesuffix(".__init__")
        package = mod if key.endswith(".__init__") else mod.rpartition(".")[0]
        out = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(
                        parts[: len(parts) - (node.level - 1)] + ([base] if base else [])
                    )
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in names else base
                           for a in node.names]  # fmt: skip
            else:
                continue
            for t in targets:
                while t and t not in names:
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    out.add(t)
        edges[mod] = out
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _sources() -> dict[str, str]:
    out = {}
    for path in sorted(
        p for top in ("pytrt_kv", "onnx_export") for p in (REPO / top).rglob("*.py")
    ):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        out[".".join(parts)] = path.read_text(encoding="utf-8")
    return out


def test_no_import_cycles():
    """No two modules import each other, directly or around a circle, even lazily: each
    layer builds on the ones below (issue 21)."""
    edges = import_edges(_sources())
    assert len(edges) > 50 and sum(map(len, edges.values())) > 100  # the walk saw them
    assert cycles(edges) == [], "import cycles:\n" + "\n".join(map(str, cycles(edges)))


@pytest.mark.parametrize(
    "files, expected",
    [
        ({"p.a": "from . import b\n", "p.b": "def f():\n    from .a import x\n"}, [["p.a", "p.b"]]),
        ({"p.__init__": "from .a import x\n", "p.a": "from . import b\n", "p.b": "y = 1\n"}, []),
        ({"p.__init__": "from .a import x\n", "p.a": "from . import y\n"}, [["p", "p.a"]]),
        ({"a": "import b\n", "b": "import c\n", "c": "from a import z\n"}, [["a", "b", "c"]]),
    ],
)
def test_cycle_check_finds_a_circle(files, expected):
    assert cycles(import_edges(files)) == expected


#: pytrt_kv modules outside the CLI that may still print or read the command line, and why.
#: Everything else returns data and raises errors (docs/ARCHITECTURE.md, "The CLI").
NOT_COMMANDS = {
    "pytrt_kv.polygraphy.data_loader": "a Polygraphy data-loader script: reads its options "
    "from polygraphy's own command line and PYTRT_KV_* (graph/feeds.py stays pure)",
    "pytrt_kv.trt.build": "build_plan(progress=True, verbose=True): documented progress "
    "and TensorRT's log on stderr",
    "pytrt_kv.trt._rtx": "the build child's end-of-answer marker on its stderr pipe",
}


def command_traits(source: str) -> list[tuple[int, str]]:
    """(line, what) of everything that makes a module a command: argparse, sys.argv,
    print(), a top-level ``add_arguments``."""
    out = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            if "argparse" in names:
                out.append((node.lineno, "imports argparse"))
        elif isinstance(node, ast.Attribute) and node.attr == "argv":
            if isinstance(node.value, ast.Name) and node.value.id == "sys":
                out.append((node.lineno, "reads sys.argv"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "print":
                out.append((node.lineno, "prints"))
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "add_arguments":
            out.append((node.lineno, "defines add_arguments"))
    return out


def command_violations(files: dict[str, tuple[str, str]]) -> list[str]:
    """``files``: module -> (file, source). Command traits outside the CLI."""
    bad = []
    for mod, (rel, source) in sorted(files.items()):
        if not _in(mod, "pytrt_kv") or is_command(mod) or mod in NOT_COMMANDS:
            continue
        for line, what in command_traits(source):
            bad.append(
                f"{rel}:{line}: {what} (a library module: return data and raise; the "
                "command in pytrt_kv/cli/ parses and prints)"
            )
    return bad


def test_only_the_cli_parses_and_prints():
    files = {
        mod: (str(path.relative_to(REPO)), path.read_text(encoding="utf-8"))
        for mod, path in module_files().items()
    }
    assert "pytrt_kv.cli.info" in files
    bad = command_violations(files)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "mod, source, broken",
    [
        ("pytrt_kv.retrieval.demo", "def f(log):\n    print('x')\n", "prints"),
        ("pytrt_kv.bench", "import argparse\n", "argparse"),
        ("pytrt_kv.x", "import sys\nn = len(sys.argv)\n", "sys.argv"),
        ("pytrt_kv.info", "def add_arguments(p):\n    pass\n", "add_arguments"),
        ("pytrt_kv.cli.info", "import argparse\nprint(1)\n", None),
        ("pytrt_kv.__main__", "import sys\nsys.exit(len(sys.argv))\n", None),
        ("pytrt_kv.demo", "def f(log):\n    log('x')\n", None),
        ("onnx_export.llama_polygraphy", "import argparse\n", None),
    ],
)
def test_command_rule_catches_a_library_that_prints(mod, source, broken):
    bad = command_violations({mod: ("f.py", source)})
    if broken is None:
        assert bad == []
    else:
        assert bad and broken in bad[0], bad


def test_imports_point_down_and_at_new_paths():
    bad = direction_violations(all_imports())
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "mod, source, broken",
    [
        ("pytrt_kv._cuda.abi", "def f():\n    from ..cli.info import run\n", "command"),
        ("pytrt_kv.trt.build", "from ..cli import demo\n", "command"),
        ("pytrt_kv._cuda.abi", "def f():\n    from ..info import cuda_devices\n", None),
        ("pytrt_kv.__main__", "from . import info\n", None),
        ("pytrt_kv.retrieval.demo", "from ..cli import retrieval_demo\n", "command"),
        ("pytrt_kv.trt", "def f():\n    from pytrt_kv.cli.build import run\n", "command"),
        ("pytrt_kv.cli.demo", "from ..cli.export_example import output_path\n", None),
        ("pytrt_kv.cli.demo", "from ..demo import verify_step\n", None),
        ("pytrt_kv.ops", "from .specs import OPS\n", "old import path"),
        ("pytrt_kv.ops", "from .contract.specs import OPS\n", None),
        ("onnx_export.x", "from onnx_export.schemas import register\n", "old import path"),
    ],
)
def test_direction_rules_catch_a_broken_import(mod, source, broken):
    found = [(mod, "f.py", line, target) for line, target in imports(source, mod, is_package=False)]
    bad = direction_violations(found)
    if broken is None:
        assert bad == []
    else:
        assert bad and broken in bad[0], bad


def test_imports_follow_the_layers():
    found = all_imports()
    assert len(found) > 100  # the walk saw the packages
    bad = violations(found, all_imports(lazy=False))
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
        ("pytrt_kv.trt.x", "def f():\n    import onnx_export\n", "only pytrt_kv.cli"),
        ("pytrt_kv.demo", "def f():\n    from onnx_export.example import x\n", "only pytrt_kv.cli"),
        ("pytrt_kv.retrieval.demo", "def f():\n    import onnx_export.retrieval\n", "only"),
        ("pytrt_kv.cli.demo", "def run(a):\n    from onnx_export.example import x\n", None),
        ("pytrt_kv.cli.demo", "from onnx_export.example import x\n", "inside functions only"),
        (
            "pytrt_kv.cli.x",
            "try:\n    import onnx_export\nexcept ImportError:\n    pass\n",
            "inside functions only",
        ),
        ("onnx_export.x", "from pytrt_kv._scatter import check_scatter\n", "public pytrt_kv"),
        ("onnx_export.x", "from pytrt_kv.graph.check import TensorInfo\n", None),
    ],
)
def test_rules_catch_a_broken_import(mod, source, broken):
    found, module_level = (
        [(mod, "f.py", line, t) for line, t in imports(source, mod, False, lazy)]
        for lazy in (True, False)
    )
    bad = violations(found, module_level)
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
