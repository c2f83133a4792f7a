"""Write plugins/kernels/kvContract.h from the Python contract.

The header carries what the C++ side used to copy by hand: the limits, status codes,
enum codes and version of ``pytrt_kv/contract/limits.py``, the cache layouts of
``pytrt_kv/contract/layouts.py`` (codes, names, shapes, segment rule), the quantised
dtypes of ``pytrt_kv/contract/quant.py`` (max, NaN byte) and the op names, tensor names
and plugin fields (names, defaults, choices) of ``pytrt_kv.specs``. It includes no
TensorRT or CUDA header, so the kernels can use it.

Usage (from the repository root)::

    python scripts/gen_contract_header.py           # rewrite the header
    python scripts/gen_contract_header.py --check   # exit 1 if it is stale

``tests/test_contract_header.py`` runs the check.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADER = ROOT / "plugins" / "kernels" / "kvContract.h"


def _const_name(text: str) -> str:
    """``"float8_e4m3fn"`` -> ``"FLOAT8_E4M3FN"``."""
    return re.sub(r"[^0-9A-Za-z]+", "_", text).strip("_").upper()


def _cpp_string(value: str) -> str:
    if not re.fullmatch(r"[ -~]*", value) or '"' in value or "\\" in value:
        raise ValueError(f"contract string {value!r}: expected printable ASCII without quotes")
    return f'"{value}"'


def _namespace_of(op_name: str) -> str:
    return op_name[0].lower() + op_name[1:]


def _op_block(op) -> list[str]:
    lines = [
        f'//! {op.name} (specs.OPS["{op.name}"]).',
        f"namespace {_namespace_of(op.name)}",
        "{",
        f"constexpr char const* kNAME{{{_cpp_string(op.name)}}};",
    ]
    for kind, tensors in (("IN", op.inputs), ("OUT", op.outputs)):
        lines.append(f"//! {'Input' if kind == 'IN' else 'Output'} positions and names.")
        for i, t in enumerate(tensors):
            lines.append(f"constexpr int32_t k{kind}_{_const_name(t.name)}{{{i}}};")
        plural = "INPUTS" if kind == "IN" else "OUTPUTS"
        lines.append(f"constexpr int32_t kNB_{plural}{{{len(tensors)}}};")
        names = ", ".join(_cpp_string(t.name) for t in tensors)
        lines.append(f"constexpr char const* k{plural[:-1]}_NAMES[kNB_{plural}]{{{names}}};")
    lines.append("//! Plugin fields (= ONNX attributes): name, default, allowed values.")
    for attr in op.attributes:
        base = f"kFIELD_{_const_name(attr.name)}"
        lines.append(f"constexpr char const* {base}{{{_cpp_string(attr.name)}}};")
        if attr.type == "string":
            lines.append(f"constexpr char const* {base}_DEFAULT{{{_cpp_string(attr.default)}}};")
            if attr.choices:
                choices = ", ".join(_cpp_string(c) for c in attr.choices)
                lines.append(f"constexpr char const* {base}_CHOICES[]{{{choices}}};")
        elif attr.type == "int":
            lines.append(f"constexpr int64_t {base}_DEFAULT{{{int(attr.default)}}};")
            if attr.choices:
                choices = ", ".join(str(int(c)) for c in attr.choices)
                lines.append(f"constexpr int64_t {base}_CHOICES[]{{{choices}}};")
        else:
            raise ValueError(f"{op.name}.{attr.name}: unknown attribute type {attr.type!r}")
    aliases = [(f"kOUT_{_const_name(o)}", f"kIN_{_const_name(i)}") for o, i in op.aliases.items()]
    lines += [
        "//! In-place outputs: {output, the input it updates} (specs aliases).",
        f"constexpr int32_t kNB_ALIASES{{{len(aliases)}}};",
        "constexpr int32_t kALIASES[kNB_ALIASES][2]{"
        + ", ".join(f"{{{o}, {i}}}" for o, i in aliases)
        + "};",
    ]
    lines += ["}" + f" // namespace {_namespace_of(op.name)}", ""]
    return lines


def _codes(prefix: str, codes, doc: str) -> Iterable[str]:
    yield f"//! {doc}"
    for name, code in codes.items():
        yield f"constexpr int32_t k{prefix}_{_const_name(name)}{{{int(code)}}};"
    yield ""


def _layout_block(layouts_mod) -> list[str]:
    """docs/SPEC.md S2-S5: the layout table (codes, names, shapes, segment rule)."""
    table = list(layouts_mod.LAYOUTS.values())
    if [lay.code for lay in table] != list(range(len(table))):
        raise ValueError("layouts.LAYOUTS: expected codes 0, 1, ... in table order")
    kinds = layouts_mod.SEGMENT_KINDS
    lines = [
        "//! docs/SPEC.md S2-S5 cache layouts (contract/layouts.py; kernels::CacheLayout).",
        "//! A token's H*D elements, f = h*D + d, are cut into nseg segments of seg elements;",
        "//! element f of slot (block, row) lies at ((block*nseg + f/seg)*BS + row)*seg + f%seg.",
    ]
    lines += [f"constexpr int32_t kLAYOUT_{_const_name(lay.name)}{{{lay.code}}};" for lay in table]
    names = ", ".join(_cpp_string(lay.name) for lay in table)
    shapes = ", ".join(_cpp_string("[" + ", ".join(lay.dims) + "]") for lay in table)
    lines += [
        f"constexpr int32_t kNB_LAYOUTS{{{len(table)}}};",
        f"constexpr char const* kLAYOUT_NAMES[kNB_LAYOUTS]{{{names}}};",
        "//! Declared 4-D shape of each layout (F = H*D/L, L = kNZ_SEGMENT_BYTES / itemsize).",
        f"constexpr char const* kLAYOUT_SHAPES[kNB_LAYOUTS]{{{shapes}}};",
        "//! The symbols of the declared shapes (layouts.DIM_SYMBOLS), and each layout's 4 dims.",
        *(f"constexpr int32_t kDIM_{sym}{{{i}}};" for i, sym in enumerate(layouts_mod.DIM_SYMBOLS)),
        f"constexpr int32_t kNB_DIM_SYMBOLS{{{len(layouts_mod.DIM_SYMBOLS)}}};",
        "constexpr char const* kDIM_NAMES[kNB_DIM_SYMBOLS]{"
        + ", ".join(_cpp_string(sym) for sym in layouts_mod.DIM_SYMBOLS)
        + "};",
        "constexpr int32_t kLAYOUT_DIMS[kNB_LAYOUTS][4]{"
        + ", ".join("{" + ", ".join(f"kDIM_{d}" for d in lay.dims) + "}" for lay in table)
        + "};",
        "//! Axis of BS (the row within a block) in each declared shape; NB is axis 0.",
        "constexpr int32_t kLAYOUT_ROW_AXIS[kNB_LAYOUTS]{"
        + ", ".join(str(lay.row_axis) for lay in table)
        + "};",
        "//! What a segment is: the whole token (H*D), one head (D), or kNZ_SEGMENT_BYTES bytes.",
    ]
    lines += [f"constexpr int32_t kSEGMENT_{_const_name(k)}{{{i}}};" for i, k in enumerate(kinds)]
    lines += [
        f"constexpr int32_t kNZ_SEGMENT_BYTES{{{layouts_mod.NZ_SEGMENT_BYTES}}};",
        "constexpr int32_t kLAYOUT_SEGMENT[kNB_LAYOUTS]{"
        + ", ".join(f"kSEGMENT_{_const_name(lay.segment)}" for lay in table)
        + "};",
        "//! Bytes of one segment of a token of rowBytes bytes in numHeads heads; 0 for an",
        "//! unknown layout.",
        "constexpr int64_t layoutSegmentBytes(int32_t layout, int64_t rowBytes, int64_t numHeads)",
        "{",
        "    return layout < 0 || layout >= kNB_LAYOUTS ? 0",
        "        : kLAYOUT_SEGMENT[layout] == kSEGMENT_TOKEN ? rowBytes",
        "        : kLAYOUT_SEGMENT[layout] == kSEGMENT_HEAD ? rowBytes / numHeads",
        "        : kNZ_SEGMENT_BYTES;",
        "}",
        "",
    ]
    return lines


def _quant_block(quant_mod) -> list[str]:
    """docs/SPEC.md S9: the quantised cache dtypes (contract/quant.py)."""
    lines = ["//! docs/SPEC.md S9 quantised cache dtypes (contract/quant.py): clamp bound M and"]
    lines += ["//! the byte written for a NaN source element."]
    for q in quant_mod.QUANT.values():
        base = f"kQUANT_{_const_name(q.name)}"
        lines += [
            f"//! {q.name}: {q.rounding}; NaN {q.nan}.",
            f"constexpr int32_t {base}_DTYPE{{kDTYPE_{_const_name(q.name)}}};",
            f"constexpr float {base}_MAX{{{float(q.max)!r}f}};",
            f"constexpr uint8_t {base}_NAN_BITS{{0x{q.nan_bits:02X}U}};",
        ]
    return lines + [""]


def render() -> str:
    """The header's text, from the contract as imported now."""
    sys.path.insert(0, str(ROOT))
    try:
        from pytrt_kv import specs
        from pytrt_kv.contract import layouts, limits, quant
    finally:
        sys.path.pop(0)
    major, minor, patch = (int(p) for p in limits.VERSION.split("."))
    lines = [
        "/*",
        " * GENERATED by scripts/gen_contract_header.py from pytrt_kv/contract/limits.py,",
        " * layouts.py, quant.py and specs.py: do not edit; change those and rerun the script.",
        " * tests/test_contract_header.py fails when this file is stale.",
        " *",
        " * The contract's numbers and names for the C++ side. No TensorRT or CUDA types: the",
        " * kernels include it too.",
        " */",
        "#pragma once",
        "",
        "#include <cstdint>",
        "",
        "// clang-format off",
        "namespace pytrt_kv",
        "{",
        "namespace contract",
        "{",
        "",
        "//! Package version (limits.VERSION); CMakeLists.txt reads kVERSION from this file.",
        f"constexpr char const* kVERSION{{{_cpp_string(limits.VERSION)}}};",
        f"constexpr int32_t kVERSION_MAJOR{{{major}}};",
        f"constexpr int32_t kVERSION_MINOR{{{minor}}};",
        f"constexpr int32_t kVERSION_PATCH{{{patch}}};",
        "//! pytrt_kv_version(): major * 10000 + minor * 100 + patch.",
        f"constexpr int32_t kVERSION_NUMBER{{{limits.VERSION_NUMBER}}};",
        "//! pytrt_kv_abi_version(): layout version of ScatterParams / GatherSelectionParams.",
        f"constexpr int32_t kABI_VERSION{{{limits.ABI_VERSION}}};",
        "",
        "//! docs/SPEC.md G2: largest K of GatherSelectionKvCache (any TBS).",
        f"constexpr int32_t kMAX_TOPK{{{limits.MAX_TOPK}}};",
        "//! kMAX_TOPK as a string literal, for messages built by literal concatenation.",
        f'#define PYTRT_KV_MAX_TOPK_STR "{limits.MAX_TOPK}"',
        "",
        "//! cudaError_t values with a meaning of their own (kvError.cpp static_asserts them).",
        f"constexpr int32_t kSTATUS_SUCCESS{{{limits.STATUS_SUCCESS}}};",
        f"constexpr int32_t kSTATUS_INVALID_VALUE{{{limits.STATUS_INVALID_VALUE}}};",
        f"constexpr int32_t kSTATUS_STUB_LIBRARY{{{limits.STATUS_STUB_LIBRARY}}};",
        f"constexpr int32_t kSTATUS_INSUFFICIENT_DRIVER{{{limits.STATUS_INSUFFICIENT_DRIVER}}};",
        f"constexpr int32_t kSTATUS_NO_DEVICE{{{limits.STATUS_NO_DEVICE}}};",
        "",
    ]
    lines += _codes("DTYPE", limits.DTYPE_CODES, "kernels::DataType values (limits.DTYPE_CODES).")
    lines += _layout_block(layouts)
    lines += _codes("MODE", limits.MODE_CODES, "kernels::CompressMode values (limits.MODE_CODES).")
    lines += _codes(
        "POINTER", limits.POINTER_KINDS, "pytrt_kv_pointer_info() kinds (limits.POINTER_KINDS)."
    )
    lines += _quant_block(quant)
    lines += [
        "//! TensorRT plugin namespace (= ONNX domain) and plugin version (specs.NAMESPACE,",
        "//! specs.PLUGIN_VERSION).",
        f"constexpr char const* kPLUGIN_NAMESPACE{{{_cpp_string(specs.NAMESPACE)}}};",
        f"constexpr char const* kPLUGIN_VERSION{{{_cpp_string(specs.PLUGIN_VERSION)}}};",
        "",
    ]
    for op in specs.OPS.values():
        lines += _op_block(op)
    lines += ["} // namespace contract", "} // namespace pytrt_kv", "// clang-format on", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 (and say so) if the checked-in header differs"
    )
    parser.add_argument("--output", type=Path, default=HEADER, help=f"default: {HEADER}")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text() if args.output.exists() else None
        if current != text:
            print(
                f"{args.output} is stale: run python scripts/gen_contract_header.py",
                file=sys.stderr,
            )
            return 1
        return 0
    args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
