"""Intervals and tests of the study: Wilson intervals of accuracies, the exact McNemar
test of paired per-trial outcomes, and a segment bootstrap for loss differences."""

from __future__ import annotations

import math

import numpy as np


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion."""
    if n == 0:
        return (0.0, 1.0)
    p = hits / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


def mcnemar(a: list[int] | np.ndarray, b: list[int] | np.ndarray) -> tuple[int, int, float]:
    """Exact two-sided McNemar test of paired outcomes (1 = found) of two methods on the
    same trials: ``(a only, b only, p)``, p = P[Bin(n, 1/2) as or more extreme], n the
    discordant pairs (1.0 when there are none)."""
    x, y = np.asarray(a, dtype=bool), np.asarray(b, dtype=bool)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(
            f"a, b: expected two 1-D outcome lists of one length, got {x.shape}, {y.shape}"
        )
    n10, n01 = int((x & ~y).sum()), int((~x & y).sum())
    n = n10 + n01
    if n == 0:
        return n10, n01, 1.0
    k = min(n10, n01)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n
    return n10, n01, min(1.0, 2.0 * tail)


def segment_ci(delta: np.ndarray, segment: int = 64, reps: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of a mean per-token loss difference, resampling whole
    ``segment``-token stretches (neighbouring tokens are not independent)."""
    n = len(delta) // segment
    if n < 2:
        return (float("nan"), float("nan"))
    means = delta[: n * segment].reshape(n, segment).mean(axis=1)
    rng = np.random.default_rng(0)
    boot = means[rng.integers(0, n, size=(reps, n))].mean(axis=1)
    return (float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975)))
