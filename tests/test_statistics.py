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

    low, high = accuracy_interval(
        0.5, 100
    )  # Wilson by hand: (0.5 + z²/200 ± z·sqrt(0.25/100 + z²/40000)) / (1 + z²/100)
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


def test_the_sign_flip_test_counts_ties_on_the_grid_of_k_over_n_accuracies():
    """Gains on the 500-prompt split are differences of float32 accuracies k/500: two sign patterns whose means are
    equal on that grid differ in float by float32's rounding, and must still count as reaching the observed mean."""
    from fractions import Fraction
    from itertools import product

    counts = [
        [261, 156, 334, 187],
        [220, 284, 242, 264],
        [267, 181, 152, 340],
        [311, 180, 284, 252],
        [297, 178, 290, 293],
        [349, 205, 236, 176],
    ]  # per seed: arm start, arm end, baseline start, end (of 500)
    accuracy = (np.array(counts) / 500).astype(np.float32).astype(float)
    differences = (accuracy[:, 1] - accuracy[:, 0]) - (accuracy[:, 3] - accuracy[:, 2])
    exact = [Fraction(int(k[1] - k[0] - k[3] + k[2]), 500) for k in counts]
    reached = sum(
        abs(sum(s * d for s, d in zip(signs, exact))) >= abs(sum(exact)) for signs in product((1, -1), repeat=6)
    )
    assert sign_flip_p(differences) == pytest.approx(reached / 64, abs=1e-12)


def test_holm_adjusts_a_family_by_hand():
    from analysis.statistics import holm

    # sorted 0.01, 0.03, 0.04 → ×3, ×2, ×1 = 0.03, 0.06, 0.04 → running maximum 0.03, 0.06, 0.06
    assert holm([0.01, 0.04, 0.03]).tolist() == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5, 0.9]).tolist() == pytest.approx([1.0, 1.0])
    assert holm([0.02]).tolist() == pytest.approx([0.02])


def test_the_share_of_pairs_ahead_is_the_paired_probability_of_improvement():
    comparison = compare([0.3, 0.5, 0.5, 0.1], [0.2, 0.5, 0.6, 0.0])  # ahead, tie, behind, ahead
    assert comparison.pairs_ahead == pytest.approx((1 + 0.5 + 0 + 1) / 4)
    assert comparison.improvement.estimate == pytest.approx(
        probability_of_improvement(np.array([0.3, 0.5, 0.5, 0.1]), np.array([0.2, 0.5, 0.6, 0.0]))
    )  # rliable's, unpaired, stays in the CSV


def test_across_starts_weights_every_start_alike_and_tests_the_starts_signs():
    from analysis.statistics import across_starts, multi_bootstrap

    by_start = {
        f"start{k}": np.full(2 if k else 40, 0.01 * (k + 1)) + np.linspace(-1e-3, 1e-3, 2 if k else 40)
        for k in range(6)
    }
    result = across_starts(by_start)
    assert result.starts == 6 and result.seeds["start0"] == 40
    assert result.per_start == pytest.approx({f"start{k}": 0.01 * (k + 1) for k in range(6)})
    assert result.difference.estimate == pytest.approx(0.035)  # the mean of the starts' means, not of the 50 pairs
    assert result.difference.low <= 0.035 <= result.difference.high and result.difference.low > 0
    assert result.signs_agree and result.p_value == pytest.approx(2 / 64)
    draws = multi_bootstrap([np.zeros(40), np.ones(1)], 4000, np.random.default_rng(0))
    assert draws.mean() == pytest.approx(0.5, abs=0.03), "a start of one seed weighs as much as one of forty"
    mixed = across_starts({"a": [0.1, 0.2], "b": [-0.05], "c": [0.3]})
    assert not mixed.signs_agree and mixed.p_value >= 2 / 8, "three starts: no p below 1/4"
    with pytest.raises(ValueError, match="a two-level interval needs at least 2 cold starts, got 1"):
        across_starts({"a": [0.1, 0.2, 0.3]})


def test_the_two_level_interval_covers_the_recipes_effect_where_one_starts_interval_falls_short():
    """Synthetic runs whose effect varies between cold starts by one standard error of a ten-seed mean (the spread the
    audit saw): a one-start interval on ten seeds estimates that start's effect and covers the recipe's about 4
    times in 5; six starts of two seeds, bootstrapped on both levels, hold about 95%."""
    from analysis.statistics import mean_interval, multi_bootstrap

    rng = np.random.default_rng(7)
    effect, seed_sd, simulations = 0.1, 0.1, 300
    start_sd = seed_sd / np.sqrt(10)
    two_level = one_start = 0
    for _ in range(simulations):
        starts = rng.normal(effect, start_sd, 6)
        draws = multi_bootstrap([rng.normal(start, seed_sd, 2) for start in starts], 1000, rng)
        low, high = np.percentile(draws, [2.5, 97.5])
        two_level += low <= effect <= high
        one_start += not mean_interval(rng.normal(starts[0], seed_sd, 10)).excludes(effect)
    assert two_level / simulations >= 0.9
    assert one_start / simulations <= 0.86
    assert two_level - one_start >= 0.08 * simulations
