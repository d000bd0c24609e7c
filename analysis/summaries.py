"""Each run's curves and numbers, and their mean across seeds: smoothing, curves on steps and tokens, the collapse test
and the stability table.

Conventions:
- curves: each seed is smoothed first (EMA, `s_1 = x_1`, `s_t = (1-α) s_{t-1} + α x_t`), then the series shows the
  mean across seeds with a band of ±1 sample standard deviation (ddof = 1; no band where one seed covers a point);
- the token axis differs between seeds, so each seed is linearly interpolated onto a common grid, inside its own
  range only (a crashed seed drops out where its data ends, it is never extrapolated);
- tables: per seed, average the last N logged steps, then mean ± std across seeds.
The table's diagnostics: the clip fraction, the importance-ratio variance, and routing drift as the share of
activated experts that changed since θ_old (the GSPO paper's §5.3 statistic).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from algos.objective import CLIP
from algos.objective import SEQ_RATIO_VAR as SEQ_VAR
from algos.objective import TOKEN_RATIO_VAR as TOKEN_VAR
from analysis.records import RunSet
from experiments.step.metrics import DRIFT, FRAGILE, MISMATCH_K3, REWARD, ROUTING_SHARE, SKIPPED, STEP_TIME, TOKENS

EMA_ALPHA = 0.3
LAST_N = 10
COLLAPSE_DROP = 0.2
COLLAPSE_TAIL_FRACTION = 0.1
COLLAPSE_MIN_TAIL = 3
TOKEN_GRID_POINTS = 100

STABILITY_COLUMNS = [
    "label",
    "algo",
    "replay",
    "seeds",
    "incomplete_runs",
    "last_step",
    "final_reward_mean",
    "final_reward_std",
    "best_reward",
    "collapsed_seeds",
    "collapse_evaluated_seeds",
    "collapse",
    "clip_frac_mean",
    "expert_change_per_update_mean",
    "expert_change_over_minibatches_mean",
    "ratio_token_var_mean",
    "ratio_seq_var_mean",
    "mismatch_kl_k3_mean",
    "fragile_frac_mean",
    "routing_share_mean",
    "skipped_steps",
    "step_s_mean",
]


def ema(values: np.ndarray, alpha: float) -> np.ndarray:
    """EMA `s_1 = x_1`, `s_t = (1-α) s_{t-1} + α x_t` over a `[T]` array in step order; α = 1 is no smoothing."""
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"EMA alpha must be in (0, 1], got {alpha}")
    out = np.empty(len(values), dtype=float)
    state = math.nan
    for i, x in enumerate(np.asarray(values, dtype=float)):
        state = x if i == 0 else (1.0 - alpha) * state + alpha * x
        out[i] = state
    return out


def per_run_series(runset: RunSet, metric: str, x: str = "step", alpha: float | None = None) -> pd.DataFrame:
    """One metric per run against `x` ("step" or "tokens"), optionally EMA-smoothed per run.

    Returns columns `[run, label, x, y]`, sorted by run then x; empty when the metric (or `train/tokens`) is absent.
    """
    if x not in ("step", "tokens"):
        raise ValueError(f"x must be 'step' or 'tokens', got {x!r}")
    rows = runset.metric(metric).sort_values(["run", "step"])
    if x == "tokens":
        tokens = runset.scalars.loc[runset.scalars["metric"] == TOKENS, ["run", "step", "value"]]
        rows = rows.merge(tokens.rename(columns={"value": "tokens"}), on=["run", "step"])
        rows = rows.assign(x=rows["tokens"])
    else:
        rows = rows.assign(x=rows["step"].astype(float))
    rows = rows.rename(columns={"value": "y"})[["run", "label", "x", "y"]].reset_index(drop=True)
    if alpha is not None and len(rows):
        rows["y"] = rows.groupby("run", sort=False)["y"].transform(lambda s: ema(s.to_numpy(), alpha))
    return rows


def aggregate_curves(series: pd.DataFrame, grid: int | np.ndarray | None = None) -> pd.DataFrame:
    """Mean and sample std across runs of each label, per x.

    `series` has columns `[run, label, x, y]`. With `grid=None` points are matched on exact x (steps are shared by
    seeds). With an int, each label gets that many evenly spaced points from its smallest first x to its largest
    last x; with an array, those points. Each run is interpolated inside its own x range only.
    Returns columns `[label, x, mean, std, n]` (`std` is NaN where `n` = 1).
    """
    columns = ["label", "x", "mean", "std", "n"]
    if series.empty:
        return pd.DataFrame(columns=columns)
    if grid is None:
        table = series.groupby(["label", "x"])["y"].agg(mean="mean", std="std", n="count").reset_index()
        return table[columns]
    parts = []
    for label, group in series.groupby("label", sort=False):
        runs = [g.sort_values("x") for _, g in group.groupby("run", sort=False)]
        if isinstance(grid, int):
            lo = min(r["x"].iloc[0] for r in runs)
            hi = max(r["x"].iloc[-1] for r in runs)
            points = np.linspace(lo, hi, grid)
        else:
            points = np.asarray(grid, dtype=float)
        stacked = np.full((len(runs), len(points)), np.nan)
        for i, run in enumerate(runs):
            xs, ys = run["x"].to_numpy(float), run["y"].to_numpy(float)
            inside = (points >= xs[0]) & (points <= xs[-1])
            stacked[i, inside] = np.interp(points[inside], xs, ys)
        n = np.sum(~np.isnan(stacked), axis=0)
        keep = n > 0
        frame = pd.DataFrame(stacked[:, keep], columns=points[keep])
        parts.append(
            pd.DataFrame(
                {
                    "label": label,
                    "x": points[keep],
                    "mean": frame.mean().to_numpy(),
                    "std": frame.std(ddof=1).to_numpy(),
                    "n": n[keep],
                }
            )
        )
    return pd.concat(parts, ignore_index=True)[columns]


def curve(runset: RunSet, metric: str, x: str = "step", alpha: float | None = EMA_ALPHA) -> pd.DataFrame:
    """Aggregated curve of one metric: exact steps on the step axis, a common grid on the token axis."""
    series = per_run_series(runset, metric, x=x, alpha=alpha)
    return aggregate_curves(series, grid=None if x == "step" else TOKEN_GRID_POINTS)


# ---------------------------------------------------------------------------------------------------------------
# Collapse and the stability table
# ---------------------------------------------------------------------------------------------------------------


def collapse_tail(n_steps: int) -> int:
    """Length K of the tail the collapse test looks at: the last 10% of logged steps, at least 3."""
    return max(COLLAPSE_MIN_TAIL, math.ceil(COLLAPSE_TAIL_FRACTION * n_steps))


def collapse_flag(reward: np.ndarray, drop: float = COLLAPSE_DROP, alpha: float = EMA_ALPHA) -> bool | None:
    """Whether one seed's training reward collapsed.

    `reward` is `[T]`, in step order. Smooth it with the EMA (α), call its maximum the best b. The run collapsed
    when the smoothed reward is below `b - drop` (an absolute drop, in reward units) at every one of the last
    K = max(3, ceil(0.1·T)) logged steps: it fell more than `drop` below its best and stayed there until the end.
    Returns None (not evaluated) when T < 2K, too short to tell a fall from a start.
    """
    values = np.asarray(reward, dtype=float)
    tail = collapse_tail(len(values))
    if len(values) < 2 * tail:
        return None
    smoothed = ema(values, alpha)
    return bool(np.all(smoothed[-tail:] < smoothed.max() - drop))


def _mean_of(frame: pd.DataFrame, metric: str) -> pd.Series:
    rows = frame[frame["metric"] == metric]
    return rows.groupby("run")["value"].mean()


def run_stats(
    runset: RunSet, last_n: int = LAST_N, drop: float = COLLAPSE_DROP, alpha: float = EMA_ALPHA
) -> pd.DataFrame:
    """Per-run numbers behind the stability table, one row per run (NaN where a metric was not logged).

    final_reward: mean raw reward over the run's last `last_n` logged steps; best_reward: maximum of the smoothed
    reward; collapsed: `collapse_flag`; means over all logged steps of clip fraction and ratio variances;
    expert_change_per_update: mean over steps of the drift after one update (the per-minibatch record with index 1,
    the GSPO paper's "experts changed per update"), expert_change_over_minibatches: mean over every minibatch
    record, whose index 0 is 0 by construction; skipped_steps: last value of the cumulative counter; step_s: mean
    `perf/step_s`, else the summary's wall time divided by the last step.
    """
    if last_n < 1:
        raise ValueError(f"last_n must be at least 1, got {last_n}")
    runs = runset.runs.set_index("run")
    stats = pd.DataFrame(index=runs.index)
    stats["label"] = runs["label"]
    stats["incomplete"] = runs["incomplete"]
    stats["last_step"] = runs["last_step"]
    reward = runset.metric(REWARD).sort_values(["run", "step"])
    final, best, collapsed = {}, {}, {}
    for run, group in reward.groupby("run"):
        values = group["value"].to_numpy(float)
        final[run] = values[-last_n:].mean()
        best[run] = ema(values, alpha).max()
        collapsed[run] = collapse_flag(values, drop=drop, alpha=alpha)
    stats["final_reward"] = pd.Series(final, dtype=float)
    stats["best_reward"] = pd.Series(best, dtype=float)
    stats["collapsed"] = pd.Series(collapsed, dtype=object).reindex(stats.index)
    scalars = runset.scalars
    stats["clip_frac"] = _mean_of(scalars, CLIP)
    drift = runset.minibatches[runset.minibatches["metric"] == DRIFT]
    stats["expert_change_per_update"] = drift[drift["minibatch"] == 1].groupby("run")["value"].mean()
    stats["expert_change_over_minibatches"] = drift.groupby("run")["value"].mean()
    stats["ratio_token_var"] = _mean_of(scalars, TOKEN_VAR)
    stats["ratio_seq_var"] = _mean_of(scalars, SEQ_VAR)
    stats["mismatch_kl_k3"] = _mean_of(scalars, MISMATCH_K3)
    stats["fragile_frac"] = _mean_of(scalars, FRAGILE)
    stats["routing_share"] = _mean_of(runset.minibatches, ROUTING_SHARE)
    skipped = scalars[scalars["metric"] == SKIPPED].sort_values("step").groupby("run")["value"].last()
    stats["skipped_steps"] = skipped
    step_s = _mean_of(scalars, STEP_TIME)
    from_summary = runs["wall_s"] / runs["last_step"].where(runs["last_step"] > 0)
    stats["step_s"] = step_s.reindex(stats.index).fillna(from_summary)
    return stats.rename_axis("run").reset_index()


def stability_table(
    runset: RunSet, last_n: int = LAST_N, drop: float = COLLAPSE_DROP, alpha: float = EMA_ALPHA
) -> pd.DataFrame:
    """One row per series (label), in display order; columns `STABILITY_COLUMNS`.

    final_reward_mean/std: mean and sample std across seeds of each seed's last-`last_n`-step mean reward;
    best_reward, clip_frac_mean, expert_change_*_mean, ratio_*_var_mean, step_s_mean: means across seeds of the
    per-run values (`run_stats`); skipped_steps: total over seeds; collapse: True when any evaluated seed collapsed.
    """
    stats = run_stats(runset, last_n=last_n, drop=drop, alpha=alpha)
    meta = runset.runs.drop_duplicates("label").set_index("label")
    rows = []
    for label in runset.labels:
        group = stats[stats["label"] == label]
        evaluated = group["collapsed"].dropna()
        skipped = group["skipped_steps"].dropna()
        rows.append(
            {
                "label": label,
                "algo": meta.loc[label, "algo"],
                "replay": meta.loc[label, "replay"],
                "seeds": len(group),
                "incomplete_runs": int(group["incomplete"].sum()),
                "last_step": int(group["last_step"].max()),
                "final_reward_mean": group["final_reward"].mean(),
                "final_reward_std": group["final_reward"].std(ddof=1),
                "best_reward": group["best_reward"].mean(),
                "collapsed_seeds": int(sum(bool(v) for v in evaluated)),
                "collapse_evaluated_seeds": len(evaluated),
                "collapse": bool(any(bool(v) for v in evaluated)),
                "clip_frac_mean": group["clip_frac"].mean(),
                "expert_change_per_update_mean": group["expert_change_per_update"].mean(),
                "expert_change_over_minibatches_mean": group["expert_change_over_minibatches"].mean(),
                "ratio_token_var_mean": group["ratio_token_var"].mean(),
                "ratio_seq_var_mean": group["ratio_seq_var"].mean(),
                "mismatch_kl_k3_mean": group["mismatch_kl_k3"].mean(),
                "fragile_frac_mean": group["fragile_frac"].mean(),
                "routing_share_mean": group["routing_share"].mean(),
                "skipped_steps": skipped.sum() if len(skipped) else math.nan,
                "step_s_mean": group["step_s"].mean(),
            }
        )
    return pd.DataFrame(rows, columns=STABILITY_COLUMNS)


def clip_fraction_by_label(runset: RunSet) -> pd.DataFrame:
    """Figure 2's bars: per label the mean over seeds of each seed's mean clip fraction, sample std, seed count.

    Columns `[label, mean, std, n]`, display order, labels without `clip/token_frac` left out.
    """
    per_run = _mean_of(runset.scalars, CLIP).rename("value").reset_index()
    per_run = per_run.merge(runset.runs[["run", "label"]], on="run")
    table = per_run.groupby("label")["value"].agg(mean="mean", std="std", n="count")
    order = [lab for lab in runset.labels if lab in table.index]
    return table.loc[order].reset_index()
