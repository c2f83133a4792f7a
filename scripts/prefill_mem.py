"""Peak memory of one prefill on the CPU runtime (docs/LLAMA.md "Prefill memory").

Runs ``DIR/prefill.onnx`` (written by ``pytrt-kv generate ... --save DIR``) once on a
prompt of ``--tokens`` seeded random token ids, one sequence, 16-token pages, the cache
just large enough, and prints the process's resident memory before the run and its peak
(``ru_maxrss``) after. The weights are read from the graph's external file into one array
each and fed as graph inputs, as ``DecoderRunner`` feeds them (one copy, not the
evaluator's second one). ``--keep-all`` runs the base ``onnx.reference`` loop, which keeps
every intermediate result until the run ends (the CPU runtime before it released them).

    pytrt-kv generate --prompt hi --tokens 1 --save /tmp/smol
    /usr/bin/time -v python3 scripts/prefill_mem.py /tmp/smol --tokens 512
"""

from __future__ import annotations

import argparse
import resource
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _weights_as_inputs(model: onnx.ModelProto, folder: Path) -> dict[str, np.ndarray]:
    """Move every external initializer of ``model`` to a graph input; return their arrays."""
    out: dict[str, np.ndarray] = {}
    kept = []
    for t in model.graph.initializer:
        if t.data_location != TensorProto.EXTERNAL:
            kept.append(t)
            continue
        ext = {e.key: e.value for e in t.external_data}
        dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
        count = int(np.prod(t.dims)) if t.dims else 1
        with open(folder / ext["location"], "rb") as f:
            f.seek(int(ext.get("offset", 0)))
            out[t.name] = np.fromfile(f, dtype=dtype, count=count).reshape(tuple(t.dims))
        model.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path, help="the --save folder of pytrt-kv generate")
    p.add_argument("--tokens", type=int, required=True, help="prompt tokens (one sequence)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--keep-all", action="store_true", help="the base onnx.reference loop")
    args = p.parse_args()

    from pytrt_kv import runtime  # noqa: PLC0415

    model = onnx.load(str(args.folder / "prefill.onnx"), load_external_data=False)
    weights = _weights_as_inputs(model, args.folder)
    ev = runtime.make_evaluator(model)
    del model
    t, bs = args.tokens, args.block_size
    pages = -(-t // bs)
    feeds: dict[str, np.ndarray] = {
        "input_ids": np.random.default_rng(0).integers(0, 49152, t).astype(np.int64),
        "positions": np.arange(t, dtype=np.int64),
        "token_batch": np.zeros(t, np.int64),
        "slot_mapping": np.arange(bs, bs + t, dtype=np.int32),  # pages 1..; page 0 pads
        "block_tables": np.arange(1, pages + 1, dtype=np.int32)[None],
        "last_token": np.array([t - 1], np.int64),
    }
    for vi in ev.proto_.graph.input:
        if vi.name.startswith(("key_cache_", "value_cache_")):
            d = [x.dim_value for x in vi.type.tensor_type.shape.dim]
            feeds[vi.name] = np.zeros((pages + 1, bs, d[2], d[3]), np.float32)
    feeds.update(weights)
    before = _rss_mib()
    if args.keep_all:
        logits = ReferenceEvaluator.run(ev, ["logits"], feeds)[0]
    else:
        logits = runtime.run(ev, feeds)["logits"]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"tokens {t} ({'keep-all' if args.keep_all else 'releasing'}): RSS before the run "
        f"{before:.0f} MiB, peak {peak:.0f} MiB, peak above before {peak - before:.0f} MiB, "
        f"logits {logits.shape} argmax {int(logits.argmax())}"
    )


if __name__ == "__main__":
    main()
