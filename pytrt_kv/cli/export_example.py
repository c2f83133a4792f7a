"""``pytrt-kv export-example PATH``: write the example model
(``onnx_export.example.build_example_model``) to an .onnx file.

The size options and :func:`output_path` serve ``pytrt-kv demo`` too. ``onnx_export`` is
imported inside functions only (docs/ARCHITECTURE.md, "The CLI").
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, fields
from pathlib import Path

from ..contract import specs

_HELP = {
    "batch": "sequences decoded together (B)",
    "heads": "query heads (Hq)",
    "kv_dim": "latent width (KV)",
    "rope_dim": "rope key width (R)",
    "num_blocks": "blocks in the full cache (NB)",
    "block_size": "tokens per full-cache block (FBS)",
    "max_blocks_per_seq": "full_kv_block_table columns (FMAX)",
    "topk": "tokens selected per step (K)",
    "selection_block_size": "tokens per selection-cache block (SBS)",
    "dtype": "cache dtype",
}


def add_size_arguments(parser: argparse.ArgumentParser) -> None:
    """``--batch``, ``--topk``, ... with the ``ExampleSizes`` defaults (also ``pytrt-kv
    demo``'s)."""
    from onnx_export.example import ExampleSizes

    for f in fields(ExampleSizes):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "dtype":
            parser.add_argument(
                flag,
                default=f.default,
                choices=[specs.FLOAT16, specs.FLOAT32],
                help=f"{_HELP[f.name]} (default {f.default})",
            )
        else:
            parser.add_argument(
                flag, type=int, default=f.default, help=f"{_HELP[f.name]} (default {f.default})"
            )


def sizes_from_args(args: argparse.Namespace):
    """The checked ``onnx_export.example.ExampleSizes`` of the size options."""
    from onnx_export.example import ExampleSizes

    return ExampleSizes(**{f.name: getattr(args, f.name) for f in fields(ExampleSizes)}).validate()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from onnx_export.example import BATCH_DIM

    parser.add_argument("path", help="where to write the .onnx file")
    parser.add_argument(
        "--alias-io",
        type=int,
        choices=(0, 1),
        default=1,
        help="alias_io attribute of both nodes (default 1: declare in-place I/O)",
    )
    parser.add_argument(
        "--dynamic",
        action="store_true",
        help=f"dynamic-batch variant: per-sequence dims (and the token count "
        f"T) are the symbolic {BATCH_DIM!r}; --batch sizes the caches "
        f"for that many sequences at most",
    )
    add_size_arguments(parser)


def output_path(arg: str, value: str) -> Path:
    """``value`` as the path of an .onnx file to write, checked up front so that a CLI
    error is one line: not a directory, in a directory that exists.

    Raises
    ------
    ValueError
        ``value`` is an existing directory.
    FileNotFoundError
        Its parent directory does not exist.
    """
    path = Path(value)
    if path.is_dir():
        raise ValueError(
            f"{arg}: expected the path of an .onnx file to write, got the directory {value!r}"
        )
    if not path.parent.is_dir():
        raise FileNotFoundError(f"{arg}: directory {str(path.parent)!r} does not exist")
    return path


def run(args: argparse.Namespace) -> int:
    import onnx

    from onnx_export.example import build_example_model

    sizes = sizes_from_args(args)
    path = output_path("path", args.path)
    model = build_example_model(
        sizes, alias_io=args.alias_io, dynamic=getattr(args, "dynamic", False)
    )
    onnx.save(model, str(path))
    ops = sorted(
        {
            f"{n.domain or 'ai.onnx'}::{n.op_type}"
            for n in model.graph.node
            if n.domain == specs.DOMAIN
        }
    )
    print(
        f"wrote {path} ({len(model.graph.node)} nodes; custom ops {', '.join(ops)}; "
        f"sizes {asdict(sizes)})"
    )
    return 0
