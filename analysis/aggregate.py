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
from collections.abc import Sequence
from types import SimpleNamespace

import numpy as np
import pandas as pd

from algos.objective import CLIP
from algos.objective import SEQ_RATIO_VAR as SEQ_VAR
from algos.objective import TOKEN_RATIO_VAR as TOKEN_VAR
from analysis.configs import SYNTHETIC_KEYS, format_value, ignored_key, method_name, short_key
from analysis.records import INCOMPLETE, UNKNOWN_START, RunSet
from analysis.statistics import ALPHA, across_starts, compare, holm, smallest_p
from experiments.config import EarlyStopped, RolloutConfig, Summary
from experiments.step.engines import EngineNumerics
from experiments.step.metrics import (
    DRIFT, ENTROPY, EVAL_GREEDY, EVAL_SPLIT_GREEDY, FRAGILE, GRAD_NORM, MISMATCH_K3, REWARD, ROUTING_SHARE, SKIPPED,
    STEP_TIME, TOKENS, gain_area, per_layer,
)

DIVERGED, INTERRUPTED, FAILED = "diverged", "interrupted", "failed"  # how a run's summary says it ended early
EMA_ALPHA = 0.3
LAST_N = 10
COLLAPSE_DROP = 0.2
COLLAPSE_TAIL_FRACTION = 0.1
COLLAPSE_MIN_TAIL = 3
TOKEN_GRID_POINTS = 100

# The metrics read here are named where they are produced (experiments.step.metrics, algos.objective).
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
    stats["mismatch_kl_k3"] = _mean_of(scalars, MISMATCH_K3)
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
# The settings an arm brings (conf/arm/*.yaml and the groups it picks): they may differ between the arms of one seed.
_ARM_KEYS = ("algo.", "routing.replay", "routing_variant.", "routers.", "rollout.precision")


def arm_of(cfg: dict) -> str:
    """The arm: objective, replay and routing variant, and the engine's precision when it is not the trainer's fp32."""
    arm = method_name(cfg)
    if cfg.get("rollout.precision", "fp32") != "fp32":
        arm += f" ({cfg['rollout.precision']} engine)"
    return arm


def arm_names(configs: dict[str, dict]) -> dict[str, str]:
    """Per run its arm (`arm_of`), and, where runs that share that name differ in another of the arm's own settings
    (`minirl` with and without `algo.mask_stale`), those settings in parentheses: two arms are never pooled as one."""
    names = {run: arm_of(cfg) for run, cfg in configs.items()}
    parts: dict[str, list[str]] = {run: [] for run in configs}

    def name(run: str) -> str:
        return names[run] + (f" ({', '.join(parts[run])})" if parts[run] else "")

    all_keys = sorted({key for cfg in configs.values() for key in cfg})
    for key in (k for k in all_keys if k.startswith(_ARM_KEYS)):
        values: dict[str, set[str]] = {}
        for run, cfg in configs.items():
            values.setdefault(name(run), set()).add(format_value(cfg.get(key, "—")))
        split = {run for run in configs if len(values[name(run)]) > 1}
        for run in split:
            parts[run].append(f"{short_key(key, all_keys)}={format_value(configs[run].get(key, '—'))}")
    return {run: name(run) for run in configs}


def sweep_axes(runset: RunSet) -> list[str]:
    """The numeric config keys a sweep varied within at least one arm (an arm's own settings are not axes), in
    sorted order. Categorical keys (a model's name, a path) are left out: a numeric key varies with them."""
    configs = {row.run: json.loads(row.config) for row in runset.runs.itertuples()}
    arms = arm_names(configs)
    by_arm: dict[str, list[dict]] = {}
    for run, cfg in configs.items():
        by_arm.setdefault(arms[run], []).append(cfg)
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


# The summaries of a run's held-out accuracy that the reports compare, each per run and from its own start (the
# values `comparison.primary` may name: experiments.config.Summary):
GAIN_MEASURES = {
    Summary.gain.value: "final gain: greedy accuracy at the last evaluation − at the start (eval_prompts, 128 by "
                        "default)",
    Summary.gain_area.value: "mean gain over the run: the area under the greedy curve above its start, per step "
                             "(every evaluation; `metrics.gain_area`)",
    Summary.split_gain.value: "final gain on the whole test split: greedy accuracy on every test prompt (500) at the "
                              "last step − at the start",
}

