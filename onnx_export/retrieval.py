"""``build_retrieval_decode_step``: one RetrievalKV decode step of one layer as ONNX.

Per row b (one new token, S = 1; sizes and layout from :mod:`.planner`)::

    ScatterPaKvCache        key, value of the new token -> full paged caches
                            [NBF, B, Hkv, D] (device or pinned host memory, R2)
    R5 scores               lowrank (default): add_lowrank_scores, q projected on the
                            basis (a constant of the graph) . each block's projected
                            keys, log-sum-exp per block, per query head softmax over the
                            row's blocks, summed; add_representation_scores: mean/minmax:
                            q summed over each GQA group (minmax: [relu(q), -relu(-q)])
                            . block_repr; mass: per query head softmax over the row's
                            blocks, summed
    Where / TopK            -inf past the row's retrievable blocks; top max_selected, ties
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
``block_repr [b,NBMAX,W]`` (float32; W = ``B*Hkv*rank`` for "lowrank", the planner's
``StepLayout.width``), ``retrievable_blocks [b]``, ``selected_blocks [b]``,
``selection_key_cache``, ``selection_value_cache [SNB,B,Hkv*D]``,
``selection_kv_block_table [b,K]``, ``selection_kv_block_status [b,1,1,K+1]``.

Graph outputs: ``attn_out [b,Hq,D]`` (float32), ``topk_indices [b,1,1,K]``, and the
updated caches ``full_key_cache_out``, ``full_value_cache_out``,
``selection_key_cache_out``, ``selection_value_cache_out``,
``selection_kv_block_status_out``, ``selection_kv_actual_seq``.

The "lowrank" basis ``[Hkv, D, rank]`` (``pytrt_kv.retrieval.reference.calibrate_basis``
of calibration keys, docs/RETRIEVAL.md "A basis fixed per model is as good") is no graph
input but a constant: ``build_retrieval_decode_step(..., basis=basis)``; the planner that
feeds the step must hold the same basis.
"""

from __future__ import annotations

import math

import numpy as np
import onnx

from pytrt_kv.contract import dtypes, specs
from pytrt_kv.retrieval.config import LOWRANK, MEAN, MINMAX, REPRESENTATIONS, RetrievalConfig
from pytrt_kv.retrieval.planner import RetrievalSizes, StepLayout
from pytrt_kv.retrieval.reference import check_basis

#: Graph inputs updated in place, with the output that is their new version.
CACHE_OUTPUTS = {
    "full_key_cache": "full_key_cache_out",
    "full_value_cache": "full_value_cache_out",
    "selection_key_cache": "selection_key_cache_out",
    "selection_value_cache": "selection_value_cache_out",
    "selection_kv_block_status": "selection_kv_block_status_out",
}


def _linear_representation(representation: str, lowrank_function: str) -> None:
    """Refuse names these builders do not compute: "lowrank" has its own subgraphs (they
    need the basis), anything else is unknown."""
    if representation == LOWRANK:
        raise ValueError(
            f"representation: 'lowrank' needs its basis: use {lowrank_function} (expected "
            f"one of {[r for r in REPRESENTATIONS if r != LOWRANK]} here), got 'lowrank'"
        )
    if representation not in REPRESENTATIONS:
        raise ValueError(
            f"representation: expected one of {list(REPRESENTATIONS)}, got {representation!r}"
        )


