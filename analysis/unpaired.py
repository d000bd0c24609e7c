"""Unpaired comparisons: two groups of cold starts that share no unit (one model's starts against another's).

The difference of the groups' means over their starts (each start's value the mean over its seeds, every start
weighted equally), a two-level bootstrap of each group apart (`statistics.multi_bootstrap`), and the exact
permutation test of the starts' values between the groups (`permutation_p`: C(K1 + K2, K1) splits). The paired tests,
the intervals and the constants both kinds share are `analysis.statistics`'.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from analysis.statistics import CONFIDENCE, EXACT_SPLITS_UP_TO, RESAMPLES, RNG_SEED, TIE, Interval, multi_bootstrap


def smallest_permutation_p(first: int, second: int, family: int = 1) -> float:
    """The smallest p the exact two-sided permutation test of two groups of `first` and `second` units can give, Holm-
    adjusted over a `family` (times its size): every unit of one group beyond every unit of the other, which only the
    observed split reaches, and its mirror when the groups are of one size (2/12870 for 8 and 8)."""
    return family * (2 if first == second else 1) / math.comb(first + second, first)


def permutation_p(first: np.ndarray | list[float], second: np.ndarray | list[float]) -> float:
    """The two-sided p-value of the permutation test of equal means of two independent groups: the share of the
    splits of the pooled values into groups of the two sizes whose |difference of means| reaches the observed one
    (within `TIE`, as `sign_flip_p`; 1.0 when the means are equal). Every split up to `EXACT_SPLITS_UP_TO`; beyond,
    `RESAMPLES` * 10 random ones (the observed one counted among them), from the fixed `RNG_SEED`."""
    first, second = np.asarray(first, dtype=float), np.asarray(second, dtype=float)
    observed = abs(first.mean() - second.mean())
    if observed <= TIE:
        return 1.0
    pooled, size = np.concatenate([first, second]), len(first)
    splits = math.comb(len(pooled), size)
    if splits <= EXACT_SPLITS_UP_TO:
        chosen = np.zeros((splits, len(pooled)), dtype=bool)
        for row, members in enumerate(itertools.combinations(range(len(pooled)), size)):
            chosen[row, list(members)] = True
    else:  # a random permutation's first `size` places make the first group
        rng = np.random.default_rng(RNG_SEED)
        chosen = np.argsort(rng.random((RESAMPLES * 10, len(pooled))), axis=1) < size
    means = chosen @ pooled / size - ~chosen @ pooled / (len(pooled) - size)
    reached = int(np.sum(np.abs(means) >= observed - TIE))
    return reached / splits if splits <= EXACT_SPLITS_UP_TO else (reached + 1) / (len(chosen) + 1)


@dataclass(frozen=True)
class BetweenStarts:
    """Two groups of cold starts that share no unit (one model's starts against another's): the unpaired view of
    `AcrossStarts`, each start's value the mean over its seeds."""

    starts: tuple[int, int]
    difference: Interval  # mean over the first group's starts − over the second's, two-level 95% interval
    p_value: float  # the permutation test of the starts' values between the two groups, two-sided
    per_start: tuple[dict[str, float], dict[str, float]]  # each start's own value, per group
    seeds: tuple[dict[str, int], dict[str, int]]  # each start's seeds, per group

    @property
    def signs_agree(self) -> bool:
        """The unpaired form of "every start agrees in sign": every start of one group lies beyond every start of the
        other (what the smallest permutation p needs, as every sign alike is what the smallest sign-flip p needs)."""
        first, second = (np.array(list(values.values())) for values in self.per_start)
        return bool(first.min() - second.max() > TIE or second.min() - first.max() > TIE)


def between_starts(
    first: Mapping[str, np.ndarray | list[float]], second: Mapping[str, np.ndarray | list[float]]
) -> BetweenStarts:
    """Two independent groups of starts (`{start sha256: one value per seed}` each; a start's value is the mean of
    its seeds, every start weighted equally): the difference of the groups' means, its interval from the two-level
    bootstrap of each group apart (`multi_bootstrap`: starts within the group, then seeds within each drawn start; the
    difference of the two draws, percentile interval), the permutation test of the starts' values between the groups
    (`permutation_p`) and each start's own value. Each group needs at least 2 starts."""
    groups = [{start: np.asarray(values, dtype=float) for start, values in group.items()} for group in (first, second)]
    if min(len(group) for group in groups) < 2:
        raise ValueError(f"two groups of starts need at least 2 starts each, got {len(first)} and {len(second)}")
    if any(len(values) == 0 or not np.all(np.isfinite(values)) for group in groups for values in group.values()):
        raise ValueError("between_starts needs at least one finite value per start")
    per_start = tuple({start: float(values.mean()) for start, values in group.items()} for group in groups)
    means = [np.array(list(values.values())) for values in per_start]
    rng = np.random.default_rng(RNG_SEED)
    draws = [multi_bootstrap(list(group.values()), RESAMPLES, rng) for group in groups]
    low, high = np.percentile(draws[0] - draws[1], [100 * (1 - CONFIDENCE) / 2, 100 * (1 + CONFIDENCE) / 2])
    return BetweenStarts(
        starts=(len(groups[0]), len(groups[1])),
        difference=Interval(float(means[0].mean() - means[1].mean()), float(low), float(high)),
        p_value=permutation_p(*means),
        per_start=(per_start[0], per_start[1]),
        seeds=(
            {start: len(values) for start, values in groups[0].items()},
            {start: len(values) for start, values in groups[1].items()},
        ),
    )