# How each run with a start and an end counts in the comparisons (the `counted` column of the per-seed table):
COUNTED = "yes"  # it ran every step
SCORED_FAILED = "scored as failed"  # it ended itself early and the declared rule scores it as failed
EXCLUDED = "excluded"  # it did not finish: left out of every comparison, named among the seeds left out
PER_SEED_COLUMNS = ["start", "end", "gain", "gain_area", "split_start", "split_end", "split_gain", "incomplete",
                    "status", "counted", "start_sha256"]  # after run, arm, seed and the swept axes


def _planned_evaluations(cfg: dict) -> list[int]:
    """The steps at which a run of `cfg` evaluates (every `trainer.eval_every` steps and at its last)."""
    steps, every = int(cfg.get("trainer.steps", 0)), int(cfg.get("trainer.eval_every", 0) or 0)
    return sorted({*(range(every, steps + 1, every) if every else ()), steps} - {0})


def accuracy_gain(runset: RunSet, early_stopped: str = EarlyStopped.exclude) -> pd.DataFrame:
    """Per run with an evaluation at its start: its arm (`arm_names`), the swept axes' values, held-out greedy accuracy
    at the start and at its last evaluation, and the `GAIN_MEASURES`: the gain (end − start), the mean gain over the
    run (`gain_area`) and, where the run evaluated the whole test split, its gain there (`split_start`, `split_end`,
    `split_gain`; NaN otherwise); how it ended (`incomplete`, `status`), whether it counts in the comparisons
    (`counted`) and the sha256 of the weights it started from.

    A run that finished counts. A run that ended itself early (`status: diverged`) counts as `early_stopped` says:
    `exclude` (kept here with what it logged, `counted` = excluded), or `failed` (scored: held-out accuracy 0 at every
    evaluation it did not reach, so its final gains are minus its start). Any other unfinished run is excluded. Runs
    without an evaluation after their start are left out here, unless scored as failed (`left_out` names them)."""
    if early_stopped not in set(EarlyStopped):
        raise ValueError(f"early_stopped {early_stopped!r} is not a rule: {', '.join(EarlyStopped)}")
    evaluations = runset.metric(EVAL_GREEDY).sort_values("step")
    start = evaluations[evaluations["step"] == 0].groupby("run")["value"].first()
    curves = {run: (group["step"].tolist(), group["value"].tolist()) for run, group in evaluations.groupby("run")}
    split = runset.metric(EVAL_SPLIT_GREEDY).sort_values("step")
    split_start = split[split["step"] == 0].groupby("run")["value"].first()
    split_end = split[split["step"] > 0].groupby("run")["value"].last()
    configs = {row.run: json.loads(row.config) for row in runset.runs.itertuples()}
    arms, axes = arm_names(configs), sweep_axes(runset)
    rows = []
    for row in runset.runs.itertuples():
        if row.run not in start.index:
            continue
        cfg = configs[row.run]
        steps, values = curves[row.run]
        scored = row.status == DIVERGED and early_stopped == EarlyStopped.failed
        if scored:  # every evaluation it did not reach at accuracy 0
            missed = [step for step in _planned_evaluations(cfg) if step > steps[-1]]
            steps, values = steps + missed, values + [0.0] * len(missed)
        elif len(steps) < 2:
            continue
        whole = row.run in split_start.index and (scored or row.run in split_end.index)
        end, split_last = (0.0, 0.0) if scored else (values[-1], split_end.get(row.run, math.nan))
        rows.append({"run": row.run, "arm": arms[row.run], "seed": row.seed, **{key: cfg.get(key) for key in axes},
                     "start": start[row.run], "end": end, "gain": end - start[row.run],
                     "gain_area": gain_area(steps, values),
                     "split_start": split_start[row.run] if whole else math.nan,
                     "split_end": split_last if whole else math.nan,
                     "split_gain": split_last - split_start[row.run] if whole else math.nan,
                     "incomplete": row.incomplete, "status": row.status,
                     "counted": SCORED_FAILED if scored else EXCLUDED if row.incomplete else COUNTED,
                     "start_sha256": row.start_sha256})
    return pd.DataFrame(rows, columns=["run", "arm", "seed", *axes, *PER_SEED_COLUMNS])


