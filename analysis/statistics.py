"""Paired comparisons of two arms over shared seeds, across cold starts, and the verdict a declared family supports.

Two arms that start from the same cold start and share a seed share its prompts' order and sampling stream, so the
comparison is paired: the per-seed difference d_i = arm_i − baseline_i. For each arm against a named baseline arm:

- **mean difference with a 95% bootstrap interval**: `scipy.stats.bootstrap(paired=True)`, percentile method, the
  seeds resampled as pairs (the convention of `rliable`, Agarwal et al., "Deep RL at the Edge of the Statistical
  Precipice", NeurIPS 2021, whose stratified bootstrap with one task is this one);
- **the exact paired sign-flip test** (every one of the 2^n sign patterns, `sign_flip_p`): a percentile interval
  from few seeds does not hold its 95% — with 3 seeds it has 10 distinct resamples and excludes 0 whenever the three
  differences share a sign, a chance of 1 in 4 when the arms do not differ — while the sign-flip test is exact at any
  n (it assumes only that, without an effect, d_i is as likely +|d_i| as −|d_i|). Sign patterns whose mean ties the
  observed one count as at least as extreme: accuracies are k/n on n prompts stored as float32, so two means equal on
  that grid differ in float by float32's rounding (below 3e-7 for a difference of two gains), never by the grid's
  spacing, and a tie is a difference below `TIE` (1e-6);
- **the share of pairs the arm leads** (its paired form of the probability of improvement: d_i > 0 counts 1, a tie
  ½), and, in the CSV, rliable's unpaired P(X > Y) (the Mann-Whitney share of all (arm seed, baseline seed) pairs,
  ties counted half) with its bootstrap interval: a statement about two seeds drawn apart, not about pairs;
- **the interquartile mean** of each arm (`scipy.stats.trim_mean(x, 0.25)`, rliable's IQM) from 5 seeds on.

Those numbers are about one cold start: they cover the seeds' noise, not the start's. Where the runs come from K ≥ 2
starts (each named by its weights' sha256), `across_starts` adds the recipe's view:

- **the two-level bootstrap** of the mean paired difference: starts resampled with replacement, then seeds within
  each drawn start, each start weighted equally (the multi-bootstrap of MultiBERTs, Sellam et al., arXiv
  2106.16163), percentile interval;
- **the exact start-level sign-flip test** on the per-start mean differences (2^K patterns: K ≥ 6 to reach 0.05);
- **each start's own difference**, and whether its sign agrees on every start.

Two groups of starts that share no unit (one model's starts against another's) are compared unpaired, in
`analysis.unpaired`, on the intervals and constants of this module.

The verdict: **separates** when the 95% interval of the mean difference excludes 0 *and* the sign-flip test gives
p < 0.05; otherwise **not distinguishable**, with the smallest effect these seeds could have detected: the mean
difference a two-sided paired t-test at α = 0.05 finds with 80% power given n seeds and the observed spread of the
differences (noncentral t), or none at n ≤ 5, where no sign-flip test reaches p < 0.05 (its smallest p is 2/2^n).
Over a family of comparisons the p-values are first adjusted by Holm's step-down correction (`holm`).

Why scipy and not rliable itself: the design here is paired (rliable's intervals resample each arm's runs
independently, which throws the pairing away), scipy has the paired bootstrap, and it is maintained; rliable would add
`arch` and `seaborn` for the same percentile bootstrap.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from scipy import optimize, stats

CONFIDENCE = 0.95
ALPHA = 0.05
POWER = 0.8
RESAMPLES = 10_000
IQM_FROM = 5  # seeds from which an arm's interquartile mean is reported (a quarter trimmed from each end)
RNG_SEED = 0  # the bootstrap's own stream: a report computes the same intervals every time
TIE = 1e-6  # two means of k/n accuracies closer than this are equal (float32's rounding, not the grid's spacing)
EXACT_PATTERNS_UP_TO = 20  # differences: beyond, the sign-flip test draws RESAMPLES * 10 sign patterns at random
EXACT_SPLITS_UP_TO = 200_000  # splits of two groups (8 + 8 starts: 12,870): beyond, RESAMPLES * 10 drawn at random


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float

    def excludes(self, value: float) -> bool:
        return not self.low <= value <= self.high

    def text(self, fmt: str = "+.3f") -> str:
        return f"{self.estimate:{fmt}} [{self.low:{fmt}}, {self.high:{fmt}}]"


@dataclass(frozen=True)
class Comparison:
    """An arm against the baseline on `seeds` shared seeds."""

    seeds: int
    difference: Interval  # mean of arm − baseline over the seeds, with its 95% bootstrap interval
    p_value: float  # the exact paired sign-flip test, two-sided
    pairs_ahead: float  # the share of the pairs in which the arm is ahead (a tie counts ½)
    improvement: Interval  # rliable's unpaired P(arm > baseline) over all cross-seed pairs, with its 95% interval
    arm_iqm: Interval | None  # from IQM_FROM seeds on
    baseline_iqm: Interval | None
    detectable: float  # the smallest mean difference these seeds could detect (inf: none)
    separates: bool

    @property
    def verdict(self) -> str:
        if self.separates:
            return "separates (95% CI of the difference excludes 0)"
        if math.isinf(self.detectable):
            return (
                f"not distinguishable (with {self.seeds} seeds no paired test reaches p < {ALPHA:g}: "
                "at least 6 are needed)"
            )
        return (
            f"not distinguishable (with {self.seeds} seeds the smallest effect this could detect is "
            f"{self.detectable:.3f})"
        )

    def row(self) -> dict[str, float | int | str | bool | None]:
        """A flat record for a CSV: every interval as estimate / low / high."""
        flat: dict[str, float | int | str | bool | None] = {"seeds": self.seeds}
        for name, value in asdict(self).items():
            if name in ("difference", "improvement", "arm_iqm", "baseline_iqm"):  # intervals, absent IQMs as None
                flat.update({f"{name}_{key}": (value or {}).get(key) for key in ("estimate", "low", "high")})
            elif name != "seeds":
                flat[name] = value
        flat["verdict"] = self.verdict
        return flat


def _mean_difference(arm: np.ndarray, baseline: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.mean(arm - baseline, axis=axis)


def probability_of_improvement(arm: np.ndarray, baseline: np.ndarray, axis: int = -1) -> np.ndarray:
    """P(X > Y) + ½ P(X = Y) over every (arm value, baseline value) pair along `axis` (rliable's definition)."""
    x = np.moveaxis(np.asarray(arm, dtype=float), axis, -1)[..., :, None]
    y = np.moveaxis(np.asarray(baseline, dtype=float), axis, -1)[..., None, :]
    return np.mean((x > y) + 0.5 * (x == y), axis=(-2, -1))


def _interquartile_mean(values: np.ndarray, axis: int = -1) -> np.ndarray:
    return stats.trim_mean(values, 0.25, axis=axis)


def _bootstrap(data: tuple[np.ndarray, ...], statistic: Callable[..., Any], paired: bool) -> Interval:
    estimate = float(statistic(*data))
    if np.all([np.all(sample == sample[0]) for sample in data]):  # nothing to resample: the interval is the point
        return Interval(estimate, estimate, estimate)
    result = stats.bootstrap(
        data,
        statistic,
        paired=paired,
        vectorized=True,
        method="percentile",
        confidence_level=CONFIDENCE,
        n_resamples=RESAMPLES,
        rng=np.random.default_rng(RNG_SEED),
    )
    return Interval(estimate, float(result.confidence_interval.low), float(result.confidence_interval.high))


def mean_interval(values: npt.ArrayLike) -> Interval:
    """An arm's mean over seeds with its 95% percentile bootstrap interval (the same bootstrap as `compare`): what a
    report with one arm, and so nothing to compare, can say of how far other seeds could move it."""
    values = np.asarray(values, dtype=float)
    if len(values) < 2:
        raise ValueError(f"an interval over seeds needs at least 2 seeds, got {len(values)}")
    return _bootstrap((values,), lambda sample, axis=-1: np.mean(sample, axis=axis), paired=False)


def sign_flip_p(differences: np.ndarray | list[float]) -> float:
    """The two-sided p-value of the exact paired sign-flip test of mean difference 0: the share of the 2^n sign
    patterns whose |mean| reaches the observed one, a pattern within `TIE` of it counting as reaching it (1.0 when every
    difference is 0). Beyond `EXACT_PATTERNS_UP_TO` differences, that share over randomly drawn patterns (the observed
    one counted among them)."""
    differences = np.asarray(differences, dtype=float)
    observed = abs(differences.mean())
    if observed <= TIE:
        return 1.0
    n = len(differences)
    reached, total = 0, 0
    if n <= EXACT_PATTERNS_UP_TO:
        bits = np.arange(n)
        for first in range(0, 2**n, 2**16):  # every pattern, 65,536 at a time
            codes = np.arange(first, min(first + 2**16, 2**n))
            signs = 1.0 - 2.0 * ((codes[:, None] >> bits) & 1)
            reached += int(np.sum(np.abs(signs @ differences) / n >= observed - TIE))
            total += len(codes)
        return reached / total
    signs = np.random.default_rng(RNG_SEED).choice([-1.0, 1.0], size=(RESAMPLES * 10, n))
    reached = int(np.sum(np.abs(signs @ differences) / n >= observed - TIE))
    return (reached + 1) / (len(signs) + 1)


def share_ahead(differences: np.ndarray | list[float]) -> float:
    """The share of paired differences above 0, a tie (|d| ≤ `TIE`) counting ½: the paired probability of
    improvement."""
    differences = np.asarray(differences, dtype=float)
    return float(np.mean((differences > TIE) + 0.5 * (np.abs(differences) <= TIE)))


def holm(p_values: list[float] | np.ndarray) -> np.ndarray:
    """Holm's step-down adjustment of a family's p-values (same order): the i-th smallest is multiplied by m − i + 1
    (i from 1), then each is raised to the largest adjusted value before it, capped at 1. It controls the chance of
    any false "separates" in the family at α, whatever the dependence between its comparisons."""
    p = np.asarray(p_values, dtype=float)
    order = np.argsort(p, kind="stable")
    scaled = p[order] * (len(p) - np.arange(len(p)))
    adjusted = np.empty_like(p)
    adjusted[order] = np.minimum(1.0, np.maximum.accumulate(scaled))
    return adjusted


def smallest_p(units: int, family: int = 1) -> float:
    """The smallest p an exact two-sided sign-flip test on `units` paired units can give (2 / 2^n: every sign alike),
    Holm-adjusted over a `family` of comparisons (its smallest p times the family's size): at or above `ALPHA`, no
    comparison of that design can separate, whatever the data."""
    return family * 2 / 2**units


def detectable_effect(seeds: int, spread: float) -> float:
    """The mean paired difference a two-sided paired t-test at `ALPHA` detects with `POWER` from `seeds` seeds whose
    differences have sample std `spread` (power from the noncentral t); inf where no exact sign-flip test on that
    many seeds can reach p < ALPHA (2/2^n ≥ ALPHA), 0 where the differences do not spread at all."""
    if seeds < 2 or smallest_p(seeds) >= ALPHA:
        return math.inf
    if spread == 0:
        return 0.0
    df = seeds - 1
    critical = stats.t.ppf(1 - ALPHA / 2, df)

    def power_short(effect: float) -> float:
        shift = effect * math.sqrt(seeds) / spread
        return stats.nct.sf(critical, df, shift) + stats.nct.cdf(-critical, df, shift) - POWER

    # At a shift of the critical value plus 4 the power is above 0.99 for any df: the root lies below it.
    return float(optimize.brentq(power_short, 0.0, (critical + 4) * spread / math.sqrt(seeds)))


def compare(arm: np.ndarray | list[float], baseline: np.ndarray | list[float]) -> Comparison:
    """`arm` against `baseline`, both one value per shared seed, in the same seed order."""
    arm, baseline = np.asarray(arm, dtype=float), np.asarray(baseline, dtype=float)
    if arm.shape != baseline.shape or arm.ndim != 1:
        raise ValueError(
            f"compare needs one value per shared seed for each arm, got shapes {arm.shape} and {baseline.shape}"
        )
    if len(arm) < 2:
        raise ValueError(f"compare needs at least 2 shared seeds, got {len(arm)}")
    if not (np.all(np.isfinite(arm)) and np.all(np.isfinite(baseline))):
        raise ValueError("compare needs finite values; a seed without a value has no pair")
    differences = arm - baseline
    difference = _bootstrap((arm, baseline), _mean_difference, paired=True)
    p_value = sign_flip_p(differences)
    improvement = _bootstrap((arm, baseline), probability_of_improvement, paired=True)
    iqm = len(arm) >= IQM_FROM
    return Comparison(
        seeds=len(arm),
        difference=difference,
        p_value=p_value,
        pairs_ahead=share_ahead(differences),
        improvement=improvement,
        arm_iqm=_bootstrap((arm,), _interquartile_mean, paired=False) if iqm else None,
        baseline_iqm=_bootstrap((baseline,), _interquartile_mean, paired=False) if iqm else None,
        detectable=detectable_effect(len(arm), float(np.std(differences, ddof=1))),
        separates=difference.excludes(0.0) and p_value < ALPHA,
    )


def multi_bootstrap(by_start: list[np.ndarray], resamples: int, rng: np.random.Generator) -> np.ndarray:
    """`resamples` draws of the two-level bootstrap of the mean of `by_start` (one array of per-seed values per
    start): K starts drawn with replacement, then, within each drawn start, as many of its seeds as it has, drawn with
    replacement; the statistic is the mean over the drawn starts of each one's mean (every start weighted equally,
    whatever its number of seeds). Vectorised over the resamples; returns `[resamples]`."""
    sizes = np.array([len(values) for values in by_start])
    table = np.zeros((len(by_start), sizes.max()))
    for k, values in enumerate(by_start):
        table[k, : len(values)] = values
    starts = rng.integers(0, len(by_start), size=(resamples, len(by_start)))  # [B, K]
    counts = sizes[starts]  # [B, K]: the seeds of each drawn start
    seeds = np.floor(rng.random((resamples, len(by_start), sizes.max())) * counts[..., None]).astype(int)
    drawn = np.where(np.arange(sizes.max()) < counts[..., None], table[starts[..., None], seeds], 0.0)
    return (drawn.sum(axis=-1) / counts).mean(axis=-1)


@dataclass(frozen=True)
class AcrossStarts:
    """An arm against the baseline over K cold starts (the recipe's view; `Comparison` is one start's)."""

    starts: int
    difference: Interval  # the mean over starts of each start's mean paired difference, two-level 95% interval
    p_value: float  # the exact start-level sign-flip test on the per-start mean differences, two-sided
    per_start: dict[str, float]  # each start's own mean paired difference
    seeds: dict[str, int]  # each start's pairs

    @property
    def signs_agree(self) -> bool:
        """Whether every start's difference has the same sign (a 0 agrees with neither)."""
        values = np.array(list(self.per_start.values()))
        return bool(np.all(values > TIE) or np.all(values < -TIE))

    def row(self) -> dict[str, float | int | str | bool]:
        return {
            "starts": self.starts,
            "starts_difference_estimate": self.difference.estimate,
            "starts_difference_low": self.difference.low,
            "starts_difference_high": self.difference.high,
            "starts_p_value": self.p_value,
            "starts_agree": self.signs_agree,
            "per_start": "; ".join(
                f"{start[:12] or '?'}: {value:+.3f} ({self.seeds[start]})" for start, value in self.per_start.items()
            ),
        }


def across_starts(differences: Mapping[str, np.ndarray | list[float]]) -> AcrossStarts:
    """The paired differences of an arm against the baseline grouped by cold start (`{start sha256: one difference
    per shared seed}`): the two-level bootstrap interval, the start-level sign-flip test and each start's own
    difference. A two-level interval needs at least 2 starts."""
    if len(differences) < 2:
        raise ValueError(
            f"a two-level interval needs at least 2 cold starts, got {len(differences)}: with one start "
            "only the within-start statistics apply"
        )
    by_start = {start: np.asarray(values, dtype=float) for start, values in differences.items()}
    if any(len(values) == 0 or not np.all(np.isfinite(values)) for values in by_start.values()):
        raise ValueError("across_starts needs at least one finite paired difference per start")
    per_start = {start: float(values.mean()) for start, values in by_start.items()}
    return AcrossStarts(
        starts=len(by_start),
        difference=starts_interval(by_start),
        p_value=sign_flip_p(np.array(list(per_start.values()))),
        per_start=per_start,
        seeds={start: len(values) for start, values in by_start.items()},
    )


def starts_interval(by_start: Mapping[str, np.ndarray | list[float]]) -> Interval:
    """The mean over cold starts of each start's mean (`{start sha256: one value per seed}`, every start weighted
    equally, whatever its number of seeds) with its 95% interval from the two-level bootstrap (`multi_bootstrap`,
    percentile): how far other starts of the same recipe, and other seeds, could move it."""
    values = [np.asarray(seeds, dtype=float) for seeds in by_start.values()]
    draws = multi_bootstrap(values, RESAMPLES, np.random.default_rng(RNG_SEED))
    low, high = np.percentile(draws, [100 * (1 - CONFIDENCE) / 2, 100 * (1 + CONFIDENCE) / 2])
    return Interval(float(np.mean([seeds.mean() for seeds in values])), float(low), float(high))


def accuracy_interval(accuracy: float, prompts: int, level: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of an accuracy measured on `prompts` prompts (each right or wrong): how far another
    draw of as many prompts could move it. The interval of one evaluation, not of a comparison between runs."""
    correct = round(accuracy * prompts)
    interval = stats.binomtest(correct, prompts).proportion_ci(confidence_level=level, method="wilson")
    return float(interval.low), float(interval.high)
