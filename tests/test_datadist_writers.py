"""Two writers into the same destination blocks (docs/SPEC.md D8, issue 30 item 7): a
node refuses, with REPEAT_REQUEST and nothing posted, a push or pull into blocks that one
of its own transfers still writes; other blocks, other layers and other caches go ahead,
and the blocks are free again once the first transfer's handle reports it ended. Both
backends, two nodes in this process."""

from __future__ import annotations

import gc
import sys
import threading
import time

import numpy as np
import pytest

from pytrt_kv.datadist import (
    CacheDesc,
    CacheIndex,
    KvCacheExtParam,
    LayerwisePush,
    LlmDataDist,
    LLMException,
    LLMStatus,
    check_transfer,
)
from pytrt_kv.datadist.inflight import Writes
from support.datadist import BACKENDS

SENTINEL = 99
DESC = CacheDesc(4, (8, 16), "int32")  # 2 layers of K and V, 8 blocks


@pytest.fixture(params=BACKENDS)
def pair(request):
    p = LlmDataDist(1, "prompt", backend=request.param, options={"timeout_s": 10.0})
    d = LlmDataDist(2, "decoder", backend=request.param, options={"timeout_s": 10.0})
    p.initialize("127.0.0.1", 0)
    d.initialize("127.0.0.1", 0)
    try:
        assert [r.cluster_id for r in p.link_clusters([d.listen_address], timeout_s=5)] == [2]
        src, dst = p.allocate_cache(DESC), d.allocate_cache(DESC)
        for i, t in enumerate(src.tensors):
            t[...] = np.arange(8)[:, None] + 100 * i
        for t in dst.tensors:
            t[...] = SENTINEL
        yield p, d, src, dst, CacheIndex(2, dst.cache_id)
    finally:
        p.finalize()
        d.finalize()


def _refused(fn) -> LLMException:
    with pytest.raises(LLMException) as info:
        fn()
    assert info.value.status is LLMStatus.REPEAT_REQUEST, info.value
    return info.value


def test_a_push_into_blocks_still_written_is_refused_and_posts_nothing(pair):
    p, d, src, dst, index = pair
    first = p.push_kv_blocks_async(src, index, [0, 1], [4, 5])
    # Block 5 overlaps: refused before anything moves, block 7 included.
    err = _refused(lambda: p.push_kv_blocks(src, index, [2, 3], [7, 5]))
    assert "block 5 of cache" in err.message and "D8" in err.message
    _refused(lambda: p.push_kv_blocks_async(src, index, [3], [4]))  # async too
    # Other blocks of the same cache go ahead meanwhile.
    d.wait_received(p.push_kv_blocks(src, index, [6], [6]), 5)
    first.wait(5)
    d.wait_received(first.tag, 5)
    assert all((t[7] == SENTINEL).all() for t in dst.tensors)  # the refused push moved nothing
    assert all(
        (t[4] == s[0]).all() and (t[5] == s[1]).all() for t, s in zip(dst.tensors, src.tensors)
    )
    # Once the first ended, the same blocks take a push again.
    d.wait_received(p.push_kv_blocks(src, index, [2, 3], [7, 5]), 5)
    assert all(
        (t[7] == s[2]).all() and (t[5] == s[3]).all() for t, s in zip(dst.tensors, src.tensors)
    )
    assert len(p._writes) == 0


def test_other_layers_of_the_same_blocks_and_refused_requests_keep_nothing(pair):
    p, d, src, dst, index = pair
    layer0 = KvCacheExtParam((0, 0), (0, 0), 2)
    layer1 = KvCacheExtParam((1, 1), (1, 1), 2)
    first = p.push_kv_blocks_async(src, index, [0], [3], layer0)
    h = p.push_kv_blocks_async(src, index, [1], [3], layer1)  # other tensors: not overlapping
    _refused(lambda: p.push_kv_blocks(src, index, [2], [3]))  # every layer: overlaps both
    for x in (first, h):
        x.wait(5)
        d.wait_received(x.tag, 5)
    assert (dst.tensors[0][3] == src.tensors[0][0]).all()
    assert (dst.tensors[2][3] == src.tensors[2][1]).all()
    # A refused request is retried as it came: now accepted, its plan kept as usual.
    d.wait_received(p.push_kv_blocks(src, index, [2], [3]), 5)
    assert all((t[3] == s[2]).all() for t, s in zip(dst.tensors, src.tensors))


