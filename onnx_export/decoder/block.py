"""The per-layer writers shared by every family: the attention projections (biases,
fused q/k/v, q/k RMSNorm, RoPE), the paged-cache write (``ScatterPaKvCache``), the
attention (prefill: over the batch's own fresh keys/values; decode: over the pages of
each sequence) with causal and sliding-window masks, and the MLP."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from onnx import TensorProto, helper

from pytrt_kv.contract import specs

from .graph import Graph
from .spec import DecoderSpec

#: Name of the graph weight of a state-dict key, transposed for MatMul unless told.
WeightFn = Callable[..., str]


def rope_tables(model: Any, s: DecoderSpec) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin ``[max_positions, rotary_dim]`` float32 as transformers computes them:
    the model's own inverse frequencies (every RoPE type's init function ran there),
    positions times them in float32, the halves repeated, times its attention scaling."""
    rot = None
    for m in model.modules():
        if hasattr(m, "inv_freq") and hasattr(m, "attention_scaling"):
            rot = m
            break
    if rot is None:
        raise ValueError("model: expected a rotary embedding module (inv_freq), found none")
    inv = getattr(rot, "original_inv_freq", None)
    inv = (rot.inv_freq if inv is None else inv).detach().float().cpu().numpy()
    if 2 * inv.shape[0] != s.rotary_dim:
        raise NotImplementedError(
            f"model: its rotary embedding rotates {2 * inv.shape[0]} dims, the config says "
            f"{s.rotary_dim} (head_dim x partial_rotary_factor)"
        )
    pos = np.arange(s.max_positions, dtype=np.float32)
    freqs = np.outer(pos, inv.astype(np.float32)).astype(np.float32)
    emb = np.concatenate([freqs, freqs], axis=-1)
    scaling = np.float32(rot.attention_scaling)
    return (np.cos(emb) * scaling).astype(np.float32), (np.sin(emb) * scaling).astype(np.float32)


def _split_heads(g: Graph, x: str, d: int) -> str:
    return g.op("Reshape", [x, g.const([0, -1, d])])


def attention_inputs(
    g: Graph, s: DecoderSpec, x: str, p: str, w: WeightFn, cos: str, sin: str
) -> tuple[str, str, str]:
    """q ``[T, Hq, D]``, k and v ``[T, Hkv, D]`` of layer prefix ``p`` (RoPE applied)."""
    d = s.head_dim
    a = p + "self_attn."
    if s.fused_qkv:
        qkv = g.linear(x, w(a + "qkv_proj.weight"))
        sizes = g.const([s.heads * d, s.kv_heads * d, s.kv_heads * d])
        q, k, v = g.op("Split", [qkv, sizes], n_out=3, axis=-1)
    else:
        q, k, v = (
            g.linear(
                x, w(f"{a}{n}_proj.weight"), w(f"{a}{n}_proj.bias", False) if s.qkv_bias else None
            )
            for n in ("q", "k", "v")
        )
    q, k, v = (_split_heads(g, t, d) for t in (q, k, v))
    if s.qk_norm:
        q = g.rms_norm(q, w(a + "q_norm.weight", False), s.eps)
        k = g.rms_norm(k, w(a + "k_norm.weight", False), s.eps)
    return g.rope(q, cos, sin, s.rotary_dim, d), g.rope(k, cos, sin, s.rotary_dim, d), v


def scatter(g: Graph, i: int, k: str, v: str, fp8: bool) -> tuple[str, str]:
    """Write layer i's keys and values into its paged caches (in place)."""
    kc_out, vc_out = f"key_cache_{i}_out", f"value_cache_{i}_out"
    g.nodes.append(
        helper.make_node(
            specs.SCATTER_PA_KV_CACHE.name,
            [k, v, f"key_cache_{i}", f"value_cache_{i}", "slot_mapping"]
            + (["", "", "", f"k_scale_{i}", f"v_scale_{i}"] if fp8 else []),
            [kc_out, vc_out],
            name=f"scatter_{i}",
            domain=specs.DOMAIN,
            cache_layout="nd",
            alias_io=1,
            **specs.PLUGIN_NODE_ATTRIBUTES,
        )
    )
    return kc_out, vc_out


def mask_bias(g: Graph, visible: str, shape_axes: list[int]) -> str:
    """0 where ``visible``, -inf elsewhere, in the activation dtype, unsqueezed."""
    vis = g.op("Unsqueeze", [visible, g.const(shape_axes)])
    neg = g.const(np.asarray(-np.inf, np.float32).astype(g.dt), g.dt)
    return g.op("Where", [vis, g.fconst(0.0), neg])


def prefill_masks(g: Graph, windows: set[int | None]) -> dict[int | None, str]:
    """Per window, the additive bias ``[1, 1, T, T]`` of the prefill's fresh attention:
    token t sees token u of its own sequence with ``pos[u] <= pos[t]`` (and
    ``pos[u] > pos[t] - window``)."""
    unsq = g.const([1])
    col = g.op("Unsqueeze", ["positions", unsq])  # [T, 1]
    same = g.op("Equal", [g.op("Unsqueeze", ["token_batch", unsq]), "token_batch"])
    causal = g.op("And", [same, g.op("LessOrEqual", ["positions", col])])  # [T(q), T(k)]
    out = {}
    for win in windows:
        vis = causal
        if win is not None:
            vis = g.op(
                "And", [vis, g.op("Greater", ["positions", g.op("Sub", [col, g.const(win)])])]
            )
        out[win] = mask_bias(g, vis, [0, 1])
    return out


