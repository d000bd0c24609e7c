"""`python -m analysis.regimes`: one table of every regime a search tried, so the search itself is evidence.

    python -m analysis.regimes SWEEP_DIR... [--out docs/regimes.md] [--title TEXT]

A regime is the setting of every config key that differs between the runs read (seeds, logging, paths and the arm
aside); an arm is the objective with its own settings and the Routing Replay mode. Each (search, regime, arm) row
gives its seeds, the held-out greedy accuracy at the start and the end of each seed, how many seeds collapsed
(`analysis.summaries.collapse_flag` on the training reward), the drift after one update and the training–inference
mismatch (mean over steps), and a verdict: `collapsed k/n` when a seed collapsed, else `improves` / `declines` when
every seed ends above / below where it started on held-out prompts, else `mixed`.

A run that did not evaluate its start (`trainer.eval_start`, logged since 2026-12) borrows the greedy start of a
run from the same checkpoint and held-out prompts: greedy decoding of one checkpoint does not depend on the seed.
Borrowed starts are marked `*`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from analysis.cli import Command
from analysis.configs import ignored_key, schema_defaults, short_key
from analysis.load import load_runs
from analysis.records import RunSet, runs_of
from analysis.summaries import collapse_flag
from analysis.tables import markdown_table, num
from experiments.step.metrics import DRIFT_PER_UPDATE, EVAL_GREEDY, MISMATCH_K3, REWARD

# what makes an arm (the label's base), never a regime's knob
_ARM_PREFIXES = ("algo.", "routing.replay")
# what fixes a greedy evaluation: the checkpoint, the task and its held-out prompts, the generation budget
_EVAL_KEYS = ("model.path", "model.name", "dataset.name", "trainer.eval_prompts", "trainer.max_new_tokens")


@dataclass
class RunOutcome:
    search: str
    arm: str
    seed: str
    config: dict[str, Any]
    start: float | None
    start_borrowed: bool
    end: float | None
    collapsed: bool | None
    drift: float | None
    mismatch: float | None


def _mean_metric(runset: RunSet, run: str, metric: str) -> float | None:
    rows = runset.metric(metric)
    values = rows.loc[rows["run"] == run, "value"]
    return float(values.mean()) if len(values) else None


def outcomes(directories: Sequence[Path]) -> list[RunOutcome]:
    """One `RunOutcome` per run found under each directory (each directory is one search)."""
    found: list[RunOutcome] = []
    for directory in directories:
        runset = load_runs([directory])
        defaults = schema_defaults()
        greedy = runset.metric(EVAL_GREEDY)
        reward = runset.metric(REWARD)
        for row in runs_of(runset.runs):
            config = defaults | json.loads(row.config)
            arm = row.algo if row.replay == "none" else f"{row.algo} + {row.replay}"
            arm_settings = sorted(k for k in config if k.startswith("algo.") and k != "algo.name")
            evals = greedy[greedy["run"] == row.run].sort_values("step")
            start = evals.loc[evals["step"] == 0, "value"]
            trained = evals[evals["step"] > 0]
            rewards = reward[reward["run"] == row.run].sort_values("step")["value"].to_numpy()
            found.append(
                RunOutcome(
                    search=directory.name,
                    arm=arm,
                    seed=row.seed,
                    config=config | {"_arm_settings": json.dumps({k: config[k] for k in arm_settings}, default=str)},
                    start=float(start.iloc[0]) if len(start) else None,
                    start_borrowed=False,
                    end=float(trained["value"].iloc[-1]) if len(trained) else None,
                    collapsed=collapse_flag(rewards) if len(rewards) else None,
                    drift=_mean_metric(runset, row.run, DRIFT_PER_UPDATE),
                    mismatch=_mean_metric(runset, row.run, MISMATCH_K3),
                )
            )
    _borrow_starts(found)
    return found


def _borrow_starts(found: list[RunOutcome]) -> None:
    known: dict[str, float] = {}
    for run in found:
        if run.start is not None:
            known.setdefault(_eval_key(run), run.start)
    for run in found:
        if run.start is None and _eval_key(run) in known:
            run.start, run.start_borrowed = known[_eval_key(run)], True


def _eval_key(run: RunOutcome) -> str:
    return json.dumps([run.config.get(k) for k in _EVAL_KEYS], default=str)


def knobs(found: list[RunOutcome]) -> list[str]:
    """The config keys that differ between the runs: a regime is their setting. A key whose value follows from a
    key already named (`model.path` and `model.num_hidden_layers` from `model.name`) is left out: it says nothing
    more. Names (`*.name`) are tried first, so they are the ones kept."""

    def value(run: RunOutcome, k: str) -> str:
        return json.dumps(run.config.get(k), default=str)

    keys = sorted({k for run in found for k in run.config})
    varying = [
        k
        for k in keys
        if not ignored_key(k)
        and not k.startswith(_ARM_PREFIXES)
        and not k.startswith("_")
        and len({value(run, k) for run in found}) > 1
    ]
    kept: list[str] = []
    for k in sorted(varying, key=lambda k: (not k.endswith(".name"), varying.index(k))):
        implied = any(
            len({(value(run, j), value(run, k)) for run in found}) == len({value(run, j) for run in found})
            for j in kept
        )
        if not implied:
            kept.append(k)
    return [k for k in varying if k in kept]


def verdict(runs: list[RunOutcome]) -> str:
    evaluated = [r.collapsed for r in runs if r.collapsed is not None]
    if any(evaluated):
        return f"collapsed {sum(evaluated)}/{len(evaluated)}"
    measured = [(r.start, r.end) for r in runs if r.start is not None and r.end is not None]
    if len(measured) < len(runs):  # a run without its start or its end
        return "–"
    if all(end > start for start, end in measured):
        return "improves"
    if all(end < start for start, end in measured):
        return "declines"
    return "mixed"


def _arm_name(run: RunOutcome, found: list[RunOutcome]) -> str:
    """The arm, with the objective's settings that differ from other runs of the same objective."""
    same = [r for r in found if r.arm == run.arm]
    settings = json.loads(run.config["_arm_settings"])
    differing = [k for k in settings if len({json.dumps(r.config.get(k), default=str) for r in same}) > 1]
    return ", ".join([run.arm] + [f"{k.split('.', 1)[1]}={settings[k]}" for k in differing])


