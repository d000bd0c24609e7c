"""The runs as the analysis reads them, whatever their source: one `RunSet` of long frames, built from the records a
run logged (a local metrics.jsonl line, a W&B history row) by the same code for both.

- `runs`: one row per run (id, label, algorithm, replay mode, seed, status, the start's sha256, ...);
- `scalars`: long frame `[run, step, metric, value]`, one row per logged step-level scalar;
- `minibatches`: long frame `[run, step, minibatch, metric, value]` from the per-minibatch records, where
  `minibatch` is the number of optimizer updates since θ_old;
- `unstarted`: the jobs that logged nothing (`[where, seed, config, why]`): a sweep's job directory without
  `metrics.jsonl` (a job refused before its first step), or a W&B run without history. A report names them among
  the seeds it left out.

A run's status is how it ended: the summary's `finished`, `diverged`, `interrupted` or `failed`, or `INCOMPLETE`
without one; a run that did not finish is kept up to its last valid record and marked incomplete. Every problem met
while reading is kept (`RunSet.problems`) and printed as a warning on stderr.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import pandas as pd

from analysis.configs import format_value, ignored_key, label_runs
from analysis.style import ALGO_ORDER, REPLAY_ORDER
from experiments.run.logger import WANDB_MINIBATCH
from experiments.step.metrics import MINIBATCH, MINIBATCHES, STEP, TOKENS, unstarted

SCALAR_COLUMNS = ["run", "step", "metric", "value"]
MINIBATCH_COLUMNS = ["run", "step", "minibatch", "metric", "value"]
RUN_COLUMNS = [
    "run",
    "label",
    "algo",
    "replay",
    "seed",
    "model",
    "num_layers",
    "status",
    "incomplete",
    "last_step",
    "wall_s",
    "start_sha256",
    "start_recipe",
    "source",
    "config",
]
UNSTARTED_COLUMNS = ["where", "seed", "config", "why"]
FINISHED = "finished"  # the status of a run that ran every planned step (its summary.json says so)
INCOMPLETE = "incomplete (crashed or still running)"  # the status of a run without summary.json
UNKNOWN_START = ""  # the start_sha256 of a run whose summary does not name its start (none yet, or written before)
UNKNOWN_RECIPE = ""  # the start_recipe of a run whose summary does not hold its start's (experiments.run.recipe)
_WANDB_MINIBATCH_KEY = re.compile("^" + re.escape(WANDB_MINIBATCH) + r"(\d+)/(.+)$")


class RunRow(Protocol):
    """One row of `RunSet.runs` (`RUN_COLUMNS`, as `run_row` and `finish` write them), read by column name."""

    run: str
    label: str
    algo: str
    replay: str
    seed: str  # as the config names it; "" where it names none
    model: str
    num_layers: float  # NaN where the config names none
    status: str
    incomplete: bool
    last_step: int
    wall_s: float
    start_sha256: str
    start_recipe: str
    source: str
    config: str  # the flat config, as JSON


class UnstartedRow(Protocol):
    """One row of `RunSet.unstarted` (`UNSTARTED_COLUMNS`, as `unstarted_row` writes them)."""

    where: str
    seed: str
    config: str  # the flat config, as JSON; "" where the job left none
    why: str


def runs_of(runs: pd.DataFrame) -> Iterable[RunRow]:
    """`runs.itertuples()` with the cells' types: pandas types a row's cells as any scalar, whatever its column."""
    return cast(Iterable[RunRow], runs.itertuples())


def unstarted_of(unstarted: pd.DataFrame) -> Iterable[UnstartedRow]:
    """`unstarted.itertuples()` with the cells' types (`runs_of`)."""
    return cast(Iterable[UnstartedRow], unstarted.itertuples())


def cell_at(frame: pd.DataFrame, row: Hashable, column: str) -> Any:
    """`frame.at[row, column]`, typed as what its column holds (Any): pandas types a cell as any scalar."""
    return frame.at[row, column]


