"""TensorRT engines with the pytrt_kv plugins (marker ``trt``: TensorRT, a GPU and the
built plugin library; skipped elsewhere, see tests/conftest.py).

Single-op and example models are built into engines and compared bit-exactly with the
CPU reference runtime; the engine inspector must show the plugin layers; in-place
bindings, pinned host full caches, CUDA graphs and torch/CuPy buffers are exercised;
whether TensorRT inserts copies for aliased caches is measured (inspector and timing
against the eager kernels) and recorded with ``record_property``.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from pytrt_kv import runtime
from pytrt_kv.graph.feeds import make_feeds
from support.env import polygraphy_command
from support.models import COMPRESS_CASES, compress_model, gather_model, scatter_model
from support.op_names import SCATTER_INPUTS

pytestmark = pytest.mark.trt


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.uint8).reshape(-1) if a.size else a.reshape(-1).view(np.uint8)


def assert_bit_exact(got: dict, want: dict, where: str):
    for name, w in want.items():
        g = np.asarray(got[name])
        assert g.shape == w.shape and g.dtype == w.dtype, (
            f"{where}: {name} {g.dtype}{g.shape} vs {w.dtype}{w.shape}"
        )
        diff = np.flatnonzero(_bits(g) != _bits(w))
        assert diff.size == 0, f"{where}: {name} differs at {diff.size} bytes, first {diff[0]}"


def _save(model, tmp_path, name="m.onnx"):
    import onnx

    path = tmp_path / name
    onnx.save(model, path)
    return path


def _engine_in_place(model, tmp_path, seed):
    """The model's engine, its feeds, the CPU runtime's outputs for them, device copies of
    the feeds and a runner for the engine (not yet bound)."""
    from pytrt_kv.trt import DeviceArray, EngineRunner, build_engine

    eng = build_engine(_save(model, tmp_path))
    feeds = make_feeds(model, seed)
    want = runtime.run(model, feeds)
    dev = {n: DeviceArray(a.shape, a.dtype).copy_from(a) for n, a in feeds.items()}
    return eng, feeds, want, dev, EngineRunner(eng)


def _caches_out(dev) -> dict:
    """The scatter's outputs as its in-place cache buffers hold them."""
    return {
        "key_cache_out": dev["key_cache"].to_numpy(),
        "value_cache_out": dev["value_cache"].to_numpy(),
    }


def _run_and_compare(model, tmp_path, steps=2, seed=0):
    from pytrt_kv.trt import run_model_steps

    feeds_list = [make_feeds(model, seed + i) for i in range(steps)]
    want = [runtime.run(model, f) for f in feeds_list]
    got = run_model_steps(_save(model, tmp_path), feeds_list, timing_cache=tmp_path / "cache.bin")
    for i, (g, w) in enumerate(zip(got, want)):
        assert_bit_exact(g, w, f"step {i}")
    return got


# --- bit-exact single-op engines ----------------------------------------------------------


@pytest.mark.parametrize("idx", ["int32", "int64"])
@pytest.mark.parametrize("layout", ["nd", "hnd", "nz"])
@pytest.mark.parametrize("dt", ["float16", "bfloat16", "float32", "int8", "float8_e4m3fn"])
def test_scatter_engine_bit_exact(tmp_path, dt, layout, idx):
    _run_and_compare(scatter_model(layout, dt, idx), tmp_path)


@pytest.mark.parametrize("alias_io", [1, 0])
def test_scatter_engine_key_only_and_alias_off(tmp_path, alias_io):
    _run_and_compare(
        scatter_model("nd", "bfloat16", "int32", value=False, alias_io=alias_io), tmp_path
    )


@pytest.mark.parametrize("dt,mode,offsets", COMPRESS_CASES)
@pytest.mark.parametrize("idx", ["int32", "int64"])
def test_scatter_engine_compress_bit_exact(tmp_path, dt, mode, offsets, idx):
    _run_and_compare(compress_model(dt, idx, mode, offsets), tmp_path)


