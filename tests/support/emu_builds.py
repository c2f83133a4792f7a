"""The emulated device's C++ builds for tests/test_emulator.py (docs/EMULATION.md), made in
the background from the start of the test session.

Three builds (plain, AddressSanitizer + UBSan, ThreadSanitizer) of the emulated device, its
self-test and the plugin harness. Each lives in a fixed folder (PYTRT_KV_EMU_TEST_BUILDS, by
default build/emu-tests in the checkout) with a stamp of everything it was built from
(sources, compiler, options): an unchanged tree runs no CMake at all, a changed one
rebuilds incrementally.

This module is a pytest plugin (tests/conftest.py loads it). When the collected tests
include one that takes the ``emu_build`` fixture, it starts all the work as soon as
collection ends (each build, then its self-test modes, harness cases and, under ASan, the
kernel tests) and moves those tests to the end of the run, so the builds overlap the rest
of the suite. The pytest process itself runs on one core; the work runs beside it, one
command at a time, at a lower priority (``nice``), so it takes the second core of a
2-core machine and not the first. When a test has to wait for its part, the pytest process
is idle, and the work may use every core. What still runs when the session ends (``-x``,
an interrupt) is killed with its process group.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from support.env import REPO, cmake_command, trt_include_dir

#: The fixture whose tests wait for the builds (tests/test_emulator.py defines it).
FIXTURE = "emu_build"
CMAKE = cmake_command()
BUILDS = {"plain": "", "asan+ubsan": "address", "tsan": "thread"}
# Self-test modes (plugins/emu/emuSelfTest.cpp) run in every build, and per sanitizer.
MODES_ANY = ("ok", "illegal", "store1", "load1", "intrinsic1")
MODES_SAN = {
    "": (),
    "address": ("raw_device", "raw_pinned", "ub"),
    "thread": ("race", "streams", "ordered"),
}
# A slice of the kernel tests that covers every kernel and path (both scatter kernels,
# every layout and vector width, rope means; the gather plan at K 1..2048, TBS > 1, pinned
# full caches, skipped rows and tables, quantising random bytes) at a fraction of the grid's
# time. The gather's two costly grid points (K33: 33 ids over 2 steps; K5_tbs3: TBS 3, S 4)
# run once per dtype, one point on each layout, so every pair of dtype, layout and point
# is still run; pinned full caches with rope only. The cases this leaves out took 49% of
# the slice's wall time (2026-11-27, 143 tests; now 130).
_GATHER_PAIRS = [
    ("BSND", "bfloat16-64", "K33"),
    ("TND", "bfloat16-64", "K5_tbs3"),
    ("TND", "float16-8", "K33"),
    ("BSND", "float16-8", "K5_tbs3"),
    ("BSND", "int8-0", "K33"),
    ("TND", "int8-0", "K5_tbs3"),
    ("TND", "float32-4", "K33"),
    ("BSND", "float32-4", "K5_tbs3"),
    ("BSND", "float8_e4m3fn-16", "K33"),
    ("TND", "float8_e4m3fn-16", "K5_tbs3"),
]
KERNEL_SLICE = (
    "bit_exact and ("
    + " or ".join("-".join(p) for p in _GATHER_PAIRS)
    + " or 7x2x64 or 3x9x2) or unaligned or (pinned and not pinned_host_memory[0-) "
    "or skipped or duplicates or out_of_range or zero or (quantise_bit_exact and hnd) "
    "or narrow_chunks or plain_value or (random_bytes and nd and head)"
)
#: The niceness of the background work: below the pytest process, which it must not slow.
NICE = 10


def build_root() -> Path:
    return Path(os.environ.get("PYTRT_KV_EMU_TEST_BUILDS") or REPO / "build" / "emu-tests")


def _digest(sanitize: str) -> str:
    """Everything a build depends on: the CMake and C++ sources, the compilers, the options."""
    h = hashlib.sha256()
    files = [REPO / "CMakeLists.txt", *sorted((REPO / "cmake").rglob("*"))]
    files += sorted((REPO / "plugins").rglob("*"))
    for f in files:
        if f.is_file() and "__pycache__" not in f.parts:
            h.update(str(f.relative_to(REPO)).encode() + b"\0" + f.read_bytes() + b"\0")
    cxx = subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout
    h.update(f"{sanitize}\0{CMAKE}\0{cxx}\0{trt_include_dir()}\0{shutil.which('nvcc')}".encode())
    return h.hexdigest()


class _Gate:
    """How many of the work's commands may run at once: one while other tests run (the
    pytest process has the other core), every core once a test waits for the work."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running = 0
        self._limit = 1

    def widen(self) -> None:
        with self._cond:
            self._limit = max(os.cpu_count() or 1, 1)
            self._cond.notify_all()

    def __enter__(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._running < self._limit)
            self._running += 1

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._running -= 1
            self._cond.notify_all()


