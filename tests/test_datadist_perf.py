"""Costs of the NIXL backend that are not speed (speed: BENCHMARKS.md): an idle node
does not burn a core (issue 19 item 7, docs/DATADIST.md "Idle CPU"), measured as CPU
time, not wall time."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pytrt_kv.datadist import (
    CacheDesc,
    CacheIndex,
    KvCacheExtParam,
    LlmDataDist,
    nixl_unavailable_reason,
)

NIXL_SKIP = nixl_unavailable_reason()
pytestmark = pytest.mark.skipif(NIXL_SKIP is not None, reason=str(NIXL_SKIP))
HERE = Path(__file__).resolve().parent


@pytest.fixture
def decoder():
    """A tests/support/datadist_node.py decoder (protocol: tests/test_datadist_processes.py)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE.parent), env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "support" / "datadist_node.py"), "--cluster-id", "2"]
        + ["--role", "decoder", "--cache", "1,8x64,uint8"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )

    def ask(**cmd) -> dict:
        if cmd:
            proc.stdin.write(json.dumps(cmd) + "\n")
            proc.stdin.flush()
        for line in proc.stdout:  # the node bounds its own waits (read: 5 s)
            if line.startswith("@@"):
                return json.loads(line[2:])
        raise AssertionError(f"the node exited with {proc.wait(timeout=10)}")

    try:
        yield ask
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _cpu_s(pid: int | str = "self") -> float:
    """utime + stime of a process, all its threads (/proc/PID/stat fields 14, 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")
def test_idle_nodes_do_not_burn_a_core_and_still_push(decoder):
    # A decoder in its own process and a prompt node here, both with the default options.
    hello = decoder()
    p = LlmDataDist(1, "prompt", backend="nixl")
    p.initialize("127.0.0.1", 0)
    try:
        src = p.allocate_cache(CacheDesc(1, (8, 64), "uint8"))
        src.tensors[0][...] = np.arange(8, dtype=np.uint8)[:, None]
        assert [r.cluster_id for r in p.link_clusters([tuple(hello["addr"])], timeout_s=5)] == [2]
        pid = hello["pid"]
        # Idle: NIXL's default progress thread spins (a whole core per node on an idle
        # host); ours sleeps (the default options["nixl.progress_delay_us"]). A spinning
        # thread gets whatever share of a core the machine's load leaves it (0.16 s per
        # second with 8 jobs on 2 cores, less with more), so the nodes' CPU time is
        # compared with that of a busy loop measured over the same window: one spinning
        # thread gets about what the busy loop gets, a sleeping node a small part of it.
        # The link's own work ends first (the handshake's connection threads, the peer's
        # metadata loaded in the background): 0.5 s, then 2 s of idle measured.
        spinner = subprocess.Popen(
            [sys.executable, "-c", "import time\nend = time.monotonic() + 30\n"
             "while time.monotonic() < end: pass"]
        )  # fmt: skip
        try:
            time.sleep(0.5)
            t0 = time.monotonic()
            here0, there0, spin0 = _cpu_s(), _cpu_s(pid), _cpu_s(spinner.pid)
            time.sleep(2.0)
            here1, there1, spin1 = _cpu_s(), _cpu_s(pid), _cpu_s(spinner.pid)
            wall = time.monotonic() - t0
        finally:
            spinner.kill()
            spinner.wait(10)
        here, there, spin = (
            (b - a) / wall for a, b in ((here0, here1), (there0, there1), (spin0, spin1))
        )
        assert spin > 0.02, f"the busy loop got {spin:.3f} s/s: too loaded to measure"
        # Measured here (2026-11-27, load average 12 on 2 cores): the nodes 0.0-0.005 s/s
        # against the busy loop's 0.41; with the progress delay mutated to 0 (either at
        # the option or at pthrDelay) a node got 0.12-0.13 s/s, as much as the busy loop.
        assert there < 0.5 * spin and here < 0.5 * spin, (there, here, spin)
        # ... and a push still completes with the defaults.
        index = CacheIndex(2, hello["cache"])
        one = KvCacheExtParam(tensor_num_per_layer=1)
        tag = p.push_kv_blocks(src, index, [3, 5], [0, 7], one, tag="idle")
        got = decoder(cmd="read", tag=tag)["data"]
        raw = np.frombuffer(base64.b64decode(got), np.uint8).reshape(8, 64)
        assert (raw[0] == 3).all() and (raw[7] == 5).all() and (raw[1:7] == 99).all()
    finally:
        p.finalize()


@pytest.mark.parametrize("n", [2, 64, 65, 500])
def test_check_transfer_fast_paths_refuse_like_the_general_ones(n):
    """check_transfer takes a set below 65 destination ids and bincount above (the
    small-push fast path, issue 19): both refuse a repeated id, naming it, and an id out
    of range, naming its position."""
    from pytrt_kv.datadist import LLMParamInvalid, check_transfer

    desc = CacheDesc(1, (1000, 4), "int8")
    one = KvCacheExtParam(tensor_num_per_layer=1)
    ids = np.arange(n) * 2
    dup = ids.copy()
    dup[-1] = dup[0]
    with pytest.raises(LLMParamInvalid, match="block 0 more than once"):
        check_transfer(desc, desc, ids, dup, one)
    bad = ids.copy()
    bad[-1] = 1000
    with pytest.raises(LLMParamInvalid, match=rf"src_blocks\[{n - 1}\]"):
        check_transfer(desc, desc, bad, ids, one)
    assert check_transfer(desc, desc, ids, ids[::-1].copy(), one).num_copies == n


@pytest.mark.parametrize(
    "key, value",
    [("nixl.progress_delay_us", -1), ("nixl.progress_delay_us", 1.5), ("nixl.progress_thread", 1)],
)
def test_progress_options_are_checked(key, value):
    node = LlmDataDist(1, "prompt", backend="nixl", options={key: value})
    with pytest.raises(TypeError, match=rf"options\['{key}'\]: expected"):
        node.initialize("127.0.0.1", 0)
    node.finalize()
