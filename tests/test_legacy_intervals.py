"""Intervals for reports made before per-seed values were kept: Welch's interval from the recorded means ± std, the
verdict no exact test on that many seeds could contradict, and a section that replaces itself when run again."""

from __future__ import annotations

import math

import pytest
from scipy import stats

from analysis.legacy_intervals import SECTION, annotate, smallest_unpaired_p

GAIN_REPORT = """# moe-rl-lab report

## Held-out accuracy gained

| arm | routing.flip_rate (SYNTHETIC) | start (greedy) | gain, end − start | seeds |
|---|---|---|---|---|
| grpo | 0 | 0.445 | +0.135 ± 0.036 | 3 |
| grpo + r2 | 0 | 0.445 | +0.164 ± 0.021 | 3 |
| grpo | 0.5 | 0.445 | −0.242 ± 0.034 | 3 |
| gspo | 0.5 | 0.445 | −0.141 | 1 |

## Stability

| series | seeds | final reward (last 10) |
|---|---|---|
| grpo | 3 | 0.5 ± 0.1 |
"""


def test_each_arm_gets_welchs_interval_against_grpo_in_its_cell_and_three_seeds_decide_nothing(tmp_path):
    report = tmp_path / "report.md"
    report.write_text(GAIN_REPORT)
    text = annotate(report, "cmd").read_text()
    # Welch by hand: difference 0.029, standard error sqrt(0.036²/3 + 0.021²/3), Welch-Satterthwaite df
    a, b = 0.036**2 / 3, 0.021**2 / 3
    df = (a + b) ** 2 / (a**2 / 2 + b**2 / 2)
    half = stats.t.ppf(0.975, df) * math.sqrt(a + b)
    assert (
        f"| routing.flip_rate (SYNTHETIC)=0 | grpo + r2 − grpo | 3 | +0.029 [{0.029 - half:+.3f}, {0.029 + half:+.3f}]"
        in text
    )
    assert "not distinguishable (3 against 3 seeds: no exact test reaches p < 0.05, its smallest p is 0.1)" in text
    assert "| routing.flip_rate (SYNTHETIC)=0.5 | gspo − grpo | 1 | – | one seed: no interval |" in text
    assert text.count(SECTION) == 1 and text.startswith(GAIN_REPORT.rstrip("\n"))
    assert annotate(report, "cmd").read_text() == text, "run again, the section replaces itself"


def test_enough_seeds_can_separate():
    assert smallest_unpaired_p(3, 3) == pytest.approx(0.1) and smallest_unpaired_p(5, 5) < 0.05
