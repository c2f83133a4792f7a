"""``build_retrieval_decode_step``: one RetrievalKV decode step of one layer as ONNX.

Per row b (one new token, S = 1; sizes and layout from :mod:`.planner`)::

    ScatterPaKvCache        key, value of the new token -> full paged caches
                            [NBF, B, Hkv, D] (device or pinned host memory, R2)
    ReduceSum / Relu        R5 query: q summed over each GQA group, heads concatenated;
                            minmax: [relu(q), -relu(-q)]
    MatMul / Where / TopK   block scores = block_repr . query over the row's
                            retrievable blocks (-inf past them); top max_selected, ties
                            to the lower id (ONNX TopK order = R4); ranks >= the row's
                            selected_blocks -> -1
    Concat                  ids in TBS units: [init ids | first_id + j | local ids],
                            -1 padding (Where against the row's max id)
    GatherSelectionKvCache  TBS = B: recalled blocks (and init, local, the new token's
                            block) -> the selection caches; resident ids stay in place
    attention               over the selection slots [0, selection_kv_actual_seq) =
                            init + recalled + local, scale 1/sqrt(D) unless given

Keys travel in the op's ``k_rope`` pair, values in its ``kv`` pair (both
``[*, B, Hkv*D]`` views of the caches, Reshape of the scatter's outputs).

Graph inputs: ``query [b,Hq,D]``, ``key [b,Hkv,D]``, ``value [b,Hkv,D]``,
``full_key_cache``, ``full_value_cache [NBF,B,Hkv,D]``, ``slot_mapping [b]``,
``full_kv_block_table [b,FMAX]``, ``full_kv_actual_seq [b]``, ``full_q_actual_seq [b]``,
``block_repr [b,NBMAX,W]`` (float32), ``retrievable_blocks [b]``, ``selected_blocks [b]``,
``selection_key_cache``, ``selection_value_cache [SNB,B,Hkv*D]``,
``selection_kv_block_table [b,K]``, ``selection_kv_block_status [b,1,1,K+1]``.

Graph outputs: ``attn_out [b,Hq,D]`` (float32), ``topk_indices [b,1,1,K]``, and the
updated caches ``full_key_cache_out``, ``full_value_cache_out``,
``selection_key_cache_out``, ``selection_value_cache_out``,
``selection_kv_block_status_out``, ``selection_kv_actual_seq``.
"""

from __future__ import annotations

import math

import numpy as np
import onnx

from pytrt_kv.contract import dtypes, specs
from pytrt_kv.retrieval.config import MINMAX, RetrievalConfig
from pytrt_kv.retrieval.planner import RetrievalSizes, StepLayout

#: Graph inputs updated in place, with the output that is their new version.
CACHE_OUTPUTS = {
    "full_key_cache": "full_key_cache_out",
    "full_value_cache": "full_value_cache_out",
    "selection_key_cache": "selection_key_cache_out",
    "selection_value_cache": "selection_value_cache_out",
    "selection_kv_block_status": "selection_kv_block_status_out",
}


