"""Write the plugin harness' GPU cases from the NumPy reference.

    python3 plugins/harness/makeCases.py OUT_DIR
    build/bin/pytrt_kv_plugin_harness run OUT_DIR/*/

Each case is a single-op model (onnx_export.single_op_model) with valid random feeds
(pytrt_kv.graph.feeds.make_feeds, the one valid-input generator) whose expected outputs
come from the CPU runtime (pytrt_kv.runtime, i.e. pytrt_kv.reference). Inputs are
written in the plugins' positional form (pytrt_kv.trt.prepare_for_tensorrt: zero-element
placeholders for absent optional inputs), in the format plugins/harness/harnessIo.h
describes. Caches start as random data (the "untouched" check: every byte the op must
not write is compared too). The grid covers dtypes, layouts, int32/int64 indices,
key-only writes, quantise on write (docs/SPEC.md S9), every compress mode, BSND/TND, TBS 1
and > 1, the quantised (no k_rope) mode, host-resident full caches and a second gather
step that reuses the first step's status.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from onnx import numpy_helper  # noqa: E402

from onnx_export import single_op_model  # noqa: E402
from pytrt_kv import dtypes, runtime, specs  # noqa: E402
from pytrt_kv.contract.layouts import LAYOUTS, get_layout  # noqa: E402
from pytrt_kv.graph.feeds import make_feeds  # noqa: E402
from pytrt_kv.trt.model import prepare_for_tensorrt  # noqa: E402

SCATTER = specs.SCATTER_PA_KV_CACHE.name
GATHER = specs.GATHER_SELECTION_KV_CACHE.name


def _np(name: str) -> np.dtype:
    return dtypes.numpy_dtype(name)


def scatter_shapes(
    layout: str, dt: str, vdt: str | None, idx: str, T=7, H=2, Dk=16, Dv=None, NB=5, BS=8
) -> dict[str, np.ndarray]:
    """Zero arrays carrying shapes/dtypes only (single_op_model reads nothing else).
    Dv != Dk except in nz, where H*D*itemsize % 32 == 0 must hold for int8 too."""
    Dv = Dv if Dv is not None else (16 if layout == "nz" else 8)

    def cache(d, t):
        return get_layout(layout).shape(NB, BS, H, d, _np(t).itemsize)

    out = {
        "key": np.zeros((T, H, Dk), _np(dt)),
        "key_cache": np.zeros(cache(Dk, dt), _np(dt)),
        "slot_mapping": np.zeros((T,), _np(idx)),
    }
    if vdt is not None:
        out["value"] = np.zeros((T, H, Dv), _np(vdt))
        out["value_cache"] = np.zeros(cache(Dv, vdt), _np(vdt))
    return out


def compress_shapes(dt: str, idx: str, offsets: bool, B=2, Smax=9, H=3, D=16, NB=12, BS=8):
    out = {
        "key": np.zeros((B, Smax, H, D), _np(dt)),
        "value": np.zeros((B, Smax, H, D), _np(dt)),
        "key_cache": np.zeros((NB, BS, 1, D), _np(dt)),
        "value_cache": np.zeros((NB, BS, 1, D), _np(dt)),
        "slot_mapping": np.zeros((B, H), _np(idx)),
        "compress_lens": np.zeros((B, H), _np(idx)),
        "seq_lens": np.zeros((B,), _np(idx)),
    }
    if offsets:
        out["compress_seq_offsets"] = np.zeros((B * H,), _np(idx))
    return out


def gather_shapes(
    dt: str,
    tnd: bool,
    tbs: int,
    rope: bool,
    B=2,
    S=2,
    K=4,
    SBS=16,
    FBS=16,
    KV=32,
    KR=8,
    FBN=24,
    FMAX=6,
):
    smax = -(-K * tbs // SBS)
    R = B * S + 1
    lead = (B * S, 1) if tnd else (B, S, 1)
    kr = (B * S * smax + 2, SBS, KR) if rope else (0,)
    return {
        "selection_k_rope": np.zeros(kr, _np(dt)),
        "selection_kv_cache": np.zeros((B * S * smax + 2, SBS, KV), _np(dt)),
        "selection_kv_block_table": np.zeros((R, smax), np.int32),
        "selection_kv_block_status": np.zeros(lead + (K + 1,), np.int32),
        "selection_topk_indices": np.zeros(lead + (K,), np.int32),
        "full_k_rope": np.zeros((FBN, FBS, KR) if rope else (0,), _np(dt)),
        "full_kv_cache": np.zeros((FBN, FBS, KV), _np(dt)),
        "full_kv_block_table": np.zeros((B, FMAX), np.int32),
        "full_kv_actual_seq": np.zeros((B,), np.int32),
        "full_q_actual_seq": np.zeros((B,), np.int32),
    }


def cases() -> list[dict]:
    cs = []
    for dt in ("float16", "bfloat16", "float32", "int8", "float8_e4m3fn"):
        for layout in LAYOUTS:
            for idx in ("int32", "int64"):
                cs.append(
                    dict(
                        op=SCATTER,
                        name=f"scatter_{layout}_{dt}_{idx}",
                        shapes=scatter_shapes(layout, dt, dt, idx),
                        attrs={"cache_layout": layout},
                    )
                )
    cs.append(
        dict(
            op=SCATTER,
            name="scatter_nz_f16_key_int8_value",
            shapes=scatter_shapes("nz", "float16", "int8", "int32"),
            attrs={"cache_layout": "nz"},
        )
    )
    cs.append(
        dict(
            op=SCATTER,
            name="scatter_nd_key_only",
            shapes=scatter_shapes("nd", "bfloat16", None, "int32"),
            attrs={"cache_layout": "nd"},
        )
    )
    cs.append(
        dict(
            op=SCATTER,
            name="scatter_nd_alias_io_0",
            shapes=scatter_shapes("nd", "float16", "float16", "int64"),
            attrs={"cache_layout": "nd", "alias_io": 0},
        )
    )
    # docs/SPEC.md S9, quantise on write: per-head and per-tensor (0-d) scales, a key-only
    # write, and a quantised key beside a byte-copied value (nz).
    for layout, src, cache, per_head, value, plain_value in (
        ("nd", "float16", "float8_e4m3fn", True, True, False),
        ("hnd", "bfloat16", "int8", False, True, False),
        ("nz", "float32", "float8_e4m3fn", False, False, False),
        ("nz", "float16", "float8_e4m3fn", True, True, True),
    ):
        shapes = scatter_shapes(layout, cache, cache if value else None, "int32", Dk=32, Dv=32)
        shapes["key"] = shapes["key"].astype(_np(src))
        scale = np.zeros((2,) if per_head else (), np.float32)
        shapes["k_scale"] = scale
        if value and plain_value:
            shapes["value"] = shapes["value"].astype(_np("float16"))
            shapes["value_cache"] = np.zeros((5, 4, 8, 16), _np("float16"))  # nz: H*D/L = 4
        elif value:
            shapes["value"] = shapes["value"].astype(_np(src))
            shapes["v_scale"] = scale
        cs.append(
            dict(
                op=SCATTER,
                name=f"scatter_quant_{layout}_{src}_{cache}_{'head' if per_head else 'tensor'}"
                + ("" if value else "_key_only")
                + ("_plain_value" if plain_value else ""),
                shapes=shapes,
                attrs={"cache_layout": layout},
            )
        )
    # The compressing write (docs/SPEC.md S6): name, dtype, index dtype, offsets, attrs.
    for name, dt, idx, offsets, attrs in (
        *(
            (f"scatter_rope_{dt}", dt, "int32", True, {})
            for dt in ("float16", "bfloat16", "float32")
        ),
        ("scatter_omni_int8", "int8", "int64", True, {"compress_mode": "omni"}),
        ("scatter_alibi_no_offsets", "float16", "int32", False, {}),
    ):
        cs.append(
            dict(op=SCATTER, name=name, shapes=compress_shapes(dt, idx, offsets), attrs=attrs)
        )
    for dt in ("float16", "bfloat16", "int8", "float32", "float8_e4m3fn"):
        for tnd in (False, True):
            for tbs in (1, 4):
                cs.append(
                    dict(
                        op=GATHER,
                        name=f"gather_{dt}_{'tnd' if tnd else 'bsnd'}_tbs{tbs}",
                        shapes=gather_shapes(dt, tnd, tbs, rope=True),
                        attrs={"selection_topk_block_size": tbs},
                    )
                )
    # Gather modes: name, dtype, TND, TBS, k_rope, full caches in host memory, more attrs.
    for name, dt, tnd, tbs, rope, host, attrs in (
        ("gather_c8_int8", "int8", False, 4, False, (), {}),
        (
            "gather_host_full_cache",
            "bfloat16",
            False,
            4,
            True,
            ("full_kv_cache", "full_k_rope"),
            {},
        ),
        ("gather_alias_io_0", "float16", True, 1, True, (), {"alias_io": 0}),
    ):
        cs.append(
            dict(
                op=GATHER,
                name=name,
                host=host,
                shapes=gather_shapes(dt, tnd, tbs, rope=rope),
                attrs={"selection_topk_block_size": tbs, **attrs},
            )
        )
    return cs


def _write(path: Path, a: np.ndarray) -> None:
    path.write_bytes(np.ascontiguousarray(a).tobytes())


def write_case(
    out: Path, case: dict, seed: int, feeds: dict[str, np.ndarray] | None = None
) -> dict:
    model = single_op_model(case["op"], case["shapes"], **case["attrs"])
    feeds = feeds if feeds is not None else make_feeds(model, seed=seed)
    expected = runtime.run(model, feeds)
    prepared = prepare_for_tensorrt(model)
    node = prepared.graph.node[0]
    inits = {i.name: numpy_helper.to_array(i) for i in prepared.graph.initializer}
    d = out / case["name"]
    d.mkdir(parents=True, exist_ok=True)
    lines = [f"plugin {case['op']}"]
    for k, v in case["attrs"].items():
        lines.append(f"field {k} i {int(v)}" if isinstance(v, int) else f"field {k} s {v or '-'}")
    host = set(case.get("host", ()))
    for k, name in enumerate(node.input):
        a = feeds[name] if name in feeds else inits[name]
        f = f"in{k}.bin"
        _write(d / f, a)
        lines.append(
            f"input {name} {dtypes.name_of(a.dtype)} {a.ndim} "
            f"{' '.join(str(s) for s in a.shape)} {f}{' host' if name in host else ''}".replace(
                "  ", " "
            )
        )
    for k, name in enumerate(node.output):
        if name in expected:
            a = expected[name]
        else:  # the placeholder output of a key-only write: zero-element like its input
            a = inits[node.input[specs.SCATTER_PA_KV_CACHE.aliased_input_index(k)]]
        f = f"out{k}.bin"
        _write(d / f, a)
        lines.append(
            f"output {name} {dtypes.name_of(a.dtype)} {a.ndim} "
            f"{' '.join(str(s) for s in a.shape)} {f}".replace("  ", " ")
        )
    (d / "case.txt").write_text("\n".join(lines) + "\n")
    return {"feeds": feeds, "expected": expected}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=20261121)
    args = parser.parse_args(argv)
    n = 0
    for i, case in enumerate(cases()):
        r = write_case(args.out, case, args.seed + i)
        n += 1
        if case["op"] == GATHER and case["name"].endswith("tbs4") and "bsnd" in case["name"]:
            # Step 2 of a decode loop: last step's status/caches in, one more token each.
            feeds = dict(r["feeds"])
            for name in ("selection_k_rope", "selection_kv_cache", "selection_kv_block_status"):
                feeds[name] = r["expected"][name + "_out"]
            table = feeds["full_kv_block_table"]
            limit = table.shape[1] * case["shapes"]["full_kv_cache"].shape[1]
            feeds["full_kv_actual_seq"] = np.minimum(feeds["full_kv_actual_seq"] + 1, limit).astype(
                np.int32
            )
            write_case(
                args.out, dict(case, name=case["name"] + "_step2"), args.seed + i, feeds=feeds
            )
            n += 1
    print(f"wrote {n} cases to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
