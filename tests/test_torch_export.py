"""torch.onnx.export (dynamo) of a module using the pytrt_kv torch functions: node types,
domain and attributes, then runtime.run against the reference; eager mode too."""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch", reason="torch not installed (extra 'torch')")
pytest.importorskip("onnxscript", reason="onnxscript not installed (extra 'torch')")

from onnx_export import torch_export as pk  # noqa: E402
from pytrt_kv import runtime  # noqa: E402
from pytrt_kv.graph.feeds import make_feeds  # noqa: E402
from pytrt_kv.reference import gather_selection_kv_cache, scatter_pa_kv_cache  # noqa: E402
from support.arrays import assert_same_bits  # noqa: E402
from support.gather_cases import gather_skeleton  # noqa: E402


class WriteThenGather(torch.nn.Module):
    """Scatter the new latent/rope (hnd caches are [NB, 1, BS, D]) and gather a selection."""

    def forward(self, kv, k_rope, key_cache, value_cache, slot_mapping, *gather_inputs):
        """``gather_inputs``: the gather's ten inputs in the op's order (docs/SPEC.md G1)."""
        kc, vc = pk.scatter_pa_kv_cache(
            kv, k_rope, key_cache, value_cache, slot_mapping, cache_layout="hnd"
        )
        outs = pk.gather_selection_kv_cache(*gather_inputs, selection_topk_block_size=4, alias_io=0)
        return (kc, vc, *outs[:3], outs[3] + 0)


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    sk = gather_skeleton(np.dtype(np.float16), S=2, tbs=4)
    from onnx_export import single_op_model

    g = make_feeds(single_op_model("GatherSelectionKvCache", sk, selection_topk_block_size=4), seed)
    scatter = {
        "kv": rng.standard_normal((3, 1, 16)).astype(np.float16),
        "k_rope": rng.standard_normal((3, 1, 8)).astype(np.float16),
        "key_cache": rng.standard_normal((4, 1, 5, 16)).astype(np.float16),
        "value_cache": rng.standard_normal((4, 1, 5, 8)).astype(np.float16),
        "slot_mapping": np.array([7, -1, 19], np.int64),
    }
    return scatter, g


def _numpy_reference(scatter, g):
    kc, vc = scatter["key_cache"].copy(), scatter["value_cache"].copy()
    scatter_pa_kv_cache(
        scatter["kv"], scatter["k_rope"], kc, vc, scatter["slot_mapping"], cache_layout="hnd"
    )
    x = {k: v.copy() for k, v in g.items()}
    actual = gather_selection_kv_cache(*x.values(), selection_topk_block_size=4)
    return [
        kc,
        vc,
        x["selection_k_rope"],
        x["selection_kv_cache"],
        x["selection_kv_block_status"],
        np.asarray(actual, np.int32),
    ]


