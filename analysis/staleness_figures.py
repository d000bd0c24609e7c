"""The report's figures of an engine that samples k weight versions behind θ_old (`rollout.lag`), drawn where the runs
vary the lag, one function each over the shared prelude (analysis.plotting); Figure 9 (analysis/routing_figures.py)
draws the drift against that engine per lag.

10. staleness in the paper's form: a column per lag, against step: reward, held-out accuracy, the engine's routes
    against θ_old's, the behaviour weight's truncated share, the mismatch KL
11. the primary summary of held-out accuracy against the lag, per arm, with its interval across cold starts (two
    levels) or across the seeds of one start
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from matplotlib.typing import RcKeyType

from algos.corrections import tis
from algos.corrections.base import token_frac
from algos.minirl import TRUNCATED as MINIRL_TRUNCATED
from analysis.arms import arms_of, sweep_axes
from analysis.diagnostics import LAG, lags_of
from analysis.gains import EXCLUDED, GAIN_MEASURES, accuracy_gain
from analysis.plotting import (
    LAG_LABEL,
    STEP_LABEL,
    FigureOutput,
    FigureSettings,
    arm_styles,
    figure,
    legend,
    legend_rows_in,
    new_figure,
    plot_band,
    smoothing_text,
)
from analysis.records import RunSet
from analysis.statistics import Interval, mean_interval, starts_interval
from analysis.style import TEXT_WIDTH_IN
from analysis.summaries import aggregate_curves, per_run_series
from experiments.step import metrics as m

ONE_LAG = "The runs share one rollout.lag: {what} to draw per lag."


@dataclass(frozen=True)
class CurveRow:
    """A row of Figure 10: the metrics it reads (of each run, the first of them the run logged), its axis label, what
    the caption calls it, whether each run's curve is smoothed first and whether the axis starts at 0."""

    metrics: tuple[str, ...]
    ylabel: str
    what: str
    smoothed: bool = True
    from_zero: bool = True


# The behaviour weight's truncation: TIS logs the share of tokens whose weight passed C (algos/corrections/tis.py),
# MiniRL its own (algos/minirl.py); a run logs the one its objective or correction has.
TRUNCATION = (token_frac(tis.TRUNCATED), MINIRL_TRUNCATED)
ROWS = (
    CurveRow((m.REWARD,), "training reward", f"the training reward (`{m.REWARD}`, Figure 1's)", from_zero=False),
    CurveRow(
        (m.EVAL_GREEDY,),
        "held-out greedy\naccuracy",
        f"held-out greedy accuracy (`{m.EVAL_GREEDY}`, at each evaluation, unsmoothed)",
        smoothed=False,
        from_zero=False,
    ),
    CurveRow(
        (m.ENGINE_EXPERTS,),
        "engine's experts\nnot θ_old's",
        "the share of the engine's activated experts θ_old's "
        f"routers did not choose on the same tokens (`{m.ENGINE_EXPERTS}`, Figure 9's)",
    ),
    CurveRow(
        TRUNCATION,
        "weight truncated\n(share)",
        "the share of tokens whose behaviour weight was truncated at its "
        f"cap (TIS: `{TRUNCATION[0]}`; MiniRL: `{TRUNCATION[1]}`)",
    ),
    CurveRow((m.MISMATCH_K3,), "KL(μ_old ‖ π_old)\nk3", f"the k3 estimate of KL(μ_old ‖ π_old) (`{m.MISMATCH_K3}`)"),
)
# Five columns of up to seven arms each: lines thinner than the style's keep the arms apart.
THIN: dict[RcKeyType, Any] = {"lines.linewidth": 0.7}


def row_series(runset: RunSet, row: CurveRow, alpha: float) -> pd.DataFrame:
    """Each run's curve of the row against step (`[run, label, x, y]`, the label the run's arm): of the row's metrics
    the first the run logged, smoothed per run with `alpha` where the row is."""
    parts, seen = [], set[str]()
    for metric in row.metrics:
        series = per_run_series(runset, metric, alpha=alpha if row.smoothed else None)
        series = series[~series["run"].isin(seen)]
        seen |= set(series["run"])
        parts.append(series)
    series = pd.concat(parts, ignore_index=True)
    return series.assign(label=series["run"].map(arms_of(runset)))


def pooled_note(runset: RunSet) -> list[str]:
    """A note where the runs vary a setting besides the lag within an arm: the figures per lag pool over it."""
    others = [key for key in sweep_axes(runset) if key != LAG]
    return [f"The runs also vary {', '.join(others)}: each point pools over it."] if others else []


