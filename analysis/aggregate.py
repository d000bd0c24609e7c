"""Seed aggregation, smoothing, routing-drift tables and the stability verdict.

Conventions:
- curves: each seed is smoothed first (EMA, `s_1 = x_1`, `s_t = (1-α) s_{t-1} + α x_t`), then the series shows the
  mean across seeds with a band of ±1 sample standard deviation (ddof = 1; no band where one seed covers a point);
- the token axis differs between seeds, so each seed is linearly interpolated onto a common grid, inside its own
  range only (a crashed seed drops out where its data ends, it is never extrapolated);
- tables: per seed, average the last N logged steps, then mean ± std across seeds.
Diagnostics: the clip fraction, the importance-ratio variance, and routing drift as the share of activated experts
that changed since θ_old (the GSPO paper's §5.3 statistic).
"""

from __future__ import annotations

import json
import math
import re
from types import SimpleNamespace

import numpy as np
import pandas as pd

from algos.objective import CLIP
from algos.objective import SEQ_RATIO_VAR as SEQ_VAR
from algos.objective import TOKEN_RATIO_VAR as TOKEN_VAR
from analysis.load import RunSet, ignored_key, method_name
from analysis.statistics import compare
from experiments.config import RolloutConfig
from experiments.step.engines import EngineNumerics
from experiments.step.metrics import (
    DRIFT, ENTROPY, EVAL_GREEDY, EVAL_SPLIT_GREEDY, FRAGILE, GRAD_NORM, MISMATCH_K3, REWARD, ROUTING_SHARE, SKIPPED,
    STEP_TIME, TOKENS, gain_area, per_layer,
)

EMA_ALPHA = 0.3
LAST_N = 10
COLLAPSE_DROP = 0.2
COLLAPSE_TAIL_FRACTION = 0.1
COLLAPSE_MIN_TAIL = 3
TOKEN_GRID_POINTS = 100

# The metrics read here are named where they are produced (experiments.step.metrics, algos.objective).
MISMATCH_KL = MISMATCH_K3  # k3 of KL(μ_old ‖ π_old)
_LAYER_METRIC = re.compile("^" + re.escape(per_layer(DRIFT, "")) + r"(\d+)$")  # DRIFT per minibatch, per layer