@pytest.mark.parametrize("rope", [True, False])
@pytest.mark.parametrize("tbs", [1, 4])
@pytest.mark.parametrize("tnd", [False, True])
@pytest.mark.parametrize("dt", ["float16", "bfloat16", "int8", "float32", "float8_e4m3fn"])
def test_gather_engine_bit_exact(tmp_path, dt, tnd, tbs, rope):
    _run_and_compare(gather_model(dt, tnd, tbs, rope), tmp_path, steps=3)


def test_gather_engine_alias_off(tmp_path):
    _run_and_compare(gather_model("float16", False, 4, alias_io=0), tmp_path)


def test_example_model(tmp_path):
    from onnx_export.example import build_example_model
    from pytrt_kv.trt import run_model_steps

    model = build_example_model()
    feeds_list = [make_feeds(model, s) for s in range(2)]
    want = [runtime.run(model, f) for f in feeds_list]
    got = run_model_steps(_save(model, tmp_path), feeds_list)
    for g, w in zip(got, want):
        exact = {k: v for k, v in w.items() if k != "attn_out"}
        assert_bit_exact(g, exact, "example")
        # attention is float math: TensorRT's kernels differ from NumPy's in rounding.
        np.testing.assert_allclose(g["attn_out"], w["attn_out"], rtol=1e-3, atol=1e-3)


# --- what is in the engine ----------------------------------------------------------------


@pytest.mark.parametrize("which", ["scatter", "gather"])
def test_plugin_layer_is_in_the_engine(tmp_path, which):
    from pytrt_kv.trt import build_engine, engine_layers, plugin_layers

    model = (
        scatter_model("nd", "float16", "int32")
        if which == "scatter"
        else gather_model("float16", False, 4)
    )
    eng = build_engine(_save(model, tmp_path))
    layers = plugin_layers(eng)
    op = "ScatterPaKvCache" if which == "scatter" else "GatherSelectionKvCache"
    assert len(layers) == 1 and op in str(layers[0]), engine_layers(eng)


@pytest.mark.parametrize("alias_io", [1, 0])
def test_inplace_binding_and_inserted_copies(tmp_path, alias_io, record_property):
    """Binds key_cache_out to key_cache's buffer: the input buffer must hold the result
    (the update happened in place). Records the copy layers TensorRT inserted and the
    engine time against the eager kernel on the same buffers."""
    from pytrt_kv import ops
    from pytrt_kv.trt import copy_layers
    from pytrt_kv.trt._tensorrt import check_cuda, import_cudart

    model = scatter_model(
        "nd", "float16", "int32", alias_io=alias_io, T=64, H=8, Dk=128, NB=512, BS=16
    )
    eng, _, want, dev, runner = _engine_in_place(model, tmp_path, 3)
    runner.run(dev)
    assert runner.address("key_cache_out") == dev["key_cache"].address
    assert_bit_exact(_caches_out(dev), want, "in place")

    cudart = import_cudart()
    stream = int(check_cuda(cudart.cudaStreamCreate(), "cudaStreamCreate"))

    def timed(fn, n=50):
        fn()
        check_cuda(cudart.cudaStreamSynchronize(stream), "sync")
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        check_cuda(cudart.cudaStreamSynchronize(stream), "sync")
        return (time.perf_counter() - t0) / n * 1e6

    t_engine = timed(lambda: runner.execute(stream))
    t_eager = timed(
        lambda: ops.scatter_pa_kv_cache(
            *(dev[n] for n in SCATTER_INPUTS[:5]), cache_layout="nd", stream=stream
        )
    )
    copies = copy_layers(eng)
    record_property("copy_layers", len(copies))
    record_property("engine_us", round(t_engine, 2))
    record_property("eager_us", round(t_eager, 2))
    print(
        f"alias_io={alias_io}: {len(copies)} copy layers, engine {t_engine:.1f} us, "
        f"eager {t_eager:.1f} us"
    )
    cudart.cudaStreamDestroy(stream)


