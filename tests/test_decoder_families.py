"""Every decoder family of onnx_export.decoder against transformers, with small
random-weight models built from transformers configs in the test (2 layers, hidden <=
256; nothing downloaded): the exported prefill and decode graphs, run on the CPU
runtime for two prompts of different lengths at once, generate transformers' greedy
tokens, with logits within the bound of their dtype (docs/YOUR_MODEL.md "Tolerances");
dense and sparse (RetrievalKV against the study's own attention), float32 and float16.

Skipped, with the reason, where the study extra (torch, transformers) is missing.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None,
    reason="torch/transformers are not installed (the 'study' extra)",
)

PROMPTS = [[5, 9, 17, 33, 2, 7, 11, 40, 3], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]]
TOKENS = 6
SMALL = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
        "original_max_position_embeddings": 32}  # fmt: skip
LLAMA3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}  # fmt: skip

#: (id, config class name, overrides): each family and each implemented field.
CASES = [
    ("llama", "LlamaConfig", {}),
    ("llama-bias-gelu", "LlamaConfig",
     dict(attention_bias=True, mlp_bias=True, hidden_act="gelu")),
    ("llama-mqa-head128-untied", "LlamaConfig",
     dict(num_attention_heads=2, num_key_value_heads=1, head_dim=128, tie_word_embeddings=False)),
    ("llama-mha-tied-gelu-tanh", "LlamaConfig",
     dict(num_key_value_heads=4, tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh")),
    ("llama-quick-gelu", "LlamaConfig", dict(hidden_act="quick_gelu")),
    ("llama-relu", "LlamaConfig", dict(hidden_act="relu")),
    ("llama3-rope", "LlamaConfig", dict(rope_parameters=LLAMA3)),
    ("llama-linear-rope", "LlamaConfig",
     dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0})),
    ("llama-dynamic-rope", "LlamaConfig",
     dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0})),
    ("llama-yarn-rope", "LlamaConfig", dict(rope_parameters=YARN)),
    ("mistral-window-5", "MistralConfig", dict(sliding_window=5)),
    ("mistral-no-window", "MistralConfig", dict(sliding_window=None)),
    ("qwen2", "Qwen2Config", {}),
    ("qwen2-sliding-layer", "Qwen2Config",
     dict(use_sliding_window=True, sliding_window=6, max_window_layers=1)),
    ("qwen3", "Qwen3Config", dict(head_dim=32)),
    ("qwen3-bias", "Qwen3Config", dict(head_dim=16, attention_bias=True)),
    ("gemma", "GemmaConfig", dict(head_dim=16)),
    ("gemma-bias", "GemmaConfig", dict(head_dim=32, attention_bias=True)),
    ("phi3", "Phi3Config", dict(pad_token_id=0)),
    ("phi3-partial-window", "Phi3Config", dict(
        pad_token_id=0, sliding_window=6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})),
]  # fmt: skip
FAMILY_CASES = ["llama", "mistral-window-5", "qwen2", "qwen3", "gemma", "phi3"]


def tiny_model(cls_name: str, dtype: str = "float32", seed: int = 0, **overrides):
    """A random-weight model of the config class (weights large enough that the logits
    are far from uniform)."""
    import torch
    import transformers

    cfg = getattr(transformers, cls_name)(**{**SMALL, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.to(getattr(torch, dtype))


def _compare(runner, dtype: str, reference, prompts=PROMPTS) -> float:
    """Generate PROMPTS; assert the tokens equal the reference's and the logits are within
    the bound of ``dtype`` (``LOGIT_RTOL``; half types: a token may part only at a near
    tie of the reference, the logits compared up to there); return the largest
    difference."""
    from onnx_export.decoder import compare_greedy

    out, _, _ = runner.generate(prompts, TOKENS)
    logits = np.stack(runner.last_logits, axis=1)
    worst = 0.0
    for b, prompt in enumerate(prompts):
        want, want_logits = reference(prompt)
        ok, same, diff, bound = compare_greedy(out[b], logits[b], want, want_logits, dtype)
        assert ok, (b, out[b], want, same, diff, bound)
        worst = max(worst, diff)
    return worst


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_dense_float32_equals_transformers(case):
    from onnx_export.decoder import DecoderRunner, reference_greedy

    _, cls_name, over = case
    model = tiny_model(cls_name, **over)
    runner = DecoderRunner(model, block_size=4, num_blocks=24)
    worst = _compare(runner, "float32", lambda p: reference_greedy(model, p, TOKENS))
    print(f"{case[0]}: float32 logits within {worst:.1e}")


@pytest.mark.parametrize("name", FAMILY_CASES)
def test_dense_float16_equals_transformers(name):
    from onnx_export.decoder import DecoderRunner, reference_greedy

    _, cls_name, over = next(c for c in CASES if c[0] == name)
    model = tiny_model(cls_name, "float16", **over)
    runner = DecoderRunner(model, block_size=4, num_blocks=24, dtype="float16")
    assert runner._caches()["key_cache_0"].dtype == np.float16
    worst = _compare(runner, "float16", lambda p: reference_greedy(model, p, TOKENS))
    print(f"{name}: float16 logits within {worst:.1e}")


def _retrieval(representation: str):
    from pytrt_kv.retrieval.config import RetrievalConfig

    # 4-token pages: init one page, local >= two, a quarter of the pages between recalled.
    return RetrievalConfig(init_tokens=4, local_tokens=8, topk_percent=0.25, block_size=4,
                           dense_boundary=0, offload_boundary=0,
                           representation=representation)  # fmt: skip


#: Long enough that a quarter of the pages between init and local is a real choice.
SPARSE_PROMPTS = [list(range(3, 40)), [(7 * i) % 120 + 3 for i in range(30)]]
SPARSE = [
    ("llama", "minmax", "float32"),
    ("mistral-no-window", "mean", "float32"),
    ("qwen2", "minmax", "float32"),
    ("qwen3", "mean", "float32"),
    ("gemma", "minmax", "float32"),
    ("phi3", "mean", "float32"),
    ("llama", "mean", "float16"),
]


@pytest.mark.parametrize("name, rep, dtype", SPARSE)
def test_sparse_equals_the_retrieval_study(name, rep, dtype):
    """The RetrievalKV graphs ("minmax" and "mean" from the RetrievalConfig) generate the
    tokens of the study's attention on the same model; and the selection matters: the
    dense graph's logits differ by far more than the bound."""
    from onnx_export.decoder import LOGIT_RTOL, DecoderRunner, reference_sparse_greedy

    _, cls_name, over = next(c for c in CASES if c[0] == name)
    model = tiny_model(cls_name, dtype, **over)
    cfg = _retrieval(rep)
    prompts_len = max(map(len, SPARSE_PROMPTS)) + TOKENS
    runner = DecoderRunner(model, block_size=4, num_blocks=40, retrieval=cfg,
                           max_pages=-(-prompts_len // 4), dtype=dtype)  # fmt: skip
    assert runner.decode_graph.graph.input[-1].name.startswith("sel_")
    worst = _compare(runner, dtype,
                     lambda p: reference_sparse_greedy(p, TOKENS, cfg, model=model),
                     SPARSE_PROMPTS)  # fmt: skip
    dense = DecoderRunner(model, block_size=4, num_blocks=40, dtype=dtype)
    dense.generate(SPARSE_PROMPTS, TOKENS)
    gap = np.abs(np.stack(dense.last_logits, 1) - np.stack(runner.last_logits, 1)).max()
    print(f"{name} {rep} {dtype}: sparse within {worst:.1e}, dense vs sparse {gap:.3f}")
    assert gap > 10 * LOGIT_RTOL[dtype] * np.abs(np.stack(runner.last_logits)).max()


def test_saved_graphs_carry_the_weights_the_runner_holds(tmp_path):
    """The runner holds each weight once (its graphs declare them); save_graphs writes
    both graphs with the weights in one shared file, and the saved prefill computes the
    runner's logits."""
    import os

    import onnx

    from onnx_export.decoder import BlockAllocator, DecoderRunner, save_graphs
    from pytrt_kv import runtime

    model = tiny_model("Qwen3Config", head_dim=16, vocab_size=512)  # a 128 KiB table
    runner = DecoderRunner(model, block_size=4, num_blocks=24)
    held = [t.name for t in runner.decode_graph.graph.initializer if t.data_location == 1]
    assert "model_embed_tokens_weight" in held and set(held) <= set(runner.weights)
    prefill, decode = save_graphs(runner, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "decode.onnx",
        "llama_weights.bin",
        "prefill.onnx",
    ]
    _, feeds = runner._prefill_feeds(BlockAllocator(24, 4), PROMPTS)
    want = runner._step(runner._prefill, runner.prefill_graph, dict(feeds), runner._caches())
    got = runtime.run(prefill, {**feeds, **runner._caches()})["logits"]
    assert np.array_equal(got, want)
    assert os.path.getsize(tmp_path / "llama_weights.bin") >= sum(
        a.nbytes for a in runner.weights.values()
    )
    assert all(t.data_location == 1 for t in onnx.load(decode, load_external_data=False)
               .graph.initializer if t.name in runner.weights)  # fmt: skip
