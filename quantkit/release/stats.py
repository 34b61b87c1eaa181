"""The gate's statistics: intervals for paired outcomes that hold at any n, clustered variance, alpha spending.

Paired binary outcomes (an item right or wrong under the baseline and the candidate): Tango's asymptotic score
interval for the difference of paired proportions (Tango, Statistics in Medicine 17:891-908, 1998), the interval
Fagerland, Lydersen and Laake recommend ("Recommended tests and confidence intervals for paired binomial
proportions", Statistics in Medicine 33:2850-2875, 2014). Unlike the Wald interval it does not collapse to zero
width when no item flips (16 items, nothing flips: about +-19 points at 95 %, not +-0), and it keeps its coverage
at small n. ``tests/test_stats.py`` reproduces the published numbers and measures the coverage.

Continuous paired signals (the correct answer's log-likelihood, KL of the choices) keep a t interval; the mean
length ratio a percentile bootstrap (numpy).

Items that are not independent (MMLU's questions of one subject, MMLU-Pro's of one category) widen the interval
by the square root of the design effect: the cluster-robust variance of the mean paired difference over the
independent one (Miller, "Adding Error Bars to Evals", 2024), never below 1.

Sequential looks: a one-sided alpha is spent over looks at information fractions t (the share of items seen)
with a Lan-DeMets spending function (O'Brien-Fleming-like or Pocock-like); at each look the interval is taken at
the alpha spent since the last look, which keeps the overall error at most alpha (a union bound; the simulation in
the tests measures it).
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

_NORMAL = NormalDist()


def z_tail(z: float) -> float:
    """The one-sided tail of the standard normal beyond ``z``."""
    return 1 - NormalDist().cdf(z)


def argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


def choice_kl(p_logits: list[float], q_logits: list[float]) -> float:
    """KL(p || q) of two distributions over the same choices, each given by its logits (log-probabilities)."""
    def log_softmax(x):
        top = max(x)
        s = math.log(sum(math.exp(v - top) for v in x)) + top
        return [v - s for v in x]

    lp, lq = log_softmax(p_logits), log_softmax(q_logits)
    return sum(math.exp(a) * (a - b) for a, b in zip(lp, lq, strict=False))


def z_of(alpha_one_sided: float) -> float:
    return _NORMAL.inv_cdf(1 - alpha_one_sided)


def _tango_statistic(delta0: np.ndarray, gained: np.ndarray, lost: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Tango's score statistic for H0: p(gained) - p(lost) = delta0, with the restricted MLE of p(lost)."""
    a = 2 * n
    b = -gained - lost + (2 * n - gained + lost) * delta0
    c = -lost * delta0 * (1 - delta0)
    p_lost = (-b + np.sqrt(np.maximum(b * b - 4 * a * c, 0.0))) / (2 * a)
    variance = n * (2 * p_lost + delta0 * (1 - delta0))
    numerator = gained - lost - n * delta0
    with np.errstate(divide="ignore", invalid="ignore"):
        # no variance (delta0 = 0 with nothing flipped): the statistic is 0 there, not 0 / 0
        degenerate = np.where(numerator > 0, np.inf, np.where(numerator < 0, -np.inf, 0.0))
        return np.where(variance > 0, numerator / np.sqrt(variance), degenerate)