def test_host_resident_full_cache(tmp_path):
    from pytrt_kv.trt import DeviceArray, EngineRunner, HostArray, build_engine

    model = gather_model("bfloat16", False, 4)
    eng = build_engine(_save(model, tmp_path))
    feeds = make_feeds(model, 5)
    want = runtime.run(model, feeds)
    bufs = {}
    for n, a in feeds.items():
        if n in ("full_kv_cache", "full_k_rope"):
            h = HostArray(a.shape, a.dtype)
            h.array[...] = a
            bufs[n] = h
        else:
            bufs[n] = DeviceArray(a.shape, a.dtype).copy_from(a)
    runner = EngineRunner(eng)
    runner.run(bufs)
    got = {"selection_kv_actual_seq": runner.output("selection_kv_actual_seq").to_numpy()}
    for out, inp in runner.aliases.items():
        got[out] = bufs[inp].to_numpy()
    assert_bit_exact(got, want, "host-resident full cache")


def test_cuda_graph_replay(tmp_path):
    from pytrt_kv.trt._tensorrt import check_cuda, import_cudart

    model = scatter_model("hnd", "float16", "int64")
    _, feeds, want, dev, runner = _engine_in_place(model, tmp_path, 9)
    runner.bind(dev)
    cudart = import_cudart()
    stream = int(check_cuda(cudart.cudaStreamCreate(), "cudaStreamCreate"))
    graph = runner.capture_graph(stream)
    # Restore the caches the warm-up and capture may have written, then replay.
    for n in ("key_cache", "value_cache"):
        dev[n].copy_from(feeds[n], stream)
    graph.launch(stream)
    check_cuda(cudart.cudaStreamSynchronize(stream), "sync")
    assert_bit_exact(_caches_out(dev), want, "graph replay")
    cudart.cudaStreamDestroy(stream)


@pytest.mark.parametrize("lib", ["torch", "cupy"])
def test_runner_accepts_framework_buffers(tmp_path, lib):
    from pytrt_kv.trt import EngineRunner, build_engine

    mod = pytest.importorskip(lib)
    model = scatter_model("nd", "float16", "int32")
    feeds = make_feeds(model, 11)
    want = runtime.run(model, feeds)
    if lib == "torch":
        if not mod.cuda.is_available():
            pytest.skip("torch without CUDA")
        bufs = {n: mod.from_numpy(np.ascontiguousarray(a)).cuda() for n, a in feeds.items()}
        stream = mod.cuda.current_stream()
    else:
        bufs = {n: mod.asarray(a) for n, a in feeds.items()}
        stream = mod.cuda.get_current_stream()
    runner = EngineRunner(build_engine(_save(model, tmp_path)))
    runner.run(bufs, stream=stream)
    stream.synchronize()
    host = (lambda t: t.cpu().numpy()) if lib == "torch" else (lambda t: mod.asnumpy(t))
    assert_bit_exact(
        {"key_cache_out": host(bufs["key_cache"]), "value_cache_out": host(bufs["value_cache"])},
        want,
        lib,
    )


def test_loading_both_libraries_is_refused():
    from pytrt_kv.trt import load_plugins

    load_plugins()
    with pytest.raises(RuntimeError, match="never load both into one process"):
        load_plugins("autoreg")


def test_polygraphy_cli_compares_with_the_reference(tmp_path):
    """``polygraphy run --trt --plugins <autoreg> --pytrt-kv-ref`` in its own process
    (the autoreg library must not share a process with the loader one)."""
    import os
    import subprocess

    from pytrt_kv import _lib
    from pytrt_kv.polygraphy import data_loader

    model = scatter_model("nd", "float16", "int32")
    path = _save(model, tmp_path)
    cmd = [
        *polygraphy_command(),
        "run",
        str(path),
        "--trt",
        "--strongly-typed",
        "--pytrt-kv-ref",
        "--plugins",
        str(_lib.require(_lib.PLUGINS_AUTOREG_LIB)),
        "--preview-features",
        "ALIASED_PLUGIN_IO_10_03",
        "--data-loader-script",
        data_loader.__file__,
        "--atol",
        "0",
        "--rtol",
        "0",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ})
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "PASSED" in r.stdout + r.stderr
