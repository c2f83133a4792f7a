"""The generators of valid inputs for a model all draw from pytrt_kv.graph.feeds.make_feeds
(issue 21 item 4; docs/GRAPH_MODE.md, Valid feeds), and what they make runs on the CPU
runtime. make_feeds itself (pure, loader options, refusals): tests/test_polygraphy.py;
the demo: tests/test_demo.py."""

from __future__ import annotations

import importlib.util

import numpy as np

from onnx_export import single_op_model
from pytrt_kv import runtime
from pytrt_kv.graph.feeds import make_feeds
from support.env import REPO


def test_case_maker_draws_valid_feeds_from_make_feeds(tmp_path):
    """The harness case maker (plugins/harness/makeCases.py): the inputs it writes are
    make_feeds' for the case's seed, and the CPU runtime accepts them."""
    from pytrt_kv.trt.model import prepare_for_tensorrt

    spec = importlib.util.spec_from_file_location(
        "makeCases", REPO / "plugins" / "harness" / "makeCases.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.make_feeds is make_feeds
    cases = mod.cases()
    for i in (0, len(cases) // 2, len(cases) - 1):
        case = cases[i]
        r = mod.write_case(tmp_path, case, 100 + i)
        model = single_op_model(case["op"], case["shapes"], **case["attrs"])
        want = make_feeds(model, seed=100 + i)
        assert list(r["feeds"]) == list(want)
        assert all(np.array_equal(r["feeds"][n], want[n]) for n in want), case["name"]
        runtime.run(model, r["feeds"])
        first = next(iter(want))
        k = list(prepare_for_tensorrt(model).graph.node[0].input).index(first)
        written = (tmp_path / case["name"] / f"in{k}.bin").read_bytes()
        assert written == np.ascontiguousarray(want[first]).tobytes(), case["name"]
