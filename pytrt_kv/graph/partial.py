"""The contract's rules that hold whatever the dynamic dims turn out to be (docs/SPEC.md S2,
S8, S9, G2), for :func:`pytrt_kv.graph.check.validate_node`.

With every shape static, the contract's own ``check_scatter``/``check_gather`` decide. A
model with a symbolic dim (``T``, ``B``) used to skip them entirely, so a dtype
disagreement or a ``selection_topk_block_size`` that does not divide a static block size
passed the model checks and failed later, in the reference or inside TensorRT (issue 31).
These functions check what the declared dtypes, ranks and static dims already decide, with
the contract's messages. Each error carries its rule (:func:`.rules.ruled`):
``schema.dtype`` for dtypes, ``schema.shape`` for ranks and dims, ``schema.input`` for a
tensor that must be present.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..contract import specs
from ..contract.gather import INT32_MAX, MAX_TOPK
from .rules import ruled as _ruled

#: A check.TensorInfo (``.shape``, ``.dtype``, ``.describe()``); check imports this module.
TensorInfo = Any


def _dtype_error(arg: str, expected: str, got: str) -> Exception:
    return _ruled("schema.dtype", TypeError(f"{arg}: expected {expected}, got {got}"))


def _value_dtype_error(arg: str, expected: str, got: str) -> Exception:
    # The contract refuses a cache of another dtype than its source as a ValueError
    # (docs/SPEC.md S8); the rule is still a dtype rule.
    return _ruled("schema.dtype", ValueError(f"{arg}: expected {expected}, got {got}"))


def _shape_error(arg: str, expected: str, got: str) -> Exception:
    return _ruled("schema.shape", ValueError(f"{arg}: expected {expected}, got {got}"))


def scatter_dtypes(given: Mapping[str, TensorInfo], layout: str) -> None:
    """docs/SPEC.md S8/S9 dtype agreement (the order and messages of
    ``contract.scatter._check_data``, ``_check_indices`` and the write checks): each
    cache has its source's dtype, or with a scale a quantised dtype fed from a float
    source; the index tensors share one dtype; no ``v_scale`` without a value; value
    (and its cache) of key's dtype unless ``layout`` is ``"nz"`` (for a 3-D key whose
    ``layout`` is not given, the contract decides once the shapes are known)."""
    if "v_scale" in given and "value" not in given:
        raise _ruled(
            "schema.input",
            ValueError(
                f"v_scale: expected None for a key-only write (no value), got "
                f"{given['v_scale'].describe()}"
            ),
        )
    for src, cache, scale in (("key", "key_cache", "k_scale"), ("value", "value_cache", "v_scale")):
        if src not in given or cache not in given:
            continue
        s, c = given[src], given[cache]
        if scale not in given:
            if c.dtype != s.dtype:
                hint = ""
                if c.dtype in specs.SCATTER_QUANT_CACHE_DTYPES:
                    hint = f", or give {scale} to quantise {src} on write (docs/SPEC.md S9)"
                raise _value_dtype_error(
                    cache, f"dtype {s.dtype} (same as {src}){hint}", f"{c.dtype} ({c.describe()})"
                )
            continue
        if s.dtype not in specs.SCATTER_QUANT_SOURCE_DTYPES:
            raise _dtype_error(
                src,
                f"a float dtype ({', '.join(specs.SCATTER_QUANT_SOURCE_DTYPES)}) to quantise "
                f"with {scale}",
                s.dtype,
            )
        if c.dtype not in specs.SCATTER_QUANT_CACHE_DTYPES:
            raise _dtype_error(
                cache,
                f"a quantised dtype ({', '.join(specs.SCATTER_QUANT_CACHE_DTYPES)}) because "
                f"{scale} is given",
                f"{c.dtype} ({c.describe()})",
            )
    first = None
    for arg in ("slot_mapping", "compress_lens", "compress_seq_offsets", "seq_lens"):
        if arg not in given:
            continue
        if first is None:
            first = given[arg].dtype
        elif given[arg].dtype != first:
            raise _value_dtype_error(
                arg,
                f"dtype {first} (all index tensors share slot_mapping's dtype)",
                f"{given[arg].dtype} ({given[arg].describe()})",
            )
    rank = _rank(given, "key")
    if "value" in given and (rank == 4 or (rank == 3 and layout and layout != "nz")):
        why = (
            "key; only cache_layout='nz' allows different key and value dtypes"
            if rank == 4
            else f"key; only cache_layout='nz' allows different key and value dtypes, "
            f"layout is {layout!r}"
        )
        for arg, ref in (("value", "key"), ("value_cache", "key_cache"))[: 1 if rank == 4 else 2]:
            a, b = given.get(arg), given.get(ref)
            if a is not None and b is not None and a.dtype != b.dtype:
                what = why if arg == "value" else why.replace("key;", "key_cache;", 1)
                raise _value_dtype_error(
                    arg, f"dtype {b.dtype} (same as {what})", f"{a.dtype} ({a.describe()})"
                )


def gather_dtypes(given: Mapping[str, TensorInfo]) -> None:
    """docs/SPEC.md G2: the four caches share selection_kv_cache's dtype (the message of
    ``contract.gather._check_gather_dtypes``)."""
    want = given["selection_kv_cache"].dtype
    for name in ("selection_k_rope", "full_kv_cache", "full_k_rope"):
        if name in given and given[name].dtype != want:
            raise _dtype_error(
                name,
                f"the cache dtype {want} of selection_kv_cache (all four caches share one dtype)",
                given[name].describe(),
            )


def _rank(given: Mapping[str, TensorInfo], name: str) -> int | None:
    info = given.get(name)
    return None if info is None or info.shape is None else len(info.shape)


def _dim(given: Mapping[str, TensorInfo], name: str, axis: int) -> int | None:
    info = given.get(name)
    if info is None or info.shape is None or axis >= len(info.shape):
        return None
    d = info.shape[axis]
    return d if isinstance(d, int) else None


def scatter_dynamic(given: Mapping[str, TensorInfo]) -> None:
    """Ranks, the compressing write's required tensors and the scales' shapes of a
    scatter with dynamic dims (docs/SPEC.md S2, S6, S9)."""
    rank = _rank(given, "key")
    for cache in ("key_cache", "value_cache"):
        r = _rank(given, cache)
        if r is not None and r != 4:
            raise _shape_error(cache, "a 4-D cache", given[cache].describe())
    if rank == 4:
        for name in ("compress_lens", "seq_lens"):
            if name not in given:
                raise _ruled(
                    "schema.input",
                    ValueError(
                        f"{name}: expected a tensor for a 4-D key (compressing write), got none"
                    ),
                )
    heads = _dim(given, "key", 2 if rank == 4 else 1)
    for scale in ("k_scale", "v_scale"):
        r = _rank(given, scale)
        if r is None:
            continue
        if rank == 4:
            raise _ruled(
                "schema.input",
                ValueError(
                    f"{scale}: expected None with a 4-D key (quantise on write applies to a "
                    f"3-D key, docs/SPEC.md S9), got {given[scale].describe()}"
                ),
            )
        n = _dim(given, scale, 0)
        if r > 1 or (r == 1 and heads is not None and n is not None and n != heads):
            raise _shape_error(
                scale,
                f"shape [] (per tensor) or [H={heads if heads is not None else 'H'}] (per head)",
                given[scale].describe(),
            )


def gather_dynamic(given: Mapping[str, TensorInfo], tbs: int) -> None:
    """Ranks and the relations between static dims of a gather with dynamic dims
    (docs/SPEC.md G2): TBS divides the static block sizes, K within [1, 2048], K*TBS an
    int32, KV equal in both caches, status one longer than the top-k ids."""
    for name, ranks in (
        ("selection_kv_cache", (3,)),
        ("full_kv_cache", (3,)),
        ("selection_kv_block_table", (2,)),
        ("full_kv_block_table", (2,)),
        ("full_kv_actual_seq", (1,)),
        ("full_q_actual_seq", (1,)),
        ("selection_topk_indices", (3, 4)),
    ):
        r = _rank(given, name)
        if r is not None and r not in ranks:
            text = " or ".join(f"{k}-D" for k in ranks)
            raise _shape_error(name, f"a {text} tensor (docs/SPEC.md G2)", given[name].describe())
    st, tk = _rank(given, "selection_kv_block_status"), _rank(given, "selection_topk_indices")
    if st is not None and tk is not None and st != tk:
        raise _shape_error(
            "selection_kv_block_status",
            f"rank {tk}, the layout of selection_topk_indices (both must agree)",
            given["selection_kv_block_status"].describe(),
        )
    for name, what in (("selection_kv_cache", "SBS"), ("full_kv_cache", "FBS")):
        bs = _dim(given, name, 1)
        if bs is not None and bs >= 1 and bs % tbs != 0:
            raise _shape_error(
                "selection_topk_block_size",
                f"a divisor of {what} = {bs} (block size of {name})",
                str(tbs),
            )
    kv_s, kv_f = _dim(given, "selection_kv_cache", 2), _dim(given, "full_kv_cache", 2)
    if kv_s is not None and kv_f is not None and kv_s != kv_f:
        raise _shape_error(
            "full_kv_cache",
            f"shape [F_BLOCK_NUM, FBS >= 1, KV = {kv_s}] (KV of selection_kv_cache)",
            given["full_kv_cache"].describe(),
        )
    k = _dim(given, "selection_topk_indices", (tk or 1) - 1)
    if k is not None and not 1 <= k <= MAX_TOPK:
        raise _shape_error(
            "selection_topk_indices",
            f"1 <= K <= {MAX_TOPK} (last dim)",
            given["selection_topk_indices"].describe(),
        )
    if k is not None and k * tbs > INT32_MAX:
        raise _shape_error(
            "selection_topk_block_size",
            f"K*TBS <= 2^31-1 with K = {k} (a row's token count is an int32)",
            str(tbs),
        )
    k1 = _dim(given, "selection_kv_block_status", (st or 1) - 1)
    if k is not None and k1 is not None and k1 != k + 1:
        raise _shape_error(
            "selection_kv_block_status",
            f"last dim K+1 = {k + 1} (selection_topk_indices with last dim K)",
            given["selection_kv_block_status"].describe(),
        )
