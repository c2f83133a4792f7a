"""The timings of ``pytrt-kv bench datadist`` (the command: :mod:`pytrt_kv.cli.bench`):
block-push throughput against same-run baselines.

Each case pushes ``--total-mib`` of blocks (one tensor, ``block`` bytes per block) from a
prompt node to a decoder node in this process, over NIXL (UCX), and times, median of
``--repeats`` runs of ``--pushes`` pushes:

- **wrapper**: ``LlmDataDist.push_kv_blocks`` (D4 checks, plan, tag, wait) end to end;
- **raw NIXL**: the same descriptor lists and indices on two bare ``nixl_agent`` objects
  configured as the wrapper's (``make_prepped_xfer`` + ``transfer`` + polling as the
  wrapper polls + ``release``: the floor a NIXL user pays), so ``wrapper / raw`` is the
  wrapper's cost (target >= 0.90);
- **baseline**: host memory: the NumPy copy ``dst[db] = src[sb]`` of the same blocks;
  ``--memory device``: one ``cudaMemcpy`` device-to-device of the same bytes;
  ``--memory pinned-to-device``: one pinned host-to-device ``cudaMemcpy`` (GPU targets:
  NIXL >= 0.80 of it).

Small pushes (:func:`bench_latency`): milliseconds per push of 1-16 scattered 4 KiB
blocks, wrapper and raw NIXL, each from a sender process into a receiver process, and
raw NIXL over the wrapper's own agent and receiver (same processes: no difference in
CPU placement), both as above (a transfer made per push) and posting one prepared
transfer again with a new notification per push (what the wrapper does for a repeated
request, docs/DATADIST.md decision 13: the strictest raw baseline).

Patterns: *contiguous* (blocks 0..N-1 to 0..N-1: NIXL merges them into one descriptor)
and *scattered* (random permutations on both sides: one descriptor per block).
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .bench_common import TARGETS, _raw_push, _rotated, raw_agent
from .bench_latency import LATENCY_BLOCKS, bench_latency, latency_markdown

__all__ = [
    "BLOCK_SIZES",
    "LATENCY_BLOCKS",
    "TARGETS",
    "bench_case",
    "bench_latency",
    "latency_markdown",
    "markdown",
]

BLOCK_SIZES = (4 << 10, 64 << 10, 1 << 20)


def _median_times(
    fns: dict[str, Callable[[], None]], pushes: int, repeats: int
) -> dict[str, float]:
    """Median seconds per call of each function; the functions take turns within each
    repeat, so that load changes on a shared machine hit all of them alike."""
    for fn in fns.values():
        fn()  # warm: connections, registrations, first-touch of pages
    times: dict[str, list[float]] = {k: [] for k in fns}
    order = list(fns.items())
    for r in range(repeats):
        for k, fn in _rotated(order, r):
            t0 = time.perf_counter()
            for _ in range(pushes):
                fn()
            times[k].append((time.perf_counter() - t0) / pushes)
    return {k: statistics.median(v) for k, v in times.items()}


class _Buffers:
    """Source and destination [NB, block] uint8 tensors of one case."""

    def __init__(self, memory: str, nb: int, block: int):
        self.memory, self.nb, self.block = memory, nb, block
        self._keep: list[Any] = []
        if memory == "host":
            from .memory import _aligned_host

            # Host blocks are NumPy arrays, device ones _cuda.DeviceArray / HostArray.
            self.src: Any = _aligned_host(nb * block).reshape(nb, block)
            self.dst: Any = _aligned_host(nb * block).reshape(nb, block)
            self.src[...] = np.random.default_rng(0).integers(0, 256, self.src.shape, np.uint8)
            self.dst[...] = 0
            self.src_place = self.dst_place = "host"
            self.src_addr, self.dst_addr = int(self.src.ctypes.data), int(self.dst.ctypes.data)
            return
        from .. import _cuda

        dst = _cuda.DeviceArray((nb, block), np.uint8)
        src: Any
        if memory == "device":
            src = _cuda.DeviceArray.from_numpy(
                np.random.default_rng(0).integers(0, 256, (nb, block), np.uint8)
            )
            self.src_place, self.src_addr = "device", src.ptr
        else:
            src = _cuda.HostArray((nb, block), np.uint8)
            src.array[...] = np.random.default_rng(0).integers(0, 256, (nb, block), np.uint8)
            self.src_place, self.src_addr = "host", int(src.array.ctypes.data)
        self.src, self.dst, self.dst_place, self.dst_addr = src, dst, "device", dst.ptr
        self._keep += [src, dst]

    def baseline(self, sb: np.ndarray, db: np.ndarray) -> Callable[[], None]:
        if self.memory == "host":
            src, dst = self.src, self.dst

            def numpy_copy():
                dst[db] = src[sb]

            return numpy_copy
        from .. import _cuda

        nbytes = len(sb) * self.block
        src = self.src.ptr if self.memory == "device" else self.src.address

        def memcpy():
            _cuda.check_status(
                _cuda.kernels().pytrt_kv_copy(self.dst.ptr, src, nbytes, 0, 0), "cudaMemcpy"
            )

        return memcpy

    def check(self, sb: np.ndarray, db: np.ndarray) -> bool:
        if self.memory == "host":
            return bool((self.dst[db] == self.src[sb]).all())
        dst = self.dst.get()
        src = self.src.get() if self.memory == "device" else self.src.array
        return bool((dst[db] == src[sb]).all())


def _raw_pair(buf: _Buffers):
    """Two bare NIXL agents with the wrapper's descriptor layout (one Nx5 strided row)."""
    tag = os.urandom(4).hex()
    a, b = raw_agent(f"raw-a-{tag}"), raw_agent(f"raw-b-{tag}")  # made as the wrapper's
    mem = {"host": "DRAM", "device": "VRAM"}
    nbytes = buf.nb * buf.block
    a.register_memory([(buf.src_addr, nbytes, 0, "")], mem[buf.src_place])
    b.register_memory([(buf.dst_addr, nbytes, 0, "")], mem[buf.dst_place])
    a.add_remote_agent(b.get_agent_metadata())
    rows = lambda addr: np.array([[addr, buf.block, 0, buf.block, buf.nb]], np.uint64)  # noqa: E731
    local = a.prep_xfer_dlist("NIXL_INIT_AGENT", rows(buf.src_addr), mem[buf.src_place])
    remote = a.prep_xfer_dlist(b.name, rows(buf.dst_addr), mem[buf.dst_place])
    return a, b, local, remote


