"""`python -m analysis.calibrate RUN_OR_SWEEP_DIR... --knob KEY --measure METRIC --target KEY=VALUE... --grid
KEY=VALUE... --out DIR`: the value of a knob at which an arm's per-update measure matches another setting's, by the
rule of the confound searches (conf/search/matched_step.yaml, matched_clip.yaml).

Per run, the measure is the mean of `METRIC` over its per-minibatch records after 1 or more updates (the off-policy
ones: the first minibatch of a step is on-policy, where KL and clipping are 0 by construction) in steps 1 to
`--steps` (default 10); per setting, its mean over the tuning seeds, with the standard error over them. The target is
the runs that match every `--target` condition (a config key and its value, e.g. `algo.name=gspo trainer.lr=0.0003`);
the grid, the runs that match every `--grid` condition, one setting per value of `--knob`, a numeric config key. The
matched knob interpolates log measure against log knob between the two grid points that bracket the target (a grid
that does not bracket it is reported as such, never extrapolated), rounded to two significant digits. Writes
`calibration.md` and `calibration.json` into --out and prints the matched value. Exit code 2 and one `error:` line on
bad input.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.cli import Command, writable_out
from analysis.load import load_runs
from analysis.records import RunSet, run_configs


def per_run_measure(runset: RunSet, metric: str, steps: int) -> pd.Series:
    """Per run: the mean of `metric` over its minibatch records after ≥ 1 update, in steps 1..`steps`."""
    rows = runset.minibatches
    rows = rows[(rows["metric"] == metric) & (rows["minibatch"] >= 1) & (rows["step"] <= steps)]
    return rows.groupby("run")["value"].mean()


def settings_table(runset: RunSet, metric: str, steps: int, keys: list[str]) -> pd.DataFrame:
    """One row per setting (the values of `keys`): the measure's mean and standard error over its seeds."""
    measure = per_run_measure(runset, metric, steps)
    configs = run_configs(runset.runs)
    rows = [
        {**{key: configs[run].get(key) for key in keys}, "run": run, "seed": configs[run].get("seed"), "value": value}
        for run, value in zip(measure.index, measure)  # `items()`, with the runs' names typed as the index's
    ]
    frame = pd.DataFrame(rows)
    if frame.empty:
        raise ValueError(f"no run logged `{metric}` on a minibatch after one update in steps 1-{steps}")
    table = frame.groupby(keys, dropna=False)["value"].agg(mean="mean", sem="sem", seeds="count").reset_index()
    return table


def matched_value(grid: pd.DataFrame, knob: str, target: float) -> float | None:
    """The knob value where log measure, interpolated linearly in log knob between bracketing grid points, equals
    `target`, rounded to two significant digits; None when no two neighbouring points bracket it."""
    points = grid.sort_values(knob)[[knob, "mean"]].to_numpy(float)
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if min(y0, y1) <= target <= max(y0, y1) and y0 > 0 and y1 > 0 and y0 != y1:
            share = (math.log(target) - math.log(y0)) / (math.log(y1) - math.log(y0))
            value = math.exp(math.log(x0) + share * (math.log(x1) - math.log(x0)))
            return float(f"{value:.2g}")
    return None


def conditions(pairs: list[str], option: str) -> dict[str, str]:
    """`KEY=VALUE` strings as a dict; ValueError naming the option for one without `=`."""
    bad = [pair for pair in pairs if "=" not in pair]
    if bad:
        raise ValueError(f"{option} {bad[0]!r} must be KEY=VALUE")
    return dict(pair.split("=", 1) for pair in pairs)


def matching(table: pd.DataFrame, wanted: dict[str, str]) -> pd.Series:
    """Rows whose every key in `wanted` holds its value (compared as config values print)."""
    keep = pd.Series(True, index=table.index)
    for key, value in wanted.items():
        keep &= table[key].map(lambda v: f"{v:g}" if isinstance(v, float) else str(v)) == value
    return keep


