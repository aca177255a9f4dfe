"""Intervals and paired tests for evaluation metrics: one sample per question at temperature 0.7 is ±3.5
points on 128 questions (pitfall "One-sample noise"), so every reported metric carries a 95% interval:
Wilson for a proportion (EM, sub_EM; stays in [0, 1], sensible at 0 and 100 %), a seeded percentile
bootstrap for a mean (F1), and the exact two-sided McNemar test on the flips of two paired result sets.
Every interval holds low <= mean <= high within the values' range.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

Z_95 = 1.959963984540054  # two-sided 95% normal quantile


def wilson_interval(successes: float, n: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval of a proportion successes/n, as fractions in [0, 1]; (0, 1) when n == 0."""
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= successes <= n:
        raise ValueError(f"successes must lie in [0, n={n}], got {successes}")
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # Clamp float noise so that low <= p <= high holds exactly at p = 0 and p = 1.
    return max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half))


def bootstrap_interval(values: Sequence[float], level: float = 0.95, resamples: int = 2000,
                       seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values` (deterministic for a given seed)."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return 0.0, 1.0
    if x.size == 1 or np.all(x == x[0]):
        return float(x[0]), float(x[0])
    rng = np.random.default_rng(seed)
    # Resample in blocks so memory stays bounded for large result sets.
    means = np.empty(resamples)
    block = max(1, 2_000_000 // x.size)
    for start in range(0, resamples, block):
        stop = min(resamples, start + block)
        idx = rng.integers(0, x.size, size=(stop - start, x.size))
        means[start:stop] = x[idx].mean(axis=1)
    alpha = (1 - level) / 2
    low, high = np.quantile(means, [alpha, 1 - alpha])
    mean = float(x.mean())
    return float(min(low, mean)), float(max(high, mean))


def metric_summary(values: Sequence[float], binary: bool) -> dict[str, float]:
    """Mean of per-question values in percent with its 95% interval (Wilson when `binary`, values 0/1;
    else bootstrap): {value, low, high, n}."""
    n = len(values)
    mean = float(sum(values) / n) if n else 0.0
    low, high = wilson_interval(sum(values), n) if binary else bootstrap_interval(values)
    return {"value": 100 * mean, "low": 100 * low, "high": 100 * high, "n": n}


def format_interval(summary: dict[str, float]) -> str:
    """A `metric_summary` as "value [low, high]", one decimal."""
    return f"{summary['value']:.1f} [{summary['low']:.1f}, {summary['high']:.1f}]"


def mcnemar_p(wins_a: int, wins_b: int) -> float:
    """Exact two-sided McNemar p-value from the discordant counts (a right & b wrong, b right & a wrong)."""
    n = wins_a + wins_b
    if n == 0:
        return 1.0
    k = min(wins_a, wins_b)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)