def rows_as_dicts(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """`frame.to_dict("records")`, keyed by column name: every frame here names its columns with text, which pandas
    types as any hashable."""
    return cast(list[dict[str, Any]], frame.to_dict("records"))


def run_configs(runs: pd.DataFrame) -> dict[str, dict[str, Any]]:
    """Each run's flat config by run name, from a `RunSet.runs` frame."""
    return {row.run: json.loads(row.config) for row in runs_of(runs)}


@dataclass
class RunSet:
    """Everything the report needs, in long frames (see the module docstring for the columns)."""

    runs: pd.DataFrame
    scalars: pd.DataFrame
    minibatches: pd.DataFrame
    source: str
    problems: list[str] = field(default_factory=list)
    unstarted: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=UNSTARTED_COLUMNS))

    @property
    def labels(self) -> list[str]:
        """Series labels in display order: catalogue algorithm order, then replay mode, then name."""
        table = self.runs.drop_duplicates("label")
        return [row["label"] for _, row in sorted(table.iterrows(), key=lambda item: _label_sort_key(item[1]))]

    def has(self, metric: str) -> bool:
        return bool((self.scalars["metric"] == metric).any())

    def metric(self, metric: str) -> pd.DataFrame:
        """Rows of one step-level metric with the run's label: columns `[run, label, step, value]`."""
        rows = self.scalars.loc[self.scalars["metric"] == metric, ["run", "step", "value"]]
        return rows.merge(self.runs[["run", "label"]], on="run")[["run", "label", "step", "value"]]

    def labels_without(self, metric: str) -> list[str]:
        """Labels none of whose runs logged `metric` (used to say which panels are left out and why)."""
        have = set(self.metric(metric)["label"])
        return [lab for lab in self.labels if lab not in have]


def _label_sort_key(row: pd.Series) -> tuple[int, str, int, str]:
    algo_rank = ALGO_ORDER.index(row["algo"]) if row["algo"] in ALGO_ORDER else len(ALGO_ORDER)
    replay_rank = REPLAY_ORDER.index(row["replay"]) if row["replay"] in REPLAY_ORDER else len(REPLAY_ORDER)
    return (algo_rank, row["algo"], replay_rank, row["label"])


def warn(problems: list[str], message: str) -> None:
    """Keep `message` among the run set's problems and print it as a warning on stderr."""
    problems.append(message)
    print(f"warning: {message}", file=sys.stderr)


def _as_float(value: Any) -> float | None:
    """Numbers and booleans as float; anything else (strings, media, nested objects) is not a metric."""
    if isinstance(value, (bool, int, float)):
        return float(value)
    return None


_NUMERIC_TYPES = frozenset((int, float, bool))


@dataclass
class RecordRows:
    """Wide records, one dict per step and per (step, minibatch), turned into long frames once at the end.

    Keeping the identifiers in separate lists means a metric can never collide with the `run`/`step` columns.
    The training loop writes NaN/inf as JSON null (JSON has neither), so in local files a null counts as a
    non-finite value; W&B rows may carry nulls for keys not logged at that step, so there it does not.
    """

    nulls_are_non_finite: bool

    step_ids: list[tuple[str, int]] = field(default_factory=list)
    step_values: list[dict[str, Any]] = field(default_factory=list)
    minibatch_ids: list[tuple[str, int, int]] = field(default_factory=list)
    minibatch_values: list[dict[str, Any]] = field(default_factory=list)
    non_finite: int = 0

    def _numbers(self, values: Mapping[str, Any]) -> dict[str, Any]:
        numeric = {k: v for k, v in values.items() if type(v) in _NUMERIC_TYPES}
        finite = {k: v for k, v in numeric.items() if math.isfinite(v)}
        self.non_finite += len(numeric) - len(finite)
        if self.nulls_are_non_finite:
            self.non_finite += sum(v is None for v in values.values())
        return finite

    def add_step(self, run: str, step: int, values: Mapping[str, Any]) -> None:
        self.step_ids.append((run, step))
        self.step_values.append(self._numbers(values))

    def add_minibatch(self, run: str, step: int, index: int, values: Mapping[str, Any]) -> None:
        self.minibatch_ids.append((run, step, index))
        self.minibatch_values.append(self._numbers(values))


def step_of(record: Mapping[str, Any]) -> int | None:
    """A record's integer RL step, or None where it has none (a truncated or foreign line)."""
    step = record.get(STEP)
    if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step):
        return None
    if float(step) != int(step):
        return None
    return int(step)


