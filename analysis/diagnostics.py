"""What the runs' routing and engines did and what moved before a collapse: routing drift per layer (the GSPO paper's
§5.3 statistic), whether the training–inference mismatch is more than rounding, the early-warning signals, and the
drift against an engine that samples behind θ_old, per lag.
"""

from __future__ import annotations

import json
import math
import re
from types import SimpleNamespace
from typing import cast

import numpy as np
import pandas as pd

from analysis.arms import arms_of
from analysis.records import RunSet, runs_of
from analysis.summaries import COLLAPSE_DROP, EMA_ALPHA, collapse_flag, ema
from experiments.config import RolloutConfig
from experiments.step.engines import EngineNumerics
from experiments.step.metrics import (
    DRIFT,
    ENGINE_EXPERTS,
    ENGINE_GATES,
    ENTROPY,
    GRAD_NORM,
    MISMATCH_K3,
    REWARD,
    per_layer,
)
from experiments.step.metrics import LAG as SERVED_LAG

# The metrics read here are named where they are produced (experiments.step.metrics).
_LAYER_METRIC = re.compile("^" + re.escape(per_layer(DRIFT, "")) + r"(\d+)$")  # DRIFT per minibatch, per layer


def _layer_rows(runset: RunSet, after_one_update: bool = False) -> pd.DataFrame:
    """The per-minibatch records of per-layer drift with the run's label and an integer `layer` column; with
    `after_one_update`, only the records with index 1 (the drift after one optimizer update since θ_old)."""
    frame = runset.minibatches
    layers = {name: int(m.group(1)) for name in frame["metric"].unique() if (m := _LAYER_METRIC.match(name))}
    rows = frame[frame["metric"].isin(list(layers))].copy()
    rows["layer"] = rows["metric"].map(layers).astype("int64")
    if after_one_update:
        rows = rows[rows["minibatch"] == 1]
    return rows.merge(runset.runs[["run", "label"]], on="run")


def _layer_tables(runset: RunSet, rows: pd.DataFrame, columns: str) -> dict[str, pd.DataFrame]:
    """Per label, in display order, a `[layers × columns]` table of `rows`' drift: the mean over the runs (and
    whatever else) a cell pools; labels without rows have none."""
    tables = {}
    for label in runset.labels:
        group = rows[rows["label"] == label]
        if len(group):
            tables[label] = group.pivot_table(index="layer", columns=columns, values="value", aggfunc="mean")
    return tables


def drift_layer_by_minibatch(runset: RunSet) -> dict[str, pd.DataFrame]:
    """Per label a `[layers × minibatch index]` table of drift: mean over steps per run, then over runs."""
    per_run = _layer_rows(runset).groupby(["label", "run", "layer", "minibatch"])["value"].mean().reset_index()
    return _layer_tables(runset, per_run, "minibatch")


def drift_layer_by_step(runset: RunSet) -> dict[str, pd.DataFrame]:
    """Per label a `[layers × step]` table of the drift after one update (minibatch index 1), mean over runs."""
    return _layer_tables(runset, _layer_rows(runset, after_one_update=True), "step")


def drift_by_depth(runset: RunSet) -> tuple[pd.DataFrame, str]:
    """Drift per layer and label, mean ± sample std across seeds, and the basis it was measured on.

    The GSPO paper's number is the change after one gradient update: the per-minibatch record with index 1 (runs
    with one minibatch per step have none and are left out). Returns (`[label, layer, mean, std, n]`, basis text).
    """
    columns = ["label", "layer", "mean", "std", "n"]
    rows = _layer_rows(runset, after_one_update=True)
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
    # A label is text; pandas types a group's key as any scalar.
    return {cast(str, label): int(group["num_layers"].max()) for label, group in known.groupby("label")}


# ---------------------------------------------------------------------------------------------------------------
# Training–inference mismatch: only where the runs' engines differ from their trainers
# ---------------------------------------------------------------------------------------------------------------

# k3 of KL(μ_old ‖ π_old) between two computations of the same weights that differ only in rounding (the HF engine
# on the trainer's own model: the KV-cache path, measured at ~1e-8); above this something differs.
MISMATCH_ROUNDING = 1e-6


def mismatch_is_rounding(runset: RunSet) -> bool:
    """Whether no run varied the training–inference mismatch: each sampled with the trainer's own model (the default
    engine, no engine numerics on, not behind θ_old: the synchronous rollout source) and logged a mismatch
    k3 below `MISMATCH_ROUNDING`. Its figure and early-warning signal would then draw rounding noise as a result."""
    engine = RolloutConfig()
    for config in runset.runs["config"]:
        config = json.loads(config)
        rollout = {
            key: config.get(f"rollout.{key}", getattr(engine, key))
            for key in ("engine", "precision", "weight_quant", "router_noise")
        }
        if rollout["engine"] != engine.engine or EngineNumerics.of(SimpleNamespace(**rollout)).differs:
            return False
        if config.get("rollout.lag", engine.lag) or config.get("rollout.source", engine.source) != engine.source:
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
        row = {
            "run": run,
            "label": group["label"].iloc[0],
            "collapsed": collapsed,
            "collapse_step": _collapse_step(steps, ema(reward, alpha), drop) if collapsed else math.nan,
        }
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


LAG = "rollout.lag"  # the exact lag (experiments.step.versions): weight versions the engine samples behind θ_old
# What is measured against the stale engine: its routes (experts, gate mass) and its log-probs, against θ_old's.
AGAINST_THE_ENGINE = (ENGINE_EXPERTS, ENGINE_GATES, MISMATCH_K3)


def lags_of(runset: RunSet) -> dict[str, int]:
    """Per run the lag its engine sampled at (`rollout.lag`; 0 where the run sets none)."""
    return {row.run: int(json.loads(row.config).get(LAG, 0)) for row in runs_of(runset.runs)}


def staleness_by_lag(runset: RunSet) -> pd.DataFrame:
    """Drift against the engine per arm and lag, where the runs vary `rollout.lag`: columns `[arm, lag, metric, mean,
    std, n]`, over seeds, of each run's mean over the steps that sampled at its full lag (the first steps of a run
    sample with the start, nearer θ_old); empty when the runs share one lag."""
    lags = lags_of(runset)
    if len(set(lags.values())) < 2:
        return pd.DataFrame(columns=["arm", "lag", "metric", "mean", "std", "n"])
    arms = arms_of(runset)
    scalars = runset.scalars
    served = scalars[scalars["metric"] == SERVED_LAG][["run", "step", "value"]].rename(columns={"value": "served"})
    rows = scalars[scalars["metric"].isin(AGAINST_THE_ENGINE)].merge(served, on=["run", "step"], how="left")
    rows["lag"] = rows["run"].map(lags)
    rows = rows[rows["served"].fillna(0) == rows["lag"]]  # a run without a lag logs none: every step is at 0
    per_run = rows.groupby(["run", "lag", "metric"], as_index=False)["value"].mean()
    per_run["arm"] = per_run["run"].map(arms)
    return per_run.groupby(["arm", "lag", "metric"])["value"].agg(mean="mean", std="std", n="count").reset_index()
