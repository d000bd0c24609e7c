"""Whether a baseline learns, and what its runs show about why (docs/results/learnability): one row per run of the
start's headroom (held-out greedy accuracy, pass@1 and pass@8 from the evaluation's samples, the share of prompts
whose samples all agree), what the run gained (greedy at the end and over the run, `metrics.gain_area`; sampled
pass@1 at the end; training prompts beside held-out), how the training signal looked (training reward and the share
of zero-advantage groups over the first and last ten steps, the reward's spread within groups), how far the policy
moved (each update's size against the weights, the KL from the start at the end, the entropy first and last) and how
noisy one evaluation is (the spread of the change between two successive evaluations).

    python -m analysis.learnability multirun/learnability --out docs/results/learnability/diagnosis

writes `runs.csv` (every run) and `table.md` (the mean over seeds per model, start and setting, with each seed's end
gain). With `--rule`, it also applies the learnability map's rule as docs/results/learnability/preregistration.md
fixed it before the map ran (`MAP_RULE`) and writes `rule.md`: per lever, GRPO's held-out greedy gain on the whole
test split (`split_gain`) and training-reward rise on every start of both MoE rungs, whether the lever learns, its
mean CPU cost, and the lever the rule picks; and `regime.json`, that lever as the run overrides the learning study's
command (docs/results/learning/command.sh) runs its family with. A map missing a lever, a start or a finished run is
refused in one line naming what is missing.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis.cli import Command, writable_out
from analysis.load import load_runs
from analysis.records import FINISHED, runs_of
from experiments.run.rundir import SUMMARY_FILE
from experiments.step import metrics as m

EDGE = 10  # steps at each end over which the training signal is averaged
# The settings a run is told apart by, as its row names them.
SETTINGS = {
    "trainer.prompts_per_step": "prompts",
    "trainer.minibatches": "N",
    "trainer.lr": "lr",
    "trainer.steps": "steps",
    "trainer.group_size": "G",
}


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


def _cpu_seconds(run_dir: Path) -> float:
    """The CPU time the run's summary.json records (NaN without one)."""
    try:
        return float(json.loads((run_dir / SUMMARY_FILE).read_text(encoding="utf-8"))["cpu_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return math.nan


def run_rows(paths: list[str]) -> pd.DataFrame:
    """One row per run under `paths` (module docstring)."""
    runset = load_runs(paths)
    rows = []
    for run in runs_of(runset.runs):
        config = json.loads(run.config)
        series = functools.partial(_series, runset.scalars, run.run)  # this run's metric by step
        greedy, train, pass1 = series(m.EVAL_GREEDY), series(m.EVAL_TRAIN_GREEDY), series(m.EVAL_ACCURACY)
        pass8 = series(m.EVAL_PASS_AT_K)
        reward, zero = _ends(series(m.REWARD)), _ends(series(m.ZERO_STD_GROUPS))
        entropy = _ends(series(m.ENTROPY))
        steps = list(greedy.index)
        row = {
            "run": run.run,
            "model": run.model,
            "arm": run.algo,
            "start_sha256": str(run.start_sha256)[:12],
            "seed": run.seed,
            "status": run.status,
            **{short: config.get(key) for key, short in SETTINGS.items()},
            "start_greedy": greedy.get(0, math.nan),
            "start_pass1": pass1.get(0, math.nan),
            "start_pass8": pass8.get(0, math.nan),
            "start_all_same": series(m.EVAL_ALL_SAME).get(0, math.nan),
            "gain": _change(greedy),
            "gain_area": m.gain_area(steps, list(greedy.values)),
            "pass1_gain": _change(pass1),
            "train_gain": _change(train),
            "end_pass8": float(pass8.iloc[-1]) if len(pass8) else math.nan,
            "reward_first": reward[0],
            "reward_last": reward[1],
            "zero_adv_first": zero[0],
            "zero_adv_last": zero[1],
            "within_group_std": float(series(m.WITHIN_GROUP_STD).mean()),
            "grad_norm": float(series(m.GRAD_NORM).mean()),
            "update_ratio": float(series(m.UPDATE_RATIO).mean()),
            "kl_to_start_end": float(series(m.KL_TO_START).tail(EDGE).mean()),
            "entropy_first": entropy[0],
            "entropy_last": entropy[1],
            # Successive evaluations' changes: their spread is the noise a single evaluation adds to a gain.
            "eval_step_sd": float(np.std(np.diff(greedy.to_numpy()), ddof=1)) if len(greedy) > 2 else math.nan,
            "eval_prompts": config.get("trainer.eval_prompts"),
            "split_gain": _change(series(m.EVAL_SPLIT_GREEDY)),
            "reward_rise": reward[1] - reward[0],
            "cpu_s": _cpu_seconds(Path(run.source)),
        }
        rows.append(row)
    return pd.DataFrame(rows)


def setting_name(row: pd.Series) -> str:
    """The run's recipe in a few words: its arm, prompts a step, mini-batches, learning rate, steps, and the prompts
    each evaluation held."""
    return (
        f"{row['arm']}: {row['prompts']} prompts, N {row['N']}, G {row['G']}, lr {row['lr']:g}, {row['steps']} "
        f"steps; evaluated on {row['eval_prompts']}"
    )


def table(rows: pd.DataFrame) -> str:
    """The markdown table: per model and setting, the mean over seeds, each seed's end gain listed."""
    rows = rows.assign(setting=[setting_name(row) for _, row in rows.iterrows()])
    shown = [
        "start_greedy",
        "start_pass1",
        "start_pass8",
        "gain",
        "gain_area",
        "pass1_gain",
        "train_gain",
        "reward_first",
        "reward_last",
        "zero_adv_first",
        "zero_adv_last",
        "within_group_std",
        "update_ratio",
        "kl_to_start_end",
        "entropy_first",
        "entropy_last",
        "eval_step_sd",
    ]
    lines = [
        "| model | start | setting | seeds | gain per seed | " + " | ".join(shown) + " |",
        "|" + "---|" * (5 + len(shown)),
    ]
    for (model, start, setting), group in rows.groupby(["model", "start_sha256", "setting"], sort=False):
        gains = ", ".join(f"{gain:+.3f}" for gain in group.sort_values("seed")["gain"])
        means = [f"{group[name].mean():.3g}" for name in shown]
        lines.append(f"| {model} | `{start}` | {setting} | {len(group)} | {gains} | " + " | ".join(means) + " |")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class MapRule:
    """The learnability map's rule (docs/results/learnability/preregistration.md, fixed before the map's first run).

    A lever *learns* when GRPO's `split_gain` ≥ `min_split_gain` and its reward rise ≥ `min_reward_rise` on each of
    `starts` starts of every rung in `rungs`; the rule picks the learning lever whose GRPO runs cost the least CPU on
    average. Where none learns, the declared `extension` decides if it learns; otherwise the lever (or the extension)
    whose smallest split_gain is largest is the best found, not a learning regime."""

    centre: dict[str, Any]  # the diagnosis's best setting, by the run row's names
    levers: dict[str, Any]  # lever name -> its change from the centre
    extension: dict[str, Any]  # the one extension, declared before the map: its change from the centre
    rungs: tuple[str, ...] = ("glm4_moe_l16", "qwen30b_l16")  # the rule's MoE rungs (the dense control decides nothing)
    starts: int = 3  # starts per rung
    arm: str = "grpo"  # the baseline the rule reads
    min_split_gain: float = 0.10
    min_reward_rise: float = 0.10

    def lever_of(self, row: pd.Series) -> str | None:
        """The lever whose setting `row` ran (the extension's name included), None for any other setting."""
        for name, change in {**self.levers, EXTENSION: self.extension}.items():
            if all(math.isclose(float(row[key]), float(value)) for key, value in {**self.centre, **change}.items()):
                return name
        return None


EXTENSION = "extension"
REGIME_FILE = "regime.json"  # the setting the rule chose, as run overrides: what the learning study's command reads
MAP_RULE = MapRule(
    centre={"prompts": 16, "N": 2, "G": 8, "lr": 1e-4, "steps": 150},
    levers={
        "centre": {},
        "p8": {"prompts": 8},
        "p32": {"prompts": 32},
        "lr3e-5": {"lr": 3e-5},
        "lr3e-4": {"lr": 3e-4},
        "g16": {"G": 16},
        "h400": {"steps": 400},
    },
    extension={"lr": 3e-5, "prompts": 32, "steps": 400},
)


def apply_rule(rows: pd.DataFrame, rule: MapRule = MAP_RULE) -> tuple[pd.DataFrame, str]:
    """Per lever (the extension where it ran), GRPO's smallest split_gain and reward rise over the rule's starts,
    whether it learns and its mean CPU seconds; and the verdict in words. A ValueError names every lever, rung and
    start count the rule lacks (a run that did not finish counts as missing)."""
    baseline = rows[(rows["arm"] == rule.arm) & rows["model"].isin(rule.rungs)]
    # pandas-stubs take a column's cells as scalars without None, which a column of objects holds.
    baseline = baseline.assign(lever=[rule.lever_of(row) for _, row in baseline.iterrows()])  # type: ignore[misc]
    finished = baseline[baseline["status"] == FINISHED]
    levers = list(rule.levers) + ([EXTENSION] if (baseline["lever"] == EXTENSION).any() else [])
    missing = [
        f"{lever} on {rung}: {n} of {rule.starts} starts finished"
        for lever in levers
        for rung in rule.rungs
        if (n := finished.query("lever == @lever and model == @rung")["start_sha256"].nunique()) < rule.starts
    ]
    if missing:
        raise ValueError("the map's rule cannot be computed: " + "; ".join(missing))
    verdicts = []
    for lever in levers:
        runs = finished[finished["lever"] == lever]
        learns = bool(
            ((runs["split_gain"] >= rule.min_split_gain) & (runs["reward_rise"] >= rule.min_reward_rise)).all()
        )
        verdicts.append(
            {
                "lever": lever,
                "runs": len(runs),
                "min_split_gain": runs["split_gain"].min(),
                "mean_split_gain": runs["split_gain"].mean(),
                "min_reward_rise": runs["reward_rise"].min(),
                "learns": learns,
                "mean_cpu_s": runs["cpu_s"].mean(),
            }
        )
    table = pd.DataFrame(verdicts)
    learning = table[table["learns"] & (table["lever"] != EXTENSION)]
    chosen = None
    if len(learning):
        chosen = learning.sort_values("mean_cpu_s").iloc[0]["lever"]
        words = f"The rule picks **{chosen}**: the cheapest lever in which GRPO learns from every start."
    elif EXTENSION not in levers:
        words = (
            f"No lever learns: the declared extension ({_change_words(rule.extension)}) is to be run from the "
            "same starts."
        )
    elif table.set_index("lever").loc[EXTENSION, "learns"]:
        chosen = EXTENSION
        words = (
            f"No lever of the map learns; the extension ({_change_words(rule.extension)}) does: the family runs there."
        )
    else:
        best = table.sort_values("min_split_gain", ascending=False).iloc[0]
        chosen = best["lever"]
        words = (
            f"Neither the map nor its extension learns: the family runs at **{best['lever']}**, whose smallest "
            f"split_gain over the starts is the largest ({best['min_split_gain']:+.3f}); every verdict there is "
            "labelled with the baseline's gain."
        )
    return table.assign(chosen=table["lever"] == chosen), words


def regime(table: pd.DataFrame, rule: MapRule = MAP_RULE) -> dict[str, Any] | None:
    """The setting the rule chose for the family (`apply_rule`'s `chosen` lever), as regime.json holds it: the lever,
    whether GRPO learns there, its smallest split_gain and the run overrides that make it (every setting the rule
    reads, the centre's included, so the family's command needs nothing else); None while the extension is to run."""
    chosen = table[table["chosen"]]
    if chosen.empty:
        return None
    row = chosen.iloc[0]
    setting = {**rule.centre, **({**rule.levers, EXTENSION: rule.extension}[row["lever"]])}
    keys = {name: key for key, name in SETTINGS.items()}
    return {
        "lever": row["lever"],
        "learns": bool(row["learns"]),
        "smallest_split_gain": round(float(row["min_split_gain"]), 6),
        "overrides": [f"{keys[name]}={value:g}" for name, value in setting.items()],
    }


def _change_words(change: dict[str, Any]) -> str:
    return ", ".join(f"{key} {value:g}" for key, value in change.items())


def rule_report(table: pd.DataFrame, words: str, rule: MapRule = MAP_RULE) -> str:
    """rule.md: the rule in one line, the table per lever and the verdict."""
    lines = [
        f"The rule: GRPO's split_gain ≥ {rule.min_split_gain:+.2f} and training-reward rise ≥ "
        f"{rule.min_reward_rise:+.2f} on each of {rule.starts} starts of {' and '.join(rule.rungs)}.",
        "",
        "| lever | runs | smallest split_gain | mean split_gain | smallest reward rise | learns | mean CPU s |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in table.itertuples():
        lines.append(
            f"| {row.lever} | {row.runs} | {row.min_split_gain:+.3f} | {row.mean_split_gain:+.3f} | "
            f"{row.min_reward_rise:+.3f} | {'yes' if row.learns else 'no'} | {row.mean_cpu_s:.0f} |"
        )
    return "\n".join([*lines, "", words]) + "\n"


def arguments(parser: argparse.ArgumentParser) -> None:
    """The runs and where the table goes."""
    parser.add_argument("paths", nargs="+", help="run or sweep directories, searched recursively")
    parser.add_argument("--out", type=Path, required=True, help="the folder runs.csv and table.md go to")
    parser.add_argument(
        "--rule",
        action="store_true",
        help="apply the learnability map's pre-registered rule and write rule.md beside the table",
    )


def read(args: argparse.Namespace) -> pd.DataFrame:
    """Every run's row; the output folder proved writable."""
    rows = run_rows(args.paths)
    if args.rule:
        apply_rule(rows)  # refused here, before anything is written, when the map lacks what the rule reads
    writable_out(args.out)
    return rows


def write(rows: pd.DataFrame, args: argparse.Namespace, command: str) -> str:
    """runs.csv and table.md (the command that made them at its head); the line saying where."""
    rows.to_csv(args.out / "runs.csv", index=False, float_format="%.6g")
    (args.out / "table.md").write_text(f"Made with `{command}`.\n\n" + table(rows), encoding="utf-8")
    if not args.rule:
        return f"table: {args.out / 'table.md'} ({len(rows)} runs)"
    verdicts, words = apply_rule(rows)
    (args.out / "rule.md").write_text(f"Made with `{command}`.\n\n" + rule_report(verdicts, words), encoding="utf-8")
    chosen = regime(verdicts)
    if chosen is not None:
        (args.out / REGIME_FILE).write_text(json.dumps({"made_with": command, **chosen}, indent=2) + "\n")
    return f"table: {args.out / 'table.md'} ({len(rows)} runs); rule: {args.out / 'rule.md'}: {words}"


main = Command("analysis.learnability", __doc__, arguments, read, write).main

if __name__ == "__main__":
    main()
