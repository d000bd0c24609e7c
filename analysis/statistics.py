"""Paired comparisons of two arms over shared seeds, and the verdict they support.

Two arms that start from the same cold start and share a seed share its prompts' order and sampling stream, so the
comparison is paired: the per-seed difference d_i = arm_i − baseline_i. For each arm against a named baseline arm:

- **mean difference with a 95% bootstrap interval**: `scipy.stats.bootstrap(paired=True)`, percentile method, the
  seeds resampled as pairs (the convention of `rliable`, Agarwal et al., "Deep RL at the Edge of the Statistical
  Precipice", NeurIPS 2021, whose stratified bootstrap with one task is this one);
- **the exact paired sign-flip test** (`scipy.stats.permutation_test(permutation_type="samples")`, all 2^n sign
  patterns): a percentile interval from few seeds does not hold its 95% — with 3 seeds it has 10 distinct resamples
  and excludes 0 whenever the three differences share a sign, a chance of 1 in 4 when the arms do not differ — while
  the sign-flip test is exact at any n (it assumes only that, without an effect, d_i is as likely +|d_i| as −|d_i|);
- **the probability of improvement** P(X > Y) (rliable's: the Mann-Whitney share of all (arm seed, baseline seed)
  pairs where the arm is higher, ties counted half) with its bootstrap interval;
- **the interquartile mean** of each arm (`scipy.stats.trim_mean(x, 0.25)`, rliable's IQM) from 5 seeds on.

The verdict: **separates** when the 95% interval of the mean difference excludes 0 *and* the sign-flip test gives
p < 0.05; otherwise **not distinguishable**, with the smallest effect these seeds could have detected: the mean
difference a two-sided paired t-test at α = 0.05 finds with 80% power given n seeds and the observed spread of the
differences (noncentral t), or none at n ≤ 5, where no sign-flip test reaches p < 0.05 (its smallest p is 2/2^n).

Why scipy and not rliable itself: the design here is paired (rliable's intervals resample each arm's runs
independently, which throws the pairing away), scipy has both the paired bootstrap and the exact permutation test,
and it is maintained; rliable would add `arch` and `seaborn` for the same percentile bootstrap.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
from scipy import optimize, stats

CONFIDENCE = 0.95
ALPHA = 0.05
POWER = 0.8
RESAMPLES = 10_000
IQM_FROM = 5  # seeds from which an arm's interquartile mean is reported (a quarter trimmed from each end)
RNG_SEED = 0  # the bootstrap's own stream: a report computes the same intervals every time


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
    improvement: Interval  # P(arm > baseline) over all cross-seed pairs, with its 95% bootstrap interval
    arm_iqm: Interval | None  # from IQM_FROM seeds on
    baseline_iqm: Interval | None
    detectable: float  # the smallest mean difference these seeds could detect (inf: none)
    separates: bool

    @property
    def verdict(self) -> str:
        if self.separates:
            return "separates (95% CI of the difference excludes 0)"
        if math.isinf(self.detectable):
            return (f"not distinguishable (with {self.seeds} seeds no paired test reaches p < {ALPHA:g}: "
                    "at least 6 are needed)")
        return (f"not distinguishable (with {self.seeds} seeds the smallest effect this could detect is "
                f"{self.detectable:.3f})")

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


def _bootstrap(data: tuple[np.ndarray, ...], statistic, paired: bool) -> Interval:
    estimate = float(statistic(*data))
    if np.all([np.all(sample == sample[0]) for sample in data]):  # nothing to resample: the interval is the point
        return Interval(estimate, estimate, estimate)
    result = stats.bootstrap(data, statistic, paired=paired, vectorized=True, method="percentile",
                             confidence_level=CONFIDENCE, n_resamples=RESAMPLES, rng=np.random.default_rng(RNG_SEED))
    return Interval(estimate, float(result.confidence_interval.low), float(result.confidence_interval.high))


def mean_interval(values: np.ndarray | list[float]) -> Interval:
    """An arm's mean over seeds with its 95% percentile bootstrap interval (the same bootstrap as `compare`): what a
    report with one arm, and so nothing to compare, can say of how far other seeds could move it."""
    values = np.asarray(values, dtype=float)
    if len(values) < 2:
        raise ValueError(f"an interval over seeds needs at least 2 seeds, got {len(values)}")
    return _bootstrap((values,), lambda sample, axis=-1: np.mean(sample, axis=axis), paired=False)


def sign_flip_p(differences: np.ndarray) -> float:
    """The two-sided p-value of the exact paired sign-flip test of mean difference 0 (every one of the 2^n sign
    patterns; 1.0 when every difference is 0)."""
    if np.all(differences == 0):
        return 1.0
    result = stats.permutation_test((differences, np.zeros_like(differences)), _mean_difference,
                                    permutation_type="samples", vectorized=True, n_resamples=np.inf,
                                    alternative="two-sided")
    return float(result.pvalue)


def detectable_effect(seeds: int, spread: float) -> float:
    """The mean paired difference a two-sided paired t-test at `ALPHA` detects with `POWER` from `seeds` seeds whose
    differences have sample std `spread` (power from the noncentral t); inf where no exact sign-flip test on that
    many seeds can reach p < ALPHA (2/2^n ≥ ALPHA), 0 where the differences do not spread at all."""
    if seeds < 2 or 2 / 2**seeds >= ALPHA:
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
        raise ValueError(f"compare needs one value per shared seed for each arm, got shapes {arm.shape} and "
                         f"{baseline.shape}")
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
        improvement=improvement,
        arm_iqm=_bootstrap((arm,), _interquartile_mean, paired=False) if iqm else None,
        baseline_iqm=_bootstrap((baseline,), _interquartile_mean, paired=False) if iqm else None,
        detectable=detectable_effect(len(arm), float(np.std(differences, ddof=1))),
        separates=difference.excludes(0.0) and p_value < ALPHA,
    )


def accuracy_interval(accuracy: float, prompts: int, level: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of an accuracy measured on `prompts` prompts (each right or wrong): how far another
    draw of as many prompts could move it. The interval of one evaluation, not of a comparison between runs."""
    correct = round(accuracy * prompts)
    interval = stats.binomtest(correct, prompts).proportion_ci(confidence_level=level, method="wilson")
    return float(interval.low), float(interval.high)
