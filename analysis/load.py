"""Find local runs and read them into a `RunSet` (analysis.records).

A local run is the training loop's Hydra output directory (`experiments.run.rundir`): it holds
`.hydra/config.yaml` (the resolved config) and `metrics.jsonl` (one JSON object per RL step, flushed each step),
plus `summary.json` once the run finished. A Hydra multirun sweep directory holds one such directory per job, so
runs are found recursively; a job directory without `metrics.jsonl` (a job refused before its first step) is named
among the unstarted. Reading never stops at bad data: a malformed line is reported as `file:line` on stderr and
skipped; a run without `summary.json` is kept up to its last valid line and marked incomplete.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from analysis.configs import as_today, flatten_config, schema_defaults
from analysis.records import (
    INCOMPLETE,
    UNKNOWN_RECIPE,
    UNKNOWN_START,
    RecordRows,
    RunSet,
    add_record,
    finish,
    frames,
    note_dropped,
    run_row,
    step_of,
    summary_fields,
    unstarted_row,
    warn,
)
from experiments.run.rundir import LOCK_FILE, METRICS_FILE, SUMMARY_FILE

CONFIG_FILE = Path(".hydra") / "config.yaml"
MULTIRUN_FILE = "multirun.yaml"  # what Hydra writes at the top of a sweep directory, beside its jobs


def _natural_key(path: Path) -> list[int | str]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def is_run_dir(path: Path) -> bool:
    """Whether `path` holds a run: its metrics.jsonl and its recorded config."""
    return (path / METRICS_FILE).is_file() and (path / CONFIG_FILE).is_file()


def is_job_dir(path: Path, filenames: Sequence[str]) -> bool:
    """A directory a run was started in: it holds a run's config, lock or summary, or it is a job of a Hydra sweep
    (its parent holds `multirun.yaml`)."""
    return (
        (path / CONFIG_FILE).is_file()
        or LOCK_FILE in filenames
        or SUMMARY_FILE in filenames
        or (path.parent / MULTIRUN_FILE).is_file()
    )


def find_run_dirs(
    paths: Sequence[str | Path],
    problems: list[str] | None = None,
    unstarted: list[Path] | None = None,
    skip: Sequence[Path] = (),
) -> list[tuple[Path, Path]]:
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
                warn(problems, f"{here / METRICS_FILE} has no {CONFIG_FILE} next to it; skipped")
            elif unstarted is not None and is_job_dir(here, filenames) and here.resolve() not in seen:
                seen.add(here.resolve())
                unstarted.append(here)
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
    if not found:
        where = ", ".join(str(p) for p in paths)
        raise ValueError(f"no runs found under {where} (a run directory holds {METRICS_FILE} and {CONFIG_FILE})")
    return sorted(found, key=lambda pair: _natural_key(pair[1]))


def _read_unstarted(job: Path, defaults: Mapping[str, Any], problems: list[str]) -> dict[str, Any]:
    """What a job directory without a log says of itself: its config (when it wrote one) and how it ended."""
    try:
        config = yaml.safe_load((job / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        config = None
    flat = as_today(flatten_config(config), defaults) if isinstance(config, dict) else {}
    status = _read_summary(job, problems)[0] if (job / SUMMARY_FILE).is_file() else None
    why = f"no {METRICS_FILE}: the job logged no step (refused before its first step" + (
        f"; its summary says {status!r})" if status else ")"
    )
    warn(problems, f"{job} holds no {METRICS_FILE}: a job that logged no step; left out")
    return unstarted_row(str(job), flat, why)


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
                warn(problems, f"{path}:{lineno}: malformed line skipped ({err.msg})")
                continue
            if not isinstance(record, dict):
                warn(problems, f"{path}:{lineno}: malformed line skipped (not a JSON object)")
                continue
            step = step_of(record)
            if step is None:
                warn(problems, f"{path}:{lineno}: malformed line skipped (no integer 'train/step')")
                continue
            records.append((step, record))
    return records


def _read_summary(run_dir: Path, problems: list[str]) -> tuple[str, float, str, str]:
    """How the run ended (the summary's `status`, `INCOMPLETE` without a readable one), its wall time, the sha256
    of the weights it started from and their recipe (`UNKNOWN_START`, `UNKNOWN_RECIPE` where the summary does not
    name them)."""
    path = run_dir / SUMMARY_FILE
    if not path.is_file():
        return INCOMPLETE, math.nan, UNKNOWN_START, UNKNOWN_RECIPE
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        warn(problems, f"{path}: unreadable ({err}); run treated as incomplete")
        return INCOMPLETE, math.nan, UNKNOWN_START, UNKNOWN_RECIPE
    if not isinstance(summary, dict):
        warn(problems, f"{path}: not a JSON object; run treated as incomplete")
        return INCOMPLETE, math.nan, UNKNOWN_START, UNKNOWN_RECIPE
    return summary_fields(summary)


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
    rows = RecordRows(nulls_are_non_finite=True)
    run_rows: list[dict[str, Any]] = []
    taken: set[str] = set()
    defaults = schema_defaults()
    jobs: list[Path] = []
    found = find_run_dirs(paths, problems, jobs, skip)
    unstarted = [_read_unstarted(job, defaults, problems) for job in sorted(jobs, key=_natural_key)]
    for root, run_dir in found:
        try:
            config = yaml.safe_load((run_dir / CONFIG_FILE).read_text(encoding="utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError) as err:
            warn(problems, f"{run_dir / CONFIG_FILE}: unreadable config ({err.__class__.__name__}); run skipped")
            continue
        if not isinstance(config, dict):
            warn(problems, f"{run_dir / CONFIG_FILE}: not a mapping; run skipped")
            continue
        records = read_metrics(run_dir / METRICS_FILE, problems)
        if not records:
            warn(problems, f"{run_dir / METRICS_FILE}: no valid metric line; run skipped")
            unstarted.append(
                unstarted_row(
                    str(run_dir),
                    as_today(flatten_config(config), defaults),
                    f"no valid line in {METRICS_FILE}: the job logged no step",
                )
            )
            continue
        run = _run_id(root, run_dir, taken)
        bad = sum(add_record(rows, run, step, record) for step, record in records)
        if bad:
            warn(
                problems,
                f"{run_dir / METRICS_FILE}: {bad} per-minibatch entries without an integer 'minibatch' index skipped",
            )
        status, wall_s, start, recipe = _read_summary(run_dir, problems)
        run_rows.append(
            run_row(run, as_today(flatten_config(config), defaults), status, wall_s, start, recipe, str(run_dir))
        )
    if not run_rows:
        raise ValueError(
            f"no run under {', '.join(str(p) for p in paths)} has a readable config and a valid {METRICS_FILE} line"
        )
    scalars, minibatches, repeated = frames(rows)
    note_dropped(problems, rows.non_finite, repeated)
    return finish(run_rows, scalars, minibatches, ", ".join(str(p) for p in paths), problems, unstarted)
