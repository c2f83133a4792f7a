"""The single-op models that the TensorRT engine tests build (tests/test_trt_engine.py on
a GPU, tests/test_rtx_build.py ahead of time with TensorRT-RTX), in one place so both
build exactly the same set; their input shapes are the C++ harness's
(plugins/harness/makeCases.py). Also the compressing scatter's cases, a small compressing
key-only feed set and the reference scatter on feeds that the CPU runtime and ONNX tests
share, and a small RetrievalKV configuration."""

from __future__ import annotations

import importlib.util

import numpy as np

from onnx_export import single_op_model
from support.arrays import cache_shape
from support.env import REPO

# A small RetrievalKV configuration (docs/SPEC.md R1): the decode step of
# tests/test_retrieval.py, and the graph tests/test_rtx_build.py builds (dense from 0).
SMALL_RETRIEVAL = dict(
    init_tokens=64, local_tokens=200, block_size=32, dense_boundary=256, offload_boundary=512
)


def _harness():
    """plugins/harness/makeCases.py, the C++ harness's case maker: its zero-array shapes
    of each op are the ones these models take too (one description of the test shapes)."""
    spec = importlib.util.spec_from_file_location(
        "makeCases", REPO / "plugins" / "harness" / "makeCases.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


HARNESS = _harness()


def _np(name):
    from pytrt_kv.contract import dtypes

    return dtypes.numpy_dtype(name)


def scatter_model(layout, dt, idx, value=True, alias_io=1, T=9, H=2, Dk=16, NB=6, BS=8):
    shapes = HARNESS.scatter_shapes(layout, dt, dt if value else None, idx, T, H, Dk, NB=NB, BS=BS)
    return single_op_model("ScatterPaKvCache", shapes, cache_layout=layout, alias_io=alias_io)


def quant_model(
    layout, src, cache, per_head, value=True, value_cache=None, T=9, H=2, D=32, NB=6, BS=8
):
    """A 3-D scatter that quantises on write (docs/SPEC.md S9): ``src`` key/value into
    ``cache`` caches (``value_cache``: another value cache dtype, copied unscaled, nz only)."""

    def shape(t):
        return cache_shape(layout, NB, BS, H, D, t)

    scale = (H,) if per_head else ()
    shapes = {
        "key": np.zeros((T, H, D), _np(src)),
        "key_cache": np.zeros(shape(cache), _np(cache)),
        "slot_mapping": np.zeros((T,), np.int32),
        "k_scale": np.zeros(scale, np.float32),
    }
    if value:
        vc = value_cache or cache
        shapes["value"] = np.zeros((T, H, D), _np(vc if value_cache else src))
        shapes["value_cache"] = np.zeros(shape(vc), _np(vc))
        if value_cache is None:
            shapes["v_scale"] = np.zeros(scale, np.float32)
    return single_op_model("ScatterPaKvCache", shapes, cache_layout=layout)


QUANT_MODELS = {
    "quant-float16-e4m3-nd-head": ("nd", "float16", "float8_e4m3fn", True, True, None),
    "quant-bfloat16-int8-hnd-tensor": ("hnd", "bfloat16", "int8", False, True, None),
    "quant-float32-e4m3-nz-tensor": ("nz", "float32", "float8_e4m3fn", False, True, None),
    "quant-bfloat16-e4m3-nd-key-only": ("nd", "bfloat16", "float8_e4m3fn", True, False, None),
    "quant-float16-e4m3-nz-plain-value": ("nz", "float16", "float8_e4m3fn", False, True, "float16"),
}

# (cache dtype, compress_mode, compress_seq_offsets given) of the compressing scatter models.
COMPRESS_CASES = [
    ("float16", "", True),
    ("bfloat16", "rope", True),
    ("float32", "rope", True),
    ("int8", "omni", True),
    ("float16", "alibi", True),
    ("int8", "", False),
]


def compress_model(dt, idx, mode, offsets=True, **sizes):
    """``sizes``: B, Smax, H, D, NB, BS of the harness's compress_shapes."""
    shapes = HARNESS.compress_shapes(dt, idx, offsets, **sizes)
    attrs = {"compress_mode": mode} if mode else {}
    return single_op_model("ScatterPaKvCache", shapes, **attrs)


def compress_key_feeds(rng) -> dict:
    """Feeds of a small key-only compressing scatter (B = H = 1, float32): one sequence
    of 4 tokens into slot 1 of a cache filled with -3."""
    return {
        "key": rng.standard_normal((1, 4, 1, 8)).astype(np.float32),
        "key_cache": np.full((2, 4, 1, 8), -3, np.float32),
        "slot_mapping": np.array([[1]], np.int32),
        "compress_lens": np.array([[2]], np.int32),
        "compress_seq_offsets": np.array([1], np.int32),
        "seq_lens": np.array([4], np.int32),
    }


def reference_scatter(feeds: dict, **attributes) -> None:
    """The reference scatter on ``feeds`` (the op's inputs by name, as a single-op model's
    graph takes them; a missing one is None): the caches in ``feeds`` are updated."""
    from pytrt_kv.reference import scatter_pa_kv_cache

    scatter_pa_kv_cache(**{"value": None, "value_cache": None, **feeds}, **attributes)


def gather_model(dt, tnd, tbs, rope=True, alias_io=1, **sizes):
    """``sizes``: B, S, K, SBS, FBS, KV, KR, FBN, FMAX of the harness's gather_shapes."""
    shapes = HARNESS.gather_shapes(dt, tnd, tbs, rope, **sizes)
    return single_op_model(
        "GatherSelectionKvCache", shapes, selection_topk_block_size=tbs, alias_io=alias_io
    )


def engine_test_models():
    """(id, model) for every model tests/test_trt_engine.py builds, the example included."""
    from onnx_export.example import build_example_model

    out = []
    for dt in ["float16", "bfloat16", "float32", "int8", "float8_e4m3fn"]:
        for layout in ["nd", "hnd", "nz"]:
            for idx in ["int32", "int64"]:
                out.append((f"scatter-{dt}-{layout}-{idx}", scatter_model(layout, dt, idx)))
    for name, (layout, src, cache, per_head, value, vc) in QUANT_MODELS.items():
        out.append((name, quant_model(layout, src, cache, per_head, value, vc)))
    for alias_io in [1, 0]:
        out.append(
            (
                f"scatter-key-only-alias{alias_io}",
                scatter_model("nd", "bfloat16", "int32", value=False, alias_io=alias_io),
            )
        )
    for dt, mode, offsets in COMPRESS_CASES:
        for idx in ["int32", "int64"]:
            out.append(
                (
                    f"compress-{dt}-{mode or 'default'}-{'offsets' if offsets else 'none'}-{idx}",
                    compress_model(dt, idx, mode, offsets),
                )
            )
    for dt in ["float16", "bfloat16", "int8", "float32", "float8_e4m3fn"]:
        for tnd in [False, True]:
            for tbs in [1, 4]:
                for rope in [True, False]:
                    name = (
                        f"gather-{dt}-{'tnd' if tnd else 'bsnd'}-tbs{tbs}-"
                        f"{'rope' if rope else 'c8'}"
                    )
                    out.append((name, gather_model(dt, tnd, tbs, rope)))
    out.append(("gather-alias-off", gather_model("float16", False, 4, alias_io=0)))
    out.append(("example", build_example_model()))
    return out
