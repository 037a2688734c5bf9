"""The few statistics sao reports: means of finite values, standard errors, paired differences, pooled variances.

One home, so every figure with a ± is computed the same way: s.e. = sd (n - 1) / sqrt(n).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import numpy as np


def finite(values: list[Any]) -> list[float]:
    """The finite numbers among `values` (NaN, inf, None and non-numbers are left out)."""
    return [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def mean(values: list[Any]) -> float | None:
    """Mean of the finite values; None when there are none."""
    kept = finite(values)
    return sum(kept) / len(kept) if kept else None


def stderr(values: list[float]) -> float | None:
    """Standard error of the mean (sample sd / sqrt(n)); None below two values."""
    return statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else None


def pooled_variance(groups: list[list[float]]) -> float | None:
    """The within-group variance pooled over groups: squared deviations from each group's own mean over
    the sum of (n - 1); None when no group has two values."""
    freedom = sum(len(group) - 1 for group in groups if group)
    if freedom < 1:
        return None
    return sum(sum((x - statistics.fmean(group)) ** 2 for x in group) for group in groups if group) / freedom


def percentile(values: list[Any], q: float) -> float | None:
    """The q-th percentile (0..100) of the finite values, interpolated linearly; None when there are none."""
    kept = finite(values)
    return float(np.percentile(kept, q)) if kept else None


def paired_gain(base: list[float], final: list[float]) -> tuple[float | None, float | None]:
    """Mean of the per-item differences final - base, and its standard error."""
    if len(base) != len(final):
        raise ValueError(f"paired scores need one base and one final score per item ({len(base)} vs {len(final)})")
    differences = [after - before for before, after in zip(base, final)]
    return (sum(differences) / len(differences) if differences else None), stderr(differences)