def add_record(rows: RecordRows, run: str, step: int, record: Mapping[str, Any]) -> int:
    """Add one step's record (local `minibatches` list or W&B `minibatch/<j>/<name>` keys).

    Returns how many per-minibatch entries were unusable (no integer `minibatch` index).
    """
    scalars: dict[str, Any] = {}
    start: dict[str, Any] = {}
    per_minibatch: dict[int, dict[str, Any]] = {}
    for key, value in record.items():
        if key.startswith(WANDB_MINIBATCH):
            match = _WANDB_MINIBATCH_KEY.match(key)
            if match:
                per_minibatch.setdefault(int(match.group(1)), {})[match.group(2)] = value
        elif (setting := unstarted(key)) is not None:
            start[setting] = value
        elif key not in (MINIBATCHES, STEP) and not key.startswith("_"):
            scalars[key] = value
    entries = record.get(MINIBATCHES, [])
    bad = 0
    for entry in entries if isinstance(entries, list) else [entries]:
        index = entry.get(MINIBATCH) if isinstance(entry, Mapping) else None
        if type(index) is not int:
            bad += 1
            continue
        per_minibatch.setdefault(index, {}).update({k: v for k, v in entry.items() if k != MINIBATCH})
    rows.add_step(run, step, scalars)
    if start:  # the starting policy's evaluation: the eval curves' point at step 0, before any token was trained on
        rows.add_step(run, 0, {**start, TOKENS: 0})
    for index, values in per_minibatch.items():
        rows.add_minibatch(run, step, index, values)
    return bad


def _long(
    ids: list[tuple[str, int]] | list[tuple[str, int, int]], values: list[dict[str, Any]], id_columns: list[str]
) -> pd.DataFrame:
    """Wide records → long `[*id_columns, metric, value]`; a value logged twice for the same ids keeps the last."""
    wide = pd.DataFrame.from_records(values, index=range(len(values))).astype("float64")
    wide = pd.concat([pd.DataFrame(ids, columns=id_columns), wide], axis=1)
    long = wide.melt(id_vars=id_columns, var_name="metric", value_name="value").dropna(subset=["value"])
    long = long.drop_duplicates([*id_columns, "metric"], keep="last")
    long = long.astype({c: "int64" for c in id_columns if c != "run"} | {"run": str, "metric": str})
    return long.sort_values([*id_columns, "metric"], kind="stable").reset_index(drop=True)


def frames(rows: RecordRows) -> tuple[pd.DataFrame, pd.DataFrame, int]:
    """Long scalar and minibatch frames, and how many step-level values were logged twice for the same step."""
    seen = sum(len(v) for v in rows.step_values)
    scalars = _long(rows.step_ids, rows.step_values, ["run", "step"])
    minibatches = _long(rows.minibatch_ids, rows.minibatch_values, ["run", "step", "minibatch"])
    return scalars[SCALAR_COLUMNS], minibatches[MINIBATCH_COLUMNS], seen - len(scalars)


def run_row(
    run: str, cfg: Mapping[str, Any], status: str, wall_s: float, start_sha256: str, start_recipe: str, source: str
) -> dict[str, Any]:
    """One row of `RunSet.runs` (without its label and last step, which `finish` adds)."""
    seed = cfg.get("seed")
    layers = cfg.get("model.num_hidden_layers")
    return {
        "run": run,
        "algo": str(cfg.get("algo.name", "unknown")),
        "replay": str(cfg.get("routing.replay", "none")),
        "seed": format_value(seed) if seed is not None else "",
        "model": str(cfg.get("model.name", "")),
        "num_layers": float(layers) if isinstance(layers, (int, float)) and not isinstance(layers, bool) else math.nan,
        "status": status,
        "incomplete": status != FINISHED,
        "wall_s": wall_s,
        "start_sha256": start_sha256,
        "start_recipe": start_recipe,
        "source": source,
        "config": json.dumps(cfg, sort_keys=True, default=str),
    }


