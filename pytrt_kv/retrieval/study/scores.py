"""How each study method scores the retrievable blocks of one layer (torch).

Every method returns scores ``[c, nb]`` (``[Hkv, c, nb]`` for the per-KV-head variants)
and the attention keeps the k best (R4), so all methods attend the same number of
tokens. Baselines: ``window`` (the k most recent blocks), ``random`` (k random blocks per
row and layer), ``random_fixed`` (k random blocks per row, the same in every layer),
``oracle`` (the k blocks with the largest true softmax mass of the layer's query heads;
an upper bound that needs the full attention). Selectors (docs/SPEC.md R5 and the
candidates measured in docs/RETRIEVAL.md), with ``q_h`` the query of head h, ``g(h)``
its KV head and ``s = scaling``:

* ``lowrank``: the R5 default: ``lowrank{r}_cal`` with ``r = RetrievalConfig.rank`` on
  the model's calibrated basis (``calibration.calibrate_lowrank``, in
  ``AttentionState.basis``);
* ``mean``: ``sum_g q_g . mean_b,g`` (``q_g`` summed over the group);
* ``minmax``: R5's Quest bound ``[relu(q), -relu(-q)] . [M, m]``;
* ``mass``: ``sum_h softmax_b(s q_h . mean_b,g(h))``: each query head's estimated
  attention mass over the blocks, summed over heads (as the oracle sums true masses);
* ``massz``: as ``mass``, with each head's softmax normalised by its true init + local
  mass as well (``B exp(s q_h . mean_b)`` per block);
* ``kmeans2``: two centroids per block and KV head (Lloyd from the block's halves, 4
  steps), score ``sum_h max_j s q_h . c_b,g(h),j``; ``kmeans2_mass``, ``kmeans2_massz``:
  the same logits through the per-head softmax of ``mass``, ``massz``; ``kmeans4``,
  ``kmeans4_massz``: four centroids (from the block's quarters);
* ``outlier4``, ``outlier4_massz``: the block's mean and its 4 keys farthest from it,
  per KV head, scored as ``kmeans2`` (max over the vectors) and through ``massz``;
* ``kmeans8_massz``: eight centroids (from the block's eighths) through ``massz``;
* ``topnorm4_massz``: the block's mean and its 4 keys of largest norm, per KV head;
* ``heavy4``, ``heavy4_massz``: InfLLM's representative keys: the block's 4 keys that
  received the most attention (summed over the KV head's query heads) from the
  ``AttentionState.heavy_window`` queries after each of them during the dense prefill;
* ``lowrank8`` .. ``lowrank32``: ``blockmass`` on logits of keys and queries projected
  on the top-r right singular vectors of the layer's retrievable keys (per KV head; r / D
  of the keys' storage; Loki's low-rank keys);
* ``prerope16`` .. ``prerope32``: as ``lowrank``, with the keys' RoPE undone before the
  projection (ShadowKV's pre-RoPE keys) and done again on the projected keys;
* ``lowrank24_cal`` .. ``prerope32_cal``: the same on a basis fixed per model, from the
  keys of a calibration text (``AttentionState.basis``, ``attention.calibrate``);
* ``blockmass`` (diagnostic, not a compact representation: it reads every key): each
  head's exact attention mass over the blocks, ``softmax_b(logsumexp_i s q_h . k_i)``,
  summed over heads; the oracle without the init + local part of the normaliser.
* ``mean_head``, ``minmax_head``: per KV head (Quest-style), each head its own k blocks.
"""

from __future__ import annotations

import math

from ..config import LOWRANK, MEAN, MINMAX