def test_a_failed_or_dropped_transfer_frees_its_blocks(pair):
    p, d, src, dst, index = pair
    h = p.push_kv_blocks_async(src, index, [0], [2])
    assert h.cancel()
    d.wait_received(p.push_kv_blocks(src, index, [1], [2]), 5)  # cancelled: free
    # A handle the caller drops without waiting does not hold its blocks forever.
    p.push_kv_blocks_async(src, index, [0], [1])
    gc.collect()
    d.wait_received(p.push_kv_blocks(src, index, [1], [1]), 5)
    assert (dst.tensors[0][1] == src.tensors[0][1]).all()


def test_a_pull_into_blocks_still_written_is_refused(pair):
    p, d, src, dst, _ = pair
    assert [r.cluster_id for r in d.link_clusters([p.listen_address], timeout_s=5)] == [1]
    index = CacheIndex(1, src.cache_id)
    first = d.pull_kv_blocks_async(index, dst, [0, 1], [2, 3])
    _refused(lambda: d.pull_kv_blocks(index, dst, [4], [3]))
    first.wait(5)
    d.pull_kv_blocks(index, dst, [4], [3])
    assert (dst.tensors[1][3] == src.tensors[1][4]).all()


def test_a_layer_wise_push_waits_for_a_push_into_its_blocks(pair):
    """A layer whose blocks another push of this node still writes is posted once that
    push ended, instead of failing the layer-wise push."""
    p, d, src, dst, index = pair
    first = p.push_kv_blocks_async(src, index, [0], [6])
    lw = LayerwisePush(p, src, index, [5], [6])
    lw.layer_ready(0)
    lw.layer_ready(1)
    assert not lw.poll()  # both layers wait for the first push
    first.wait(5)
    d.wait_received(first.tag, 5)
    d.wait_received(lw.wait(5), 5)
    assert all((t[6] == s[5]).all() for t, s in zip(dst.tensors, src.tensors))


def test_claims_made_at_once_from_many_threads_never_hold_a_block_twice():
    """The claim registry itself (``inflight.Writes``, whose common case takes no lock):
    threads claiming the same block at once, thread switches forced every microsecond,
    never hold it together, and they do get it in turn."""
    desc = CacheDesc(1, (8, 4), "int8")
    plan = check_transfer(desc, desc, [0], [3], KvCacheExtParam(tensor_num_per_layer=1))
    writes, key = Writes(), (2, 1, 1)
    owner: list = [None]
    got, clashes = [0], []

    def worker(me: int) -> None:
        for _ in range(3000):
            try:
                c = writes.claim(key, plan, (0, 1))
            except LLMException:
                continue
            if owner[0] is not None:
                clashes.append((me, owner[0]))
            owner[0] = me
            got[0] += 1
            time.sleep(0)
            owner[0] = None
            Writes.release(c)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        sys.setswitchinterval(old)
    assert not clashes, clashes[:5]
    assert got[0] > 10 and len(writes) == 0  # 49-88 of 12000 tries got it here, loaded


def test_destinations_with_nothing_in_flight_are_not_kept_forever():
    """The registry keeps a dict per destination cache; those with nothing in flight are
    dropped once there are ``_MAX_IDLE_DESTINATIONS`` (caches come and go), and one with
    a transfer in flight is kept through that."""
    from pytrt_kv.datadist import inflight

    desc = CacheDesc(1, (8, 4), "int8")
    plan = check_transfer(desc, desc, [0], [3], KvCacheExtParam(tensor_num_per_layer=1))
    writes = Writes()
    held = writes.claim((9, 9, 9), plan, (0, 1))
    for gen in range(3 * inflight._MAX_IDLE_DESTINATIONS):
        Writes.release(writes.claim((2, 1, gen), plan, (0, 1)))
    assert len(writes._by_dst) <= inflight._MAX_IDLE_DESTINATIONS + 1
    with pytest.raises(LLMException) as info:
        writes.claim((9, 9, 9), plan, (0, 1))
    assert info.value.status is LLMStatus.REPEAT_REQUEST
    Writes.release(held)
    Writes.release(writes.claim((9, 9, 9), plan, (0, 1)))