def finish(
    run_rows: list[dict[str, Any]],
    scalars: pd.DataFrame,
    minibatches: pd.DataFrame,
    source: str,
    problems: list[str],
    unstarted: Sequence[dict[str, Any]] = (),
) -> RunSet:
    """Attach labels and last steps; runs of one experiment, start and seed (a crashed run and its rerun) count once."""
    runs = pd.DataFrame(run_rows)
    last = scalars.groupby("run")["step"].max()
    runs["last_step"] = runs["run"].map(last).fillna(0).astype("int64")
    kept = _without_repeats(runs, problems)
    runs = runs[runs["run"].isin(kept)].reset_index(drop=True)
    scalars = scalars[scalars["run"].isin(kept)].reset_index(drop=True)
    minibatches = minibatches[minibatches["run"].isin(kept)].reset_index(drop=True)
    configs = run_configs(runs)
    runs["label"] = runs["run"].map(label_runs(configs))
    runs = runs[RUN_COLUMNS].reset_index(drop=True)
    return RunSet(
        runs=runs,
        scalars=scalars,
        minibatches=minibatches,
        source=source,
        problems=problems,
        unstarted=pd.DataFrame(list(unstarted), columns=UNSTARTED_COLUMNS),
    )


def _without_repeats(runs: pd.DataFrame, problems: list[str]) -> set[str]:
    """The runs to count: of runs with the same experiment, start and seed, the finished one with the most steps
    (else the one with the most steps); each left out is reported, never averaged in as another replicate. Runs of
    one experiment and seed from different starts (their summaries name two sha256) are not repeats; a run that
    names no start (it crashed before its summary) repeats the one that does."""

    def experiment(config: str) -> str:
        flat = {k: v for k, v in json.loads(config).items() if not ignored_key(k) or k == "seed"}
        return json.dumps(flat, sort_keys=True, default=str)

    kept = set()
    for _, group in runs.groupby(runs["config"].map(experiment), sort=False):
        ranked = group.sort_values(["incomplete", "last_step"], ascending=[True, False], kind="stable")
        starts = [start for start in dict.fromkeys(ranked["start_sha256"]) if start != UNKNOWN_START]
        for i, start in enumerate(starts or [UNKNOWN_START]):
            own = ranked[ranked["start_sha256"] == start]
            best, repeats = own.iloc[0], own.iloc[1:]
            kept.add(best["run"])
            if i == 0 and start != UNKNOWN_START:  # the runs that name no start repeat the best one that does
                repeats = pd.concat([repeats, ranked[ranked["start_sha256"] == UNKNOWN_START]])
            for other in repeats.itertuples():
                warn(
                    problems,
                    f"run {other.run} repeats run {best['run']} (same config and seed "
                    f"{best['seed'] or '?'}); only {best['run']} ({best['status']}, {best['last_step']} "
                    f"steps) is counted, not {other.run} ({other.status}, {other.last_step} steps)",
                )
    return kept


def unstarted_row(where: str, flat: Mapping[str, Any], why: str) -> dict[str, Any]:
    """One row of `RunSet.unstarted`: where the job was, its seed and config, and why it logged nothing."""
    seed = flat.get("seed")
    return {
        "where": where,
        "seed": format_value(seed) if seed is not None else "",
        "config": json.dumps(dict(flat), sort_keys=True, default=str) if flat else "",
        "why": why,
    }


def summary_fields(summary: Mapping[str, Any]) -> tuple[str, float, str, str]:
    """How a run ended, its wall time, its start's sha256 and its start's recipe (sorted JSON of the cold start's
    settings), from its summary (`INCOMPLETE`, NaN, `UNKNOWN_START` and `UNKNOWN_RECIPE` where it does not say)."""
    status = summary.get("status")
    wall = _as_float(summary.get("wall_s"))
    start = summary.get("start_sha256")
    recipe = summary.get("start_recipe")
    return (
        str(status) if isinstance(status, str) and status else INCOMPLETE,
        wall if wall is not None else math.nan,
        start if isinstance(start, str) else UNKNOWN_START,
        json.dumps(recipe, sort_keys=True, default=str) if isinstance(recipe, dict) else UNKNOWN_RECIPE,
    )


def note_dropped(problems: list[str], non_finite: int, repeated: int) -> None:
    """Say how many values reading left out: non-finite ones, and ones logged twice for a step."""
    if non_finite:
        warn(
            problems,
            f"{non_finite} non-finite metric values (NaN/inf, or null in metrics.jsonl) left out of the "
            "figures and tables",
        )
    if repeated:
        warn(problems, f"{repeated} metric values logged twice for the same step; the last one is used")
