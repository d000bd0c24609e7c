"""Find runs (local directories or W&B) and read them into long pandas frames.

A local run is the training loop's Hydra output directory (`experiments.run.rundir`): it holds
`.hydra/config.yaml` (the resolved config) and `metrics.jsonl` (one JSON object per RL step, flushed each step),
plus `summary.json` once the run finished. A Hydra multirun sweep directory holds one such directory per job, so
runs are found recursively. A W&B run carries the same flat keys in its history, with per-minibatch values
flattened as `minibatch/<j>/<name>`, and the resolved config as `run.config`.

Both sources end in one `RunSet`:
- `runs`: one row per run (id, label, algorithm, replay mode, seed, status, the start's sha256, ...);
- `scalars`: long frame `[run, step, metric, value]`, one row per logged step-level scalar;
- `minibatches`: long frame `[run, step, minibatch, metric, value]` from the per-minibatch records, where
  `minibatch` is the number of optimizer updates since θ_old;
- `unstarted`: the jobs that logged nothing (`[where, seed, config, why]`): a sweep's job directory without
  `metrics.jsonl` (a job refused before its first step), or a W&B run without history. A report names them among
  the seeds it left out.

Series are "grouped by what differs": the label of a run names its algorithm, its replay mode when not `none`,
and every other config key that separates runs which would otherwise share a label (seeds are not such a key:
runs that differ only in seed, paths or logging are the seeds of one series). Reading never stops at bad data:
a malformed line is reported as `file:line` on stderr and skipped; a run without `summary.json` is kept up to its
last valid line and marked incomplete, with how it ended (`status`: the summary's `diverged`, `interrupted` or
`failed`, or `INCOMPLETE` without one).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from analysis.style import ALGO_ORDER, REPLAY_ORDER
from experiments.run.logger import WANDB_MINIBATCH
from experiments.run.resume import node_recorded, retired_as_today
from experiments.run.rundir import LOCK_FILE, METRICS_FILE, SUMMARY_FILE
from experiments.step.metrics import MINIBATCH, MINIBATCHES, STEP, TOKENS, unstarted

CONFIG_FILE = Path(".hydra") / "config.yaml"
MULTIRUN_FILE = "multirun.yaml"  # what Hydra writes at the top of a sweep directory, beside its jobs

SCALAR_COLUMNS = ["run", "step", "metric", "value"]
MINIBATCH_COLUMNS = ["run", "step", "minibatch", "metric", "value"]
RUN_COLUMNS = [
    "run", "label", "algo", "replay", "seed", "model", "num_layers", "status", "incomplete",
    "last_step", "wall_s", "start_sha256", "source", "config",
]
UNSTARTED_COLUMNS = ["where", "seed", "config", "why"]
FINISHED = "finished"  # the status of a run that ran every planned step (its summary.json says so)
INCOMPLETE = "incomplete (crashed or still running)"  # the status of a run without summary.json
UNKNOWN_START = ""  # the start_sha256 of a run whose summary does not name its start (none yet, or written before)

# Config keys that never separate series: seeds are aggregated; logging, threads, checkpointing and the comparison an
# experiment declares (how its report decides) do not change what a run computes. Everything else does (a checkpoint
# path, a data file), so runs that differ there are never merged.
_IGNORED_PREFIXES = ("hydra.", "logger.", "wandb.", "comparison.")
_IGNORED_KEYS = frozenset({"seed", "trainer.threads", "trainer.save_checkpoint", "trainer.checkpoint_every",
                           "trainer.keep_checkpoints", "resume"})
_OUTPUT_LEAF = re.compile(r"^(.*_dir|dir|output.*)$")  # where results go, never what they are computed from
_WANDB_MINIBATCH_KEY = re.compile("^" + re.escape(WANDB_MINIBATCH) + r"(\d+)/(.+)$")


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


def _label_sort_key(row: pd.Series) -> tuple:
    algo_rank = ALGO_ORDER.index(row["algo"]) if row["algo"] in ALGO_ORDER else len(ALGO_ORDER)
    replay_rank = REPLAY_ORDER.index(row["replay"]) if row["replay"] in REPLAY_ORDER else len(REPLAY_ORDER)
    return (algo_rank, row["algo"], replay_rank, row["label"])


def _warn(problems: list[str], message: str) -> None:
    problems.append(message)
    print(f"warning: {message}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------------------------
# Configs and labels
# ---------------------------------------------------------------------------------------------------------------

def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config → `{"a.b.c": value}`. Lists become their JSON text so that values stay comparable."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_config(value, prefix=f"{name}."))
        elif isinstance(value, (list, tuple)):
            flat[name] = json.dumps(value, sort_keys=True, default=str)
        else:
            flat[name] = value
    return flat


def schema_defaults() -> dict[str, Any]:
    """Today's default of every key of the typed schema, flat, for configs written before the key existed."""
    from omegaconf import OmegaConf

    from experiments.config import TrainConfig

    flat = flatten_config(OmegaConf.to_container(OmegaConf.structured(TrainConfig), throw_on_missing=False))
    return {k: v for k, v in flat.items() if v != "???"}