def arguments(parser: argparse.ArgumentParser) -> None:
    """The runs, the knob and the measure, which runs are the target and which the grid, how many steps, where."""
    parser.add_argument("paths", nargs="+", metavar="RUN_OR_SWEEP_DIR")
    parser.add_argument("--knob", required=True, help="the numeric config key of the grid (e.g. trainer.lr)")
    parser.add_argument("--measure", required=True, help="the per-minibatch metric matched (e.g. kl/old_k3)")
    parser.add_argument(
        "--target",
        nargs="+",
        required=True,
        metavar="KEY=VALUE",
        help="the runs whose measure is the target (e.g. algo.name=gspo trainer.lr=0.0003)",
    )
    parser.add_argument(
        "--grid",
        nargs="+",
        required=True,
        metavar="KEY=VALUE",
        help="the runs of the knob's grid (e.g. algo.name=grpo)",
    )
    parser.add_argument("--steps", type=int, default=10, help="steps 1..N are measured (default: %(default)s)")
    parser.add_argument("--out", type=Path, required=True)


def read(args: argparse.Namespace) -> tuple[pd.DataFrame, list[str], pd.Series, pd.Series]:
    """The settings' table over the keys the conditions and the knob name, and which rows are the target and the
    grid: one target and at least two grid points, or the command is refused."""
    target_of, grid_of = conditions(args.target, "--target"), conditions(args.grid, "--grid")
    runset = load_runs(args.paths)
    keys = list(dict.fromkeys([*target_of, *grid_of, args.knob]))
    table = settings_table(runset, args.measure, args.steps, keys)
    is_target, in_grid = matching(table, target_of), matching(table, grid_of)
    if is_target.sum() != 1 or in_grid.sum() < 2:
        raise ValueError(
            f"--target must match one setting and --grid at least two; they match {is_target.sum()} "
            f"and {in_grid.sum()} of {len(table)}"
        )
    writable_out(args.out)
    return table, keys, is_target, in_grid


def write(
    settings: tuple[pd.DataFrame, list[str], pd.Series, pd.Series], args: argparse.Namespace, command: str
) -> str:
    """calibration.md and calibration.json; the verdict line."""
    table, keys, is_target, in_grid = settings
    target, grid = table[is_target].iloc[0], table[in_grid]
    matched = matched_value(grid, args.knob, float(target["mean"]))
    lines = [
        "# Calibration",
        "",
        f"Made with `{command}`.",
        "",
        f"`{args.measure}` per run: its mean over the minibatch records after ≥ 1 update in steps 1-{args.steps}; "
        "per setting: mean ± standard error over the seeds.",
        "",
        "| " + " | ".join(keys) + f" | {args.measure} | seeds |",
        "|" + "---|" * (len(keys) + 2),
    ]
    for row in table.sort_values(keys).to_dict("records"):
        sem = "" if np.isnan(row["sem"]) else f" ± {row['sem']:.3g}"
        cells = [f"{row[key]:g}" if isinstance(row[key], float) else str(row[key]) for key in keys]
        lines.append("| " + " | ".join(cells) + f" | {row['mean']:.4g}{sem} | {row['seeds']} |")
    named = " ".join(args.target)
    verdict = f"The target ({named}) is {target['mean']:.4g}; " + (
        f"the grid ({' '.join(args.grid)}) matches it at **{args.knob} = {matched:g}**."
        if matched is not None
        else "no two neighbouring grid points bracket it: extend the grid (nothing is extrapolated)."
    )
    lines += ["", verdict]
    (args.out / "calibration.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (args.out / "calibration.json").write_text(
        json.dumps(
            {
                "knob": args.knob,
                "measure": args.measure,
                "target": args.target,
                "grid": args.grid,
                "target_value": float(target["mean"]),
                "matched": matched,
                "steps": args.steps,
            },
            indent=2,
        )
        + "\n"
    )
    return verdict


main = Command("analysis.calibrate", __doc__, arguments, read, write).main

if __name__ == "__main__":
    main()
