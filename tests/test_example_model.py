"""The example sparse-attention decode model and `pytrt-kv export-example`."""

from __future__ import annotations

import argparse

import numpy as np
import onnx
import pytest

from onnx_export.example import CACHE_OUTPUTS, ExampleSizes, build_example_model
from pytrt_kv import runtime
from pytrt_kv.cli import export_example
from pytrt_kv.graph.feeds import make_feeds

SIZES = [
    ExampleSizes(),
    ExampleSizes(
        batch=3,
        topk=5,
        selection_block_size=4,
        block_size=5,
        max_blocks_per_seq=3,
        num_blocks=10,
        dtype="float32",
        kv_dim=16,
        rope_dim=8,
        heads=2,
    ),
]


def _producer(model, name):
    return next(n for n in model.graph.node if name in n.output)


@pytest.mark.parametrize("sizes", SIZES)
def test_structure_and_wiring(sizes):
    m = build_example_model(sizes)
    onnx.checker.check_model(m, full_check=True)
    assert m.ir_version == 10
    custom = [n for n in m.graph.node if n.domain == "pytrt_kv"]
    assert [n.op_type for n in custom] == ["ScatterPaKvCache", "GatherSelectionKvCache"]
    scatter, gather = custom
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in gather.attribute}
    assert attrs["selection_topk_block_size"] == 1 and attrs["plugin_namespace"] == b"pytrt_kv"
    # The gather reads the UPDATED full caches: scatter *_out -> Reshape -> gather.
    for gather_in, scatter_out in ((6, 0), (5, 1)):
        reshape = _producer(m, gather.input[gather_in])
        assert reshape.op_type == "Reshape" and reshape.input[0] == scatter.output[scatter_out]
    assert gather.input[4] == "topk_indices"
    # Each cache input is consumed by its op only; each *_out is a graph output.
    outputs = {o.name for o in m.graph.output}
    for cache, cache_out in CACHE_OUTPUTS.items():
        consumers = [n for n in m.graph.node if cache in n.input]
        assert len(consumers) == 1 and consumers[0].domain == "pytrt_kv", cache
        assert cache_out in outputs
    assert {"attn_out", "selection_kv_actual_seq"} <= outputs


