"""Read the runs of a W&B project into a `RunSet` (analysis.records), through a parquet cache.

A W&B run carries the flat keys a local run logs in its history, with per-minibatch values flattened as
`minibatch/<j>/<name>`, its resolved config as `run.config` and, where it ended, its `summary.json` as `run.summary`.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from analysis.configs import as_today, flatten_config, schema_defaults
from analysis.records import (
    FINISHED,
    INCOMPLETE,
    RUN_COLUMNS,
    UNKNOWN_RECIPE,
    UNKNOWN_START,
    UNSTARTED_COLUMNS,
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


def load_wandb(
    path: str,
    groups: Sequence[str] = (),
    *,
    cache_root: Path,
    refresh: bool = False,
    api_factory: Callable[[], Any] = default_wandb_api,
) -> RunSet:
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
        raise ValueError(
            f"W&B did not start ({type(error).__name__}: {error}); --wandb needs an API key "
            "(`wandb login` or WANDB_API_KEY) and a connection, or a cache from an earlier run"
        ) from None
    filters = {"group": {"$in": list(groups)}} if groups else None
    problems: list[str] = []
    rows = RecordRows(nulls_are_non_finite=False)
    run_rows: list[dict[str, Any]] = []
    unstarted: list[dict[str, Any]] = []
    defaults = schema_defaults()
    for wb_run in api.runs(path, filters=filters):
        config = {k: v for k, v in dict(wb_run.config).items() if not str(k).startswith("_")}
        run = str(wb_run.id)
        history = 0
        without_step = 0
        for record in wb_run.scan_history():
            step = step_of(record)
            if step is None:
                without_step += 1
                continue
            history += 1
            add_record(rows, run, step, record)
        if without_step:
            warn(problems, f"W&B run {run} ({wb_run.name}): {without_step} history rows without 'train/step' skipped")
        source = f"wandb:{path}/{run} (group {wb_run.group}, name {wb_run.name})"
        flat = as_today(flatten_config(config), defaults)
        if not history:
            warn(problems, f"W&B run {run} ({wb_run.name}): no history row with 'train/step'; run skipped")
            unstarted.append(unstarted_row(source, flat, "logged no step (W&B run without history)"))
            continue
        summary = dict(getattr(wb_run, "summary", None) or {})
        if "status" in summary:
            status, wall_s, start, recipe = summary_fields(summary)
        else:
            status, wall_s, start, recipe = (
                (FINISHED if wb_run.state == "finished" else INCOMPLETE),
                math.nan,
                UNKNOWN_START,
                UNKNOWN_RECIPE,
            )
        run_rows.append(run_row(run, flat, status, wall_s, start, recipe, source))
    if not run_rows:
        where = f" in groups {', '.join(groups)}" if groups else ""
        raise ValueError(f"no W&B runs with history found in {path}{where}")
    scalars, minibatches, repeated = frames(rows)
    note_dropped(problems, rows.non_finite, repeated)
    source = f"W&B {path}" + (f" (groups: {', '.join(groups)})" if groups else "")
    runset = finish(run_rows, scalars, minibatches, source, problems, unstarted)
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
    """The cached RunSet; a cache written before the runs named their start (or its recipe) reads them as
    `UNKNOWN_START` (`UNKNOWN_RECIPE`)."""
    meta = json.loads((cache / "meta.json").read_text(encoding="utf-8"))
    runs = pd.read_parquet(cache / "runs.parquet")
    for column, unknown in (("start_sha256", UNKNOWN_START), ("start_recipe", UNKNOWN_RECIPE)):
        if column not in runs:
            runs[column] = unknown
    return RunSet(
        runs=runs[RUN_COLUMNS],
        scalars=pd.read_parquet(cache / "scalars.parquet"),
        minibatches=pd.read_parquet(cache / "minibatches.parquet"),
        source=f"{meta['source']} (cached in {cache})",
        problems=list(meta["problems"]),
        unstarted=pd.DataFrame(meta.get("unstarted", []), columns=UNSTARTED_COLUMNS),
    )