def decode_masks(g: Graph, windows: set[int | None], span: str) -> dict[int | None, str]:
    """Per window, the bias ``[B, 1, 1, L]`` over the ``L = W * BS`` positions of each
    sequence's pages: ``j < seq_lens[b]`` (and ``j >= seq_lens[b] - window``)."""
    j = g.op("Range", [g.const(0), g.op("Squeeze", [span, g.const([0])]), g.const(1)])
    lens = g.op("Unsqueeze", [g.op("Cast", ["seq_lens"], to=TensorProto.INT64), g.const([1])])
    causal = g.op("Less", [j, lens])  # [B, L]
    out = {}
    for win in windows:
        vis = causal
        if win is not None:
            vis = g.op("And", [vis, g.op("GreaterOrEqual", [j, g.op("Sub", [lens, g.const(win)])])])
        out[win] = mask_bias(g, vis, [1, 2])
    return out


def _softmax_av(g: Graph, scores: str, v: str) -> str:
    """softmax in float32 (as transformers' eager attention), back to the activation
    dtype, times v."""
    probs = g.to_act(g.op("Softmax", [g.to_float(scores)], axis=-1))
    return g.op("MatMul", [probs, v])


def attend_fresh(g: Graph, s: DecoderSpec, q: str, k: str, v: str, bias: str) -> str:
    """Prefill attention over the batch's own keys/values: q ``[T, Hq, D]``, k, v
    ``[T, Hkv, D]``, bias ``[1, 1, T, T]`` -> ``[T, Hq*D]``. Memory: the scores
    ``[Hkv, G, T, T]`` (three per layer: product, masked, softmax), never a gathered copy
    of the pages per token (``[T, W*BS, Hkv*D]``, what this graph did before)."""
    d, kvh, grp = s.head_dim, s.kv_heads, s.group
    # The scale goes on q (linear in T), not on the [.., T, T] scores: one T x T tensor
    # less to make (the CPU runtime holds the live ones of one layer at a time).
    q = g.op("Mul", [q, g.fconst(1.0 / np.sqrt(d))])
    qg = g.op("Transpose", [g.op("Reshape", [q, g.const([0, kvh, grp, d])])], perm=[1, 2, 0, 3])
    kt = g.op("Unsqueeze", [g.op("Transpose", [k], perm=[1, 2, 0]), g.const([1])])  # [Hkv,1,D,T]
    vt = g.op("Unsqueeze", [g.op("Transpose", [v], perm=[1, 0, 2]), g.const([1])])  # [Hkv,1,T,D]
    out = _softmax_av(g, g.op("Add", [g.op("MatMul", [qg, kt]), bias]), vt)  # [Hkv, G, T, D]
    out = g.op("Transpose", [out], perm=[2, 0, 1, 3])
    return g.op("Reshape", [out, g.const([0, s.heads * d])])


def attend_pages(g: Graph, s: DecoderSpec, q: str, pages: list[str], bias: str) -> str:
    """Decode attention of q ``[B, Hq, D]`` over key/value pages ``[B, P, BS, ...]``
    (flattened to L tokens) with bias ``[B, 1, 1, L]`` -> ``[B, Hq*D]``."""
    d, kvh = s.head_dim, s.kv_heads
    kk, vv = (
        g.op("Transpose", [g.op("Reshape", [pg, g.const([0, -1, kvh, d])])], perm=[0, 2, 1, 3])
        for pg in pages
    )
    qg = g.op("Reshape", [q, g.const([0, kvh, s.group, d])])  # [B, Hkv, G, D]
    scores = g.op("MatMul", [qg, g.op("Transpose", [kk], perm=[0, 1, 3, 2])])
    scores = g.op("Mul", [scores, g.fconst(1.0 / np.sqrt(d))])
    out = _softmax_av(g, g.op("Add", [scores, bias]), vv)
    return g.op("Reshape", [out, g.const([0, s.heads * d])])


def mlp(g: Graph, s: DecoderSpec, x: str, p: str, w: WeightFn) -> str:
    """down(act(gate(x)) * up(x)), fused gate/up for Phi-3, biases with ``mlp_bias``."""
    m = p + "mlp."
    if s.fused_gate_up:
        both = g.linear(x, w(m + "gate_up_proj.weight"))
        gate, up = g.op(
            "Split", [both, g.const([s.intermediate, s.intermediate])], n_out=2, axis=-1
        )
    else:
        gate, up = (
            g.linear(
                x, w(f"{m}{n}_proj.weight"), w(f"{m}{n}_proj.bias", False) if s.mlp_bias else None
            )
            for n in ("gate", "up")
        )
    act = g.op("Mul", [g.act(gate, s.act), up])
    return g.linear(
        act, w(m + "down_proj.weight"), w(m + "down_proj.bias", False) if s.mlp_bias else None
    )