_GATE = _Gate()
_PROCS: set[subprocess.Popen] = set()
_PROCS_LOCK = threading.Lock()
_STOPPING = threading.Event()


def _lower_priority() -> None:
    """Lower this thread's priority; on Linux the niceness is per thread and the processes
    it starts inherit it (elsewhere the work runs at the normal priority)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
    except (AttributeError, OSError):
        pass


def _run(cmd, timeout: int, **kw) -> subprocess.CompletedProcess:
    """subprocess.run through the gate, in its own process group (killed with it when the
    session ends)."""
    with _GATE:
        if _STOPPING.is_set():
            raise RuntimeError("the test session ended before this ran")
        proc = subprocess.Popen(
            [str(c) for c in cmd],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            **kw,
        )
        with _PROCS_LOCK:
            _PROCS.add(proc)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            err += f"\n[killed after {timeout} s]"
        finally:
            with _PROCS_LOCK:
                _PROCS.discard(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _build(out: Path, sanitize: str) -> subprocess.CompletedProcess:
    """Configure (once) and build ``out`` unless its stamp says it is current."""
    stamp = out / "pytrt_kv_test_stamp"
    digest = _digest(sanitize)
    if stamp.is_file() and stamp.read_text() == digest:
        return subprocess.CompletedProcess([], 0, "cached: unchanged sources\n", "")
    targets = ["pytrt_kv_emu_selftest", "pytrt_kv_kernels_emu"]
    inc = trt_include_dir()
    if not (out / "CMakeCache.txt").is_file():
        cmd = [
            CMAKE,
            "-S",
            REPO,
            "-B",
            out,
            "-DPYTRT_KV_EMU=ON",
            f"-DPYTRT_KV_EMU_SANITIZE={sanitize}",
        ]
        cmd += ["-DCMAKE_BUILD_TYPE=Release"]
        if inc is not None:
            cmd.append(f"-DTensorRT_INCLUDE_DIR={inc}")
        if shutil.which("ninja"):
            cmd += ["-G", "Ninja"]
        # PYTRT_KV_CUDA_ARCHS picks the CUDA architectures where nvcc exists (one: faster).
        conf = _run(cmd, 600, env=dict(os.environ, PYTRT_KV_CUDA_ARCHS="86"))
        if conf.returncode != 0:
            return conf
    if inc is not None:
        targets.append("pytrt_kv_plugin_harness_emu")
    # -j1: one compiler at a time (the gate decides how many commands run at once).
    b = _run([CMAKE, "--build", out, "-j1", "--target", *targets], 2400)
    if b.returncode == 0:
        stamp.write_text(digest)
    return b


def san_env(sanitize: str) -> dict[str, str]:
    env = dict(os.environ)
    env["ASAN_OPTIONS"] = "detect_leaks=0:abort_on_error=0"
    env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
    env["TSAN_OPTIONS"] = "halt_on_error=0"
    return env


_CASES_LOCK = threading.Lock()
_TEMP_DIRS: list[Path] = []


@functools.cache
def _harness_cases_once() -> list[str]:
    out = Path(tempfile.mkdtemp(prefix="pytrt_kv_harness_cases_"))
    _TEMP_DIRS.append(out)
    gen = _run(
        [sys.executable, REPO / "plugins" / "harness" / "makeCases.py", out],
        300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert gen.returncode == 0, gen.stderr
    return sorted(str(p) for p in out.iterdir() if (p / "case.txt").is_file())


def _harness_cases() -> list[str]:
    """The harness cases, generated once for all builds (the builds' threads ask at once)."""
    with _CASES_LOCK:
        return _harness_cases_once()


def _kernel_slice(out: Path, sanitize: str) -> subprocess.CompletedProcess:
    """The kernel tests' slice in a second pytest with the sanitizer runtime preloaded."""
    runtime = _run(["g++", "-print-file-name=libasan.so"], 60).stdout.strip()
    env = san_env(sanitize)
    env.update(
        LD_PRELOAD=runtime,
        PYTRT_KV_LIB_DIR=str(out / "lib"),
        PYTHONPATH=os.pathsep.join(
            p for p in (str(REPO / "tests"), str(REPO), os.environ.get("PYTHONPATH", "")) if p
        ),
    )
    tests = [
        REPO / "tests" / f
        for f in ("test_ops_scatter.py", "test_ops_gather.py", "test_quantise.py")
    ]
    # -s: a sanitizer's report goes to this pytest's stderr, where the test reads it (with
    # pytest's capture it went into the capture file, lost when the sanitizer ends the
    # process: returncode 1, no output).
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "--device", "emu"]
    return _run([*cmd, "-k", KERNEL_SLICE, *tests], 1800, env=env, cwd=REPO / "tests")


