"""The datadist process tests' helpers (tests/test_datadist_processes.py,
tests/test_datadist_security_processes.py): a tests/support/datadist_node.py process
(:class:`Node`), the ``spawn`` fixture that makes and reaps them, their environment and
the decoding of their tensors."""

from __future__ import annotations

import base64
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from pytrt_kv.datadist import CacheDesc, nixl_unavailable_reason

NIXL_SKIP = nixl_unavailable_reason()
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def _env(**extra):
    env = dict(os.environ)
    # The source tree first when the tests run from it (an installed package otherwise).
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


class Node:
    """A tests/support/datadist_node.py process; replies are read on a thread, waits are bounded."""

    def __init__(self, *args, env=None):
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "datadist_node.py"), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env or _env(),
        )
        self.replies: queue.Queue[dict] = queue.Queue()
        self.stderr: list = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()
        self.hello = self.reply(timeout_s=60)

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith("@@"):
                self.replies.put(json.loads(line[2:]))

    def reply(self, timeout_s=10.0) -> dict:
        try:
            return self.replies.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(
                f"node gave no reply within {timeout_s} s; stderr: {''.join(self.stderr)[-2000:]}"
            ) from None

    def ask(self, timeout_s=10.0, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        r = self.reply(timeout_s)
        assert "error" not in r, r
        return r

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture(name="spawn")
def spawn_fixture():
    """``spawn(*args, env=None)``: a :class:`Node`; all are killed (resumed first) after
    the test. Import ``spawn_fixture`` into a test module to use the fixture ``spawn``."""
    nodes = []

    def make(*args, env=None):
        n = Node(*args, env=env)
        nodes.append(n)
        return n

    yield make
    for n in nodes:
        try:
            os.kill(n.proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        n.kill()


def _tensors(b64: str, desc: CacheDesc):
    raw = np.frombuffer(base64.b64decode(b64), np.uint8)
    return [
        a.view(desc.dtype).reshape(desc.shape)
        for a in raw.reshape(desc.num_tensors, desc.tensor_bytes)
    ]
