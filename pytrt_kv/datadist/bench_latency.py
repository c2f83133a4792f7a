"""Small pushes for ``pytrt-kv bench datadist`` (:func:`bench_latency`): milliseconds
per push of 1-16 scattered 4 KiB blocks, wrapper and raw NIXL, each from a sender process
into a receiver process (see :mod:`.bench`)."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .bench_common import TARGETS, _raw_post, _raw_push, _rotated, raw_agent

LATENCY_BLOCKS = (1, 2, 4, 8, 16)


def _latency_layout(block: int) -> tuple[int, Any, Any]:
    """NB and the source/destination block ids of an n-block push: every other block on
    both sides (one descriptor per block, as a layer-wise push of a short request)."""
    nb = 2 * max(LATENCY_BLOCKS) + 1
    return nb, (lambda n: np.arange(n) * 2), (lambda n: np.arange(n) * 2 + 1)


def _receiver(kind: str, block: int, conn: Any) -> None:
    """Child process: the destination node (``kind`` "wrapper") or bare agent ("raw")."""
    from .memory import _aligned_host

    nb, _, _ = _latency_layout(block)
    if kind == "wrapper":
        from .llm_datadist import LlmDataDist
        from .types import CacheDesc

        d = LlmDataDist(2, "decoder", backend="nixl")
        d.initialize()
        cache = d.allocate_cache(CacheDesc(1, (nb, block), "uint8"))
        conn.send((d.listen_address, cache.cache_id))
        conn.recv()  # stop
        d.finalize()
        return
    agent = raw_agent(f"raw-dst-{os.getpid()}")
    dst = _aligned_host(nb * block)
    agent.register_memory([(int(dst.ctypes.data), dst.nbytes, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), int(dst.ctypes.data)))
    while True:  # read notifications as the wrapper's destination would, until told to stop
        if conn.poll(0.01):
            conn.recv()
            return
        agent.get_new_notifs()


def _reposter(a: Any, local: Any, remote: Any, li: np.ndarray, ri: np.ndarray) -> Any:
    """Raw NIXL posting one prepared transfer again per push, each with its own
    notification (NIXL allows reposting a completed transfer)."""
    h = a.make_prepped_xfer("WRITE", local, li, remote, ri, notif_msg=b"raw")
    count = iter(range(1 << 62))
    return lambda: _raw_post(a, h, b"raw%d" % next(count))


def _sender(kind: str, block: int, peer: Any, conn: Any) -> None:
    """Child process: the source; answers ("run", n, pushes) with seconds per push. The
    wrapper's sender also answers ("same", n, pushes): raw NIXL pushes over the wrapper's
    own agent, descriptor lists and receiver (same processes, same CPU placement)."""
    from .memory import _aligned_host

    nb, src_ids, dst_ids = _latency_layout(block)
    push: Callable[[int], None]
    same: Callable[[int], None] | None = None
    repost: Callable[[int], None] | None = None
    if kind == "wrapper":
        from .llm_datadist import LlmDataDist
        from .types import CacheDesc, CacheIndex, KvCacheExtParam

        p = LlmDataDist(1, "prompt", backend="nixl")
        p.initialize()
        src = p.allocate_cache(CacheDesc(1, (nb, block), "uint8"))
        p.link_clusters([peer[0]])
        index, one = CacheIndex(2, peer[1]), KvCacheExtParam(tensor_num_per_layer=1)
        # Made before timing, as the raw sender's: the caller's block lists already exist.
        ids = {n: (src_ids(n), dst_ids(n)) for n in LATENCY_BLOCKS}

        def push(n: int) -> None:
            p.push_kv_blocks(src, index, *ids[n], one, timeout_s=60)

        t: Any = p._transport
        node, info = p._remote_cache("dst_cache_index", index)
        state: Any = src._backend_state  # the "nixl" transport's (registration, list)
        dls = (state[1], t._remote_dlist(node.agent, info))
        raw_ids = {n: (a.astype(np.int32), b.astype(np.int32)) for n, (a, b) in ids.items()}

        def same(n: int) -> None:
            _raw_push(t.agent, *dls, *raw_ids[n])

        reposters = {n: _reposter(t.agent, *dls, *raw_ids[n]) for n in LATENCY_BLOCKS}

        def repost(n: int) -> None:
            reposters[n]()

    else:
        a = raw_agent(f"raw-src-{os.getpid()}")
        buf = _aligned_host(nb * block)
        a.register_memory([(int(buf.ctypes.data), buf.nbytes, 0, "")], "DRAM")
        name = a.add_remote_agent(peer[0])

        def rows(addr: int) -> np.ndarray:
            return np.array([[addr, block, 0, block, nb]], np.uint64)

        local = a.prep_xfer_dlist("NIXL_INIT_AGENT", rows(int(buf.ctypes.data)), "DRAM")
        remote = a.prep_xfer_dlist(name, rows(peer[1]), "DRAM")
        idx = {
            n: (src_ids(n).astype(np.int32), dst_ids(n).astype(np.int32)) for n in LATENCY_BLOCKS
        }

        def push(n: int) -> None:
            _raw_push(a, local, remote, *idx[n])

    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            return
        what, n, pushes = cmd
        fn = {"same": same, "repost": repost}.get(what) or push
        fn(n)  # warm
        t0 = time.perf_counter()
        for _ in range(pushes):
            fn(n)
        conn.send((time.perf_counter() - t0) / pushes)


def _recv(conn: Any, proc: Any, what: str, timeout_s: float) -> Any:
    """The next message from a child, failing early when the child has died."""
    end = time.monotonic() + timeout_s
    while not conn.poll(0.1):
        if not proc.is_alive():
            raise RuntimeError(f"the {what} process exited ({proc.exitcode})")
        if time.monotonic() > end:
            raise RuntimeError(f"the {what} process did not answer within {timeout_s} s")
    return conn.recv()


def bench_latency(block: int, pushes: int, repeats: int) -> list[dict[str, Any]]:
    """Seconds per n-block push (n in :data:`LATENCY_BLOCKS`), wrapper and raw NIXL, each
    a sender process pushing into its own receiver process (four processes), and raw NIXL
    over the wrapper's own agent and lists ("same": same processes and CPU placement,
    which on a small shared host moves these times by 2x from run to run). They take
    turns within each repeat; times are medians of ``repeats``, ratios medians of the
    repeats' ratios."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    procs: list[tuple[Any, Any]] = []
    senders: dict[str, tuple[Any, Any]] = {}
    try:
        for kind in ("wrapper", "raw"):
            rc, rc_child = ctx.Pipe()
            r = ctx.Process(target=_receiver, args=(kind, block, rc_child), daemon=True)
            r.start()
            procs.append((r, rc))
            peer = _recv(rc, r, f"{kind} receiver", 120)
            sc, sc_child = ctx.Pipe()
            s = ctx.Process(target=_sender, args=(kind, block, peer, sc_child), daemon=True)
            s.start()
            procs.append((s, sc))
            _recv(sc, s, f"{kind} sender", 120)
            senders[kind] = (sc, s)
        times: dict[tuple[str, int], list[float]] = {}
        turns = [("wrapper", "run"), ("wrapper", "same"), ("wrapper", "repost"), ("raw", "run")]
        for rep in range(repeats):
            for n in LATENCY_BLOCKS:
                for kind, what in _rotated(turns, rep):
                    sc, s = senders[kind]
                    sc.send((what, n, pushes))
                    key = (what if what != "run" else kind, n)
                    times.setdefault(key, []).append(_recv(sc, s, f"{kind} sender", 300))
    finally:
        for _, c in procs:
            try:
                c.send(("stop",))
            except (OSError, ValueError):
                pass
        for p, _ in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(10)

    def ratio(kind: str, n: int) -> float:
        # Median of the per-repeat ratios: the four timings of a repeat are taken back to
        # back, so a slow spell of this shared host hits both sides of a ratio; a ratio of
        # medians mixes spells.
        return statistics.median(t / w for t, w in zip(times[kind, n], times["wrapper", n]))

    rows = []
    for n in LATENCY_BLOCKS:
        wrap = times["wrapper", n]
        rows.append(
            {
                "blocks": n,
                "block": block,
                "wrapper_ms": statistics.median(wrap) * 1e3,
                "raw_ms": statistics.median(times["raw", n]) * 1e3,
                "wrapper_vs_raw": ratio("raw", n),
                "raw_same_ms": statistics.median(times["same", n]) * 1e3,
                "wrapper_vs_raw_same": ratio("same", n),
                "raw_repost_ms": statistics.median(times["repost", n]) * 1e3,
                "wrapper_vs_raw_repost": ratio("repost", n),
            }
        )
        rows[-1]["met"] = rows[-1]["wrapper_vs_raw"] >= TARGETS["wrapper_vs_raw"]
    return rows