def bench_case(
    memory: str, block: int, pattern: str, total: int, pushes: int, repeats: int
) -> dict[str, Any]:
    from .llm_datadist import LlmDataDist
    from .types import CacheDesc, CacheIndex, KvCacheExtParam, LLMException

    nb = max(1, total // block)
    buf = _Buffers(memory, nb, block)
    rng = np.random.default_rng(1)
    if pattern == "contiguous":
        sb = db = np.arange(nb)
    else:
        sb, db = rng.permutation(nb), rng.permutation(nb)
    row: dict[str, Any] = {
        "memory": memory,
        "block": block,
        "pattern": pattern,
        "blocks": nb,
        "mib": nb * block / 2**20,
    }

    p = LlmDataDist(1, "prompt", backend="nixl")
    d = LlmDataDist(2, "decoder", backend="nixl")
    p.initialize()
    d.initialize()
    a, _b, local, remote = _raw_pair(buf)  # _b: the target agent stays alive
    try:
        src = p.register_cache(CacheDesc(1, (nb, block), "uint8", buf.src_place), [buf.src_addr])
        dst = d.register_cache(CacheDesc(1, (nb, block), "uint8", buf.dst_place), [buf.dst_addr])
        (link,) = p.link_clusters([d.listen_address])
        if not link.ok:
            raise LLMException(link.status, link.message)
        index, one = CacheIndex(2, dst.cache_id), KvCacheExtParam(tensor_num_per_layer=1)
        li, ri = sb.astype(np.int32), db.astype(np.int32)

        def wrapper():  # from the same int arrays the raw loop uses
            p.push_kv_blocks(src, index, sb, db, one, timeout_s=60)

        def raw():
            _raw_push(a, local, remote, li, ri)

        wrapper()
        row["correct"] = buf.check(sb, db)
        t = _median_times(
            {"wrapper": wrapper, "raw": raw, "baseline": buf.baseline(sb, db)}, pushes, repeats
        )
        t_wrap, t_raw, t_base = t["wrapper"], t["raw"], t["baseline"]
    finally:
        local.release()
        remote.release()
        p.finalize()
        d.finalize()
    nbytes = nb * block
    row.update(
        wrapper_gbs=nbytes / t_wrap / 1e9,
        raw_gbs=nbytes / t_raw / 1e9,
        baseline_gbs=nbytes / t_base / 1e9,
        wrapper_ms=t_wrap * 1e3,
        raw_ms=t_raw * 1e3,
        baseline_ms=t_base * 1e3,
    )
    row["wrapper_vs_raw"] = t_raw / t_wrap
    row["nixl_vs_baseline"] = t_base / t_raw
    row["met"] = row["wrapper_vs_raw"] >= TARGETS["wrapper_vs_raw"] and (
        memory == "host" or row["nixl_vs_baseline"] >= TARGETS["gpu_vs_memcpy"]
    )
    return row


def _machine() -> dict[str, str]:
    try:
        from importlib.metadata import version

        nixl_version = version("nixl")
    except Exception:
        nixl_version = "?"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "python": platform.python_version(),
        "load": f"{os.getloadavg()[0]:.1f}",
        "nixl": nixl_version,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def markdown(info: dict[str, str], rows: list[dict[str, Any]]) -> str:
    base = "NumPy copy" if all(r["memory"] == "host" for r in rows) else "baseline"
    lines = [
        f"{info['cpu']}, {info['cores']} cores (load average {info['load']} at the start), "
        f"nixl {info['nixl']} (UCX), Python {info['python']}, {info['date']}",
        "",
        f"| memory | block | pattern | blocks | MiB/push | wrapper GB/s | raw NIXL GB/s | "
        f"wrapper/raw | {base} GB/s | NIXL/{base} | correct |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        blk = f"{r['block'] >> 10} KiB" if r["block"] < 1 << 20 else f"{r['block'] >> 20} MiB"
        lines.append(
            f"| {r['memory']} | {blk} | {r['pattern']} | {r['blocks']} | "
            f"{r['mib']:.0f} | {r['wrapper_gbs']:.2f} | {r['raw_gbs']:.2f} | "
            f"{r['wrapper_vs_raw']:.2f} | {r['baseline_gbs']:.2f} | "
            f"{r['nixl_vs_baseline']:.2f} | {'yes' if r['correct'] else 'NO'} |"
        )
    return "\n".join(lines + [""] + chart(rows, base)) + "\n"


def chart(rows: list[dict[str, Any]], base: str, width: int = 40) -> list[str]:
    """A text bar chart of the table's three throughputs (renders in any Markdown)."""
    top = max(max(r["wrapper_gbs"], r["raw_gbs"], r["baseline_gbs"]) for r in rows) or 1.0
    out = ["```", f"GB/s (bar = {top / width:.3f} GB/s)"]
    for r in rows:
        blk = f"{r['block'] >> 10} KiB" if r["block"] < 1 << 20 else f"{r['block'] >> 20} MiB"
        for i, (name, key) in enumerate(
            (("wrapper", "wrapper_gbs"), ("raw NIXL", "raw_gbs"), (base, "baseline_gbs"))
        ):
            label = f"{blk} {r['pattern']}" if i == 0 else ""
            bar = "#" * max(1, round(r[key] / top * width))
            out.append(f"{label:<18} {name:<10} {bar} {r[key]:.2f}")
    out.append("```")
    return out
