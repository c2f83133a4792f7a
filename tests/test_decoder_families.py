"""Every decoder family of onnx_export.decoder against transformers, with small
random-weight models built from transformers configs in the test (2 layers, hidden <=
256; nothing downloaded): the exported prefill and decode graphs, run on the CPU
runtime for two prompts of different lengths at once, generate transformers' greedy
tokens, with logits within the bound of their dtype (docs/YOUR_MODEL.md "Tolerances");
dense and sparse (RetrievalKV against the study's own attention), each family in float32,
float16 and bfloat16; and each family's graphs build a TensorRT-RTX engine for sm89.

Skipped, with the reason, where the study extra (torch, transformers) is missing (the
engine builds: where the rtx extra or the plugin library is).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from pytrt_kv.contract import specs
from support.env import rtx_unavailable_reason
from support.tiny_models import SMALL, tiny_model

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None,
    reason="torch/transformers are not installed (the 'study' extra)",
)

PROMPTS = [[5, 9, 17, 33, 2, 7, 11, 40, 3], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]]
TOKENS = 6
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


def _compare(runner, dtype: str, reference, prompts=PROMPTS) -> tuple[float, list]:
    """Generate ``prompts``; assert the tokens equal the reference's and the logits are
    within the bound of ``dtype`` (``LOGIT_RTOL``; half types: a token may part only at a
    near tie of the reference, the logits compared up to there); return the largest
    difference and the references (tokens, logits) per prompt."""
    from onnx_export.decoder import compare_greedy

    out, _, _ = runner.generate(prompts, TOKENS)
    logits = np.stack(runner.last_logits, axis=1)
    worst, refs = 0.0, []
    for b, prompt in enumerate(prompts):
        want, want_logits = reference(prompt)
        refs.append((want, want_logits))
        ok, same, diff, bound = compare_greedy(out[b], logits[b], want, want_logits, dtype)
        assert ok, (b, out[b], want, same, diff, bound)
        worst = max(worst, diff)
    return worst, refs


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_dense_float32_equals_transformers(case):
    from onnx_export.decoder import DecoderRunner, reference_greedy

    _, cls_name, over = case
    model = tiny_model(cls_name, **over)
    runner = DecoderRunner(model, block_size=4, num_blocks=24)
    worst, _ = _compare(runner, "float32", lambda p: reference_greedy(model, p, TOKENS))
    print(f"{case[0]}: float32 logits within {worst:.1e}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", FAMILY_CASES)
def test_dense_half_types_equal_transformers(name, dtype):
    """Weights, activations and caches in the half type, against transformers running
    the model in that type."""
    import ml_dtypes
    from onnx import TensorProto

    from onnx_export.decoder import DecoderRunner, reference_greedy

    _, cls_name, over = next(c for c in CASES if c[0] == name)
    model = tiny_model(cls_name, dtype, **over)
    runner = DecoderRunner(model, block_size=4, num_blocks=24, dtype=dtype)
    want = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
    assert runner._caches()["key_cache_0"].dtype == want
    embed = next(t for t in runner.prefill_graph.graph.initializer
                 if t.name == "model_embed_tokens_weight")  # fmt: skip
    assert embed.data_type == {"float16": TensorProto.FLOAT16,
                               "bfloat16": TensorProto.BFLOAT16}[dtype]  # fmt: skip
    worst, _ = _compare(runner, dtype, lambda p: reference_greedy(model, p, TOKENS))
    print(f"{name}: {dtype} logits within {worst:.1e}")


def _retrieval(representation: str):
    from pytrt_kv.retrieval.config import RetrievalConfig

    # 4-token pages: init one page, local >= two, a quarter of the pages between recalled;
    # "lowrank" keeps LOWRANK_RANK numbers per key and KV head (every head_dim is >= 16).
    return RetrievalConfig(init_tokens=4, local_tokens=8, topk_percent=0.25, block_size=4,
                           dense_boundary=0, offload_boundary=0,
                           representation=representation, rank=LOWRANK_RANK)  # fmt: skip


LOWRANK_RANK = 8


def _lowrank_basis(model) -> list:
    """The tiny model's "lowrank" basis: calibrated (as ``pytrt-kv generate`` does on
    its calibration text) on 160 random token ids, the first 32 left out."""
    from pytrt_kv.retrieval.study.calibration import calibrate_lowrank

    ids = np.random.default_rng(1).integers(0, SMALL["vocab_size"], 160)
    return calibrate_lowrank(model, ids, LOWRANK_RANK, skip=32)


#: Long enough that a quarter of the pages between init and local is a real choice.
SPARSE_PROMPTS = [list(range(3, 40)), [(7 * i) % 120 + 3 for i in range(30)]]
SPARSE_FAMILIES = ["llama", "mistral-no-window", "qwen2", "qwen3", "gemma", "phi3"]
SPARSE_DTYPES = ("float32", "float16", "bfloat16")
#: Every family in every dtype (one representation per family and dtype): "lowrank"
#: (the default) once per family, twice per dtype; "mean", "minmax" and "mass" four
#: times each, each in every dtype. Not here, a near tie rather than an error: phi3
#: "lowrank" in bfloat16 (one step selects another page, logits off by 0.23, the
#: tokens equal).
SPARSE_TABLE = {
    "llama": ("lowrank", "mean", "mass"),
    "mistral-no-window": ("minmax", "lowrank", "mean"),
    "qwen2": ("mass", "minmax", "lowrank"),
    "qwen3": ("mean", "mass", "lowrank"),
    "gemma": ("minmax", "lowrank", "minmax"),
    "phi3": ("lowrank", "mass", "mean"),
}
SPARSE = [
    (name, SPARSE_TABLE[name][j], dtype)
    for j, dtype in enumerate(SPARSE_DTYPES)
    for name in SPARSE_FAMILIES
]


@pytest.mark.parametrize("name, rep, dtype", SPARSE)
def test_sparse_equals_the_retrieval_study(name, rep, dtype):
    """The RetrievalKV graphs (each R5 representation of the RetrievalConfig; "lowrank"
    with the basis calibrated on the model, the same for graphs and study) generate the
    tokens of the study's attention on the same model; and the selection matters: the
    dense graph's tokens and logits fail the same comparison."""
    from onnx_export.decoder import DecoderRunner, compare_greedy, reference_sparse_greedy

    _, cls_name, over = next(c for c in CASES if c[0] == name)
    model = tiny_model(cls_name, dtype, **over)
    cfg = _retrieval(rep)
    basis = _lowrank_basis(model) if rep == "lowrank" else None
    prompts_len = max(map(len, SPARSE_PROMPTS)) + TOKENS
    runner = DecoderRunner(model, block_size=4, num_blocks=40, retrieval=cfg,
                           max_pages=-(-prompts_len // 4), dtype=dtype, basis=basis)  # fmt: skip
    assert runner.decode_graph.graph.input[-1].name.startswith("sel_")
    worst, refs = _compare(runner, dtype,
                           lambda p: reference_sparse_greedy(p, TOKENS, cfg, model=model,
                                                             basis=basis),
                           SPARSE_PROMPTS)  # fmt: skip
    dense = DecoderRunner(model, block_size=4, num_blocks=40, dtype=dtype)
    out, _, _ = dense.generate(SPARSE_PROMPTS, TOKENS)
    logits = np.stack(dense.last_logits, 1)
    dense_ok = [compare_greedy(out[b], logits[b], *refs[b], dtype)[0] for b in range(len(out))]
    gap = np.abs(logits - np.stack(runner.last_logits, 1)).max()
    print(f"{name} {rep} {dtype}: sparse within {worst:.1e}, dense vs sparse {gap:.3f}")
    assert not all(dense_ok), dense_ok


def test_sparse_covers_every_representation_family_and_dtype():
    """The rotation above: "lowrank" meets every family, each representation every
    dtype."""
    from pytrt_kv.retrieval.config import REPRESENTATIONS

    assert {n for n, r, _ in SPARSE if r == "lowrank"} == set(SPARSE_FAMILIES)
    for rep in REPRESENTATIONS:
        assert {d for _, r, d in SPARSE if r == rep} == set(SPARSE_DTYPES), rep


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(basis=None), r"basis: expected the 'lowrank' basis, one float32 array \[2, 16, 8\]"),
        (dict(basis="short"), "basis: expected a list of 2 arrays"),
        (dict(basis=[np.zeros((2, 16, 4), np.float32)] * 2),
         r"basis\[0\]: expected shape \[2, 16, 8\]"),
        (dict(basis=[np.eye(16, 8, dtype=np.float32)[None].repeat(2, 0),
                     np.full((2, 16, 8), np.nan, np.float32)]),
         r"basis\[1\]: expected finite values"),
        (dict(rank=17), "retrieval.rank: expected <= head_dim = 16"),
        (dict(representation="mean", basis=[np.zeros((2, 16, 8), np.float32)] * 2),
         "basis: expected None"),
    ],
)  # fmt: skip
def test_sparse_lowrank_refuses_a_bad_basis_by_name(kw, match):
    """A "lowrank" export needs the model's basis (one [Hkv, D, r] array per layer,
    finite) and ``rank <= head_dim``; refused by name before any weight is read."""
    import dataclasses

    from onnx_export.decoder import export_decoder

    model = tiny_model("LlamaConfig")
    kw = dict(kw)
    basis = kw.pop("basis", None)
    cfg = dataclasses.replace(_retrieval("lowrank"), **kw)

    def no_weights():
        raise AssertionError("a weight was read")

    model.state_dict = no_weights
    for decode in (False, True):
        with pytest.raises(ValueError, match=match):
            export_decoder(model, block_size=4, decode=decode, retrieval=cfg, max_pages=8,
                           basis=basis)  # fmt: skip


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


