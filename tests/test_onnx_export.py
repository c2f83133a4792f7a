"""Export-time and check-time refusals of bad models, and the onnx-graphsurgeon helpers."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper

from onnx_export import (
    add_gather_selection_kv_cache,
    add_scatter_pa_kv_cache,
    export_model,
    single_op_model,
)
from pytrt_kv import runtime
from pytrt_kv.graph.feeds import make_feeds
from support.arrays import assert_same_bits  # noqa: E402
from support.gather_cases import gather_skeleton  # noqa: E402


def scatter_feeds(
    key_dt=np.float16,
    cache_dt=np.float16,
    key_shape=(3, 2, 16),
    cache_shape=(4, 8, 2, 16),
    slots_dt=np.int32,
):
    return {
        "key": np.ones(key_shape, key_dt),
        "key_cache": np.ones(cache_shape, cache_dt),
        "slot_mapping": np.zeros(key_shape[:1], slots_dt),
    }


# --- refused at export time (single_op_model / validate_node) -----------------------


@pytest.mark.parametrize(
    "feeds,attrs,exc,pattern",
    [
        (scatter_feeds(cache_dt=np.float32), {}, (TypeError, ValueError), "key_cache"),
        (scatter_feeds(slots_dt=np.float32), {}, TypeError, "slot_mapping"),
        (scatter_feeds(key_dt=np.float64, cache_dt=np.float64), {}, TypeError, "dtype"),
        (scatter_feeds(), {"foo": 1}, ValueError, "attribute 'foo'.*unknown"),
        (scatter_feeds(), {"cache_layout": "bogus"}, ValueError, "cache_layout"),
        (scatter_feeds(), {"cache_layout": 3}, TypeError, "cache_layout.*string"),
        (scatter_feeds(), {"alias_io": "yes"}, TypeError, "alias_io.*int"),
        (scatter_feeds(), {"alias_io": 2}, ValueError, "alias_io"),
        (scatter_feeds(), {"plugin_version": "2"}, ValueError, "plugin_version"),
        (scatter_feeds(key_shape=(3, 32)), {}, ValueError, "key"),
        (scatter_feeds(cache_shape=(4, 8, 2, 15)), {}, ValueError, "key_cache"),
        (scatter_feeds(cache_shape=(4, 8, 3, 16)), {"cache_layout": "nd"}, ValueError, "key_cache"),
        (
            {"key": np.ones((3, 2, 16), np.float16), "slot_mapping": np.zeros(3, np.int32)},
            {},
            ValueError,
            "key_cache: expected a tensor",
        ),
        (
            dict(scatter_feeds(), bogus=np.ones(3, np.int32)),
            {},
            ValueError,
            "unknown \\['bogus'\\]",
        ),
    ],
)
def test_bad_scatter_refused_at_export(feeds, attrs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        single_op_model("ScatterPaKvCache", feeds, **attrs)


def test_bad_gather_refused_at_export():
    good = gather_skeleton(np.dtype(np.float16), tbs=4)
    single_op_model("GatherSelectionKvCache", good, selection_topk_block_size=4)
    cases = [
        (dict(good, full_kv_cache=good["full_kv_cache"].astype(np.float32)), {}, "full_kv_cache"),
        (
            dict(good, selection_kv_block_table=good["selection_kv_block_table"].astype(np.int64)),
            {},
            "selection_kv_block_table",
        ),
        (good, {"selection_topk_block_size": 3}, "selection_topk_block_size|SBS|TBS"),
        (good, {"selection_topk_block_size": 0}, "selection_topk_block_size"),
        (
            dict(good, selection_topk_indices=good["selection_topk_indices"][..., :-1]),
            {},
            "selection_topk_indices|selection_kv_block_status",
        ),
        (dict(good, full_kv_actual_seq=np.zeros(3, np.int32)), {}, "full_kv_actual_seq"),
    ]
    for feeds, attrs, pattern in cases:
        attrs = {"selection_topk_block_size": 4, **attrs}
        with pytest.raises((ValueError, TypeError), match=pattern):
            single_op_model("GatherSelectionKvCache", feeds, **attrs)
    with pytest.raises(ValueError, match="op_type"):
        single_op_model("Scatter", good)


# --- refused at check time (hand-written models that bypass the exporters) ----------


def _hand_model(
    key_type=TensorProto.FLOAT16,
    cache_type=TensorProto.FLOAT16,
    key_shape=(3, 2, 16),
    cache_shape=(4, 8, 2, 16),
    **attrs,
):
    base = {"cache_layout": "nd", "plugin_namespace": "pytrt_kv", "plugin_version": "1"}
    base.update(attrs)
    base = {k: v for k, v in base.items() if v is not None}
    node = helper.make_node(
        "ScatterPaKvCache",
        ["key", "", "key_cache", "", "slot_mapping"],
        ["key_cache_out"],
        domain="pytrt_kv",
        name="w",
        **base,
    )
    g = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("key", key_type, key_shape),
            helper.make_tensor_value_info("key_cache", cache_type, cache_shape),
            helper.make_tensor_value_info("slot_mapping", TensorProto.INT32, key_shape[:1]),
        ],
        [helper.make_tensor_value_info("key_cache_out", cache_type, cache_shape)],
    )
    return helper.make_model(
        g,
        ir_version=10,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("pytrt_kv", 1)],
    )


def test_hand_model_ok_and_runs():
    m = _hand_model()
    onnx.checker.check_model(m, full_check=True)
    feeds = make_feeds(m, 0)
    out = runtime.run(m, feeds)
    assert out["key_cache_out"].shape == (4, 8, 2, 16)


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (dict(plugin_version=None), "Required attribute 'plugin_version' is missing"),
        (dict(plugin_namespace=None), "Required attribute 'plugin_namespace' is missing"),
        (dict(bogus=1), "Unrecognized attribute: bogus"),
        (dict(cache_layout=1), "Mismatched attribute type"),
        (dict(cache_type=TensorProto.FLOAT), "T_key|type"),
        (dict(key_type=TensorProto.DOUBLE, cache_type=TensorProto.DOUBLE), "T_key|type"),
        (dict(key_shape=(3, 32)), "key"),
        (dict(cache_shape=(4, 8, 3, 16)), "key_cache"),
        (dict(cache_layout="hnd"), "key_cache"),
        (dict(cache_layout=None), "cache_layout"),
        (dict(plugin_version="2"), "plugin_version"),
    ],
)
def test_bad_models_fail_check(kwargs, pattern):
    m = _hand_model(**kwargs)
    if kwargs == dict(cache_layout=None):
        # Shapes static, or only T dynamic: the layout is detected, so only a model with
        # other dynamic dims needs it.
        onnx.checker.check_model(m, full_check=True)
        # (T is dynamic in key and slot_mapping together: a named T beside a static
        # one is refused, issue 21.)
        for inp, axis, name in ((0, 0, "T"), (2, 0, "T"), (0, 1, "H")):
            m.graph.input[inp].type.tensor_type.shape.dim[axis].dim_param = name
            m.graph.input[inp].type.tensor_type.shape.dim[axis].ClearField("dim_value")
            if inp == 2:
                onnx.checker.check_model(m, full_check=True)
    with pytest.raises(
        (onnx.checker.ValidationError, onnx.shape_inference.InferenceError, ValueError, TypeError),
        match=pattern,
    ):
        onnx.checker.check_model(m, full_check=True)


def test_check_error_names_the_node():
    with pytest.raises(ValueError, match=r"ScatterPaKvCache.*\(w\): key_cache"):
        onnx.checker.check_model(_hand_model(cache_shape=(4, 8, 3, 16)), full_check=True)


# --- graphsurgeon helpers --------------------------------------------------------------


def test_graphsurgeon_scatter_then_gather_graph():
    dt = np.dtype(ml_dtypes.bfloat16)
    g = gs.Graph(opset=18)
    key = gs.Variable("key", dt, (2, 1, 32))
    cache = gs.Variable("kc", dt, (6, 4, 1, 32))
    slots = gs.Variable("slot_mapping", np.int64, (2,))
    g.inputs = [key, cache, slots]
    (out,) = add_scatter_pa_kv_cache(g, key, None, cache, None, slots, alias_io=0)
    node = g.nodes[-1]
    assert node.op == "ScatterPaKvCache" and node.domain == "pytrt_kv"
    assert node.attrs == {
        "alias_io": 0,
        "cache_layout": "nd",
        "plugin_namespace": "pytrt_kv",
        "plugin_version": "1",
    }
    assert out.name == "key_cache_out" and tuple(out.shape) == (6, 4, 1, 32)
    # A second node's outputs get unique names.
    (out2,) = add_scatter_pa_kv_cache(g, key, None, out, None, slots)
    assert out2.name == "key_cache_out_1" and g.nodes[-1].name == "ScatterPaKvCache_1"
    # Every *_out is a graph output, also one a later node reads (docs/SPEC.md O).
    g.outputs = [out, out2]
    m = export_model(g)
    assert m.ir_version == 10
    assert {o.domain: o.version for o in m.opset_import} == {"": 18, "pytrt_kv": 1}
    feeds = {
        "key": np.arange(64).reshape(2, 1, 32).astype(dt),
        "kc": np.full((6, 4, 1, 32), 5, dt),
        "slot_mapping": np.array([3, 22]),
    }
    res = runtime.run(m, feeds)
    want = feeds["kc"].copy()
    want[0, 3, 0] = feeds["key"][0, 0]
    want[5, 2, 0] = feeds["key"][1, 0]
    for name in ("key_cache_out", "key_cache_out_1"):  # the second write is the same
        assert_same_bits(res[name], want, name)


def test_graphsurgeon_gather_outputs_and_names():
    dt = np.dtype(np.float16)
    sk = gather_skeleton(dt, S=2, tbs=4, layout="TND")
    g = gs.Graph(opset=17)
    vs = {n: gs.Variable(n, a.dtype, a.shape) for n, a in sk.items()}
    g.inputs = list(vs.values())
    outs = add_gather_selection_kv_cache(
        g,
        *vs.values(),
        selection_topk_block_size=4,
        name="gather",
        output_names=["a", "b", "c", "d"],
    )
    assert [o.name for o in outs] == ["a", "b", "c", "d"]
    assert [tuple(o.shape) for o in outs] == [
        sk["selection_k_rope"].shape,
        sk["selection_kv_cache"].shape,
        sk["selection_kv_block_status"].shape,
        (sk["selection_kv_block_table"].shape[0],),
    ]
    assert outs[3].dtype == np.int32
    assert g.nodes[0].attrs["selection_topk_block_size"] == 4
    g.outputs = outs
    export_model(g)
    with pytest.raises(ValueError, match="output_names"):
        add_gather_selection_kv_cache(
            g, *vs.values(), selection_topk_block_size=4, output_names=["x"]
        )


def test_graphsurgeon_validates_at_export_time():
    g = gs.Graph(opset=17)
    key = gs.Variable("key", np.float16, (2, 1, 32))
    cache = gs.Variable("kc", np.float32, (6, 4, 1, 32))
    slots = gs.Variable("slot_mapping", np.int32, (2,))
    with pytest.raises((TypeError, ValueError), match="key_cache"):
        add_scatter_pa_kv_cache(g, key, None, cache, None, slots)
    with pytest.raises(TypeError, match="dtype"):
        add_scatter_pa_kv_cache(g, gs.Variable("k"), None, cache, None, slots)
    with pytest.raises(TypeError, match="onnx_graphsurgeon"):
        add_scatter_pa_kv_cache(g, np.zeros(3), None, cache, None, slots)
    assert not g.nodes  # nothing appended on failure


def test_graphsurgeon_dynamic_shapes_need_layout():
    g = gs.Graph(opset=17)
    key = gs.Variable("key", np.float16, ("T", "H", 32))
    cache = gs.Variable("kc", np.float16, (6, 4, 1, 32))
    slots = gs.Variable("slot_mapping", np.int32, ("T",))
    with pytest.raises(
        ValueError,
        match=r"cache_layout: expected one of \['nd', 'nz', 'hnd'\]"
        r".*key float16\[T, H, 32\] \(dim 1\).*pass "
        r"cache_layout=",
    ):
        add_scatter_pa_kv_cache(g, key, None, cache, None, slots)
    key = gs.Variable("key", np.float16, ("T", 1, 32))
    (out,) = add_scatter_pa_kv_cache(g, key, None, cache, None, slots, cache_layout="nd")
    g.inputs, g.outputs = [key, cache, slots], [out]
    m = export_model(g)
    feeds = {
        "key": np.ones((3, 1, 32), np.float16),
        "kc": np.zeros((6, 4, 1, 32), np.float16),
        "slot_mapping": np.array([0, 7, -1], np.int32),
    }
    res = runtime.run(m, feeds)["key_cache_out"]
    assert res[0, 0, 0, 0] == 1 and res[1, 3, 0, 0] == 1 and res.sum() == 64


@pytest.mark.parametrize(
    "cache_shape,value_shape,layout",
    [
        (("NB", 4, 2, 32), None, "nd"),  # NB dynamic too
        ((6, 2, 4, 32), None, "hnd"),
        ((6, 4, 4, 16), None, "nz"),  # H*Dk/L = 2*32/16 = 4 columns of L = 16
        ((6, 4, 2, 32), ("T", 2, 8), "nd"),  # value [T, H, Dv] with its own cache
    ],
)
def test_graphsurgeon_layout_inferred_when_only_t_is_dynamic(cache_shape, value_shape, layout):
    g = gs.Graph(opset=17)
    key = gs.Variable("key", np.float16, ("T", 2, 32))
    cache = gs.Variable("kc", np.float16, cache_shape)
    slots = gs.Variable("slot_mapping", np.int32, ("T",))
    value = vcache = None
    if value_shape is not None:
        value = gs.Variable("value", np.float16, value_shape)
        vcache = gs.Variable("vc", np.float16, cache_shape[:3] + (8,))
    outs = add_scatter_pa_kv_cache(g, key, value, cache, vcache, slots)
    assert g.nodes[0].attrs["cache_layout"] == layout
    g.inputs = [x for x in (key, value, cache, vcache, slots) if x is not None]
    g.outputs = outs
    m = export_model(g)
    rng = np.random.default_rng(3)
    for T in (1, 3):  # two token counts through one model
        nb = 6 if isinstance(cache_shape[0], int) else 5
        feeds = {
            "key": rng.standard_normal((T, 2, 32)).astype(np.float16),
            "kc": np.full((nb,) + tuple(cache_shape[1:]), 7, np.float16),
            "slot_mapping": np.arange(T, dtype=np.int32) * 3,
        }
        if value is not None:
            feeds["value"] = rng.standard_normal((T, 2, 8)).astype(np.float16)
            feeds["vc"] = np.full((nb,) + tuple(cache_shape[1:3]) + (8,), 7, np.float16)
        got = runtime.run(m, feeds)
        want = reference_scatter(feeds, layout)
        assert np.array_equal(got["key_cache_out"], want[0])
        if value is not None:
            assert np.array_equal(got["value_cache_out"], want[1])


def reference_scatter(feeds, layout):
    from pytrt_kv.reference import scatter_pa_kv_cache

    kc = feeds["kc"].copy()
    vc = feeds["vc"].copy() if "vc" in feeds else None
    scatter_pa_kv_cache(
        feeds["key"], feeds.get("value"), kc, vc, feeds["slot_mapping"], cache_layout=layout
    )
    return kc, vc


def test_graphsurgeon_ambiguous_layout_with_dynamic_t_asks_for_it():
    """H = BS: nd [NB, BS, H, D] and hnd [NB, H, BS, D] both fit."""
    g = gs.Graph(opset=17)
    key = gs.Variable("key", np.float16, ("T", 4, 32))
    cache = gs.Variable("kc", np.float16, (6, 4, 4, 32))
    slots = gs.Variable("slot_mapping", np.int32, ("T",))
    with pytest.raises(
        ValueError, match="cache_layout: expected one of .*'nd', 'hnd'.* to be given"
    ):
        add_scatter_pa_kv_cache(g, key, None, cache, None, slots)
