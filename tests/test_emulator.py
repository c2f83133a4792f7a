"""The emulated device (docs/EMULATION.md): what it claims to check, each shown to work.

- Work counters: the gather's copy kernel moves exactly the copied tokens' bytes (its work
  is proportional to misses, by construction), the scatter exactly T rows.
- Schedules: the plan kernel's results do not depend on the order threads run between
  barriers (forward, reverse, random with yields at atomics).
- Faults: a kernel access outside live device/pinned memory is a sticky
  cudaErrorIllegalAddress, reported by the next synchronizing call, as on a GPU.
- Faults at the source line: one element past an allocation by a plain store, a plain
  load or an intrinsic is reported with the kernel, thread and file:line.
- Streams: two threads' per-thread default streams race visibly when they share a
  workspace (issue 16's C3 keying put back), never with pytrt_kv's keying.
- Sanitizer builds (CMake, PYTRT_KV_EMU_SANITIZE): the harness `run` cases and the kernel
  tests are clean under AddressSanitizer + UBSan and ThreadSanitizer, and an injected bug
  is reported by each (pytrt_kv_emu_selftest): a raw one-byte overflow of device and
  pinned memory (ASan), undefined behaviour (UBSan), a missing barrier and two unordered
  streams (TSan). The builds are made once, cached by content and run in the background
  from the start of the session (tests/support/emu_builds.py); their tests run last.

Everything here runs without a GPU; the Python half needs the emulated kernel library
(built by scripts/test.sh), the C++ half cmake and g++.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pytrt_kv import _lib
from support import emu_builds
from support.emu_builds import BUILDS, CMAKE
from support.env import REPO, trt_include_dir

emu_lib = pytest.mark.skipif(
    _lib.find(_lib.EMU_KERNELS_LIB) is None,
    reason=f"{_lib.EMU_KERNELS_LIB} not built (scripts/test.sh builds it: -DPYTRT_KV_EMU=ON)",
)


def _emu_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, _lib.DEVICE_ENV: "emu", **extra}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO / "tests"), env.get("PYTHONPATH", "")) if p
    )
    return env


def _in_emulator(code: str, **env: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter on the emulated device (the device choice and
    the schedule are read when the library loads)."""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        env=_emu_env(**env),
        cwd=REPO / "tests",
    )


# --- work counters ------------------------------------------------------------------------

_GATHER_WORK = r"""
import json, sys
import numpy as np
from pytrt_kv import ops
from pytrt_kv._cuda import DeviceArray, emu
from pytrt_kv.reference import gather_selection_kv_cache as ref_gather

rng = np.random.default_rng(5)
B, K, TBS, BS, KV, ROPE = 2, 100, 4, 16, 48, 8
fmax = 64
kv_len = fmax * BS
R = B
smax = K * TBS // BS
sel_kv = np.zeros((R * smax, BS, KV), np.float16)
sel_rope = np.zeros((R * smax, BS, ROPE), np.float16)
sel_table = np.arange(R * smax, dtype=np.int32).reshape(R, smax)
status = np.full((B, 1, 1, K + 1), -1, np.int32)
status[..., K] = 0
full_kv = rng.standard_normal((B * fmax, BS, KV)).astype(np.float16)
full_rope = rng.standard_normal((B * fmax, BS, ROPE)).astype(np.float16)
full_table = np.arange(B * fmax, dtype=np.int32).reshape(B, fmax)
kv = np.full(B, kv_len, np.int32)
q = np.ones(B, np.int32)
# ids never include the newest tokens or the partial tail: every kept id may stay in place
ids_pool = np.arange(kv_len // TBS - 2)
prev = np.stack([rng.choice(ids_pool, K, replace=False) for _ in range(B)])
out = []
for overlap in (0.0, 0.5, 0.9, 0.99, 0.0):
    keep = int(round(overlap * K))
    topk = np.empty((B, K), np.int32)
    for b in range(B):
        kept = rng.choice(prev[b], keep, replace=False)
        fresh = rng.choice(np.setdiff1d(ids_pool, prev[b]), K - keep, replace=False)
        topk[b] = rng.permutation(np.concatenate([kept, fresh]))
    prev = topk.copy()
    topk4 = topk.reshape(B, 1, 1, K)
    args = [sel_rope, sel_kv, sel_table, status, topk4, full_rope, full_kv, full_table, kv, q]
    dev = [DeviceArray.from_numpy(a) for a in args]
    want_status = status.copy()
    ref_args = [a.copy() for a in args]
    ref_gather(*ref_args, selection_topk_block_size=TBS)
    emu.take_launches()
    got = ops.gather_selection_kv_cache(*dev, selection_topk_block_size=TBS)
    launches = emu.take_launches()
    new_status = dev[3].get()
    assert (new_status == ref_args[3]).all()
    assert (dev[1].get().view(np.uint16) == ref_args[1].view(np.uint16)).all()
    # Kept ids stay in place (none is the partial tail, reserved or among the newest
    # tokens); every other id is copied into a free slot.
    copied = B * (K - keep) if overlap or len(out) else B * K
    out.append({"overlap": overlap, "launches": launches, "copied_ids": copied})
    status = new_status
    sel_kv, sel_rope = dev[1].get(), dev[0].get()
print(json.dumps(out))
"""


