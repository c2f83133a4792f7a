"""TensorRT-RTX builds in a helper process that can load the plugin layers.

TensorRT-RTX's ONNX parser ``dlopen``s the unversioned ``libtensorrt_rtx.so`` when it
meets a plugin node, but the ``tensorrt-rtx`` wheels ship only ``libtensorrt_rtx.so.1``:
the ``dlopen`` fails inside a ``noexcept`` function and the process ends ("terminate
called without an active exception"). Loading the library beforehand does not help
(the loader matches by file name or soname, and neither is the unversioned name), and
``LD_LIBRARY_PATH`` is read only when a process starts. So when the unversioned name
does not resolve here, builds run in one long-lived child process whose
``LD_LIBRARY_PATH`` leads to a private folder holding the symlink
``libtensorrt_rtx.so -> .../tensorrt_rtx_libs/libtensorrt_rtx.so.1``
(docs/TENSORRT.md, "TensorRT-RTX").

Protocol: one JSON request per line on the child's stdin; one JSON answer per line on a
pipe of its own (TensorRT's log and the plugins' messages go to stderr, and native code
may print to stdout, so neither can carry answers). The child's stdout and stderr come
back through one more pipe: a thread relays them to this process's stderr and keeps the
plugins' own lines (``[pytrt_kv] ...``, what a plugin prints when it has no TensorRT
logger) so that a failed build's exception carries them too. The child ends each answer's
output with a marker line, so the relay has seen everything before the answer is used.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from .._lib import install_command

UNVERSIONED = "libtensorrt_rtx.so"
#: Line the child writes to its stderr after each request (see the module docstring).
_DONE = "\x00pytrt_kv-rtx-request-done"
#: Set in the helper process (so that it never starts one of its own).
CHILD_ENV = "PYTRT_KV_RTX_CHILD"

_lock = threading.Lock()
_worker: _Worker | None = None


@functools.cache
def plugin_parsing_works_here() -> bool:
    """True when ``libtensorrt_rtx.so`` resolves in this process (what the parser needs)."""
    try:
        ctypes.CDLL(UNVERSIONED)
    except OSError:
        return False
    return True


def _versioned_library() -> Path:
    spec = importlib.util.find_spec("tensorrt_rtx_libs")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        for candidate in sorted(Path(folder).glob(UNVERSIONED + ".*")):
            return candidate
    raise ImportError(
        f"TensorRT-RTX: no {UNVERSIONED}.* in the tensorrt_rtx_libs package "
        f"({folders or 'not installed'}); reinstall it: "
        f"`{install_command('rtx')}`"
    )


class _Worker:
    def __init__(self):
        self.dir = tempfile.TemporaryDirectory(prefix="pytrt_kv_rtx_")
        os.symlink(_versioned_library(), Path(self.dir.name) / UNVERSIONED)
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (self.dir.name, env.get("LD_LIBRARY_PATH", "")) if p
        )
        env["PYTRT_KV_TENSORRT"] = "rtx"
        env[CHILD_ENV] = "1"
        # The child imports the same pytrt_kv as this process (and so finds the same
        # native libraries), whatever the working directory.
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (package_root, env.get("PYTHONPATH", "")) if p
        )
        read_fd, write_fd = os.pipe()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; from pytrt_kv.trt._rtx import serve; "
                "from pytrt_kv.trt.build import build_plan; serve(int(sys.argv[1]), build_plan)",
                str(write_fd),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            pass_fds=(write_fd,),
            text=True,
            errors="replace",
        )
        os.close(write_fd)
        self.answers = os.fdopen(read_fd, "r")
        self.plugin_lines: list[str] = []
        self.done = threading.Event()
        self.relay = threading.Thread(target=self._relay, daemon=True)
        self.relay.start()

    def _relay(self):
        for line in self.proc.stdout:
            if line.rstrip("\n") == _DONE:
                self.done.set()
                continue
            if line.startswith("[pytrt_kv]"):
                self.plugin_lines.append(line.rstrip("\n"))
            try:
                sys.stderr.write(line)
            except (OSError, ValueError):
                pass
        self.done.set()

    def request(self, payload: dict[str, Any]) -> dict[str, Any]:
        self.plugin_lines = []
        self.done.clear()
        try:
            self.proc.stdin.write(json.dumps(payload) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the answer read below reports how the child ended
        line = self.answers.readline()
        self.done.wait(timeout=30)
        if not line:
            code = self.proc.wait()
            raise RuntimeError(
                f"the TensorRT-RTX build process ended (exit status {code}) while "
                f"building {payload.get('onnx_path')}; its log is above"
            )
        return json.loads(line)

    def close(self):
        try:
            if self.proc.poll() is None:
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        self.answers.close()
        self.dir.cleanup()


def _close_worker():
    global _worker
    with _lock:
        if _worker is not None:
            _worker.close()
            _worker = None


atexit.register(_close_worker)


_ERRORS = {
    "ValueError": ValueError,
    "TypeError": TypeError,
    "RuntimeError": RuntimeError,
    "ImportError": ImportError,
    "FileNotFoundError": FileNotFoundError,
}


def build_in_worker(onnx_path: str, kwargs: dict[str, Any]) -> bytes:
    """:func:`pytrt_kv.trt.build_plan` with TensorRT-RTX, run in the helper process; its
    errors are raised here with the same type and message."""
    global _worker
    with _lock:
        if _worker is None or _worker.proc.poll() is not None:
            _worker = _Worker()
        with tempfile.NamedTemporaryFile(dir=_worker.dir.name, suffix=".plan", delete=False) as f:
            out = f.name
        try:
            payload = {
                "onnx_path": str(Path(onnx_path).resolve())
                if Path(onnx_path).exists()
                else str(onnx_path),
                "out": out,
                "kwargs": kwargs,
            }
            try:
                answer = _worker.request(payload)
            except RuntimeError:
                _worker.close()
                _worker = None
                raise
            if not answer.get("ok"):
                message = answer.get("message", "")
                extra = [ln for ln in _worker.plugin_lines if ln not in message]
                if extra:
                    message += "; " + "; ".join(extra)
                raise _ERRORS.get(str(answer.get("type")), RuntimeError)(message)
            return Path(out).read_bytes()
        finally:
            Path(out).unlink(missing_ok=True)


def serve(answer_fd: int, build_plan: Any) -> None:
    """The child's loop (see the module docstring); ``build_plan`` is
    :func:`pytrt_kv.trt.build.build_plan`, passed in by the child's command line so that
    this module does not import the one that imports it."""

    with os.fdopen(answer_fd, "w") as answers:
        for line in sys.stdin:
            req = json.loads(line)
            try:
                plan = build_plan(req["onnx_path"], flavour="rtx", **req["kwargs"])
                Path(req["out"]).write_bytes(plan)
                answer: dict[str, Any] = {"ok": True}
            except Exception as exc:  # every error goes back to the caller, typed
                answer = {"ok": False, "type": type(exc).__name__, "message": str(exc)}
            sys.stdout.flush()
            print(_DONE, file=sys.stderr, flush=True)
            answers.write(json.dumps(answer) + "\n")
            answers.flush()
