"""``pytrt-kv check``: every rule that decides whether a model with pytrt_kv nodes is
valid (:func:`pytrt_kv.graph.check_model`: node schema, graph rules, ``--target``
architectures of the installed kernels; with ``--target`` or ``--tensorrt`` the rules of
the TensorRT paths too). One line per problem, naming the node, the
tensor and the rule; exit status 1 when there is one. ``runtime.run``, ``prepare`` and
``build`` refuse the same models with the first of these lines (docs/GRAPH_MODE.md,
"Model checks")."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.add_argument("model", help="ONNX model with pytrt_kv nodes (any form: prepared or not)")
    parser.add_argument(
        "--target",
        nargs="+",
        default=None,
        metavar="SM",
        help="compute capabilities an engine will be built for (sm80 sm89 sm120...): each "
        "must be one the installed kernels were compiled for; implies --tensorrt",
    )
    parser.add_argument(
        "--tensorrt",
        action="store_true",
        help="also the rules of the TensorRT paths (prepare, build): dtypes TensorRT cannot "
        "pass to a plugin (uint8, float8_e5m2), which the CPU runtime runs",
    )


def run(args: argparse.Namespace) -> int:
    import sys

    from .._lib import kernel_architectures
    from ..graph.lint import check_model
    from ..trt.build import _load_onnx

    model = _load_onnx(args.model)
    problems = check_model(model, targets=args.target, tensorrt=bool(args.tensorrt or args.target))
    for p in problems:
        print(p)
    if args.target and kernel_architectures() is None:
        print(
            "note: --target not checked: no build_info.json beside the CUDA kernels library "
            "(pytrt-kv info shows where the libraries are)",
            file=sys.stderr,
        )
    if problems:
        return 1
    n = sum(1 for node in model.graph.node if node.domain == "pytrt_kv")
    print(f"{args.model}: ok ({n} pytrt_kv node{'s' if n != 1 else ''})")
    return 0
