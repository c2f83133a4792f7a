#!/usr/bin/env python3
"""Disaggregated prefill/decode with pytrt_kv.datadist: two processes, KV blocks over NIXL.

    python3 examples/datadist_prefill_decode.py [--steps 3] [--prompt-len 37]

This process is the **prefill** node (role "prompt", cluster 1). It starts the **decode**
node (role "decoder", cluster 2) as a second process (this file with ``--decode``), then:

1. decode: registers its full caches (the ``full_kv_cache`` / ``full_k_rope`` buffers its
   engine reads, [NB, FBS, 1, D]) as two datadist caches, chooses the blocks each
   sequence will use (its block table) and reports its address, cache ids and table;
2. prefill: links to the decode node, "runs the prompt" (random KV here, where a real
   deployment runs its prefill engine) into its own paged caches with its own block
   table, and pushes each sequence's blocks into the decode node's blocks, one tagged
   push per cache (layer range: the single tensor, ``tensor_num_per_layer=1``);
3. prefill: tells the decode node the sequence lengths, the tags and a digest of the
   prompt tokens;
4. decode: waits for both tags (bounded), checks the digest of the tokens it received,
   then runs ``--steps`` steps of the example sparse-attention decode model
   (``onnx_export.example``: ScatterPaKvCache + GatherSelectionKvCache) on the CPU
   runtime (``pytrt_kv.runtime``), each verified against a direct NumPy computation.

Exit status 0 and "decode PASSED" when every check passed. Every wait is bounded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import select
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np

# Run from a source checkout without installing (an installed pytrt-kv works too).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from onnx_export.example import CACHE_OUTPUTS, ExampleSizes, build_example_model  # noqa: E402
from pytrt_kv import demo, dtypes, runtime  # noqa: E402
from pytrt_kv.datadist import CacheDesc, CacheIndex, KvCacheExtParam, LlmDataDist  # noqa: E402

PREFILL_ID, DECODE_ID = 1, 2
#: The full caches (graph inputs of the example model) that the prefill node fills.
CACHES = ("full_kv_cache", "full_k_rope")
ONE_TENSOR = KvCacheExtParam(tensor_num_per_layer=1)
WAIT_S = 60.0


def _block_shape(z: ExampleSizes, name: str):
    width = z.kv_dim if name == "full_kv_cache" else z.rope_dim
    return (z.block_size, 1, width)


def _prompt_digest(z, caches, table, kv_len) -> str:
    """sha256 of every prompt token's KV bytes, sequence by sequence, in position order."""
    h = hashlib.sha256()
    for name in CACHES:
        for b, n in enumerate(kv_len):
            p = np.arange(int(n))
            h.update(
                np.ascontiguousarray(
                    caches[name][table[b, p // z.block_size], p % z.block_size]
                ).tobytes()
            )
    return h.hexdigest()


def _say(msg: dict) -> None:
    sys.stdout.write("@@" + json.dumps(msg) + "\n")
    sys.stdout.flush()


# --- decode node ---------------------------------------------------------------------------


def decode(args) -> int:
    z = ExampleSizes()
    rng = np.random.default_rng(args.seed + 1)
    node = LlmDataDist(DECODE_ID, "decoder", backend="nixl")
    node.initialize("127.0.0.1", 0)
    try:
        # The engine's own buffers, registered (not copied): blocks land where it reads.
        full = {
            name: np.full(
                (z.num_blocks,) + _block_shape(z, name), -7.0, dtypes.numpy_dtype(z.dtype)
            )
            for name in CACHES
        }
        caches = {
            name: node.register_cache(CacheDesc(1, full[name].shape, z.dtype), [full[name]])
            for name in CACHES
        }
        table = (
            rng.permutation(z.num_blocks)[: z.batch * z.max_blocks_per_seq]
            .reshape(z.batch, z.max_blocks_per_seq)
            .astype(np.int32)
        )
        _say(
            {
                "address": list(node.listen_address),
                "table": table.tolist(),
                "caches": {name: c.cache_id for name, c in caches.items()},
            }
        )

        ready, _, _ = select.select([sys.stdin], [], [], WAIT_S)
        if not ready:
            print(f"decode: no request from the prefill node within {WAIT_S} s")
            return 1
        request = json.loads(sys.stdin.readline())
        for tag in request["tags"]:
            node.wait_received(tag, timeout_s=WAIT_S)
        kv_len = np.array(request["kv_len"], np.int32)
        if _prompt_digest(z, full, table, kv_len) != request["digest"]:
            print("decode: the received prompt KV differs from what the prefill node sent")
            return 1
        print(
            f"decode: received the prompt KV of {z.batch} sequences (kv_len "
            f"{kv_len.tolist()}), digest matches"
        )

        model = build_example_model(z)
        evaluator = runtime.make_evaluator(model)
        state = demo.initial_state(z, int(kv_len[0]), rng, model)
        state.update(
            full_kv_cache=full["full_kv_cache"],
            full_k_rope=full["full_k_rope"],
            full_kv_block_table=table,
            kv_len=kv_len,
        )
        fails = []
        for step in range(1, args.steps + 1):
            feeds = demo.step_feeds(z, state, rng, model)
            out = runtime.run(evaluator, feeds)
            step_fails, stats = demo.verify_step(z, feeds, out, demo.expected_step(z, feeds))
            print(
                f"decode: step {step}: kv_len {feeds['full_kv_actual_seq'].tolist()}, "
                f"max |attn err| {stats['err']:.3g}: {'ok' if not step_fails else 'FAILED'}"
            )
            fails += step_fails
            if step_fails:
                break
            state = {**state, "kv_len": feeds["full_kv_actual_seq"]}
            for src, dst in CACHE_OUTPUTS.items():
                state[src] = out[dst]
        for f in fails:
            print(f"decode:   {f}")
        print("decode PASSED" if not fails else f"decode FAILED ({len(fails)} checks)")
        return 0 if not fails else 1
    finally:
        node.finalize()


# --- prefill node --------------------------------------------------------------------------


def prefill(args) -> int:
    z = ExampleSizes()
    last = args.prompt_len + z.batch - 1 + args.steps
    if args.prompt_len < 1 or last > z.max_tokens:
        raise SystemExit(
            f"--prompt-len/--steps: need prompt_len + batch - 1 + steps <= {z.max_tokens}"
        )
    child = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--decode",
            "--steps",
            str(args.steps),
            "--seed",
            str(args.seed),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()

    def pump():
        for line in child.stdout:
            lines.put(line)
        lines.put("")

    threading.Thread(target=pump, daemon=True).start()

    def next_message() -> dict:
        while True:
            line = lines.get(timeout=WAIT_S)
            if not line:
                raise RuntimeError("the decode process ended early")
            if line.startswith("@@"):
                return json.loads(line[2:])
            print(line, end="")

    node = LlmDataDist(PREFILL_ID, "prompt", backend="nixl")
    node.initialize("127.0.0.1", 0)
    try:
        hello = next_message()
        dtable = np.array(hello["table"], np.int32)
        (link,) = node.link_clusters([tuple(hello["address"])], timeout_s=10)
        if not link.ok:  # one result per cluster (docs/DATADIST.md)
            raise SystemExit(f"prefill: cannot link to the decode node: {link.message}")
        print(f"prefill: linked to the decode node at {hello['address'][0]}:{hello['address'][1]}")

        # The prompt's KV in this node's own paged caches (more blocks, another table).
        rng = np.random.default_rng(args.seed)
        nb = 2 * z.num_blocks
        caches = {
            name: node.allocate_cache(CacheDesc(1, (nb,) + _block_shape(z, name), z.dtype))
            for name in CACHES
        }
        for c in caches.values():
            c.tensors[0][...] = rng.standard_normal(c.tensors[0].shape)
        ptable = rng.permutation(nb)[: z.batch * z.max_blocks_per_seq].reshape(
            z.batch, z.max_blocks_per_seq
        )
        kv_len = np.array([args.prompt_len + b for b in range(z.batch)], np.int32)
        used = -(-kv_len // z.block_size)  # blocks holding each sequence's prompt
        src_blocks = np.concatenate([ptable[b, : used[b]] for b in range(z.batch)])
        dst_blocks = np.concatenate([dtable[b, : used[b]] for b in range(z.batch)])

        tags = []
        for name, c in caches.items():
            tags.append(
                node.push_kv_blocks(
                    c,
                    CacheIndex(DECODE_ID, hello["caches"][name]),
                    src_blocks.tolist(),
                    dst_blocks.tolist(),
                    ONE_TENSOR,
                    tag=f"prompt:{name}",
                    timeout_s=WAIT_S,
                )
            )
        print(
            f"prefill: pushed {len(src_blocks)} blocks x {len(CACHES)} caches "
            f"({len(src_blocks) * sum(c.cache_desc.block_bytes for c in caches.values())} "
            f"bytes), tags {tags}"
        )
        digest = _prompt_digest(z, {n: c.tensors[0] for n, c in caches.items()}, ptable, kv_len)
        child.stdin.write(
            json.dumps({"kv_len": kv_len.tolist(), "tags": tags, "digest": digest}) + "\n"
        )
        child.stdin.flush()
        while True:
            line = lines.get(timeout=WAIT_S * 2)
            if not line:
                break
            print(line, end="")
        return child.wait(timeout=WAIT_S)
    finally:
        node.finalize()
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="decode steps (default 3)")
    ap.add_argument(
        "--prompt-len",
        type=int,
        default=37,
        help="prompt tokens of sequence 0 (sequence b has prompt_len + b)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--decode", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return decode(args) if args.decode else prefill(args)


if __name__ == "__main__":
    sys.exit(main())
