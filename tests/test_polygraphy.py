"""Polygraphy extension (`polygraphy run m.onnx --pytrt-kv-ref`) and the data loader."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from onnx_export import single_op_model
from onnx_export.example import ExampleSizes, build_example_model
from pytrt_kv import runtime
from pytrt_kv.polygraphy import data_loader
from support.env import polygraphy_command, polygraphy_env
from support.gather_cases import gather_skeleton

REPO = Path(__file__).resolve().parents[1]
LOADER = REPO / "pytrt_kv" / "polygraphy" / "data_loader.py"

pytest.importorskip("polygraphy", reason="polygraphy not installed (extra 'test')")


@pytest.fixture(scope="module")
def example_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("ex") / "example.onnx"
    onnx.save(build_example_model(ExampleSizes()), str(path))
    return path


def _polygraphy(args, tmp_path):
    return subprocess.run(
        polygraphy_command() + [str(a) for a in args],
        cwd=tmp_path,
        env=polygraphy_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_entry_point_declared_in_pyproject():
    text = (REPO / "pyproject.toml").read_text()
    assert '[project.entry-points."polygraphy.run.plugins"]' in text
    assert 'pytrt-kv = "pytrt_kv.polygraphy:export_argument_groups"' in text
    from pytrt_kv.polygraphy import export_argument_groups

    (group,) = export_argument_groups()
    assert group.get_name_opt()[1] == "pytrt-kv-ref"


def test_polygraphy_run_example_cpu(example_path, tmp_path):
    # Two reference runners: exercises Polygraphy's Comparator on CPU (ONNX Runtime cannot
    # run our custom ops, so it is not a comparison target).
    res = _polygraphy(
        ["run", example_path, "--pytrt-kv-ref", "--pytrt-kv-ref", "--data-loader-script", LOADER],
        tmp_path,
    )
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-4000:]
    assert "Passed: 3/3 iterations" in log and "PASSED" in log


def test_polygraphy_run_single_op_gather(tmp_path):
    path = tmp_path / "gather.onnx"
    sk = gather_skeleton(np.dtype(np.float16), S=2, tbs=4, layout="TND")
    onnx.save(single_op_model("GatherSelectionKvCache", sk, selection_topk_block_size=4), str(path))
    res = _polygraphy(["run", path, "--pytrt-kv-ref", "--data-loader-script", LOADER], tmp_path)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]


def test_runner_api_matches_runtime(example_path):
    from polygraphy.comparator import Comparator

    from pytrt_kv.polygraphy import PytrtKvRefRunner

    model = onnx.load(str(example_path))
    feeds = list(data_loader.load_data(example_path, iterations=2, seed=5))
    results = Comparator.run([PytrtKvRefRunner(model)], data_loader=feeds)
    ((_, iters),) = results.items()
    assert len(iters) == 2
    for feed, got in zip(feeds, iters):
        want = runtime.run(model, feed)
        for name, w in want.items():
            assert np.array_equal(np.asarray(got[name]), w, equal_nan=True), name


# --- data loader ----------------------------------------------------------------------


def test_loader_example_feeds_are_valid(example_path):
    model = onnx.load(str(example_path))
    z = ExampleSizes()
    names = [i.name for i in model.graph.input]
    a = list(data_loader.load_data(example_path, iterations=3, seed=1))
    b = list(data_loader.load_data(model, iterations=3, seed=1))
    assert len(a) == 3
    for fa, fb in zip(a, b):  # deterministic
        assert list(fa) == names
        assert all(np.array_equal(fa[n], fb[n]) for n in names)
    for f in a:
        kv_len = f["full_kv_actual_seq"]
        assert ((kv_len >= 1) & (kv_len <= z.max_tokens)).all()
        table = f["full_kv_block_table"]
        assert len(np.unique(table)) == table.size  # private full blocks
        pos = kv_len - 1
        slots = table[np.arange(z.batch), pos // z.block_size] * z.block_size + pos % z.block_size
        assert np.array_equal(f["slot_mapping"], slots)  # decode-step consistency
        sel = f["selection_kv_block_table"]
        assert len(np.unique(sel)) == sel.size  # private selection blocks
        runtime.run(model, f)  # the reference accepts them
    assert not np.array_equal(a[0]["kv"], a[1]["kv"])


def test_loader_finds_model_from_env_and_argv(example_path, monkeypatch):
    monkeypatch.setenv("PYTRT_KV_MODEL", str(example_path))
    assert "kv" in next(data_loader.load_data())
    monkeypatch.delenv("PYTRT_KV_MODEL")
    monkeypatch.setattr(sys, "argv", ["polygraphy", "run", str(example_path), "--x"])
    assert len(list(data_loader.load_data(iterations=2))) == 2
    monkeypatch.setattr(sys, "argv", ["polygraphy"])
    with pytest.raises(ValueError, match="model"):
        next(data_loader.load_data())


def test_loader_topk_rows_and_status(tmp_path):
    sk = gather_skeleton(np.dtype(np.float16), B=3, S=2, K=6, tbs=2, layout="BSND")
    m = single_op_model("GatherSelectionKvCache", sk, selection_topk_block_size=2)
    padded = reused = 0
    for seed in range(6):
        f = data_loader.make_feeds(m, seed)
        topk = f["selection_topk_indices"].reshape(6, 6)
        status = f["selection_kv_block_status"].reshape(6, 7)
        for r in range(6):
            valid = topk[r][topk[r] >= 0]
            assert len(np.unique(valid)) == len(valid)  # distinct ids per row
            padded += int((topk[r] < 0).sum())
            old = status[r, :6]
            n_old = int((old >= 0).sum())
            assert (old[:n_old] >= 0).all() and (old[n_old:] == -1).all()
            reused += len(set(valid.tolist()) & set(old[:n_old].tolist()))
        runtime.run(m, f)
    assert padded > 0 and reused > 0


def test_loader_refuses_models_without_room():
    sk = gather_skeleton(np.dtype(np.float16), B=2, K=5, tbs=1, extra_rows=0)
    sk["selection_kv_cache"] = np.zeros((1, 8, 32), np.float16)
    sk["selection_k_rope"] = np.zeros((1, 8, 4), np.float16)
    m = single_op_model("GatherSelectionKvCache", sk, selection_topk_block_size=1)
    with pytest.raises(ValueError, match="selection_kv_cache"):
        data_loader.make_feeds(m, 0)


def test_data_loader_refuses_a_full_cache_too_small_for_private_blocks():
    # Shared full blocks would give two batches the same slots (duplicates, docs/SPEC.md S7).
    sk = gather_skeleton(np.dtype(np.float16), B=3, FMAX=4)
    sk["full_kv_cache"] = np.zeros((3 * 4 - 1, 8, 32), np.float16)
    sk["full_k_rope"] = np.zeros((3 * 4 - 1, 8, 4), np.float16)
    m = single_op_model("GatherSelectionKvCache", sk, selection_topk_block_size=1)
    with pytest.raises(
        ValueError,
        match=r"full_kv_cache: expected at least B\*F_MAX_BLOCK_NUM "
        r"= 12 blocks.*got 11 blocks",
    ):
        data_loader.make_feeds(m, 0)


# --- the runner takes the model in any form, like Polygraphy's runners ----------------


def test_runner_accepts_paths_bytes_and_loaders(example_path):
    from polygraphy.backend.onnx import OnnxFromPath
    from polygraphy.comparator import Comparator

    from pytrt_kv.polygraphy import PytrtKvRefRunner

    model = onnx.load(str(example_path))
    feeds = list(data_loader.load_data(model, iterations=1, seed=2))
    want = runtime.run(model, feeds[0])
    for source in (
        str(example_path),
        example_path,
        model.SerializeToString(),
        OnnxFromPath(str(example_path)),
    ):
        runner = PytrtKvRefRunner(source)
        results = Comparator.run([runner], data_loader=feeds)
        ((_, (got,)),) = results.items()
        for name, w in want.items():
            assert np.array_equal(np.asarray(got[name]), w, equal_nan=True), (source, name)
        with runner:
            assert "kv" in runner.get_input_metadata(use_numpy_dtypes=False)


def test_runner_missing_file_is_a_clear_error(tmp_path):
    from pytrt_kv.polygraphy import PytrtKvRefRunner

    runner = PytrtKvRefRunner(str(tmp_path / "nope.onnx"))
    with pytest.raises(FileNotFoundError, match="nope.onnx"):
        runner.activate()


# --- a run without the data loader fails instead of checking nothing -------------------


def test_polygraphy_run_without_data_loader_fails(example_path, tmp_path):
    res = _polygraphy(["run", example_path, "--pytrt-kv-ref"], tmp_path)
    log = res.stdout + res.stderr
    assert res.returncode != 0, log[-4000:]
    assert "--data-loader-script" in log and "slot_mapping" in log
    assert "Traceback" not in log


def test_polygraphy_run_without_index_inputs_needs_no_loader(tmp_path):
    """A model whose op inputs are all computed in the graph is fine with the default."""
    from pytrt_kv.polygraphy._args import index_inputs_fed_by_graph

    path = tmp_path / "gather.onnx"
    sk = gather_skeleton(np.dtype(np.float16), tbs=1)
    onnx.save(single_op_model("GatherSelectionKvCache", sk, selection_topk_block_size=1), str(path))
    assert any("full_kv_actual_seq" in x for x in index_inputs_fed_by_graph(str(path)))
    plain = tmp_path / "plain.onnx"
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])
    onnx.save(
        onnx.helper.make_model(
            onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
        ),
        str(plain),
    )
    assert index_inputs_fed_by_graph(str(plain)) == []


# --- the loader reads Polygraphy's options ------------------------------------------


def test_loader_takes_seed_and_iterations_from_polygraphy_options(example_path, monkeypatch):
    model = onnx.load(str(example_path))
    monkeypatch.delenv("PYTRT_KV_SEED", raising=False)
    monkeypatch.setenv("PYTRT_KV_ITERATIONS", "5")
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "polygraphy",
            "run",
            str(example_path),
            "--pytrt-kv-ref",
            "--seed",
            "7",
            "--iterations",
            "2",
        ],
    )
    got = list(data_loader.load_data())
    assert len(got) == 2
    for i, feeds in enumerate(got):
        want = data_loader.make_feeds(model, 7 + i)
        assert all(np.array_equal(feeds[n], want[n]) for n in want)
    # Explicit arguments win over the command line; --iters is Polygraphy's alias.
    assert len(list(data_loader.load_data(iterations=1))) == 1
    monkeypatch.setattr(sys, "argv", ["polygraphy", "run", str(example_path), "--iters", "4"])
    assert len(list(data_loader.load_data())) == 4
    monkeypatch.setattr(sys, "argv", ["polygraphy", "run", str(example_path)])
    assert len(list(data_loader.load_data())) == 5  # the environment


def test_polygraphy_run_dynamic_example_with_input_shapes(tmp_path):
    path = tmp_path / "dyn.onnx"
    onnx.save(build_example_model(ExampleSizes(batch=3), dynamic=True), str(path))
    res = _polygraphy(
        [
            "run",
            path,
            "--pytrt-kv-ref",
            "--pytrt-kv-ref",
            "--data-loader-script",
            LOADER,
            "--input-shapes",
            "kv:[3,1,64]",
            "--iterations",
            "2",
            "--seed",
            "3",
        ],
        tmp_path,
    )
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-4000:]
    assert "Passed: 2/2 iterations" in log
    assert "attn_out [dtype=float32, shape=(3, 4, 64)]" in log


# --- dynamic dims -------------------------------------------------------------------


@pytest.fixture(scope="module")
def dynamic_model():
    return build_example_model(ExampleSizes(batch=3), dynamic=True)


def test_loader_dynamic_dims_from_shapes_argv_and_default(dynamic_model, monkeypatch):
    m = dynamic_model
    monkeypatch.setattr(sys, "argv", ["pytest"])
    for b in (2, 3):
        f = data_loader.make_feeds(m, 1, shapes={"kv": [b, 1, 64]})
        assert f["kv"].shape == (b, 1, 64) and f["selection_kv_block_status"].shape[0] == b
        assert f["full_kv_block_table"].shape == (b, 4)  # every "batch" dim bound
        out = runtime.run(m, f)
        assert out["attn_out"].shape == (b, 4, 64)

    def first(argv):  # the loader reads the command line; make_feeds does not
        monkeypatch.setattr(sys, "argv", argv)
        return next(data_loader.load_data(m, iterations=1, seed=0))

    argv = ["polygraphy", "run", "m.onnx", "--input-shapes", "slot_mapping:[2]", "index_q:[2,64]"]
    assert first(argv)["q_nope"].shape == (2, 4, 64)
    opt = ["--trt-min-shapes", "kv:[1,1,64]", "--trt-opt-shapes", "kv:[3,1,64]"]
    argv = ["polygraphy", "run", "m.onnx", *opt, "--trt-max-shapes", "kv:[3,1,64]"]
    assert first(argv)["kv"].shape == (3, 1, 64)  # the opt profile
    f = first(["pytest"])  # Polygraphy's default 1
    assert f["kv"].shape == (1, 1, 64)
    runtime.run(m, f)


# --- make_feeds is pure; the loader reads argv and the environment (issue 21 item 4) ----


def test_make_feeds_reads_neither_argv_nor_the_environment(dynamic_model, monkeypatch):
    """Junk on the command line and in the environment changes nothing: the same
    arguments give the same feeds, another seed other feeds."""
    from pytrt_kv.graph.feeds import make_feeds

    m = dynamic_model
    monkeypatch.setattr(sys, "argv", ["pytest"])
    for var in ("PYTRT_KV_MODEL", "PYTRT_KV_SEED", "PYTRT_KV_ITERATIONS", "PYTRT_KV_MAX_BYTES"):
        monkeypatch.delenv(var, raising=False)
    clean = {s: make_feeds(m, s) for s in (0, 1)}
    junk_argv = ["polygraphy", "run", "other.onnx", "--seed", "9", "--input-shapes", "kv:[2,1,64]"]
    monkeypatch.setattr(sys, "argv", junk_argv)
    monkeypatch.setenv("PYTRT_KV_MODEL", "/nonexistent.onnx")
    monkeypatch.setenv("PYTRT_KV_SEED", "junk")
    monkeypatch.setenv("PYTRT_KV_ITERATIONS", "abc")
    monkeypatch.setenv("PYTRT_KV_MAX_BYTES", "1")
    for seed, want in clean.items():
        for _ in range(2):
            got = make_feeds(m, seed)
            assert list(got) == list(want)
            assert all(np.array_equal(got[n], want[n]) for n in want), seed
        runtime.run(m, got)
    assert not np.array_equal(clean[0]["kv"], clean[1]["kv"])


def test_feeds_module_never_touches_argv_or_the_environment():
    """No os/sys import and no environ/argv/getenv attribute in pytrt_kv/graph/feeds.py
    and the modules it draws from (feeds_*.py)."""
    import ast

    paths = sorted((REPO / "pytrt_kv" / "graph").glob("feeds*.py"))
    assert len(paths) >= 4, paths
    nodes = [n for p in paths for n in ast.walk(ast.parse(p.read_text()))]
    bad = []
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            bad += [f"import {x}" for x in mods if x in ("os", "sys")]
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "argv", "getenv"):
            bad.append(f".{node.attr} at line {node.lineno}")
    assert not bad, bad


@pytest.mark.parametrize(
    "var,value,match",
    [
        (
            "PYTRT_KV_ITERATIONS",
            "abc",
            "PYTRT_KV_ITERATIONS: expected a positive integer, got 'abc'",
        ),
        ("PYTRT_KV_ITERATIONS", "0", "PYTRT_KV_ITERATIONS: expected a positive integer, got '0'"),
        ("PYTRT_KV_SEED", "1.5", r"PYTRT_KV_SEED: expected an integer >= 0, got '1\.5'"),
        ("PYTRT_KV_MAX_BYTES", "lots", "PYTRT_KV_MAX_BYTES: expected a positive integer"),
    ],
)
def test_loader_names_a_bad_environment_variable(example_path, monkeypatch, var, value, match):
    monkeypatch.setattr(sys, "argv", ["pytest"])
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=match):
        next(data_loader.load_data(example_path))


def test_loader_names_a_bad_command_line_option(example_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["polygraphy", "run", str(example_path), "--seed", "x"])
    with pytest.raises(ValueError, match="--seed: expected an integer >= 0, got 'x'"):
        next(data_loader.load_data())


def test_a_terabyte_cache_is_refused_naming_the_input_and_size(monkeypatch):
    """A model may declare a cache larger than the host: a ValueError naming the input and
    its size before anything is allocated, never a MemoryError."""
    from types import SimpleNamespace

    monkeypatch.setattr(sys, "argv", ["pytest"])
    monkeypatch.delenv("PYTRT_KV_MAX_BYTES", raising=False)

    def stand(shape, dt):
        return SimpleNamespace(shape=shape, dtype=np.dtype(dt))

    cache = (2**25, 16, 8, 128)  # float16: 2**40 bytes = 1 TiB
    m = single_op_model(
        "ScatterPaKvCache",
        {
            "key": stand((4, 8, 128), np.float16),
            "key_cache": stand(cache, np.float16),
            "slot_mapping": stand((4,), np.int32),
        },
        cache_layout="nd",
    )
    match = (
        r"key_cache: expected the feeds to fit .* got float16\[33554432, 16, 8, 128\] "
        r"= 1099511627776 bytes \(1 TiB\)"
    )
    with pytest.raises(ValueError, match=match):
        data_loader.make_feeds(m, 0)
    with pytest.raises(ValueError, match=match):
        next(data_loader.load_data(m, iterations=1))
    # The limit is an argument (and $PYTRT_KV_MAX_BYTES for the loader).
    small = scatter_model_small()
    with pytest.raises(ValueError, match="key_cache: expected the feeds to fit in max_bytes = 100"):
        data_loader.make_feeds(small, 0, max_bytes=100)
    monkeypatch.setenv("PYTRT_KV_MAX_BYTES", "100")
    with pytest.raises(ValueError, match="key_cache: expected the feeds to fit in max_bytes = 100"):
        next(data_loader.load_data(small))


def scatter_model_small():
    return single_op_model(
        "ScatterPaKvCache",
        {
            "key": np.zeros((3, 2, 16), np.float16),
            "key_cache": np.zeros((4, 8, 2, 16), np.float16),
            "slot_mapping": np.zeros((3,), np.int32),
        },
    )


def test_paged_step_reads_the_hnd_block_size_from_dim_2():
    """A paged step whose scatter writes an hnd cache [NB, H, BS, D] (docs/SPEC.md S2, S5)
    and leaves cache_layout to be detected: BS is dim 2, not the head count of dim 1. The
    model checks refuse the node without cache_layout (docs/SPEC.md O, issue 31): it runs
    with the layout put back, on the same feeds."""
    from onnx import TensorProto, helper

    B, H, D, NB, BS, W = 2, 3, 8, 8, 4, 2
    m = single_op_model(
        "ScatterPaKvCache",
        {
            "key": np.zeros((B, H, D), np.float16),
            "key_cache": np.zeros((NB, H, BS, D), np.float16),
            "slot_mapping": np.zeros((B,), np.int32),
        },
        cache_layout="hnd",
    )
    node = m.graph.node[0]
    keep = [a for a in node.attribute if a.name != "cache_layout"]
    del node.attribute[:]
    node.attribute.extend(keep)
    m.graph.input.append(helper.make_tensor_value_info("block_tables", TensorProto.INT32, [B, W]))
    m.graph.input.append(helper.make_tensor_value_info("seq_lens", TensorProto.INT32, [B]))
    for seed in range(5):
        f = data_loader.make_feeds(m, seed)
        tables, slots, lens = f["block_tables"], f["slot_mapping"], f["seq_lens"]
        pos = lens - 1
        assert (slots // BS == tables[np.arange(B), pos // BS]).all(), (tables, slots, pos)
        assert (slots % BS == pos % BS).all()
        with pytest.raises(ValueError, match=r"'cache_layout': .*required with a 3-D key"):
            runtime.run(m, f)
        fixed = onnx.ModelProto()
        fixed.CopyFrom(m)
        fixed.graph.node[0].attribute.append(helper.make_attribute("cache_layout", "hnd"))
        runtime.run(fixed, f)


@pytest.mark.parametrize(
    "shapes,match",
    [
        ({"kv": [2, 1, 64], "slot_mapping": [3]}, r"slot_mapping: expected dim 0 = batch = 2"),
        ({"kv": [2, 1, 65]}, r"kv: expected dim 2 = 64 \(static in the model\)"),
        ({"kv": [2, 64]}, r"kv: expected a shape of rank 3"),
        ({"nope": [1]}, r"'nope' is not a graph input"),
    ],
)
def test_loader_refuses_inconsistent_shapes(dynamic_model, shapes, match):
    with pytest.raises(ValueError, match=match):
        data_loader.make_feeds(dynamic_model, 0, shapes=shapes)


# --- models the loader cannot serve: clear errors naming the input ----------------------


def _rename_input(model, old, new):
    for vi in model.graph.input:
        if vi.name == old:
            vi.name = new
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new
    return model


def _table_as_initializer(m):
    """Status and topk as graph inputs but no full_kv_block_table to derive kv_len."""
    table = next(vi for vi in m.graph.input if vi.name == "full_kv_block_table")
    m.graph.input.remove(table)
    init = onnx.numpy_helper.from_array(np.zeros((2, 4), np.int32), "full_kv_block_table")
    m.graph.initializer.append(init)


@pytest.mark.parametrize(
    "skeleton,change,match",
    [
        pytest.param(
            {},
            lambda m: _rename_input(m, "selection_topk_indices", "topk"),
            r"^topk: expected the graph input to be named 'selection_topk_indices'",
            id="index input under another name",
        ),
        pytest.param(
            {},
            lambda m: _rename_input(m, "full_kv_cache", "fkv"),  # not an index input
            r"^full_kv_cache: expected a graph input named 'full_kv_cache'",
            id="no cache to size the tables from",
        ),
        pytest.param(
            {"FMAX": 0},
            lambda m: m,
            r"^full_kv_block_table: expected F_MAX_BLOCK_NUM >= 1, got 0",
            id="table without columns",
        ),
        pytest.param(
            {},
            _table_as_initializer,
            r"^full_kv_block_table: expected a graph input",
            id="no kv_len source",
        ),
    ],
)
def test_loader_refuses_a_gather_it_cannot_feed(skeleton, change, match):
    sk = gather_skeleton(np.dtype(np.float16), tbs=1, **skeleton)
    m = single_op_model("GatherSelectionKvCache", sk, selection_topk_block_size=1)
    change(m)
    with pytest.raises(ValueError, match=match):
        data_loader.make_feeds(m, 0)


def test_loader_refuses_a_compressing_write_without_tokens():
    feeds = {
        "key": np.zeros((2, 0, 1, 8), np.float16),
        "key_cache": np.zeros((4, 4, 1, 8), np.float16),
        "slot_mapping": np.zeros((2, 1), np.int32),
        "compress_lens": np.zeros((2, 1), np.int32),
        "seq_lens": np.zeros(2, np.int32),
    }
    m = single_op_model("ScatterPaKvCache", feeds)
    with pytest.raises(ValueError, match=r"^key: expected Smax \(dim 1\) >= 1, got 0"):
        data_loader.make_feeds(m, 0)