BASELINES = ("window", "random", "random_fixed", "oracle")
#: Selectors computed from per-head logits of block vectors: name -> (vectors, aggregate).
VECTOR_SELECTORS = {
    "mass": ("mean", "mass"),
    "massz": ("mean", "massz"),
    "kmeans2": ("kmeans2", "sum"),
    "kmeans2_mass": ("kmeans2", "mass"),
    "kmeans2_massz": ("kmeans2", "massz"),
    "kmeans4": ("kmeans4", "sum"),
    "kmeans4_massz": ("kmeans4", "massz"),
    "kmeans8_massz": ("kmeans8", "massz"),
    "outlier4": ("outlier4", "sum"),
    "outlier4_massz": ("outlier4", "massz"),
    "topnorm4_massz": ("topnorm4", "massz"),
    "heavy4": ("heavy4", "sum"),
    "heavy4_massz": ("heavy4", "massz"),
    "blockmass": ("keys", "mass"),
}
#: Selectors from low-rank keys (every key of the span projected on the top-r right
#: singular vectors of the layer's span, per KV head): name -> r.
LOWRANK_SELECTORS = {"lowrank8": 8, "lowrank16": 16, "lowrank24": 24, "lowrank32": 32}
#: The same with the keys taken before RoPE (ShadowKV: pre-RoPE keys are low-rank), the
#: projected keys rotated again at their positions: name -> r.
PREROPE_SELECTORS = {"prerope16": 16, "prerope24": 24, "prerope32": 32}
#: The same with a basis fixed per model (Loki's calibration): the top singular vectors
#: of the keys of a calibration text (``AttentionState.basis``), not of the context.
CALIBRATED_SELECTORS = {
    "lowrank24_cal": ("post", 24),
    "lowrank32_cal": ("post", 32),
    "prerope24_cal": ("pre", 24),
    "prerope32_cal": ("pre", 32),
}
REP_SELECTORS = (
    LOWRANK,
    MEAN,
    MINMAX,
    *VECTOR_SELECTORS,
    *LOWRANK_SELECTORS,
    *PREROPE_SELECTORS,
    *CALIBRATED_SELECTORS,
)
HEAD_SELECTORS = (MEAN + "_head", MINMAX + "_head")
ALL_SELECTORS = BASELINES + REP_SELECTORS + HEAD_SELECTORS


def selector_scores(
    method: str,
    cfg,
    q,
    k,
    causal,
    allowed,
    valid,
    G: int,
    scale: float,
    seed: int,
    cache: dict,
    extra: dict | None = None,
):
    """Scores of the retrievable blocks for rows ``q [Hq, c, D]`` over keys
    ``k [Hkv, Lk, D]``; ``causal``/``allowed`` ``[c, Lk]`` (allowed: init + local),
    ``valid [c, nb]`` (the row's retrievable blocks); ``cache`` keeps the block
    representations of this forward; ``extra``: what the layer knows beyond its keys
    (``"importance"`` ``[Hkv, Lp]`` for ``heavy4``, ``"inv_freq"`` for ``prerope``,
    ``"basis"`` for the ``_cal`` methods)."""
    import torch

    extra = extra or {}
    c, nb = valid.shape
    if method == "window":  # the most recent blocks: a window widened to the budget
        return torch.arange(nb, dtype=torch.float32, device=q.device).expand(c, nb)
    if method in ("random", "random_fixed"):
        # drawn on the CPU, so that a GPU run draws the same blocks as a CPU run
        return torch.rand(c, nb, generator=torch.Generator().manual_seed(seed)).to(q.device)
    if method == "oracle":
        return _oracle(cfg, q, k, causal, nb, G, scale)
    if method in (MEAN, MINMAX):
        return _linear(method, cfg, q, k, nb, G, cache)
    if method in HEAD_SELECTORS:
        return _per_head(method, cfg, q, k, nb, G, cache)
    if method in VECTOR_SELECTORS:
        return _vector_scores(method, cfg, q, k, allowed, valid, G, scale, cache, extra)
    if method in LOWRANK_SELECTORS:
        return _lowrank(LOWRANK_SELECTORS[method], cfg, q, k, valid, G, scale, cache)
    if method in PREROPE_SELECTORS:
        inv_freq = extra.get("inv_freq")
        if inv_freq is None:
            raise ValueError(f"method {method!r}: needs the model's RoPE frequencies")
        r = PREROPE_SELECTORS[method]
        return _lowrank(r, cfg, q, k, valid, G, scale, cache, inv_freq=inv_freq)
    if method == LOWRANK:
        basis, r = extra.get("basis"), cfg.rank
        if basis is None or "post" not in basis:
            raise ValueError(
                "method 'lowrank': needs the model's calibrated basis "
                "(calibration.calibrate_lowrank sets AttentionState.basis)"
            )
        if basis["post"].shape[-1] < r:
            raise ValueError(
                f"cfg.rank: expected <= the calibrated basis' rank {basis['post'].shape[-1]}, "
                f"got {r}"
            )
        return _lowrank(r, cfg, q, k, valid, G, scale, cache, None, basis["post"][..., :r])
    if method in CALIBRATED_SELECTORS:
        kind, r = CALIBRATED_SELECTORS[method]
        basis, inv = extra.get("basis"), extra.get("inv_freq") if kind == "pre" else None
        if basis is None or (kind == "pre" and inv is None):
            raise ValueError(f"method {method!r}: needs a calibrated basis (AttentionState.basis)")
        return _lowrank(r, cfg, q, k, valid, G, scale, cache, inv, basis[kind][..., :r])
    raise ValueError(f"method: expected one of {list(ALL_SELECTORS)}, got {method!r}")


