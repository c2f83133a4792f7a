"""Keying of the eager gather's workspace cache (issue 16, C3): default-stream handles are
per thread, explicit streams are shared (work on one stream runs in order)."""

import threading

import pytest

from pytrt_kv._cuda import WorkspaceCache


def _key_in_thread(device: int, stream: int):
    out = []
    t = threading.Thread(target=lambda: out.append(WorkspaceCache.key(device, stream)))
    t.start()
    t.join()
    return out[0]


@pytest.mark.parametrize("stream", WorkspaceCache.DEFAULT_STREAM_HANDLES)
def test_default_stream_handles_are_keyed_per_thread(stream):
    here = WorkspaceCache.key(0, stream)
    assert here == WorkspaceCache.key(0, stream)
    assert here != _key_in_thread(0, stream)


def test_explicit_stream_is_shared_across_threads():
    assert WorkspaceCache.key(0, 0x7F00AB) == _key_in_thread(0, 0x7F00AB)
    assert WorkspaceCache.key(0, 0x7F00AB) != WorkspaceCache.key(1, 0x7F00AB)


def test_empty_request_allocates_nothing():
    assert WorkspaceCache().get(0, 2, 0) == (0, 0)


@pytest.mark.gpu
def test_two_threads_on_per_thread_stream_get_distinct_workspaces():
    cache = WorkspaceCache()
    got: list = []

    def worker(n):
        got.append(cache.get(0, 2, n))

    threads = [threading.Thread(target=worker, args=(n,)) for n in (1 << 12, 1 << 20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (p0, n0), (p1, n1) = got
    assert p0 != 0 and p1 != 0
    lo, hi = sorted([(p0, n0), (p1, n1)])
    assert lo[0] + lo[1] <= hi[0], "per-thread workspaces overlap"
