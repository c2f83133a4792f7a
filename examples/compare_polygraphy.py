"""Run a model with pytrt_kv ops on the CPU runtime and compare runners with Polygraphy.

Runners, fed the same valid inputs by the project's data loader
(``pytrt_kv.polygraphy.data_loader``; random index inputs are invalid for these ops):

- ``PytrtKvRefRunner``: the project's Polygraphy runner over the CPU runtime
  (``pytrt_kv.runtime``: onnx.reference + the NumPy reference of our ops);
- ``numpy_step_runner`` (below): the same decode step written directly in NumPy, without
  the graph or the reference gather (``pytrt_kv.demo.expected_step``), so the
  comparison checks the runtime against an independent computation on any CPU;
- ``TrtRunner`` on an engine built by ``pytrt_kv.trt.build_engine``, where TensorRT, a GPU
  and the plugin library are usable (``pytrt_kv.trt.availability()``).

Cache updates are data movement and must match exactly; attention is float math in a
different order, so ``attn_out`` gets a small tolerance.

    python3 examples/compare_polygraphy.py [OUT.onnx]      # default example.onnx
"""

import sys

import onnx
from polygraphy.comparator import Comparator, CompareFunc

from onnx_export.example import ExampleSizes, build_example_model
from pytrt_kv.demo import expected_step
from pytrt_kv.graph.feeds import make_feeds
from pytrt_kv.polygraphy import FunctionRunner, PytrtKvRefRunner

SIZES = ExampleSizes()


def numpy_step_runner(model):
    """The example model's decode step computed directly in NumPy (no graph)."""
    return FunctionRunner(
        model,
        lambda feeds: expected_step(SIZES, feeds),
        name="numpy-step",
        outputs=("full_kv_cache_out", "full_k_rope_out", "attn_out"),
    )


def fresh_rows(feeds):
    """Start every selection row afresh (status all -1, docs/SPEC.md G5).

    ``make_feeds`` may hand in a previous step's status whose kept slots hold random bytes:
    valid for the op, which keeps them in place, but then the graph's attention reads
    those bytes while numpy_step_runner reads the true tokens. A fresh status makes the op
    copy every selected token, so both sides attend over the same data.
    """
    feeds["selection_kv_block_status"][...] = -1
    return feeds


def trt_runner(path):
    """A Polygraphy TrtRunner on our engine, or None (and why) where TensorRT can't run."""
    from pytrt_kv.trt import availability, build_engine

    reason = availability()
    if reason:
        return None, reason
    from polygraphy.backend.trt import TrtRunner

    engine = build_engine(path)  # loads the plugins, strongly typed
    # Polygraphy binds every output to its own buffer: the plugins then copy each cache
    # input to its output before updating it (docs/SPEC.md O), so results are the same.
    return TrtRunner(engine.engine, name="tensorrt"), ""


def main(argv):
    path = argv[1] if len(argv) > 1 else "example.onnx"
    model = build_example_model(SIZES)
    onnx.save(model, path)

    runners = [PytrtKvRefRunner(model, name="pytrt-kv-ref"), numpy_step_runner(model)]
    trt, why_not = trt_runner(path)
    if trt is None:
        print(f"TensorRT runner not used: {why_not}")
    else:
        runners.append(trt)

    feeds = [fresh_rows(make_feeds(model, seed=i)) for i in range(3)]  # a list is a loader
    results = Comparator.run(runners, data_loader=feeds)
    exact = dict(atol={"": 0.0, "attn_out": 1e-3}, rtol={"": 0.0, "attn_out": 1e-3})
    passed = bool(Comparator.compare_accuracy(results, compare_func=CompareFunc.simple(**exact)))
    print(f"{' vs '.join(r.name for r in runners)}: {'PASSED' if passed else 'FAILED'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