def how_it_ended(status: str, last_step: int, cfg: dict) -> str:
    """A run that did not finish, in words: how and at which of its planned steps it stopped."""
    at = f"step {last_step} of {cfg.get('trainer.steps', '?')}"
    return {DIVERGED: f"diverged at {at} (ended itself)", INTERRUPTED: f"interrupted at {at}",
            FAILED: f"failed at {at} (its run directory could not be written)",
            INCOMPLETE: f"no summary.json after {at} (crashed, killed or still running)"}.get(
        status, f"status {status!r} at {at}")


LEFT_OUT_COLUMNS = ["arm", "seed", "start_sha256", "run", "why"]  # the cell's axes come after seed


def left_out(runset: RunSet, gains: pd.DataFrame, axes: list[str], early_stopped: str = EarlyStopped.exclude
             ) -> pd.DataFrame:
    """Every (arm, cell, start, seed) a comparison could have held and does not, with why: a run that did not finish
    (and is not scored by the declared rule), a run without an evaluation at its start or after it, a job that logged
    no step (`RunSet.unstarted`), and a seed another arm of the cell holds from a start this arm has no run from."""
    configs = {row.run: json.loads(row.config) for row in runset.runs.itertuples()}
    jobs = {f"unstarted {i}": json.loads(job.config) for i, job in enumerate(runset.unstarted.itertuples())
            if job.config}
    arms = arm_names({**configs, **jobs})
    evaluated = runset.metric(EVAL_GREEDY)
    rule = f"comparison.early_stopped={early_stopped}"
    rows = []
    for row in runset.runs.itertuples():
        cfg = configs[row.run]
        listed = gains[gains["run"] == row.run]
        if not listed.empty and listed["counted"].iloc[0] != EXCLUDED:
            continue
        if listed.empty:
            steps = set(evaluated.loc[evaluated["run"] == row.run, "step"])
            why = ("no held-out evaluation at its start" if 0 not in steps else
                   "no held-out evaluation after its start")
            if row.incomplete:
                why += f"; {how_it_ended(row.status, row.last_step, cfg)}"
        elif row.status == DIVERGED:
            why = f"{how_it_ended(row.status, row.last_step, cfg)}: excluded by the declared rule ({rule})"
        else:
            why = f"{how_it_ended(row.status, row.last_step, cfg)}: stopped from outside, so it never counts"
        rows.append({"arm": arms[row.run], "seed": row.seed, **{key: cfg.get(key) for key in axes},
                     "start_sha256": row.start_sha256, "run": row.run, "why": why})
    for i, job in enumerate(runset.unstarted.itertuples()):
        cfg = jobs.get(f"unstarted {i}", {})
        rows.append({"arm": arms.get(f"unstarted {i}", "?"), "seed": job.seed, **{key: cfg.get(key) for key in axes},
                     "start_sha256": UNKNOWN_START, "run": job.where, "why": job.why})
    return with_missing_units(pd.DataFrame(rows, columns=[*LEFT_OUT_COLUMNS[:2], *axes, *LEFT_OUT_COLUMNS[2:]]),
                              gains, axes)


def with_missing_units(named: pd.DataFrame, gains: pd.DataFrame, axes: list[str]) -> pd.DataFrame:
    """`named` (the left-out rows already known, with why) and, per cell, every (start, seed) some arm holds a counted
    run at and another arm has no run at (nor a named one): the missing seeds."""
    rows = named.to_dict("records")
    counted = gains[gains["counted"] != EXCLUDED]
    for cell, part in cells(counted, axes):
        units = set(zip(part["start_sha256"], part["seed"]))
        here = named[_in_cell(named, cell)]
        for arm in sorted(set(part["arm"]), key=arm_order):
            own = set(zip(part.loc[part["arm"] == arm, "start_sha256"], part.loc[part["arm"] == arm, "seed"]))
            named_here = here[here["arm"] == arm]
            for start, seed in sorted(units - own, key=lambda unit: (unit[0], _seed_key(unit[1]))):
                if ((named_here["seed"] == seed) & named_here["start_sha256"].isin([start, UNKNOWN_START])).any():
                    continue  # already named, with why
                rows.append({"arm": arm, "seed": seed, **cell, "start_sha256": start, "run": "–",
                             "why": "missing: no run of this arm at this seed from this start (another arm has one)"})
    return pd.DataFrame(rows, columns=named.columns)


