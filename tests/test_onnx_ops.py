"""single_op_model + runtime.run reproduce the reference bit-exactly (every layout, mode
and gather variant); every exported model passes onnx.checker full_check; schemas and
shape inference."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest

from onnx_export import single_op_model
from pytrt_kv import runtime
from pytrt_kv.contract import dtypes, specs
from pytrt_kv.graph.feeds import make_feeds
from pytrt_kv.reference import gather_selection_kv_cache, scatter_pa_kv_cache
from support.arrays import assert_same_bits, bits, cache_shape
from support.gather_cases import gather_skeleton
from support.models import compress_key_feeds, reference_scatter

SENTINEL = 13


def _sentinel(shape, dt) -> np.ndarray:
    return np.full(shape, SENTINEL, np.float32).astype(dt)


def _run_and_compare(op_type, feeds, attrs, reference):
    model = single_op_model(op_type, feeds, **attrs)
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version == specs.ONNX_IR_VERSION
    assert {o.domain: o.version for o in model.opset_import} == {
        "": specs.ONNX_OPSET,
        specs.DOMAIN: specs.DOMAIN_VERSION,
    }
    # Graph I/O carry the docs/SPEC.md names, optional inputs only when present.
    op = specs.get_op(op_type)
    assert [i.name for i in model.graph.input] == [n for n in op.input_names if n in feeds]
    node = model.graph.node[0]
    attrs_out = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs_out["plugin_namespace"] == b"pytrt_kv" and attrs_out["plugin_version"] == b"1"
    before = {k: v.copy() for k, v in feeds.items()}
    out = runtime.run(model, feeds)
    for k, v in feeds.items():  # functional: feeds are not modified
        assert_same_bits(v, before[k], k)
    want = reference({k: v.copy() for k, v in feeds.items()})
    assert list(out) == [o.name for o in model.graph.output]
    for name, w in want.items():
        assert_same_bits(out[name], w, name)
    return out, attrs_out


def test_scatter_ambiguous_layout_asks_for_it():
    # nz [NB, H*D/16, BS, 16] and hnd [NB, H, BS, D] coincide when D == 16.
    with pytest.raises(ValueError, match="cache_layout"):
        single_op_model(
            "ScatterPaKvCache",
            {
                "key": np.ones((2, 3, 16), np.float16),
                "key_cache": np.ones((4, 3, 6, 16), np.float16),
                "slot_mapping": np.zeros(2, np.int32),
            },
        )


# --- ScatterPaKvCache -------------------------------------------------------------


def _scatter_ref(layout, mode):
    def ref(x):
        reference_scatter(x, cache_layout=layout, compress_mode=mode)
        out = {"key_cache_out": x["key_cache"]}
        if "value_cache" in x:
            out["value_cache_out"] = x["value_cache"]
        return out

    return ref


@pytest.mark.parametrize("layout", ["nd", "nz", "hnd"])
@pytest.mark.parametrize(
    "dtype", [specs.FLOAT16, specs.BFLOAT16, specs.INT8, specs.FLOAT32, specs.FLOAT8_E4M3]
)
@pytest.mark.parametrize("index", [np.int32, np.int64])
@pytest.mark.parametrize("with_value", [True, False])
def test_scatter_3d(layout, dtype, index, with_value):
    dt = dtypes.numpy_dtype(dtype)
    T, H, Dk, Dv, NB, BS = 7, 2, 16, 32, 5, 3  # odd block size
    shapes = {
        "key": (T, H, Dk),
        "key_cache": cache_shape(layout, NB, BS, H, Dk, dt),
        "slot_mapping": (T,),
    }
    if with_value:
        shapes.update(value=(T, H, Dv), value_cache=cache_shape(layout, NB, BS, H, Dv, dt))
    order = [n for n in specs.SCATTER_PA_KV_CACHE.input_names if n in shapes]
    skeleton = {n: np.zeros(shapes[n], index if n == "slot_mapping" else dt) for n in order}
    model = single_op_model("ScatterPaKvCache", skeleton, cache_layout=layout)
    for seed in range(2):
        feeds = make_feeds(model, seed)
        feeds["key_cache"] = _sentinel(shapes["key_cache"], dt)
        if with_value:
            feeds["value_cache"] = _sentinel(shapes["value_cache"], dt)
        assert (feeds["slot_mapping"] >= 0).any()
        out, attrs = _run_and_compare(
            "ScatterPaKvCache", feeds, {"cache_layout": layout}, _scatter_ref(layout, None)
        )
        assert attrs["cache_layout"] == layout.encode()
        assert not np.array_equal(bits(out["key_cache_out"]), bits(feeds["key_cache"]))


@pytest.mark.parametrize(
    "layout,key,cache",
    [
        ("nd", (2, 3, 16), (4, 6, 3, 16)),
        ("hnd", (2, 3, 8), (4, 3, 6, 8)),
        ("nz", (2, 1, 32), (4, 2, 6, 16)),
    ],
)
def test_scatter_layout_resolved_from_shapes(layout, key, cache):
    feeds = {
        "key": np.ones(key, np.float16),
        "key_cache": np.ones(cache, np.float16),
        "slot_mapping": np.array([0, 5], np.int32),
    }
    m = single_op_model("ScatterPaKvCache", feeds)
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in m.graph.node[0].attribute}
    assert attrs["cache_layout"] == layout.encode()
    out = runtime.run(m, feeds)
    want = _scatter_ref(layout, None)({k: v.copy() for k, v in feeds.items()})
    assert_same_bits(out["key_cache_out"], want["key_cache_out"], "key_cache_out")


@pytest.mark.parametrize(
    "mode,dtype,offsets",
    [
        ("rope", specs.FLOAT16, True),
        ("rope", specs.BFLOAT16, True),
        ("rope", specs.FLOAT32, True),
        (None, specs.FLOAT16, True),
        ("omni", specs.INT8, True),
        ("omni", specs.BFLOAT16, True),
        ("alibi", specs.FLOAT16, False),
        (None, specs.UINT8, False),
        ("alibi", specs.FLOAT16, True),
    ],
)
@pytest.mark.parametrize("index", [np.int32, np.int64])
def test_scatter_compress(mode, dtype, offsets, index):
    dt = dtypes.numpy_dtype(dtype)
    B, Smax, H, Dk, Dv, NB, BS = 3, 6, 2, 8, 4, 9, 5  # runs cross block edges
    skeleton = {
        "key": np.zeros((B, Smax, H, Dk), dt),
        "value": np.zeros((B, Smax, H, Dv), dt),
        "key_cache": np.zeros((NB, BS, 1, Dk), dt),
        "value_cache": np.zeros((NB, BS, 1, Dv), dt),
        "slot_mapping": np.zeros((B, H), index),
        "compress_lens": np.zeros((B, H), index),
    }
    if offsets:
        skeleton["compress_seq_offsets"] = np.zeros(B * H, index)
    skeleton["seq_lens"] = np.zeros(B, index)
    attrs = {} if mode is None else {"compress_mode": mode}
    model = single_op_model("ScatterPaKvCache", skeleton, **attrs)
    resolved = {a.name: onnx.helper.get_attribute_value(a) for a in model.graph.node[0].attribute}
    assert resolved["compress_mode"] == (mode or ("rope" if offsets else "alibi")).encode()
    assert "cache_layout" not in resolved
    for seed in range(3):
        feeds = make_feeds(model, seed)
        feeds["key_cache"] = _sentinel((NB, BS, 1, Dk), dt)
        feeds["value_cache"] = _sentinel((NB, BS, 1, Dv), dt)
        _run_and_compare("ScatterPaKvCache", feeds, attrs, _scatter_ref(None, mode))


# --- GatherSelectionKvCache -------------------------------------------------------


def _gather_ref(tbs):
    def ref(x):
        actual = gather_selection_kv_cache(
            *(x[n] for n in specs.GATHER_SELECTION_KV_CACHE.input_names),
            selection_topk_block_size=tbs,
        )
        return {
            "selection_k_rope_out": x["selection_k_rope"],
            "selection_kv_cache_out": x["selection_kv_cache"],
            "selection_kv_block_status_out": x["selection_kv_block_status"],
            "selection_kv_actual_seq": np.asarray(actual, np.int32),
        }

    return ref


@pytest.mark.parametrize(
    "dtype", [specs.FLOAT16, specs.BFLOAT16, specs.INT8, specs.FLOAT32, specs.FLOAT8_E5M2]
)
@pytest.mark.parametrize("layout", ["BSND", "TND"])
@pytest.mark.parametrize("tbs,S,k_rope", [(1, 1, 4), (1, 2, 0), (4, 1, 0), (4, 2, 4), (2, 3, 4)])
def test_gather(dtype, layout, tbs, S, k_rope):
    dt = dtypes.numpy_dtype(dtype)
    skeleton = gather_skeleton(dt, S=S, tbs=tbs, layout=layout, k_rope=k_rope)
    model = single_op_model("GatherSelectionKvCache", skeleton, selection_topk_block_size=tbs)
    out_types = {o.name: o.type.tensor_type for o in model.graph.output}
    assert [d.dim_value for d in out_types["selection_kv_actual_seq"].shape.dim] == [
        skeleton["selection_kv_block_table"].shape[0]
    ]
    copied = 0
    for seed in range(3):
        feeds = make_feeds(model, seed)
        for name in ("selection_k_rope", "selection_kv_cache"):
            feeds[name] = _sentinel(feeds[name].shape, dt)
        out, _ = _run_and_compare(
            "GatherSelectionKvCache", feeds, {"selection_topk_block_size": tbs}, _gather_ref(tbs)
        )
        copied += int(
            np.count_nonzero(
                bits(out["selection_kv_cache_out"]) != bits(feeds["selection_kv_cache"])
            )
        )
    assert copied > 0  # the grid moves data, not just status


def test_gather_many_topk_token_level():
    dt = np.dtype(np.float16)
    skeleton = gather_skeleton(dt, K=40, tbs=1, SBS=16, FBS=16, FMAX=4)
    model = single_op_model("GatherSelectionKvCache", skeleton, selection_topk_block_size=1)
    feeds = make_feeds(model, 7)
    _run_and_compare(
        "GatherSelectionKvCache", feeds, {"selection_topk_block_size": 1}, _gather_ref(1)
    )


# --- schemas ------------------------------------------------------------------------


def test_schemas_registered_from_specs():
    for op in specs.OPS.values():
        schema = onnx.defs.get_schema(op.name, specs.DOMAIN_VERSION, specs.DOMAIN)
        assert [i.name for i in schema.inputs] == list(op.input_names)
        assert [o.name for o in schema.outputs] == list(op.output_names)
        assert set(schema.attributes) == set(op.attribute_names) | set(specs.PLUGIN_NODE_ATTRIBUTES)
        for t in op.inputs:
            p = schema.inputs[op.input_index(t.name)]
            want = (
                onnx.defs.OpSchema.FormalParameterOption.Optional
                if t.optional
                else onnx.defs.OpSchema.FormalParameterOption.Single
            )
            assert p.option == want, t.name
            allowed = next(
                c.allowed_type_strs
                for c in schema.type_constraints
                if c.type_param_str == p.type_str
            )
            assert len(allowed) == len(t.dtypes)


def test_shape_inference_fills_outputs():
    feeds = gather_skeleton(np.dtype(ml_dtypes.bfloat16), S=2, tbs=4)
    model = single_op_model("GatherSelectionKvCache", feeds, selection_topk_block_size=4)
    del model.graph.output[:]
    node = model.graph.node[0]
    model.graph.output.extend([onnx.helper.make_empty_tensor_value_info(n) for n in node.output])
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    got = {o.name: o for o in inferred.graph.value_info} | {
        o.name: o for o in inferred.graph.output
    }

    def desc(n):
        tt = got[n].type.tensor_type
        return tt.elem_type, [d.dim_value for d in tt.shape.dim]

    assert desc("selection_kv_cache_out") == (
        onnx.TensorProto.BFLOAT16,
        list(feeds["selection_kv_cache"].shape),
    )
    assert desc("selection_kv_block_status_out") == (
        onnx.TensorProto.INT32,
        list(feeds["selection_kv_block_status"].shape),
    )
    assert desc("selection_kv_actual_seq") == (
        onnx.TensorProto.INT32,
        [feeds["selection_kv_block_table"].shape[0]],
    )


@pytest.mark.parametrize(
    "layout,cache",
    [("hnd", (3, 16, 4, 8)), ("nz", (3, 8, 4, 16))],  # [NB, H, BS, D] / [NB, H*D/16, BS, 16]
)
def test_feeds_for_a_node_without_cache_layout_use_the_detected_block_size(layout, cache):
    # A hand-written node may leave cache_layout empty: the loader must read BS from the
    # detected layout's dim, not from dim 1 (H or H*D/L here, larger than BS), else it
    # draws slots past NB*BS. The model checks refuse such a node (docs/SPEC.md O:
    # cache_layout is required with a 3-D key, issue 31), so it runs once the layout is set.
    T, H, D = 6, 16, 8
    node = onnx.helper.make_node(
        "ScatterPaKvCache",
        ["key", "", "key_cache", "", "slot_mapping"],
        ["key_cache_out"],
        domain=specs.DOMAIN,
        **specs.PLUGIN_NODE_ATTRIBUTES,
    )
    f16, i32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.INT32
    graph = onnx.helper.make_graph(
        [node],
        "g",
        [
            onnx.helper.make_tensor_value_info("key", f16, [T, H, D]),
            onnx.helper.make_tensor_value_info("key_cache", f16, list(cache)),
            onnx.helper.make_tensor_value_info("slot_mapping", i32, [T]),
        ],
        [onnx.helper.make_tensor_value_info("key_cache_out", f16, list(cache))],
    )
    model = onnx.helper.make_model(
        graph,
        opset_imports=[
            onnx.helper.make_opsetid("", 17),
            onnx.helper.make_opsetid(specs.DOMAIN, specs.DOMAIN_VERSION),
        ],
    )
    NB, BS = cache[0], cache[2]
    with pytest.raises(ValueError, match=r"attribute 'cache_layout': .*required with a 3-D key"):
        runtime.run(model, make_feeds(model, 0))
    for seed in range(4):
        feeds = make_feeds(model, seed)
        assert feeds["slot_mapping"].max() < NB * BS
        fixed = onnx.ModelProto()
        fixed.CopyFrom(model)
        fixed.graph.node[0].attribute.append(onnx.helper.make_attribute("cache_layout", layout))
        assert make_feeds(fixed, seed)["slot_mapping"].tolist() == feeds["slot_mapping"].tolist()
        out = runtime.run(fixed, feeds)["key_cache_out"]
        expected = feeds["key_cache"].copy()
        scatter_pa_kv_cache(
            feeds["key"], None, expected, None, feeds["slot_mapping"], cache_layout=layout
        )
        assert_same_bits(out, expected, "key_cache_out")


def test_symbolic_batch_and_heads_of_a_4d_key_pass_the_checker():
    """Issue 21 (fuzzing): specs.absent_placeholders multiplied the symbolic B and H of a
    4-D key ("can't multiply sequence by non-int of type 'str'" in the checker)."""
    rng = np.random.default_rng(0)
    feeds = compress_key_feeds(rng)
    model = single_op_model("ScatterPaKvCache", feeds)
    symbolic = {"key": {0: "B", 2: "H"}, "slot_mapping": {0: "B", 1: "H"}}
    symbolic.update(compress_lens={0: "B", 1: "H"}, seq_lens={0: "B"})
    for vi in model.graph.input:
        for axis, name in symbolic.get(vi.name, {}).items():
            vi.type.tensor_type.shape.dim[axis].dim_param = name
    onnx.checker.check_model(model, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    out = {vi.name: vi for vi in inferred.graph.output}["key_cache_out"]
    assert [d.dim_value for d in out.type.tensor_type.shape.dim] == [2, 4, 1, 8]
    assert specs.absent_placeholders({"key": ("B", 4, "H", 8), "compress_seq_offsets": (0,)}) == (
        "compress_seq_offsets",
    )
    assert specs.absent_placeholders({"key": ("B", 4, 0, 8), "compress_seq_offsets": (0,)}) == ()