def add_representation_scores(
    op, const, representation: str, reps, query, *, kv_heads: int, q_heads: int,
    head_dim: int, scale: float, valid=None,
):  # fmt: skip
    """Block scores of one layer (docs/SPEC.md R5) as ONNX nodes, for any graph builder.

    ``op(op_type, inputs, **attrs)`` adds a node and returns its output, ``const(array)``
    adds a constant and returns it (onnx-graphsurgeon here, ``onnx_export.llama``'s
    builder there). ``reps`` ``[B, NB, W]`` float32 (W = ``representation_width``),
    ``query`` ``[B, Hq, D]`` float32 (post-RoPE); ``valid`` ``[B, NB]`` bool, the row's
    retrievable blocks (required by "mass", whose per-head softmax must not see the
    others). Returns ``[B, NB]`` float32 scores, equal to
    ``pytrt_kv.retrieval.reference.score_blocks`` row by row; callers still mask the
    invalid blocks with -inf before TopK. "lowrank" is refused (ValueError): its scores
    are :func:`add_lowrank_scores`, which takes the basis.
    """
    _linear_representation(representation, "add_lowrank_scores")
    G, kd = q_heads // kv_heads, kv_heads * head_dim
    i64 = np.int64
    qh = op("Reshape", [query, const(np.array([0, kv_heads, G, head_dim], i64))])
    if representation in (MEAN, MINMAX):  # q summed over each GQA group, heads concatenated
        qg = op("ReduceSum", [qh, const(np.array([2], i64))], keepdims=0)
        qg = op("Reshape", [qg, const(np.array([0, kd], i64))])
        if representation == MINMAX:
            neg = op("Neg", [op("Relu", [op("Neg", [qg])])])
            qg = op("Concat", [op("Relu", [qg]), neg], axis=1)
        s = op("MatMul", [reps, op("Unsqueeze", [qg, const(np.array([2], i64))])])
        return op("Squeeze", [s, const(np.array([2], i64))])
    # "mass": sum over query heads of softmax over blocks of scale * q_h . mean_b,g(h).
    if valid is None:
        raise ValueError("valid: expected the [B, NB] retrievable-block mask for 'mass', got None")
    r = op("Reshape", [reps, const(np.array([0, 0, kv_heads, head_dim], i64))])
    r = op("Transpose", [r], perm=[0, 2, 3, 1])  # [B, Hkv, D, NB]
    s = op("Mul", [op("MatMul", [qh, r]), const(np.array(scale, np.float32))])
    keep = op("Unsqueeze", [valid, const(np.array([1, 2], i64))])  # [B, 1, 1, NB]
    s = op("Where", [keep, s, const(np.array(-np.inf, np.float32))])
    p = op("Softmax", [s], axis=-1)  # [B, Hkv, G, NB]
    return op("ReduceSum", [p, const(np.array([1, 2], i64))], keepdims=0)


def add_block_representations(op, const, representation: str, pages, valid, *, block_size: int):
    """Every block's representation from its keys, as ONNX nodes (builders as in
    :func:`add_representation_scores`; a prefill writes them all at once): ``pages``
    ``[..., B, Hkv*D]`` float32 (each block's keys), ``valid`` ``[..., B, 1]`` bool (the
    keys present). "minmax": max and min over the valid keys (0 where a block has none);
    "mean" and "mass": sum of the valid keys / ``block_size`` (the mean of a complete
    block; only complete blocks are scored, R3). Returns ``[..., W]``. "lowrank" is
    refused (ValueError): see :func:`add_lowrank_block_representations`."""
    _linear_representation(representation, "add_lowrank_block_representations")
    axis = const(np.array([-2], np.int64))
    if representation == MINMAX:
        hi = op("Where", [valid, pages, const(np.array(-np.inf, np.float32))])
        lo = op("Where", [valid, pages, const(np.array(np.inf, np.float32))])
        # ReduceMax/Min take axes as an attribute up to opset 17.
        new = op(
            "Concat",
            [
                op("ReduceMax", [hi], axes=[-2], keepdims=0),
                op("ReduceMin", [lo], axes=[-2], keepdims=0),
            ],
            axis=-1,
        )
        return op("Where", [op("IsInf", [new]), const(np.array(0.0, np.float32)), new])
    kept = op("Where", [valid, pages, const(np.array(0.0, np.float32))])
    total = op("ReduceSum", [kept, axis], keepdims=0)
    return op("Mul", [total, const(np.array(1.0 / block_size, np.float32))])