def _in_cell(frame: pd.DataFrame, cell: dict) -> pd.Series:
    inside = pd.Series(True, index=frame.index)
    for key, value in cell.items():
        inside &= frame[key] == value
    return inside


def _seed_key(seed: str) -> tuple[bool, int, str]:
    return (not seed.isdigit(), int(seed) if seed.isdigit() else 0, seed)


def check_pairable(runset: RunSet, gains: pd.DataFrame, axes: list[str]) -> None:
    """Refuse (`ValueError`, one line) runs that a comparison would pair although their configs differ beyond their
    arms: within one cell, start and seed, the counted runs must agree in every setting but the arm's own (the
    objective and its settings, replay, routing variant, router switches, the engine's precision), the swept axes and
    what never changes a run's numbers (`load.ignored_key`); `model.path` too where the start's sha256 names it. A
    setting one of two runs lacks altogether was recorded by the other only (added since, to a node the older run
    did not have): not compared. One arm holds at most one run there. Across the starts a cell pools (the recipe's
    view), the runs must agree in the same settings but `model.path`: starts of one recipe, never a start of another
    task or model whose only difference is a categorical key (a dataset's name is no axis)."""
    configs = {row.run: json.loads(row.config) for row in runset.runs.itertuples()}
    counted = gains[gains["counted"] != EXCLUDED]
    _check_one_recipe(configs, counted, axes)
    for (start, seed), part in counted.groupby(["start_sha256", "seed"], sort=True):
        for cell, runs in cells(part, axes):
            twice = runs[runs.duplicated("arm", keep=False)]
            if not twice.empty:
                arm = twice["arm"].iloc[0]
                raise ValueError(f"arm {arm!r} has {int((twice['arm'] == arm).sum())} runs at seed {seed} from start "
                                 f"{start[:12] or '(unnamed)'}{_cell_text(cell)} ({', '.join(twice['run'])}): a paired "
                                 "comparison takes one run per arm, cell, start and seed")
            first, *others = runs["run"]
            for other in others:
                key, here, there = _first_difference(configs, first, other, axes, path=start == UNKNOWN_START)
                if key is not None:
                    arm = dict(zip(runs["run"], runs["arm"]))
                    raise ValueError(
                        f"runs of seed {seed} from start {start[:12] or '(unnamed)'}{_cell_text(cell)} disagree in "
                        f"{key} beyond their arms: {arm[first]} has {here} ({first}), {arm[other]} {there} "
                        f"({other}); pairing them would compare that setting too: report them apart, or pair "
                        "them with analysis.compare under names that say it")


def _first_difference(configs: dict[str, dict], first: str, other: str, axes: list[str], path: bool
                      ) -> tuple[str | None, str, str]:
    """The first setting (in key order) two runs both recorded with different values, beyond their arms' own
    settings, the swept axes and what never changes a run's numbers; `model.path` only where `path`. (None, "", "")
    when they agree."""
    def settings(run: str) -> dict[str, str]:
        return {key: format_value(value) for key, value in configs[run].items()
                if not (key.startswith(_ARM_KEYS) or key in axes or ignored_key(key) or key in _NOT_AXES
                        or (key == "model.path" and not path))}

    mine, theirs = settings(first), settings(other)
    for key in sorted(set(mine) & set(theirs)):
        if mine[key] != theirs[key]:
            return key, mine[key], theirs[key]
    return None, "", ""


