"""k* from a lag map (`python -m analysis.staleness_lag`): the async study's rule on the learning study's measure and
starts, against a synthetic map whose answer is known."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from analysis.staleness_lag import K_STAR_JSON, K_STAR_MD, main

NAIVE = "grpo (π_old = μ_old)"
STARTS = ("a" * 64, "b" * 64, "c" * 64)


def lag_map(tmp_path, split_gain, drop=()):
    """A per-seed table of the rule's two arms at lags 0, 1, 2, 4 on three starts; `split_gain(arm, lag, start)` gives
    each run's value; `drop`: (arm, lag, start) triples with no run."""
    rows = [
        {
            "run": f"{arm}_{lag}_{start}",
            "arm": arm,
            "seed": "100",
            "rollout.lag": lag,
            "start": 0.5,
            "end": 0.5,
            "gain": 0.0,
            "gain_area": 0.0,
            "split_gain": split_gain(arm, lag, start),
            "counted": "yes",
            "start_sha256": STARTS[start],
        }
        for arm in ("minirl", NAIVE)
        for lag in (0, 1, 2, 4)
        for start in range(3)
        if (arm, lag, start) not in drop
    ]
    path = tmp_path / "per_seed.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    return path


def test_k_star_is_the_smallest_lag_at_which_the_mean_fall_over_starts_reaches_the_threshold(tmp_path):
    # The naive arm falls 0.06 at lag 2 on average, but on one start only (0.18, 0, 0); MiniRL falls 0.04 at lag 1
    # and 0.08 at lag 4: k* = 2, from the mean over starts, not from any one start's fall.
    def gain(arm, lag, start):
        if arm == NAIVE:
            return 0.20 - (0.18 if (lag >= 2 and start == 0) else 0.0)
        return 0.20 - {0: 0.0, 1: 0.04, 2: 0.04, 4: 0.08}[lag]

    main([str(lag_map(tmp_path, gain)), "--out", str(tmp_path / "out")])
    picked = json.loads((tmp_path / "out" / K_STAR_JSON).read_text())
    assert picked["k_star"] == 2 and picked["fell"]
    assert picked["falls"][NAIVE] == pytest.approx({"1": 0.0, "2": 0.06, "4": 0.06})
    assert picked["falls"]["minirl"]["1"] == pytest.approx(0.04)
    assert "k* = 2" in (tmp_path / "out" / K_STAR_MD).read_text()


def test_no_fall_anywhere_picks_the_largest_lag_and_says_it_is_the_null(tmp_path):
    main([str(lag_map(tmp_path, lambda arm, lag, start: 0.2 - 0.01 * lag)), "--out", str(tmp_path / "out")])
    picked = json.loads((tmp_path / "out" / K_STAR_JSON).read_text())
    assert picked["k_star"] == 4 and not picked["fell"]
    assert "the null at the largest lag" in (tmp_path / "out" / K_STAR_MD).read_text()


def test_a_start_missing_a_run_the_rule_reads_is_refused_in_one_line_before_anything_is_written(tmp_path, capsys):
    path = lag_map(tmp_path, lambda arm, lag, start: 0.2, drop={("minirl", 2, 1)})
    with pytest.raises(SystemExit) as raised:
        main([str(path), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert raised.value.code == 2 and "\n" not in err
    assert err.startswith("error: ") and "no counted run of 'minirl' at rollout.lag 2 on start bbbbbbbbbbbb" in err
    assert not (tmp_path / "out").exists()