def build_retrieval_graph(
    sizes: RetrievalSizes, cfg: RetrievalConfig, *, scale: float | None = None, alias_io: int = 1
):
    """The decode step as an onnx-graphsurgeon graph (see the module docstring)."""
    import onnx_graphsurgeon as gs

    from .graphsurgeon import add_gather_selection_kv_cache, add_scatter_pa_kv_cache

    z = sizes.validate(cfg)
    lay = StepLayout.of(z, cfg)
    b, Hq, Hkv, D = z.batch, z.q_heads, z.kv_heads, z.head_dim
    G, HD = Hq // Hkv, Hkv * z.head_dim
    B, NBF, FMAX, NBMAX, W = (
        lay.block_size,
        lay.full_blocks,
        lay.full_max_blocks,
        lay.max_blocks,
        lay.width,
    )
    K, KSEL, SNB, T = lay.topk, lay.max_selected, lay.sel_blocks, lay.topk * lay.block_size
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    cdt = dtypes.numpy_dtype(z.dtype)
    i32, i64, f32 = np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.float32)
    bool_ = np.dtype(bool)

    g = gs.Graph(opset=specs.ONNX_OPSET, name="pytrt_kv_retrieval_decode_step")
    V = gs.Variable
    inp = {
        "query": V("query", cdt, (b, Hq, D)),
        "key": V("key", cdt, (b, Hkv, D)),
        "value": V("value", cdt, (b, Hkv, D)),
        "full_key_cache": V("full_key_cache", cdt, (NBF, B, Hkv, D)),
        "full_value_cache": V("full_value_cache", cdt, (NBF, B, Hkv, D)),
        "slot_mapping": V("slot_mapping", i32, (b,)),
        "full_kv_block_table": V("full_kv_block_table", i32, (b, FMAX)),
        "full_kv_actual_seq": V("full_kv_actual_seq", i32, (b,)),
        "full_q_actual_seq": V("full_q_actual_seq", i32, (b,)),
        "block_repr": V("block_repr", f32, (b, NBMAX, W)),
        "retrievable_blocks": V("retrievable_blocks", i32, (b,)),
        "selected_blocks": V("selected_blocks", i32, (b,)),
        "selection_key_cache": V("selection_key_cache", cdt, (SNB, B, HD)),
        "selection_value_cache": V("selection_value_cache", cdt, (SNB, B, HD)),
        "selection_kv_block_table": V("selection_kv_block_table", i32, (b, K)),
        "selection_kv_block_status": V("selection_kv_block_status", i32, (b, 1, 1, K + 1)),
    }
    g.inputs = list(inp.values())
    counter = iter(range(1 << 30))

    def const(name: str, value) -> gs.Constant:
        return gs.Constant(f"{name}_{next(counter)}", np.asarray(value))

    def shape(*dims: int) -> gs.Constant:
        return const("shape", np.array(dims, np.int64))

    def op(op_type: str, inputs: list, dtype, shp, name: str | None = None, **attrs) -> gs.Variable:
        out_name = name or f"{op_type.lower()}_{next(counter)}"
        (out,) = g.layer(
            op=op_type,
            name=f"{op_type}_{next(counter)}",
            inputs=inputs,
            outputs=[V(out_name, dtype, shp)],
            attrs=attrs,
        )
        return out

    def column(x: gs.Tensor) -> gs.Variable:  # [b] -> [b, 1]
        return op("Unsqueeze", [x, const("axes", np.array([1], np.int64))], x.dtype, (b, 1))

    neg_inf = const("neg_inf", np.array(-np.inf, np.float32))
    pad = const("pad", np.array(-1, np.int32))

    # 1. The new token into the full caches (nd layout: key [T = b, Hkv, D]).
    fk_out, fv_out = add_scatter_pa_kv_cache(
        g,
        inp["key"],
        inp["value"],
        inp["full_key_cache"],
        inp["full_value_cache"],
        inp["slot_mapping"],
        cache_layout="nd",
        alias_io=alias_io,
        name="write_new_token",
        output_names=["full_key_cache_out", "full_value_cache_out"],
    )
    fk3 = op("Reshape", [fk_out, shape(NBF, B, HD)], cdt, (NBF, B, HD))
    fv3 = op("Reshape", [fv_out, shape(NBF, B, HD)], cdt, (NBF, B, HD))

    # 2. R5 query and block scores, R4 selection.
    qf = op("Cast", [inp["query"]], f32, (b, Hq, D), to=onnx.TensorProto.FLOAT)
    qg = op("Reshape", [qf, shape(b, Hkv, G, D)], f32, (b, Hkv, G, D))
    qg = op("ReduceSum", [qg, const("axes", np.array([2], np.int64))], f32, (b, Hkv, D), keepdims=0)
    qg = op("Reshape", [qg, shape(b, HD)], f32, (b, HD))
    if cfg.representation == MINMAX:
        pos = op("Relu", [qg], f32, (b, HD))
        neg = op("Neg", [op("Relu", [op("Neg", [qg], f32, (b, HD))], f32, (b, HD))], f32, (b, HD))
        qg = op("Concat", [pos, neg], f32, (b, W), axis=1)
    qcol = op("Unsqueeze", [qg, const("axes", np.array([2], np.int64))], f32, (b, W, 1))
    scores = op("MatMul", [inp["block_repr"], qcol], f32, (b, NBMAX, 1))
    scores = op("Reshape", [scores, shape(b, NBMAX)], f32, (b, NBMAX))
    in_range = op(
        "Less",
        [
            const("blocks", np.arange(NBMAX, dtype=np.int32)[None]),
            column(inp["retrievable_blocks"]),
        ],
        bool_,
        (b, NBMAX),
    )
    scores = op("Where", [in_range, scores, neg_inf], f32, (b, NBMAX), name="block_scores")
    L = column(inp["full_kv_actual_seq"])
    max_id = op(
        "Sub",
        [
            op(
                "Div",
                [
                    op("Add", [L, const("bm1", np.array(B - 1, np.int32))], i32, (b, 1)),
                    const("B", np.array(B, np.int32)),
                ],
                i32,
                (b, 1),
            ),
            const("one", np.array(1, np.int32)),
        ],
        i32,
        (b, 1),
    )
    parts = []
    if lay.init_blocks:
        init_ids = const("init_ids", np.arange(lay.init_blocks, dtype=np.int32)[None])
        ok = op("LessOrEqual", [init_ids, max_id], bool_, (b, lay.init_blocks))
        parts.append(op("Where", [ok, init_ids, pad], i32, (b, lay.init_blocks)))
    if KSEL:
        _, top_idx = g.layer(
            op="TopK",
            name="select_blocks",
            inputs=[scores, const("k", np.array([KSEL], np.int64))],
            outputs=[V("selected_scores", f32, (b, KSEL)), V("selected_j", i64, (b, KSEL))],
            attrs={"axis": -1, "largest": 1, "sorted": 1},
        )
        ids = op(
            "Add",
            [
                op("Cast", [top_idx], i32, (b, KSEL), to=onnx.TensorProto.INT32),
                const("first_id", np.array(lay.first_id, np.int32)),
            ],
            i32,
            (b, KSEL),
        )
        ranked = op(
            "Less",
            [const("ranks", np.arange(KSEL, dtype=np.int32)[None]), column(inp["selected_blocks"])],
            bool_,
            (b, KSEL),
        )
        parts.append(op("Where", [ranked, ids, pad], i32, (b, KSEL)))
    first_local = op(
        "Add",
        [column(inp["retrievable_blocks"]), const("first_id", np.array(lay.first_id, np.int32))],
        i32,
        (b, 1),
    )
    local_ids = op(
        "Add",
        [first_local, const("local", np.arange(lay.local_blocks, dtype=np.int32)[None])],
        i32,
        (b, lay.local_blocks),
    )
    ok = op("LessOrEqual", [local_ids, max_id], bool_, (b, lay.local_blocks))
    parts.append(op("Where", [ok, local_ids, pad], i32, (b, lay.local_blocks)))
    ids = op("Concat", parts, i32, (b, K), axis=1) if len(parts) > 1 else parts[0]
    topk = op("Reshape", [ids, shape(b, 1, 1, K)], i32, (b, 1, 1, K), name="topk_indices")

    # 3. Recall: selected blocks (and init, local, the new token's block) -> selection.
    sk_out, sv_out, status_out, actual = add_gather_selection_kv_cache(
        g,
        inp["selection_key_cache"],
        inp["selection_value_cache"],
        inp["selection_kv_block_table"],
        inp["selection_kv_block_status"],
        topk,
        fk3,
        fv3,
        inp["full_kv_block_table"],
        inp["full_kv_actual_seq"],
        inp["full_q_actual_seq"],
        selection_topk_block_size=B,
        alias_io=alias_io,
        name="recall_blocks",
        output_names=[
            "selection_key_cache_out",
            "selection_value_cache_out",
            "selection_kv_block_status_out",
            "selection_kv_actual_seq",
        ],
    )

    # 4. Attention over the selection slots [0, actual_seq) (R6).
    def slots(cache: gs.Tensor, perm: list[int], shp) -> gs.Variable:
        x = op("Gather", [cache, inp["selection_kv_block_table"]], cdt, (b, K, B, HD), axis=0)
        x = op("Reshape", [x, shape(b, T, Hkv, D)], cdt, (b, T, Hkv, D))
        x = op("Transpose", [x], cdt, shp, perm=perm)
        return op("Cast", [x], f32, shp, to=onnx.TensorProto.FLOAT)

    kt = slots(sk_out, [0, 2, 3, 1], (b, Hkv, D, T))
    vs = slots(sv_out, [0, 2, 1, 3], (b, Hkv, T, D))
    qh = op("Reshape", [qf, shape(b, Hkv, G, D)], f32, (b, Hkv, G, D))
    s = op("MatMul", [qh, kt], f32, (b, Hkv, G, T))
    s = op("Mul", [s, const("scale", np.array(scale, np.float32))], f32, (b, Hkv, G, T))
    n = op("Reshape", [actual, shape(b, 1, 1, 1)], i32, (b, 1, 1, 1))
    keep = op(
        "Less",
        [const("slots", np.arange(T, dtype=np.int32)[None, None, None]), n],
        bool_,
        (b, 1, 1, T),
    )
    s = op("Where", [keep, s, neg_inf], f32, (b, Hkv, G, T))
    p = op("Softmax", [s], f32, (b, Hkv, G, T), axis=-1)
    o = op("MatMul", [p, vs], f32, (b, Hkv, G, D))
    attn = op("Reshape", [o, shape(b, Hq, D)], f32, (b, Hq, D), name="attn_out")

    g.outputs = [attn, topk, fk_out, fv_out, sk_out, sv_out, status_out, actual]
    return g


def build_retrieval_decode_step(
    sizes: RetrievalSizes, cfg: RetrievalConfig, *, scale: float | None = None, alias_io: int = 1
) -> onnx.ModelProto:
    """The retrieval decode step as an ONNX model (IR 10, opset 17 + pytrt_kv 1), checked
    with ``onnx.checker`` (``full_check=True``).

    Parameters
    ----------
    sizes : RetrievalSizes
    cfg : RetrievalConfig
    scale : float, default ``1/sqrt(head_dim)``
    alias_io : 0 or 1
        ``alias_io`` attribute of both pytrt_kv nodes.

    Examples
    --------
    >>> from pytrt_kv.retrieval import RetrievalConfig
    >>> cfg = RetrievalConfig(init_tokens=32, local_tokens=64, block_size=32)
    >>> m = build_retrieval_decode_step(RetrievalSizes(batch=1, max_len=512), cfg)
    >>> sorted({n.op_type for n in m.graph.node if n.domain == "pytrt_kv"})
    ['GatherSelectionKvCache', 'ScatterPaKvCache']
    """
    from .graphsurgeon import export_model

    return export_model(build_retrieval_graph(sizes, cfg, scale=scale, alias_io=alias_io))
