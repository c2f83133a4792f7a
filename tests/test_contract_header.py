"""The C++ side's copy of the contract (plugins/kernels/kvContract.h) is generated from
pytrt_kv/contract/limits.py and pytrt_kv.specs, and nothing else holds another copy."""

from __future__ import annotations

import ctypes
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


# --- the ctypes mirrors of the kernels' parameter structs, field by field -------------------

#: C++ field types of the params structs -> the ctypes type that mirrors them.
_CTYPE_OF = {
    "pointer": ctypes.c_void_p,
    "int32_t": ctypes.c_int32,
    "DataType": ctypes.c_int32,  # enum class ... : int32_t (kvCommon.h)
    "CacheLayout": ctypes.c_int32,
    "CompressMode": ctypes.c_int32,
    "int64_t": ctypes.c_int64,
    "bool": ctypes.c_bool,
    "size_t": ctypes.c_size_t,
}


def header_fields(header: str, struct: str) -> list[tuple[str, str]]:
    """(name, C++ type, pointers as "pointer") of ``struct``'s fields in ``header``'s text,
    in declaration order."""
    m = re.search(rf"struct {struct}\s*\{{(.*?)\n\}};", header, re.S)
    assert m, f"struct {struct} not found"
    body = re.sub(r"//[^\n]*", "", m.group(1))
    out = []
    for decl in body.split(";"):
        decl = re.sub(r"\{[^}]*\}", "", decl).strip()  # default member initializers
        if not decl:
            continue
        kind, name = decl.rsplit(None, 1)
        kind = "pointer" if "*" in kind + name else kind.replace("const", "").strip()
        out.append((name.lstrip("*"), kind))
    return out


def mirror_mismatches(fields: list[tuple[str, str]], ctypes_fields: list[tuple]) -> list[str]:
    """Where a ctypes ``_fields_`` list differs from the C++ fields: name, order or type."""
    bad = []
    if len(fields) != len(ctypes_fields):
        bad.append(f"{len(fields)} C++ fields, {len(ctypes_fields)} in the mirror")
    for i, ((name, kind), (cname, ctype)) in enumerate(zip(fields, ctypes_fields)):
        if name != cname:
            bad.append(f"field {i}: C++ {name}, mirror {cname}")
        if _CTYPE_OF.get(kind) is not ctype:
            bad.append(f"field {i} ({name}): C++ {kind}, mirror {ctype.__name__}")
    return bad


@pytest.mark.parametrize(
    "header, struct, mirror",
    [
        ("scatterPaKvCache.h", "ScatterParams", "ScatterParams"),
        ("gatherSelectionKvCache.h", "GatherSelectionParams", "GatherSelectionParams"),
    ],
)
def test_ctypes_params_mirror_the_header_field_by_field(header, struct, mirror):
    """pytrt_kv._cuda.abi's structs name every field of the C++ struct, in order, with
    the matching type: a swap of two same-sized fields (which the offsets of
    pytrt_kv_params_layout cannot see) fails here, and so does a renamed field."""
    fields = header_fields((ROOT / "plugins" / "kernels" / header).read_text(), struct)
    assert len(fields) >= 20
    assert mirror_mismatches(fields, getattr(_cuda.abi, mirror)._fields_) == []


def test_mirror_check_sees_a_swap_of_same_sized_fields():
    fields = header_fields((ROOT / "plugins" / "kernels" / "scatterPaKvCache.h").read_text(),
                           "ScatterParams")  # fmt: skip
    mirror = list(_cuda.abi.ScatterParams._fields_)
    i, j = [n for n, _ in mirror].index("headSizeK"), [n for n, _ in mirror].index("headSizeV")
    mirror[i], mirror[j] = mirror[j], mirror[i]  # both int32: same offsets, other meaning
    assert mirror_mismatches(fields, mirror) == [
        f"field {i}: C++ headSizeK, mirror headSizeV",
        f"field {j}: C++ headSizeV, mirror headSizeK",
    ]
    retyped = list(_cuda.abi.ScatterParams._fields_)
    k = [n for n, _ in retyped].index("numBlocks")
    retyped[k] = ("numBlocks", __import__("ctypes").c_int32)
    assert mirror_mismatches(fields, retyped) == [
        f"field {k} (numBlocks): C++ int64_t, mirror c_int"
    ]


def test_header_carries_the_layout_and_quant_tables():
    from pytrt_kv.contract.layouts import LAYOUTS, NZ_SEGMENT_BYTES
    from pytrt_kv.contract.quant import QUANT

    text = (ROOT / "plugins" / "kernels" / "kvContract.h").read_text()
    axes = ", ".join(str(lay.row_axis) for lay in LAYOUTS.values())
    assert f"kLAYOUT_ROW_AXIS[kNB_LAYOUTS]{{{axes}}};" in text
    names = ", ".join(f'"{n}"' for n in LAYOUTS)
    assert f"kLAYOUT_NAMES[kNB_LAYOUTS]{{{names}}};" in text
    assert f"kNZ_SEGMENT_BYTES{{{NZ_SEGMENT_BYTES}}};" in text
    for name, q in QUANT.items():
        base = f"kQUANT_{name.upper()}"
        assert f"constexpr float {base}_MAX{{{q.max!r}f}};" in text
        assert f"constexpr uint8_t {base}_NAN_BITS{{0x{q.nan_bits:02X}U}};" in text
    assert "kQUANT_FLOAT8_E4M3FN_NAN_BITS{0x7FU}" in text  # docs/SPEC.md S9
