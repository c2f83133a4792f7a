"""``pytrt-kv build``: ONNX model -> serialized TensorRT engine (plan file).

With TensorRT-RTX the build needs no GPU: ``--target`` picks the compute capabilities
(``sm80 sm89 sm120``...). With full TensorRT the engine is built for this machine's GPU.
Each build phase and the total time are printed to stderr (``--quiet`` turns that off).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.lower().split("x") if d != "")


def _named_values(
    specs, sep: str, parse, option: str, expected: str, *, last: bool = False
) -> dict[str, list]:
    """``NAME<sep>VALUES`` options -> ``{NAME: parse(VALUES)}``, each 1 or 3 values (fixed,
    or min/opt/max); a ValueError naming ``option`` and ``expected`` otherwise. The name
    ends at the first ``sep``, or with ``last`` at the last one (a tensor name may hold a
    ":")."""
    out: dict[str, list] = {}
    for spec in specs or ():
        name, found, text = spec.rpartition(sep) if last else spec.partition(sep)
        try:
            values = parse(text)
        except ValueError:
            values = []
        if not found or not name or len(values) not in (1, 3):
            raise ValueError(f"{option}: expected {expected}, got {spec!r}")
        out[name] = values
    return out


def parse_shapes(specs) -> dict[str, tuple]:
    """``name:1x8,4x8,16x8`` (min,opt,max) or ``name:4x8`` (fixed) -> build_plan's ``shapes``."""
    found = _named_values(
        specs,
        ":",
        lambda text: [_shape(p) for p in text.split(",")],
        "--shapes",
        "NAME:MINxDIMS,OPTxDIMS,MAXxDIMS or NAME:DIMS (e.g. key:1x8x128,16x8x128,64x8x128)",
        last=True,
    )
    return {name: tuple(parts) if len(parts) == 3 else parts[0] for name, parts in found.items()}


def parse_dims(specs) -> dict[str, tuple[int, int, int]]:
    """``B=1:8:64`` (min:opt:max) or ``B=8`` (fixed) -> build.shapes_from_dims' ``dims``."""
    found = _named_values(
        specs, "=", lambda text: [int(v) for v in text.split(":")], "--dim",
        "NAME=MIN:OPT:MAX or NAME=SIZE (e.g. B=1:8:64)",
    )  # fmt: skip
    return {name: (v[0], v[len(v) // 2], v[-1]) for name, v in found.items()}  # 1 value: fixed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("model", help="ONNX model with pytrt_kv nodes (any form: prepared or not)")
    parser.add_argument("-o", "--output", help="plan file to write (default: MODEL with .plan)")
    parser.add_argument(
        "--target",
        nargs="+",
        default=None,
        metavar="SM",
        help="TensorRT-RTX: compute capabilities to build for, e.g. sm80 sm89 sm120 "
        "(default: this GPU, or, when there is none, every one TensorRT-RTX knows that the "
        "installed kernels were built for)",
    )
    parser.add_argument(
        "--flavour",
        choices=("tensorrt", "rtx"),
        default=None,
        help="which TensorRT builds (default: full TensorRT when it imports, else "
        "TensorRT-RTX; or $PYTRT_KV_TENSORRT)",
    )
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=None,
        metavar="NAME:MIN,OPT,MAX",
        help="optimization profile of each dynamic input, dims joined by x "
        "(key:1x8x128,16x8x128,64x8x128)",
    )
    parser.add_argument(
        "--dim",
        nargs="+",
        default=None,
        metavar="NAME=MIN:OPT:MAX",
        help="range of a symbolic dimension, applied to every input that uses it "
        "(B=1:8:64 T=1:256:4096); --shapes entries override it for their input",
    )
    parser.add_argument("--workspace", type=int, default=None, help="workspace limit in bytes")
    parser.add_argument(
        "--timing-cache", default=None, help="timing cache file (full TensorRT only)"
    )
    parser.add_argument(
        "--serialize-plugins",
        action="store_true",
        help="put the plugin library into the plan (TensorRT-RTX: the engine then loads "
        "without pytrt_kv, by a runtime that allows host code); where the TensorRT "
        "flavour cannot, print how to load the library instead",
    )
    parser.add_argument("--verbose", action="store_true", help="TensorRT verbose log")
    parser.add_argument("--quiet", action="store_true", help="no progress output")


def run(args: argparse.Namespace) -> int:
    from ..graph.lint import validate_model
    from ..trt import build_plan, can_serialize_plugins, plugin_loading_instructions
    from ..trt._tensorrt import flavour_of, import_tensorrt
    from ..trt.build import _load_onnx

    dims = parse_dims(args.dim)
    shapes = parse_shapes(args.shapes)
    # The model checks before TensorRT is imported (build_plan repeats them).
    validate_model(_load_onnx(args.model), targets=args.target, tensorrt=True)

    out = Path(args.output) if args.output else Path(args.model).with_suffix(".plan")
    trt = import_tensorrt(args.flavour)
    label = "TensorRT-RTX" if flavour_of(trt) == "rtx" else "TensorRT"
    if not args.quiet:
        targets = f" for {', '.join(args.target)}" if args.target else ""
        print(
            f"building {args.model} with {label} {trt.__version__}{targets}",
            file=sys.stderr,
            flush=True,
        )
    t0 = time.perf_counter()
    plan = build_plan(
        args.model,
        engine_path=out,
        timing_cache=args.timing_cache,
        shapes=shapes,
        dims=dims,
        workspace=args.workspace,
        verbose=args.verbose,
        targets=args.target,
        flavour=flavour_of(trt),
        progress=not args.quiet,
        serialize_plugins=args.serialize_plugins,
    )
    print(f"wrote {out} ({len(plan)} bytes) in {time.perf_counter() - t0:.2f} s")
    if args.serialize_plugins:
        if can_serialize_plugins(trt):
            print(
                f"{out} carries the plugin library: deserialize it with host code allowed "
                "(TensorRT-RTX runtime.engine_host_code_allowed = True, or "
                f"pytrt_kv.trt.load_engine({str(out)!r}, host_code_allowed=True))"
            )
        else:
            print(
                f"{label} cannot put the plugin library into the plan (docs/TENSORRT.md, "
                f'"Plugins inside the plan"): {plugin_loading_instructions(out)}'
            )
    return 0
