"""Uncertainty of sweep results: the spread over seeds and paired gaps with intervals.

A policy's gap to the baseline is paired by seed: for each seed both ran under (same
initialization, data order and stochastic-rounding keys), ``gap_s = 100 (L_policy,s -
L_base,s) / L_base,s``; the report gives the mean gap and its 95 % t interval
``mean ± t(0.975, n-1) sd / sqrt(n)`` over the ``n`` seeds, and calls the gap distinguishable
from zero when that interval excludes zero. One seed gives a gap and no interval.

Whether a gap changes between two settings (a larger model, the late BF16 switch, another
optimizer) is paired the same way: per seed ``gap_s(a) - gap_s(b)``, each gap against its
own setting's baseline, with the t interval of the mean difference.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from scipy import stats as _scipy_stats

__all__ = ["Interval", "GapDifference", "mean_interval", "paired_gap", "gap_difference"]


class Interval(NamedTuple):
    mean: float
    low: float  # NaN with fewer than 2 samples
    high: float
    n: int

    @property
    def distinguishable(self) -> bool | None:
        """Whether the interval excludes zero (``None``: no interval)."""
        if not math.isfinite(self.low):
            return None
        return self.low > 0 or self.high < 0


def mean_interval(values, confidence: float = 0.95) -> Interval:
    """The mean of ``values`` and its two-sided t interval."""
    v = np.asarray(list(values), float)
    if v.size == 0:
        return Interval(math.nan, math.nan, math.nan, 0)
    mean = float(v.mean())
    if v.size < 2:
        return Interval(mean, math.nan, math.nan, 1)
    half = float(_scipy_stats.t.ppf(0.5 + confidence / 2, v.size - 1) * v.std(ddof=1)
                 / math.sqrt(v.size))
    return Interval(mean, mean - half, mean + half, int(v.size))


def paired_gap(values: dict[int, float], base: dict[int, float],
               confidence: float = 0.95) -> Interval:
    """The relative gap in % of ``values`` to ``base`` (both keyed by seed), paired over the
    seeds both have."""
    seeds = sorted(set(values) & set(base))
    return mean_interval(_relative_gaps(values, base, seeds), confidence)


def _relative_gaps(values: dict[int, float], base: dict[int, float], seeds) -> list[float]:
    return [100 * (values[s] - base[s]) / base[s] for s in seeds]


class GapDifference(NamedTuple):
    gap: float  # mean gap in % of the first setting, over the shared seeds
    gap_there: float  # the same for the second setting
    difference: Interval  # of the per-seed differences gap - gap_there


def gap_difference(values: dict[int, float], base: dict[int, float],
                   values_there: dict[int, float], base_there: dict[int, float],
                   confidence: float = 0.95) -> GapDifference:
    """How the relative gap of ``values`` to ``base`` differs from the gap of
    ``values_there`` to ``base_there`` (all keyed by seed), paired over the seeds all four
    have."""
    seeds = sorted(set(values) & set(base) & set(values_there) & set(base_there))
    here = _relative_gaps(values, base, seeds)
    there = _relative_gaps(values_there, base_there, seeds)
    nan = float("nan")
    return GapDifference(float(np.mean(here)) if seeds else nan,
                         float(np.mean(there)) if seeds else nan,
                         mean_interval((a - b for a, b in zip(here, there, strict=True)), confidence))
