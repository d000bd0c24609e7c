"""analysis/: loading runs, aggregation by hand, collapse flag, figures, W&B (fake API + parquet cache), CLI.

Run directories are synthetic (tests/synthetic_runs.py): closed-form curves, so every expected number below is
derived by hand from those formulas.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import signal
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))

import synthetic_runs as syn  # noqa: E402

from algos.objective import TOKEN_RATIO_VAR  # noqa: E402
from analysis import statistics  # noqa: E402
from analysis.arms import arm_names, sweep_axes  # noqa: E402
from analysis.configs import label_runs, schema_defaults  # noqa: E402
from analysis.curve_figures import fig_early_warning, fig_mismatch, fig_replay_grpo  # noqa: E402
from analysis.diagnostics import drift_by_depth, drift_layer_by_minibatch, early_warning, staleness_by_lag  # noqa: E402
from analysis.gains import EXCLUDED, SCORED_FAILED, accuracy_gain, left_out  # noqa: E402
from analysis.headline import skipped_updates  # noqa: E402
from analysis.load import load_runs  # noqa: E402
from analysis.plotting import FigureSettings, SeriesStyle, legend, legend_rows_in, new_figure, plot_band, series_styles  # noqa: E402
from analysis.recipe_starts import numbers_text  # noqa: E402
from analysis.records import INCOMPLETE, MINIBATCH_COLUMNS, RUN_COLUMNS, SCALAR_COLUMNS  # noqa: E402
from analysis.report import main, write_report  # noqa: E402
from analysis.routing_figures import (  # noqa: E402
    fig_decomposition,
    fig_drift_depth,
    fig_drift_layer_minibatch,
    fig_drift_layer_step,
    fig_staleness,
    heatmaps,
)
from analysis.sections import held_out_prompts, runs_section  # noqa: E402
from analysis.summaries import (  # noqa: E402
    STABILITY_COLUMNS,
    aggregate_curves,
    collapse_flag,
    curve,
    ema,
    per_run_series,
    stability_table,
)
from analysis.sweep_figure import fig_sweep_response  # noqa: E402
from analysis.verdicts import arm_comparisons  # noqa: E402
from analysis.wandb_runs import load_wandb  # noqa: E402
from experiments.step.metrics import (  # noqa: E402
    CHI2_TOKEN,
    ENGINE_EXPERTS,
    ENGINE_GATES,
    ENTROPY,
    ESS,
    EVAL_ACCURACY,
    EVAL_GREEDY,
    LAG,
    MISMATCH_K3,
    REWARD,
    TOKENS,
    started,
)

DPI = "60"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    return syn.make_sweep(tmp_path_factory.mktemp("runs") / "sweep")


@pytest.fixture(scope="module")
def runset(sweep):
    return load_runs([sweep])


@pytest.fixture(scope="module")
def report_out(sweep, tmp_path_factory):
    """One end-to-end CLI run shared by the tests that inspect its output (rendering is the slow part)."""
    out = tmp_path_factory.mktemp("report")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        main([str(sweep), "--out", str(out), "--dpi", DPI, "--last-n", "5", "--pdf"])
    assert stdout.getvalue() == f"report: {out / 'report.md'}\n"
    return out


# ---------------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------------


def test_loader_returns_expected_frames(runset):
    runs = runset.runs
    assert list(runs.columns) == RUN_COLUMNS
    assert list(runset.scalars.columns) == SCALAR_COLUMNS
    assert list(runset.minibatches.columns) == MINIBATCH_COLUMNS
    assert list(runs["run"]) == [f"sweep/{i}" for i in range(6)]
    assert list(runs["label"]) == ["grpo"] * 3 + ["gspo"] * 3
    assert runset.labels == ["grpo", "gspo"]
    assert list(runs["seed"]) == ["0", "1", "2"] * 2
    assert list(runs["incomplete"]) == [False] * 5 + [True]
    assert runs.loc[5, "status"] == INCOMPLETE
    assert list(runs["last_step"]) == [20] * 5 + [12]
    # 20 steps × 5 runs, minus the malformed line, plus the 12 steps of the crashed run.
    assert len(runset.metric(REWARD)) == 20 * 5 - 1 + 12
    eval_steps = sorted(set(runset.metric(EVAL_ACCURACY)["step"]))
    assert eval_steps == [5, 10, 15, 20]
    row = runset.scalars.query("run == 'sweep/0' and step == 7 and metric == 'reward/mean'")
    assert row["value"].item() == pytest.approx(0.14)
    mb = runset.minibatches.query(
        "run == 'sweep/3' and step == 4 and minibatch == 2 and metric == 'routing/expert_change_frac/layer_1'"
    )
    assert mb["value"].item() == pytest.approx(0.4)
    assert set(runset.minibatches["minibatch"]) == {0, 1, 2}


def test_malformed_line_is_reported_with_file_and_line_and_skipped(sweep, capsys):
    rs = load_runs([sweep])
    expected = f"{sweep / '1' / 'metrics.jsonl'}:5:"
    assert expected in capsys.readouterr().err
    assert any(p.startswith(expected) for p in rs.problems)
    steps = set(rs.metric(REWARD).query("run == 'sweep/1'")["step"])
    assert 5 not in steps and {4, 6} <= steps


def test_running_run_with_half_written_last_line_is_kept_up_to_its_last_valid_line(tmp_path, capsys):
    run = syn.curve_run(tmp_path / "live", "grpo", 0, [0.1, 0.2, 0.3], finished=False)
    with (run / "metrics.jsonl").open("a", encoding="utf-8") as handle:
        handle.write('{"train/step": 4, "reward/me')
    rs = load_runs([run])
    assert f"{run / 'metrics.jsonl'}:4:" in capsys.readouterr().err
    assert rs.runs["incomplete"].tolist() == [True]
    assert rs.runs["last_step"].tolist() == [3]
    assert rs.runs["run"].tolist() == ["live"]


def test_the_starting_evaluation_is_the_eval_curves_point_at_step_0(tmp_path):
    run = syn.curve_run(tmp_path / "run", "grpo", 0, [0.1, 0.2, 0.3])
    lines = (run / "metrics.jsonl").read_text().splitlines()
    first = json.loads(lines[0]) | {started(EVAL_GREEDY): 0.25, EVAL_GREEDY: 0.5}
    (run / "metrics.jsonl").write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    rs = load_runs([run])
    greedy = rs.metric(EVAL_GREEDY)
    assert greedy[["step", "value"]].values.tolist() == [[0, 0.25], [1, 0.5]]
    tokens = rs.metric(TOKENS)
    assert tokens[tokens["step"] == 0]["value"].tolist() == [0]
    assert rs.metric(REWARD)["step"].tolist() == [1, 2, 3], "no training reward at the start"
    assert rs.runs["last_step"].tolist() == [3]


def test_null_and_non_finite_values_are_counted_and_left_out(tmp_path, capsys):
    records = [syn.step_record("grpo", 0, t, 0.1 * t) for t in (1, 2, 3)]
    records[1][REWARD] = None  # how the training loop writes a NaN reward
    records[2][TOKEN_RATIO_VAR] = float("inf")  # json.dumps writes Infinity, which json.loads reads back
    run = syn.write_run(tmp_path / "run", syn.config("grpo", 0), records)
    rs = load_runs([run])
    assert rs.metric(REWARD)["step"].tolist() == [1, 3]
    assert rs.metric(TOKEN_RATIO_VAR)["step"].tolist() == [1, 2]
    assert "2 non-finite metric values" in capsys.readouterr().err


def test_labels_name_what_differs_and_drop_seeds_output_dirs_and_algorithm_defaults():
    def cfg(algo, seed, lr, replay="none", clip=0.2, model="tiny_moe"):
        return {
            "algo.name": algo,
            "algo.clip_low": clip,
            "routing.replay": replay,
            "seed": seed,
            "trainer.lr": lr,
            "model.name": model,
            "dataset.name": "addition",
            "hydra.run.dir": f"/out/{algo}/{seed}",
            "logger.wandb.name": f"{algo}-{seed}",
            "trainer.output_dir": f"/out/{seed}",
        }

    labels = label_runs(
        {
            "a": cfg("grpo", 0, 1e-3),
            "b": cfg("grpo", 1, 1e-3),
            "c": cfg("grpo", 0, 1e-3, replay="r2"),
            "d": cfg("grpo", 0, 1e-4),
            "e": cfg("gspo", 0, 1e-3, clip=3e-4),
        }
    )
    assert labels == {
        "a": "grpo, lr=0.001",
        "b": "grpo, lr=0.001",
        "c": "grpo + r2, lr=0.001",
        "d": "grpo, lr=0.0001",
        "e": "gspo, lr=0.001",
    }
    # `name` is ambiguous (algo.name, model.name, dataset.name), so the key keeps its section.
    labels = label_runs({"a": cfg("grpo", 0, 1e-3), "b": cfg("grpo", 0, 1e-3, model="deep_moe")})
    assert labels == {"a": "grpo, model.name=tiny_moe", "b": "grpo, model.name=deep_moe"}
    # A random-init run and a run from a checkpoint are two experiments, not two seeds of one.
    labels = label_runs(
        {
            "a": {**cfg("grpo", 0, 1e-3), "model.path": None},
            "b": {**cfg("grpo", 1, 1e-3), "model.path": "/ckpt/tiny_moe-addition"},
        }
    )
    assert labels["a"] != labels["b"] and "path=" in labels["b"]
    # The starts of one recipe are one series (its band spans them); two recipes stay two.
    start = lambda seed, path: {**cfg("grpo", seed, 1e-3), "model.path": path}  # noqa: E731
    labels = label_runs(
        {
            "a": start(0, "/ckpt/rung-balanced"),
            "b": start(0, "/ckpt/rung-balanced-start1"),
            "c": start(1, "/ckpt/rung-balanced-start7/"),
            "d": start(0, "/ckpt/rung-tied-start1"),
        }
    )
    assert labels["a"] == labels["b"] == labels["c"] == "grpo, path=rung-balanced"
    assert labels["d"] == "grpo, path=rung-tied"
    labels = label_runs({"a": start(0, "/ckpt/rung"), "b": start(0, "/ckpt/rung-start1")})
    assert labels == {"a": "grpo", "b": "grpo"}
    # A routing variant is part of the arm; a run from before variants existed ran without one.
    soft = {**cfg("grpo", 0, 1e-3, replay="r2"), "routing_variant.name": "soft_replay", "routing_variant.top_margin": 2}
    labels = label_runs(
        {
            "a": cfg("grpo", 0, 1e-3, replay="r2"),
            "b": soft,
            "c": {**cfg("grpo", 1, 1e-3, replay="r2"), "routing_variant.name": "none"},
        }
    )
    assert labels == {"a": "grpo + r2", "b": "grpo + r2 + soft_replay", "c": "grpo + r2"}
    # So are router switches, and the one parameter that differs between arms that share them.
    lagged = {
        **cfg("grpo", 0, 1e-3, replay="r2"),
        "routers.lagged_replay.name": "lagged_replay",
        "routers.lagged_replay.lag": 1,
    }
    labels = label_runs(
        {"a": cfg("grpo", 0, 1e-3, replay="r2"), "b": lagged, "c": {**lagged, "routers.lagged_replay.lag": 2}}
    )
    assert labels == {
        "a": "grpo + r2, lag=—",
        "b": "grpo + r2 + lagged_replay, lag=1",
        "c": "grpo + r2 + lagged_replay, lag=2",
    }
    # Synthetic flips are named as such in every series they touch, whether or not the rate is what differs.
    labels = label_runs(
        {
            "a": cfg("grpo", 0, 1e-3),
            "b": {**cfg("grpo", 0, 1e-3), "routing.flip_rate": 0.2},
            "c": {**cfg("grpo", 0, 1e-3, replay="r2"), "routing.flip_rate": 0.2},
        }
    )
    assert labels == {"a": "grpo", "b": "grpo + SYNTHETIC flips p=0.2", "c": "grpo + r2 + SYNTHETIC flips p=0.2"}


def test_empty_directory_is_a_one_line_error_with_exit_code_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no runs found"):
        load_runs([tmp_path / "empty"])
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "empty"), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no runs found under") and err.count("\n") == 1
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "missing"), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"error: no such directory: {tmp_path / 'missing'}\n"


# ---------------------------------------------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------------------------------------------


def test_ema_by_hand():
    assert ema(np.array([0.0, 1.0, 1.0]), 0.5) == pytest.approx([0.0, 0.5, 0.75])
    assert ema(np.array([3.0, 1.0]), 1.0) == pytest.approx([3.0, 1.0])
    with pytest.raises(ValueError, match="alpha"):
        ema(np.array([1.0]), 0.0)


def test_curve_means_and_bands_by_hand(runset):
    table = curve(runset, REWARD, x="step", alpha=None).set_index(["label", "x"])
    # grpo at step 10: 0.2, 0.3, 0.4 → mean 0.3, sample std 0.1.
    assert table.loc[("grpo", 10.0), ["mean", "std", "n"]].tolist() == pytest.approx([0.3, 0.1, 3])
    # grpo at step 5: seed 1's line is malformed → seeds 0 and 2: 0.1, 0.3.
    assert table.loc[("grpo", 5.0), ["mean", "std", "n"]].tolist() == pytest.approx([0.2, math.sqrt(0.02), 2])
    # gspo at step 15: the crashed seed 2 ended at step 12 → 0.45, 0.55.
    assert table.loc[("gspo", 15.0), ["mean", "std", "n"]].tolist() == pytest.approx([0.5, math.sqrt(0.005), 2])
    # Smoothing happens per seed: grpo seed 0 is 0.02·t, EMA(0.5) at t = 2 is 0.5·0.02 + 0.5·0.04.
    smoothed = per_run_series(runset, REWARD, alpha=0.5).query("run == 'sweep/0'")
    assert smoothed["y"].iloc[1] == pytest.approx(0.03)


def test_token_axis_interpolates_each_seed_inside_its_own_range(runset):
    series = per_run_series(runset, REWARD, x="tokens")
    table = aggregate_curves(series, grid=np.array([250.0, 1000.0, 2000.0])).set_index(["label", "x"])
    # 100 tokens per step: 250 tokens is step 2.5, where grpo seed s has 0.05 + 0.1·s.
    assert table.loc[("grpo", 250.0), ["mean", "std", "n"]].tolist() == pytest.approx([0.15, 0.1, 3])
    assert table.loc[("grpo", 1000.0), "mean"] == pytest.approx(0.3)
    # The crashed gspo seed stopped at 1200 tokens and is not extrapolated to 2000.
    assert table.loc[("gspo", 2000.0), ["mean", "n"]].tolist() == pytest.approx([0.65, 2])


def test_stability_table_by_hand(runset):
    table = stability_table(runset, last_n=5).set_index("label")
    grpo, gspo = table.loc["grpo"], table.loc["gspo"]
    # grpo: last 5 steps (16..20) average 0.02·18 + 0.1·s → 0.36, 0.46, 0.56.
    assert grpo["final_reward_mean"] == pytest.approx(0.46)
    assert grpo["final_reward_std"] == pytest.approx(0.1)
    # gspo: seeds 0, 1 → 0.54, 0.64; the crashed seed's last 5 steps (8..12) → 0.03·10 + 0.2 = 0.5.
    assert gspo["final_reward_mean"] == pytest.approx(0.56)
    assert gspo["final_reward_std"] == pytest.approx(math.sqrt(0.0104 / 2))
    assert (gspo["seeds"], gspo["incomplete_runs"], gspo["last_step"]) == (3, 1, 20)
    assert (grpo["clip_frac_mean"], gspo["clip_frac_mean"]) == pytest.approx((0.001, 0.15))
    # After one update: mean over layers of 0.05·(l+1) = 0.075; over minibatches 0..2 of 0.05·(l+1)·j²: 0.075·5/3.
    assert gspo["expert_change_per_update_mean"] == pytest.approx(0.075)
    assert gspo["expert_change_over_minibatches_mean"] == pytest.approx(0.125)
    assert (gspo["ratio_token_var_mean"], gspo["ratio_seq_var_mean"]) == pytest.approx((1e-3, 1e-5))
    assert gspo["skipped_steps"] == 3 and grpo["skipped_steps"] == 0
    assert gspo["step_s_mean"] == pytest.approx(2.0)
    assert not grpo["collapse"] and (gspo["collapsed_seeds"], gspo["collapse_evaluated_seeds"]) == (0, 3)


def test_drift_tables_by_hand(runset):
    by_minibatch = drift_layer_by_minibatch(runset)
    assert by_minibatch["grpo"].loc[1, 2] == pytest.approx(0.4)
    assert by_minibatch["gspo"].loc[0, 0] == pytest.approx(0.0)
    depth, basis = drift_by_depth(runset)
    assert "minibatch index 1" in basis
    # After one update the drift is 0.05·(l+1): 0.05 and 0.1, identical across seeds.
    grpo = depth[depth["label"] == "grpo"]
    assert grpo["mean"].tolist() == pytest.approx([0.05, 0.1])
    assert grpo["std"].tolist() == pytest.approx([0.0, 0.0])


# ---------------------------------------------------------------------------------------------------------------
# Collapse flag
# ---------------------------------------------------------------------------------------------------------------

RISE = list(np.linspace(0.0, 0.8, 30))


@pytest.mark.parametrize(
    "values, expected",
    [
        (RISE + [0.1] * 15, True),  # planted collapse: falls 0.7 and stays down
        (list(np.linspace(0.0, 0.8, 45)), False),  # healthy rise
        (RISE + [0.1] * 10 + [0.8] * 12, False),  # falls, then recovers before the end
        (RISE + [0.7] * 15, False),  # settles 0.1 below the best: less than the 0.2 drop
        ([0.5] * 40, False),  # flat
        ([0.8, 0.1, 0.1, 0.1, 0.1], None),  # five steps: too short to judge
    ],
)
def test_collapse_flag(values, expected):
    assert collapse_flag(np.array(values)) is expected


def test_collapse_flag_in_the_stability_table(tmp_path):
    syn.curve_run(tmp_path / "bad", "gspo", 0, RISE + [0.1] * 15)
    syn.curve_run(tmp_path / "good", "grpo", 0, list(np.linspace(0.0, 0.8, 45)))
    table = stability_table(load_runs([tmp_path])).set_index("label")
    assert table.loc["gspo", "collapse"] and table.loc["gspo", "collapsed_seeds"] == 1
    assert not table.loc["grpo", "collapse"]
    assert table.loc["gspo", "final_reward_mean"] == pytest.approx(0.1)
    assert math.isnan(table.loc["gspo", "final_reward_std"])  # one seed: no spread to report


# ---------------------------------------------------------------------------------------------------------------
# Figures and the report
# ---------------------------------------------------------------------------------------------------------------

EXPECTED_FIGURES = [
    "fig1_reward_vs_compute",
    "fig2_clip_fraction",
    "fig4a_drift_layer_minibatch",
    "fig4b_drift_layer_step",
    "fig4c_drift_depth",
    "fig5_ratio_variance",
]


def test_every_figure_file_is_written_and_non_empty(report_out):
    for name in EXPECTED_FIGURES:
        png, pdf = report_out / f"{name}.png", report_out / f"{name}.pdf"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert pdf.read_bytes()[:5] == b"%PDF-", name
        assert png.stat().st_size > 1000 and pdf.stat().st_size > 1000


def test_report_references_each_figure_and_lists_problems(report_out, sweep):
    text = (report_out / "report.md").read_text(encoding="utf-8")
    for name in EXPECTED_FIGURES:
        assert f"]({name}.png)" in text
    # No GRPO run with Routing Replay in this sweep: Figure 3 is a note, not a failure.
    assert "Needs GRPO runs both without and with Routing Replay" in text
    assert "`sweep/5` (gspo): last step 12" in text
    assert f"{sweep / '1' / 'metrics.jsonl'}:5:" in text
    assert "| grpo | 3 | 0 | 0.460 ± 0.100 |" in text
    summary = pd.read_csv(report_out / "summary.csv")
    assert summary["label"].tolist() == ["grpo", "gspo"]
    assert list(summary.columns) == STABILITY_COLUMNS


def test_the_gains_section_says_how_many_prompts_the_runs_were_evaluated_on(tmp_path):
    """The measures' definitions name the settings, and the runs' own counts follow them (a hard-coded count said 500
    of a split of 1,000)."""
    for seed, prompts in ((0, 1000), (1, 128)):
        syn.evaluated_run(
            tmp_path / "runs" / str(seed),
            "grpo",
            seed,
            "none",
            0.5,
            0.6,
            **{"trainer.eval_prompts": prompts, "dataset.test_size": 1000},
        )
    syn.evaluated_run(tmp_path / "runs" / "gspo", "gspo", 0, "none", 0.5, 0.6)  # records neither
    runset = load_runs([tmp_path / "runs"])
    assert held_out_prompts(runset) == (
        "Prompts: each evaluation's greedy accuracy is on 128 or 1,000 test prompts (`trainer.eval_prompts`), the "
        "whole test split 1,000 (`dataset.test_size`)."
    )
    assert "not recorded" in held_out_prompts(load_runs([tmp_path / "runs" / "gspo"]))


def test_the_runs_section_names_each_recipe_s_starts_and_why_one_between_them_is_missing(tmp_path):
    """A family's starts 3 on, start 5 replaced for missing its SFT's target (the issue's bad input: the report says
    so); start 8's folder is not on this machine; start 10 reached its target yet no run starts from it; a second
    recipe's start 0 alone. Each reason is read from the skipped start's own cold_start.json."""
    starts = tmp_path / "starts"
    recipe, other = "glm4_moe_l16-x-t1000", "qwen30b_l16-y"
    records = {5: (False, 0.412), 10: (True, 0.5), 12: (None, 0.5)}
    for k, (reached, accuracy) in records.items():
        (starts / f"{recipe}-start{k}").mkdir(parents=True)
        (starts / f"{recipe}-start{k}" / "cold_start.json").write_text(
            json.dumps(
                {"target_accuracy": 0.45, "eval_greedy_accuracy": accuracy}
                | ({} if reached is None else {"reached_target": reached})
            )
        )
    paths = [starts / f"{recipe}-start{k}" for k in (3, 4, 6, 7, 9, 11, 13)] + [starts / other]
    for i, path in enumerate(paths):
        syn.evaluated_run(tmp_path / "runs" / str(i), "grpo", 0, "none", 0.5, 0.6, **{"model.path": f"{path}/"})
    (sentence,) = [line for line in runs_section(load_runs([tmp_path / "runs"])) if line.startswith("Starts by")]
    assert sentence == (
        f"Starts by recipe (docs/results/router_starts.sh's numbers): `{recipe}` starts 3, 4, 6, 7, 9, 11, 13; start 5 "
        "missed its SFT's target (41.2% held-out greedy against 45%), so the next number stands in for it; start 8 "
        f"is not on this machine (no cold_start.json in {starts / f'{recipe}-start8'}); start 10 reached its SFT's "
        "target, yet no run here starts from it; start 12's cold_start.json does not say whether it reached its "
        f"target, and no run here starts from it. `{other}` start 0."
    )
    assert numbers_text([13, 3, 4, 6, 7, 8, 9]) == "3, 4, 6-9, 13"


def test_a_report_asked_for_some_figures_draws_those_alone_and_says_why_the_rest_are_not(sweep, tmp_path, capsys):
    """`--figures` (a map's committed report keeps its response figure and a few others): the figures it names are
    drawn as without it, every other is named with why it is not drawn, and a stale PNG of a figure no longer asked
    for is removed with the report it belonged to."""
    out = tmp_path / "out"
    main([str(sweep), "--out", str(out), "--dpi", DPI, "--last-n", "5"])
    full = {path.name: path.read_bytes() for path in out.glob("*.png")}
    assert {"fig1_reward_vs_compute.png", "fig2_clip_fraction.png"} <= set(full)
    main([str(sweep), "--out", str(out), "--dpi", DPI, "--last-n", "5", "--figures", "2", "5", "2"])
    kept = {path.name: path.read_bytes() for path in out.glob("*.png")}
    assert kept == {name: full[name] for name in ("fig2_clip_fraction.png", "fig5_ratio_variance.png")}
    text = (out / "report.md").read_text(encoding="utf-8")
    figure1 = text.split("### Figure 1:")[1].split("### Figure")[0]
    assert "Not drawn." in figure1 and "asked for figures 2, 5 alone (`--figures`" in figure1
    assert "](fig2_clip_fraction.png)" in text and "](fig1_reward_vs_compute.png)" not in text
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        main([str(sweep), "--out", str(tmp_path / "other"), "--figures", "4d", "12"])
    assert refused.value.code == 2 and not (tmp_path / "other").exists()
    assert "--figures: no figure 4d, 12; the report's figures are 0, 1, 2, 3, 4a, 4b, 4c, 5, 6, 7, 8, 9, 10, 11" in (
        capsys.readouterr().err
    )


def test_replay_figure_drawn_when_grpo_ran_with_and_without_replay(tmp_path):
    syn.curve_run(tmp_path / "runs" / "plain", "grpo", 0, syn.STEPS * [0.2])
    syn.curve_run(tmp_path / "runs" / "r2", "grpo", 0, lambda t: 0.02 * t, replay="r2")
    rs = load_runs([tmp_path / "runs"])
    assert rs.labels == ["grpo", "grpo + r2"]
    out = fig_replay_grpo(rs, FigureSettings(tmp_path / "out", dpi=int(DPI), pdf=True))
    assert [f.name for f in out.files] == ["fig3_grpo_routing_replay.png", "fig3_grpo_routing_replay.pdf"]
    assert all(f.stat().st_size > 1000 for f in out.files)
    styles = series_styles(rs)
    assert styles["grpo"].color == styles["grpo + r2"].color
    assert styles["grpo"].linestyle != styles["grpo + r2"].linestyle


def test_missing_routing_metrics_leave_panels_out_with_a_note(tmp_path):
    syn.curve_run(tmp_path / "dense", "grpo", 0, lambda t: 0.02 * t, routing=False)
    rs = load_runs([tmp_path / "dense"])
    for draw in (fig_drift_layer_minibatch, fig_drift_layer_step, fig_drift_depth):
        out = draw(rs, FigureSettings(tmp_path / "out"))
        assert out.files == [] and "dense model" in out.notes[0]
    assert not (tmp_path / "out").exists()
    table = stability_table(rs)
    assert math.isnan(table.loc[0, "expert_change_per_update_mean"])


@pytest.mark.parametrize("layers", [4, 16, 48])
def test_the_drift_heat_maps_put_layer_ticks_on_whole_layers(layers):
    """At some panel heights matplotlib's own ticks fell between layers (0.0, 2.5, 5.0, ...): at none may they."""
    table = pd.DataFrame(np.full((layers, 3), 0.1), index=range(layers), columns=[0, 1, 2])
    fig = heatmaps({"grpo": table}, "updates", integer_x=True)
    ax = fig.axes[0]
    low, high = ax.get_ylim()
    for height in np.linspace(1.0, 8.0, 29):  # inches: from a crowded grid of panels to one tall panel
        fig.set_size_inches(fig.get_size_inches()[0], height)
        ticks = [t for t in ax.yaxis.get_major_locator()() if low <= t <= high]
        assert len(ticks) >= 2 and all(t == int(t) for t in ticks), (height, ticks)


# ---------------------------------------------------------------------------------------------------------------
# W&B
# ---------------------------------------------------------------------------------------------------------------


def _no_network():
    raise AssertionError("the W&B API was used although the parquet cache should have served this call")


def test_wandb_loader_with_fake_api_and_parquet_cache(tmp_path):
    api = syn.FakeApi([syn.FakeRun("grpo", 0, "finished", 6), syn.FakeRun("gspo", 0, "running", 4)])
    rs = load_wandb("ent/proj", ["sweepA"], cache_root=tmp_path, api_factory=lambda: api)
    assert api.calls == [("ent/proj", {"group": {"$in": ["sweepA"]}})]
    assert rs.runs["run"].tolist() == ["grpo0", "gspo0"]
    assert rs.labels == ["grpo", "gspo"]
    assert rs.runs["incomplete"].tolist() == [False, True]
    assert len(rs.metric(REWARD)) == 6 + 4
    assert not rs.has("_runtime")
    mb = rs.minibatches.query("run == 'gspo0' and step == 2 and minibatch == 1 and metric == 'ratio/token_var'")
    assert mb["value"].item() == pytest.approx(1e-3)

    cached = load_wandb("ent/proj", ["sweepA"], cache_root=tmp_path, api_factory=_no_network)
    for name in ("runs", "scalars", "minibatches"):
        pd.testing.assert_frame_equal(getattr(cached, name), getattr(rs, name), check_dtype=False)
    assert "cached" in cached.source

    load_wandb("ent/proj", ["sweepA"], cache_root=tmp_path, refresh=True, api_factory=lambda: api)
    assert len(api.calls) == 2
    with pytest.raises(ValueError, match="ENTITY/PROJECT"):
        load_wandb("just-a-project", cache_root=tmp_path, api_factory=_no_network)


def test_cli_wandb_on_a_dense_model_caches_and_notes_the_missing_routing_panels(tmp_path, capsys):
    api = syn.FakeApi([syn.FakeRun("grpo", 0, "finished", 6, routing=False)])
    out = tmp_path / "out"
    main(["--wandb", "ent/proj", "--group", "sweepA", "--out", str(out), "--dpi", DPI], wandb_api_factory=lambda: api)
    assert (out / ".cache" / "wandb_ent_proj_sweepA" / "scalars.parquet").is_file()
    text = (out / "report.md").read_text(encoding="utf-8")
    assert re.search(r"Source: W&B ent/proj \(groups: sweepA\)", text)
    assert "](fig1_reward_vs_compute.png)" in text and "](fig5_ratio_variance.png)" in text
    assert "> Note: No per-minibatch `routing/expert_change_frac/layer_<i>` values (dense model" in text
    assert (
        "> Note: `routing/expert_change_frac` was not logged by grpo; the experts-changed columns are empty there."
    ) in text
    assert not (out / "fig4c_drift_depth.png").exists()
    assert capsys.readouterr().out == f"report: {out / 'report.md'}\n"


def test_empty_wandb_project_is_a_one_line_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--wandb", "ent/proj", "--out", str(tmp_path)], wandb_api_factory=lambda: syn.FakeApi([]))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "error: no W&B runs with history found in ent/proj\n"


def test_a_crashed_run_and_its_rerun_count_once_and_the_report_says_so(tmp_path, capsys):
    crashed = syn.curve_run(tmp_path / "a_crashed", "grpo", 0, [0.1, 0.2], finished=False)
    rerun = syn.curve_run(tmp_path / "b_rerun", "grpo", 0, [0.1, 0.2, 0.3, 0.4])
    other_seed = syn.curve_run(tmp_path / "c_seed1", "grpo", 1, [0.2, 0.3, 0.4, 0.5])
    rs = load_runs([crashed, rerun, other_seed])
    assert len(rs.runs) == 2 and not rs.runs["run"].str.contains("a_crashed").any()
    assert set(rs.runs["seed"]) == {"0", "1"}
    assert len(rs.metric(REWARD)) == 4 + 4, "the crashed run's steps are not averaged in"
    assert any("repeats run" in problem and "finished" in problem for problem in rs.problems)
    assert "repeats run" in capsys.readouterr().err


def test_early_warning_finds_the_fall_and_the_lead_of_a_signal(tmp_path):
    runs = [
        syn.mismatch_run(tmp_path / "collapsing", 0, collapse_at=20, kl_rises_at=12),
        syn.mismatch_run(tmp_path / "healthy", 1),
    ]
    rs = load_runs(runs)
    table = early_warning(rs, alpha=1.0).set_index("run")
    collapsing = table.loc[[r for r in table.index if "collapsing" in r][0]]
    assert collapsing["collapsed"] and collapsing["collapse_step"] == 20
    assert collapsing[MISMATCH_K3 + "_moved_step"] == 12 and collapsing[MISMATCH_K3 + "_lead"] == 8
    assert math.isnan(collapsing[ENTROPY + "_moved_step"]), "a flat signal never moves"
    healthy = table.loc[[r for r in table.index if "healthy" in r][0]]
    assert not healthy["collapsed"] and math.isnan(healthy[MISMATCH_K3 + "_moved_step"])


def test_mismatch_early_warning_and_decomposition_figures_and_table(tmp_path):
    runs = [syn.mismatch_run(tmp_path / "a", 0, collapse_at=20, kl_rises_at=12), syn.mismatch_run(tmp_path / "b", 1)]
    rs = load_runs(runs)
    out = tmp_path / "out"
    for draw in (fig_mismatch, fig_early_warning, fig_decomposition):
        result = draw(rs, FigureSettings(out, pdf=True))
        assert [p.suffix for p in result.files] == [".png", ".pdf"] and result.caption, result.notes
    row = stability_table(rs).iloc[0]
    assert row["mismatch_kl_k3_mean"] > 1e-3 and row["routing_share_mean"] == pytest.approx(0.15)
    report = write_report(rs, out / "report")
    text = report.read_text(encoding="utf-8")
    assert "## Early warning" in text
    assert re.search(r"\| \d+ \| – \| \d+ \(\+\d+\) \| – \|", text), "a positive lead for k3"
    assert "`mismatch/kl_k3` in 0 of 1" in text


def test_a_series_is_dotted_where_not_all_its_seeds_have_data(tmp_path):
    short = syn.curve_run(tmp_path / "short", "grpo", 0, [0.1] * 5)
    long = syn.curve_run(tmp_path / "long", "grpo", 1, [0.3] * 10)
    rs = load_runs([short, long])
    table = curve(rs, REWARD, alpha=1.0)
    style = series_styles(rs)["grpo"]
    fig = new_figure(3, 2)
    ax = fig.subplots()
    plot_band(ax, table, style)
    solid, dotted = ax.get_lines()
    solid_y = np.asarray(solid.get_ydata(), dtype=float)
    assert np.isfinite(solid_y[:5]).all() and np.isnan(solid_y[5:]).all(), "the one-seed tail is not drawn solid"
    assert dotted.get_linestyle() == ":"


def test_regimes_table_names_each_knob_setting_and_judges_each_arm(tmp_path):
    from analysis import regimes

    search = tmp_path / "search"
    for seed in (0, 1):
        for lr, slope in ((1e-4, 0.01), (1e-3, None)):
            values = [0.5 + slope * s for s in range(1, 21)] if slope else [0.9] * 10 + [0.1] * 10
            run = syn.write_run(
                search / f"lr{lr}_s{seed}",
                syn.config("grpo", seed, lr=lr),
                [syn.step_record("grpo", seed, s, v) for s, v in enumerate(values, 1)],
            )
            lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            lines[0][started(EVAL_GREEDY)] = 0.5
            lines[-1][EVAL_GREEDY] = 0.6 if slope else 0.0
            (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    deeper = syn.config("grpo", 0, lr=1e-4)
    deeper["model"].update(name="paper_moe_l2", num_hidden_layers=2, path="/checkpoints/paper_moe_l2")
    syn.write_run(search / "l2_s0", deeper, [syn.step_record("grpo", 0, s, 0.5) for s in range(1, 21)])
    found = regimes.outcomes([search])
    assert regimes.knobs(found) == ["model.name", "trainer.lr"], (
        "seeds and output paths are not knobs, and the layers and path that come with a model name are not named twice"
    )
    table = regimes.regimes_table(found)
    healthy = next(line for line in table.splitlines() if "model.name=tiny_moe, lr=0.0001" in line)
    collapsed = next(line for line in table.splitlines() if "lr=0.001" in line)
    assert "0,1" in healthy and "0.50→0.60, 0.50→0.60" in healthy and healthy.endswith("| improves |")
    assert collapsed.endswith("| collapsed 2/2 |")
    out = tmp_path / "regimes.md"
    regimes.main([str(search), "--out", str(out)])
    assert "| search | regime |" in out.read_text()
    with pytest.raises(SystemExit) as refused:
        regimes.main([str(tmp_path / "nowhere")])
    assert refused.value.code == 2


def test_a_legend_of_long_labels_stays_inside_the_figure():
    import matplotlib

    from analysis.style import COLUMN_WIDTH_IN, RC_PARAMS

    labels = [f"grpo + r2, model.name=paper_moe_l{depth}, minibatches={n}" for depth in (2, 4) for n in (2, 4, 8)]
    styles = {label: SeriesStyle(color="C0", linestyle="-", hatch="") for label in labels}
    with matplotlib.rc_context(RC_PARAMS):
        fig = new_figure(COLUMN_WIDTH_IN, 2.1 + legend_rows_in(labels, COLUMN_WIDTH_IN))
        fig.subplots()
        legend(fig, labels, styles)
        fig.canvas.draw()
    box, drawn = fig.bbox, fig.legends[0].get_window_extent()
    assert box.x0 <= drawn.x0 and drawn.x1 <= box.x1, "the legend is cut off at the figure's sides"
    assert box.y0 <= drawn.y0, "the legend is cut off at the bottom"


def test_the_gain_is_drawn_against_the_one_setting_a_sweep_varied_within_an_arm(tmp_path):
    runs = tmp_path / "runs"
    for i, (algo, replay, flip, seed, end) in enumerate(
        [
            ("grpo", "none", 0.0, 0, 0.6),
            ("grpo", "none", 0.0, 1, 0.7),
            ("grpo", "none", 0.3, 0, 0.1),
            ("grpo", "r2", 0.0, 0, 0.6),
            ("grpo", "r2", 0.3, 0, 0.55),
            ("gspo", "none", 0.3, 0, 0.5),
        ]
    ):
        syn.evaluated_run(runs / str(i), algo, seed, replay, 0.5, end, **{"routing.flip_rate": flip})
    rs = load_runs([runs])
    # the flip rate varies within arms; the clip range (an algorithm's own setting) does not, so it is no axis
    assert sweep_axes(rs) == ["routing.flip_rate"]
    gains = accuracy_gain(rs)
    grpo = gains[gains["arm"] == "grpo"].sort_values(["routing.flip_rate", "seed"])
    assert grpo["gain"].round(6).tolist() == [0.1, 0.2, -0.4]
    assert set(gains["arm"]) == {"grpo", "grpo + r2", "gspo"}
    out = fig_sweep_response(rs, FigureSettings(tmp_path / "out", dpi=int(DPI), pdf=True))
    assert [f.name for f in out.files] == ["fig0_sweep_response.png", "fig0_sweep_response.pdf"]
    assert "SYNTHETIC" in out.caption and "Seeds: 0, 1." in out.caption
    text = write_report(rs, tmp_path / "report").read_text(encoding="utf-8")
    # final gain, mean gain over the run (a straight line from start to end: half the final gain), no whole split
    assert "| grpo | 0 | 0.500 | +0.150 ± 0.071 | +0.075 ± 0.035 | – | 2 |" in text
    assert "| grpo | 0.3 | 0.500 | -0.400 | -0.200 | – | 1 |" in text
    assert "routing.flip_rate (SYNTHETIC)" in text and "(0.3) are SYNTHETIC" in text
    # no two arms share 2 seeds in a cell: said once, not in a row per comparison
    assert "None of the 9 comparisons (each arm against grpo in each cell, on each summary" in text
    assert "not compared: 1 shared seed(s)" not in text and "no comparison and no interval here" in text


def test_the_report_compares_each_arm_with_the_baseline_over_shared_seeds_and_says_what_ten_and_three_show(tmp_path):
    rng = np.random.default_rng(0)
    for seeds in (10, 3):
        runs = tmp_path / f"runs{seeds}"
        for seed in range(seeds):
            base = 0.5 + rng.normal(0.0, 0.3)
            syn.evaluated_run(runs / f"g{seed}", "grpo", seed, "none", 0.5, base)
            syn.evaluated_run(runs / f"r{seed}", "grpo", seed, "r2", 0.5, base + rng.normal(0.2, 0.1))
            syn.evaluated_run(runs / f"s{seed}", "gspo", seed, "none", 0.5, base + rng.normal(0.0, 0.1))
        out = tmp_path / f"report{seeds}"
        text = write_report(load_runs([runs]), out).read_text(encoding="utf-8")
        comparisons = pd.read_csv(out / "comparisons.csv")
        assert len(pd.read_csv(out / "per_seed.csv")) == 3 * seeds
        final = comparisons[comparisons["measure"] == "gain"].set_index("arm")
        assert set(final.index) == {"grpo + r2", "gspo"} and set(final["baseline"]) == {"grpo"}
        assert final.loc["grpo + r2", "difference_estimate"] > 0.1
        assert bool(final.loc["grpo + r2", "separates"]) == (seeds == 10)
        assert not final.loc["gspo", "separates"]
        assert "## Each arm against grpo, paired over shared seeds" in text
        if seeds == 3:
            assert "with 3 seeds no paired test reaches p < 0.05" in text and "**separates" not in text
        else:  # the family: R2 and GSPO on the mean gain over the run, Holm over the two
            family = comparisons[comparisons["role"] == "primary"].set_index("arm")
            assert set(family["measure"]) == {"gain_area"} and len(family) == 2
            assert family.loc["grpo + r2", "holm_p"] == pytest.approx(2 * family.loc["grpo + r2", "p_value"])
            assert "**separates (95% CI of the difference excludes 0; Holm p = 0.00391 over a family of 2)**" in text
            assert "the smallest effect this could detect is" in text
            assert "secondary: separates (95% CI of the difference excludes 0; p = 0.00195, uncorrected)" in text
    with pytest.raises(SystemExit) as stop:
        main([str(tmp_path / "runs3"), "--out", str(tmp_path / "bad"), "--baseline", "ppo"])
    assert stop.value.code == 2


def test_a_flip_rate_no_run_varied_is_still_labelled_synthetic(tmp_path):
    for i, (algo, replay) in enumerate([("grpo", "none"), ("grpo", "r2")]):
        syn.evaluated_run(tmp_path / "runs" / str(i), algo, 0, replay, 0.5, 0.6, **{"routing.flip_rate": 0.2})
    text = write_report(load_runs([tmp_path / "runs"]), tmp_path / "report").read_text(encoding="utf-8")
    assert "| grpo + SYNTHETIC flips p=0.2 |" in text and "(0.2) are SYNTHETIC" in text


def test_router_noise_runs_are_labelled_synthetic_with_what_the_noise_can_show(tmp_path):
    for i, rate in enumerate([0.0, 0.1]):
        syn.evaluated_run(tmp_path / "runs" / str(i), "grpo", 0, "none", 0.5, 0.6, **{"routing.perturb_rate": rate})
    runset = load_runs([tmp_path / "runs"])
    assert set(runset.labels) == {"grpo", "grpo + SYNTHETIC router noise p=0.1"}
    text = write_report(runset, tmp_path / "report").read_text(encoding="utf-8")
    assert "routing.perturb_rate (SYNTHETIC)" in text
    assert "(0.1) are SYNTHETIC: after each optimizer update the routers' weights got Gaussian noise" in text
    assert "not what natural drift does at that dose" in text


def test_two_swept_settings_make_a_phase_diagram_and_none_makes_no_figure(tmp_path):
    for i, (lr, layers) in enumerate([(1e-4, 2), (1e-4, 4), (1e-3, 2), (1e-3, 4)]):
        for algo in ("grpo", "gspo"):
            syn.evaluated_run(
                tmp_path / "grid" / f"{algo}{i}",
                algo,
                0,
                "none",
                0.5,
                0.5 - lr * layers * 50,
                **{"trainer.lr": lr, "model.num_hidden_layers": layers},
            )
    rs = load_runs([tmp_path / "grid"])
    assert sweep_axes(rs) == ["model.num_hidden_layers", "trainer.lr"]
    out = fig_sweep_response(rs, FigureSettings(tmp_path / "out", dpi=int(DPI)))
    assert out.files and "phase diagram" in out.caption
    syn.evaluated_run(tmp_path / "flat" / "a", "grpo", 0, "none", 0.5, 0.6)
    one_arm = fig_sweep_response(load_runs([tmp_path / "flat"]), FigureSettings(tmp_path / "out2", dpi=int(DPI)))
    assert not one_arm.files and "nothing varied" in one_arm.notes[0]
    syn.evaluated_run(tmp_path / "flat" / "b", "gspo", 0, "none", 0.5, 0.6)
    arms = fig_sweep_response(load_runs([tmp_path / "flat"]), FigureSettings(tmp_path / "out3", dpi=int(DPI)))
    assert arms.files and arms.caption.startswith("Each run's mean gain over the run"), "arms alone: one panel"


def test_figures_are_png_by_default_and_pdf_only_when_asked(tmp_path):
    """A report is regenerated, not accumulated: PNG (a 256-colour palette) unless a paper asks for PDFs too."""
    syn.curve_run(tmp_path / "runs" / "plain", "grpo", 0, syn.STEPS * [0.2])
    syn.curve_run(tmp_path / "runs" / "r2", "grpo", 0, lambda t: 0.02 * t, replay="r2")
    rs = load_runs([tmp_path / "runs"])
    out = fig_replay_grpo(rs, FigureSettings(tmp_path / "out", dpi=int(DPI)))
    assert [f.name for f in out.files] == ["fig3_grpo_routing_replay.png"]
    assert not list((tmp_path / "out").glob("*.pdf"))
    from PIL import Image

    assert Image.open(out.files[0]).mode == "P"
    report = write_report(rs, tmp_path / "report")
    assert not list(report.parent.glob("*.pdf")) and "[PDF]" not in report.read_text(encoding="utf-8")


def test_the_mismatch_figure_is_left_out_when_engine_and_trainer_do_not_differ(tmp_path):
    """The quickstart samples with the trainer's own model: its mismatch k3 is the KV-cache path's ~1e-8, which a
    figure would draw as a result. It is drawn only where an engine differs (or something measured more)."""

    def run(directory, kl, rollout):
        records = []
        for t in range(1, 21):
            record = syn.step_record("grpo", 0, t, 0.02 * t)
            record[MISMATCH_K3], record[CHI2_TOKEN], record[ESS] = kl, 2 * kl, 1.0
            records.append(record)
        return syn.write_run(directory, {**syn.config("grpo", 0), "rollout": rollout}, records)

    same = load_runs([run(tmp_path / "same", 1e-8, {"engine": "hf", "precision": "fp32"})])
    out = fig_mismatch(same, FigureSettings(tmp_path / "out"))
    assert out.files == [] and "trainer's own model" in out.notes[0]
    assert "not a quantity these runs varied" in out.notes[0]
    assert f"{MISMATCH_K3}_moved_step" not in early_warning(same).columns
    bf16 = load_runs([run(tmp_path / "bf16", 1e-8, {"engine": "hf", "precision": "bf16"})])
    drawn = fig_mismatch(bf16, FigureSettings(tmp_path / "out2"))
    assert drawn.files, "an engine that differs: its mismatch is the result"


def test_a_sweep_straddling_an_added_and_a_retired_setting_is_one_series(tmp_path):
    """Parts of one sweep recorded before and after the model gained a field and the trainer lost one: the older
    run lacks the new field (it ran at the schema's default) and holds the retired one at the value that means what
    today's config does without it; neither absence splits the series. A retired setting at another value does."""
    records = [syn.step_record("grpo", 0, t, 0.1 * t) for t in (1, 2)]
    before = syn.config("grpo", 0, router_aux_loss_coef=0.0)
    after = syn.config("grpo", 1)
    after["model"]["kv_lora_rank"] = schema_defaults()["model.kv_lora_rank"]
    balanced = syn.config("grpo", 2, router_aux_loss_coef=0.05)
    for name, cfg in (("before", before), ("after", after), ("balanced", balanced)):
        syn.write_run(tmp_path / name, cfg, records)
    runs = load_runs([tmp_path]).runs.set_index("seed")
    assert runs.loc["0", "label"] == runs.loc["1", "label"] == "grpo, router_aux_loss_coef=—"
    assert runs.loc["2", "label"] == "grpo, router_aux_loss_coef=0.05"


def test_seeds_are_listed_in_numeric_order_in_every_table_and_sentence(tmp_path):
    for seed in (10, 2, 1):
        syn.evaluated_run(tmp_path / "runs" / f"g{seed}", "grpo", seed, "none", 0.5, 0.6)
    text = write_report(load_runs([tmp_path / "runs"]), tmp_path / "report").read_text(encoding="utf-8")
    assert "| grpo | 3 | 1, 2, 10 |" in text
    assert "(1, 2, 10)" in text and "10, 1" not in text


# ---------------------------------------------------------------------------------------------------------------
# What a comparison counts, from which start, by which declaration; the report put in place whole
# ---------------------------------------------------------------------------------------------------------------

START_A, START_B, START_C = "a" * 64, "b" * 64, "c" * 64


@pytest.fixture
def no_figures(monkeypatch):
    """Reports without drawing (the tables are what these tests read; drawing is most of a report's time)."""
    monkeypatch.setattr("analysis.report.all_figures", lambda *args, **kwargs: [])


def test_a_crashed_seed_is_never_paired_and_every_seed_left_out_is_named(tmp_path, no_figures):
    """Two arms, seeds 0-4: GSPO's seed 1 crashed after step 2 of 3 (its last evaluation far above GRPO's), its seed 3
    was refused (a job directory without metrics.jsonl) and it never ran seed 4. Only seeds 0 and 2 pair."""
    runs = tmp_path / "sweep"
    (runs / "multirun.yaml").parent.mkdir(parents=True)
    (runs / "multirun.yaml").write_text("hydra: {}\n")
    for seed in range(5):
        syn.evaluated_run(runs / f"grpo_s{seed}", "grpo", seed, "none", 0.5, 0.5 + 0.01 * seed, sha=START_A)
    for seed in (0, 2):
        syn.evaluated_run(runs / f"gspo_s{seed}", "gspo", seed, "none", 0.5, 0.52 + 0.01 * seed, sha=START_A)
    syn.evaluated_run(runs / "gspo_s1", "gspo", 1, "none", 0.5, 0.95, status=None, logged=2)
    refused = runs / "gspo_s3"
    (refused / ".hydra").mkdir(parents=True)
    (refused / ".hydra" / "config.yaml").write_text(yaml.safe_dump(syn.config("gspo", 3)))
    (refused / ".lock").touch()
    runset = load_runs([runs])
    assert runset.unstarted["where"].tolist() == [str(refused)] and runset.unstarted["seed"].tolist() == ["3"]
    gains = accuracy_gain(runset)
    assert gains.set_index("run").loc["sweep/gspo_s1", "counted"] == EXCLUDED
    comparisons = arm_comparisons(gains, "grpo", [])
    assert set(comparisons.query("measure != 'split_gain'")["seeds"]) == {2}, "the crashed seed is not paired"
    assert comparisons.query("measure == 'gain'")["difference_estimate"].item() == pytest.approx(0.02)
    left = left_out(runset, gains, []).set_index("seed")
    assert list(left.index) == ["1", "3", "4"] and set(left["arm"]) == {"gspo"}
    assert left.loc["1", "why"] == (
        "no summary.json after step 2 of 3 (crashed, killed or still running): stopped from outside, so it never counts"
    )
    assert left.loc["3", "why"].startswith("no metrics.jsonl: the job logged no step (refused before its first step")
    assert left.loc["4", "why"].startswith("missing: no run of this arm at this seed from this start")
    text = write_report(runset, tmp_path / "report").read_text(encoding="utf-8")
    assert "## Seeds left out of the comparisons" in text and f"`{refused}`" in text
    assert "| gspo | `aaaaaaaaaaaa` | 4 | – | missing: no run of this arm at this seed from this start" in text
    assert "`sweep/gspo_s1` (gspo): last step 2, no summary.json after step 2 of 3" in text
    assert pd.read_csv(tmp_path / "report" / "left_out.csv", dtype=str)["seed"].tolist() == ["1", "3", "4"]


def test_a_run_that_ended_itself_counts_as_the_declared_rule_says(tmp_path, no_figures):
    """GSPO's seed 2 diverged after step 2 of 3 (at 0.6 there). Excluded by default; scored as failed when the
    experiment declares it: held-out accuracy 0 at the evaluation it did not reach (step 3)."""

    def sweep(rule):
        runs = tmp_path / f"runs_{rule}"
        for seed in range(3):
            syn.evaluated_run(
                runs / f"g{seed}", "grpo", seed, "none", 0.5, 0.7, sha=START_A, comparison={"early_stopped": rule}
            )
        for seed in range(2):
            syn.evaluated_run(
                runs / f"s{seed}", "gspo", seed, "none", 0.5, 0.8, sha=START_A, comparison={"early_stopped": rule}
            )
        syn.evaluated_run(
            runs / "s2",
            "gspo",
            2,
            "none",
            0.5,
            0.6,
            sha=START_A,
            status="diverged",
            logged=2,
            comparison={"early_stopped": rule},
        )
        return runs

    excluded = load_runs([sweep("exclude")])
    assert accuracy_gain(excluded).set_index("run").loc["runs_exclude/s2", "counted"] == EXCLUDED
    assert left_out(excluded, accuracy_gain(excluded), [])["why"].item() == (
        "diverged at step 2 of 3 (ended itself): excluded by the declared rule (comparison.early_stopped=exclude)"
    )
    out = tmp_path / "failed"
    text = write_report(load_runs([sweep("failed")]), out).read_text(encoding="utf-8")
    scored = pd.read_csv(out / "per_seed.csv").set_index("run").loc["runs_failed/s2"]
    assert scored["counted"] == SCORED_FAILED and (scored["end"], scored["gain"]) == pytest.approx((0.0, -0.5))
    # the curve 0.5 (step 0), 0.6 (step 2), 0 (step 3, not reached): area (2·1.1/2 + 1·0.6/2) / 3 − 0.5
    assert scored["gain_area"] == pytest.approx((1.1 + 0.3) / 3 - 0.5)
    assert set(pd.read_csv(out / "comparisons.csv").query("measure != 'split_gain'")["seeds"]) == {3}
    assert "scored as failed: held-out accuracy 0 at every evaluation it did not reach" in text
    assert "Declared by the runs" in text


def test_runs_are_paired_by_their_start_and_several_starts_get_the_two_level_statistics(tmp_path, no_figures):
    """Seeds 0 and 1 from each of three cold starts; GSPO − GRPO is +0.1 from two starts and −0.05 from the third."""
    runs = tmp_path / "runs"
    for start, effect in ((START_A, 0.1), (START_B, 0.1), (START_C, -0.05)):
        for seed in (0, 1):
            syn.evaluated_run(runs / f"g_{start[0]}{seed}", "grpo", seed, "none", 0.5, 0.6 + 0.01 * seed, sha=start)
            syn.evaluated_run(
                runs / f"s_{start[0]}{seed}", "gspo", seed, "none", 0.5, 0.6 + 0.01 * seed + effect, sha=start
            )
    runset = load_runs([runs])
    assert len(runset.runs) == 12, "runs of one config and seed from other starts are not repeats"
    out = tmp_path / "report"
    text = write_report(runset, out).read_text(encoding="utf-8")
    per_seed = pd.read_csv(out / "per_seed.csv", dtype={"start_sha256": str})
    assert set(per_seed["start_sha256"]) == {START_A, START_B, START_C}
    gain = pd.read_csv(out / "comparisons.csv").query("measure == 'gain'").iloc[0]
    assert gain["seeds"] == 6 and gain["starts"] == 3
    assert gain["starts_difference_estimate"] == pytest.approx(0.05) and not gain["starts_agree"]
    assert gain["per_start"] == "aaaaaaaaaaaa: +0.100 (2); bbbbbbbbbbbb: +0.100 (2); cccccccccccc: -0.050 (2)"
    assert gain["starts_p_value"] == pytest.approx(statistics.sign_flip_p([0.1, 0.1, -0.05]))
    assert "across starts, mean [two-level 95% CI]" in text and "signs differ" in text
    assert "with 3 starts no start-level test reaches p < 0.05: at least 6 are needed" in text
    assert "Cold starts (the sha256 of the weights each run started from" in text
    assert "A series pools the starts of one recipe" in text
    one = write_report(load_runs([runs / "g_a0", runs / "g_a1", runs / "s_a0", runs / "s_a1"]), tmp_path / "one")
    one_text = one.read_text(encoding="utf-8")
    assert "One start (sha256 `aaaaaaaaaaaa`): within-start statistics only" in one_text
    assert "pools the starts" not in one_text
    assert "two-level" not in one_text.split("## Each arm against")[1].split("\n\n")[2]  # no two-level columns


def test_a_declaration_that_does_not_fit_the_runs_is_refused_in_one_line_before_any_figure(tmp_path, capsys):
    def runs(name, **comparison_of):
        folder = tmp_path / name
        for i, (algo, replay) in enumerate([("grpo", "none"), ("grpo", "r2")]):
            for seed in (0, 1):
                syn.evaluated_run(
                    folder / f"{i}{seed}",
                    algo,
                    seed,
                    replay,
                    0.5,
                    0.6,
                    sha=START_A,
                    comparison=comparison_of.get(f"{algo}{replay}", {"family": ["gspo"]}),
                )
        return folder

    def refused(folder, *flags):
        out = tmp_path / f"out_{folder.name}"
        with pytest.raises(SystemExit) as stop:
            main([str(folder), "--out", str(out), "--dpi", DPI, *flags])
        assert stop.value.code == 2 and not list(out.glob("*.png")) if out.exists() else True
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        return err

    assert refused(runs("family")) == (
        "error: comparison.family names 'gspo', an arm these runs did not run; their arms: grpo, grpo + r2\n"
    )
    err = refused(runs("primary", grpor2={"primary": "reward"}, grponone={"primary": "reward"}))
    assert "comparison.primary 'reward' is not a summary the analysis computes; the summaries: gain, gain_area" in err
    err = refused(runs("differ", grpor2={"primary": "gain"}, grponone={"primary": "split_gain"}))
    assert "the runs of this report declare different comparisons" in err and "--primary sets it" in err
    err = refused(runs("baseline", grpor2={"baseline": "gspo"}, grponone={"baseline": "gspo"}))
    assert "comparison.baseline 'gspo' is not an arm of these runs" in err
    assert "--family" in refused(runs("flag"), "--family", "ppo")


def _contrast(folder, references=(), flips=(0.10, 0.12, 0.14), noise=(-0.02, -0.04, -0.06)):
    """The quickstart's shape: GRPO and GRPO + R2 on seeds 0-2 from one start in two cells, SYNTHETIC flips alone
    (p = 0.2) and SYNTHETIC router noise alone (p = 0.1). R2's final gain over GRPO's is `flips` per seed in the first
    cell and `noise` in the second (its mean gain over the run, a straight line from the start: half of it)."""
    comparison = {"baseline": "grpo", "family": ["grpo + r2"], "references": [str(path) for path in references]}
    for cell, (flip, perturb, effects) in enumerate([(0.2, 0.0, flips), (0.0, 0.1, noise)]):
        for seed, effect in enumerate(effects):
            grpo = 0.5 + 0.01 * seed - 0.2 * cell
            for replay, end in (("none", grpo), ("r2", grpo + effect)):
                syn.evaluated_run(
                    folder / f"{cell}_{replay}_{seed}",
                    "grpo",
                    seed,
                    replay,
                    0.5,
                    end,
                    sha=START_A,
                    comparison=comparison,
                    **{"routing.flip_rate": flip, "routing.perturb_rate": perturb},
                )
    return folder


def test_the_first_screen_says_what_ran_the_verdicts_and_once_what_three_seeds_cannot_show(tmp_path, monkeypatch):
    runset = load_runs([_contrast(tmp_path / "runs")])
    monkeypatch.setattr(
        "analysis.report.all_figures",
        lambda runset, settings: [fig_sweep_response(runset, replace(settings, dpi=int(DPI)))],
    )
    text = write_report(runset, tmp_path / "report").read_text(encoding="utf-8")
    first = text.split("## Held-out accuracy gained")[0]
    assert len(first.splitlines()) < 30, "the first screen holds the summary, the long tables come after it"
    assert (
        "**Ran**: 12 runs (all finished) of 2 arms (grpo, grpo + r2) in 2 cells (SYNTHETIC router noise p=0.1; "
        "SYNTHETIC flips p=0.2), seeds 0, 1, 2; cold start (the weights' sha256) `aaaaaaaaaaaa` (12 runs)." in first
    )
    assert "**Updates skipped** for a non-finite loss or gradient: none, in any arm." in first
    assert "![Held-out accuracy gained, against what the sweep varied](fig0_sweep_response.png)" in first
    assert "Figure 0: Per cell of the sweep (a panel), each run's mean gain over the run" in first
    assert (
        "**The declared comparisons**: grpo + r2 against grpo on `gain_area` (mean gain over the run), Holm's "
        "correction over 2:" in first
    )
    assert (
        "- SYNTHETIC flips p=0.2: grpo +0.005, grpo + r2 +0.065; grpo + r2 − grpo +0.060 [+0.050, +0.070] over 3 "
        "seeds: **not distinguishable**\n"
    ) in first
    assert (
        "- SYNTHETIC router noise p=0.1: grpo -0.095, grpo + r2 -0.115; grpo + r2 − grpo -0.020 [-0.030, -0.010] "
        "over 3 seeds: **not distinguishable**\n"
    ) in first
    said = "3 seeds: an exact sign-flip test on fewer than 6 cannot reach p < 0.05, so no verdict here can separate"
    assert said in first and text.count(said) == 1
    assert "- One cold start (`aaaaaaaaaaaa`)" in first and "SYNTHETIC flips and SYNTHETIC router noise" in first
    assert "Shown first, under *What ran and what it shows*." in text, "Figure 0 is not drawn twice"
    for section in (
        "## The declared comparison",
        "## Each arm against grpo",
        "## Runs",
        "## Figures",
        "## Seeds left out of the comparisons",
        "## Stability",
        "## Early warning",
    ):
        assert text.index(first) < text.index(section), section


def test_the_first_screen_counts_each_arms_skipped_updates(tmp_path):
    """The synthetic sweep's GSPO runs each skipped an update after step 10 (its crashed seed 2 too), GRPO's none:
    a count that once stood only in the stability table's CSV column."""
    runset = load_runs([syn.make_sweep(tmp_path / "sweep")])
    line = skipped_updates(runset, pd.DataFrame())
    assert line == (
        "**Updates skipped** for a non-finite loss or gradient (each run's updates, minus these, are what "
        "it trained on): gspo 3 in 3 of 3 runs; none in the other arms."
    )


def test_the_miniature_is_set_beside_the_committed_results_with_the_sign_of_each(tmp_path, no_figures):
    """R2 − GRPO here: +0.06 over the run under the flips, −0.02 under the router noise. The flips' reference ran no
    noise, the noise's no flips (their tables vary only their own dose): each cell meets one reference's row."""
    separated = "separates (95% CI of the difference excludes 0)"
    flips = syn.reference_folder(
        tmp_path / "flips",
        "routing.flip_rate",
        [
            (0.0, "gain_area", "grpo + r2", -0.001, -0.010, 0.006, "not distinguishable (the smallest effect 0.014)"),
            (0.2, "gain_area", "grpo + r2", 0.133, 0.110, 0.157, separated),
            (0.2, "gain", "grpo + r2", 0.109, 0.080, 0.140, separated),
            (0.2, "gain_area", "gspo", 0.052, 0.039, 0.065, separated),
        ],
    )
    noise = syn.reference_folder(
        tmp_path / "noise",
        "routing.perturb_rate",
        [
            (0.0, "gain_area", "grpo + r2", 0.007, -0.002, 0.018, "not distinguishable"),
            (0.1, "gain_area", "grpo + r2", 0.011, -0.005, 0.026, "not distinguishable (the smallest effect 0.026)"),
        ],
    )
    elsewhere = syn.reference_folder(
        tmp_path / "elsewhere", "routing.flip_rate", [(0.5, "gain_area", "grpo + r2", 0.2, 0.1, 0.3, separated)]
    )
    runs = _contrast(tmp_path / "runs", references=(flips, noise, elsewhere))
    text = write_report(load_runs([runs]), tmp_path / "report").read_text(encoding="utf-8")
    first = text.split("## Held-out accuracy gained")[0]
    assert (
        f"grpo + r2 − grpo +0.060 [+0.050, +0.070] over 3 seeds: **not distinguishable**; `{flips}` +0.133 "
        "[+0.110, +0.157] over 10 seeds, separates: **same sign**\n"
    ) in first
    assert (
        f"grpo + r2 − grpo -0.020 [-0.030, -0.010] over 3 seeds: **not distinguishable**; `{noise}` +0.011 "
        "[-0.005, +0.026] over 10 seeds, not distinguishable: **opposite sign** (its interval holds 0)\n"
    ) in first
    assert (
        f"- `{elsewhere}`: no matching row (its table holds grpo + r2 against grpo at routing.flip_rate = 0.5; "
        "a setting its table does not vary is taken at the schema's default there)"
    ) in first
    table = text.split("## Beside the committed results")[1].split("\n\n")[1]
    assert len(table.splitlines()) == 2 + 3, "gain_area in both cells and the final gain under the flips; no more"
    assert (
        f"| 0.2 | 0 | grpo + r2 | gain | +0.120 [+0.100, +0.140] (3) | `{flips}` | +0.109 [+0.080, +0.140] (10) "
        f"| {separated} | **same sign** |" in table
    )
    assert "- **references** (the committed results these runs are a miniature of):" in text


def test_a_report_written_inside_its_sweep_is_not_one_of_the_sweeps_jobs(tmp_path, no_figures):
    """`make run` writes the quickstart's report into its sweep's folder: that folder is no job refused before its
    first step, neither when the report first makes it nor when a second report finds the first one there."""
    sweep = _contrast(tmp_path / "sweep")
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    for _ in range(2):
        main([str(sweep), "--out", str(sweep / "report")])
        assert pd.read_csv(sweep / "report" / "left_out.csv").empty
    assert "left out" not in (sweep / "report" / "report.md").read_text(encoding="utf-8").split("## Held-out")[0]


def test_a_reference_that_is_not_a_reports_folder_is_refused_in_one_line_before_any_figure(tmp_path, capsys):
    def refused(name, references, *flags):
        runs = _contrast(tmp_path / f"runs_{name}", references=references)
        out = tmp_path / f"out_{name}"
        with pytest.raises(SystemExit) as stop:
            main([str(runs), "--out", str(out), "--dpi", DPI, *flags])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.count("\n") == 1 and not out.exists(), err
        return err

    missing = tmp_path / "docs" / "results" / "nowhere"
    assert refused("missing", [missing]) == (
        f"error: comparison.references names '{missing}', which is not a folder ({missing}); a reference is the "
        "folder of a report that compared arms, holding its comparisons.csv\n"
    )
    (tmp_path / "empty").mkdir()
    assert f"names '{tmp_path / 'empty'}', which holds no comparisons.csv" in refused("empty", [tmp_path / "empty"])
    thin = tmp_path / "thin"
    thin.mkdir()
    pd.DataFrame({"measure": ["gain"], "arm": ["gspo"], "baseline": ["grpo"]}).to_csv(thin / "comparisons.csv")
    assert "has no column seeds, difference_estimate, difference_low, difference_high, verdict" in refused(
        "thin", [thin]
    )
    assert refused("flag", [], "--references", str(missing)).startswith("error: --references names")


def test_a_command_line_flag_overrides_the_declaration_and_the_report_says_so(tmp_path, no_figures):
    folder = tmp_path / "runs"
    for i, (algo, replay) in enumerate([("grpo", "none"), ("grpo", "r2"), ("gspo", "none")]):
        for seed in (0, 1):
            syn.evaluated_run(
                folder / f"{i}{seed}",
                algo,
                seed,
                replay,
                0.5,
                0.6 + 0.1 * i,
                sha=START_A,
                comparison={"family": ["gspo"], "primary": "gain"},
            )
    main([str(folder), "--out", str(tmp_path / "out"), "--family", "grpo + r2", "gspo"])
    text = (tmp_path / "out" / "report.md").read_text(encoding="utf-8")
    assert "Declared by the runs" in text and "set on the command line: family (--family)" in text
    assert "- **family**: grpo + r2, gspo against grpo on `gain` in every cell (2 comparisons)" in text
    comparisons = pd.read_csv(tmp_path / "out" / "comparisons.csv")
    assert set(comparisons.query("role == 'primary'")["arm"]) == {"grpo + r2", "gspo"}
    assert set(comparisons.query("role == 'primary'")["measure"]) == {"gain"}


def test_runs_of_one_start_and_seed_that_differ_beyond_their_arms_are_refused(tmp_path, capsys):
    """GRPO at lr 2.7e-4 and GSPO at 3e-4: the lr is no axis (it does not vary within an arm), so a report would pair
    them as if only the objective differed."""
    for seed in (0, 1):
        syn.evaluated_run(
            tmp_path / "runs" / f"g{seed}", "grpo", seed, "none", 0.5, 0.6, sha=START_A, **{"trainer.lr": 2.7e-4}
        )
        syn.evaluated_run(
            tmp_path / "runs" / f"s{seed}", "gspo", seed, "none", 0.5, 0.6, sha=START_A, **{"trainer.lr": 3e-4}
        )
    with pytest.raises(SystemExit) as stop:
        main([str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1
    assert "runs of seed 0 from start aaaaaaaaaaaa disagree in trainer.lr beyond their arms: grpo has 0.00027" in err
    assert not (tmp_path / "out").exists()


def test_starts_of_two_recipes_are_never_pooled_as_starts_of_one(tmp_path, capsys):
    """Addition's start and a reasoning-gym task's start in one report: the dataset's name is no axis (it is not a
    number), so without the check the comparison across starts would pool two recipes as draws of one."""

    def runs(folder, second_dataset):
        for sha, dataset in ((START_A, "addition"), (START_B, second_dataset)):
            for seed in (0, 1):
                for algo in ("grpo", "gspo"):
                    syn.evaluated_run(
                        folder / f"{sha[0]}_{algo}{seed}",
                        algo,
                        seed,
                        "none",
                        0.5,
                        0.6 + 0.01 * seed,
                        sha=sha,
                        **{"dataset.name": dataset, "model.path": f"/starts/{sha[0]}"},
                    )
        return str(folder)

    with pytest.raises(SystemExit) as stop:
        main([runs(tmp_path / "two_recipes", "reasoning_gym"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1
    assert "runs from starts aaaaaaaaaaaa and bbbbbbbbbbbb disagree in dataset.name: addition" in err
    assert not (tmp_path / "out").exists()
    # two starts of one recipe (only model.path differs): pooled, the comparison is across starts
    main([runs(tmp_path / "one_recipe", "addition"), "--out", str(tmp_path / "out"), "--dpi", DPI])
    assert set(pd.read_csv(tmp_path / "out" / "comparisons.csv")["starts"].dropna()) == {2}


def test_starts_of_two_sft_recipes_are_never_pooled_though_their_rl_runs_agree(tmp_path, capsys):
    """Two starts whose RL runs agree in every setting but the start's path, made by cold starts of two SFT learning
    rates: their summaries say so (`start_recipe`, copied from each start's cold_start.json), and the report refuses
    in one line to pool them, naming the setting; with one recipe (only the start's own seed differs) it pools."""

    def runs(folder, second_lr):
        for sha, lr in ((START_A, 1e-3), (START_B, second_lr)):
            for seed in (0, 1):
                for algo in ("grpo", "gspo"):
                    run = syn.evaluated_run(
                        folder / f"{sha[0]}_{algo}{seed}",
                        algo,
                        seed,
                        "none",
                        0.5,
                        0.6 + 0.01 * seed,
                        sha=sha,
                        **{"model.path": f"/starts/{sha[0]}"},
                    )
                    summary = json.loads((run / "summary.json").read_text())
                    summary["start_recipe"] = {"sft.lr": lr, "sft.max_steps": 600, "model.name": "tiny_moe"}
                    (run / "summary.json").write_text(json.dumps(summary))
        return str(folder)

    with pytest.raises(SystemExit) as stop:
        main([runs(tmp_path / "two_recipes", 3e-4), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1
    assert (
        "starts aaaaaaaaaaaa and bbbbbbbbbbbb were made by two cold-start recipes (their SFT's sft.lr: 0.001 and "
        "0.0003)"
    ) in err
    assert not (tmp_path / "out").exists()
    main([runs(tmp_path / "one_recipe", 1e-3), "--out", str(tmp_path / "out"), "--dpi", DPI])
    assert set(pd.read_csv(tmp_path / "out" / "comparisons.csv")["starts"].dropna()) == {2}


def test_a_family_too_large_for_its_starts_says_it_cannot_separate_whatever_the_data(tmp_path, no_figures):
    """Six starts give a smallest start-level p of 2/64; Holm over a family of 2 doubles it past 0.05. Every start
    agrees in sign and the interval excludes 0, yet no verdict of the family can separate: the report says why."""
    for k in range(6):
        for algo, replay, end in (("grpo", "none", 0.5), ("gspo", "none", 0.7 + 0.01 * k), ("grpo", "r2", 0.6)):
            syn.evaluated_run(
                tmp_path / "runs" / f"{algo}{replay}{k}",
                algo,
                0,
                replay,
                0.5,
                end,
                sha=f"{k}" * 64,
                **{"model.path": f"/starts/{k}"},
            )
    text = write_report(load_runs([tmp_path / "runs"]), tmp_path / "out").read_text(encoding="utf-8")
    comparisons = pd.read_csv(tmp_path / "out" / "comparisons.csv").query("role == 'primary'")
    gspo = comparisons[comparisons["arm"] == "gspo"].iloc[0]
    assert gspo["starts_difference_low"] > 0 and gspo["holm_p"] == pytest.approx(0.0625)
    assert "with 6 starts and a family of 2 the smallest Holm p any comparison can reach is 0.0625" in gspo["verdict"]
    assert (
        "- 6 starts and a declared family of 2: the smallest Holm-adjusted p any comparison of the family can "
        "reach is 0.0625, so none can separate"
    ) in text


def test_arms_that_share_a_method_but_not_their_own_settings_are_two_arms():
    """MiniRL with and without its staleness mask (conf/arm/minirl_no_clip.yaml) share the method name; pooling
    them per seed would average two arms."""

    def cfg(mask, seed):
        return {"algo.name": "minirl", "algo.mask_stale": mask, "routing.replay": "none", "seed": seed}

    names = arm_names(
        {"a": cfg(True, 0), "b": cfg(False, 0), "c": cfg(True, 1), "d": {**cfg(True, 0), "algo.name": "grpo"}}
    )
    assert names == {
        "a": "minirl (mask_stale=True)",
        "b": "minirl (mask_stale=False)",
        "c": "minirl (mask_stale=True)",
        "d": "grpo",
    }


def _report_twice(tmp_path, monkeypatch, second):
    """A report in `out`, then a second one whose figures run `second(out_dir)` before they are 'drawn'."""
    runs = tmp_path / "runs"
    for seed in (0, 1):
        syn.evaluated_run(runs / f"g{seed}", "grpo", seed, "none", 0.5, 0.6, sha=START_A)
        syn.evaluated_run(runs / f"s{seed}", "gspo", seed, "none", 0.5, 0.7, sha=START_A)
    out = tmp_path / "out"

    def draw(runset, settings):
        (settings.out_dir / "fig1_reward_vs_compute.png").write_bytes(b"\x89PNG a whole figure")
        return []

    monkeypatch.setattr("analysis.report.all_figures", draw)
    if second is not None:
        main([str(runs), "--out", str(out)])
        (out / "command.sh").write_text("# not the report's\n")
    before = {path.name: path.read_bytes() for path in out.iterdir()} if out.exists() else {}

    def interrupted(runset, settings):
        (settings.out_dir / "fig1_reward_vs_compute.png").write_bytes(b"")  # half-written
        (second or (lambda directory: os.kill(os.getpid(), signal.SIGTERM)))(settings.out_dir)
        return []

    monkeypatch.setattr("analysis.report.all_figures", interrupted)
    return runs, out, before


def test_an_interrupted_report_leaves_the_previous_one_whole_and_says_so(tmp_path, monkeypatch, capsys):
    runs, out, before = _report_twice(tmp_path, monkeypatch, lambda _: os.kill(os.getpid(), signal.SIGTERM))
    with pytest.raises(SystemExit) as stop:
        main([str(runs), "--out", str(out)])
    assert stop.value.code == 128 + signal.SIGTERM
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before, "the previous report, untouched"
    assert capsys.readouterr().err == (
        f"error: interrupted by SIGTERM while the output was written; nothing was put "
        f"in place: {out} holds the previous report.md, untouched\n"
    )


def test_a_stop_while_the_report_is_put_in_place_lands_after_it_whole_and_says_so(tmp_path, monkeypatch, capsys):
    """The renames that put a finished report in place are a block a stop must not cut (`experiments.run.stops`): a
    SIGTERM that arrives among them ends the command once the new report is whole."""
    runs, out, _ = _report_twice(tmp_path, monkeypatch, lambda _: None)
    replace, sent = os.replace, []

    def replace_then_stop(source, target):
        replace(source, target)
        if not sent:  # the first file moved, the others still in the staging folder
            sent.append(os.kill(os.getpid(), signal.SIGTERM))

    monkeypatch.setattr("analysis.cli.os.replace", replace_then_stop)
    with pytest.raises(SystemExit) as stop:
        main([str(runs), "--out", str(out)])
    assert stop.value.code == 128 + signal.SIGTERM and sent
    assert (out / "fig1_reward_vs_compute.png").read_bytes() == b"" and (out / "report.md").is_file()
    assert not list(out.glob(".staging-*")), "no staging folder left"
    assert capsys.readouterr().err == (
        f"error: interrupted by SIGTERM as the finished output was put in place, which it let end: "
        f"{out / 'report.md'} is the new one, whole\n"
    )


def test_a_report_that_fails_midway_leaves_the_previous_one_and_no_staging(tmp_path, monkeypatch):
    def crash(out_dir):
        raise RuntimeError("a bug while drawing")

    runs, out, before = _report_twice(tmp_path, monkeypatch, crash)
    with pytest.raises(RuntimeError, match="a bug while drawing"):
        main([str(runs), "--out", str(out)])
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before


def test_a_first_report_interrupted_leaves_none_and_says_so(tmp_path, monkeypatch, capsys):
    runs, out, _ = _report_twice(tmp_path, monkeypatch, None)
    with pytest.raises(SystemExit):
        main([str(runs), "--out", str(out)])
    assert not out.exists(), "the folder it made is gone: no half report"
    assert capsys.readouterr().err.endswith(f"nothing was put in place: {out} holds no report.md\n")


def test_a_new_report_replaces_the_old_ones_files_and_no_others(tmp_path, no_figures):
    for seed in (0, 1):
        syn.evaluated_run(tmp_path / "two" / f"g{seed}", "grpo", seed, "none", 0.5, 0.6, sha=START_A)
        syn.evaluated_run(tmp_path / "two" / f"s{seed}", "gspo", seed, "none", 0.5, 0.7, sha=START_A)
    out = tmp_path / "out"
    write_report(load_runs([tmp_path / "two"]), out)
    (out / "fig9_from_an_older_report.png").write_bytes(b"old")
    (out / "command.sh").write_text("# kept\n")
    write_report(load_runs([tmp_path / "two" / "g0", tmp_path / "two" / "g1"]), out)  # one arm: no comparisons
    assert sorted(path.name for path in out.iterdir()) == [
        "command.sh",
        "left_out.csv",
        "per_seed.csv",
        "report.md",
        "summary.csv",
    ]


def test_every_declared_family_names_arms_its_experiments_sweep_runs():
    """The experiment files declare their families in the arms' report names ("grpo + r3 (bf16 engine)"): composed
    with each arm of their sweep, as their runs record them, every declaration of a sweep of several arms fits the arms
    analysis names (one arm's is compared elsewhere, by analysis.compare, under the names its command gives)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from analysis import declaration
    from analysis.configs import flatten_config
    from experiments.config import PROJECT_ROOT, register_configs

    register_configs()
    checked = []
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        for path in sorted((PROJECT_ROOT / "conf" / "experiment").glob("*.yaml")):
            if "comparison:" not in path.read_text(encoding="utf-8"):
                continue
            sweep = compose("train", overrides=[f"experiment={path.stem}"], return_hydra_config=True)
            arms = str(sweep.hydra.sweeper.params.get("arm", "")).split(",")
            if len(arms) < 2:
                continue
            configs = {
                arm: flatten_config(
                    OmegaConf.to_container(
                        compose("train", overrides=[f"experiment={path.stem}", f"arm={arm}"]), resolve=False
                    )
                )
                for arm in arms
            }
            found = declaration.read(configs)
            assert found.declared, path.name
            found.checked(arm_names(configs).values())  # refuses a family or baseline of no arm run
            found.read_references()  # refuses a reference that is not a committed report's folder
            checked.append(path.stem)
    assert checked == [
        "async_map",
        "deep_long_seeds",
        "deep_long_starts",
        "few_experts",
        "few_experts_starts",
        "flip_dose_seeds",
        "learning_family",
        "learning_staleness",
        "quickstart",
        "real_routers",
        "router_noise_dose",
        "staleness",
    ]


def test_a_wandb_runs_summary_names_how_it_ended_and_its_start_and_a_run_without_history_is_left_out(tmp_path):
    ended = syn.FakeRun("grpo", 0, "crashed", 4, summary={"status": "diverged", "start_sha256": START_A, "wall_s": 8.0})
    silent = syn.FakeRun("gspo", 0, "failed", 0)
    rs = load_wandb("ent/proj", [], cache_root=tmp_path, api_factory=lambda: syn.FakeApi([ended, silent]))
    assert rs.runs[["status", "start_sha256", "incomplete"]].values.tolist() == [["diverged", START_A, True]]
    assert rs.unstarted["seed"].tolist() == ["0"] and "W&B run without history" in rs.unstarted["why"].item()
    cached = load_wandb("ent/proj", [], cache_root=tmp_path, api_factory=_no_network)
    pd.testing.assert_frame_equal(cached.unstarted, rs.unstarted)


def test_the_early_warning_figure_is_drawn_only_when_a_run_collapsed(tmp_path):
    """A figure only of what the sweep showed: without a collapse there is no fall for a signal to precede."""
    calm = load_runs([syn.mismatch_run(tmp_path / "a", 0), syn.mismatch_run(tmp_path / "b", 1)])
    result = fig_early_warning(calm, FigureSettings(tmp_path / "out"))
    assert not result.files and "No run collapsed" in result.notes[0]
    fallen = load_runs([syn.mismatch_run(tmp_path / "c", 0, collapse_at=20, kl_rises_at=12)])
    assert fig_early_warning(fallen, FigureSettings(tmp_path / "out")).files


def test_drift_against_the_engine_is_drawn_per_lag_from_the_steps_at_the_full_lag(tmp_path):
    """Runs at rollout.lag 0 and 2: each step's drift against the engine is 0.01 × the lag it served (+ 0.001 × seed),
    and the first two steps of a lag-2 run serve less than 2 (they sample with the start). Per arm and lag the figure's
    table holds each run's mean over its steps at the full lag, averaged over seeds; without a second lag, no figure."""
    for lag in (0, 2):
        for seed in (0, 1):
            records = []
            for step in range(1, 6):
                served = min(lag, step - 1)
                record = syn.step_record("grpo", seed, step, 0.5)
                record.update(
                    {
                        ENGINE_EXPERTS: 0.01 * served + 0.001 * seed,
                        ENGINE_GATES: 0.005 * served,
                        MISMATCH_K3: 0.002 * served,
                    }
                )
                if lag:
                    record[LAG] = served
                records.append(record)
            cfg = syn.config("grpo", seed)
            cfg["rollout"] = {"lag": lag}
            syn.write_run(tmp_path / "runs" / f"lag{lag}_s{seed}", cfg, records)
    runset = load_runs([tmp_path / "runs"])
    table = staleness_by_lag(runset).set_index(["lag", "metric"])["mean"]
    assert table[(2, ENGINE_EXPERTS)] == pytest.approx(0.0205) and table[(0, ENGINE_EXPERTS)] == pytest.approx(0.0005)
    assert table[(2, MISMATCH_K3)] == pytest.approx(0.004) and table[(0, ENGINE_GATES)] == 0
    out = fig_staleness(runset, FigureSettings(tmp_path / "fig", dpi=int(DPI)))
    assert [path.name for path in out.files] == ["fig9_staleness.png"] and "k weight versions behind" in out.caption
    one_lag = load_runs([tmp_path / "runs" / "lag2_s0", tmp_path / "runs" / "lag2_s1"])
    assert staleness_by_lag(one_lag).empty and fig_staleness(one_lag, FigureSettings(tmp_path / "none")).files == []