def add_representation_update(
    op, const, representation: str, current, key_row, fresh, *, kv_width: int, block_size: int
):
    """A block's representation after one more key, as ONNX nodes (builders as in
    :func:`add_representation_scores`): ``current`` ``[B, W]`` the block's row,
    ``key_row`` ``[B, kv_width = Hkv*D]`` float32 the new key, ``fresh`` ``[B, 1]`` bool
    (the key is the block's first: the old row is ignored). "minmax": running max and
    min; "mean" and "mass": running sum of ``key / block_size``, the mean once the block is
    complete (only complete blocks are ever scored, R3). Returns the new ``[B, W]`` row.
    "lowrank" is refused (ValueError): see :func:`add_lowrank_update`."""
    _linear_representation(representation, "add_lowrank_update")
    i64 = np.int64
    if representation == MINMAX:
        axis = const(np.array([1], i64))
        hi = op(
            "Slice", [current, const(np.array([0], i64)), const(np.array([kv_width], i64)), axis]
        )
        lo = op(
            "Slice",
            [current, const(np.array([kv_width], i64)), const(np.array([2 * kv_width], i64)), axis],
        )
        hi = op("Max", [op("Where", [fresh, const(np.array(-np.inf, np.float32)), hi]), key_row])
        lo = op("Min", [op("Where", [fresh, const(np.array(np.inf, np.float32)), lo]), key_row])
        return op("Concat", [hi, lo], axis=1)
    base = op("Where", [fresh, const(np.array(0.0, np.float32)), current])
    return op("Add", [base, op("Mul", [key_row, const(np.array(1.0 / block_size, np.float32))])])


# --- "lowrank" (R5) -----------------------------------------------------------------------
# The subgraphs of pytrt_kv.retrieval.reference.lowrank_*: ``basis`` ``[Hkv, D, r]`` is a
# constant of the graph (a basis fixed per model, docs/RETRIEVAL.md "A basis fixed per
# model is as good"), a block's row its projected keys ``[B*Hkv*r]`` (token-major).