@figure("10", "fig10_staleness_curves", "Staleness in the paper's form")
def fig_staleness_curves(runset: RunSet, settings: FigureSettings, out: FigureOutput) -> Figure | None:
    """A column per lag, against step, per arm: what the reward and held-out accuracy did while the engine sampled k
    versions behind, and how far its routes and log-probs were from θ_old's (the rows no run logs left out)."""
    lags = lags_of(runset)
    columns = sorted(set(lags.values()))
    if len(columns) < 2:
        out.notes.append(ONE_LAG.format(what="no staleness"))
        return None
    styles = arm_styles(runset)
    rows = []
    for row in ROWS:
        series = row_series(runset, row, settings.alpha)
        names = " or ".join(f"`{metric}`" for metric in row.metrics)
        if series.empty:
            out.notes.append(f"No run logged {names}: its row is left out.")
            continue
        without = [arm for arm in styles if arm not in set(series["label"])]
        if without:
            out.notes.append(f"{names}: not logged by {', '.join(without)}.")
        rows.append((row, series))
    fig = new_figure(TEXT_WIDTH_IN, 1.0 * len(rows) + 0.45 + legend_rows_in(list(styles), TEXT_WIDTH_IN))
    grid = fig.subplots(len(rows), len(columns), squeeze=False, sharex=True, sharey="row")
    drawn: set[str] = set()
    for r, (row, series) in enumerate(rows):
        for c, lag in enumerate(columns):
            ax = grid[r][c]
            table = aggregate_curves(series[series["run"].map(lags) == lag])
            for arm, style in styles.items():
                part = table[table["label"] == arm]
                if len(part):
                    with matplotlib.rc_context(THIN):
                        plot_band(ax, part, style)
                    drawn.add(arm)
            ax.xaxis.set_major_locator(MaxNLocator(nbins=3, integer=True))
            if r == 0:
                ax.set_title(f"k = {lag}")
            if r == len(rows) - 1:
                ax.set_xlabel(STEP_LABEL)
        if row.from_zero:  # once the row's every column is drawn: its shared scale then covers them all
            grid[r][0].set_ylim(bottom=0)
        grid[r][0].set_ylabel(row.ylabel)
    legend(fig, [arm for arm in styles if arm in drawn], styles)
    out.notes += pooled_note(runset)
    smoothed = (
        f"each run smoothed first ({smoothing_text(settings.alpha)}) in every row but the held-out accuracy's"
        if settings.alpha < 1
        else "no curve smoothed"
    )
    out.caption = (
        "Per lag k (a column: the engine samples k weight versions behind θ_old, `rollout.lag`; a run's first k steps "
        "sample with the start, fewer versions behind) against RL step, per arm (one colour in every column and in "
        "Figures 9 and 11), top to bottom: " + "; ".join(row.what for row, _ in rows) + ". Each curve is the mean "
        "over the runs of that arm and lag (seeds and cold starts alike), the band ± 1 sample std across them (none "
        f"where one run covers a step), {smoothed}; a row shares one y scale."
    )
    return fig


TWO_LEVEL, SEEDS, NONE = "two-level", "across seeds", "none"  # the interval a point of Figure 11 has
# Each interval as the caption names it, and the points that have it.
INTERVALS = {
    TWO_LEVEL: (
        "the two-level bootstrap across cold starts (starts resampled, then seeds within each drawn start, "
        "every start weighted equally: the point is the mean of its starts' means; "
        "`statistics.starts_interval`)",
        "where a point's runs come from two or more starts",
    ),
    SEEDS: (
        "the bootstrap across the seeds of one start (`statistics.mean_interval`)",
        "where they come from one start",
    ),
    NONE: ("none", "where a point is one run"),
}


def gain_by_lag(gains: pd.DataFrame, measure: str) -> pd.DataFrame:
    """Per arm and lag (`gains`: the counted rows of `gains.accuracy_gain` with a `lag` column): the mean of `measure`
    with its 95% interval, two-level where the point's runs come from two or more cold starts (`start_sha256`),
    across seeds where from one, none for one run; `[arm, lag, estimate, low, high, interval, starts, runs, seeds]`
    (`seeds`: per start, where every start holds as many)."""
    rows = []
    for (arm, lag), part in gains.groupby(["arm", "lag"]):
        # A start's sha256 is text; pandas types a group's key as any scalar.
        by_start = {cast(str, start): group[measure].to_numpy(float) for start, group in part.groupby("start_sha256")}
        if len(by_start) >= 2:
            interval, kind = starts_interval(by_start), TWO_LEVEL
        elif len(part) >= 2:
            interval, kind = mean_interval(part[measure]), SEEDS
        else:
            value = float(part[measure].iloc[0])
            interval, kind = Interval(value, np.nan, np.nan), NONE
        sizes = {len(values) for values in by_start.values()}
        rows.append(
            {
                "arm": arm,
                "lag": lag,
                "estimate": interval.estimate,
                "low": interval.low,
                "high": interval.high,
                "interval": kind,
                "starts": len(by_start),
                "runs": len(part),
                "seeds": sizes.pop() if len(sizes) == 1 else np.nan,
            }
        )
    return pd.DataFrame(rows, columns=["arm", "lag", "estimate", "low", "high", "interval", "starts", "runs", "seeds"])


