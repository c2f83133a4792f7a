"""Build a TensorRT engine for a model with pytrt_kv ops, run it in place, and compare
it with the CPU runtime.

``pytrt_kv.trt.build_engine`` loads the plugin library into TensorRT's registry, rewrites
the model into the plugins' positional form, builds a strongly typed network with
aliased plugin I/O, and writes the engine file when asked. ``EngineRunner`` binds every
``*_out`` cache to its input's buffer, so the caches are updated in place
(docs/SPEC.md O); ``DeviceArray`` holds device buffers when no torch/CuPy is at hand.

Where this machine cannot build and run an engine (no TensorRT Python package of any
flavour, no cuda-python, no GPU, or the plugin library was not built), the script says
why and exits 0; ``pytrt-kv info`` tells what the installation has. Install TensorRT
with ``python3 -m pip install '/path/to/pytrt_kv[trt]'``.

    python3 examples/build_engine.py [OUT.plan]      # default example.plan
"""

import sys
from pathlib import Path

import numpy as np
import onnx

from onnx_export.example import build_example_model
from pytrt_kv import runtime
from pytrt_kv.graph.feeds import make_feeds
from pytrt_kv.trt import DeviceArray, EngineRunner, availability, build_engine, plugin_layers


def main(argv):
    plan_path = Path(argv[1] if len(argv) > 1 else "example.plan")
    onnx_path = plan_path.with_suffix(".onnx")
    model = build_example_model()
    onnx.save(model, str(onnx_path))
    print(f"wrote {onnx_path}")

    # '' when a TensorRT flavour, cuda-python, a GPU and the plugin library are all usable.
    reason = availability()
    if reason:
        print(f"skipped: no engine can be built on this machine: {reason}")
        return 0

    engine = build_engine(onnx_path, engine_path=plan_path)
    names = [str(layer.get("Name", "?")) for layer in plugin_layers(engine)]
    print(f"engine written: {plan_path} ({plan_path.stat().st_size} bytes), plugin layers {names}")

    feeds = make_feeds(model, seed=0)
    feeds["selection_kv_block_status"][...] = -1  # fresh rows: attention sees real tokens
    want = runtime.run(model, feeds)  # functional: feeds stay as they are

    runner = EngineRunner(engine)
    device = {n: DeviceArray(a.shape, a.dtype).copy_from(a) for n, a in feeds.items()}
    runner.run(device)  # legacy default stream
    # An aliased output lives in its input's buffer: the cache was updated in place.
    got = {
        n: (device[runner.aliases[n]] if n in runner.aliases else runner.output(n)).get()
        for n in runner.output_names
    }
    for name, expected in want.items():
        if name == "attn_out":  # float math: rounding may differ
            ok = np.allclose(got[name], expected, atol=1e-3, rtol=1e-3)
        else:  # data movement: exact
            ok = np.array_equal(got[name].view(np.uint8), expected.view(np.uint8))
        if not ok:
            print(f"MISMATCH: {name}")
            return 1
    print(f"engine outputs match the CPU runtime ({len(want)} outputs)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
