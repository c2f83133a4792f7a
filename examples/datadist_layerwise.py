#!/usr/bin/env python3
"""Layer-wise push with pytrt_kv.datadist: two processes, the transfer overlaps prefill.

    python3 examples/datadist_layerwise.py [--layers 8] [--tokens 512] [--repeats 5]

This process is the **prefill** node (cluster 1); it starts the **decode** node
(cluster 2, this file with ``--decode``), which registers a ``--layers``-layer KV cache
(K and V per layer: ``tensor_num_per_layer=2``) and reports it. The prefill node then
runs a stand-in prefill (per layer, NumPy matmuls compute the prompt's K and V from the
hidden state and write them into the layer's blocks of its paged cache, then the hidden
state moves on) in two ways, alternating, ``--repeats`` times each:

- **after**: prefill every layer, then one ``push_kv_blocks`` of the whole request;
- **layer-wise**: :class:`pytrt_kv.datadist.LayerwisePush`: each layer is marked ready
  (``layer_ready``) as soon as its K and V are written and moves while the next layers
  compute; ``wait()`` sends the tag after the last layer.

Every run's blocks are checked by the decode node (a digest of the received blocks,
after ``wait_received``). Printed: the median time from the prefill's start to the push's
completion for both, their ratio, and the prefill alone (no push: the floor of both).
On a GPU, ``layer_ready(layer, event)`` takes an event recorded after the layer's
kernels (untested here: no GPU). Every wait is bounded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# Run from a source checkout without installing (an installed pytrt-kv works too).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pytrt_kv.datadist import CacheDesc, CacheIndex, LayerwisePush, LlmDataDist  # noqa: E402

BLOCK_TOKENS = 16
WAIT_S = 60.0


def _desc(args, num_blocks: int) -> CacheDesc:
    return CacheDesc(2 * args.layers, (num_blocks, BLOCK_TOKENS, args.dim), "float16")


def _digest(tensors, blocks) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(np.ascontiguousarray(t[blocks]).tobytes())
    return h.hexdigest()


def _say(msg: dict) -> None:
    sys.stdout.write("@@" + json.dumps(msg) + "\n")
    sys.stdout.flush()


def decode(args) -> int:
    node = LlmDataDist(2, "decoder", backend="nixl")
    node.initialize("127.0.0.1", 0)
    try:
        nblocks = args.tokens // BLOCK_TOKENS
        cache = node.allocate_cache(_desc(args, 2 * nblocks))
        table = np.random.default_rng(1).permutation(2 * nblocks)[:nblocks]
        _say(
            {"address": list(node.listen_address), "cache": cache.cache_id, "table": table.tolist()}
        )
        while True:
            ready, _, _ = select.select([sys.stdin], [], [], WAIT_S)
            if not ready:
                return 1
            msg = json.loads(sys.stdin.readline())
            if msg.get("quit"):
                return 0
            node.wait_received(msg["tag"], timeout_s=WAIT_S)
            _say({"tag": msg["tag"], "ok": _digest(cache.tensors, table) == msg["digest"]})
    finally:
        node.finalize()


def prefill(args) -> int:
    child = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--decode",
            "--layers",
            str(args.layers),
            "--tokens",
            str(args.tokens),
            "--dim",
            str(args.dim),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )

    def ask(msg: dict | None = None) -> dict:
        if msg is not None:
            child.stdin.write(json.dumps(msg) + "\n")
            child.stdin.flush()
        ready, _, _ = select.select([child.stdout], [], [], WAIT_S)
        if not ready:
            raise RuntimeError("the decode node did not answer")
        while True:
            line = child.stdout.readline()
            if not line:
                raise RuntimeError("the decode process ended early")
            if line.startswith("@@"):
                return json.loads(line[2:])
            print(line, end="")

    node = LlmDataDist(1, "prompt", backend="nixl")
    node.initialize("127.0.0.1", 0)
    try:
        hello = ask()
        node.link_clusters([tuple(hello["address"])], timeout_s=10)
        index, dst_blocks = CacheIndex(2, hello["cache"]), hello["table"]
        nblocks, d = args.tokens // BLOCK_TOKENS, args.dim
        cache = node.allocate_cache(_desc(args, 3 * nblocks))
        src_blocks = np.random.default_rng(2).permutation(3 * nblocks)[:nblocks]
        rng = np.random.default_rng(0)
        h = args.hidden
        weights = [
            (
                rng.standard_normal((h, d)).astype(np.float32) / np.sqrt(h),
                rng.standard_normal((h, d)).astype(np.float32) / np.sqrt(h),
                rng.standard_normal((h, h)).astype(np.float32) / np.sqrt(h),
            )
            for _ in range(args.layers)
        ]
        x0 = rng.standard_normal((args.tokens, h)).astype(np.float32)

        def run_layer(layer: int, x: np.ndarray) -> np.ndarray:
            wk, wv, wo = weights[layer]
            for t, w in ((2 * layer, wk), (2 * layer + 1, wv)):
                kv = (x @ w).astype(np.float16).reshape(nblocks, BLOCK_TOKENS, d)
                cache.tensors[t][src_blocks] = kv
            return np.tanh(x @ wo)

        times: dict[str, list[float]] = {"prefill only": [], "after": [], "layer-wise": []}
        for rep in range(args.repeats):
            for mode in times:
                x0 += 0.01  # new data each run: the digest proves this run's blocks arrived
                tag = f"{mode}:{rep}"
                t0 = time.perf_counter()
                if mode == "prefill only":  # no push: the floor of both
                    x = x0
                    for layer in range(args.layers):
                        x = run_layer(layer, x)
                    times[mode].append(time.perf_counter() - t0)
                    continue
                if mode == "after":
                    x = x0
                    for layer in range(args.layers):
                        x = run_layer(layer, x)
                    node.push_kv_blocks(
                        cache, index, src_blocks, dst_blocks, tag=tag, timeout_s=WAIT_S
                    )
                else:
                    lw = LayerwisePush(
                        node, cache, index, src_blocks, dst_blocks, tag=tag, timeout_s=WAIT_S
                    )
                    x = x0
                    for layer in range(args.layers):
                        x = run_layer(layer, x)
                        lw.layer_ready(layer)  # CPU: written now; GPU: pass its event
                    lw.wait()
                times[mode].append(time.perf_counter() - t0)
                reply = ask({"tag": tag, "digest": _digest(cache.tensors, src_blocks)})
                if not reply["ok"]:
                    print(f"prefill: the decode node received other blocks in run {tag}")
                    return 1
        alone, after, lw_t = (statistics.median(v) for v in times.values())
        mib = nblocks * _desc(args, 1).block_bytes * 2 * args.layers / 2**20
        print(
            f"prefill: {args.layers} layers, {args.tokens} tokens, {mib:.1f} MiB of KV, "
            f"median of {args.repeats} runs each:"
        )
        print(f"  prefill alone:      {alone * 1e3:.1f} ms (no push)")
        print(f"  push after prefill: {after * 1e3:.1f} ms")
        print(f"  layer-wise push:    {lw_t * 1e3:.1f} ms ({lw_t / after:.2f} of it)")
        print("layer-wise PASSED (every run's blocks verified by the decode node)")
        ask_quit = json.dumps({"quit": True}) + "\n"
        child.stdin.write(ask_quit)
        child.stdin.flush()
        return child.wait(timeout=WAIT_S)
    finally:
        node.finalize()
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8, help="layers (default 8)")
    ap.add_argument("--tokens", type=int, default=512, help="prompt tokens, a multiple of 16")
    ap.add_argument("--dim", type=int, default=512, help="K/V width per token (default 512)")
    ap.add_argument(
        "--hidden", type=int, default=64, help="hidden width of the stand-in (default 64)"
    )
    ap.add_argument("--repeats", type=int, default=5, help="runs of each way (default 5)")
    ap.add_argument("--decode", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tokens % BLOCK_TOKENS or args.layers < 1 or args.repeats < 1:
        ap.error(f"--tokens must be a multiple of {BLOCK_TOKENS}; --layers, --repeats >= 1")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return decode(args) if args.decode else prefill(args)


if __name__ == "__main__":
    sys.exit(main())
