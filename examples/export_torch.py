"""Export a torch module that uses the pytrt_kv ops, with torch.onnx (dynamo).

``onnx_export.torch_export`` provides functional versions of both ops (they return the
updated caches, docs/SPEC.md O). Inside ``torch.onnx.export(..., dynamo=True)`` each call
becomes one ``pytrt_kv`` node; in eager mode it runs the NumPy reference, so the module
also runs without TensorRT. The example exports the module, runs the ONNX model on the
CPU runtime and checks it against the eager module, bit for bit.

Needs the torch extra: ``python3 -m pip install '/path/to/pytrt_kv[torch]'``.

    python3 examples/export_torch.py [OUT.onnx]      # default torch_step.onnx
"""

import sys
import warnings

import numpy as np
import onnx

try:
    import torch
except ImportError:
    sys.exit(
        "this example needs torch and onnxscript: python3 -m pip install '/path/to/pytrt_kv[torch]'"
    )

from onnx_export import torch_export as pk
from pytrt_kv import runtime
from pytrt_kv.graph.feeds import make_feeds

B, KV, ROPE = 2, 16, 8  # batch, latent width, rope width
NB, FBS, FMAX = 8, 4, 4  # full cache: blocks, block size, table columns
SNB, SBS, SMAX, K = 4, 4, 2, 4  # selection cache and top-k width


class DecodeStep(torch.nn.Module):
    """Write this step's token into the full caches, gather the top-k into the selection."""

    def forward(
        self,
        kv,
        k_rope,
        slot_mapping,
        full_kv_cache,
        full_k_rope,
        full_kv_block_table,
        full_kv_actual_seq,
        full_q_actual_seq,
        selection_k_rope,
        selection_kv_cache,
        selection_kv_block_table,
        selection_kv_block_status,
        selection_topk_indices,
    ):
        full_kv_out, full_rope_out = pk.scatter_pa_kv_cache(
            kv, k_rope, full_kv_cache, full_k_rope, slot_mapping, cache_layout="nd"
        )
        sel_rope, sel_kv, status, actual = pk.gather_selection_kv_cache(
            selection_k_rope,
            selection_kv_cache,
            selection_kv_block_table,
            selection_kv_block_status,
            selection_topk_indices,
            full_rope_out.reshape(NB, FBS, ROPE),
            full_kv_out.reshape(NB, FBS, KV),
            full_kv_block_table,
            full_kv_actual_seq,
            full_q_actual_seq,
            selection_topk_block_size=1,
        )
        return full_kv_out, full_rope_out, sel_rope, sel_kv, status, actual


def example_inputs():
    """Shapes and dtypes of one step (the values only need the right dtype here)."""
    f16, i32 = torch.float16, torch.int32
    return (
        torch.zeros(B, 1, KV, dtype=f16),
        torch.zeros(B, 1, ROPE, dtype=f16),
        torch.zeros(B, dtype=i32),
        torch.zeros(NB, FBS, 1, KV, dtype=f16),
        torch.zeros(NB, FBS, 1, ROPE, dtype=f16),
        torch.zeros(B, FMAX, dtype=i32),
        torch.zeros(B, dtype=i32),
        torch.zeros(B, dtype=i32),
        torch.zeros(SNB, SBS, ROPE, dtype=f16),
        torch.zeros(SNB, SBS, KV, dtype=f16),
        torch.zeros(B, SMAX, dtype=i32),
        torch.full((B, 1, 1, K + 1), -1, dtype=i32),
        torch.full((B, 1, 1, K), -1, dtype=i32),
    )


def main(argv):
    path = argv[1] if len(argv) > 1 else "torch_step.onnx"
    module = DecodeStep().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's own progress warnings
        program = torch.onnx.export(module, example_inputs(), dynamo=True, verbose=False)
    program.save(path)
    model = onnx.load(path)
    onnx.checker.check_model(model, full_check=True)
    print(
        f"wrote {path}: pytrt_kv nodes "
        f"{[n.op_type for n in model.graph.node if n.domain == 'pytrt_kv']}"
    )

    feeds = make_feeds(model, seed=0)  # valid feeds, named after forward()'s args
    got = runtime.run(model, feeds)
    with torch.no_grad():
        eager = module(*(torch.from_numpy(feeds[i.name]) for i in model.graph.input))
    for out, want in zip(model.graph.output, eager):
        a, b = got[out.name], want.numpy()
        if a.shape != b.shape or not np.array_equal(a.view(np.uint8), b.view(np.uint8)):
            print(f"MISMATCH: {out.name}")
            return 1
    print(
        f"ONNX model on the CPU runtime == eager torch module, bit for bit ({len(eager)} outputs)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
