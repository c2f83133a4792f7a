"""Export a decode step that uses both pytrt_kv ops, with onnx-graphsurgeon.

The graph writes this step's token (latent ``kv`` and ``k_rope``) into the paged full
caches with ScatterPaKvCache, then gathers the top-k selected tokens of the *updated*
caches into the selection caches with GatherSelectionKvCache (docs/SPEC.md S3, G5, O).
The top-k indices are a graph input here; a real model computes them (see
``onnx_export/example.py`` for an indexer + TopK + attention).

Then it checks the model, runs it on the CPU runtime with valid random feeds
(``make_feeds``) and compares every output with the NumPy reference called directly.

    python3 examples/export_graphsurgeon.py [OUT.onnx]      # default decode_step.onnx
"""

import sys

import numpy as np
import onnx
import onnx_graphsurgeon as gs

import pytrt_kv
from onnx_export import add_gather_selection_kv_cache, add_scatter_pa_kv_cache, export_model
from pytrt_kv import runtime
from pytrt_kv.graph.feeds import make_feeds

B, KV, ROPE = 2, 16, 8  # batch, latent width, rope width
NB, FBS, FMAX = 8, 4, 4  # full cache: blocks, block size, table columns per sequence
SNB, SBS, SMAX = 4, 4, 2  # selection cache: blocks, block size, table columns per row
K, TBS = 4, 1  # top-k width, tokens per selected id


def build_graph() -> gs.Graph:
    f16, i32 = np.float16, np.int32
    V = gs.Variable
    t = {  # graph inputs, named as in docs/SPEC.md so that make_feeds can serve them
        "kv": V("kv", f16, (B, 1, KV)),  # [T, H=1, KV]
        "k_rope": V("k_rope", f16, (B, 1, ROPE)),
        "slot_mapping": V("slot_mapping", i32, (B,)),
        "full_kv_cache": V("full_kv_cache", f16, (NB, FBS, 1, KV)),  # "nd" layout
        "full_k_rope": V("full_k_rope", f16, (NB, FBS, 1, ROPE)),
        "full_kv_block_table": V("full_kv_block_table", i32, (B, FMAX)),
        "full_kv_actual_seq": V("full_kv_actual_seq", i32, (B,)),
        "full_q_actual_seq": V("full_q_actual_seq", i32, (B,)),
        "selection_k_rope": V("selection_k_rope", f16, (SNB, SBS, ROPE)),
        "selection_kv_cache": V("selection_kv_cache", f16, (SNB, SBS, KV)),
        "selection_kv_block_table": V("selection_kv_block_table", i32, (B, SMAX)),
        "selection_kv_block_status": V("selection_kv_block_status", i32, (B, 1, 1, K + 1)),
        "selection_topk_indices": V("selection_topk_indices", i32, (B, 1, 1, K)),
    }
    g = gs.Graph(inputs=list(t.values()), opset=17, name="decode_step")

    # 1. Write the new token. The *_out tensors are the updated caches: later nodes must
    #    read them, never the inputs (docs/SPEC.md O).
    full_kv_out, full_rope_out = add_scatter_pa_kv_cache(
        g,
        t["kv"],
        t["k_rope"],
        t["full_kv_cache"],
        t["full_k_rope"],
        t["slot_mapping"],
        cache_layout="nd",
        output_names=["full_kv_cache_out", "full_k_rope_out"],
    )

    # 2. The gather reads 3-D caches [blocks, block size, width]: drop the head axis.
    def squeeze_heads(x: gs.Variable, width: int) -> gs.Variable:
        shape = gs.Constant(f"{x.name}_shape", np.array([NB, FBS, width], np.int64))
        return g.layer(
            op="Reshape", inputs=[x, shape], outputs=[V(f"{x.name}_3d", f16, (NB, FBS, width))]
        )[0]

    sel_rope_out, sel_kv_out, status_out, actual_seq = add_gather_selection_kv_cache(
        g,
        t["selection_k_rope"],
        t["selection_kv_cache"],
        t["selection_kv_block_table"],
        t["selection_kv_block_status"],
        t["selection_topk_indices"],
        squeeze_heads(full_rope_out, ROPE),
        squeeze_heads(full_kv_out, KV),
        t["full_kv_block_table"],
        t["full_kv_actual_seq"],
        t["full_q_actual_seq"],
        selection_topk_block_size=TBS,
    )

    # 3. Every *_out is a graph output, so a runtime can bind it to its input's buffer.
    g.outputs = [full_kv_out, full_rope_out, sel_rope_out, sel_kv_out, status_out, actual_seq]
    return g


def reference(feeds):
    """The same step with the NumPy reference, in place on copies."""
    x = {k: v.copy() for k, v in feeds.items()}
    pytrt_kv.scatter_pa_kv_cache(
        x["kv"],
        x["k_rope"],
        x["full_kv_cache"],
        x["full_k_rope"],
        x["slot_mapping"],
        cache_layout="nd",
    )
    actual = pytrt_kv.gather_selection_kv_cache(
        x["selection_k_rope"],
        x["selection_kv_cache"],
        x["selection_kv_block_table"],
        x["selection_kv_block_status"],
        x["selection_topk_indices"],
        x["full_k_rope"].reshape(NB, FBS, ROPE),
        x["full_kv_cache"].reshape(NB, FBS, KV),
        x["full_kv_block_table"],
        x["full_kv_actual_seq"],
        x["full_q_actual_seq"],
        selection_topk_block_size=TBS,
    )
    return {
        "full_kv_cache_out": x["full_kv_cache"],
        "full_k_rope_out": x["full_k_rope"],
        "selection_k_rope_out": x["selection_k_rope"],
        "selection_kv_cache_out": x["selection_kv_cache"],
        "selection_kv_block_status_out": x["selection_kv_block_status"],
        "selection_kv_actual_seq": actual,
    }


def main(argv):
    path = argv[1] if len(argv) > 1 else "decode_step.onnx"
    model = export_model(build_graph())  # IR 10, opset 17 + pytrt_kv 1, full_check
    onnx.save(model, path)
    print(f"wrote {path}: nodes {[n.op_type for n in model.graph.node]}")

    for seed in range(3):
        feeds = make_feeds(model, seed=seed)  # valid slots, tables, status, top-k
        got = runtime.run(model, feeds)  # functional: feeds are not modified
        want = reference(feeds)
        for name, expected in want.items():
            if not np.array_equal(got[name].view(np.uint8), expected.view(np.uint8)):
                print(f"MISMATCH seed {seed}: {name}")
                return 1
        print(
            f"seed {seed}: every output bit-exact with the reference; "
            f"selected tokens per row {got['selection_kv_actual_seq'].tolist()}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