def _check_one_recipe(configs: dict[str, dict], counted: pd.DataFrame, axes: list[str]) -> None:
    """Refuse a cell whose named starts' runs differ beyond their arms and `model.path`: a two-level comparison
    pools starts as draws of one recipe, and a start of another recipe (another task, model or SFT) is not one."""
    named = counted[counted["start_sha256"] != UNKNOWN_START]
    for cell, part in cells(named, axes):
        first_runs = part.drop_duplicates("start_sha256")
        if len(first_runs) < 2:
            continue
        first, *others = first_runs["run"]
        start = dict(zip(first_runs["run"], first_runs["start_sha256"]))
        for other in others:
            key, here, there = _first_difference(configs, first, other, axes, path=False)
            if key is not None:
                raise ValueError(
                    f"runs from starts {start[first][:12]} and {start[other][:12]}{_cell_text(cell)} disagree in {key}: "
                    f"{here} ({first}), {there} ({other}); a comparison across starts pools them as starts of one "
                    "recipe, which they are not: report each recipe's runs apart")


def _cell_text(cell: dict) -> str:
    return "".join(f", {key}={format_value(value)}" for key, value in cell.items())


def cell_name(cell: dict) -> str:
    """A cell of a sweep as a reader names it: a SYNTHETIC intervention by what it is and its dose where it is on
    ("SYNTHETIC flips p=0.2"), any other setting as key=value; a cell whose interventions are all off and that sets
    nothing else says so."""
    parts = [f"{SYNTHETIC_KEYS[key]} p={format_value(value)}" if key in SYNTHETIC_KEYS else
             f"{key}={format_value(value)}" for key, value in cell.items()
             if key not in SYNTHETIC_KEYS or float(value)]
    if parts:
        return ", ".join(parts)
    return "no SYNTHETIC intervention" if cell else "every run"


# ---------------------------------------------------------------------------------------------------------------
# Arms against a baseline arm, paired over shared (start, seed) units (analysis.statistics), judged as a family
# ---------------------------------------------------------------------------------------------------------------

DEFAULT_BASELINE = "grpo"
PRIMARY, SECONDARY = "primary", "secondary"  # a comparison's role: in the declared family, or reported beside it


def arm_order(arm: str) -> tuple[bool, str]:
    """GRPO's arms first, then by name."""
    return (arm.split(" ")[0] != "grpo", arm)


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


def _by_unit(rows: pd.DataFrame, measure: str) -> pd.Series:
    """One arm's values of `measure` in one cell, indexed by (start, seed)."""
    values = rows.dropna(subset=[measure]).set_index(["start_sha256", "seed"])[measure]
    if values.index.has_duplicates:
        unit = values.index[values.index.duplicated()][0]
        raise ValueError(f"more than one run of arm {rows['arm'].iloc[0]!r} at seed {unit[1]} from start "
                         f"{unit[0][:12] or '(unnamed)'}: a paired comparison takes one run per arm, cell, start and "
                         "seed")
    return values


def arm_comparisons(gains: pd.DataFrame, baseline: str, axes: list[str], primary: str = Summary.gain_area,
                    family: Sequence[str] = ()) -> pd.DataFrame:
    """Per cell, per gain measure (`GAIN_MEASURES`) and per arm other than `baseline`: the paired comparison over the
    (start, seed) units both hold with a counted value (`statistics.compare`; runs whose `counted` is excluded never
    enter) and, where those units span ≥ 2 starts, the comparison across starts (`statistics.across_starts`). One row
    each with the cell's axes, `measure`, `arm`, `baseline`, `role` (primary: `primary` measure and an arm of
    `family`, every arm when empty; else secondary), the numbers and the `verdict`: Holm's correction over the
    primary rows decides theirs (on the start-level test where there are ≥ 2 starts), the secondary rows keep the
    uncorrected rule and say so. Fewer than 2 shared units give a row that says so."""
    counted = gains[gains["counted"] != EXCLUDED] if "counted" in gains else gains
    if "start_sha256" not in counted:  # a table from before runs named their start: every run from one, unnamed
        counted = counted.assign(start_sha256=UNKNOWN_START)
    rows = []
    for cell, part in cells(counted, axes):
        reference = part[part["arm"] == baseline]
        for measure in GAIN_MEASURES:
            base = _by_unit(reference, measure)
            for arm in sorted(set(part["arm"]) - {baseline}, key=arm_order):
                own = _by_unit(part[part["arm"] == arm], measure)
                shared = sorted(set(own.index) & set(base.index), key=lambda unit: (unit[0], _seed_key(unit[1])))
                role = PRIMARY if measure == primary and (not family or arm in family) else SECONDARY
                row = {**cell, "measure": measure, "arm": arm, "baseline": baseline, "role": role}
                if len(shared) < 2:
                    rows.append({**row, "seeds": len(shared), "verdict": f"not compared: {len(shared)} shared seed(s)"})
                    continue
                row.update(compare(own[shared].to_numpy(), base[shared].to_numpy()).row())
                differences: dict[str, list[float]] = {}
                for unit in shared:
                    differences.setdefault(unit[0], []).append(own[unit] - base[unit])
                row.update(across_starts(differences).row() if len(differences) >= 2 else
                           {"starts": 1, "per_start": f"{shared[0][0][:12] or '?'}: {row['difference_estimate']:+.3f} "
                                                      f"({len(shared)})"})
                rows.append(row)
    return _judged(pd.DataFrame(rows))


