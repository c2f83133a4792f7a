"""Every C++/CUDA source is formatted as .clang-format says (TensorRT OSS's style), by
the clang-format pinned in the test extra (scripts/format_cpp.py)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("format_cpp", ROOT / "scripts" / "format_cpp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_formatter_is_the_pinned_wheel_not_path():
    import clang_format  # the test extra installs it; a missing formatter is a failure

    tool = _tool()
    exe = Path(tool.executable())
    assert exe.is_file() and Path(clang_format.__file__).parent in exe.parents
    pyproject = (ROOT / "pyproject.toml").read_text()
    pin = re.search(r'"clang-format==([\d.]+)"', pyproject)
    assert pin, "pyproject.toml: the test extra must pin clang-format"
    out = tool.subprocess.run([str(exe), "--version"], capture_output=True, text=True).stdout
    assert f"version {pin.group(1)}" in out, out


def test_sources_are_clang_formatted():
    tool = _tool()
    files = tool.sources()
    assert any(f.suffix == ".cu" for f in files) and any(f.suffix == ".h" for f in files)
    r = tool.run(True, files)
    assert r.returncode == 0, (
        "C++/CUDA sources not formatted (run: python scripts/format_cpp.py):\n" + r.stderr[-6000:]
    )


def test_check_catches_a_badly_formatted_file(tmp_path):
    tool = _tool()
    (tmp_path / ".clang-format").write_text((ROOT / ".clang-format").read_text())
    bad = tmp_path / "bad.cpp"
    bad.write_text("int  f( int x ){return x;}\n")
    r = tool.subprocess.run(
        [tool.executable(), "--style=file", "--dry-run", "--Werror", str(bad)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode != 0 and "bad.cpp" in r.stderr