def _blocks(cfg, k):
    """``[Hkv, n, B, D]``: every block complete in the keys (later chunks see more)."""
    Hkv, Lk, D = k.shape
    Bs, init = cfg.block_size, cfg.init_tokens
    n = max(0, (Lk - cfg.local_tokens - init) // Bs)
    return k[:, init : init + n * Bs].reshape(Hkv, n, Bs, D)


def _oracle(cfg, q, k, causal, nb: int, G: int, scale: float):
    import torch

    Hq, c, D = q.shape
    Hkv = k.shape[0]
    Bs, init = cfg.block_size, cfg.init_tokens
    s = torch.matmul(q.reshape(Hkv, G, c, D), k[:, None].transpose(-1, -2)) * scale
    s = s.reshape(Hq, c, k.shape[1])
    p = torch.softmax(s.masked_fill(~causal[None], float("-inf")), dim=-1)
    return p[:, :, init : init + nb * Bs].reshape(Hq, c, nb, Bs).sum(dim=(0, 3))


def _linear(kind: str, cfg, q, k, nb: int, G: int, cache: dict):
    """R5 scores ``[c, nb]``, as ``reference.block_scores`` (heads concatenated)."""
    import torch

    # R5's float32 accumulation, also for a half-type model: its own dtype would round
    # the group sums and scores (bfloat16: 8 bits), so near-equal blocks tie or swap.
    q, k = q.float(), k.float()
    Hq, c, D = q.shape
    Hkv = k.shape[0]
    if kind not in cache:
        blocks = _blocks(cfg, k).permute(1, 2, 0, 3)  # [n, B, Hkv, D]
        blocks = blocks.reshape(blocks.shape[0], blocks.shape[1], Hkv * D)
        if kind == MINMAX:
            cache[kind] = torch.cat([blocks.amax(dim=1), blocks.amin(dim=1)], dim=1)
        else:
            cache[kind] = blocks.mean(dim=1)
    reps = cache[kind][:nb]
    qg = q.reshape(Hkv, G, c, D).sum(dim=1).permute(1, 0, 2).reshape(c, Hkv * D)
    if kind == MINMAX:
        qg = torch.cat([qg.clamp(min=0), qg.clamp(max=0)], dim=1)
    return qg @ reps.T


def _per_head(kind: str, cfg, q, k, nb: int, G: int, cache: dict):
    """Per-KV-head R5 scores ``[Hkv, c, nb]``: each head's own block representation,
    scored with its own query group (summed over its G query heads), as Quest does."""
    import torch

    Hq, c, D = q.shape
    Hkv = k.shape[0]
    if kind not in cache:
        blocks = _blocks(cfg, k)
        if kind == MINMAX + "_head":
            cache[kind] = torch.cat([blocks.amax(dim=-2), blocks.amin(dim=-2)], dim=-1)
        else:
            cache[kind] = blocks.mean(dim=2)
    reps = cache[kind][:, :nb]  # [Hkv, nb, D or 2D]
    qg = q.reshape(Hkv, G, c, D).sum(dim=1)  # [Hkv, c, D]
    if kind == MINMAX + "_head":
        qg = torch.cat([qg.clamp(min=0), qg.clamp(max=0)], dim=-1)
    return qg @ reps.transpose(-1, -2)


def kmeans(blocks, k: int = 2, steps: int = 4):
    """``k`` (default two) centroids per block and head: ``[..., B, D]`` -> ``[..., k,
    D]``. Lloyd's algorithm from the means of the block's k equal parts in order (the
    last one takes the rest); a point goes to the nearest centroid (ties to the first);
    an emptied centroid keeps its place."""
    import torch

    part = blocks.shape[-2] // k  # the last part takes the rest
    ends = [(j + 1) * part if j < k - 1 else None for j in range(k)]
    cen = torch.stack([blocks[..., j * part : ends[j], :].mean(-2) for j in range(k)], dim=-2)
    for _ in range(steps):
        d = ((blocks[..., :, None, :] - cen[..., None, :, :]) ** 2).sum(-1)  # [..., B, k]
        w = torch.nn.functional.one_hot(d.argmin(-1), k).to(blocks.dtype)  # [..., B, k]
        cnt = w.sum(-2)  # [..., k]
        new = (w.transpose(-1, -2) @ blocks) / cnt.clamp(min=1)[..., None]
        cen = torch.where(cnt[..., None] > 0, new, cen)
    return cen


def outliers(blocks, r: int):
    """The block's mean and its ``r`` keys farthest from it, per block and head:
    ``[..., B, D]`` -> ``[..., r + 1, D]`` (a token unlike the rest of its block, such as
    an inserted fact, keeps a vector of its own)."""
    import torch

    mean = blocks.mean(-2, keepdim=True)
    return torch.cat([mean, top_keys(blocks, ((blocks - mean) ** 2).sum(-1), r)], dim=-2)


def rope(x, inv_freq, sign: float = 1.0):
    """``x [..., L, D]`` rotated at positions ``0 .. L-1`` as Llama's RoPE does
    (``rotate_half``); ``sign = -1`` undoes it."""
    import torch

    pos = torch.arange(x.shape[-2], device=x.device, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq.to(device=x.device, dtype=torch.float32)[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * emb.cos() + sign * rot * emb.sin()


def top_basis(x, r: int):
    """The top-``r`` right singular vectors of each head's rows: ``[H, N, D]`` ->
    ``[H, D, r]`` (orthonormal columns)."""
    import torch

    return torch.linalg.svd(x, full_matrices=False).Vh[:, :r].transpose(-1, -2)


def _lowrank(
    r: int, cfg, q, k, valid, G: int, scale: float, cache: dict, inv_freq=None, basis=None
):
    """``blockmass`` on approximate logits: the keys of the retrievable span and the
    queries projected on the span's top-``r`` right singular vectors (per KV head), each
    head's logsumexp over a block's projected keys, softmax over the blocks, summed over
    heads. Storage: r numbers per token and KV head (r / D of the keys). ``basis``
    ``[Hkv, D, r]``: these vectors instead of the span's (a calibrated basis)."""
    import torch

    Hq, c, D = q.shape
    Hkv = k.shape[0]
    nb = valid.shape[1]
    name = ("lowrank" if inv_freq is None else "prerope") + str(r)
    name += "" if basis is None else "_cal"

    def top(x):  # [Hkv, N, D] -> the basis [Hkv, D, r]
        if basis is not None:
            return basis.to(device=x.device, dtype=torch.float32)
        return top_basis(x, r)

    if name not in cache and inv_freq is None:
        blocks = _blocks(cfg, k).float()  # [Hkv, n, B, D]
        _, n, B, _ = blocks.shape
        flat = blocks.reshape(Hkv, n * B, D)
        v = top(flat)
        cache[name] = ((flat @ v).reshape(Hkv, n, B, -1), v)  # [Hkv, n, B, r], [Hkv, D, r]
    elif name not in cache:
        init, Bs = cfg.init_tokens, cfg.block_size
        n = _blocks(cfg, k).shape[1]
        pre = rope(k.float(), inv_freq, -1.0)  # every key before RoPE
        v = top(pre[:, init : init + n * Bs])
        approx = rope((pre @ v) @ v.transpose(-1, -2), inv_freq)  # projected, rotated
        cache[name] = approx[:, init : init + n * Bs].reshape(Hkv, n, Bs, D)
    if inv_freq is None:
        proj, v = cache[name]
        qh = q.float().reshape(Hkv, G, c, D) @ v[:, None]  # [Hkv, G, c, r]
    else:
        proj, qh = cache[name], q.float().reshape(Hkv, G, c, D)
    logits = torch.einsum("hgcr,hnbr->hgcnb", qh, proj[:, :nb]) * scale
    logits = torch.logsumexp(logits, dim=-1).masked_fill(~valid, float("-inf"))
    return torch.softmax(logits, dim=-1).sum(dim=(0, 1))


def top_keys(blocks, weight, r: int):
    """The ``r`` keys of largest ``weight`` per block and head: blocks ``[..., B, D]``,
    weight ``[..., B]`` -> ``[..., r, D]``."""
    import torch

    idx = weight.topk(r, dim=-1).indices
    return torch.gather(blocks, -2, idx[..., None].expand(*idx.shape, blocks.shape[-1]))


def _vector_scores(
    method: str, cfg, q, k, allowed, valid, G: int, scale: float, cache: dict, extra: dict
):
    """``[c, nb]`` from per-head logits ``l[h, c, b]`` of each block's vectors (max over
    them; logsumexp over all keys for ``blockmass``), aggregated as named."""
    import torch

    vectors, agg = VECTOR_SELECTORS[method]
    # float32 as R5 says (and as _linear does): a half-type model's own dtype would round
    # the logits, so near-equal blocks tie or swap against the graphs' float32 scores.
    q, k = q.float(), k.float()
    Hq, c, D = q.shape
    Hkv = k.shape[0]
    nb = valid.shape[1]
    if vectors not in cache:
        blocks = _blocks(cfg, k)
        if vectors == "mean":
            cache[vectors] = blocks.mean(dim=2, keepdim=True)
        elif vectors.startswith("kmeans"):  # kmeans2, kmeans4, kmeans8: k centroids
            cache[vectors] = kmeans(blocks, k=int(vectors[len("kmeans") :]))
        elif vectors == "outlier4":
            cache[vectors] = outliers(blocks, 4)
        elif vectors == "topnorm4":
            picked = top_keys(blocks, blocks.float().norm(dim=-1), 4)
            cache[vectors] = torch.cat([blocks.mean(-2, keepdim=True), picked], dim=-2)
        elif vectors == "heavy4":
            imp = extra.get("importance")
            if imp is None:
                raise ValueError(
                    f"method {method!r}: needs the keys' importance from a dense prefill "
                    "(AttentionState.heavy_window > 0)"
                )
            init, n = cfg.init_tokens, blocks.shape[1]
            end = init + n * cfg.block_size  # keys after the prefill: no importance (0)
            imp = torch.nn.functional.pad(imp, (0, max(0, end - imp.shape[1])))
            w = imp[:, init:end].reshape(Hkv, n, cfg.block_size)
            cache[vectors] = top_keys(blocks, w, 4)
        else:
            cache[vectors] = blocks
    vec = cache[vectors][:, :nb]  # [Hkv, nb, r, D]
    qh = q.reshape(Hkv, G, c, D)
    logits = torch.einsum("hgcd,hnrd->hgcnr", qh, vec) * scale
    if vectors == "keys":
        logits = torch.logsumexp(logits, dim=-1)
    else:
        logits = logits.amax(dim=-1)  # [Hkv, G, c, nb]
    if agg == "sum":
        return logits.sum(dim=(0, 1))
    logits = logits.masked_fill(~valid, float("-inf"))
    if agg == "mass":
        return torch.softmax(logits, dim=-1).sum(dim=(0, 1))
    # massz: B exp(l) per block against the head's true init + local mass.
    s = torch.matmul(qh, k[:, None].transpose(-1, -2)) * scale  # [Hkv, G, c, Lk]
    rest = torch.logsumexp(s.masked_fill(~allowed, float("-inf")), dim=-1)  # [Hkv, G, c]
    est = logits + math.log(cfg.block_size)
    z = torch.logsumexp(torch.cat([rest[..., None], est], dim=-1), dim=-1, keepdim=True)
    return torch.exp(est - z).sum(dim=(0, 1))
