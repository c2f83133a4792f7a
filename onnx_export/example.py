"""The example model: one DeepSeek-V3.2-style sparse-attention decode step.

Per batch b (one new token, S = 1, TBS = 1)::

    ScatterPaKvCache        kv, k_rope of the new token -> full paged caches
    Gather + MatMul         indexer score of every cached position (read from the
                            UPDATED cache, so the new token is scored too)
    Where + TopK            top-K over the visible positions (< kv_len), -inf elsewhere;
                            -1 padding where fewer than K are visible
    GatherSelectionKvCache  the selected tokens -> the compact selection cache
                            (reusing those already there)
    attention               MLA-style (latent q_nope . kv + q_rope . k_rope) over the
                            selection cache slots, masked by selection_kv_actual_seq

Graph inputs (names follow docs/SPEC.md where the tensor is an op input):
``kv [B,1,KV]``, ``k_rope [B,1,R]``, ``slot_mapping [B]``, ``full_kv_cache [NB,FBS,1,KV]``,
``full_k_rope [NB,FBS,1,R]``, ``full_kv_block_table [B,FMAX]``, ``full_kv_actual_seq [B]``
(kv_len, including the new token), ``full_q_actual_seq [B]``,
``selection_k_rope [SNB,SBS,R]``, ``selection_kv_cache [SNB,SBS,KV]``,
``selection_kv_block_table [B,SMAX]``, ``selection_kv_block_status [B,1,1,K+1]``,
``q_nope [B,Hq,KV]``, ``q_rope [B,Hq,R]``, ``index_q [B,KV]``.

Graph outputs: ``attn_out [B,Hq,KV]`` (float32), ``topk_indices [B,1,1,K]`` and every
cache ``*_out``: ``full_kv_cache_out``, ``full_k_rope_out``, ``selection_k_rope_out``,
``selection_kv_cache_out``, ``selection_kv_block_status_out``, ``selection_kv_actual_seq``.
Feeding each ``*_out`` back as the next step's input runs a decode loop (``pytrt-kv demo``).

``build_example_model(sizes, dynamic=True)`` (``pytrt-kv export-example --dynamic``) is
the dynamic-batch variant: every ``B`` above is the symbolic dim ``batch`` (so T, the
scatter's token count, is dynamic too: one new token per sequence), while the caches keep
the static sizes made for ``sizes.batch`` sequences; one model serves any batch from 1 to
``sizes.batch``. Feed it with ``make_feeds(model, seed, shapes={"kv": [b, 1, KV]})`` or
Polygraphy's ``--input-shapes kv:[b,1,KV]``.

The full caches are 4-D ``[NB, FBS, 1, D]`` because ScatterPaKvCache ("nd" layout) writes
them; GatherSelectionKvCache reads the same memory as ``[NB, FBS, D]`` through a Reshape of
the scatter's ``*_out`` (a view in TensorRT, so no copy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np
import onnx

from pytrt_kv.contract import dtypes, limits, specs

#: Graph inputs updated in place, with the graph output that is their new version.
CACHE_OUTPUTS = {
    "full_kv_cache": "full_kv_cache_out",
    "full_k_rope": "full_k_rope_out",
    "selection_k_rope": "selection_k_rope_out",
    "selection_kv_cache": "selection_kv_cache_out",
    "selection_kv_block_status": "selection_kv_block_status_out",
}


@dataclass(frozen=True)
class ExampleSizes:
    """Sizes of the example model (defaults keep the demo fast on a small CPU)."""

    batch: int = 2  #: B: sequences decoded together
    heads: int = 4  #: Hq: query heads sharing the latent cache (MLA)
    kv_dim: int = 64  #: KV: latent width
    rope_dim: int = 16  #: R: rope key width
    num_blocks: int = 16  #: NB: blocks of the full cache
    block_size: int = 16  #: FBS: tokens per full-cache block
    max_blocks_per_seq: int = 4  #: FMAX: columns of full_kv_block_table
    topk: int = 8  #: K: tokens selected per step
    selection_block_size: int = 8  #: SBS: tokens per selection-cache block
    dtype: str = specs.FLOAT16  #: cache dtype

    @property
    def max_tokens(self) -> int:
        """P: positions one sequence can hold (FMAX * FBS)."""
        return self.max_blocks_per_seq * self.block_size

    @property
    def selection_max_blocks(self) -> int:
        """SMAX: selection blocks per row, enough for K tokens."""
        return -(-self.topk // self.selection_block_size)

    @property
    def selection_num_blocks(self) -> int:
        """SNB: private selection blocks for every row."""
        return self.batch * self.selection_max_blocks

    def validate(self) -> ExampleSizes:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name != "dtype" and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{f.name}: expected a positive int, got {v!r}")
        if self.dtype not in (specs.FLOAT16, specs.FLOAT32):
            raise ValueError(f"dtype: expected 'float16' or 'float32', got {self.dtype!r}")
        if self.batch * self.max_blocks_per_seq > self.num_blocks:
            raise ValueError(
                f"num_blocks: expected >= batch * max_blocks_per_seq = "
                f"{self.batch * self.max_blocks_per_seq} (private blocks per sequence), got "
                f"{self.num_blocks}"
            )
        if self.topk > self.max_tokens:
            raise ValueError(
                f"topk: expected <= max_blocks_per_seq * block_size = "
                f"{self.max_tokens}, got {self.topk}"
            )
        if self.topk > limits.MAX_TOPK:
            raise ValueError(
                f"topk: expected <= {limits.MAX_TOPK} (docs/SPEC.md G2), got {self.topk}"
            )
        return self


#: Name of the symbolic batch dim of the dynamic variant.
BATCH_DIM = "batch"


def build_example_graph(
    sizes: ExampleSizes = ExampleSizes(), *, alias_io: int = 1, dynamic: bool = False
):
    """The example as an onnx-graphsurgeon graph (see the module docstring).

    With ``dynamic``, every per-sequence dim is the symbolic :data:`BATCH_DIM` (so the
    scatter's token count T, one new token per sequence, is dynamic too); the caches
    keep static sizes, made for ``sizes.batch`` sequences at most.
    """
    import onnx_graphsurgeon as gs

    from .graphsurgeon import add_scatter_pa_kv_cache

    z = sizes.validate()
    B = BATCH_DIM if dynamic else z.batch
    Bc = -1 if dynamic else z.batch  # the batch dim in Reshape targets
    Hq, KV, R = z.heads, z.kv_dim, z.rope_dim
    NB, FBS, FMAX, K = z.num_blocks, z.block_size, z.max_blocks_per_seq, z.topk
    SBS, SMAX, SNB = z.selection_block_size, z.selection_max_blocks, z.selection_num_blocks
    cdt = dtypes.numpy_dtype(z.dtype)
    i32 = np.dtype(np.int32)

    g = gs.Graph(opset=specs.ONNX_OPSET, name="pytrt_kv_sparse_decode_step")
    V = gs.Variable
    inp = {
        "kv": V("kv", cdt, (B, 1, KV)),
        "k_rope": V("k_rope", cdt, (B, 1, R)),
        "slot_mapping": V("slot_mapping", i32, (B,)),
        "full_kv_cache": V("full_kv_cache", cdt, (NB, FBS, 1, KV)),
        "full_k_rope": V("full_k_rope", cdt, (NB, FBS, 1, R)),
        "full_kv_block_table": V("full_kv_block_table", i32, (B, FMAX)),
        "full_kv_actual_seq": V("full_kv_actual_seq", i32, (B,)),
        "full_q_actual_seq": V("full_q_actual_seq", i32, (B,)),
        "selection_k_rope": V("selection_k_rope", cdt, (SNB, SBS, R)),
        "selection_kv_cache": V("selection_kv_cache", cdt, (SNB, SBS, KV)),
        "selection_kv_block_table": V("selection_kv_block_table", i32, (B, SMAX)),
        "selection_kv_block_status": V("selection_kv_block_status", i32, (B, 1, 1, K + 1)),
        "q_nope": V("q_nope", cdt, (B, Hq, KV)),
        "q_rope": V("q_rope", cdt, (B, Hq, R)),
        "index_q": V("index_q", cdt, (B, KV)),
    }
    g.inputs = list(inp.values())
    counter = iter(range(1 << 30))

    def const(name: str, value) -> gs.Constant:
        return gs.Constant(f"{name}_{next(counter)}", np.asarray(value))

    def op(op_type: str, inputs: list, dtype, shape, **attrs) -> gs.Variable:
        (out,) = g.layer(
            op=op_type,
            name=f"{op_type}_{next(counter)}",
            inputs=inputs,
            outputs=[V(f"{op_type.lower()}_{next(counter)}", dtype, shape)],
            attrs=attrs,
        )
        return out

    # 1. Write the new token (latent + rope) into the full paged caches.
    full_kv_out, full_rope_out = add_scatter_pa_kv_cache(
        g,
        inp["kv"],
        inp["k_rope"],
        inp["full_kv_cache"],
        inp["full_k_rope"],
        inp["slot_mapping"],
        cache_layout="nd",
        alias_io=alias_io,
        name="write_new_token",
        output_names=["full_kv_cache_out", "full_k_rope_out"],
    )
    full_kv3 = op(
        "Reshape",
        [full_kv_out, const("shape", np.array([NB, FBS, KV], np.int64))],
        cdt,
        (NB, FBS, KV),
    )
    full_rope3 = op(
        "Reshape",
        [full_rope_out, const("shape", np.array([NB, FBS, R], np.int64))],
        cdt,
        (NB, FBS, R),
    )

    topk, neg_inf = _indexer_topk(g, op, const, inp, full_kv3, z, B, Bc)

    sel_rope_out, sel_kv_out, status_out, actual = _gather(
        g, inp, topk, full_rope3, full_kv3, alias_io
    )
    attn = _attention(g, op, const, inp, sel_kv_out, sel_rope_out, actual, neg_inf, z, B, Bc)

    outs = [full_kv_out, full_rope_out, sel_rope_out, sel_kv_out, status_out, actual]
    g.outputs = [attn, topk, *outs]
    return g


def _gather(g, inp, topk, full_rope3, full_kv3, alias_io: int):
    """Step 4 of :func:`build_example_graph`: gather the selected tokens into the
    selection cache, reusing resident ones; returns the op's four outputs."""
    from .graphsurgeon import add_gather_selection_kv_cache

    # 4. Gather the selected tokens into the selection cache (reusing resident ones).
    return add_gather_selection_kv_cache(
        g,
        inp["selection_k_rope"],
        inp["selection_kv_cache"],
        inp["selection_kv_block_table"],
        inp["selection_kv_block_status"],
        topk,
        full_rope3,
        full_kv3,
        inp["full_kv_block_table"],
        inp["full_kv_actual_seq"],
        inp["full_q_actual_seq"],
        selection_topk_block_size=1,
        alias_io=alias_io,
        name="gather_selection",
        output_names=[
            "selection_k_rope_out",
            "selection_kv_cache_out",
            "selection_kv_block_status_out",
            "selection_kv_actual_seq",
        ],
    )


def _indexer_topk(g, op, const, inp, full_kv3, z, B, Bc):
    """Steps 2-3 of :func:`build_example_graph`: the indexer's score per cached position
    and the top-k visible positions (padding -1), as ``topk_indices [B, 1, 1, K]``."""
    import onnx_graphsurgeon as gs

    V = gs.Variable
    cdt = dtypes.numpy_dtype(z.dtype)
    i32, f32 = np.dtype(np.int32), np.dtype(np.float32)
    KV, FMAX, FBS, K, P = z.kv_dim, z.max_blocks_per_seq, z.block_size, z.topk, z.max_tokens
    # 2. Indexer: one score per cached position, from the updated cache.
    tokens = op("Gather", [full_kv3, inp["full_kv_block_table"]], cdt, (B, FMAX, FBS, KV), axis=0)
    tokens = op(
        "Reshape", [tokens, const("shape", np.array([Bc, P, KV], np.int64))], cdt, (B, P, KV)
    )
    tokens = op("Cast", [tokens], f32, (B, P, KV), to=onnx.TensorProto.FLOAT)
    iq = op("Cast", [inp["index_q"]], f32, (B, KV), to=onnx.TensorProto.FLOAT)
    iq = op("Unsqueeze", [iq, const("axes", np.array([2], np.int64))], f32, (B, KV, 1))
    scores = op("MatMul", [tokens, iq], f32, (B, P, 1))
    scores = op("Reshape", [scores, const("shape", np.array([Bc, P], np.int64))], f32, (B, P))

    # 3. Top-K over the visible positions p < kv_len.
    kv_len = op(
        "Unsqueeze",
        [inp["full_kv_actual_seq"], const("axes", np.array([1], np.int64))],
        i32,
        (B, 1),
    )
    visible = op(
        "Less",
        [const("positions", np.arange(P, dtype=np.int32)[None]), kv_len],
        np.dtype(bool),
        (B, P),
    )
    neg_inf = const("neg_inf", np.array(-np.inf, np.float32))
    masked = op("Where", [visible, scores, neg_inf], f32, (B, P))
    top_vals, top_idx = g.layer(
        op="TopK",
        name="topk",
        inputs=[masked, const("k", np.array([K], np.int64))],
        outputs=[V("topk_values", f32, (B, K)), V("topk_positions", np.dtype(np.int64), (B, K))],
        attrs={"axis": -1, "largest": 1, "sorted": 1},
    )
    idx32 = op("Cast", [top_idx], i32, (B, K), to=onnx.TensorProto.INT32)
    padding = op("Equal", [top_vals, neg_inf], np.dtype(bool), (B, K))
    topk = op("Where", [padding, const("pad", np.array(-1, np.int32)), idx32], i32, (B, K))
    topk = g.layer(
        op="Reshape",
        name="topk_bsnd",
        inputs=[topk, const("shape", np.array([Bc, 1, 1, K], np.int64))],
        outputs=[V("topk_indices", i32, (B, 1, 1, K))],
    )[0]
    return topk, neg_inf


def _attention(g, op, const, inp, sel_kv_out, sel_rope_out, actual, neg_inf, z, B, Bc):
    """Step 5 of :func:`build_example_graph`: attention of the query over the K selection
    slots (slots >= actual_seq masked), as ``attn_out [B, Hq, KV]``."""
    import onnx_graphsurgeon as gs

    V = gs.Variable
    cdt = dtypes.numpy_dtype(z.dtype)
    i32, f32 = np.dtype(np.int32), np.dtype(np.float32)
    Hq, KV, R, K = z.heads, z.kv_dim, z.rope_dim, z.topk
    SBS, SMAX = z.selection_block_size, z.selection_max_blocks

    # 5. Attention of the query over the K selection slots; slots >= actual_seq masked.
    def slots(cache: gs.Variable, width: int) -> gs.Variable:
        x = op(
            "Gather", [cache, inp["selection_kv_block_table"]], cdt, (B, SMAX, SBS, width), axis=0
        )
        x = op(
            "Reshape",
            [x, const("shape", np.array([Bc, SMAX * SBS, width], np.int64))],
            cdt,
            (B, SMAX * SBS, width),
        )
        x = op(
            "Slice",
            [
                x,
                const("starts", np.array([0], np.int64)),
                const("ends", np.array([K], np.int64)),
                const("axes", np.array([1], np.int64)),
            ],
            cdt,
            (B, K, width),
        )
        return op("Cast", [x], f32, (B, K, width), to=onnx.TensorProto.FLOAT)

    sel_kv = slots(sel_kv_out, KV)
    sel_rope = slots(sel_rope_out, R)
    qn = op("Cast", [inp["q_nope"]], f32, (B, Hq, KV), to=onnx.TensorProto.FLOAT)
    qr = op("Cast", [inp["q_rope"]], f32, (B, Hq, R), to=onnx.TensorProto.FLOAT)
    s_nope = op(
        "MatMul", [qn, op("Transpose", [sel_kv], f32, (B, KV, K), perm=[0, 2, 1])], f32, (B, Hq, K)
    )
    s_rope = op(
        "MatMul", [qr, op("Transpose", [sel_rope], f32, (B, R, K), perm=[0, 2, 1])], f32, (B, Hq, K)
    )
    s = op("Add", [s_nope, s_rope], f32, (B, Hq, K))
    s = op(
        "Mul", [s, const("scale", np.array(1.0 / math.sqrt(KV + R), np.float32))], f32, (B, Hq, K)
    )
    n_sel = op("Reshape", [actual, const("shape", np.array([Bc, 1, 1], np.int64))], i32, (B, 1, 1))
    keep = op(
        "Less",
        [const("slots", np.arange(K, dtype=np.int32)[None, None]), n_sel],
        np.dtype(bool),
        (B, 1, K),
    )
    s = op("Where", [keep, s, neg_inf], f32, (B, Hq, K))
    p = op("Softmax", [s], f32, (B, Hq, K), axis=-1)
    attn = g.layer(
        op="MatMul", name="attn_out", inputs=[p, sel_kv], outputs=[V("attn_out", f32, (B, Hq, KV))]
    )[0]
    return attn


def build_example_model(
    sizes: ExampleSizes = ExampleSizes(), *, alias_io: int = 1, dynamic: bool = False
) -> onnx.ModelProto:
    """The example model: IR 10, opset 17 + pytrt_kv 1, checked with ``full_check``.

    ``dynamic``: the dynamic-batch variant (see :func:`build_example_graph`); one model
    then serves 1 to ``sizes.batch`` sequences per step.
    """
    from .graphsurgeon import export_model

    return export_model(build_example_graph(sizes, alias_io=alias_io, dynamic=dynamic))
