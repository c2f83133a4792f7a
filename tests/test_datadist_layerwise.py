"""Layer-wise push (issue 19, docs/DATADIST.md "Layer-wise push"): each layer moves when
marked ready (at once on the CPU, once its event completes on a GPU: a fake event
here), the destination sees the tag only after every layer, and the result is the
reference's whole-cache push."""

from __future__ import annotations

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
    LayerwisePush,
    LlmDataDist,
    LLMException,
    LLMStatus,
    push_kv_blocks_reference,
)
from support.datadist import BACKENDS, NIXL_ONLY

SENTINEL = -5
REPO = Path(__file__).resolve().parents[1]


class FakeEvent:
    """A CUDA event stand-in: ``query()`` is False until ``fire()``."""

    def __init__(self):
        self.fired = False

    def query(self) -> bool:
        return self.fired

    def fire(self) -> None:
        self.fired = True


@pytest.fixture(params=BACKENDS)
def pair(request):
    p = LlmDataDist(1, "prompt", backend=request.param)
    d = LlmDataDist(2, "decoder", backend=request.param)
    p.initialize()
    d.initialize()
    src = p.allocate_cache(CacheDesc(6, (10, 4), "int32"))  # 3 layers of K and V
    dst = d.allocate_cache(CacheDesc(6, (8, 4), "int32"))
    rng = np.random.default_rng(3)
    for t in src.tensors:
        t[...] = rng.integers(-1000, 1000, t.shape)
    for t in dst.tensors:
        t[...] = SENTINEL
    p.link_clusters([d.listen_address])
    yield p, d, src, dst
    p.finalize()
    d.finalize()


def _layer_untouched(dst, layer: int) -> bool:
    return all((dst.tensors[t] == SENTINEL).all() for t in (2 * layer, 2 * layer + 1))


def test_layers_move_when_ready_and_the_tag_comes_last(pair):
    p, d, src, dst = pair
    sb, db = [9, 0, 4], [1, 7, 2]
    lw = LayerwisePush(p, src, CacheIndex(2, dst.cache_id), sb, db, tag="req")
    assert lw.num_layers == 3
    ev = FakeEvent()
    lw.layer_ready(2)  # CPU: written, posted now
    lw.layer_ready(0, ev)  # GPU-style: posted once the event completes
    with pytest.raises(ValueError, match=r"layers \[1\] were never marked ready"):
        lw.wait(timeout_s=5)
    for _ in range(5000):  # layer 2 lands (bounded); layer 0 waits for its event
        lw.poll()
        if not _layer_untouched(dst, 2):
            break
        time.sleep(0.001)
    assert not _layer_untouched(dst, 2)
    assert _layer_untouched(dst, 0)
    assert not d.received("req")  # no tag before every layer is in
    lw.layer_ready(1)
    with pytest.raises(LLMException) as info:  # the event never fired: nothing hangs
        lw.wait(timeout_s=0.05)
    assert info.value.status is LLMStatus.TIMEOUT
    assert _layer_untouched(dst, 0)


def test_layerwise_push_matches_the_whole_push(pair):
    p, d, src, dst = pair
    sb, db = [9, 0, 4], [1, 7, 2]
    expected = push_kv_blocks_reference(
        [t.copy() for t in src.tensors], [t.copy() for t in dst.tensors], sb, db
    )
    lw = LayerwisePush(p, src, CacheIndex(2, dst.cache_id), sb, db, tag="req")
    ev = FakeEvent()
    lw.layer_ready(1)
    lw.layer_ready(0, ev)
    lw.layer_ready(2)
    ev.fire()
    assert lw.wait(timeout_s=10) == "req"
    d.wait_received("req", timeout_s=10)
    assert all((a == b).all() for a, b in zip(dst.tensors, expected))


def test_layerwise_bad_input(pair):
    p, d, src, dst = pair
    index = CacheIndex(2, dst.cache_id)
    with pytest.raises(LLMException) as info:  # checked for the whole request up front
        LayerwisePush(p, src, index, [0, 1], [3, 3])
    assert info.value.status is LLMStatus.PARAM_INVALID
    lw = LayerwisePush(p, src, index, [0], [0])
    with pytest.raises(ValueError, match="0 <= layer < 3"):
        lw.layer_ready(3)
    with pytest.raises(TypeError, match="query"):
        lw.layer_ready(0, event=object())
    lw.layer_ready(0)
    with pytest.raises(ValueError, match="already marked ready"):
        lw.layer_ready(0)
    with pytest.raises(LLMException) as info:
        LayerwisePush(d, dst, CacheIndex(1, src.cache_id), [0], [0])
    assert info.value.status is LLMStatus.PARAM_INVALID
    assert all((t == SENTINEL).all() for t in dst.tensors[2:])


@NIXL_ONLY
def test_example_layerwise(tmp_path):
    """examples/datadist_layerwise.py, small: two processes, both ways verified."""
    r = subprocess.run(
        [sys.executable, str(REPO / "examples" / "datadist_layerwise.py")]
        + ["--layers", "3", "--tokens", "64", "--dim", "64", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "layer-wise PASSED" in r.stdout and "layer-wise push:" in r.stdout, r.stdout