#: One family per row, the dtypes spread over them (the family's nodes are the same in
#: each dtype but for the casts; each dtype is built twice).
RTX_BUILDS = [("llama", "float32"), ("mistral-window-5", "float16"), ("qwen2", "bfloat16"),
              ("qwen3", "float32"), ("gemma", "float16"), ("phi3", "bfloat16")]  # fmt: skip


@pytest.mark.skipif(bool(rtx_unavailable_reason()), reason=rtx_unavailable_reason() or "-")
def test_every_family_builds_with_tensorrt_rtx(tmp_path):
    """Each family's prefill and decode graphs (the graphs differ per family: fused or
    separate projections, biases, q/k norms, the Gemma norm, partial RoPE, window masks)
    build a TensorRT-RTX engine for sm89 on this CPU-only machine, every layer's
    ScatterPaKvCache plugin in it. Small graphs (2 layers, hidden 64): about 1 s a
    build; SmolLM2's real-size builds are tests/test_llama.py's."""
    from onnx_export.decoder import DecoderRunner, save_graphs
    from pytrt_kv.trt import build_plan

    dims = {"B": (1, 2, 4), "W": (1, 2, 4), "NB": (8, 8, 8)}
    for name, dtype in RTX_BUILDS:
        _, cls_name, over = next(c for c in CASES if c[0] == name)
        model = tiny_model(cls_name, dtype, **over)
        runner = DecoderRunner(model, block_size=4, num_blocks=8, dtype=dtype)
        prefill, decode = save_graphs(runner, tmp_path / name)
        for path, extra in ((prefill, {"T": (1, 8, 16)}), (decode, {})):
            plan = build_plan(path, flavour="rtx", targets=["sm89"], dims={**dims, **extra})
            assert specs.SCATTER_PA_KV_CACHE.name.encode() in plan, (name, path)
            assert all(f"scatter_{i}".encode() in plan for i in range(2)), (name, path)