@emu_lib
def test_gather_copy_work_is_the_copied_tokens_bytes():
    r = _in_emulator(_GATHER_WORK)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    steps = json.loads(r.stdout.strip().splitlines()[-1])
    tbs, kv, rope, item = 4, 48, 8, 2
    row_bytes = (kv + rope) * item
    for step in steps:
        names = [x["name"] for x in step["launches"]]
        assert names == ["gatherPlanKernel", "gatherCopyKernel"], names
        plan, copy = step["launches"]
        # The plan moves no cache bytes through the copy intrinsics; the copy moves exactly
        # the copied ids' tokens (every id is whole here: TBS tokens), read once, written once.
        assert plan["bytes_read"] == 0 and plan["bytes_written"] == 0
        want = step["copied_ids"] * tbs * row_bytes
        assert step["copied_ids"] > 0
        assert copy["bytes_read"] == want and copy["bytes_written"] == want, (step, want)
    by_overlap = {s["overlap"]: s["copied_ids"] for s in steps[:4]}
    # 2 rows x 100 ids: what is not kept is copied (0% -> all, 99% -> 1 per row).
    assert by_overlap == {0.0: 200, 0.5: 100, 0.9: 20, 0.99: 2}


_SCATTER_WORK = r"""
import json
import numpy as np
from pytrt_kv import ops
from pytrt_kv._cuda import DeviceArray, emu
rng = np.random.default_rng(1)
out = []
for layout in ("nd", "hnd", "nz"):
    T, H, D, NB, BS = 37, 2, 64, 8, 16
    slots = rng.permutation(NB * BS)[:T].astype(np.int32)
    slots[::5] = -1  # padding: never read, never written
    key = DeviceArray.from_numpy(rng.standard_normal((T, H, D)).astype(np.float16))
    val = DeviceArray.from_numpy(rng.standard_normal((T, H, D)).astype(np.float16))
    shape = {"nd": (NB, BS, H, D), "hnd": (NB, H, BS, D), "nz": (NB, H * D // 16, BS, 16)}[layout]
    kc = DeviceArray(shape, np.float16)
    vc = DeviceArray(shape, np.float16)
    emu.take_launches()
    ops.scatter_pa_kv_cache(key, val, kc, vc, DeviceArray.from_numpy(slots), cache_layout=layout)
    out.append({"layout": layout, "rows": int((slots >= 0).sum()), "launches": emu.take_launches()})
print(json.dumps(out))
"""


@emu_lib
def test_scatter_moves_exactly_the_written_rows():
    r = _in_emulator(_SCATTER_WORK)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for step in json.loads(r.stdout.strip().splitlines()[-1]):
        (launch,) = step["launches"]
        assert launch["name"] == "scatterTokensKernel"
        row = 2 * 64 * 2  # H * D * itemsize, key and value alike
        # Source rows are loaded before the slot test (latency overlap); only valid rows
        # are stored.
        assert launch["bytes_written"] == step["rows"] * row * 2, step
        assert launch["bytes_read"] == 37 * row * 2, step


# --- schedules and faults -----------------------------------------------------------------