def interval_text(table: pd.DataFrame) -> str:
    """Which interval the points of `gain_by_lag`'s table have, in words: one for all, else each and where."""
    kinds = [kind for kind in INTERVALS if kind in set(table["interval"])]
    if kinds == [NONE]:
        return "No point has an interval: each is one run."
    if len(kinds) == 1:
        return f"The interval is {INTERVALS[kinds[0]][0]}."
    return "The interval is " + "; ".join(f"{INTERVALS[kind][0]} {INTERVALS[kind][1]}" for kind in kinds) + "."


class _Point(Protocol):
    """A row of `gain_by_lag`'s table, as `design_text` reads it."""

    starts: int
    runs: int
    seeds: float  # NaN where its starts hold unequal numbers of seeds


def design_text(table: pd.DataFrame) -> str:
    """How many starts × seeds the points of `gain_by_lag`'s table hold: one design for all, else each with its number
    of points."""

    def design(point: _Point) -> str:
        if np.isnan(point.seeds):  # its starts hold unequal numbers of seeds
            return f"{point.starts} starts, {point.runs} runs"
        return f"{point.starts} start{'s' * (point.starts > 1)} × {point.seeds:g} seed{'s' * (point.seeds > 1)}"

    # pandas types a row's cells as any scalar: these are the table's columns.
    designs = Counter(design(point) for point in cast(Iterable[_Point], table.itertuples()))
    if len(designs) == 1:
        return f"Every point: {next(iter(designs))}."
    return "Points: " + ", ".join(f"{text} ({count})" for text, count in designs.most_common()) + "."


@figure("11", "fig11_gain_by_lag", "Gain over the run against the lag")
def fig_gain_by_lag(runset: RunSet, settings: FigureSettings, out: FigureOutput) -> Figure | None:
    """Per arm, each run's `settings.primary` summary of held-out accuracy against the lag: the mean with its 95%
    interval (across cold starts where there are several, `gain_by_lag`), the runs as faint dots. The runs the
    comparisons count (`accuracy_gain` under `settings.early_stopped`), as Figure 0."""
    lags = lags_of(runset)
    if len(set(lags.values())) < 2:
        out.notes.append(ONE_LAG.format(what="no gain"))
        return None
    measure = settings.primary
    gains = accuracy_gain(runset, settings.early_stopped)
    gains = gains[gains["counted"] != EXCLUDED].dropna(subset=[measure])
    if gains.empty:
        out.notes.append(f"No counted run has a `{measure}` (none evaluated at its start and after it).")
        return None
    table = gain_by_lag(gains.assign(lag=gains["run"].map(lags)), measure)
    styles = arm_styles(runset)
    arms = [arm for arm in styles if arm in set(table["arm"])]
    columns = sorted(set(table["lag"]))
    offsets = dict(zip(arms, np.linspace(-0.25, 0.25, len(arms)) if len(arms) > 1 else [0.0]))
    fig = new_figure(TEXT_WIDTH_IN, 2.4 + legend_rows_in(arms, TEXT_WIDTH_IN))
    ax = fig.subplots()
    for arm in arms:
        style, points = styles[arm], table[table["arm"] == arm].sort_values("lag")
        runs = gains[gains["arm"] == arm]
        ax.scatter(
            [columns.index(lags[run]) + offsets[arm] for run in runs["run"]],
            runs[measure],
            s=5,
            color=style.color,
            alpha=0.35,
            linewidths=0,
            zorder=1,
        )
        x = [columns.index(lag) + offsets[arm] for lag in points["lag"]]
        ax.vlines(x, points["low"], points["high"], color=style.color, linewidth=0.9, zorder=2)
        ax.plot(
            x,
            points["estimate"],
            color=style.color,
            linestyle=style.linestyle,
            marker="o",
            markersize=2.5,
            linewidth=0.8,
            zorder=3,
        )
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set_xticks(range(len(columns)), [str(lag) for lag in columns])
    ax.set_xlabel(LAG_LABEL)
    name = GAIN_MEASURES[measure].split(":")[0]
    ax.set_ylabel(f"{name}\n(held-out greedy acc.)")
    legend(fig, arms, styles)
    out.notes += pooled_note(runset)
    out.caption = (
        f"Each run's {name} of held-out greedy accuracy (`{measure}`, from the run's own start) against the lag k, "
        "per arm (one colour, as in Figures 9 and 10): a faint dot per run, the mean with its 95% interval. "
        f"{interval_text(table)} {design_text(table)} A run counts as in the comparisons "
        f"(`comparison.early_stopped={settings.early_stopped}`); one stopped from outside is left out."
    )
    return fig