STABILITY_COLUMNS = [
    "label", "algo", "replay", "seeds", "incomplete_runs", "last_step",
    "final_reward_mean", "final_reward_std", "best_reward", "collapsed_seeds", "collapse_evaluated_seeds",
    "collapse", "clip_frac_mean", "expert_change_per_update_mean", "expert_change_over_minibatches_mean",
    "ratio_token_var_mean", "ratio_seq_var_mean", "mismatch_kl_k3_mean", "fragile_frac_mean", "routing_share_mean",
    "skipped_steps", "step_s_mean",
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
        parts.append(pd.DataFrame({
            "label": label, "x": points[keep], "mean": frame.mean().to_numpy(),
            "std": frame.std(ddof=1).to_numpy(), "n": n[keep],
        }))
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


def run_stats(runset: RunSet, last_n: int = LAST_N, drop: float = COLLAPSE_DROP,
              alpha: float = EMA_ALPHA) -> pd.DataFrame:
    """Per-run numbers behind the stability table, one row per run (NaN where a metric was not logged).

    final_reward: mean raw reward over the run's last `last_n` logged steps; best_reward: maximum of the smoothed
    reward; collapsed: `collapse_flag`; means over all logged steps of clip fraction and ratio variances;
    expert_change_per_update: mean over steps of the drift after one update (the per-minibatch record with index 1,
    the GSPO paper's "experts changed per update"), expert_change_over_minibatches: mean over every minibatch
    record, whose index 0 is 0 by construction; skipped_steps: last value of the cumulative counter; step_s: mean `perf/step_s`, else the summary's
    wall time divided by the last step.
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
    stats["mismatch_kl_k3"] = _mean_of(scalars, MISMATCH_KL)
    stats["fragile_frac"] = _mean_of(scalars, FRAGILE)
    stats["routing_share"] = _mean_of(runset.minibatches, ROUTING_SHARE)
    skipped = scalars[scalars["metric"] == SKIPPED].sort_values("step").groupby("run")["value"].last()
    stats["skipped_steps"] = skipped
    step_s = _mean_of(scalars, STEP_TIME)
    from_summary = runs["wall_s"] / runs["last_step"].where(runs["last_step"] > 0)
    stats["step_s"] = step_s.reindex(stats.index).fillna(from_summary)
    return stats.rename_axis("run").reset_index()


def stability_table(runset: RunSet, last_n: int = LAST_N, drop: float = COLLAPSE_DROP,
                    alpha: float = EMA_ALPHA) -> pd.DataFrame:
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
        rows.append({
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
        })
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


# ---------------------------------------------------------------------------------------------------------------
# Routing drift per layer
# ---------------------------------------------------------------------------------------------------------------

def _layer_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows of per-layer drift metrics with an integer `layer` column added."""
    layers = {name: int(m.group(1)) for name in frame["metric"].unique() if (m := _LAYER_METRIC.match(name))}
    rows = frame[frame["metric"].isin(list(layers))].copy()
    rows["layer"] = rows["metric"].map(layers).astype("int64")
    return rows


def drift_layer_by_minibatch(runset: RunSet) -> dict[str, pd.DataFrame]:
    """Per label a `[layers × minibatch index]` table of drift: mean over steps per run, then over runs."""
    rows = _layer_rows(runset.minibatches)
    if rows.empty:
        return {}
    per_run = rows.groupby(["run", "layer", "minibatch"])["value"].mean().reset_index()
    per_run = per_run.merge(runset.runs[["run", "label"]], on="run")
    tables = {}
    for label in runset.labels:
        group = per_run[per_run["label"] == label]
        if len(group):
            tables[label] = group.pivot_table(index="layer", columns="minibatch", values="value", aggfunc="mean")
    return tables


def drift_layer_by_step(runset: RunSet) -> dict[str, pd.DataFrame]:
    """Per label a `[layers × step]` table of the drift after one update (minibatch index 1), mean over runs."""
    rows = _layer_rows(runset.minibatches)
    rows = rows[rows["minibatch"] == 1]
    if rows.empty:
        return {}
    rows = rows.merge(runset.runs[["run", "label"]], on="run")
    tables = {}
    for label in runset.labels:
        group = rows[rows["label"] == label]
        if len(group):
            tables[label] = group.pivot_table(index="layer", columns="step", values="value", aggfunc="mean")
    return tables


def drift_by_depth(runset: RunSet) -> tuple[pd.DataFrame, str]:
    """Drift per layer and label, mean ± sample std across seeds, and the basis it was measured on.

    The GSPO paper's number is the change after one gradient update: the per-minibatch record with index 1 (runs
    with one minibatch per step have none and are left out). Returns (`[label, layer, mean, std, n]`, basis text).
    """
    columns = ["label", "layer", "mean", "std", "n"]
    mb = _layer_rows(runset.minibatches)
    rows = mb[mb["minibatch"] == 1].merge(runset.runs[["run", "label"]], on="run")
    if rows.empty:
        return pd.DataFrame(columns=columns), ""
    basis = "after one optimizer update (minibatch index 1)"
    per_run = rows.groupby(["label", "run", "layer"])["value"].mean().reset_index()
    table = per_run.groupby(["label", "layer"])["value"].agg(mean="mean", std="std", n="count").reset_index()
    table["order"] = table["label"].map({lab: i for i, lab in enumerate(runset.labels)})
    table = table.sort_values(["order", "layer"])
    return table[columns].reset_index(drop=True), basis


def layer_counts(runset: RunSet) -> dict[str, int]:
    """Number of MoE layers per label as configured (`model.num_hidden_layers`), where known."""
    known = runset.runs.dropna(subset=["num_layers"])
    return {label: int(group["num_layers"].max()) for label, group in known.groupby("label")}


# ---------------------------------------------------------------------------------------------------------------
# Training–inference mismatch: only where the runs' engines differ from their trainers
# ---------------------------------------------------------------------------------------------------------------

# k3 of KL(μ_old ‖ π_old) between two computations of the same weights that differ only in rounding (the HF engine
# on the trainer's own model: the KV-cache path, measured at ~1e-8); above this something differs.
MISMATCH_ROUNDING = 1e-6


def mismatch_is_rounding(runset: RunSet) -> bool:
    """Whether no run varied the training–inference mismatch: each sampled with the trainer's own model (the default
    engine, no engine numerics on) and logged a mismatch k3 below `MISMATCH_ROUNDING`. Its figure and early-warning
    signal would then draw rounding noise as a result."""
    engine = RolloutConfig()
    for config in runset.runs["config"]:
        config = json.loads(config)
        rollout = {key: config.get(f"rollout.{key}", getattr(engine, key))
                   for key in ("engine", "precision", "weight_quant", "router_noise")}
        if rollout["engine"] != engine.engine or EngineNumerics.of(SimpleNamespace(**rollout)).differs:
            return False
    values = runset.metric(MISMATCH_K3)["value"]
    return bool(values.abs().max() < MISMATCH_ROUNDING) if len(values) else True


# ---------------------------------------------------------------------------------------------------------------
# Early warning: what moves before the reward falls
# ---------------------------------------------------------------------------------------------------------------

WARNING_SIGNALS = (ENTROPY, MISMATCH_K3, GRAD_NORM)
WARNING_SUSTAIN = 3  # a signal has moved when it stays outside its early band for this many logged steps


def _collapse_step(steps: np.ndarray, smoothed: np.ndarray, drop: float) -> float:
    """The first step of the final stretch where the smoothed reward stays more than `drop` below its best."""
    above = np.nonzero(smoothed >= smoothed.max() - drop)[0]
    last_above = above[-1]
    return float(steps[last_above + 1]) if last_above + 1 < len(steps) else math.nan


def _moved_step(steps: np.ndarray, smoothed: np.ndarray) -> float:
    """The first step after the early window (the first fifth of the run, at least 3 steps) from which the smoothed
    signal stays for `WARNING_SUSTAIN` steps outside the early band: mean ± max(3 std, 20% of |mean|)."""
    window = max(3, len(steps) // 5)
    if len(steps) < window + WARNING_SUSTAIN:
        return math.nan
    early = smoothed[:window]
    mean = float(np.mean(early))
    half_width = max(3 * float(np.std(early)), 0.2 * abs(mean), 1e-12)
    outside = np.abs(smoothed - mean) > half_width
    for i in range(window, len(steps) - WARNING_SUSTAIN + 1):
        if outside[i : i + WARNING_SUSTAIN].all():
            return float(steps[i])
    return math.nan


def early_warning(runset: RunSet, drop: float = COLLAPSE_DROP, alpha: float = EMA_ALPHA) -> pd.DataFrame:
    """Per run: whether it collapsed (`collapse_flag`), the step its reward fell for good, and for each signal of
    `WARNING_SIGNALS` it logged (the mismatch only where a run varied it) the step it first moved
    (`<metric>_moved_step`) and, in a collapsed run, by how many steps that came before the fall (`<metric>_lead`,
    positive: the signal moved first)."""
    signals = [s for s in WARNING_SIGNALS if not (s == MISMATCH_K3 and mismatch_is_rounding(runset))]
    rows = []
    for run, group in runset.metric(REWARD).sort_values(["run", "step"]).groupby("run", sort=False):
        steps, reward = group["step"].to_numpy(float), group["value"].to_numpy(float)
        collapsed = bool(collapse_flag(reward, drop=drop, alpha=alpha))
        row = {"run": run, "label": group["label"].iloc[0], "collapsed": collapsed,
               "collapse_step": _collapse_step(steps, ema(reward, alpha), drop) if collapsed else math.nan}
        for metric in signals:
            signal = runset.metric(metric)
            signal = signal[signal["run"] == run].sort_values("step")
            if signal.empty:
                continue
            moved = _moved_step(signal["step"].to_numpy(float), ema(signal["value"].to_numpy(float), alpha))
            row[f"{metric}_moved_step"] = moved
            row[f"{metric}_lead"] = row["collapse_step"] - moved if collapsed else math.nan
        rows.append(row)
    return pd.DataFrame(rows, columns=None if rows else ["run", "label", "collapsed", "collapse_step"])


# ---------------------------------------------------------------------------------------------------------------
# What a sweep varied: held-out accuracy gained from each run's own start, against the swept knobs
# ---------------------------------------------------------------------------------------------------------------

# Config keys that are never a sweep's axis: who the run is (algorithm and replay make the arm; the seed is
# averaged over) and what an arm implies or a run records about itself.
_NOT_AXES = ("algo.name", "routing.replay", "routing_variant.name", "rollout.precision", "seed")


def arm_of(cfg: dict) -> str:
    """The arm: objective, replay and routing variant, and the engine's precision when it is not the trainer's fp32."""
    arm = method_name(cfg)
    if cfg.get("rollout.precision", "fp32") != "fp32":
        arm += f" ({cfg['rollout.precision']} engine)"
    return arm


def sweep_axes(runset: RunSet) -> list[str]:
    """The numeric config keys a sweep varied within at least one arm (an arm's own settings are not axes), in
    sorted order. Categorical keys (a model's name, a path) are left out: a numeric key varies with them."""
    configs = {row.run: json.loads(row.config) for row in runset.runs.itertuples()}
    by_arm: dict[str, list[dict]] = {}
    for cfg in configs.values():
        by_arm.setdefault(arm_of(cfg), []).append(cfg)
    keys = sorted({k for cfg in configs.values() for k in cfg})
    axes = []
    for key in keys:
        if key in _NOT_AXES or ignored_key(key):
            continue
        values = [cfg.get(key) for cfg in configs.values()]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            continue
        if any(len({cfg.get(key) for cfg in arm}) > 1 for arm in by_arm.values()):
            axes.append(key)
    return axes


# The summaries of a run's held-out accuracy that the reports compare, each per run and from its own start:
GAIN_MEASURES = {
    "gain": "final gain: greedy accuracy at the last evaluation − at the start (eval_prompts, 128 by default)",
    "gain_area": "mean gain over the run: the area under the greedy curve above its start, per step "
                 "(every evaluation; `metrics.gain_area`)",
    "split_gain": "final gain on the whole test split: greedy accuracy on every test prompt (500) at the last step "
                  "− at the start",
}


def accuracy_gain(runset: RunSet) -> pd.DataFrame:
    """Per run: its arm, the swept axes' values, held-out greedy accuracy at the start and at its last evaluation,
    and the `GAIN_MEASURES`: the gain (end − start), the mean gain over the run (`gain_area`) and, where the run
    evaluated the whole test split, its gain there (`split_start`, `split_end`, `split_gain`; NaN otherwise). Runs
    without both evaluations are left out."""
    evaluations = runset.metric(EVAL_GREEDY).sort_values("step")
    start = evaluations[evaluations["step"] == 0].groupby("run")["value"].first()
    end = evaluations[evaluations["step"] > 0].groupby("run")["value"].last()
    curves = {run: (group["step"].tolist(), group["value"].tolist()) for run, group in evaluations.groupby("run")}
    split = runset.metric(EVAL_SPLIT_GREEDY).sort_values("step")
    split_start = split[split["step"] == 0].groupby("run")["value"].first()
    split_end = split[split["step"] > 0].groupby("run")["value"].last()
    axes = sweep_axes(runset)
    rows = []
    for row in runset.runs.itertuples():
        if row.run not in start.index or row.run not in end.index:
            continue
        cfg = json.loads(row.config)
        whole = row.run in split_start.index and row.run in split_end.index
        rows.append({"run": row.run, "arm": arm_of(cfg), "seed": row.seed, **{key: cfg.get(key) for key in axes},
                     "start": start[row.run], "end": end[row.run], "gain": end[row.run] - start[row.run],
                     "gain_area": gain_area(*curves[row.run]),
                     "split_start": split_start[row.run] if whole else math.nan,
                     "split_end": split_end[row.run] if whole else math.nan,
                     "split_gain": split_end[row.run] - split_start[row.run] if whole else math.nan,
                     "incomplete": row.incomplete})
    return pd.DataFrame(rows, columns=["run", "arm", "seed", *axes, "start", "end", "gain", "gain_area",
                                       "split_start", "split_end", "split_gain", "incomplete"])


# ---------------------------------------------------------------------------------------------------------------
# Arms against a baseline arm, paired over shared seeds (analysis.statistics)
# ---------------------------------------------------------------------------------------------------------------

DEFAULT_BASELINE = "grpo"


def baseline_arm(gains: pd.DataFrame, baseline: str | None) -> str | None:
    """The arm the others are compared with: `baseline` (refused, naming the arms, when no run has it), else GRPO
    when a run has it, else the first arm in name order; None without runs."""
    arms = sorted(set(gains["arm"]))
    if baseline is not None:
        if baseline not in arms:
            raise ValueError(f"--baseline {baseline!r} is not an arm of these runs; their arms: {', '.join(arms)}")
        return baseline
    if not arms:
        return None
    return DEFAULT_BASELINE if DEFAULT_BASELINE in arms else arms[0]


def cells(gains: pd.DataFrame, axes: list[str]) -> list[tuple[dict, pd.DataFrame]]:
    """The sweep's cells: (the axes' values, its runs), one per combination of swept values, in sorted order."""
    if not axes:
        return [({}, gains)]
    return [(dict(zip(axes, key if isinstance(key, tuple) else (key,))), part)
            for key, part in gains.groupby(axes, sort=True)]


def arm_comparisons(gains: pd.DataFrame, baseline: str, axes: list[str]) -> pd.DataFrame:
    """Per cell, per gain measure (`GAIN_MEASURES`) and per arm other than `baseline`: the paired comparison over the
    seeds both hold with a value (`statistics.compare`), one row each with the cell's axes, `measure`, `arm`,
    `baseline`, the comparison's fields and its `verdict`; fewer than 2 shared seeds give a row that says so."""
    rows = []
    for cell, part in cells(gains, axes):
        reference = part[part["arm"] == baseline]
        for measure in GAIN_MEASURES:
            base = reference.dropna(subset=[measure]).groupby("seed")[measure].mean()
            for arm in sorted(set(part["arm"]) - {baseline}, key=lambda a: (a.split(" ")[0] != "grpo", a)):
                own = part[part["arm"] == arm].dropna(subset=[measure]).groupby("seed")[measure].mean()
                shared = sorted(set(own.index) & set(base.index), key=lambda s: (len(s), s))
                row = {**cell, "measure": measure, "arm": arm, "baseline": baseline}
                if len(shared) < 2:
                    rows.append({**row, "seeds": len(shared), "verdict": f"not compared: {len(shared)} shared seed(s)"})
                    continue
                rows.append({**row, **compare(own[shared].to_numpy(), base[shared].to_numpy()).row()})
    return pd.DataFrame(rows)
