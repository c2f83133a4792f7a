"""The C++ side's copy of the contract (plugins/kernels/kvContract.h) is generated from
pytrt_kv/contract/limits.py and pytrt_kv.specs, and nothing else holds another copy."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

import pytrt_kv
from pytrt_kv import _cuda, specs
from pytrt_kv.contract import limits

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location(
        "gen_contract_header", ROOT / "scripts" / "gen_contract_header.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_checked_in_header_is_what_the_generator_writes():
    gen = _generator()
    text = gen.render()
    current = gen.HEADER.read_text()
    assert current == text, (
        f"{gen.HEADER.relative_to(ROOT)} is stale: run python scripts/gen_contract_header.py"
    )


def test_generator_check_mode_fails_on_a_stale_header(tmp_path, capsys):
    gen = _generator()
    stale = tmp_path / "kvContract.h"
    stale.write_text(
        gen.render().replace(
            f"kMAX_TOPK{{{limits.MAX_TOPK}}}", f"kMAX_TOPK{{{limits.MAX_TOPK + 1}}}"
        )
    )
    assert gen.main(["--check", "--output", str(stale)]) == 1
    assert "stale" in capsys.readouterr().err
    gen.main(["--output", str(stale)])
    assert gen.main(["--check", "--output", str(stale)]) == 0


def test_header_carries_every_op_name_tensor_and_field():
    text = (ROOT / "plugins" / "kernels" / "kvContract.h").read_text()
    for op in specs.OPS.values():
        assert f'kNAME{{"{op.name}"}}' in text
        for t in (*op.inputs, *op.outputs):
            assert f'"{t.name}"' in text
        for a in op.attributes:
            assert re.search(rf'kFIELD_\w+\{{"{a.name}"\}}', text)
    for name in limits.DTYPE_CODES:
        assert f"kDTYPE_{name.upper()}{{{limits.DTYPE_CODES[name]}}}" in text


def test_codes_cover_the_contract_values():
    all_dtypes = {
        d for op in specs.OPS.values() for t in (*op.inputs, *op.outputs) for d in t.dtypes
    }
    assert all_dtypes <= set(limits.DTYPE_CODES)
    assert sorted(limits.DTYPE_CODES.values()) == list(range(len(limits.DTYPE_CODES)))
    assert set(limits.LAYOUT_CODES) == set(specs.CACHE_LAYOUTS)
    assert set(limits.MODE_CODES) == set(specs.COMPRESS_MODES)


def test_ctypes_layer_reads_the_contract():
    assert _cuda.DTYPE_CODE == limits.DTYPE_CODES
    assert _cuda.LAYOUT_CODE == limits.LAYOUT_CODES
    assert _cuda.MODE_CODE == limits.MODE_CODES
    assert _cuda.ABI_VERSION == limits.ABI_VERSION
    assert (_cuda.HOST, _cuda.PINNED, _cuda.DEVICE, _cuda.MANAGED) == tuple(
        limits.POINTER_KINDS[k] for k in ("host", "pinned", "device", "managed")
    )


def test_version_has_one_source():
    major, minor, patch = (int(p) for p in limits.VERSION.split("."))
    assert limits.VERSION_NUMBER == major * 10000 + minor * 100 + patch
    assert pytrt_kv.__version__ == limits.VERSION
    if sys.version_info >= (3, 11):  # tomllib
        import tomllib

        pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
        project = pyproject["project"]
        assert "version" not in project and "version" in project["dynamic"]
        [provider] = [d for d in pyproject["tool"]["dynamic-metadata"] if d["field"] == "version"]
        assert provider["input"] == "pytrt_kv/contract/limits.py"
    # What scikit-build-core's regex provider matches by default in that file.
    found = re.findall(
        r"(?m)^(?:__version__|VERSION) *= *(['\"])v?(.+?)\1",
        (ROOT / "pytrt_kv" / "contract" / "limits.py").read_text(),
    )
    assert [v for _, v in found] == [limits.VERSION]


@pytest.mark.parametrize(
    "path, pattern",
    [
        ("plugins/kernels/gatherPlan.h", r"kMAX_TOPK = \d"),
        ("plugins/kernels/capi.cpp", r"return \d+; // \d"),
        ("plugins/kernels/capi.cpp", r"kABI_VERSION = \d"),
        ("plugins/gatherSelectionKvCache/gatherSelectionKvCachePlugin.h", r"kMAX_TOPK\{\d"),
        ("plugins/common/pluginCommon.h", r'kPLUGIN_NAMESPACE\{"'),
        ("pytrt_kv/_cuda/abi.py", r"ABI_VERSION = \d"),
        ("pytrt_kv/__init__.py", r"__version__ = \""),
        ("CMakeLists.txt", r"project\(pytrt_kv VERSION \d"),
    ],
)
def test_no_hand_copies_left(path, pattern):
    file = ROOT / path
    assert file.exists(), path
    assert not re.search(pattern, file.read_text()), f"{path}: a hand copy of a contract value"
