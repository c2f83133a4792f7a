"""``export_decoder``: the prefill or decode graph of a transformers decoder over paged
KV caches (the inputs and outputs: docs/LLAMA.md "The graphs"; the families and their
fields: docs/YOUR_MODEL.md "Families")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from pytrt_kv.contract import specs

from ..models import finalize_model
from . import block, sparse
from .families import decoder_spec
from .graph import Graph, dtype_of
from .spec import DecoderSpec

KV_CACHE_DTYPES = ("float32", "fp8")


@dataclass
class _Ctx:
    """What every layer of one graph shares."""

    g: Graph
    s: DecoderSpec
    decode: bool
    fp8: bool
    block_size: int
    w: Any
    cos: str = ""
    sin: str = ""
    masks: dict = field(default_factory=dict)
    table: str = "block_tables"
    plan: dict | None = None
    sel_k: int = 0
    outputs: list = field(default_factory=list)


def _inputs(
    s: DecoderSpec,
    decode: bool,
    fp8: bool,
    block_size: int,
    retrieval: Any,
    max_pages: Any,
    act: int,
) -> list[onnx.ValueInfoProto]:
    i64, i32, f32 = TensorProto.INT64, TensorProto.INT32, TensorProto.FLOAT
    vi = helper.make_tensor_value_info
    tokens = "B" if decode else "T"
    out = [vi("input_ids", i64, [tokens]), vi("positions", i64, [tokens])]
    if not decode:
        out.append(vi("token_batch", i64, ["T"]))
    width: Any = max_pages if (retrieval is not None and decode) else "W"
    out += [vi("slot_mapping", i32, [tokens]), vi("block_tables", i32, ["B", width])]
    out.append(vi("seq_lens", i32, ["B"]) if decode else vi("last_token", i64, ["B"]))
    cache_type = TensorProto.FLOAT8E4M3FN if fp8 else act
    shape: list[Any] = ["NB", block_size, s.kv_heads, s.head_dim]
    out += [
        vi(f"{k}_cache_{i}", cache_type, shape) for i in range(s.layers) for k in ("key", "value")
    ]
    if fp8:
        out += [vi(f"{k}_scale_{i}", f32, [s.kv_heads]) for i in range(s.layers) for k in "kv"]
    if retrieval is not None:
        width_r = sparse.reps_width(retrieval, s.kv_heads, s.head_dim)
        out += [vi(f"key_reps_{i}", f32, ["NB", width_r]) for i in range(s.layers)]
    if retrieval is not None and decode:
        sel_k = sparse.selection_width(retrieval, max_pages)
        out.append(vi("sel_block_tables", i32, ["B", sel_k]))
        for i in range(s.layers):
            out += [
                vi(f"sel_key_{i}", act, ["SNB", block_size, s.kd]),
                vi(f"sel_value_{i}", act, ["SNB", block_size, s.kd]),
                vi(f"sel_status_{i}", i32, ["B", 1, sel_k + 1]),
            ]
    return out


def _layer(c: _Ctx, i: int, h: str, retrieval: Any) -> str:
    """Layer i of the residual stream ``h``: attention (paged cache) and MLP."""
    g, s = c.g, c.s
    p = f"model.layers.{i}."
    x = g.rms_norm(h, c.w(p + "input_layernorm.weight", False), s.eps, s.norm_offset)
    q, k, v = block.attention_inputs(g, s, x, p, c.w, c.cos, c.sin)
    kc_out, vc_out = block.scatter(g, i, k, v, c.fp8)
    cache_type = TensorProto.FLOAT8E4M3FN if c.fp8 else g.onnx_dt
    shape: list[Any] = ["NB", c.block_size, s.kv_heads, s.head_dim]
    vi = helper.make_tensor_value_info
    c.outputs += [vi(kc_out, cache_type, shape), vi(vc_out, cache_type, shape)]
    win = s.windows[i]
    if c.plan is not None:
        reps_out = f"key_reps_{i}_out"
        sparse.update_reps(g, c.plan, k, kc_out, f"key_reps_{i}", reps_out, s.kd, i)
        width = sparse.reps_width(retrieval, s.kv_heads, s.head_dim)
        c.outputs.append(vi(reps_out, TensorProto.FLOAT, ["NB", width]))
    if not c.decode:
        attn = block.attend_fresh(g, s, q, k, v, c.masks[win])
    elif c.plan is not None:
        sel, sel_len = sparse.select_and_gather(
            g, c.plan, q, kc_out, vc_out, reps_out, i, s.kv_heads, s.group, s.head_dim
        )
        sel_shape: list[Any] = ["SNB", c.block_size, s.kd]
        c.outputs += [
            vi(f"sel_value_{i}_out", g.onnx_dt, sel_shape),
            vi(f"sel_key_{i}_out", g.onnx_dt, sel_shape),
            vi(f"sel_status_{i}_out", TensorProto.INT32, ["B", 1, c.sel_k + 1]),
        ]
        # Attention over the selection: row b's valid tokens are [0, sel_len[b]).
        pages = [g.op("Gather", [t, "sel_block_tables"], axis=0) for t in sel]
        sj = g.op("Range", [g.const(0), g.const(c.sel_k * c.block_size), g.const(1)])
        lens = g.op("Unsqueeze", [g.op("Cast", [sel_len], to=TensorProto.INT64), g.const([1])])
        attn = block.attend_pages(
            g, s, q, pages, block.mask_bias(g, g.op("Less", [sj, lens]), [1, 2])
        )
    else:
        caches = [kc_out, vc_out]
        if c.fp8:
            # float(q) * scale[h] with DequantizeLinear, the one consumer TensorRT allows
            # an FP8 tensor besides plugins and copies (so the whole cache).
            caches = [
                g.op("DequantizeLinear", [t, sc], axis=2)
                for t, sc in zip(caches, (f"k_scale_{i}", f"v_scale_{i}"))
            ]
        pages = [g.op("Gather", [t, c.table], axis=0) for t in caches]
        attn = block.attend_pages(g, s, q, pages, c.masks[win])
    o_bias = c.w(p + "self_attn.o_proj.bias", False) if s.o_bias else None
    h = g.op("Add", [h, g.linear(attn, c.w(p + "self_attn.o_proj.weight"), o_bias)])
    x = g.rms_norm(h, c.w(p + "post_attention_layernorm.weight", False), s.eps, s.norm_offset)
    return g.op("Add", [h, block.mlp(g, s, x, p, c.w)])


def _check_args(block_size: Any, kv_cache_dtype: str, dtype: str) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size: expected an int >= 1, got {block_size!r}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: expected 'float32' or 'fp8', got {kv_cache_dtype!r}")
    dtype_of(dtype)
    if kv_cache_dtype == "fp8" and dtype != "float32":
        raise ValueError(f"kv_cache_dtype: 'fp8' caches need dtype 'float32', got {dtype!r}")


def export_decoder(
    model: Any,
    *,
    block_size: int = 16,
    decode: bool = False,
    kv_cache_dtype: str = "float32",
    retrieval: Any = None,
    max_pages: int | None = None,
    dtype: str = "float32",
    held: dict[str, np.ndarray] | None = None,
    basis: Any = None,
) -> onnx.ModelProto:
    """The prefill (``decode=False``) or decode graph of ``model`` (a transformers causal
    LM of a family in ``families.FAMILIES``); both name their weights alike (the
    state-dict names). ``dtype``: weights, activations and caches (float32, float16,
    bfloat16; norms, softmax and RoPE tables in float32 as transformers computes them).

    ``kv_cache_dtype="fp8"``: float8 e4m3 caches, quantised on write (docs/SPEC.md S9)
    with per-head scales as inputs ``k_scale_<i>``/``v_scale_<i>`` ``[H_kv]``.
    ``retrieval`` (a ``RetrievalConfig``): the RetrievalKV variant (docs/LLAMA.md
    "Sparse decode"); needs ``block_size == retrieval.block_size`` and, for the decode
    graph, the static block-table width ``max_pages``. Every unsupported config field or
    argument is refused here, before any weight is read.

    ``basis``: with ``retrieval.representation == "lowrank"`` (and only then), the
    model's basis, one float32 array ``[kv_heads, head_dim, retrieval.rank]`` per layer
    (``pytrt_kv.retrieval.study.calibration.calibrate_lowrank``); each becomes the
    constant ``lowrank_basis_<i>`` of the graph (``retrieval.rank <= head_dim``).

    ``held``: a dict that receives the weights of 64 KiB or more (the graph declares
    them with ``location`` ``graph.IN_RUNNER``); the runner passes one dict to both
    graphs, so the weights are held once."""
    _check_args(block_size, kv_cache_dtype, dtype)
    s = decoder_spec(model.config)
    fp8 = kv_cache_dtype == "fp8"
    if retrieval is not None:
        sparse.check_retrieval(retrieval, block_size, decode, max_pages, fp8, s.windows)
    bases = sparse.check_basis(retrieval, basis, s.layers, s.kv_heads, s.head_dim)
    g = Graph(dtype, held)
    sd = model.state_dict()  # tensors converted one at a time, as each is written

    def w(key: str, transpose: bool = True) -> str:
        if key not in sd:
            raise ValueError(f"model: expected the weight {key!r} for family {s.family!r}")
        a = sd[key].detach().float().numpy().astype(g.dt, copy=False)
        return g.weight(key.replace(".", "_"), a.T if transpose else a)

    c = _Ctx(g=g, s=s, decode=decode, fp8=fp8, block_size=block_size, w=w)
    inputs = _inputs(s, decode, fp8, block_size, retrieval, max_pages, g.onnx_dt)
    cos_t, sin_t = block.rope_tables(model, s)
    c.cos, c.sin = (
        g.op(
            "Unsqueeze",
            [g.op("Gather", [g.weight(n, t.astype(g.dt)), "positions"], axis=0), g.const([1])],
        )
        for n, t in (("rope_cos", cos_t), ("rope_sin", sin_t))
    )
    if decode:
        span = g.op("Mul", [g.op("Shape", ["block_tables"], start=1, end=2), g.const([block_size])])
        c.masks = block.decode_masks(g, set(s.windows), span)
    else:
        c.masks = block.prefill_masks(g, set(s.windows))
    if retrieval is not None:
        c.plan = sparse.retrieval_plan(
            g, retrieval, block_size, decode, max_pages, bases, s.head_dim
        )
        c.sel_k = sparse.selection_width(retrieval, max_pages) if decode else 0
    embed = w("model.embed_tokens.weight", False)
    h = g.op("Gather", [embed, "input_ids"], axis=0)  # [T, hidden]
    if s.embed_scale is not None:
        h = g.op("Mul", [h, g.fconst(s.embed_scale)])
    for i in range(s.layers):
        h = _layer(c, i, h, retrieval)
    h = g.rms_norm(h, w("model.norm.weight", False), s.eps, s.norm_offset)
    if not decode:
        h = g.op("Gather", [h, "last_token"], axis=0)  # [B, hidden]
    # Tied embeddings: the head reuses the embedding table, transposed by Gemm.
    head = embed if (s.tied or "lm_head.weight" not in sd) else w("lm_head.weight", False)
    logits = g.to_float(g.op("Gemm", [h, head], transB=1))
    g.nodes.append(helper.make_node("Identity", [logits], ["logits"]))
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", s.vocab])]
    name = f"{s.family}_{'sparse_' if retrieval is not None else ''}"
    graph = helper.make_graph(
        g.nodes, name + ("decode" if decode else "prefill"), inputs, outputs + c.outputs, g.inits
    )
    # DequantizeLinear takes float8 from opset 19; bfloat16 Cast/MatMul need opset 13+.
    opset = max(specs.ONNX_OPSET, 19) if fp8 else specs.ONNX_OPSET
    proto = helper.make_model(
        graph,
        opset_imports=[
            helper.make_opsetid("", opset),
            helper.make_opsetid(specs.DOMAIN, specs.DOMAIN_VERSION),
        ],
    )
    proto.ir_version = specs.ONNX_IR_VERSION
    return finalize_model(proto, check=False)