def test_topk_padding_when_few_tokens_visible():
    sizes = ExampleSizes()
    m = build_example_model(sizes)
    feeds = make_feeds(m, 3)
    feeds["selection_kv_block_status"][:] = -1
    kv_len = np.array([3, sizes.topk + 4], np.int32)
    table = feeds["full_kv_block_table"]
    pos = kv_len - 1
    feeds["full_kv_actual_seq"] = kv_len
    feeds["slot_mapping"] = (
        table[np.arange(2), pos // sizes.block_size] * sizes.block_size + pos % sizes.block_size
    ).astype(np.int32)
    out = runtime.run(m, feeds)
    topk = out["topk_indices"].reshape(2, -1)
    assert sorted(topk[0][topk[0] >= 0].tolist()) == [0, 1, 2]
    assert (topk[0] == -1).sum() == sizes.topk - 3
    assert (topk[1] >= 0).all() and topk[1].max() < kv_len[1]
    assert out["selection_kv_actual_seq"].tolist() == [3, sizes.topk]
    assert np.isfinite(out["attn_out"]).all()


def test_sizes_validated():
    with pytest.raises(ValueError, match="num_blocks"):
        ExampleSizes(batch=8, num_blocks=4).validate()
    with pytest.raises(ValueError, match="topk"):
        ExampleSizes(topk=100).validate()
    with pytest.raises(ValueError, match="dtype"):
        ExampleSizes(dtype="int8").validate()


def test_export_example_cli(tmp_path, capsys):
    from pytrt_kv.cli import main

    path = tmp_path / "ex.onnx"
    assert (
        main(["export-example", str(path), "--topk", "4", "--batch", "1", "--alias-io", "0"]) == 0
    )
    assert "wrote" in capsys.readouterr().out
    m = onnx.load(str(path))
    onnx.checker.check_model(m, full_check=True)
    status = next(i for i in m.graph.input if i.name == "selection_kv_block_status")
    assert [d.dim_value for d in status.type.tensor_type.shape.dim] == [1, 1, 1, 5]
    for n in m.graph.node:
        if n.domain == "pytrt_kv":
            assert {a.name: a.i for a in n.attribute}["alias_io"] == 0


def test_export_example_module_entry(tmp_path):
    p = argparse.ArgumentParser()
    export_example.add_arguments(p)
    assert export_example.run(p.parse_args([str(tmp_path / "a.onnx")])) == 0
    with pytest.raises(FileNotFoundError, match="path"):
        export_example.run(p.parse_args([str(tmp_path / "missing" / "a.onnx")]))


# --- the dynamic-batch variant -----------------------------------------------------------


def test_dynamic_variant_declares_symbolic_batch():
    z = ExampleSizes(batch=3)
    m = build_example_model(z, dynamic=True)
    onnx.checker.check_model(m, full_check=True)
    dims = {
        i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
        for i in m.graph.input
    }
    assert dims["kv"] == ["batch", 1, z.kv_dim]
    assert dims["slot_mapping"] == ["batch"]  # T = batch (S = 1)
    assert dims["selection_kv_block_status"] == ["batch", 1, 1, z.topk + 1]
    assert dims["full_kv_cache"] == [z.num_blocks, z.block_size, 1, z.kv_dim]  # static
    assert dims["selection_kv_cache"][0] == z.selection_num_blocks
    static = build_example_model(z)
    assert all(
        d.HasField("dim_value") for i in static.graph.input for d in i.type.tensor_type.shape.dim
    )


@pytest.mark.parametrize("batch", [1, 3])
def test_dynamic_variant_runs_two_batch_sizes_on_the_cpu_runtime(batch):
    """One dynamic model, decode steps at two batch sizes, each verified against the
    independent NumPy computation of ``pytrt-kv demo``."""
    import dataclasses

    from pytrt_kv import demo

    z = ExampleSizes(batch=3)
    m = runtime.make_evaluator(build_example_model(z, dynamic=True))
    zb = dataclasses.replace(z, batch=batch)
    rng = np.random.default_rng(batch)
    step_model = build_example_model(zb)  # make_feeds draws from the static model
    state = demo.initial_state(zb, prompt_len=10, rng=rng, model=step_model)
    for name in ("selection_k_rope", "selection_kv_cache"):  # the model's static pool
        x = state[name]
        pad = np.full((z.selection_num_blocks - x.shape[0],) + x.shape[1:], demo.SENTINEL, x.dtype)
        state[name] = np.concatenate([x, pad])
    for _ in range(2):
        feeds = demo.step_feeds(zb, state, rng, step_model)
        out = runtime.run(m, feeds)
        assert out["attn_out"].shape == (batch, z.heads, z.kv_dim)
        fails, _ = demo.verify_step(zb, feeds, out, demo.expected_step(zb, feeds))
        assert not fails, fails
        state.update({k: out[k + "_out"] for k in CACHE_OUTPUTS})
        state["kv_len"] = feeds["full_kv_actual_seq"]


def test_dynamic_variant_matches_the_static_model():
    """Same feeds through the dynamic model and the static one of that batch size."""
    z = ExampleSizes(batch=2)
    dyn, static = build_example_model(z, dynamic=True), build_example_model(z)
    feeds = make_feeds(static, 4)
    a, b = runtime.run(dyn, feeds), runtime.run(static, feeds)
    assert a.keys() == b.keys()
    for name in a:
        assert np.array_equal(a[name], b[name], equal_nan=True), name


def test_export_example_cli_dynamic(tmp_path):
    from pytrt_kv.cli import main

    path = tmp_path / "dyn.onnx"
    assert (
        main(["export-example", str(path), "--dynamic", "--batch", "4", "--num-blocks", "16"]) == 0
    )
    m = onnx.load(str(path))
    kv = next(i for i in m.graph.input if i.name == "kv")
    assert kv.type.tensor_type.shape.dim[0].dim_param == "batch"


@pytest.mark.parametrize(
    "argv",
    [
        ["export-example", "{dir}"],
        ["export-example", "{dir}/no/x.onnx"],
        ["demo", "--model", "{dir}", "--no-trt", "--steps", "1"],
        ["demo", "--model", "{dir}/no/x.onnx", "--no-trt"],
    ],
)
def test_cli_bad_model_paths_are_one_line_errors(tmp_path, capsys, argv):
    from pytrt_kv.cli import main

    argv = [a.replace("{dir}", str(tmp_path)) for a in argv]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"pytrt-kv {argv[0]}: error: ") and err.count("\n") == 1, err
    assert ("directory" in err) and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_cli_os_errors_are_one_line(tmp_path, capsys, monkeypatch):
    """Any other OSError of a subcommand (e.g. a read-only folder) is one line too."""
    from pytrt_kv.cli import main

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path / "m.onnx"))

    monkeypatch.setattr(onnx, "save", denied)
    assert main(["export-example", str(tmp_path / "m.onnx")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pytrt-kv export-example: error: ") and "Permission denied" in err