def _save_tokenizer(folder, vocab: int = 128) -> None:
    """A word-level tokenizer ("w0 w1 ..." -> ids), made offline, saved as a model's."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab - 1)}
    words["[UNK]"] = vocab - 1
    raw = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]").save_pretrained(folder)


def test_generate_runs_a_local_folder_offline(tmp_path, capsys):
    """``generate --model FOLDER`` with what save_pretrained writes (config.json,
    safetensors, tokenizer files): a random-weight Gemma in bfloat16, checked against
    transformers, graphs saved (docs/YOUR_MODEL.md)."""
    from pytrt_kv.cli import main

    folder = tmp_path / "mymodel"
    tiny_model("GemmaConfig", "bfloat16", head_dim=16).save_pretrained(folder)
    _save_tokenizer(folder)
    rc = main(["generate", "--model", str(folder), "--prompt", "w5 w9 w17 w33 w2 w7",
               "--prompt", "w3 w1 w4", "--tokens", "4", "--block-size", "4",
               "--num-blocks", "16", "--dtype", "bfloat16", "--check",
               "--save", str(tmp_path / "out")])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "check: all 8 tokens equal transformers' greedy generation" in out, out
    assert "(bfloat16)" in out and (tmp_path / "out" / "decode.onnx").is_file()


def test_generate_refuses_a_folder_by_name_before_the_weights_load(tmp_path, monkeypatch, capsys):
    """A folder's config.json and tokenizer are read first: a refused field, prompts past
    the model's positions or the cache, and a folder without a tokenizer (transformers
    would make an empty one) are refused in one line, and the weights never load."""
    import transformers

    import onnx_export.decoder.load as load
    from pytrt_kv.cli import main

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(load, "load_model", no_model)
    prompt = " ".join(f"w{i}" for i in range(10))
    cases = [
        ("GemmaConfig", dict(head_dim=16, use_bidirectional_attention=True), True, [],
         "config.use_bidirectional_attention: got True; supported: None or False"),
        ("LlamaConfig", dict(max_position_embeddings=12), True, ["--tokens", "4"],
         "tokens: the longest prompt (10) plus 4 tokens reaches position 12, past the "
         "model's max_position_embeddings 12"),
        ("LlamaConfig", {}, True, ["--num-blocks", "3"], "num_blocks: 1 prompts of 10 tokens"),
        ("LlamaConfig", {}, False, [], "has no tokenizer (expected tokenizer.json"),
        ("Qwen3Config", {}, False, [], "has no tokenizer (expected tokenizer.json"),
    ]  # fmt: skip
    for i, (cls_name, over, tokenizer, args, want) in enumerate(cases):
        folder = tmp_path / str(i)
        getattr(transformers, cls_name)(**{**SMALL, **over}).save_pretrained(folder)
        if tokenizer:
            _save_tokenizer(folder)
        rc = main(["generate", "--model", str(folder), "--prompt", prompt, "--tokens", "2",
                   "--block-size", "4", *args])  # fmt: skip
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 1 and len(err) == 1 and want in err[0], (cls_name, err)