def as_today(flat: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """A recorded flat config in today's keys, by the rules resume applies (`experiments.run.resume`): every setting
    added to one of its nodes since it was written, at the schema's default (what the run computed with), and every
    setting retired since dropped where it holds the value that means what today's config does without it
    (`RETIRED`). Without this, a field added or retired between two parts of a sweep splits its series by the
    key's absence alone."""
    added = {key: value for key, value in defaults.items() if key not in flat and node_recorded(flat, key)}
    kept = {key: value for key, value in flat.items() if not retired_as_today(key, value)}
    return {**kept, **added}


def ignored_key(key: str) -> bool:
    """Keys that say where a run writes or how it runs (seeds, threads, logging), never what it computes."""
    return key.startswith(_IGNORED_PREFIXES) or key in _IGNORED_KEYS or bool(_OUTPUT_LEAF.match(key.rsplit(".", 1)[-1]))


def _short_key(key: str, all_keys: Iterable[str]) -> str:
    """Shortest dotted suffix of `key` that no other key ends with (`trainer.lr` → `lr` unless `optim.lr` exists)."""
    parts = key.split(".")
    others = [k for k in all_keys if k != key]
    for n in range(1, len(parts) + 1):
        suffix = ".".join(parts[-n:])
        if not any(k == suffix or k.endswith("." + suffix) for k in others):
            return suffix
    return key


def _format_value(value: Any, key: str = "") -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if key.endswith("path") and isinstance(value, str) and "/" in value:
        return Path(value).name  # a start's own directory name: the same on every machine, unlike where it lives
    return str(value)


FLIP_RATE = "routing.flip_rate"  # the config key of the SYNTHETIC flips (models/routing.py): named in every label
PERTURB_RATE = "routing.perturb_rate"  # the SYNTHETIC router noise's (models/routing/perturbation.py): likewise
SYNTHETIC_KEYS = {FLIP_RATE: "SYNTHETIC flips", PERTURB_RATE: "SYNTHETIC router noise"}  # key: what a label calls it


def label_runs(configs: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """Readable series label per run from its flattened config.

    The base is `algo.name`, plus ` + <routing.replay>` when replay is not `none`, ` + <routing_variant.name>`
    when a routing variant is on (a run without the key ran without one), ` + <switch>` per router switch on,
    ` + SYNTHETIC flips p=<p>` when `routing.flip_rate` is not 0 and ` + SYNTHETIC router noise p=<p>` when
    `routing.perturb_rate` is not 0. Then, in sorted key order, every
    config key that differs between runs (ignoring seeds, threads, checkpointing, output dirs, logger/W&B/Hydra
    keys; a checkpoint or data path does count, shown by its last part: a start's directory name) and still
    splits runs sharing a label so far is appended to all labels as `key=value`, with the shortest unambiguous
    key suffix. Keys that only restate the algorithm (its clip range, say) therefore never clutter a label.
    """
    labels = {run: _base_label(cfg) for run, cfg in configs.items()}
    all_keys = sorted({k for cfg in configs.values() for k in cfg})
    candidates = [
        k for k in all_keys
        if k not in ("algo.name", "routing.replay", "routing_variant.name", *SYNTHETIC_KEYS) and not ignored_key(k)
        and len({_format_value(cfg.get(k, "—"), k) for cfg in configs.values()}) > 1
    ]
    for key in candidates:
        groups: dict[str, set[str]] = {}
        for run, cfg in configs.items():
            groups.setdefault(labels[run], set()).add(_format_value(cfg.get(key, "—"), key))
        if any(len(values) > 1 for values in groups.values()):
            short = _short_key(key, all_keys)
            labels = {
                run: f"{labels[run]}, {short}={_format_value(configs[run].get(key, '—'), key)}" for run in configs
            }
    return labels


def method_name(cfg: Mapping[str, Any]) -> str:
    """The objective, then ` + <routing.replay>` and ` + <routing_variant.name>` where they are on (a run from before
    variants existed ran without one), then ` + <switch>` for each router switch on (`routers.<switch>.name`): what a
    series and an arm are named by first."""
    name = str(cfg.get("algo.name", "unknown"))
    for key in ("routing.replay", "routing_variant.name"):
        if str(cfg.get(key, "none")) != "none":
            name += f" + {cfg[key]}"
    return name + "".join(f" + {cfg[key]}" for key in cfg if key.startswith("routers.") and key.endswith(".name"))


def _base_label(cfg: Mapping[str, Any]) -> str:
    label = method_name(cfg)
    for key, called in SYNTHETIC_KEYS.items():  # an intervention, never to be read as a natural regime
        if float(cfg.get(key, 0.0)):
            label += f" + {called} p={float(cfg[key]):g}"
    return label


# ---------------------------------------------------------------------------------------------------------------
# Records → long rows (shared by local files and W&B history rows)
# ---------------------------------------------------------------------------------------------------------------

def _as_float(value: Any) -> float | None:
    """Numbers and booleans as float; anything else (strings, media, nested objects) is not a metric."""
    if isinstance(value, (bool, int, float)):
        return float(value)
    return None


_NUMERIC_TYPES = frozenset((int, float, bool))


@dataclass
class _Rows:
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


def _step_of(record: Mapping[str, Any]) -> int | None:
    step = record.get(STEP)
    if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step):
        return None
    if float(step) != int(step):
        return None
    return int(step)


def _add_record(rows: _Rows, run: str, step: int, record: Mapping[str, Any]) -> int:
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
        elif unstarted(key) is not None:
            start[unstarted(key)] = value
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


def _long(ids: list[tuple], values: list[dict[str, Any]], id_columns: list[str]) -> pd.DataFrame:
    """Wide records → long `[*id_columns, metric, value]`; a value logged twice for the same ids keeps the last."""
    wide = pd.DataFrame.from_records(values, index=range(len(values))).astype("float64")
    wide = pd.concat([pd.DataFrame(ids, columns=id_columns), wide], axis=1)
    long = wide.melt(id_vars=id_columns, var_name="metric", value_name="value").dropna(subset=["value"])
    long = long.drop_duplicates([*id_columns, "metric"], keep="last")
    long = long.astype({c: "int64" for c in id_columns if c != "run"} | {"run": str, "metric": str})
    return long.sort_values([*id_columns, "metric"], kind="stable").reset_index(drop=True)


def _frames(rows: _Rows) -> tuple[pd.DataFrame, pd.DataFrame, int]:
    """Long scalar and minibatch frames, and how many step-level values were logged twice for the same step."""
    seen = sum(len(v) for v in rows.step_values)
    scalars = _long(rows.step_ids, rows.step_values, ["run", "step"])
    minibatches = _long(rows.minibatch_ids, rows.minibatch_values, ["run", "step", "minibatch"])
    return scalars[SCALAR_COLUMNS], minibatches[MINIBATCH_COLUMNS], seen - len(scalars)


def _run_row(run: str, cfg: Mapping[str, Any], status: str, wall_s: float, start_sha256: str,
             source: str) -> dict[str, Any]:
    seed = cfg.get("seed")
    layers = cfg.get("model.num_hidden_layers")
    return {
        "run": run,
        "algo": str(cfg.get("algo.name", "unknown")),
        "replay": str(cfg.get("routing.replay", "none")),
        "seed": _format_value(seed) if seed is not None else "",
        "model": str(cfg.get("model.name", "")),
        "num_layers": float(layers) if isinstance(layers, (int, float)) and not isinstance(layers, bool) else math.nan,
        "status": status,
        "incomplete": status != FINISHED,
        "wall_s": wall_s,
        "start_sha256": start_sha256,
        "source": source,
        "config": json.dumps(cfg, sort_keys=True, default=str),
    }


def _finish(run_rows: list[dict], scalars: pd.DataFrame, minibatches: pd.DataFrame, source: str,
            problems: list[str], unstarted: list[dict] = ()) -> RunSet:
    """Attach labels and last steps; runs of one experiment, start and seed (a crashed run and its rerun) count once."""
    runs = pd.DataFrame(run_rows)
    last = scalars.groupby("run")["step"].max()
    runs["last_step"] = runs["run"].map(last).fillna(0).astype("int64")
    kept = _without_repeats(runs, problems)
    runs = runs[runs["run"].isin(kept)].reset_index(drop=True)
    scalars = scalars[scalars["run"].isin(kept)].reset_index(drop=True)
    minibatches = minibatches[minibatches["run"].isin(kept)].reset_index(drop=True)
    configs = {row.run: json.loads(row.config) for row in runs.itertuples()}
    runs["label"] = runs["run"].map(label_runs(configs))
    runs = runs[RUN_COLUMNS].reset_index(drop=True)
    return RunSet(runs=runs, scalars=scalars, minibatches=minibatches, source=source, problems=problems,
                  unstarted=pd.DataFrame(list(unstarted), columns=UNSTARTED_COLUMNS))


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
                _warn(problems, f"run {other.run} repeats run {best['run']} (same config and seed "
                                f"{best['seed'] or '?'}); only {best['run']} ({best['status']}, {best['last_step']} "
                                f"steps) is counted, not {other.run} ({other.status}, {other.last_step} steps)")
    return kept


# ---------------------------------------------------------------------------------------------------------------
# Local run directories
# ---------------------------------------------------------------------------------------------------------------

def _natural_key(path: Path) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def is_run_dir(path: Path) -> bool:
    return (path / METRICS_FILE).is_file() and (path / CONFIG_FILE).is_file()


def is_job_dir(path: Path, filenames: Sequence[str]) -> bool:
    """A directory a run was started in: it holds a run's config, lock or summary, or it is a job of a Hydra sweep
    (its parent holds `multirun.yaml`)."""
    return ((path / CONFIG_FILE).is_file() or LOCK_FILE in filenames or SUMMARY_FILE in filenames
            or (path.parent / MULTIRUN_FILE).is_file())


def find_run_dirs(paths: Sequence[str | Path], problems: list[str] | None = None,
                  unstarted: list[Path] | None = None, skip: Sequence[Path] = ()) -> list[tuple[Path, Path]]:
    """All run directories under `paths`, as `(input_root, run_dir)` pairs in natural order (0, 1, ..., 10); the job
    directories that hold no `metrics.jsonl` (a job refused before its first step) are added to `unstarted`. The
    folders `skip` and what they hold are passed over (a report's own output folder inside the sweep it reports:
    `make run` writes the quickstart's report there, and a job of the sweep it is not).

    Raises FileNotFoundError for a path that does not exist, ValueError when nothing under `paths` is a run.
    """
    problems = [] if problems is None else problems
    found: list[tuple[Path, Path]] = []
    seen: set[Path] = set()
    skipped = {Path(folder).resolve() for folder in skip}
    for given in paths:
        root = Path(given)
        if not root.exists():
            raise FileNotFoundError(f"no such directory: {root}")
        if not root.is_dir():
            raise ValueError(f"not a directory: {root} (expected a run directory or a sweep directory)")
        for current, dirnames, filenames in os.walk(root):
            here = Path(current)
            if here.resolve() in skipped:
                dirnames[:] = []
                continue
            if is_run_dir(here):
                dirnames[:] = []  # checkpoints and W&B files below a run are not runs
                if here.resolve() not in seen:
                    seen.add(here.resolve())
                    found.append((root, here))
                continue
            if METRICS_FILE in filenames:
                _warn(problems, f"{here / METRICS_FILE} has no {CONFIG_FILE} next to it; skipped")
            elif unstarted is not None and is_job_dir(here, filenames) and here.resolve() not in seen:
                seen.add(here.resolve())
                unstarted.append(here)
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
    if not found:
        where = ", ".join(str(p) for p in paths)
        raise ValueError(f"no runs found under {where} (a run directory holds {METRICS_FILE} and {CONFIG_FILE})")
    return sorted(found, key=lambda pair: _natural_key(pair[1]))


def _unstarted_row(where: str, flat: Mapping[str, Any], why: str) -> dict[str, Any]:
    seed = flat.get("seed")
    return {"where": where, "seed": _format_value(seed) if seed is not None else "",
            "config": json.dumps(dict(flat), sort_keys=True, default=str) if flat else "", "why": why}


def _read_unstarted(job: Path, defaults: Mapping[str, Any], problems: list[str]) -> dict[str, Any]:
    """What a job directory without a log says of itself: its config (when it wrote one) and how it ended."""
    try:
        config = yaml.safe_load((job / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        config = None
    flat = as_today(flatten_config(config), defaults) if isinstance(config, dict) else {}
    status = _read_summary(job, problems)[0] if (job / SUMMARY_FILE).is_file() else None
    why = f"no {METRICS_FILE}: the job logged no step (refused before its first step" + \
        (f"; its summary says {status!r})" if status else ")")
    _warn(problems, f"{job} holds no {METRICS_FILE}: a job that logged no step; left out")
    return _unstarted_row(str(job), flat, why)


def read_metrics(path: Path, problems: list[str]) -> list[tuple[int, dict[str, Any]]]:
    """Valid `(step, record)` pairs of one metrics.jsonl; each malformed line is reported as `path:line` and skipped.

    A line is malformed when it is not a JSON object or lacks an integer `train/step` (a run killed mid-write
    leaves exactly such a truncated last line).
    """
    records: list[tuple[int, dict[str, Any]]] = []
    with path.open(encoding="utf-8", errors="replace") as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                _warn(problems, f"{path}:{lineno}: malformed line skipped ({err.msg})")
                continue
            if not isinstance(record, dict):
                _warn(problems, f"{path}:{lineno}: malformed line skipped (not a JSON object)")
                continue
            step = _step_of(record)
            if step is None:
                _warn(problems, f"{path}:{lineno}: malformed line skipped (no integer 'train/step')")
                continue
            records.append((step, record))
    return records


def _read_summary(run_dir: Path, problems: list[str]) -> tuple[str, float, str]:
    """How the run ended (the summary's `status`, `INCOMPLETE` without a readable one), its wall time and the sha256
    of the weights it started from (`UNKNOWN_START` where the summary does not name them)."""
    path = run_dir / SUMMARY_FILE
    if not path.is_file():
        return INCOMPLETE, math.nan, UNKNOWN_START
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        _warn(problems, f"{path}: unreadable ({err}); run treated as incomplete")
        return INCOMPLETE, math.nan, UNKNOWN_START
    if not isinstance(summary, dict):
        _warn(problems, f"{path}: not a JSON object; run treated as incomplete")
        return INCOMPLETE, math.nan, UNKNOWN_START
    return _summary_fields(summary)


def _summary_fields(summary: Mapping[str, Any]) -> tuple[str, float, str]:
    status = summary.get("status")
    wall = _as_float(summary.get("wall_s"))
    start = summary.get("start_sha256")
    return (str(status) if isinstance(status, str) and status else INCOMPLETE, wall if wall is not None else math.nan,
            start if isinstance(start, str) else UNKNOWN_START)


def _run_id(root: Path, run_dir: Path, taken: set[str]) -> str:
    rel = run_dir.relative_to(root)
    name = root.resolve().name if rel == Path(".") else f"{root.resolve().name}/{rel.as_posix()}"
    candidate, n = name, 2
    while candidate in taken:
        candidate, n = f"{name}#{n}", n + 1
    taken.add(candidate)
    return candidate


def load_runs(paths: Sequence[str | Path], skip: Sequence[Path] = ()) -> RunSet:
    """Load every run under `paths` (run or sweep directories, searched recursively, passing over the folders
    `skip`) into a RunSet."""
    problems: list[str] = []
    rows = _Rows(nulls_are_non_finite=True)
    run_rows: list[dict] = []
    taken: set[str] = set()
    defaults = schema_defaults()
    jobs: list[Path] = []
    found = find_run_dirs(paths, problems, jobs, skip)
    unstarted = [_read_unstarted(job, defaults, problems) for job in sorted(jobs, key=_natural_key)]
    for root, run_dir in found:
        try:
            config = yaml.safe_load((run_dir / CONFIG_FILE).read_text(encoding="utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError) as err:
            _warn(problems, f"{run_dir / CONFIG_FILE}: unreadable config ({err.__class__.__name__}); run skipped")
            continue
        if not isinstance(config, dict):
            _warn(problems, f"{run_dir / CONFIG_FILE}: not a mapping; run skipped")
            continue
        records = read_metrics(run_dir / METRICS_FILE, problems)
        if not records:
            _warn(problems, f"{run_dir / METRICS_FILE}: no valid metric line; run skipped")
            unstarted.append(_unstarted_row(str(run_dir), as_today(flatten_config(config), defaults),
                                            f"no valid line in {METRICS_FILE}: the job logged no step"))
            continue
        run = _run_id(root, run_dir, taken)
        bad = sum(_add_record(rows, run, step, record) for step, record in records)
        if bad:
            _warn(problems, f"{run_dir / METRICS_FILE}: {bad} per-minibatch entries without an integer "
                            "'minibatch' index skipped")
        status, wall_s, start = _read_summary(run_dir, problems)
        run_rows.append(_run_row(run, as_today(flatten_config(config), defaults), status, wall_s, start,
                                 str(run_dir)))
    if not run_rows:
        raise ValueError(f"no run under {', '.join(str(p) for p in paths)} has a readable config and a valid "
                         f"{METRICS_FILE} line")
    scalars, minibatches, repeated = _frames(rows)
    _note_dropped(problems, rows.non_finite, repeated)
    return _finish(run_rows, scalars, minibatches, ", ".join(str(p) for p in paths), problems, unstarted)


def _note_dropped(problems: list[str], non_finite: int, repeated: int) -> None:
    if non_finite:
        _warn(problems, f"{non_finite} non-finite metric values (NaN/inf, or null in metrics.jsonl) left out of the "
                        "figures and tables")
    if repeated:
        _warn(problems, f"{repeated} metric values logged twice for the same step; the last one is used")


# ---------------------------------------------------------------------------------------------------------------
# W&B
# ---------------------------------------------------------------------------------------------------------------

def default_wandb_api() -> Any:
    """The real W&B public API (imported here: `wandb` is slow to import and only this path needs it)."""
    import wandb

    return wandb.Api()


def _cache_key(path: str, groups: Sequence[str]) -> str:
    raw = path.replace("/", "_") + "_" + ("+".join(sorted(groups)) if groups else "all-groups")
    slug = re.sub(r"[^A-Za-z0-9._+-]", "_", raw)
    if len(slug) > 120:
        slug = slug[:80] + "_" + hashlib.sha1(raw.encode()).hexdigest()[:12]
    return f"wandb_{slug}"


def wandb_cache_dir(cache_root: Path, path: str, groups: Sequence[str]) -> Path:
    """Where the parquet cache of one (entity/project, groups) query lives."""
    return Path(cache_root) / _cache_key(path, groups)


def _check_project_path(path: str) -> None:
    parts = path.split("/")
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"W&B path must be ENTITY/PROJECT, got {path!r}")


def load_wandb(path: str, groups: Sequence[str] = (), *, cache_root: Path, refresh: bool = False,
               api_factory: Callable[[], Any] = default_wandb_api) -> RunSet:
    """Load the runs of W&B project `path` (restricted to `groups` when given) into a RunSet.

    The loaded frames are written as parquet under `wandb_cache_dir(cache_root, path, groups)`; a later call with
    the same arguments reads them back without creating an API object (no network), unless `refresh` is set.
    `api_factory` returns an object with `runs(path, filters=...)` whose items have `.id`, `.name`, `.group`,
    `.state`, `.config` (the nested resolved config), `.scan_history()` and, where the run ended, `.summary` (its
    `summary.json`: the status and the start's sha256 come from there; without it, W&B's state).
    """
    _check_project_path(path)
    cache = wandb_cache_dir(cache_root, path, groups)
    if not refresh and (cache / "runs.parquet").is_file():
        return _read_cache(cache)
    try:
        api = api_factory()
    except Exception as error:  # only W&B's client runs here: no key, no network, a bad host
        raise ValueError(f"W&B did not start ({type(error).__name__}: {error}); --wandb needs an API key "
                         "(`wandb login` or WANDB_API_KEY) and a connection, or a cache from an earlier run") from None
    filters = {"group": {"$in": list(groups)}} if groups else None
    problems: list[str] = []
    rows = _Rows(nulls_are_non_finite=False)
    run_rows: list[dict] = []
    unstarted: list[dict] = []
    defaults = schema_defaults()
    for wb_run in api.runs(path, filters=filters):
        config = {k: v for k, v in dict(wb_run.config).items() if not str(k).startswith("_")}
        run = str(wb_run.id)
        history = 0
        without_step = 0
        for record in wb_run.scan_history():
            step = _step_of(record)
            if step is None:
                without_step += 1
                continue
            history += 1
            _add_record(rows, run, step, record)
        if without_step:
            _warn(problems, f"W&B run {run} ({wb_run.name}): {without_step} history rows without 'train/step' "
                            "skipped")
        source = f"wandb:{path}/{run} (group {wb_run.group}, name {wb_run.name})"
        flat = as_today(flatten_config(config), defaults)
        if not history:
            _warn(problems, f"W&B run {run} ({wb_run.name}): no history row with 'train/step'; run skipped")
            unstarted.append(_unstarted_row(source, flat, "logged no step (W&B run without history)"))
            continue
        summary = dict(getattr(wb_run, "summary", None) or {})
        if "status" in summary:
            status, wall_s, start = _summary_fields(summary)
        else:
            status, wall_s, start = (FINISHED if wb_run.state == "finished" else INCOMPLETE), math.nan, UNKNOWN_START
        run_rows.append(_run_row(run, flat, status, wall_s, start, source))
    if not run_rows:
        where = f" in groups {', '.join(groups)}" if groups else ""
        raise ValueError(f"no W&B runs with history found in {path}{where}")
    scalars, minibatches, repeated = _frames(rows)
    _note_dropped(problems, rows.non_finite, repeated)
    source = f"W&B {path}" + (f" (groups: {', '.join(groups)})" if groups else "")
    runset = _finish(run_rows, scalars, minibatches, source, problems, unstarted)
    _write_cache(cache, runset)
    return runset


def _write_cache(cache: Path, runset: RunSet) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    runset.scalars.to_parquet(cache / "scalars.parquet", index=False)
    runset.minibatches.to_parquet(cache / "minibatches.parquet", index=False)
    meta = {"source": runset.source, "problems": runset.problems, "unstarted": runset.unstarted.to_dict("records")}
    (cache / "meta.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
    # Written last: its presence is what marks the cache complete (an interrupted write is fetched again).
    runset.runs.to_parquet(cache / "runs.parquet", index=False)


def _read_cache(cache: Path) -> RunSet:
    """The cached RunSet; a cache written before the runs named their start reads them as `UNKNOWN_START`."""
    meta = json.loads((cache / "meta.json").read_text(encoding="utf-8"))
    runs = pd.read_parquet(cache / "runs.parquet")
    if "start_sha256" not in runs:
        runs["start_sha256"] = UNKNOWN_START
    return RunSet(
        runs=runs[RUN_COLUMNS],
        scalars=pd.read_parquet(cache / "scalars.parquet"),
        minibatches=pd.read_parquet(cache / "minibatches.parquet"),
        source=f"{meta['source']} (cached in {cache})",
        problems=list(meta["problems"]),
        unstarted=pd.DataFrame(meta.get("unstarted", []), columns=UNSTARTED_COLUMNS),
    )