def latency_markdown(rows: list[dict[str, Any]], pushes: int, repeats: int) -> str:
    lines = [
        f"Small pushes (one tensor, {rows[0]['block'] >> 10} KiB blocks, every other block "
        f"on both sides; times: median of {repeats} runs of {pushes} pushes, ratios: median "
        f"of the {repeats} runs' ratios (raw time / wrapper time); sender and receiver "
        f"in separate processes, wrapper and raw NIXL in separate process pairs; 'same "
        f"processes': raw NIXL over the wrapper's own agent, lists and receiver, a "
        f"transfer made per push or one prepared transfer reposted):",
        "",
        "| blocks | wrapper ms | raw NIXL ms | wrapper/raw | raw NIXL, same processes ms "
        "| wrapper/raw, same processes | raw NIXL reposted, same processes ms "
        "| wrapper/raw reposted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['blocks']} | {r['wrapper_ms']:.3f} | {r['raw_ms']:.3f} | "
            f"{r['wrapper_vs_raw']:.2f} | {r['raw_same_ms']:.3f} | "
            f"{r['wrapper_vs_raw_same']:.2f} | {r['raw_repost_ms']:.3f} | "
            f"{r['wrapper_vs_raw_repost']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def python_cost(pushes: int = 2000, batches: int = 40, polls: int = 0) -> dict[str, float]:
    """Thread CPU time of the wrapper's Python per kept-plan push, in ns: two ``"nixl"``
    nodes in this process, NIXL's post replaced by one that completes at once (or after
    ``polls`` status checks), one 4 KiB block pushed ``batches`` x ``pushes`` times.
    What the wrapper adds per push, without NIXL's time or most of a shared machine's
    noise (docs/DATADIST.md, "Performance"); min and median over the batches.

    ``python -c "from pytrt_kv.datadist.bench_latency import python_cost as f; print(f())"``
    """
    from .llm_datadist import LlmDataDist
    from .types import CacheDesc, CacheIndex, KvCacheExtParam

    p, d = LlmDataDist(1, "prompt", backend="nixl"), LlmDataDist(2, "decoder", backend="nixl")
    p.initialize()
    d.initialize()
    try:
        nb, src_ids, dst_ids = _latency_layout(4096)
        src = p.allocate_cache(CacheDesc(1, (nb, 4096), "uint8"))
        dst = d.allocate_cache(CacheDesc(1, (nb, 4096), "uint8"))
        p.link_clusters([d.listen_address])
        index, one = CacheIndex(2, dst.cache_id), KvCacheExtParam(tensor_num_per_layer=1)
        sb, db = src_ids(1), dst_ids(1)
        p.push_kv_blocks(src, index, sb, db, one, timeout_s=60)  # real: the plan is kept
        t: Any = p._transport
        ok, busy = t._b.NIXL_SUCCESS, t._b.NIXL_IN_PROG
        left = [0]

        def post(handle: Any, notif: bytes) -> Any:
            left[0] = polls
            return busy if polls else ok

        def status(handle: Any) -> Any:
            left[0] -= 1
            return busy if left[0] > 0 else ok

        t._post, t._status = post, (status, ok, busy)
        per: list[float] = []
        for _ in range(batches):
            c0 = time.thread_time_ns()
            for _ in range(pushes):
                p.push_kv_blocks(src, index, sb, db, one, timeout_s=60)
            per.append((time.thread_time_ns() - c0) / pushes)
        return {"min_ns": min(per), "median_ns": statistics.median(per)}
    finally:
        p.finalize()
        d.finalize()