def test_dynamo_export_round_trip(tmp_path):
    scatter, g = _inputs()
    args = tuple(torch.from_numpy(a) for a in [*scatter.values(), *g.values()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(WriteThenGather().eval(), args, dynamo=True)
    model = program.model_proto
    custom = [n for n in model.graph.node if n.domain == "pytrt_kv"]
    assert [n.op_type for n in custom] == ["ScatterPaKvCache", "GatherSelectionKvCache"]
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in custom]
    assert attrs[0] == {
        "alias_io": 1,
        "cache_layout": b"hnd",
        "plugin_namespace": b"pytrt_kv",
        "plugin_version": b"1",
    }
    assert attrs[1] == {
        "alias_io": 0,
        "selection_topk_block_size": 4,
        "plugin_namespace": b"pytrt_kv",
        "plugin_version": b"1",
    }
    assert {o.domain: o.version for o in model.opset_import}["pytrt_kv"] == 1
    path = tmp_path / "torch.onnx"
    onnx.save(model, str(path))
    onnx.checker.check_model(str(path), full_check=True)
    names = [i.name for i in model.graph.input]
    feeds = dict(zip(names, [*scatter.values(), *g.values()]))
    got = list(runtime.run(path, feeds).values())
    for i, (a, b) in enumerate(zip(got, _numpy_reference(scatter, g))):
        assert_same_bits(a, b, f"output {i}")


def test_eager_mode_runs_the_reference():
    scatter, g = _inputs(1)
    args = [torch.from_numpy(a) for a in [*scatter.values(), *g.values()]]
    before = [a.clone() for a in args]
    got = WriteThenGather()(*args)
    for a, b in zip(args, before):
        assert torch.equal(a, b)  # functional: inputs untouched
    for i, (a, b) in enumerate(zip(got, _numpy_reference(scatter, g))):
        assert_same_bits(a.numpy(), b, f"output {i}")


def test_eager_bfloat16_and_validation():
    key = torch.randn(2, 1, 8).to(torch.bfloat16)
    cache = torch.zeros(3, 4, 1, 8, dtype=torch.bfloat16)
    (out,) = pk.scatter_pa_kv_cache(key, None, cache, None, torch.tensor([0, 9]))
    assert out.dtype == torch.bfloat16
    assert not cache.any(), "functional: the caller's bfloat16 cache must stay untouched"
    assert torch.equal(out[0, 0, 0], key[0, 0]) and torch.equal(out[2, 1, 0], key[1, 0])
    with pytest.raises((TypeError, ValueError), match="key_cache"):
        pk.scatter_pa_kv_cache(key, None, cache.float(), None, torch.tensor([0, 9]))
    with pytest.raises(TypeError, match="key"):
        pk.scatter_pa_kv_cache(np.zeros((2, 1, 8)), None, cache, None, torch.tensor([0, 9]))


class QuantWrite(torch.nn.Module):
    """docs/SPEC.md S9 from torch: float16 key/value into float8 e4m3 caches, per-head
    key scales, one value scale."""

    def forward(self, key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale):
        return pk.scatter_pa_kv_cache(
            key,
            value,
            key_cache,
            value_cache,
            slot_mapping,
            cache_layout="nd",
            k_scale=k_scale,
            v_scale=v_scale,
        )


def _quant_inputs():
    rng = np.random.default_rng(5)
    T, H, D, NB, BS = 5, 2, 16, 3, 4
    return {
        "key": (rng.standard_normal((T, H, D)) * 100).astype(np.float16),
        "value": (rng.standard_normal((T, H, D)) * 100).astype(np.float16),
        "key_cache": np.zeros((NB, BS, H, D), np.uint8).view(ml_dtypes.float8_e4m3fn),
        "value_cache": np.zeros((NB, BS, H, D), np.uint8).view(ml_dtypes.float8_e4m3fn),
        "slot_mapping": np.array([7, -1, 0, 11, 3], np.int32),
        "k_scale": np.array([0.5, 2.0], np.float32),
        "v_scale": np.array(0.25, np.float32),
    }


def _quant_reference(x):
    kc, vc = x["key_cache"].copy(), x["value_cache"].copy()
    scatter_pa_kv_cache(x["key"], x["value"], kc, vc, x["slot_mapping"], k_scale=x["k_scale"],
                        v_scale=x["v_scale"])  # fmt: skip
    return kc, vc


def _torch_of(a):
    if a.dtype == ml_dtypes.float8_e4m3fn:
        return torch.from_numpy(a.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    return torch.from_numpy(a)


def test_quantise_on_write_exports_and_runs(tmp_path):
    x = _quant_inputs()
    args = tuple(_torch_of(a) for a in x.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(QuantWrite().eval(), args, dynamo=True)
    model = program.model_proto
    (node,) = [n for n in model.graph.node if n.domain == "pytrt_kv"]
    assert len(node.input) == 10 and list(node.input[5:8]) == ["", "", ""]
    path = tmp_path / "quant.onnx"
    onnx.save(model, str(path))
    onnx.checker.check_model(str(path), full_check=True)
    feeds = dict(zip([i.name for i in model.graph.input], x.values()))
    got = list(runtime.run(path, feeds).values())
    want = _quant_reference(x)
    assert np.any(want[0].view(np.uint8)) and np.any(want[1].view(np.uint8))
    for i, (a, b) in enumerate(zip(got, want)):
        assert_same_bits(a, b, f"output {i}")
    # Eager torch mode runs the same reference.
    eager = QuantWrite()(*args)
    for i, (a, b) in enumerate(zip(eager, want)):
        assert_same_bits(a.view(torch.uint8).numpy(), b.view(np.uint8), f"eager output {i}")