def regimes_table(found: list[RunOutcome]) -> str:
    keys = knobs(found)
    all_keys = sorted({k for run in found for k in run.config})
    groups: dict[tuple[str, tuple[str, ...], str], list[RunOutcome]] = {}
    for run in found:
        regime = tuple(f"{short_key(k, all_keys)}={run.config.get(k, '–')}" for k in keys)
        groups.setdefault((run.search, regime, _arm_name(run, found)), []).append(run)
    rows = []
    for (search, regime, arm), runs in groups.items():
        runs.sort(key=lambda r: r.seed)
        per_seed = ", ".join(
            f"{num(r.start, '.2f')}{'*' if r.start_borrowed else ''}→{num(r.end, '.2f')}" for r in runs
        )

        def mean(field: str, runs: list[RunOutcome] = runs) -> float | None:
            values = [getattr(r, field) for r in runs if getattr(r, field) is not None]
            return float(np.mean(values)) if values else None

        rows.append(
            [
                search,
                ", ".join(regime) or "–",
                arm,
                ",".join(r.seed for r in runs),
                per_seed,
                num(mean("drift"), ".2%") if mean("drift") is not None else "–",
                num(mean("mismatch"), ".3g"),
                verdict(runs),
            ]
        )
    header = [
        "search",
        "regime",
        "arm",
        "seeds",
        "held-out greedy start→end per seed",
        "drift after one update",
        "mismatch k3",
        "verdict",
    ]
    return markdown_table(header, rows)


def arguments(parser: argparse.ArgumentParser) -> None:
    """The searches (a sweep directory each), where the table goes and its heading."""
    parser.add_argument("directories", nargs="+", type=Path, help="sweep directories, one search each")
    parser.add_argument("--out", type=Path, help="write the markdown here (default: print it)")
    parser.add_argument("--title", default="Regimes tried", help="the heading above the table")


def read(args: argparse.Namespace) -> list[RunOutcome]:
    """Every run's outcome under the searches; a path that is not a directory is refused."""
    missing = [str(d) for d in args.directories if not d.is_dir()]
    if missing:
        raise ValueError(f"not a directory: {', '.join(missing)}")
    return outcomes(args.directories)


def write(found: list[RunOutcome], args: argparse.Namespace, command: str) -> str:
    """The table, into `--out` (the line saying where) or as what is printed. It names the searches it was made from,
    not where it was written."""
    made_by = "python -m analysis.regimes " + " ".join(str(d) for d in args.directories)
    text = (
        f"# {args.title}\n\nMade by `{made_by}`. Starts marked * are borrowed from a run of the same checkpoint "
        f"and held-out prompts (greedy decoding does not depend on the seed).\n\n{regimes_table(found)}"
    )
    if not args.out:
        return text
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n", encoding="utf-8")
    return f"regimes: {args.out}"


main = Command("analysis.regimes", __doc__, arguments, read, write).main

if __name__ == "__main__":
    main()
