"""The RetrievalKV variant of the graphs (docs/LLAMA.md "Sparse decode"): per-page key
representations (docs/SPEC.md R5, "lowrank", "mean", "minmax" or "mass" as the
RetrievalConfig says) kept up to date by both graphs, and per decode layer the R4
selection, the ``GatherSelectionKvCache`` into the selection caches and the attention
over them. "lowrank" projects keys and queries on a per-layer basis ``[Hkv, D, r]``, a
constant of the model (``pytrt_kv.retrieval.study.calibration.calibrate_lowrank``) held
by both graphs as the float32 weight ``lowrank_basis_<i>``."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
from onnx import TensorProto, helper

from pytrt_kv.contract import specs

from .graph import Graph


def selection_width(retrieval: Any, max_pages: int | None) -> int:
    """K, the selection width of the sparse decode graph: the most pages one step can
    select with block tables of ``max_pages`` columns (init + the largest top-k + the
    pages of the local window), at most ``max_pages``."""
    if max_pages is None:
        raise ValueError(
            "max_pages: expected the static block-table width of the sparse "
            "decode graph (an int >= 1), got None"
        )
    bs, init, local = retrieval.block_size, retrieval.init_tokens, retrieval.local_tokens
    nb = max(0, (max_pages * bs - local - init) // bs)
    n = init // bs + retrieval.num_selected(nb) + -(-(local + bs - 1) // bs)
    return min(max_pages, n)


def reps_width(retrieval: Any, kv_heads: int, head_dim: int) -> int:
    """Columns of ``key_reps_<i>``: lowrank keeps the page's projected keys
    (``BS*Hkv*r``, token-major), minmax [max, min] (``2*Hkv*D``), mean and mass the key
    sum (``Hkv*D``)."""
    from pytrt_kv.retrieval.config import LOWRANK, MINMAX  # noqa: PLC0415

    kd = kv_heads * head_dim
    if retrieval.representation == LOWRANK:
        return retrieval.block_size * kv_heads * retrieval.rank
    return 2 * kd if retrieval.representation == MINMAX else kd


def check_basis(
    retrieval: Any, basis: Any, layers: int, kv_heads: int, head_dim: int
) -> list[np.ndarray] | None:
    """The "lowrank" basis as float32 arrays ``[kv_heads, head_dim, retrieval.rank]``,
    one per layer (None for the other representations and without retrieval).

    Raises
    ------
    ValueError
        ``retrieval.rank > head_dim``; ``basis`` missing for "lowrank" (or given for
        another representation), not one array per layer, of another shape, or not
        finite.
    """
    from pytrt_kv.retrieval.config import LOWRANK  # noqa: PLC0415
    from pytrt_kv.retrieval.reference import check_basis  # noqa: PLC0415

    rep = None if retrieval is None else retrieval.representation
    if rep != LOWRANK:
        if basis is not None:
            raise ValueError(
                f"basis: expected None (only the 'lowrank' representation has a basis), "
                f"got one with representation {rep!r}"
            )
        return None
    if retrieval.rank > head_dim:
        raise ValueError(
            f"retrieval.rank: expected <= head_dim = {head_dim} (the basis is [kv_heads, "
            f"head_dim, rank]), got {retrieval.rank}"
        )
    if basis is None:
        raise ValueError(
            f"basis: expected the 'lowrank' basis, one float32 array [{kv_heads}, "
            f"{head_dim}, {retrieval.rank}] per layer (calibrate_lowrank), got None"
        )
    if isinstance(basis, np.ndarray) or not hasattr(basis, "__len__") or len(basis) != layers:
        got = f"{len(basis)} arrays" if isinstance(basis, (list, tuple)) else type(basis).__name__
        raise ValueError(f"basis: expected a list of {layers} arrays (one per layer), got {got}")
    rank = retrieval.rank
    return [
        np.ascontiguousarray(check_basis(b, kv_heads, head_dim, rank, name=f"basis[{i}]"))
        for i, b in enumerate(basis)
    ]


def check_retrieval(
    retrieval: Any, block_size: int, decode: bool, max_pages: Any, fp8: bool, windows: tuple
) -> None:
    from pytrt_kv.retrieval.config import REPRESENTATIONS, RetrievalConfig  # noqa: PLC0415

    if not isinstance(retrieval, RetrievalConfig):
        raise TypeError(f"retrieval: expected a RetrievalConfig, got {type(retrieval).__name__}")
    if retrieval.representation not in REPRESENTATIONS:
        raise ValueError(
            f"retrieval.representation: expected one of {REPRESENTATIONS}, got "
            f"{retrieval.representation!r}"
        )
    if retrieval.block_size != block_size:
        raise ValueError(
            f"retrieval.block_size: expected the page size {block_size} (a page is a "
            f"retrieval block), got {retrieval.block_size}"
        )
    if fp8:
        raise ValueError("kv_cache_dtype: expected 'float32' with retrieval, got 'fp8'")
    if any(w is not None for w in windows):
        raise NotImplementedError(
            "config.sliding_window: retrieval selects pages over the whole sequence; "
            "supported with retrieval: no sliding-window layers"
        )
    if decode and (isinstance(max_pages, bool) or not isinstance(max_pages, int) or max_pages < 1):
        raise ValueError(
            f"max_pages: expected the static block-table width (an int >= 1) for the "
            f"sparse decode graph, got {max_pages!r}"
        )


def _prompt_tokens(g: Graph, bs: int) -> str:
    """Prefill: ``[B, W, BS, 1]`` bool, the table slots that hold a prompt token (the
    prompt lengths from the flattened batch: ``positions[last_token[b]] + 1``)."""
    lens = g.op("Add", [g.op("Gather", ["positions", "last_token"], axis=0), g.const(1)])
    span = g.op("Mul", [g.op("Shape", ["block_tables"], start=1, end=2), g.const([bs])])
    j = g.op("Range", [g.const(0), g.op("Squeeze", [span, g.const([0])]), g.const(1)])
    valid = g.op("Less", [j, g.op("Unsqueeze", [lens, g.const([1])])])  # [B, W*BS]
    return g.op("Reshape", [valid, g.const([0, -1, bs, 1])])  # [B, W, BS, 1]


def retrieval_plan(
    g: Graph,
    cfg: Any,
    bs: int,
    decode: bool,
    max_pages: Any,
    basis: list[np.ndarray] | None = None,
    head_dim: int = 0,
) -> dict:
    """Layer-independent tensors of the RetrievalKV step (docs/SPEC.md R3, R4), and what
    every layer's R5 representation needs: its name, ``basis`` (checked by
    :func:`check_basis`; "lowrank") and the score scale ``1/sqrt(head_dim)``."""
    i64 = TensorProto.INT64
    unsq1 = g.const([1])
    rep = {
        "rep": cfg.representation,
        "basis": basis,
        "basis_names": {},
        "scale": 1.0 / math.sqrt(head_dim) if head_dim else 1.0,
        "block_size": bs,
    }
    if not decode:
        return {"valid": _prompt_tokens(g, bs), **rep}
    L = g.op("Cast", ["seq_lens"], to=i64)  # [B], this step's token included
    pos = g.op("Sub", [L, g.const(1)])
    page = g.op(
        "GatherElements",
        [
            "block_tables",
            g.op(
                "Cast",
                [g.op("Unsqueeze", [g.op("Div", [pos, g.const(bs)]), unsq1])],
                to=TensorProto.INT32,
            ),
        ],
        axis=1,
    )
    page = g.op("Reshape", [g.op("Cast", [page], to=i64), g.const([-1])])  # [B]
    slot = g.op("Mod", [pos, g.const(bs)])  # [B], the token's place in its page
    fresh = g.op("Equal", [slot, g.const(0)])  # first token of a page
    first = cfg.init_tokens // bs
    over = g.op("Max", [g.op("Sub", [L, g.const(cfg.local_tokens + cfg.init_tokens)]), g.const(0)])
    nb = g.op("Div", [over, g.const(bs)])  # [B] retrievable pages (R3), >= 0
    w = g.op("Range", [g.const(0), g.const(max_pages), g.const(1)])  # [W]
    end = g.op("Unsqueeze", [g.op("Add", [nb, g.const(first)]), unsq1])  # [B, 1]
    candidate = g.op("And", [g.op("GreaterOrEqual", [w, g.const(first)]), g.op("Less", [w, end])])
    stored = g.op("Less", [g.op("Mul", [w, g.const(bs)]), g.op("Unsqueeze", [L, unsq1])])
    always = g.op("And", [stored, g.op("Not", [candidate])])  # init and local pages
    # What the per-head softmax of "lowrank" and "mass" sees: the candidates, or every
    # page of a row without one (its scores are -inf anyway; no softmax of only -inf).
    none = g.op(
        "Equal",
        [
            g.op("ReduceMax", [g.op("Cast", [candidate], to=TensorProto.INT32)], axes=[1]),
            g.const(0, np.int32),
        ],
    )  # [B, 1]
    ksel_table = [cfg.num_selected(n) for n in range(max_pages + 1)]
    ksel = g.op("Gather", [g.const(ksel_table), nb], axis=0)  # [B] (R4, exact)
    ones = g.op(
        "Add",
        [
            g.op(
                "Range",
                [
                    g.const(0),
                    g.op("Squeeze", [g.op("Shape", ["seq_lens"]), g.const([0])]),
                    g.const(1),
                ],
            ),
            g.const(1),
        ],
    )
    return {
        **rep,
        "page": page,
        "fresh": fresh,
        "slot": g.op("Unsqueeze", [slot, unsq1]),  # [B, 1]
        "w": w,
        "candidate": candidate,
        "softmax_valid": g.op("Or", [candidate, none]),
        "always": always,
        "ksel": ksel,
        "kmax": max(ksel_table),
        "max_pages": max_pages,
        "q_cum": g.op("Cast", [ones], to=TensorProto.INT32),
        "sel_k": selection_width(cfg, max_pages),
    }


def _builders(g: Graph, plan: dict, i: int) -> tuple[Callable[..., str], Callable[..., str]]:
    """``(op, const)`` for the subgraphs of ``onnx_export.retrieval``; layer i's basis
    (the very array they are given) becomes the weight ``lowrank_basis_<i>``, added
    once per graph, so both graphs hold the same named constant."""
    basis = plan["basis"][i] if plan["basis"] is not None else None

    def const(a: np.ndarray) -> str:
        if basis is not None and a is basis:
            if i not in plan["basis_names"]:
                plan["basis_names"][i] = g.weight(f"lowrank_basis_{i}", basis)
            return str(plan["basis_names"][i])
        return g.const(a, a.dtype)

    def op(op_type: str, inputs: list[str], **attrs: Any) -> str:
        return str(g.op(op_type, inputs, **attrs))

    return op, const


def update_reps(
    g: Graph, plan: dict, k: str, kc_out: str, reps_in: str, reps_out: str, kd: int, i: int = 0
) -> None:
    """Per-page key representation (float32) of layer i, kept up to date as pages fill:
    lowrank the page's keys projected on the layer's basis ``[BS*Hkv*r]`` (token-major,
    a missing key projects to zeros); minmax ``[max over its keys, min over its keys]``
    ``[2*kd]``; mean and mass: the sum of its keys ``[kd]`` (divided by the page size
    when scored; only complete pages are scored)."""
    from pytrt_kv.retrieval.config import LOWRANK, MINMAX  # noqa: PLC0415

    from ..retrieval import (  # noqa: PLC0415
        add_lowrank_block_representations,
        add_lowrank_update,
    )

    f32 = np.float32
    minmax, lowrank = plan["rep"] == MINMAX, plan["rep"] == LOWRANK
    lo_fill = g.const(f32(np.inf), f32) if minmax else g.const(f32(0), f32)
    hi_fill = g.const(f32(-np.inf), f32) if minmax else lo_fill
    if "valid" in plan:  # prefill: every page of every prompt, from the written cache
        pages = g.op("Gather", [kc_out, "block_tables"], axis=0)  # [B, W, BS, Hkv, D]
        pages = g.to_float(g.op("Reshape", [pages, g.const([0, 0, 0, kd])]))
        if lowrank:
            op, const = _builders(g, plan, i)
            new = add_lowrank_block_representations(
                op, const, pages, plan["valid"], basis=plan["basis"][i]
            )  # [B, W, BS*Hkv*r]
        elif minmax:
            hi = g.op(
                "ReduceMax", [g.op("Where", [plan["valid"], pages, hi_fill])], axes=[2], keepdims=0
            )
            lo = g.op(
                "ReduceMin", [g.op("Where", [plan["valid"], pages, lo_fill])], axes=[2], keepdims=0
            )
            new = g.op("Concat", [hi, lo], axis=-1)  # [B, W, 2*kd]
            # A padding column (no valid token: +-inf) stores 0, so no score is ever NaN.
            new = g.op("Where", [g.op("IsInf", [new]), g.const(f32(0), f32), new])
        else:
            new = g.op(
                "ReduceSum",
                [g.op("Where", [plan["valid"], pages, lo_fill]), g.const([2])],
                keepdims=0,
            )
        # Padding columns name page 0 (never handed out): its row is unspecified.
        idx = g.op(
            "Unsqueeze", [g.op("Cast", ["block_tables"], to=TensorProto.INT64), g.const([2])]
        )
        g.nodes.append(helper.make_node("ScatterND", [reps_in, idx, new], [reps_out]))
        return
    row = g.to_float(g.op("Reshape", [k, g.const([0, kd])]))  # [B, kd]: this step's key
    cur = g.op("Gather", [reps_in, plan["page"]], axis=0)  # [B, width]
    fresh = g.op("Unsqueeze", [plan["fresh"], g.const([1])])
    if lowrank:  # the key's projection at its slot (pos % BS) of its page's row
        op, const = _builders(g, plan, i)
        new = add_lowrank_update(
            op, const, cur, row, plan["slot"], basis=plan["basis"][i],
            block_size=plan["block_size"],
        )  # fmt: skip
    elif minmax:
        hi = g.op("Slice", [cur, g.const([0]), g.const([kd]), g.const([1])])
        lo = g.op("Slice", [cur, g.const([kd]), g.const([2 * kd]), g.const([1])])
        hi = g.op("Max", [g.op("Where", [fresh, hi_fill, hi]), row])
        lo = g.op("Min", [g.op("Where", [fresh, lo_fill, lo]), row])
        new = g.op("Concat", [hi, lo], axis=1)
    else:
        new = g.op("Add", [g.op("Where", [fresh, lo_fill, cur]), row])
    idx = g.op("Unsqueeze", [plan["page"], g.const([1])])  # private pages: no duplicates
    g.nodes.append(helper.make_node("ScatterND", [reps_in, idx, new], [reps_out]))


def _page_scores(
    g: Graph, plan: dict, q: str, reps_out: str, kvh: int, group: int, d: int, i: int = 0
) -> str:
    """R5 scores ``[B, W]`` of every page of the row's table, -inf off the candidates.
    lowrank: per query head h, softmax over the candidates of the logsumexp over a
    page's keys of ``scale * (q_h P) . (k P)`` (P the layer's basis), summed over heads;
    mass: the same softmax of ``scale * q_h . (sum / BS)``, summed over heads; with q
    summed over each GQA group (float32), minmax ``[relu(q), -relu(-q)] . [max, min]``,
    mean ``q . (sum / BS)``."""
    from pytrt_kv.retrieval.config import LOWRANK, MASS, MINMAX  # noqa: PLC0415

    from ..retrieval import (  # noqa: PLC0415
        add_lowrank_scores,
        add_representation_scores,
    )

    kd = kvh * d
    reps = g.op("Gather", [reps_out, "block_tables"], axis=0)  # [B, W, width]
    neg = g.const(np.float32(-np.inf), np.float32)
    if plan["rep"] in (LOWRANK, MASS):
        op, const = _builders(g, plan, i)
        qh = g.to_float(g.op("Reshape", [q, g.const([0, kvh * group, d])]))  # [B, Hq, D]
        if plan["rep"] == LOWRANK:
            scores = add_lowrank_scores(
                op, const, reps, qh, basis=plan["basis"][i], block_size=plan["block_size"],
                q_heads=kvh * group, scale=plan["scale"], valid=plan["softmax_valid"],
            )  # fmt: skip
        else:
            means = g.op("Mul", [reps, g.const(np.float32(1.0 / plan["block_size"]), np.float32)])
            scores = add_representation_scores(
                op, const, MASS, means, qh, kv_heads=kvh, q_heads=kvh * group, head_dim=d,
                scale=plan["scale"], valid=plan["softmax_valid"],
            )  # fmt: skip
        return g.op("Where", [plan["candidate"], scores, neg])
    qf = g.to_float(g.op("Reshape", [q, g.const([0, kvh, group, d])]))
    qsum = g.op("Reshape", [g.op("ReduceSum", [qf, g.const([2])], keepdims=0), g.const([0, kd])])
    if plan["rep"] == MINMAX:
        qq = g.op(
            "Concat",
            [g.op("Relu", [qsum]), g.op("Neg", [g.op("Relu", [g.op("Neg", [qsum])])])],
            axis=1,
        )
    else:
        qq = qsum
        reps = g.op("Mul", [reps, g.const(np.float32(1.0 / plan["block_size"]), np.float32)])
    scores = g.op("MatMul", [reps, g.op("Unsqueeze", [qq, g.const([2])])])
    return g.op("Where", [plan["candidate"], g.op("Squeeze", [scores, g.const([2])]), neg])


def select_and_gather(
    g: Graph,
    plan: dict,
    q: str,
    kc_out: str,
    vc_out: str,
    reps_out: str,
    i: int,
    kvh: int,
    group: int,
    d: int,
) -> tuple[list[str], str]:
    """R4/R5 selection of layer i and its GatherSelectionKvCache; returns the selection
    caches (keys, values) after the gather and the rows' token counts."""
    W, kd = plan["max_pages"], kvh * d
    scores = _page_scores(g, plan, q, reps_out, kvh, group, d, i)
    include = plan["always"]
    if plan["kmax"]:
        # Top ksel[b] candidates, descending, ties to the lower page (ONNX TopK, R4).
        _, idx = g.op(
            "TopK", [scores, g.const([plan["kmax"]])], n_out=2, axis=1, largest=1, sorted=1
        )
        rank = g.op("Range", [g.const(0), g.const(plan["kmax"]), g.const(1)])
        keep = g.op("Less", [rank, g.op("Unsqueeze", [plan["ksel"], g.const([1])])])
        ids = g.op("Where", [keep, idx, g.const(-1)])  # [B, kmax]
        hit = g.op("Equal", [g.op("Unsqueeze", [ids, g.const([2])]), plan["w"]])  # [B, kmax, W]
        chosen = g.op(
            "ReduceMax", [g.op("Cast", [hit], to=TensorProto.INT32)], axes=[1], keepdims=0
        )
        include = g.op("Or", [include, g.op("Cast", [chosen], to=TensorProto.BOOL)])
    # The included pages in ascending order, padded with -1: top-K of (W - w) where included.
    sel_k = plan["sel_k"]
    key = g.op(
        "Cast",
        [g.op("Where", [include, g.op("Sub", [g.const(W), plan["w"]]), g.const(0)])],
        to=TensorProto.FLOAT,
    )
    vals, cols = g.op("TopK", [key, g.const([sel_k])], n_out=2, axis=1, largest=1, sorted=1)
    ids = g.op(
        "Where", [g.op("Greater", [vals, g.const(np.float32(0), np.float32)]), cols, g.const(-1)]
    )
    ids = g.op("Unsqueeze", [g.op("Cast", [ids], to=TensorProto.INT32), g.const([1])])
    full = [g.op("Reshape", [c, g.const([0, 0, kd])]) for c in (vc_out, kc_out)]
    outs = [f"sel_value_{i}_out", f"sel_key_{i}_out", f"sel_status_{i}_out", f"sel_len_{i}"]
    g.nodes.append(
        helper.make_node(
            specs.GATHER_SELECTION_KV_CACHE.name,
            [
                f"sel_value_{i}",
                f"sel_key_{i}",
                "sel_block_tables",
                f"sel_status_{i}",
                ids,
                full[0],
                full[1],
                "block_tables",
                "seq_lens",
                plan["q_cum"],
            ],
            outs,
            name=f"gather_{i}",
            domain=specs.DOMAIN,
            selection_topk_block_size=plan["block_size"],
            alias_io=1,
            **specs.PLUGIN_NODE_ATTRIBUTES,
        )
    )
    return [outs[1], outs[0]], outs[3]
