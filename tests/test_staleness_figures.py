"""analysis/staleness_figures.py: Figures 10 and 11 of runs that vary `rollout.lag`, drawn from synthetic runs whose
every number is set by hand (tests/synthetic_runs.py writes them as the training loop does).

The figures' own drawing functions (`inspect.unwrap` of the decorated ones) return the matplotlib Figure, whose lines
and interval segments the tests read back.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import numpy as np
from matplotlib.collections import LineCollection
from matplotlib.colors import to_hex

sys.path.insert(0, str(Path(__file__).parent))

import synthetic_runs as syn  # noqa: E402

from algos.corrections import tis  # noqa: E402
from algos.corrections.base import token_frac  # noqa: E402
from algos.minirl import TRUNCATED as MINIRL_TRUNCATED  # noqa: E402
from analysis import statistics  # noqa: E402
from analysis.load import load_runs  # noqa: E402
from analysis.plotting import FigureOutput, FigureSettings, arm_styles  # noqa: E402
from analysis.staleness_figures import fig_gain_by_lag, fig_staleness_curves  # noqa: E402
from experiments.step.metrics import ENGINE_EXPERTS, EVAL_GREEDY, LAG, MISMATCH_K3, REWARD, STEP, started  # noqa: E402

STEPS = 6
START_A, START_B, START_C = "a" * 64, "b" * 64, "c" * 64
ARMS = {"grpo": ("grpo", "none"), "grpo + tis": ("grpo", "tis"), "minirl": ("minirl", "none")}  # (algo, correction)
TRUNCATION = {"grpo + tis": token_frac(tis.TRUNCATED), "minirl": MINIRL_TRUNCATED}  # what each arm's weight logs


def lagged_run(
    folder: Path,
    arm: str,
    lag: int,
    seed: int,
    gain: float,
    start: str = START_A,
    engine: bool = True,
    finished: bool = True,
) -> Path:
    """A run of `arm` at `rollout.lag` = `lag` whose held-out greedy accuracy goes from 0.5 at its start to 0.5 +
    `gain` at its last step (its only evaluations: its mean gain over the run is `gain` / 2); the lag it served,
    the mismatch (and with `engine`, the engine's routes) grow with it, and its arm's truncated share where it has
    one."""
    algo, correction = ARMS[arm]
    records = []
    for step in range(1, STEPS + 1):
        served = min(lag, step - 1)  # the first steps sample with the start
        record = {STEP: step, REWARD: 0.1 * step + 0.01 * seed, LAG: served, MISMATCH_K3: 0.01 * served}
        if engine:
            record[ENGINE_EXPERTS] = 0.02 * served
        if arm in TRUNCATION:
            record[TRUNCATION[arm]] = 0.05 * served
        records.append(record)
    records[0][started(EVAL_GREEDY)] = 0.5
    records[-1][EVAL_GREEDY] = 0.5 + gain
    cfg = {
        "algo": {"name": algo},
        "routing": {"replay": "none"},
        "correction": {"name": correction},
        "rollout": {"lag": lag},
        "model": {"name": "tiny_moe"},
        "dataset": {"name": "addition"},
        "seed": seed,
        "trainer": {"steps": STEPS, "eval_every": 0},
    }
    return syn.write_run(folder, cfg, records, finished=finished, start=start)


def drawn(draw, runset, settings: FigureSettings):
    """The Figure a decorated figure function draws (its own function, without the record and the files)."""
    return inspect.unwrap(draw)(runset, settings, FigureOutput("", "", "", ""))


def line_colors(ax) -> set[str]:
    """The colours of the curves drawn on `ax` (lines holding at least one finite point)."""
    return {
        to_hex(line.get_color())
        for line in ax.get_lines()
        if np.isfinite(np.asarray(line.get_ydata(), dtype=float)).any()
    }


def test_fig10_draws_a_column_per_lag_a_row_per_logged_metric_and_an_arm_in_one_colour_everywhere(tmp_path):
    """Three arms at lags 4, 0 and 1 (MiniRL not at 0), seeds 0 and 1; no run logs the engine's routes, so their row
    is left out and named; the truncated share comes from TIS's metric for one arm and MiniRL's for another."""
    for lag in (4, 0, 1):
        for arm in ARMS:
            if arm == "minirl" and lag == 0:
                continue
            for seed in (0, 1):
                lagged_run(tmp_path / "runs" / f"{arm}_{lag}_{seed}", arm, lag, seed, 0.02, engine=False)
    runset = load_runs([tmp_path / "runs"])
    settings = FigureSettings(tmp_path / "fig", dpi=40)
    out = fig_staleness_curves(runset, settings)
    assert [path.name for path in out.files] == ["fig10_staleness_curves.png"]
    assert any(f"`{ENGINE_EXPERTS}`" in note and "row is left out" in note for note in out.notes)
    assert any(
        f"`{TRUNCATION['grpo + tis']}` or `{MINIRL_TRUNCATED}`: not logged by grpo." == note for note in out.notes
    )
    assert "first k steps sample with the start" in out.caption and ENGINE_EXPERTS not in out.caption

    fig = drawn(fig_staleness_curves, runset, settings)
    assert fig.axes[0].get_subplotspec().get_gridspec().get_geometry() == (4, 3), "4 logged rows × 3 lags"
    grid = np.array(fig.axes).reshape(4, 3)
    assert [ax.get_title() for ax in grid[0]] == ["k = 0", "k = 1", "k = 4"], "columns in lag order"
    styles = {arm: style.color for arm, style in arm_styles(runset).items()}
    reward, truncated = grid[0], grid[2]
    assert line_colors(reward[0]) == {styles["grpo"], styles["grpo + tis"]}, "MiniRL ran no lag 0"
    for ax in reward[1:]:
        assert line_colors(ax) == set(styles.values())
    for ax in truncated[1:]:  # each arm with a truncated weight, from whichever metric it logs
        assert line_colors(ax) == {styles["grpo + tis"], styles["minirl"]}
    assert len(set(styles.values())) == 3
    legend = fig.legends[0]
    assert [text.get_text() for text in legend.get_texts()] == list(styles)
    assert [to_hex(handle.get_color()) for handle in legend.legend_handles] == list(styles.values())
    highest = max(np.nanmax(np.asarray(line.get_ydata(), dtype=float)) for ax in truncated for line in ax.get_lines())
    assert highest > 0.1 and truncated[0].get_ylim()[1] >= highest, (
        "lag 0's column (no truncation) shares the row's scale, which holds the largest lag's values"
    )


def test_fig11_draws_the_two_level_interval_over_starts_not_the_pooled_seeds_one(tmp_path):
    """GRPO and MiniRL at lags 0 and 2 from three starts × two seeds, the starts far apart (+0.2, 0, −0.1) and the
    seeds close; a GRPO run at lag 2 that crashed with a far higher gain is not drawn."""
    offsets = {START_A: 0.2, START_B: 0.0, START_C: -0.1}
    for arm in ("grpo", "minirl"):
        for lag in (0, 2):
            for start, offset in offsets.items():
                for seed in (0, 1):
                    lagged_run(
                        tmp_path / "runs" / f"{arm}_{lag}_{start[0]}{seed}",
                        arm,
                        lag,
                        seed,
                        offset + 0.01 * seed - 0.05 * lag,
                        start=start,
                    )
    lagged_run(tmp_path / "runs" / "crashed", "grpo", 2, 9, 3.0, finished=False)
    runset = load_runs([tmp_path / "runs"])
    settings = FigureSettings(tmp_path / "fig", dpi=40)
    out = fig_gain_by_lag(runset, settings)
    assert [path.name for path in out.files] == ["fig11_gain_by_lag.png"]
    assert "two-level bootstrap across cold starts" in out.caption and "Every point: 3 starts × 2 seeds." in out.caption

    # GRPO at lag 2, each unit's mean gain over the run (half its final gain: a straight line from the start)
    by_start = [[(offset + 0.01 * seed - 0.1) / 2 for seed in (0, 1)] for offset in offsets.values()]
    draws = statistics.multi_bootstrap(
        [np.array(values) for values in by_start], statistics.RESAMPLES, np.random.default_rng(statistics.RNG_SEED)
    )
    two_level = np.percentile(draws, [2.5, 97.5])
    pooled = statistics.mean_interval([value for values in by_start for value in values])
    assert pooled.high - pooled.low < 0.8 * (two_level[1] - two_level[0]), "pooling seeds misses the starts' spread"

    ax = drawn(fig_gain_by_lag, runset, settings).axes[0]
    segments = [
        segment
        for collection in ax.collections
        if isinstance(collection, LineCollection)
        for segment in collection.get_segments()
    ]
    spans = [(segment[0][1], segment[1][1]) for segment in segments]
    assert any(np.allclose(span, two_level) for span in spans)
    assert not any(np.allclose(span, (pooled.low, pooled.high), atol=1e-3) for span in spans)
    dots = np.concatenate(
        [collection.get_offsets()[:, 1] for collection in ax.collections if not isinstance(collection, LineCollection)]
    )
    assert len(dots) == 24 and dots.max() < 1.0, "every counted run a dot, the crashed run none"


def test_fig11_from_one_start_draws_the_interval_across_its_seeds(tmp_path):
    for lag in (0, 1):
        for seed, gain in enumerate((0.1, 0.2, 0.4)):
            lagged_run(tmp_path / "runs" / f"{lag}_{seed}", "grpo", lag, seed, gain)
    runset = load_runs([tmp_path / "runs"])
    settings = FigureSettings(tmp_path / "fig", dpi=40)
    out = fig_gain_by_lag(runset, settings)
    assert "bootstrap across the seeds of one start" in out.caption and "1 start × 3 seeds" in out.caption
    across_seeds = statistics.mean_interval([0.05, 0.1, 0.2])
    ax = drawn(fig_gain_by_lag, runset, settings).axes[0]
    spans = [
        (segment[0][1], segment[1][1])
        for collection in ax.collections
        if isinstance(collection, LineCollection)
        for segment in collection.get_segments()
    ]
    assert any(np.allclose(span, (across_seeds.low, across_seeds.high)) for span in spans)


def test_runs_at_one_lag_draw_neither_figure_and_say_why(tmp_path):
    for arm in ("grpo", "minirl"):
        for seed in (0, 1):
            lagged_run(tmp_path / "runs" / f"{arm}_{seed}", arm, 2, seed, 0.1)
    runset = load_runs([tmp_path / "runs"])
    for draw in (fig_staleness_curves, fig_gain_by_lag):
        out = draw(runset, FigureSettings(tmp_path / "fig"))
        assert out.files == [] and any("share one rollout.lag" in note for note in out.notes)
    assert not (tmp_path / "fig").exists()
