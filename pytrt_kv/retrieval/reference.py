"""Block representations, scoring, selection and the NumPy sparse-decode reference
(docs/SPEC.md R4-R6).

Shapes: one layer, one sequence; ``L`` cached tokens (the current one included), ``Hkv``
KV heads of width ``D``, ``Hq = G * Hkv`` query heads (GQA group ``g`` = query heads
``g*G .. g*G+G-1``, the ``repeat_kv`` convention of Llama-style models). Keys are
post-RoPE. All arithmetic is float32 (float64 where noted), whatever the cache dtype.

"lowrank" (docs/RETRIEVAL.md "On a GPU: low-rank keys find what the oracle finds" and
"A basis fixed per model is as good") needs a ``basis [Hkv, D, r]`` (orthonormal columns
per KV head, r = ``RetrievalConfig.rank``), a constant of the model calibrated once on
keys of another text (:func:`calibrate_basis`): a block's representation is its keys
projected on the basis (:func:`lowrank_representations`), its score each query head's
log-sum-exp of its logits over those projected keys, softmax over the blocks per head,
summed over the query heads (:func:`lowrank_scores`). Every function that may meet
"lowrank" takes the basis as ``basis=`` and refuses to run without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .config import LOWRANK, MASS, MEAN, MINMAX, REPRESENTATIONS, Partition, RetrievalConfig


def _keys_2d(arg: str, keys: np.ndarray) -> np.ndarray:
    k = np.asarray(keys)
    if k.ndim != 3:
        raise ValueError(f"{arg}: expected shape [L, Hkv, D], got {list(k.shape)}")
    return k.reshape(k.shape[0], -1).astype(np.float32)


def representation_width(
    kind: str,
    kv_heads: int,
    head_dim: int,
    *,
    block_size: int | None = None,
    rank: int | None = None,
) -> int:
    """Width W of one block's representation row.

    ``2*Hkv*D`` (minmax), ``Hkv*D`` (mean, mass) or ``block_size*Hkv*rank`` (lowrank:
    every key of the block projected on the rank-r basis; ``block_size`` and ``rank``
    are required for it and ignored otherwise).

    Raises
    ------
    ValueError
        An unknown ``kind``, or "lowrank" without ``block_size`` or ``rank``.
    """
    if kind not in REPRESENTATIONS:
        raise ValueError(f"kind: expected one of {list(REPRESENTATIONS)}, got {kind!r}")
    if kind == LOWRANK:
        return _lowrank_int("block_size", block_size) * kv_heads * _lowrank_int("rank", rank)
    return (2 if kind == MINMAX else 1) * kv_heads * head_dim


def _lowrank_int(name: str, v: int | None) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}: expected an int >= 1 for 'lowrank', got {v!r}")
    return v


def check_basis(
    basis: np.ndarray | None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    rank: int | None = None,
    name: str = "basis",
) -> np.ndarray:
    """The "lowrank" basis as float32 ``[Hkv, D, r]``, its shape checked against the
    dimensions given (None: any) and its values finite.

    Raises
    ------
    ValueError
        ``basis`` None (the lowrank representation has no default basis), of another
        shape, or not finite; the message names ``name`` (``"basis[3]"`` for one layer's).
    """
    want = f"[{kv_heads or 'Hkv'}, {head_dim or 'D'}, {rank or 'r'}]"
    if basis is None:
        raise ValueError(
            f"{name}: expected a {want} array for 'lowrank' (calibrate_basis of keys of "
            "another text), got None"
        )
    b = np.asarray(basis, dtype=np.float32)
    if (
        b.ndim != 3
        or (kv_heads is not None and b.shape[0] != kv_heads)
        or (head_dim is not None and b.shape[1] != head_dim)
        or (rank is not None and b.shape[2] != rank)
    ):
        raise ValueError(f"{name}: expected shape {want}, got {list(b.shape)}")
    if not np.isfinite(b).all():
        raise ValueError(f"{name}: expected finite values, got NaN or inf")
    return b


def calibrate_basis(keys: np.ndarray, rank: int) -> np.ndarray:
    """The "lowrank" basis of calibration keys: per KV head, the top-``rank`` right
    singular vectors of its keys (NumPy SVD in float64, not centred).

    Parameters
    ----------
    keys : numpy.ndarray ``[N, Hkv, D]``
        Post-RoPE keys of a calibration text (of another kind than the sequences the
        basis will score: a constant of the model, docs/RETRIEVAL.md "A basis fixed per
        model is as good").
    rank : int
        r, ``1 <= rank <= min(D, N)``.

    Returns
    -------
    numpy.ndarray float32 ``[Hkv, D, rank]``
        Orthonormal columns per KV head, the largest singular value first.

    Examples
    --------
    >>> k = np.random.default_rng(0).standard_normal((64, 2, 8))
    >>> b = calibrate_basis(k, 3)
    >>> b.shape, bool(np.allclose(b[1].T @ b[1], np.eye(3), atol=1e-6))
    ((2, 8, 3), True)
    """
    k = np.asarray(keys)
    if k.ndim != 3:
        raise ValueError(f"keys: expected shape [N, Hkv, D], got {list(k.shape)}")
    N, _, D = k.shape
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank: expected an int >= 1, got {rank!r}")
    if rank > D:
        raise ValueError(f"rank: expected <= head_dim D = {D}, got {rank}")
    if rank > N:
        raise ValueError(f"rank: expected <= the {N} calibration keys, got {rank}")
    k64 = k.astype(np.float64).transpose(1, 0, 2)  # [Hkv, N, D]
    vh = np.linalg.svd(k64, full_matrices=False)[2]  # [Hkv, min(N, D), D]
    return np.ascontiguousarray(vh[:, :rank].transpose(0, 2, 1)).astype(np.float32)


def block_representations(
    keys: np.ndarray, part: Partition, kind: str = MEAN, *, basis: np.ndarray | None = None
) -> np.ndarray:
    """R5 representation of every retrievable block.

    Parameters
    ----------
    keys : numpy.ndarray ``[L' >= init_end + nb*B, Hkv, D]``
        Post-RoPE keys of the sequence (only the retrievable blocks are read).
    part : Partition
    kind : "lowrank" | "mean" | "minmax" | "mass"
    basis : numpy.ndarray ``[Hkv, D, r]``, required for "lowrank" (ignored otherwise)

    Returns
    -------
    numpy.ndarray float32 ``[nb, W]``
        minmax: ``[M, m]`` (element-wise max then min over the block's keys, each
        ``Hkv*D`` wide, heads concatenated), ``W = 2*Hkv*D``; mean and mass: the mean
        key, ``W = Hkv*D``; lowrank: :func:`lowrank_representations`, ``W = B*Hkv*r``.
    """
    if kind == LOWRANK:
        return lowrank_representations(keys, part, check_basis(basis))
    k = _keys_2d("keys", keys)
    nb, B = part.num_blocks, part.block_size
    end = part.init_end + nb * B
    if k.shape[0] < end:
        raise ValueError(
            f"keys: expected at least {end} tokens (init + {nb} blocks of {B}), got {k.shape[0]}"
        )
    blocks = k[part.init_end : end].reshape(nb, B, k.shape[1])
    if kind == MINMAX:
        return np.concatenate([blocks.max(axis=1), blocks.min(axis=1)], axis=1)
    if kind in (MEAN, MASS):
        return blocks.astype(np.float64).mean(axis=1).astype(np.float32)
    raise ValueError(f"kind: expected one of {list(REPRESENTATIONS)}, got {kind!r}")


def group_query(q: np.ndarray, kv_heads: int) -> np.ndarray:
    """R5 query: ``q [Hq, D]`` summed over each GQA group, heads concatenated:
    float32 ``[Hkv*D]``."""
    q = np.asarray(q, dtype=np.float32)
    if q.ndim != 2 or kv_heads < 1 or q.shape[0] % kv_heads:
        raise ValueError(
            f"q: expected shape [Hq, D] with Hq a multiple of kv_heads = "
            f"{kv_heads}, got {list(q.shape)}"
        )
    return q.reshape(kv_heads, q.shape[0] // kv_heads, q.shape[1]).sum(axis=1).reshape(-1)


def score_query(q_group: np.ndarray, kind: str = MEAN) -> np.ndarray:
    """The query row that scores a representation by one inner product (R5):
    ``[relu(q), -relu(-q)]`` for minmax, ``q`` for mean."""
    q = np.asarray(q_group, dtype=np.float32)
    if kind == MINMAX:
        return np.concatenate([np.maximum(q, 0), np.minimum(q, 0)])
    if kind == MEAN:
        return q
    raise ValueError(
        f"kind: expected 'mean' or 'minmax' (the linear scores; {list(REPRESENTATIONS)} "
        f"through score_blocks), got {kind!r}"
    )


def block_scores(q_group: np.ndarray, reps: np.ndarray, kind: str = MEAN) -> np.ndarray:
    """R5 score of each block: float32 ``[nb]`` = ``reps @ score_query(q_group)``."""
    sq = score_query(q_group, kind)
    reps = np.asarray(reps, dtype=np.float32)
    if reps.ndim != 2 or reps.shape[1] != sq.shape[0]:
        raise ValueError(
            f"reps: expected shape [nb, {sq.shape[0]}] for {kind}, got {list(reps.shape)}"
        )
    return reps @ sq


def score_blocks(
    q: np.ndarray,
    reps: np.ndarray,
    kind: str,
    kv_heads: int,
    scale: float | None = None,
    *,
    basis: np.ndarray | None = None,
) -> np.ndarray:
    """R5 score of each block for the current token's query ``q [Hq, D]``: float32
    ``[nb]``.

    mean, minmax: :func:`block_scores` of the GQA-summed query. mass: each query head's
    softmax over the blocks of ``scale * q_h . mean_b`` (its KV head's part of the mean),
    summed over the query heads: an estimate of the attention mass each block draws,
    every head counted alike (``scale`` default ``1/sqrt(D)``). lowrank:
    :func:`lowrank_scores` with ``basis [kv_heads, D, r]`` (required; the block size is
    the width of ``reps`` over ``kv_heads * r``).
    """
    if kind in (MEAN, MINMAX):
        return block_scores(group_query(q, kv_heads), reps, kind)
    if kind == LOWRANK:
        qa = np.asarray(q)
        b = check_basis(basis, kv_heads, qa.shape[-1] if qa.ndim == 2 else None)
        per_key = kv_heads * b.shape[2]
        r = np.asarray(reps)
        if r.ndim != 2 or r.shape[1] % per_key or r.shape[1] == 0:
            raise ValueError(
                f"reps: expected shape [nb, B*{per_key}] for lowrank (B keys of Hkv*r "
                f"projections), got {list(r.shape)}"
            )
        return lowrank_scores(q, r, b, r.shape[1] // per_key, scale)
    if kind != MASS:
        raise ValueError(f"kind: expected one of {list(REPRESENTATIONS)}, got {kind!r}")
    qg = group_query(q, kv_heads)  # validates q against kv_heads
    q = np.asarray(q, dtype=np.float64)
    r = np.asarray(reps, dtype=np.float64)
    if r.ndim != 2 or r.shape[1] != qg.shape[0]:
        raise ValueError(f"reps: expected shape [nb, {qg.shape[0]}] for mass, got {list(r.shape)}")
    Hq, D = q.shape
    if r.shape[0] == 0:
        return np.zeros(0, np.float32)
    scale = 1.0 / np.sqrt(D) if scale is None else float(scale)
    G = Hq // kv_heads
    s = np.einsum("hgd,bhd->hgb", q.reshape(kv_heads, G, D), r.reshape(-1, kv_heads, D)) * scale
    s -= s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return p.sum(axis=(0, 1)).astype(np.float32)


def select_blocks(scores: np.ndarray, k: int) -> np.ndarray:
    """R4: the ``k`` best blocks, by descending score, ties to the lower index
    (the order ONNX TopK defines). int64 ``[k]``, in that order."""
    s = np.asarray(scores, dtype=np.float32)
    if not 0 <= k <= s.shape[0]:
        raise ValueError(f"k: expected 0 <= k <= {s.shape[0]} blocks, got {k}")
    order = np.lexsort((np.arange(s.shape[0]), -s))
    return order[:k].astype(np.int64)


def dense_attention(
    q: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    scale: float | None = None,
    positions: Sequence[int] | np.ndarray | None = None,
) -> np.ndarray:
    """Softmax attention of one query token (float64 accumulation).

    Parameters
    ----------
    q : ``[Hq, D]``; keys : ``[L, Hkv, D]``; values : ``[L, Hkv, Dv]``
    scale : float, default ``1/sqrt(D)``
    positions : token positions attended (default: all ``L``)

    Returns
    -------
    numpy.ndarray float32 ``[Hq, Dv]``
    """
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(keys, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    if k.ndim != 3 or v.ndim != 3 or k.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"keys, values: expected [L, Hkv, D] and [L, Hkv, Dv], got "
            f"{list(k.shape)} and {list(v.shape)}"
        )
    hkv = k.shape[1]
    if q.ndim != 2 or q.shape[0] % hkv or q.shape[1] != k.shape[2]:
        raise ValueError(
            f"q: expected [Hq, {k.shape[2]}] with Hq a multiple of {hkv}, got {list(q.shape)}"
        )
    if positions is not None:
        idx = np.asarray(list(positions), dtype=np.int64)
        k, v = k[idx], v[idx]
    if k.shape[0] == 0:
        raise ValueError("positions: expected at least one attended token, got none")
    scale = 1.0 / np.sqrt(q.shape[1]) if scale is None else float(scale)
    group = q.shape[0] // hkv
    kh = np.repeat(k.transpose(1, 0, 2), group, axis=0)  # [Hq, L, D]
    vh = np.repeat(v.transpose(1, 0, 2), group, axis=0)
    s = np.einsum("hd,hld->hl", q, kh) * scale
    s -= s.max(axis=1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=1, keepdims=True)
    return np.einsum("hl,hld->hd", p, vh).astype(np.float32)


@dataclass(frozen=True)
class SparseResult:
    """Result of :func:`sparse_decode_attention`."""

    out: np.ndarray  #: float32 ``[Hq, Dv]``
    partition: Partition
    selected: np.ndarray  #: int64 ``[k]`` retrievable block indices j, in R4 order
    scores: np.ndarray  #: float32 ``[nb]``
    positions: np.ndarray  #: int64 attended token positions, ascending


def sparse_decode_attention(
    q: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    cfg: RetrievalConfig,
    scale: float | None = None,
    reps: np.ndarray | None = None,
    basis: np.ndarray | None = None,
) -> SparseResult:
    """R6: attention of the current token over init + the recalled blocks + local.

    Parameters
    ----------
    q : numpy.ndarray ``[Hq, D]``
        Query of the current token (position ``L-1``), post-RoPE.
    keys, values : numpy.ndarray ``[L, Hkv, D]``, ``[L, Hkv, Dv]``
        The whole sequence, the current token included.
    cfg : RetrievalConfig
    scale : float, default ``1/sqrt(D)`` (the model's own scaling; "mass" and "lowrank"
        score with it too)
    reps : numpy.ndarray ``[>= nb, W]``, optional
        Precomputed block representations (default: from ``keys``).
    basis : numpy.ndarray ``[Hkv, D, cfg.rank]``
        The "lowrank" basis (:func:`calibrate_basis`); required for "lowrank", ignored
        by the other representations.

    Returns
    -------
    SparseResult
        With ``cfg.topk_percent == 1`` every block is recalled and ``out`` equals
        :func:`dense_attention`.

    Raises
    ------
    ValueError
        "lowrank" without a basis, or a basis of another shape (the message names
        ``basis``).

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> k, v = rng.standard_normal((2, 700, 2, 8)).astype(np.float32)
    >>> q = rng.standard_normal((4, 8)).astype(np.float32)
    >>> cfg = RetrievalConfig(init_tokens=32, local_tokens=100, block_size=32,
    ...                       topk_percent=1.0, rank=4)
    >>> basis = calibrate_basis(rng.standard_normal((256, 2, 8)), cfg.rank)
    >>> r = sparse_decode_attention(q, k, v, cfg, basis=basis)
    >>> r.partition.num_blocks, len(r.selected)
    (17, 17)
    >>> bool(np.allclose(r.out, dense_attention(q, k, v), atol=1e-6))
    True
    """
    k3 = np.asarray(keys)
    L = k3.shape[0]
    part = cfg.partition(L)
    hkv = k3.shape[1] if k3.ndim == 3 else 0
    if cfg.representation == LOWRANK:
        basis = check_basis(basis, hkv, k3.shape[2] if k3.ndim == 3 else None, cfg.rank)
    if reps is None:
        reps = block_representations(keys, part, cfg.representation, basis=basis)
    reps = np.asarray(reps, dtype=np.float32)[: part.num_blocks]
    scores = score_blocks(q, reps, cfg.representation, hkv, scale, basis=basis)
    selected = select_blocks(scores, cfg.num_selected(part.num_blocks))
    positions = np.asarray(part.attended(selected), dtype=np.int64)
    out = dense_attention(q, keys, values, scale, positions)
    return SparseResult(
        out=out, partition=part, selected=selected, scores=scores, positions=positions
    )


def lowrank_representations(keys: np.ndarray, part: Partition, basis: np.ndarray) -> np.ndarray:
    """R5 "lowrank": every retrievable block's keys projected on ``basis [Hkv, D, r]``:
    float32 ``[nb, B*Hkv*r]`` (token-major: token t of the block, KV head g, component j
    at ``(t*Hkv + g)*r + j``; float64 inside)."""
    k = np.asarray(keys, dtype=np.float32)
    if k.ndim != 3:
        raise ValueError(f"keys: expected shape [L, Hkv, D], got {list(k.shape)}")
    b = check_basis(basis, k.shape[1], k.shape[2])
    nb, B = part.num_blocks, part.block_size
    end = part.init_end + nb * B
    if k.shape[0] < end:
        raise ValueError(
            f"keys: expected at least {end} tokens (init + {nb} blocks of {B}), got {k.shape[0]}"
        )
    proj = np.einsum("lhd,hdr->lhr", k[part.init_end : end].astype(np.float64), b)
    return proj.reshape(nb, B * b.shape[0] * b.shape[2]).astype(np.float32)  # nb may be 0


def lowrank_scores(
    q: np.ndarray, reps: np.ndarray, basis: np.ndarray, block_size: int, scale: float | None = None
) -> np.ndarray:
    """R5 "lowrank" score of each block for ``q [Hq, D]``: float32 ``[nb]`` = sum over
    query heads h of ``softmax_b(logsumexp_{i in b} scale * (q_h P_g) . (k_i P_g))``
    (g = h's KV head, P_g its ``basis [Hkv, D, r]`` part, ``reps [nb, block_size*Hkv*r]``
    from :func:`lowrank_representations`, ``scale`` default ``1/sqrt(D)``), float64
    inside."""
    q = np.asarray(q, dtype=np.float64)
    if q.ndim != 2:
        raise ValueError(f"q: expected shape [Hq, D], got {list(q.shape)}")
    Hq, D = q.shape
    b = check_basis(basis, head_dim=D).astype(np.float64)
    Hkv, _, r = b.shape
    if Hq % Hkv:
        raise ValueError(f"q: expected Hq a multiple of the basis' {Hkv} KV heads, got {Hq}")
    reps = np.asarray(reps, dtype=np.float64)
    width = block_size * Hkv * r
    if reps.ndim != 2 or reps.shape[1] != width:
        raise ValueError(f"reps: expected shape [nb, {width}] for lowrank, got {list(reps.shape)}")
    nb = reps.shape[0]
    if nb == 0:
        return np.zeros(0, np.float32)
    scale = 1.0 / np.sqrt(D) if scale is None else float(scale)
    qp = np.einsum("hgd,hdr->hgr", q.reshape(Hkv, Hq // Hkv, D), b)
    kp = reps.reshape(nb, block_size, Hkv, r)
    s = np.einsum("hgr,nbhr->hgnb", qp, kp) * scale
    m = s.max(axis=-1, keepdims=True)
    lse = (m + np.log(np.exp(s - m).sum(axis=-1, keepdims=True)))[..., 0]  # [Hkv, G, nb]
    lse -= lse.max(axis=-1, keepdims=True)
    p = np.exp(lse)
    p /= p.sum(axis=-1, keepdims=True)
    return p.sum(axis=(0, 1)).astype(np.float32)
