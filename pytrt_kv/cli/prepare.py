"""``pytrt-kv prepare``: rewrite the pytrt_kv nodes of an ONNX model into the plugins'
positional form (for polygraphy/trtexec, which parse the file themselves; see
:func:`pytrt_kv.trt.prepare_for_tensorrt`)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="ONNX model with pytrt_kv nodes")
    parser.add_argument("dst", help="where to write the prepared model")


def run(args: argparse.Namespace) -> int:
    import onnx

    from ..graph.tensorrt import prepare_for_tensorrt
    from ..trt.build import _load_onnx

    onnx.save(prepare_for_tensorrt(_load_onnx(args.src)), args.dst)
    print(f"wrote {args.dst}")
    return 0
