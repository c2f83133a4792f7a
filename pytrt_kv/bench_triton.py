"""The Triton baseline of ``pytrt-kv bench``: a paged-KV scatter written in Triton for the
comparison (BENCHMARKS.md), the way a user would write one for the nd layout.

Imported only by :mod:`pytrt_kv.bench` when the benchmark runs, and only where Triton is
installed (``import triton`` imports torch): :func:`pytrt_kv.bench.triton_scatter` catches
the ImportError and the benchmark says the baseline was skipped and why.

One launch writes key and value: program (t, c) copies elements ``c*BLOCK ..`` of token
row ``t`` (``H * D`` contiguous elements, the nd layout) of key and of value to row
``slots[t]`` of the flattened caches; a negative slot writes nothing. No checks: the
benchmark makes valid arguments and verifies the result against ``index_copy_`` before it
times anything. ``TRITON_INTERPRET=1`` runs the same kernel on CPU tensors (the
rehearsal of scripts/gpu_check.sh).
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

#: Elements per program: one 2 KiB bf16 row of H = 8, D = 128 per program, 16 bytes a lane.
BLOCK = 1024


@triton.jit
def _scatter_kv_rows(key, value, key_cache, value_cache, slots, row, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    c = tl.program_id(1)
    # A one-element vector, not a scalar load: Triton's interpreter (TRITON_INTERPRET=1)
    # refuses the mask of a scalar load.
    slot = tl.load(slots + t + tl.arange(0, 1)).to(tl.int64)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    mask = (offs < row) & (slot >= 0)
    src = t.to(tl.int64) * row + offs
    dst = slot * row + offs
    tl.store(key_cache + dst, tl.load(key + src, mask=mask), mask=mask)
    tl.store(value_cache + dst, tl.load(value + src, mask=mask), mask=mask)


def scatter(key: Any, value: Any, key_cache: Any, value_cache: Any, slots: Any) -> None:
    """``key_cache.view(-1, H, D)[slots[t]] = key[t]`` (and value) for every token ``t``
    with ``slots[t] >= 0``: contiguous torch tensors, key/value ``[T, H, D]``, caches
    ``[NB, BS, H, D]``, slots int32 or int64 ``[T]``."""
    tokens = key.shape[0]
    row = key[0].numel()
    grid = (tokens, triton.cdiv(row, BLOCK))
    _scatter_kv_rows[grid](key, value, key_cache, value_cache, slots, row, BLOCK=BLOCK)
