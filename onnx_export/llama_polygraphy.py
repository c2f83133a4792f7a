"""SmolLM2-135M's decode graph under Polygraphy: our graph on the CPU runtime against
transformers, on valid random paged states from the project's data loader (docs/LLAMA.md).

Runners, fed the same feeds (``pytrt_kv.graph.feeds.make_feeds``: private pages per
sequence, a random length per sequence, each token at its position and slot; the caches
random everywhere else):

- ``PytrtKvRefRunner``: the exported decode graph (30 ``ScatterPaKvCache`` writes,
  attention over the gathered pages) on ``pytrt_kv.runtime``;
- ``transformers_decode_runner`` (below): transformers' own model, which reads each
  sequence's past keys/values from its pages into a ``DynamicCache`` and runs the token at
  its position; its new key/value rows are written at the slots with NumPy indexing
  (``onnx_export.llama.reference_decode_step``). Nothing of the graph is shared.

The script writes ``decode.onnx`` (+ ``prefill.onnx``, weights in ``llama_weights.bin``)
into DIR, compares the two runners in-process, saves transformers' results as
``DIR/transformers_outputs.json`` and prints the ``polygraphy run`` command that compares
``--pytrt-kv-ref`` against them on the command line (``--load-outputs``).

    python3 -m onnx_export.llama_polygraphy DIR [--iterations N] [--seed S]

(``examples/compare_llama_polygraphy.py`` runs the same from a checkout.)

Exit status 0 when the runners agree within the tolerances below, 1 otherwise.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import onnx
from polygraphy.comparator import Comparator, CompareFunc, RunResults

from pytrt_kv.graph.feeds import make_feeds
from pytrt_kv.polygraphy import FunctionRunner, PytrtKvRefRunner

from .llama import LlamaRunner, load_llama, reference_decode_step, save_graphs

# 3 sequences of up to 4 pages of 4 tokens each, in a cache of 48 pages per layer.
BLOCK_SIZE, NUM_BLOCKS = 4, 48
SHAPES = {"block_tables": (3, 4), "key_cache_0": (NUM_BLOCKS, BLOCK_SIZE, 3, 64)}
# Cache rows outside the step's slots are copied (exact); the new rows and the logits are
# float32 math in another order (measured: 3e-4 on the rows, 3e-3 on logits up to 32).
ATOL = {"": 1e-3, "logits": 2e-2}
RTOL = {"": 1e-3, "logits": 1e-3}


def transformers_decode_runner(hf_model, graph: onnx.ModelProto, name: str = "transformers"):
    """The decode step computed by transformers from the paged state (no graph)."""
    return FunctionRunner(graph, lambda feeds: reference_decode_step(hf_model, feeds), name=name)


def loader_command(folder: Path, iterations: int, seed: int) -> list[str]:
    """The ``polygraphy run`` command comparing ``--pytrt-kv-ref`` with the saved results."""
    import pytrt_kv.polygraphy.data_loader as loader

    shapes = [f"{n}:[{','.join(map(str, s))}]" for n, s in SHAPES.items()]
    tol = []
    for flag, values in (("--atol", ATOL), ("--rtol", RTOL)):
        tol += [flag] + [f"{n}:{v}" if n else str(v) for n, v in values.items()]
    return [
        "polygraphy", "run", str(folder / "decode.onnx"), "--pytrt-kv-ref",
        "--data-loader-script", loader.__file__, "--input-shapes", *shapes,
        "--iterations", str(iterations), "--seed", str(seed),
        "--load-outputs", str(folder / "transformers_outputs.json"), *tol,
    ]  # fmt: skip


def compare(folder: Path, iterations: int = 2, seed: int = 0, hf_model=None) -> bool:
    """Export (if DIR has no decode.onnx), compare in-process, save transformers' results."""
    if hf_model is None:
        hf_model, _ = load_llama()
    decode = folder / "decode.onnx"
    if not decode.exists():
        save_graphs(LlamaRunner(hf_model, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS), folder)
    graph = onnx.load(str(decode), load_external_data=False)
    runners = [PytrtKvRefRunner(str(decode)), transformers_decode_runner(hf_model, graph)]
    # Iteration i uses seed + i, as the data loader does under `polygraphy run --seed`.
    feeds = [make_feeds(graph, seed + i, SHAPES) for i in range(iterations)]
    results = Comparator.run(runners, data_loader=feeds)
    ok = bool(
        Comparator.compare_accuracy(results, compare_func=CompareFunc.simple(atol=ATOL, rtol=RTOL))
    )
    # Only transformers' results: `polygraphy run --pytrt-kv-ref` produces its own.
    saved = RunResults()
    saved.append((runners[1].name, results[runners[1].name]))
    saved.save(str(folder / "transformers_outputs.json"))
    return ok


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    ok = compare(args.folder, args.iterations, args.seed)
    print(f"pytrt-kv-ref vs transformers: {'PASSED' if ok else 'FAILED'}")
    print("The same comparison with the Polygraphy CLI:")
    print(shlex.join(loader_command(args.folder, args.iterations, args.seed)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
