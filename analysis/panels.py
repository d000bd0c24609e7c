"""`python -m analysis.panels`: a sweep in the paper's form, one column of panels per value of the key it swept.

    python -m analysis.panels multirun/staleness/map_* --by trainer.minibatches --out docs/results/staleness/map

Qwen's "Stabilizing RL with LLMs" (arXiv 2512.01374) shows each off-policy setting N (mini-batches per rollout batch)
in a panel of its own, the arms as lines within it. Here a column per value of `--by`, a row per measure: the training
reward (per-seed EMA), the held-out greedy accuracy (as evaluated), and beside them what explains them: the experts
changed after one update (the paper's drift), the gate mass it moved (total variation), the clipped share of tokens
and the mismatch KL k3 between the engine and the trainer at θ_old. A line per arm (`analysis.arms.arm_names`),
the mean over its runs in that column with a ±1 std band where two or more runs cover a point. A measure no run logged,
or only some runs of a column (runs made before it existed), leaves its row out, printed with why; a column none of
whose runs logged a measure (at N = 1 no update follows another in a step) says "not logged" in its panel.
Writes `<out>/panels.png` (and `.pdf` with `--pdf`) and prints what it drew.
"""

from __future__ import annotations

import argparse
import textwrap
from dataclasses import replace
from pathlib import Path

from matplotlib.ticker import MaxNLocator

from analysis.arms import arm_names
from analysis.cli import Command, writable_out
from analysis.load import load_runs
from analysis.plotting import STEP_LABEL, in_style, legend, new_figure, plot_band, save, series_styles
from analysis.records import RunSet, run_configs
from analysis.style import TEXT_WIDTH_IN
from analysis.summaries import EMA_ALPHA, curve
from experiments.step import metrics as m

# The rows, top to bottom: what the arms reach, then what explains it. (metric, y label, smoothed, log scale)
ROWS = (
    (m.REWARD, "training reward", True, False),
    (m.EVAL_GREEDY, "held-out greedy accuracy", False, False),
    (m.DRIFT_PER_UPDATE, "experts changed after one update", True, False),
    (m.GATE_DRIFT_PER_UPDATE, "gate mass moved after one update (TV)", True, False),
    ("clip/token_frac", "clipped tokens (fraction)", True, False),
    (m.MISMATCH_K3, "mismatch KL k3 (engine vs trainer)", True, True),
)


def by_value(runset: RunSet, key: str) -> dict[float | str | None, RunSet]:
    """The runs of each value of the config key `key`, each run labelled by its arm; `ValueError` naming the key when
    no run has it."""
    configs = run_configs(runset.runs)
    if not any(key in cfg for cfg in configs.values()):
        raise ValueError(f"--by {key}: no run's config has this key (a swept key, e.g. trainer.minibatches)")
    arms = arm_names(configs)
    runs = runset.runs.assign(label=runset.runs["run"].map(arms))
    parts: dict[float | str | None, RunSet] = {}  # None: the runs whose config lacks the key
    for value in sorted({cfg.get(key) for cfg in configs.values()}, key=lambda v: (v is None, str(v).zfill(12))):
        chosen = [run for run, cfg in configs.items() if cfg.get(key) == value]
        parts[value] = replace(
            runset,
            runs=runs[runs["run"].isin(chosen)],
            scalars=runset.scalars[runset.scalars["run"].isin(chosen)],
            minibatches=runset.minibatches[runset.minibatches["run"].isin(chosen)],
        )
    return parts


@in_style
def draw(
    runset: RunSet, key: str, out: Path, dpi: int = 150, pdf: bool = False, alpha: float = EMA_ALPHA
) -> tuple[list[Path], list[str]]:
    """The panels of `runset` by `key` into `out`: the files written and the rows left out, each with why (no run
    logged it, or only some runs of a column did)."""
    parts = by_value(runset, key)
    rows, left_out = [], []
    for row in ROWS:
        logged = set(runset.scalars.loc[runset.scalars["metric"] == row[0], "run"])
        # a column shows a measure for all its runs or for none (at N = 1 no update follows another): a row that
        # holds some runs of a column only would show those arms as if they were the column
        partial = [value for value, part in parts.items() if 0 < len(logged & set(part.runs["run"])) < len(part.runs)]
        if not logged:
            left_out.append(f"{row[1]} (no run logged it)")
        elif partial:
            left_out.append(
                f"{row[1]} (only some runs logged it at {key.rsplit('.', 1)[-1]} = {', '.join(map(str, partial))})"
            )
        else:
            rows.append(row)
    everyone = replace(
        runset, runs=runset.runs.assign(label=runset.runs["run"].map(arm_names(run_configs(runset.runs))))
    )
    styles = series_styles(everyone)
    fig = new_figure(max(TEXT_WIDTH_IN, 2.2 * len(parts)), 1.5 * len(rows) + 0.8)
    grid = fig.subplots(len(rows), len(parts), squeeze=False, sharey="row")
    for col, (value, part) in enumerate(parts.items()):
        for line, (metric, label, smoothed, log) in enumerate(rows):
            ax = grid[line][col]
            if not part.has(metric):
                ax.text(0.5, 0.5, "not logged", transform=ax.transAxes, ha="center", va="center", color="0.5")
                ax.tick_params(labelbottom=line == len(rows) - 1)
            table = curve(part, metric, x="step", alpha=alpha if smoothed else None)
            for arm in part.labels:
                arm_curve = table[table["label"] == arm]
                if len(arm_curve):
                    plot_band(ax, arm_curve, styles[arm], marker=None if smoothed else "o")
            if log:
                ax.set_yscale("log")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            if line == 0:
                ax.set_title(f"{key.rsplit('.', 1)[-1]} = {value}")
            if col == 0:
                ax.set_ylabel(textwrap.fill(label, 24))
            if line == len(rows) - 1:
                ax.set_xlabel(STEP_LABEL)
    legend(fig, everyone.labels, styles)
    files = save(fig, out, "panels", dpi, pdf)
    return files, left_out


def arguments(parser: argparse.ArgumentParser) -> None:
    """The runs, the swept key a column each, where the panels go and how."""
    parser.add_argument("paths", nargs="+", metavar="RUN_OR_SWEEP_DIR", help="run or sweep directories")
    parser.add_argument("--by", required=True, metavar="KEY", help="the swept config key, a column per value")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--dpi", type=int, default=150, help="PNG resolution (default: %(default)s)")
    parser.add_argument("--pdf", action="store_true", help="also a PDF")


def read(args: argparse.Namespace) -> RunSet:
    """The runs, once the output folder proved writable; a key no run has is refused (`by_value`)."""
    writable_out(args.out)
    runset = load_runs(args.paths)
    by_value(runset, args.by)
    return runset


def write(runset: RunSet, args: argparse.Namespace, command: str) -> str:
    """The panels; the line saying what was drawn and which rows were left out."""
    files, left_out = draw(runset, args.by, args.out, args.dpi, args.pdf)
    return f"panels: {', '.join(str(f) for f in files)}" + (f"; left out: {'; '.join(left_out)}" if left_out else "")


main = Command("analysis.panels", __doc__, arguments, read, write, refuses=(ValueError, FileNotFoundError)).main

if __name__ == "__main__":
    main()