class Work:
    """One build's background work: the build, then what runs on it."""

    def __init__(self, sanitize: str):
        self.sanitize = sanitize
        self.out = build_root() / (sanitize or "plain")
        self.results: dict[str, concurrent.futures.Future] = {
            k: concurrent.futures.Future()
            for k in ("build", "harness", "kernels", *MODES_ANY, *MODES_SAN[sanitize])
        }
        threading.Thread(target=self._run, daemon=True).start()

    def _set(self, key: str, fn) -> None:
        try:
            self.results[key].set_result(fn())
        except BaseException as e:  # a timeout or missing tool: the test waiting on it says so
            self.results[key].set_exception(e)

    def _run(self) -> None:
        _lower_priority()
        self.out.mkdir(parents=True, exist_ok=True)
        self._set("build", lambda: _build(self.out, self.sanitize))
        built = self.results["build"]
        if built.exception() is not None or built.result().returncode != 0:
            for f in self.results.values():
                if not f.done():
                    f.set_exception(RuntimeError("the build failed"))
            return
        exe = self.out / "bin" / "pytrt_kv_emu_selftest"
        for mode in (*MODES_ANY, *MODES_SAN[self.sanitize]):
            self._set(mode, lambda m=mode: _run([exe, m], 300, env=san_env(self.sanitize)))
        harness = self.out / "bin" / "pytrt_kv_plugin_harness_emu"
        if trt_include_dir() is not None:
            cases = _harness_cases()
            self._set(
                "harness",
                lambda: (
                    len(cases),
                    _run([harness, "run", *cases], 1800, env=san_env(self.sanitize)),
                ),
            )
        else:
            self.results["harness"].set_result(None)
        if self.sanitize == "address":
            self._set("kernels", lambda: _kernel_slice(self.out, self.sanitize))
        else:
            self.results["kernels"].set_result(None)

    def get(self, key: str):
        """Wait for ``key``'s result; the pytest process is idle meanwhile, so the work
        may take every core."""
        f = self.results[key]
        if not f.done():
            _GATE.widen()
        # Generous: on a shared 2-core machine the three builds and their runs queue up.
        return f.result(timeout=3600)


_WORK: dict[str, Work] = {}
_WORK_LOCK = threading.Lock()


def work(sanitize: str) -> Work:
    """The background work of one build, all three started on the first call."""
    with _WORK_LOCK:
        if not _WORK:
            for s in BUILDS.values():
                _WORK[s] = Work(s)
        return _WORK[sanitize]


def _wanted(items) -> list:
    return [i for i in items if FIXTURE in getattr(i, "fixturenames", ())]


def pytest_collection_modifyitems(items) -> None:
    """The tests that wait for the builds run last: the builds have the whole run to finish."""
    waiting = _wanted(items)
    if waiting:
        ids = {id(i) for i in waiting}
        items[:] = [i for i in items if id(i) not in ids] + waiting


def pytest_collection_finish(session) -> None:
    """Start the work once the tests are known (after -k and deselection), if one needs it."""
    if _wanted(session.items) and CMAKE is not None and not session.config.option.collectonly:
        work("")


def pytest_sessionfinish() -> None:
    """Kill what still runs (an early end: -x, a keyboard interrupt) and remove the cases."""
    _STOPPING.set()
    with _PROCS_LOCK:
        for proc in _PROCS:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for d in _TEMP_DIRS:
        shutil.rmtree(d, ignore_errors=True)
