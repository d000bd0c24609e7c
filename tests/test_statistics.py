"""The paired comparison on synthetic seeds with known effects: it finds an effect ten seeds can show, does not claim
one from three, holds its false-positive rate without an effect, and its numbers match hand computations."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from analysis.statistics import compare, detectable_effect, probability_of_improvement, sign_flip_p


def synthetic_seeds(rng: np.random.Generator, seeds: int, effect: float, spread: float):
    """Per seed, a baseline that varies a lot between seeds (σ 0.3, as held-out gains do) and an arm that differs
    from it by `effect` with paired noise `spread`."""
    baseline = rng.normal(0.0, 0.3, seeds)
    return baseline + rng.normal(effect, spread, seeds), baseline


def test_ten_seeds_detect_an_effect_of_0_2_with_spread_0_1():
    rng = np.random.default_rng(0)
    verdicts = [compare(*synthetic_seeds(rng, 10, 0.2, 0.1)) for _ in range(20)]
    assert all(c.separates for c in verdicts)
    assert all(c.verdict.startswith("separates") for c in verdicts)


def test_three_seeds_never_claim_it():
    rng = np.random.default_rng(1)
    for _ in range(20):
        comparison = compare(*synthetic_seeds(rng, 3, 0.2, 0.1))
        assert not comparison.separates
        assert "with 3 seeds no paired test reaches p < 0.05" in comparison.verdict


def test_three_seeds_that_share_a_sign_are_not_enough_although_a_percentile_interval_excludes_zero():
    # deep_long_seeds' GSPO − GRPO: +0.12, +0.29, +0.38. The bootstrap's 10 resamples all lie above 0.
    comparison = compare([0.62, 0.59, 0.78], [0.5, 0.3, 0.4])
    assert comparison.difference.low > 0 and comparison.p_value == pytest.approx(0.25)
    assert not comparison.separates


def test_without_an_effect_ten_seeds_claim_one_at_most_at_the_nominal_rate():
    rng = np.random.default_rng(2)
    claims = sum(compare(*synthetic_seeds(rng, 10, 0.0, 0.1)).separates for _ in range(300))
    assert claims / 300 <= 0.08  # nominal 5%; three standard errors above it


def test_the_undetected_verdict_names_the_smallest_effect_its_seeds_could_detect():
    rng = np.random.default_rng(3)
    arm, baseline = synthetic_seeds(rng, 10, 0.02, 0.1)
    comparison = compare(arm, baseline)
    assert not comparison.separates
    spread = np.std(arm - baseline, ddof=1)
    assert comparison.detectable == pytest.approx(detectable_effect(10, spread))
    assert f"the smallest effect this could detect is {comparison.detectable:.3f}" in comparison.verdict


def test_the_detectable_effect_has_80_percent_power_by_simulation():
    effect = detectable_effect(10, 0.1)
    assert 0.09 < effect < 0.11  # (t_0.975,9 + t_0.8,9) · 0.1 / √10 ≈ 0.0995 by the normal-approximation formula
    rng = np.random.default_rng(4)
    differences = rng.normal(effect, 0.1, (4000, 10))
    power = np.mean(stats.ttest_1samp(differences, 0.0, axis=1).pvalue < 0.05)
    assert power == pytest.approx(0.8, abs=0.03)
    assert detectable_effect(5, 0.1) == np.inf  # 2/2^5 > 0.05: no sign-flip test on 5 seeds reaches it


def test_the_sign_flip_p_value_counts_sign_patterns_by_hand():
    # d = (1, 2, 3): of the 8 sign patterns, |mean| >= 2 only for (+,+,+) and (−,−,−)
    assert sign_flip_p(np.array([1.0, 2.0, 3.0])) == pytest.approx(2 / 8)
    # d = (3, −1, 1, 1): the share of the 16 sign patterns whose |mean| reaches the observed 1, enumerated
    patterns = np.array(np.meshgrid(*[[-1, 1]] * 4)).reshape(4, -1).T * np.array([3.0, -1.0, 1.0, 1.0])
    by_hand = np.mean(np.abs(patterns.mean(axis=1)) >= 1.0 - 1e-12)
    assert sign_flip_p(np.array([3.0, -1.0, 1.0, 1.0])) == pytest.approx(by_hand)


def test_probability_of_improvement_is_the_mann_whitney_share_by_hand():
    arm, baseline = np.array([0.3, 0.5, 0.5]), np.array([0.5, 0.1, 0.2])
    # pairs (arm, baseline): 0.3 beats 0.1, 0.2 (2), ties none; each 0.5 ties 0.5 and beats 0.1, 0.2 (2.5 each)
    assert probability_of_improvement(arm, baseline) == pytest.approx((2 + 2.5 + 2.5) / 9)


def test_interquartile_means_appear_from_five_seeds_and_bad_input_is_refused():
    rng = np.random.default_rng(5)
    assert compare(*synthetic_seeds(rng, 4, 0.1, 0.1)).arm_iqm is None
    five = compare(*synthetic_seeds(rng, 5, 0.1, 0.1))
    assert five.arm_iqm is not None and five.arm_iqm.low <= five.arm_iqm.estimate <= five.arm_iqm.high
    with pytest.raises(ValueError, match="one value per shared seed"):
        compare([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="finite"):
        compare([1.0, np.nan], [1.0, 2.0])


def test_an_accuracys_interval_is_wilsons_and_narrows_with_more_prompts():
    from analysis.statistics import accuracy_interval

    low, high = accuracy_interval(0.5, 100)  # Wilson by hand: (0.5 + z²/200 ± z·sqrt(0.25/100 + z²/40000)) / (1 + z²/100)
    z = 1.959964
    centre, half = (0.5 + z * z / 200) / (1 + z * z / 100), z * (0.25 / 100 + z * z / 40000) ** 0.5 / (1 + z * z / 100)
    assert (low, high) == pytest.approx((centre - half, centre + half), abs=1e-6)
    wide, narrow = accuracy_interval(0.9, 50), accuracy_interval(0.9, 500)
    assert wide[0] < narrow[0] < 0.9 < narrow[1] < wide[1] <= 1.0


def test_one_arms_mean_interval_narrows_with_seeds_and_needs_two():
    from analysis.statistics import mean_interval

    rng = np.random.default_rng(3)
    few, many = mean_interval(rng.normal(0.1, 0.3, 3)), mean_interval(rng.normal(0.1, 0.3, 30))
    assert few.low <= few.estimate <= few.high and many.high - many.low < few.high - few.low
    assert many.excludes(-0.2) and not many.excludes(0.1)
    with pytest.raises(ValueError, match="at least 2 seeds, got 1"):
        mean_interval([0.5])
