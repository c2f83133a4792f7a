"""Command-line interface: ``pytrt-kv`` (also ``python -m pytrt_kv``).

Each subcommand is one thin module of this package (docs/ARCHITECTURE.md, "The CLI"):
``add_arguments(parser)`` declares its options and ``run(args) -> int`` calls the library
and prints. Library modules return data and raise errors; they never parse ``argv`` or
print (progress goes through ``log``/``progress`` callbacks the command passes in). Heavy
imports happen inside ``run`` so ``--help`` stays fast; ``onnx_export`` (shipped in the same
wheel) is imported only there, never at module level.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

#: (subcommand, module, one-line help)
SUBCOMMANDS = (
    (
        "info",
        "pytrt_kv.cli.info",
        "print versions and what is available (native libraries, TensorRT and whether it "
        "can run engines here, GPU)",
    ),
    (
        "demo",
        "pytrt_kv.cli.demo",
        "export the example sparse-attention decode model and run it step by step, verified",
    ),
    (
        "export-example",
        "pytrt_kv.cli.export_example",
        "write the example model (ScatterPaKvCache + GatherSelectionKvCache) to an .onnx file",
    ),
    (
        "generate",
        "pytrt_kv.cli.generate",
        "SmolLM2-135M through the paged-KV-cache ops on the CPU runtime: greedy generation "
        "for several prompts, --check against transformers (extra 'study')",
    ),
    (
        "bench",
        "pytrt_kv.cli.bench",
        "benchmark the CUDA kernels against same-run baselines (needs a GPU); "
        "`bench datadist`: block push over NIXL",
    ),
    (
        "check",
        "pytrt_kv.cli.check",
        "check a model with pytrt_kv nodes (schema, graph rules, --target architectures): "
        "one line per problem, exit 1",
    ),
    (
        "build",
        "pytrt_kv.cli.build",
        "build a TensorRT engine (plan) from an ONNX model; with TensorRT-RTX also without a "
        "GPU, for --target compute capabilities",
    ),
    (
        "prepare",
        "pytrt_kv.cli.prepare",
        "rewrite pytrt_kv nodes into the TensorRT plugins' positional form "
        "(for polygraphy/trtexec)",
    ),
    (
        "retrieval-demo",
        "pytrt_kv.cli.retrieval_demo",
        "RetrievalKV decode steps (scatter, block scoring, recall, attention) on the CPU "
        "runtime, verified against the NumPy reference",
    ),
    (
        "study",
        "pytrt_kv.cli.study",
        "RetrievalKV accuracy study on SmolLM2-135M: passkey retrieval and next-token loss "
        "vs dense (extra 'study')",
    ),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pytrt-kv",
        description="Paged-KV-cache ops (ScatterPaKvCache, GatherSelectionKvCache) for "
        "TensorRT engines: reference, ONNX export, CPU runtime, kernels, plugins.",
    )
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"pytrt_kv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module, help_text in SUBCOMMANDS:
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except (ValueError, TypeError, OSError, RuntimeError, ImportError) as exc:
        # One line, no traceback: what went wrong and with which argument (OSError covers
        # a directory or an unreadable file given where a file was expected).
        print(f"pytrt-kv {args.command}: error: {exc}", file=sys.stderr)
        return 1