def tango_interval(gained, lost, n, z: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(estimate, low, high) of p(candidate right) - p(baseline right) in proportions, for ``gained`` items only the
    candidate answers right and ``lost`` items only the baseline does, out of ``n``; two-sided at normal quantile
    ``z``. Vectorized over arrays of counts (the coverage computation solves thousands at once)."""
    gained, lost, n = (np.asarray(v, dtype=np.float64) for v in (gained, lost, n))
    estimate = (gained - lost) / n
    bounds = []
    for target in (z, -z):  # the statistic falls as delta0 rises: the low limit solves T = z, the high T = -z
        lo, hi = np.full(estimate.shape, -1.0), np.full(estimate.shape, 1.0)
        for _ in range(60):  # bisection to well below 1e-12
            mid = (lo + hi) / 2
            above = _tango_statistic(mid, gained, lost, n) > target
            lo, hi = np.where(above, mid, lo), np.where(above, hi, mid)
        bounds.append((lo + hi) / 2)
    return estimate, np.minimum(bounds[0], estimate), np.maximum(bounds[1], estimate)


def paired_binary_interval(baseline: list[int], candidate: list[int], z: float,
                           design_effect: float = 1.0) -> tuple[float, float, float]:
    """(delta, low, high) in points, candidate - baseline, Tango's interval widened by sqrt(design_effect)."""
    gained = sum(1 for x, y in zip(baseline, candidate, strict=True) if y and not x)
    lost = sum(1 for x, y in zip(baseline, candidate, strict=True) if x and not y)
    estimate, low, high = (float(v) for v in tango_interval(gained, lost, len(baseline), z))
    widen = math.sqrt(design_effect)
    return 100 * estimate, 100 * (estimate - widen * (estimate - low)), 100 * (estimate + widen * (high - estimate))


def t_interval(values: list[float], alpha_two_sided: float) -> tuple[float, float, float]:
    """Mean of paired differences with a Student-t interval (one value: its own point, no width claimed)."""
    from scipy.stats import t as student

    x = np.asarray(values, dtype=np.float64)
    mean = float(x.mean())
    if x.size < 2:
        return mean, mean, mean
    half = float(student.ppf(1 - alpha_two_sided / 2, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size))
    return mean, mean - half, mean + half


def bootstrap_interval(values: list[float], confidence: float, rounds: int, seed: str) -> tuple[float, float]:
    """Percentile interval of the mean of ``values`` over ``rounds`` resamplings of the paired items (numpy)."""
    import hashlib

    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(f"quantkit-bootstrap-{seed}".encode()).digest()[:8],
                                               "little"))
    x = np.asarray(values, dtype=np.float64)
    means = x[rng.integers(0, x.size, size=(rounds, x.size))].mean(axis=1)
    tail = (1 - confidence) / 2
    return float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail))


def design_effect(differences: list[float], clusters: list[str]) -> float:
    """Cluster-robust variance of the mean difference over the independent one: sum over clusters of (sum of
    centred differences)^2, with the G / (G - 1) small-sample factor, over the sum of squared centred differences.
    Never below 1: clustering may widen an interval, never narrow it (differences that cancel within each cluster
    give 0, which once divided a margin by zero)."""
    d = np.asarray(differences, dtype=np.float64)
    centred = d - d.mean()
    independent = float((centred ** 2).sum())
    groups: dict[str, float] = {}
    for value, cluster in zip(centred, clusters, strict=True):
        groups[cluster] = groups.get(cluster, 0.0) + float(value)
    g = len(groups)
    if independent == 0 or g < 2:
        return 1.0
    clustered = g / (g - 1) * sum(v * v for v in groups.values())
    return max(clustered / independent, 1.0)


def spent(alpha: float, t: float, spending: str) -> float:
    """One-sided alpha spent by information fraction ``t`` (Lan-DeMets): O'Brien-Fleming-like
    2 - 2 Phi(z_{alpha/2} / sqrt(t)) (for a one-sided alpha: 2 (1 - Phi(z_alpha / sqrt t))), or Pocock-like
    alpha ln(1 + (e - 1) t)."""
    if t >= 1:
        return alpha
    if spending == "pocock":
        return alpha * math.log(1 + (math.e - 1) * t)
    return 2 * (1 - _NORMAL.cdf(z_of(alpha / 2) / math.sqrt(t)))


def look_alphas(alpha: float, looks: list[float], spending: str) -> list[float]:
    """The one-sided alpha each look tests at: what the spending function adds since the previous look."""
    previous, out = 0.0, []
    for t in looks:
        now = spent(alpha, t, spending)
        out.append(max(now - previous, 1e-12))
        previous = now
    return out


def certifiable_margin(n: int, discordance: float, z: float) -> float:
    """Points of margin ``n`` items can certify when the candidate flips a share ``discordance`` of them both ways
    evenly (true delta 0): minus the low end of Tango's interval at that table."""
    flips = discordance * n / 2
    _, low, _ = tango_interval(flips, flips, n, z)
    return float(-100 * low)


def items_for_margin(margin: float, discordance: float, z: float, limit: int = 10**8) -> int:
    """The fewest items whose interval, at this discordance and true delta 0, certifies ``margin`` points (the same
    interval the verdict uses)."""
    if margin <= 0:
        return limit
    n = 1
    while n < limit and certifiable_margin(n, discordance, z) >= margin:
        n *= 2
    lo, hi = n // 2, n
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if certifiable_margin(mid, discordance, z) >= margin else (lo, mid)
    return hi
