"""The session's memory limit (tests/conftest.py, README "Run the whole test suite"): a
pytest session whose process peaked above ``PYTRT_KV_TEST_MAX_RSS_GB`` fails, naming the
limit and the value; a malformed limit is refused before any test runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_nothing():
    """The test the sessions below run."""


def _session(limit: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTRT_KV_TEST_MAX_RSS_GB=limit)
    node = f"{Path(__file__).relative_to(REPO).as_posix()}::test_nothing"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.parametrize(
    "limit, code, message",
    [
        ("64", 0, r"pytest process: \d+\.\d\d GiB \(limit 64 GiB\)"),
        ("0.001", 1, r"FAILED memory limit: pytest process peaked at \d+\.\d\d GiB, above "
                     r"the 0\.001 GiB limit \(PYTRT_KV_TEST_MAX_RSS_GB\)"),
        ("four", 4, r"PYTRT_KV_TEST_MAX_RSS_GB: expected a positive number of GiB, got 'four'"),
    ],
)  # fmt: skip
def test_a_session_above_the_limit_fails(limit, code, message):
    import re

    r = _session(limit)
    out = r.stdout + r.stderr
    assert r.returncode == code, out
    assert re.search(message, out), out