def add_lowrank_scores(
    op, const, reps, query, *, basis, block_size: int, q_heads: int, scale: float, valid
):
    """``[Bt, NB]`` float32 scores (``reference.lowrank_scores`` row by row) of ``reps``
    ``[Bt, NB, B*Hkv*r]`` for ``query`` ``[Bt, Hq, D]``; ``valid`` ``[Bt, NB]`` bool
    (the per-head softmax sees only the row's retrievable blocks)."""
    b = np.asarray(basis, np.float32)
    if b.ndim != 3 or q_heads % b.shape[0]:
        raise ValueError(
            f"basis: expected shape [Hkv, D, r] with Hkv dividing q_heads = {q_heads}, "
            f"got {list(b.shape)}"
        )
    hkv, d, r = b.shape
    i64 = np.int64
    qh = op("Reshape", [query, const(np.array([0, hkv, q_heads // hkv, d], i64))])
    qp = op("MatMul", [qh, const(b)])  # [Bt, Hkv, G, r]
    kp = op("Reshape", [reps, const(np.array([0, 0, block_size, hkv, r], i64))])
    kp = op("Transpose", [kp], perm=[0, 3, 4, 1, 2])  # [Bt, Hkv, r, NB, B]
    kp = op("Reshape", [kp, const(np.array([0, 0, 0, -1], i64))])
    s = op("Mul", [op("MatMul", [qp, kp]), const(np.array(scale, np.float32))])
    s = op("Reshape", [s, const(np.array([0, 0, 0, -1, block_size], i64))])
    lse = op("ReduceLogSumExp", [s], axes=[-1], keepdims=0)  # [Bt, Hkv, G, NB]
    keep = op("Unsqueeze", [valid, const(np.array([1, 2], i64))])
    lse = op("Where", [keep, lse, const(np.array(-np.inf, np.float32))])
    p = op("Softmax", [lse], axis=-1)
    return op("ReduceSum", [p, const(np.array([1, 2], i64))], keepdims=0)


def add_lowrank_block_representations(op, const, pages, valid, *, basis):
    """``[Bt, NB, B*Hkv*r]``: every block's projected keys from ``pages`` ``[Bt, NB, B,
    Hkv*D]`` float32 and ``valid`` ``[Bt, NB, B, 1]`` bool (a missing key projects to
    zeros)."""
    b = np.asarray(basis, np.float32)
    hkv, d, _ = b.shape
    i64 = np.int64
    kept = op("Where", [valid, pages, const(np.array(0.0, np.float32))])
    k = op("Reshape", [kept, const(np.array([0, 0, 0, hkv, 1, d], i64))])
    proj = op("MatMul", [k, const(b)])  # [Bt, NB, B, Hkv, 1, r]
    return op("Reshape", [proj, const(np.array([0, 0, -1], i64))])


def add_lowrank_update(op, const, current, key_row, slot, *, basis, block_size: int):
    """A block's row after one more key: ``current`` ``[Bt, B*Hkv*r]``, ``key_row`` ``[Bt,
    Hkv*D]`` float32, ``slot`` ``[Bt, 1]`` int64 (the key's place in its block, ``pos %
    B``; 0 starts the block: the old row's other slots become zeros)."""
    b = np.asarray(basis, np.float32)
    hkv, d, r = b.shape
    i64 = np.int64
    kp = op("MatMul", [op("Reshape", [key_row, const(np.array([0, hkv, 1, d], i64))]), const(b)])
    kp = op("Reshape", [kp, const(np.array([0, 1, hkv * r], i64))])  # [Bt, 1, Hkv*r]
    cur = op("Reshape", [current, const(np.array([0, block_size, hkv * r], i64))])
    fresh = op(
        "Unsqueeze", [op("Equal", [slot, const(np.array(0, i64))]), const(np.array([2], i64))]
    )
    cur = op("Where", [fresh, const(np.array(0.0, np.float32)), cur])
    here = op("Equal", [const(np.arange(block_size, dtype=i64)), slot])  # [Bt, B]
    here = op("Unsqueeze", [here, const(np.array([2], i64))])
    return op("Reshape", [op("Where", [here, kp, cur]), const(np.array([0, -1], i64))])


class _Builder:
    """Unique names, constants and typed nodes of one onnx-graphsurgeon graph."""

    def __init__(self, graph, batch: int) -> None:
        self.g, self.b = graph, batch
        self.counter = iter(range(1 << 30))

    def const(self, name: str, value):
        import onnx_graphsurgeon as gs

        return gs.Constant(f"{name}_{next(self.counter)}", np.asarray(value))

    def shape(self, *dims: int):
        return self.const("shape", np.array(dims, np.int64))

    def op(self, op_type: str, inputs: list, dtype, shp, name: str | None = None, **attrs):
        import onnx_graphsurgeon as gs

        out_name = name or f"{op_type.lower()}_{next(self.counter)}"
        (out,) = self.g.layer(
            op=op_type,
            name=f"{op_type}_{next(self.counter)}",
            inputs=inputs,
            outputs=[gs.Variable(out_name, dtype, shp)],
            attrs=attrs,
        )
        return out

    def untyped(self, op_type: str, inputs: list, **attrs):
        """A node whose output type and shape the checker infers (for
        :func:`add_representation_scores`)."""
        return self.op(op_type, inputs, None, None, **attrs)

    def column(self, x):  # [b] -> [b, 1]
        return self.op(
            "Unsqueeze", [x, self.const("axes", np.array([1], np.int64))], x.dtype, (self.b, 1)
        )


def _step_inputs(z: RetrievalSizes, lay: StepLayout) -> dict:
    import onnx_graphsurgeon as gs

    V = gs.Variable
    b, Hq, Hkv, D = z.batch, z.q_heads, z.kv_heads, z.head_dim
    B, K, HD = lay.block_size, lay.topk, Hkv * D
    NBF, SNB = lay.full_blocks, lay.sel_blocks
    cdt = dtypes.numpy_dtype(z.dtype)
    i32, f32 = np.dtype(np.int32), np.dtype(np.float32)
    return {
        "query": V("query", cdt, (b, Hq, D)),
        "key": V("key", cdt, (b, Hkv, D)),
        "value": V("value", cdt, (b, Hkv, D)),
        "full_key_cache": V("full_key_cache", cdt, (NBF, B, Hkv, D)),
        "full_value_cache": V("full_value_cache", cdt, (NBF, B, Hkv, D)),
        "slot_mapping": V("slot_mapping", i32, (b,)),
        "full_kv_block_table": V("full_kv_block_table", i32, (b, lay.full_max_blocks)),
        "full_kv_actual_seq": V("full_kv_actual_seq", i32, (b,)),
        "full_q_actual_seq": V("full_q_actual_seq", i32, (b,)),
        "block_repr": V("block_repr", f32, (b, lay.max_blocks, lay.width)),
        "retrievable_blocks": V("retrievable_blocks", i32, (b,)),
        "selected_blocks": V("selected_blocks", i32, (b,)),
        "selection_key_cache": V("selection_key_cache", cdt, (SNB, B, HD)),
        "selection_value_cache": V("selection_value_cache", cdt, (SNB, B, HD)),
        "selection_kv_block_table": V("selection_kv_block_table", i32, (b, K)),
        "selection_kv_block_status": V("selection_kv_block_status", i32, (b, 1, 1, K + 1)),
    }


def _block_ids(bd: _Builder, lay: StepLayout, inp: dict, scores):
    """``topk_indices [b, 1, 1, K]``: [init ids | first_id + top j | local ids], -1 padded."""
    import onnx_graphsurgeon as gs

    b, B, K, KSEL = bd.b, lay.block_size, lay.topk, lay.max_selected
    i32, i64, f32 = np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.float32)
    bool_ = np.dtype(bool)
    op, const = bd.op, bd.const
    pad = const("pad", np.array(-1, np.int32))
    L = bd.column(inp["full_kv_actual_seq"])
    up = op("Add", [L, const("bm1", np.array(B - 1, np.int32))], i32, (b, 1))
    blocks = op("Div", [up, const("B", np.array(B, np.int32))], i32, (b, 1))
    max_id = op("Sub", [blocks, const("one", np.array(1, np.int32))], i32, (b, 1))
    parts = []
    if lay.init_blocks:
        init_ids = const("init_ids", np.arange(lay.init_blocks, dtype=np.int32)[None])
        ok = op("LessOrEqual", [init_ids, max_id], bool_, (b, lay.init_blocks))
        parts.append(op("Where", [ok, init_ids, pad], i32, (b, lay.init_blocks)))
    if KSEL:
        _, top_idx = bd.g.layer(
            op="TopK",
            name="select_blocks",
            inputs=[scores, const("k", np.array([KSEL], np.int64))],
            outputs=[
                gs.Variable("selected_scores", f32, (b, KSEL)),
                gs.Variable("selected_j", i64, (b, KSEL)),
            ],
            attrs={"axis": -1, "largest": 1, "sorted": 1},
        )
        j = op("Cast", [top_idx], i32, (b, KSEL), to=onnx.TensorProto.INT32)
        ids = op("Add", [j, const("first_id", np.array(lay.first_id, np.int32))], i32, (b, KSEL))
        ranks = const("ranks", np.arange(KSEL, dtype=np.int32)[None])
        ranked = op("Less", [ranks, bd.column(inp["selected_blocks"])], bool_, (b, KSEL))
        parts.append(op("Where", [ranked, ids, pad], i32, (b, KSEL)))
    first_local = op(
        "Add",
        [bd.column(inp["retrievable_blocks"]), const("first_id", np.array(lay.first_id, np.int32))],
        i32,
        (b, 1),
    )
    local = const("local", np.arange(lay.local_blocks, dtype=np.int32)[None])
    local_ids = op("Add", [first_local, local], i32, (b, lay.local_blocks))
    ok = op("LessOrEqual", [local_ids, max_id], bool_, (b, lay.local_blocks))
    parts.append(op("Where", [ok, local_ids, pad], i32, (b, lay.local_blocks)))
    ids = op("Concat", parts, i32, (b, K), axis=1) if len(parts) > 1 else parts[0]
    return op("Reshape", [ids, bd.shape(b, 1, 1, K)], i32, (b, 1, 1, K), name="topk_indices")


def _attend(bd: _Builder, z: RetrievalSizes, lay: StepLayout, inp: dict, qf, sk, sv, actual,
            scale: float):  # fmt: skip
    """R6: softmax attention of ``qf [b, Hq, D]`` (float32) over the selection slots
    ``[0, actual)`` of the gathered caches; ``attn_out [b, Hq, D]``."""
    b, Hq, Hkv, D = z.batch, z.q_heads, z.kv_heads, z.head_dim
    G, HD, B, K = Hq // Hkv, Hkv * D, lay.block_size, lay.topk
    T = K * B
    cdt = dtypes.numpy_dtype(z.dtype)
    i32, f32, bool_ = np.dtype(np.int32), np.dtype(np.float32), np.dtype(bool)
    op, const, shape = bd.op, bd.const, bd.shape

    def slots(cache, perm: list[int], shp):
        x = op("Gather", [cache, inp["selection_kv_block_table"]], cdt, (b, K, B, HD), axis=0)
        x = op("Reshape", [x, shape(b, T, Hkv, D)], cdt, (b, T, Hkv, D))
        x = op("Transpose", [x], cdt, shp, perm=perm)
        return op("Cast", [x], f32, shp, to=onnx.TensorProto.FLOAT)

    kt = slots(sk, [0, 2, 3, 1], (b, Hkv, D, T))
    vs = slots(sv, [0, 2, 1, 3], (b, Hkv, T, D))
    qh = op("Reshape", [qf, shape(b, Hkv, G, D)], f32, (b, Hkv, G, D))
    s = op("MatMul", [qh, kt], f32, (b, Hkv, G, T))
    s = op("Mul", [s, const("scale", np.array(scale, np.float32))], f32, (b, Hkv, G, T))
    n = op("Reshape", [actual, shape(b, 1, 1, 1)], i32, (b, 1, 1, 1))
    slot = const("slots", np.arange(T, dtype=np.int32)[None, None, None])
    keep = op("Less", [slot, n], bool_, (b, 1, 1, T))
    s = op("Where", [keep, s, const("neg_inf", np.array(-np.inf, np.float32))], f32, (b, Hkv, G, T))
    p = op("Softmax", [s], f32, (b, Hkv, G, T), axis=-1)
    o = op("MatMul", [p, vs], f32, (b, Hkv, G, D))
    return op("Reshape", [o, shape(b, Hq, D)], f32, (b, Hq, D), name="attn_out")


def build_retrieval_graph(
    sizes: RetrievalSizes,
    cfg: RetrievalConfig,
    *,
    scale: float | None = None,
    alias_io: int = 1,
    basis: np.ndarray | None = None,
):
    """The decode step as an onnx-graphsurgeon graph (see the module docstring and
    :func:`build_retrieval_decode_step`)."""
    import onnx_graphsurgeon as gs

    from .graphsurgeon import add_gather_selection_kv_cache, add_scatter_pa_kv_cache

    z = sizes.validate(cfg)
    lay = StepLayout.of(z, cfg)
    b, Hq, Hkv, D = z.batch, z.q_heads, z.kv_heads, z.head_dim
    if cfg.representation == LOWRANK:
        basis = check_basis(basis, Hkv, D, cfg.rank)
    B, NBF, NBMAX, HD = lay.block_size, lay.full_blocks, lay.max_blocks, Hkv * D
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    cdt = dtypes.numpy_dtype(z.dtype)
    f32 = np.dtype(np.float32)
    g = gs.Graph(opset=specs.ONNX_OPSET, name="pytrt_kv_retrieval_decode_step")
    inp = _step_inputs(z, lay)
    g.inputs = list(inp.values())
    bd = _Builder(g, b)
    op, const = bd.op, bd.const

    # 1. The new token into the full caches (nd layout: key [T = b, Hkv, D]).
    fk_out, fv_out = add_scatter_pa_kv_cache(
        g, inp["key"], inp["value"], inp["full_key_cache"], inp["full_value_cache"],
        inp["slot_mapping"], cache_layout="nd", alias_io=alias_io, name="write_new_token",
        output_names=["full_key_cache_out", "full_value_cache_out"],
    )  # fmt: skip
    fk3 = op("Reshape", [fk_out, bd.shape(NBF, B, HD)], cdt, (NBF, B, HD))
    fv3 = op("Reshape", [fv_out, bd.shape(NBF, B, HD)], cdt, (NBF, B, HD))

    # 2. R5 block scores over the row's retrievable blocks, R4 selection.
    qf = op("Cast", [inp["query"]], f32, (b, Hq, D), to=onnx.TensorProto.FLOAT)
    blocks = const("blocks", np.arange(NBMAX, dtype=np.int32)[None])
    in_range = op(
        "Less", [blocks, bd.column(inp["retrievable_blocks"])], np.dtype(bool), (b, NBMAX)
    )
    if cfg.representation == LOWRANK:
        scores = add_lowrank_scores(
            bd.untyped, lambda a: const("c", a), inp["block_repr"], qf, basis=basis,
            block_size=B, q_heads=Hq, scale=scale, valid=in_range,
        )  # fmt: skip
    else:
        scores = add_representation_scores(
            bd.untyped, lambda a: const("c", a), cfg.representation, inp["block_repr"], qf,
            kv_heads=Hkv, q_heads=Hq, head_dim=D, scale=scale, valid=in_range,
        )  # fmt: skip
    neg_inf = const("neg_inf", np.array(-np.inf, np.float32))
    scores = op("Where", [in_range, scores, neg_inf], f32, (b, NBMAX), name="block_scores")
    topk = _block_ids(bd, lay, inp, scores)

    # 3. Recall: selected blocks (and init, local, the new token's block) -> selection.
    sk_out, sv_out, status_out, actual = add_gather_selection_kv_cache(
        g, inp["selection_key_cache"], inp["selection_value_cache"],
        inp["selection_kv_block_table"], inp["selection_kv_block_status"], topk, fk3, fv3,
        inp["full_kv_block_table"], inp["full_kv_actual_seq"], inp["full_q_actual_seq"],
        selection_topk_block_size=B, alias_io=alias_io, name="recall_blocks",
        output_names=["selection_key_cache_out", "selection_value_cache_out",
                      "selection_kv_block_status_out", "selection_kv_actual_seq"],
    )  # fmt: skip

    # 4. Attention over the selection slots [0, actual_seq) (R6).
    attn = _attend(bd, z, lay, inp, qf, sk_out, sv_out, actual, scale)
    g.outputs = [attn, topk, fk_out, fv_out, sk_out, sv_out, status_out, actual]
    return g


def build_retrieval_decode_step(
    sizes: RetrievalSizes,
    cfg: RetrievalConfig,
    *,
    scale: float | None = None,
    alias_io: int = 1,
    basis: np.ndarray | None = None,
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
    basis : numpy.ndarray ``[kv_heads, head_dim, cfg.rank]``
        The "lowrank" basis, a constant of the graph (required for "lowrank"; ignored by
        the other representations). Feed the step from a planner holding the same one.

    Raises
    ------
    ValueError
        Sizes the config does not fit; "lowrank" without a basis or with one of another
        shape (the message names ``basis``).

    Examples
    --------
    >>> from pytrt_kv.retrieval import RetrievalConfig, calibrate_basis
    >>> cfg = RetrievalConfig(init_tokens=32, local_tokens=64, block_size=32, rank=8)
    >>> basis = calibrate_basis(np.random.default_rng(1).standard_normal((256, 2, 16)), 8)
    >>> m = build_retrieval_decode_step(RetrievalSizes(batch=1, max_len=512), cfg, basis=basis)
    >>> sorted({n.op_type for n in m.graph.node if n.domain == "pytrt_kv"})
    ['GatherSelectionKvCache', 'ScatterPaKvCache']
    """
    from .graphsurgeon import export_model

    graph = build_retrieval_graph(sizes, cfg, scale=scale, alias_io=alias_io, basis=basis)
    return export_model(graph)
