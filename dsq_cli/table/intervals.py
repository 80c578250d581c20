"""Confidence intervals over seeds, for `dsq table` (docs/table.md, "Intervals").

A row's seeds are a small sample of what its recipe scores, so a mean alone says little. Each
mean gets the Student t interval

    mean ± t(1 - (1 - level) / 2, n - 1) · s / sqrt(n)

with ``s`` the sample standard deviation (n - 1 in the denominator). Two rows are compared seed
by seed: runs of one seed share their initialisation and data order, so the differences of
paired runs vary less than either row. The interval of a paired difference is the same formula
over the per-seed differences.

The t quantile comes from the regularized incomplete beta function (continued fraction, as in
Numerical Recipes, §6.4) inverted by bisection: pure Python, no scipy at run time.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def regularized_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, for a, b > 0 and 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    front = math.exp(log_front)
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_continued_fraction(a, b, x) / a
    return 1.0 - front * _beta_continued_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    tail = 0.5 * regularized_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` (>= 1) degrees of freedom, to about 1e-10."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"a quantile needs 0 < p < 1, got {p}")
    if df < 1:
        raise ValueError(f"Student's t needs at least 1 degree of freedom, got {df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        high *= 2.0
    for _ in range(200):
        mid = 0.5 * (low + high)
        if t_cdf(mid, df) < p:
            low = mid
        else:
            high = mid
        if high - low <= 1e-13 * max(1.0, high):
            break
    return 0.5 * (low + high)


@dataclass(frozen=True)
class Interval:
    """A mean over ``n`` values with its two-sided confidence interval at ``level``; ``low`` and
    ``high`` are None below two values (no spread to estimate)."""

    mean: float
    n: int
    sd: float | None
    level: float
    low: float | None
    high: float | None

    @property
    def excludes_zero(self) -> bool:
        return self.low is not None and (self.low > 0 or self.high < 0)

    def as_dict(self) -> dict:
        return {
            "mean": self.mean,
            "n": self.n,
            "sd": self.sd,
            "level": self.level,
            "low": self.low,
            "high": self.high,
        }


def mean_interval(values: Sequence[float], level: float = 0.95) -> Interval:
    """The Student t interval of the mean of ``values`` (at least one)."""
    if not values:
        raise ValueError("an interval needs at least one value")
    n, mean = len(values), statistics.fmean(values)
    if n < 2:
        return Interval(mean, n, None, level, None, None)
    sd = statistics.stdev(values)
    half = t_quantile(1.0 - (1.0 - level) / 2.0, n - 1) * sd / math.sqrt(n)
    return Interval(mean, n, sd, level, mean - half, mean + half)


def paired_differences(
    values: Mapping[object, float], against: Mapping[object, float]
) -> list[float]:
    """``values[k] - against[k]`` for every key (seed) both hold, in key order."""
    keys = sorted(set(values) & set(against), key=lambda k: (str(type(k)), k))
    return [values[k] - against[k] for k in keys]


def paired_interval(
    values: Mapping[object, float], against: Mapping[object, float], level: float = 0.95
) -> Interval | None:
    """The interval of the mean paired difference, or None when no key is shared."""
    differences = paired_differences(values, against)
    return mean_interval(differences, level) if differences else None


def p_value(interval: Interval) -> float | None:
    """The two-sided p of the t test that the mean is 0 (None below two values): for a paired
    difference, the paired t test."""
    if interval.low is None or interval.sd is None:
        return None
    if interval.sd == 0:
        return 1.0 if interval.mean == 0 else 0.0
    t = abs(interval.mean) / (interval.sd / math.sqrt(interval.n))
    return 2.0 * (1.0 - t_cdf(t, interval.n - 1))


def equivalence_p(interval: Interval, margin: float) -> float | None:
    """The p of two one-sided t tests that the mean lies inside ± ``margin`` (TOST): the larger
    of the two one-sided p-values, each testing that the mean is at or beyond one edge. None
    below two values. It is below (1 - level) / 2 exactly where the interval at ``level`` lies
    inside the margin."""
    if interval.low is None or interval.sd is None:
        return None
    if interval.sd == 0:
        return 0.0 if abs(interval.mean) < margin else 1.0
    se = interval.sd / math.sqrt(interval.n)
    df = interval.n - 1
    above_lower = 1.0 - t_cdf((interval.mean + margin) / se, df)  # H0: mean <= -margin
    below_upper = t_cdf((interval.mean - margin) / se, df)  # H0: mean >= +margin
    return max(above_lower, below_upper)


def holm(p_values: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjustment of a block of p-values (None left out and kept as None):
    the i-th smallest of m is multiplied by m - i, each kept at least its predecessor's
    adjusted value and at most 1."""
    order = sorted((p, i) for i, p in enumerate(p_values) if p is not None)
    adjusted: list[float | None] = [None] * len(p_values)
    running = 0.0
    for rank, (p, i) in enumerate(order):
        running = max(running, min(1.0, (len(order) - rank) * p))
        adjusted[i] = running
    return adjusted


def inside(interval: Interval | None, margin: float | None) -> bool | None:
    """Whether ``interval`` lies inside ± ``margin`` (None without either or below two pairs)."""
    if interval is None or interval.low is None or margin is None:
        return None
    return -margin < interval.low and interval.high < margin