_SCHEDULE = r"""
import numpy as np
from support import device as dv
from support.arrays import assert_same_bits
from test_ops_gather import Case, run_step, to_device_args

rng = np.random.default_rng(11)
for K, tbs, sbs, fbs, S in ((2048, 1, 128, 128, 1), (40, 4, 8, 8, 2), (5, 3, 9, 6, 4)):
    fmax = max(-(-K * tbs * 2 // fbs), 4)
    case = Case(rng, B=2, S=S, K=K, tbs=tbs, sbs=sbs, fbs=fbs, kv=32, rope=8, fmax=fmax)
    dev = to_device_args(case, host_full=False)
    for step, reuse in enumerate((0.0, 0.7, 0.95)):
        if step:
            case.advance()
        case.new_topk(reuse)
        run_step(case, dev, host_full=False)
print("ok")
"""


@emu_lib
@pytest.mark.parametrize("schedule", ["reverse", "random:1", "random:2"])
def test_plan_results_do_not_depend_on_the_thread_schedule(schedule):
    r = _in_emulator(_SCHEDULE, PYTRT_KV_EMU_SCHEDULE=schedule)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (
        r.stdout[-3000:] + r.stderr[-3000:]
    )


_FAULT = r"""
import ctypes
import numpy as np
from pytrt_kv import _cuda, ops
from pytrt_kv._cuda import DeviceArray, emu

key = DeviceArray.from_numpy(np.ones((4, 1, 8), np.float16))
cache = DeviceArray((2, 4, 1, 8), np.float16)
slots = DeviceArray.from_numpy(np.arange(4, dtype=np.int32))
# The kernel is handed a cache pointer with no allocation behind it (a caller bug):
p = _cuda.ScatterParams()
p.key, p.keyCache, p.slotMapping = key.ptr, 4096, slots.ptr
p.keyType = p.valueType = _cuda.DTYPE_CODE["float16"]
p.indexType = _cuda.DTYPE_CODE["int32"]
p.layout = _cuda.LAYOUT_CODE["nd"]
p.numTokens, p.numHeads, p.headSizeK, p.headSizeV, p.numBlocks, p.blockSize = 4, 1, 8, 8, 2, 4
lib = _cuda.kernels()
assert lib.pytrt_kv_scatter_pa_kv_cache(ctypes.byref(p), None, -1) == 0  # asynchronous
try:
    cache.get()
except RuntimeError as e:
    print("raised:", e)
try:
    ops.scatter_pa_kv_cache(key, None, cache, None, slots)  # sticky, as on a GPU
except RuntimeError as e:
    print("sticky:", e)
emu.reset()
ops.scatter_pa_kv_cache(key, None, cache, None, slots)
assert (cache.get()[0, :, 0] == 1).all()
print("recovered")
"""


