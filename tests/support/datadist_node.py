"""A datadist node in its own process, driven over stdin/stdout by the tests
(tests/test_datadist_processes.py). One JSON command per stdin line; each reply is one
stdout line starting with ``@@`` (anything else on stdout is ignored by the driver).

    python tests/support/datadist_node.py --cluster-id 2 --role decoder --backend nixl \
        --cache 4,8x64,float16

Commands: ``link`` {addr, timeout_s}, ``unlink`` {cluster}, ``fds`` (open fds), ``read``
{tag, timeout_s} (waits for the tag, returns the cache's bytes), ``fill`` {seed},
``pull`` {cluster, cache, src, dst, ext},
``alloc`` (another cache like the first; returns its id), ``realloc`` (deallocates the
cache and makes a new one of the same layout, filled with the sentinel: with
``--register`` the same buffers registered again if the node allows it, else a new
allocation), ``state`` (the cache's bytes and the quarantined cache ids), ``quit``.
``--options`` is the node's ``options`` as JSON.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys

import numpy as np

from pytrt_kv.datadist import CacheDesc, CacheIndex, KvCacheExtParam, LlmDataDist, LLMException

SENTINEL = 99


def _bytes(cache) -> str:
    return base64.b64encode(
        b"".join(np.ascontiguousarray(t).tobytes() for t in cache.tensors)
    ).decode()


def _reply(**kw) -> None:
    sys.stdout.write("@@" + json.dumps(kw) + "\n")
    sys.stdout.flush()


def _quarantined(node) -> list:
    # getattr: the same driver runs against code without quarantine (a test's pre-fix run)
    return getattr(node, "quarantined_caches", list)()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cluster-id", type=int, required=True)
    ap.add_argument("--role", required=True)
    ap.add_argument("--backend", default="nixl")
    ap.add_argument("--cache", required=True, help="num_tensors,NBxDIMS,dtype")
    ap.add_argument("--options", default="{}", help="LlmDataDist options, JSON")
    ap.add_argument("--port", type=int, default=0, help="control port (0: a free one)")
    ap.add_argument(
        "--register", action="store_true", help="register buffers of this process (not allocate)"
    )
    args = ap.parse_args()
    n, shape, dtype = args.cache.split(",")
    desc = CacheDesc(int(n), tuple(int(v) for v in shape.split("x")), dtype)
    node = LlmDataDist(
        args.cluster_id, args.role, backend=args.backend, options=json.loads(args.options)
    )
    node.initialize("127.0.0.1", args.port)
    buffers = [np.full(desc.shape, SENTINEL, desc.dtype) for _ in range(desc.num_tensors)]
    cache = node.register_cache(desc, buffers) if args.register else node.allocate_cache(desc)
    for t in cache.tensors:
        t[...] = SENTINEL
    _reply(addr=list(node.listen_address), cache=cache.cache_id, pid=__import__("os").getpid())
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            op = cmd["cmd"]
            if op == "quit":
                break
            if op == "link":
                linked = node.link_clusters([tuple(cmd["addr"])], timeout_s=cmd.get("timeout_s", 5))
                _reply(
                    linked=[r.cluster_id for r in linked if r.status.name == "SUCCESS"],
                    results=[[r.status.name, r.cluster_id, r.message] for r in linked],
                )
            elif op == "unlink":
                node.unlink_clusters([cmd["cluster"]], timeout_s=cmd.get("timeout_s", 1))
                _reply(linked=node.linked_clusters(), quarantined=_quarantined(node))
            elif op == "fds":
                _reply(fds=len(__import__("os").listdir("/proc/self/fd")))
            elif op == "alloc":
                _reply(cache=node.allocate_cache(desc).cache_id)
            elif op == "read":
                node.wait_received(cmd["tag"], timeout_s=cmd.get("timeout_s", 5))
                _reply(data=_bytes(cache))
            elif op == "realloc":
                # The new cache takes the old one's memory where the node allows it: the
                # same buffers registered again (--register), else a new allocation.
                old = cache
                node.deallocate_cache(old)
                refused = None
                if args.register:
                    for t in buffers:
                        t[...] = SENTINEL
                    try:
                        cache = node.register_cache(desc, buffers)
                    except ValueError as exc:
                        refused = str(exc)
                if refused is not None or not args.register:
                    cache = node.allocate_cache(desc)
                for t in cache.tensors:
                    t[...] = SENTINEL
                _reply(
                    cache=cache.cache_id,
                    reused=sorted(cache.tensor_addrs) == sorted(old.tensor_addrs),
                    refused=refused,
                    quarantined=_quarantined(node),
                    data=_bytes(cache),
                )
            elif op == "state":
                _reply(cache=cache.cache_id, quarantined=_quarantined(node), data=_bytes(cache))
            elif op == "fill":
                rng = np.random.default_rng(cmd["seed"])
                for t in cache.tensors:
                    t.view(np.uint8)[...] = rng.integers(0, 256, t.view(np.uint8).shape)
                _reply(data=_bytes(cache))
            elif op == "pull":
                ext = KvCacheExtParam(*cmd["ext"]) if cmd.get("ext") else None
                node.pull_kv_blocks(
                    CacheIndex(cmd["cluster"], cmd["cache"]),
                    cache,
                    cmd["src"],
                    cmd["dst"],
                    ext,
                    timeout_s=5,
                )
                _reply(data=_bytes(cache))
            else:
                _reply(error=f"unknown command {op!r}")
        except LLMException as exc:
            _reply(error=str(exc), status=exc.status.name)
    node.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