def _judged(table: pd.DataFrame) -> pd.DataFrame:
    """The verdict of every compared row: the primary rows as a family (Holm), the secondary ones alone."""
    if table.empty or "difference_estimate" not in table:
        return table
    for column in ("starts", "starts_p_value", "starts_difference_low", "starts_difference_high"):
        if column not in table:
            table[column] = math.nan
    compared = table["difference_estimate"].notna()
    across = compared & (table["starts"] >= 2)
    table["decisive_p"] = table["starts_p_value"].where(across, table["p_value"])
    low = table["starts_difference_low"].where(across, table["difference_low"])
    high = table["starts_difference_high"].where(across, table["difference_high"])
    interval_excludes = (low > 0) | (high < 0)
    family = compared & (table["role"] == PRIMARY)
    table["holm_p"] = math.nan
    table.loc[family, "holm_p"] = holm(table.loc[family, "decisive_p"].to_numpy(float))
    decides = table["holm_p"].where(family, table["decisive_p"])
    table["separates"] = (interval_excludes & (decides < ALPHA)).astype(object).where(compared, None)
    size = int(family.sum())
    for i in table.index[compared]:
        table.at[i, "verdict"] = _verdict(table.loc[i], size)
    return table


def _verdict(row: pd.Series, family_size: int) -> str:
    starts = int(row["starts"])
    where = f" across {starts} starts" if starts >= 2 else ""
    if row["role"] == PRIMARY:
        test = f"{'start-level ' if starts >= 2 else ''}Holm p = {row['holm_p']:.3g} over a family of {family_size}"
    else:
        test = f"{'start-level ' if starts >= 2 else ''}p = {row['decisive_p']:.3g}, uncorrected"
    interval = "two-level 95% CI" if starts >= 2 else "95% CI"
    units = starts if starts >= 2 else int(row["seeds"])
    if row["separates"]:
        said = f"separates{where} ({interval} of the difference excludes 0; {test})"
    elif row["role"] == PRIMARY and smallest_p(units) < ALPHA <= smallest_p(units, family_size):
        said = (f"not distinguishable{where} ({test}; with {units} {'starts' if starts >= 2 else 'seeds'} and a family "
                f"of {family_size} the smallest Holm p any comparison can reach is "
                f"{smallest_p(units, family_size):.3g}: this design cannot separate, whatever the data)")
    elif starts >= 2 and smallest_p(starts) >= ALPHA:
        said = (f"not distinguishable{where} ({test}; with {starts} starts no start-level test reaches p < "
                f"{ALPHA:g}: at least 6 are needed)")
    elif starts >= 2:
        said = f"not distinguishable{where} ({test})"
    elif math.isinf(row["detectable"]):
        said = (f"not distinguishable ({test}; with {int(row['seeds'])} seeds no paired test reaches p < {ALPHA:g}: "
                "at least 6 are needed)")
    else:
        said = (f"not distinguishable ({test}; with {int(row['seeds'])} seeds the smallest effect this could detect "
                f"is {row['detectable']:.3f})")
    return said if row["role"] == PRIMARY else f"secondary: {said}"
