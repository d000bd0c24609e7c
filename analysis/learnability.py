"""Whether a baseline learns, and what its runs show about why (docs/results/learnability): one row per run of the
start's headroom (held-out greedy accuracy, pass@1 and pass@8 from the evaluation's samples, the share of prompts
whose samples all agree), what the run gained (greedy at the end and over the run, `metrics.gain_area`; sampled
pass@1 at the end; training prompts beside held-out), how the training signal looked (training reward and the share
of zero-advantage groups over the first and last ten steps, the reward's spread within groups), how far the policy
moved (each update's size against the weights, the KL from the start at the end, the entropy first and last) and how
noisy one evaluation is (the spread of the change between two successive evaluations).

    python -m analysis.learnability multirun/learnability --out docs/results/learnability/diagnosis

writes `runs.csv` (every run) and `table.md` (the mean over seeds per model, start and setting, with each seed's end
gain).
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
from experiments.step import metrics as m

EDGE = 10  # steps at each end over which the training signal is averaged
# The settings a run is told apart by, as its row names them.
SETTINGS = {"trainer.prompts_per_step": "prompts", "trainer.minibatches": "N", "trainer.lr": "lr",
            "trainer.steps": "steps", "trainer.group_size": "G"}


def _series(scalars: pd.DataFrame, run: str, metric: str) -> pd.Series:
    rows = scalars[(scalars["run"] == run) & (scalars["metric"] == metric)]
    return rows.set_index("step")["value"].sort_index()


def _ends(series: pd.Series) -> tuple[float, float]:
    """The mean of the first and of the last EDGE steps (from step 1)."""
    trained = series[series.index >= 1]
    return (float(trained.head(EDGE).mean()), float(trained.tail(EDGE).mean())) if len(trained) else (math.nan,) * 2


def _change(series: pd.Series) -> float:
    """The last value minus the first (NaN with fewer than two)."""
    return float(series.iloc[-1] - series.iloc[0]) if len(series) > 1 else math.nan


def run_rows(paths: list[str]) -> pd.DataFrame:
    """One row per run under `paths` (module docstring)."""
    runset = load_runs(paths)
    rows = []
    for run in runset.runs.itertuples():
        config = json.loads(run.config)
        series = lambda metric: _series(runset.scalars, run.run, metric)  # noqa: E731  this run's metric by step
        greedy, train, pass1 = series(m.EVAL_GREEDY), series(m.EVAL_TRAIN_GREEDY), series(m.EVAL_ACCURACY)
        pass8 = series(m.EVAL_PASS_AT_K)
        reward, zero = _ends(series(m.REWARD)), _ends(series(m.ZERO_STD_GROUPS))
        entropy = _ends(series(m.ENTROPY))
        steps = list(greedy.index)
        row = {
            "run": run.run, "model": run.model, "arm": run.algo, "start_sha256": str(run.start_sha256)[:12],
            "seed": run.seed, "status": run.status, **{short: config.get(key) for key, short in SETTINGS.items()},
            "start_greedy": greedy.get(0, math.nan),
            "start_pass1": pass1.get(0, math.nan),
            "start_pass8": pass8.get(0, math.nan),
            "start_all_same": series(m.EVAL_ALL_SAME).get(0, math.nan),
            "gain": _change(greedy),
            "gain_area": m.gain_area(steps, list(greedy.values)),
            "pass1_gain": _change(pass1),
            "train_gain": _change(train),
            "end_pass8": float(pass8.iloc[-1]) if len(pass8) else math.nan,
            "reward_first": reward[0], "reward_last": reward[1],
            "zero_adv_first": zero[0], "zero_adv_last": zero[1],
            "within_group_std": float(series(m.WITHIN_GROUP_STD).mean()),
            "grad_norm": float(series(m.GRAD_NORM).mean()),
            "update_ratio": float(series(m.UPDATE_RATIO).mean()),
            "kl_to_start_end": float(series(m.KL_TO_START).tail(EDGE).mean()),
            "entropy_first": entropy[0], "entropy_last": entropy[1],
            # Successive evaluations' changes: their spread is the noise a single evaluation adds to a gain.
            "eval_step_sd": float(np.std(np.diff(greedy.values), ddof=1)) if len(greedy) > 2 else math.nan,
            "eval_prompts": config.get("trainer.eval_prompts"),
        }
        rows.append(row)
    return pd.DataFrame(rows)


def setting_name(row: pd.Series) -> str:
    """The run's recipe in a few words: its arm, prompts a step, mini-batches, learning rate, steps, and the prompts
    each evaluation held."""
    return (f"{row['arm']}: {row['prompts']} prompts, N {row['N']}, lr {row['lr']:g}, {row['steps']} steps; "
            f"evaluated on {row['eval_prompts']}")


def table(rows: pd.DataFrame) -> str:
    """The markdown table: per model and setting, the mean over seeds, each seed's end gain listed."""
    rows = rows.assign(setting=[setting_name(row) for _, row in rows.iterrows()])
    shown = ["start_greedy", "start_pass1", "start_pass8", "gain", "gain_area", "pass1_gain", "train_gain",
             "reward_first",
             "reward_last", "zero_adv_first", "zero_adv_last", "within_group_std", "update_ratio", "kl_to_start_end",
             "entropy_first", "entropy_last", "eval_step_sd"]
    lines = ["| model | start | setting | seeds | gain per seed | " + " | ".join(shown) + " |",
             "|" + "---|" * (5 + len(shown))]
    for (model, start, setting), group in rows.groupby(["model", "start_sha256", "setting"], sort=False):
        gains = ", ".join(f"{gain:+.3f}" for gain in group.sort_values("seed")["gain"])
        means = [f"{group[name].mean():.3g}" for name in shown]
        lines.append(f"| {model} | `{start}` | {setting} | {len(group)} | {gains} | " + " | ".join(means) + " |")
    return "\n".join(lines) + "\n"


def arguments(parser: argparse.ArgumentParser) -> None:
    """The runs and where the table goes."""
    parser.add_argument("paths", nargs="+", help="run or sweep directories, searched recursively")
    parser.add_argument("--out", type=Path, required=True, help="the folder runs.csv and table.md go to")


def read(args: argparse.Namespace) -> pd.DataFrame:
    """Every run's row; the output folder proved writable."""
    rows = run_rows(args.paths)
    writable_out(args.out)
    return rows


def write(rows: pd.DataFrame, args: argparse.Namespace, command: str) -> str:
    """runs.csv and table.md (the command that made them at its head); the line saying where."""
    rows.to_csv(args.out / "runs.csv", index=False, float_format="%.6g")
    (args.out / "table.md").write_text(f"Made with `{command}`.\n\n" + table(rows), encoding="utf-8")
    return f"table: {args.out / 'table.md'} ({len(rows)} runs)"


main = Command("analysis.learnability", __doc__, arguments, read, write).main

if __name__ == "__main__":
    main()