@emu_lib
def test_illegal_address_is_a_sticky_error_naming_kernel_and_thread():
    r = _in_emulator(_FAULT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "illegal address: store of 16 bytes" in r.stderr and "scatterTokensKernel" in r.stderr
    assert "raised: copy to host: CUDA error 700" in r.stdout, r.stdout
    assert "sticky:" in r.stdout and "recovered" in r.stdout, r.stdout


@emu_lib
def test_info_names_the_emulated_device():
    r = subprocess.run(
        [sys.executable, "-m", "pytrt_kv", "info"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_emu_env(),
    )
    assert r.returncode == 0, r.stderr
    assert "device in use      emulated device (pytrt_kv, CPU)" in r.stdout, r.stdout
    assert "PYTRT_KV_DEVICE=emu" in r.stdout


def test_unknown_device_choice_names_the_variable(monkeypatch):
    monkeypatch.setenv(_lib.DEVICE_ENV, "gpu0")
    with pytest.raises(ValueError, match="PYTRT_KV_DEVICE: expected 'emu' or 'cuda'.*'gpu0'"):
        _lib.emulated()


# --- streams: a race between two streams is visible ----------------------------------------

_STREAM_RACE = r"""
import json, sys, threading
import numpy as np
from pytrt_kv import ops
from pytrt_kv._cuda import WorkspaceCache, emu
from pytrt_kv.reference import gather_selection_kv_cache as ref_gather
from support import device as dv
from test_ops_gather import Case, op_args, to_device_args

if sys.argv[1] == "c3":  # issue 16's C3 put back: one workspace per handle, whatever the thread
    WorkspaceCache.key = staticmethod(lambda device, stream: (device, stream, 0))
rng = np.random.default_rng(3)
PER_THREAD = 2  # cudaStreamPerThread: one handle, a different stream in each thread


def make(B, K):
    case = Case(rng, B=B, S=1, K=K, tbs=1, sbs=16, fbs=16, kv=32, rope=8, fmax=8)
    case.new_topk(0.0)
    return case


# The larger workspace first, so that (with C3's keying) both threads then take it as is.
warm = to_device_args(make(3, 64), False)
ops.gather_selection_kv_cache(*op_args(warm), selection_topk_block_size=1, stream=PER_THREAD)
dv.synchronize()
rounds, keep = [], []
for _ in range(6):
    cases = [make(2, 40), make(3, 24)]
    devs = [to_device_args(c, False) for c in cases]  # uploads synchronize: before the threads
    wants = [ref_gather(*c.args(), selection_topk_block_size=1) for c in cases]
    outs = [None, None]
    go = threading.Barrier(2)

    def work(i):
        go.wait()
        outs[i] = ops.gather_selection_kv_cache(
            *op_args(devs[i]), selection_topk_block_size=1, stream=PER_THREAD
        )

    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        dv.synchronize()  # both threads' work runs here, the two streams interleaved
        right = all(
            dv.to_numpy(outs[i]).tolist() == wants[i].tolist()
            and dv.to_numpy(devs[i][3]).tolist() == cases[i].status.tolist()
            and (dv.to_numpy(devs[i][1]).view(np.uint16) == cases[i].sel_kv.view(np.uint16)).all()
            for i in (0, 1)
        )
        rounds.append("right" if right else "wrong")
    except RuntimeError as e:
        rounds.append("error: " + str(e)[:60])
        emu.reset()
    keep.append((devs, outs))  # nothing freed (a free synchronizes) while threads issue work
print(json.dumps(rounds))
"""


@emu_lib
@pytest.mark.parametrize("keying", ["c3", "per_thread"])
def test_two_threads_per_thread_streams_race_only_with_a_shared_workspace(keying):
    """Two threads gather on their per-thread default streams, unsynchronized. With the
    workspace keyed per thread (pytrt_kv's) every round is right; with issue 16's C3
    keying put back, the seeded interleaving of the two streams makes one thread's copy
    read the other's plan: wrong data or an illegal address (with PYTRT_KV_EMU_STREAMS=issue,
    one queue in issue order as before, all six rounds came out right)."""
    r = _in_emulator(_STREAM_RACE.replace("sys.argv[1]", repr(keying)))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rounds = json.loads(r.stdout.strip().splitlines()[-1])
    if keying == "per_thread":
        assert rounds == ["right"] * 6, rounds
    else:
        assert any(x != "right" for x in rounds), rounds


# --- the C++ builds: made once, cached by content, run in the background ---------------------
#
# Three builds (plain, AddressSanitizer + UBSan, ThreadSanitizer) of the emulated device, its
# self-test and the plugin harness: tests/support/emu_builds.py starts them when the session
# starts (cached by content) and runs these tests last, so the builds overlap the rest of
# the suite; each test below waits for its part and checks it.


@pytest.fixture(params=list(BUILDS.values()), ids=list(BUILDS))
def emu_build(request):
    if CMAKE is None:
        pytest.skip("cmake not installed (the test extra installs it)")
    work = emu_builds.work(request.param)
    b = work.get("build")
    assert b.returncode == 0, b.stdout[-6000:] + b.stderr[-6000:]
    return work


def _source_line(path: str, marker: str) -> str:
    """``file:line`` of the first line of ``path`` (under plugins/) containing ``marker``."""
    lines = (REPO / "plugins" / path).read_text().splitlines()
    (n,) = [i + 1 for i, line in enumerate(lines) if marker in line][:1]
    return f"{Path(path).name}:{n}"


def test_selftest_valid_run_is_clean(emu_build):
    r = emu_build.get("ok")
    assert r.returncode == 0 and "selftest ok: cudaSuccess" in r.stdout, r.stdout + r.stderr[-4000:]
    assert "Sanitizer" not in r.stderr and "runtime error" not in r.stderr, r.stderr[-4000:]


@pytest.mark.parametrize(
    "mode, access, where",
    [
        ("illegal", "store of 16 bytes", ("kernels/kvDispatch.cuh", "__stwb(reinterpret_cast<V*>")),
        (
            "store1",
            "store of 4 bytes",
            ("kernels/gatherPlan.h", "storeGlobal(a.actualSeq + row.r, total)"),
        ),
        ("load1", "load of 4 bytes", ("kernels/gatherPlan.h", "loadGlobal(a.kvLen + b)")),
        (
            "intrinsic1",
            "store of 16 bytes",
            ("kernels/kvDispatch.cuh", "__stwb(reinterpret_cast<V*>"),
        ),
    ],
)
def test_one_element_overflows_are_reported_at_their_source_line(emu_build, mode, access, where):
    """Any build: an access one element past an allocation (exact sizes, not rounded up)
    by a plain store, a plain load and an intrinsic is an illegal address, reported with the
    kernel, the thread and the source line of the access."""
    r = emu_build.get(mode)
    assert r.returncode == 1 and "cudaErrorIllegalAddress" in r.stdout, r.stdout + r.stderr[-3000:]
    kernel = "gatherCopyKernel" if "Dispatch" in where[0] else "gatherPlanKernel"
    line = _source_line(*where)
    assert f"illegal address: {access}" in r.stderr and kernel in r.stderr, r.stderr[-3000:]
    assert f"{line}) by thread" in r.stderr, (line, r.stderr[-3000:])


def test_each_sanitizer_reports_its_injected_bug(emu_build):
    sanitize = emu_build.sanitize
    if sanitize == "address":
        for mode in (
            "raw_device",
            "raw_pinned",
        ):  # one byte past 13 bytes: seen since allocations are not rounded up
            r = emu_build.get(mode)
            assert "AddressSanitizer: heap-buffer-overflow" in r.stderr, (mode, r.stderr[-4000:])
            assert "WRITE of size 1" in r.stderr and "rawStoreKernel" in r.stderr, r.stderr[-4000:]
            assert _source_line("emu/emuSelfTest.cpp", "p[n] = 1;") in r.stderr, r.stderr[-4000:]
        r = emu_build.get("ub")
        assert "runtime error: shift exponent 32" in r.stderr, r.stderr[-4000:]
    elif sanitize == "thread":
        r = emu_build.get("race")
        assert "ThreadSanitizer: data race" in r.stderr, r.stderr[-4000:]
        assert "gatherPlanKernel" in r.stderr
        r = emu_build.get("streams")  # two streams, nothing ordering them
        assert "ThreadSanitizer: data race" in r.stderr and "fillKernel" in r.stderr, r.stderr[
            -4000:
        ]
        r = emu_build.get("ordered")  # the same, ordered by a stream synchronize: clean
        assert r.returncode == 0 and "ThreadSanitizer" not in r.stderr, r.stderr[-4000:]
    else:
        pytest.skip("the plain build has no sanitizer: its checks are the emulator's own (above)")


def test_harness_run_cases_on_the_emulated_device(emu_build):
    """The plugins' enqueue, bit-exact against the reference on every harness case,
    plain and under each sanitizer."""
    if trt_include_dir() is None:
        pytest.skip("TensorRT headers: set TensorRT_INCLUDE_DIR (or TensorRT_ROOT)")
    n, r = emu_build.get("harness")
    assert n >= 60
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert f"harness run: {n} cases" in r.stdout and " 0 failed" in r.stdout, r.stdout
    assert "Sanitizer" not in r.stderr and "runtime error" not in r.stderr, r.stderr[-4000:]


def test_kernel_tests_under_the_sanitizer(emu_build):
    """Under AddressSanitizer + UBSan, a slice of the Python kernel tests. (The plain build
    runs the whole kernel suite, tests/test_ops_*.py; ThreadSanitizer cannot be preloaded
    into an uninstrumented Python, so the TSan build runs the harness cases and the
    self-test instead.)"""
    if emu_build.sanitize != "address":
        pytest.skip(f"the {emu_build.sanitize or 'plain'} build: see the docstring")
    r = emu_build.get("kernels")
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-5000:]
    assert " passed" in r.stdout and " failed" not in r.stdout, r.stdout[-2000:]
    assert "Sanitizer" not in r.stderr and "runtime error" not in r.stderr, r.stderr[-4000:]


def test_cuda_architectures_come_from_the_environment(emu_build):
    """The configure ran with PYTRT_KV_CUDA_ARCHS=86 (docs/TENSORRT.md)."""
    cache = (emu_build.out / "CMakeCache.txt").read_text()
    if "CMAKE_CUDA_ARCHITECTURES:" not in cache:
        pytest.skip("no nvcc here: the CUDA architectures are not configured")
    assert "CMAKE_CUDA_ARCHITECTURES:STRING=86\n" in cache
