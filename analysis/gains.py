"""What a sweep varied, per run: held-out accuracy gained from its own start (the summaries the comparisons take), how
each run counts, and every (arm, cell, start, seed) a comparison could have held and does not, with why.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pandas as pd

from analysis.arms import arm_names, arm_order, in_cell, seed_order, sweep_axes, sweep_cells
from analysis.records import (
    INCOMPLETE,
    UNKNOWN_RECIPE,
    UNKNOWN_START,
    RunSet,
    rows_as_dicts,
    run_configs,
    runs_of,
    unstarted_of,
)
from experiments.config import AccuracySummary, EarlyStopped
from experiments.run.recipe import recipe_sha256
from experiments.step.metrics import EVAL_GREEDY, EVAL_SPLIT_GREEDY, gain_area

DIVERGED, INTERRUPTED, FAILED = "diverged", "interrupted", "failed"  # how a run's summary says it ended early

# The summaries of a run's held-out accuracy that the reports compare, each per run and from its own start (the
# values `comparison.primary` may name: experiments.config.AccuracySummary):
GAIN_MEASURES = {
    AccuracySummary.gain.value: "final gain: greedy accuracy at the last evaluation − at the start (on the first "
    "`trainer.eval_prompts` test prompts)",
    AccuracySummary.gain_area.value: "mean gain over the run: the area under the greedy curve above its start, per "
    "step (every evaluation; `metrics.gain_area`)",
    AccuracySummary.split_gain.value: "final gain on the whole test split: greedy accuracy on every test prompt "
    "(`dataset.test_size`) at the last step − at the start",
}

# How each run with a start and an end counts in the comparisons (the `counted` column of the per-seed table):
COUNTED = "yes"  # it ran every step
SCORED_FAILED = "scored as failed"  # it ended itself early and the declared rule scores it as failed
EXCLUDED = "excluded"  # it did not finish: left out of every comparison, named among the seeds left out
PER_SEED_COLUMNS = [
    "start",
    "end",
    "gain",
    "gain_area",
    "split_start",
    "split_end",
    "split_gain",
    "incomplete",
    "status",
    "counted",
    "start_sha256",
    "start_recipe",
]  # after run, arm, seed and the swept axes


def _planned_evaluations(cfg: dict[str, Any]) -> list[int]:
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
    configs = run_configs(runset.runs)
    arms, axes = arm_names(configs), sweep_axes(runset)
    rows = []
    for row in runs_of(runset.runs):
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
        rows.append(
            {
                "run": row.run,
                "arm": arms[row.run],
                "seed": row.seed,
                **{key: cfg.get(key) for key in axes},
                "start": start[row.run],
                "end": end,
                "gain": end - start[row.run],
                "gain_area": gain_area(steps, values),
                "split_start": split_start[row.run] if whole else math.nan,
                "split_end": split_last if whole else math.nan,
                "split_gain": split_last - split_start[row.run] if whole else math.nan,
                "incomplete": row.incomplete,
                "status": row.status,
                "counted": SCORED_FAILED if scored else EXCLUDED if row.incomplete else COUNTED,
                "start_sha256": row.start_sha256,
                # the recipe's sha256 (experiments.run.recipe), "" where the run's summary does not hold it
                "start_recipe": recipe_sha256(json.loads(row.start_recipe))
                if row.start_recipe != UNKNOWN_RECIPE
                else UNKNOWN_RECIPE,
            }
        )
    return pd.DataFrame(rows, columns=["run", "arm", "seed", *axes, *PER_SEED_COLUMNS])


def how_it_ended(status: str, last_step: int, cfg: dict[str, Any]) -> str:
    """A run that did not finish, in words: how and at which of its planned steps it stopped."""
    at = f"step {last_step} of {cfg.get('trainer.steps', '?')}"
    return {
        DIVERGED: f"diverged at {at} (ended itself)",
        INTERRUPTED: f"interrupted at {at}",
        FAILED: f"failed at {at} (its run directory could not be written)",
        INCOMPLETE: f"no summary.json after {at} (crashed, killed or still running)",
    }.get(status, f"status {status!r} at {at}")


LEFT_OUT_COLUMNS = ["arm", "seed", "start_sha256", "run", "why"]  # the cell's axes come after seed


def left_out(
    runset: RunSet, gains: pd.DataFrame, axes: list[str], early_stopped: str = EarlyStopped.exclude
) -> pd.DataFrame:
    """Every (arm, cell, start, seed) a comparison could have held and does not, with why: a run that did not finish
    (and is not scored by the declared rule), a run without an evaluation at its start or after it, a job that logged
    no step (`RunSet.unstarted`), and a seed another arm of the cell holds from a start this arm has no run from."""
    configs = run_configs(runset.runs)
    jobs = {
        f"unstarted {i}": json.loads(job.config) for i, job in enumerate(unstarted_of(runset.unstarted)) if job.config
    }
    arms = arm_names({**configs, **jobs})
    evaluated = runset.metric(EVAL_GREEDY)
    rule = f"comparison.early_stopped={early_stopped}"
    rows = []
    for row in runs_of(runset.runs):
        cfg = configs[row.run]
        listed = gains[gains["run"] == row.run]
        if not listed.empty and listed["counted"].iloc[0] != EXCLUDED:
            continue
        if listed.empty:
            steps = set(evaluated.loc[evaluated["run"] == row.run, "step"])
            why = "no held-out evaluation at its start" if 0 not in steps else "no held-out evaluation after its start"
            if row.incomplete:
                why += f"; {how_it_ended(row.status, row.last_step, cfg)}"
        elif row.status == DIVERGED:
            why = f"{how_it_ended(row.status, row.last_step, cfg)}: excluded by the declared rule ({rule})"
        else:
            why = f"{how_it_ended(row.status, row.last_step, cfg)}: stopped from outside, so it never counts"
        rows.append(
            {
                "arm": arms[row.run],
                "seed": row.seed,
                **{key: cfg.get(key) for key in axes},
                "start_sha256": row.start_sha256,
                "run": row.run,
                "why": why,
            }
        )
    for i, job in enumerate(unstarted_of(runset.unstarted)):
        cfg = jobs.get(f"unstarted {i}", {})
        rows.append(
            {
                "arm": arms.get(f"unstarted {i}", "?"),
                "seed": job.seed,
                **{key: cfg.get(key) for key in axes},
                "start_sha256": UNKNOWN_START,
                "run": job.where,
                "why": job.why,
            }
        )
    return with_missing_units(
        pd.DataFrame(rows, columns=[*LEFT_OUT_COLUMNS[:2], *axes, *LEFT_OUT_COLUMNS[2:]]), gains, axes
    )


def with_missing_units(named: pd.DataFrame, gains: pd.DataFrame, axes: list[str]) -> pd.DataFrame:
    """`named` (the left-out rows already known, with why) and, per cell, every (start, seed) some arm holds a counted
    run at and another arm has no run at (nor a named one): the missing seeds."""
    rows = rows_as_dicts(named)
    counted = gains[gains["counted"] != EXCLUDED]
    for cell, part in sweep_cells(counted, axes):
        units = set(zip(part["start_sha256"], part["seed"]))
        here = named[in_cell(named, cell)]
        for arm in sorted(set(part["arm"]), key=arm_order):
            own = set(zip(part.loc[part["arm"] == arm, "start_sha256"], part.loc[part["arm"] == arm, "seed"]))
            named_here = here[here["arm"] == arm]
            for start, seed in sorted(units - own, key=lambda unit: (unit[0], seed_order(unit[1]))):
                if ((named_here["seed"] == seed) & named_here["start_sha256"].isin([start, UNKNOWN_START])).any():
                    continue  # already named, with why
                rows.append(
                    {
                        "arm": arm,
                        "seed": seed,
                        **cell,
                        "start_sha256": start,
                        "run": "–",
                        "why": "missing: no run of this arm at this seed from this start (another arm has one)",
                    }
                )
    return pd.DataFrame(rows, columns=named.columns)
