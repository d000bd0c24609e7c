"""Run logging: `metrics.jsonl` (the source of truth for `analysis/`) and the same numbers to W&B.

`metrics.jsonl` gets one JSON object per RL step, handed to the kernel at once (unbuffered), so a crashed run keeps
every finished step; the file is only ever appended to (a run directory is claimed by one run,
`experiments.run.rundir`). A write that fails (a full disk) cuts the file back to its last whole line, so that no
partial line is ever left, and raises `StorageError` naming the file, the last step it holds and the cut; closing after
a failure never raises.
Before each step's line the writer checks that the file it holds open is still the run directory's `metrics.jsonl`:
a directory removed (or a log removed or replaced) under a running run would otherwise take every later line into a
file nobody can read, and the run would end claiming a log that no longer exists. It stops the run instead, in one
line naming the step (`StorageError`), and from then on says the log is gone (`lost`) wherever it would say what the
log holds.
Per-minibatch values sit under the key `minibatches` (a list, index = updates since θ_old); W&B receives them
flattened as `minibatch/<j>/<name>`. W&B is offline by default (no network needed); online, its start-up waits at
most `logger.wandb.init_timeout` seconds (W&B's own default is 90, which a machine without a network spent in
silence, in every job of a sweep). If it cannot start, or stops logging, the run warns and keeps the local log
(losing the dashboard must never lose the experiment), and `summary.json` records it under `wandb`.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

if TYPE_CHECKING:
    import wandb

from experiments.run.rundir import METRICS_FILE, SUMMARY_FILE, StorageError, replace_file
from experiments.step.metrics import MINIBATCH, MINIBATCHES, STEP

WANDB_ID_FILE = ".wandb_id"  # the W&B run of this directory, which a resumed run continues
WANDB_MINIBATCH = "minibatch/"  # W&B has no lists: minibatch j's `name` is logged as `minibatch/<j>/<name>`


def _finite_or_none(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null so every line stays valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _clean(record: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in record.items():
        if isinstance(value, list):
            out[key] = [_clean(item) if isinstance(item, dict) else _finite_or_none(item) for item in value]
        else:
            out[key] = _finite_or_none(value)
    return out


def _first_line(error: BaseException) -> str:
    return next((line for line in str(error).splitlines() if line.strip()), "")


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    """`summary.json`, replaced whole: a kill while it is written leaves the previous one or none (`OSError` when it
    cannot be written)."""
    replace_file(run_dir / SUMMARY_FILE, json.dumps(_clean(summary), indent=2) + "\n")


def flatten_for_wandb(record: dict[str, Any]) -> dict[str, Any]:
    """Flat keys for W&B: per-minibatch entries become `minibatch/<j>/<name>`."""
    flat = {key: value for key, value in record.items() if key != MINIBATCHES}
    for entry in record.get(MINIBATCHES, []):
        index = entry[MINIBATCH]
        for key, value in entry.items():
            if key != MINIBATCH:
                flat[f"{WANDB_MINIBATCH}{index}/{key}"] = value
    return flat


class RunLogger:
    """Writes `metrics.jsonl`, `summary.json` and (unless disabled) a W&B run into `run_dir`."""

    def __init__(
        self, run_dir: str | Path, cfg: DictConfig, name: str, tags: list[str], group: str | None, resume: bool = False
    ) -> None:
        """`resume`: the run continues from a checkpoint; W&B continues the run whose id the directory recorded."""
        self.run_dir = Path(run_dir)
        self.last_step: int | None = None
        self.lost: str | None = None  # why metrics.jsonl no longer holds the run's steps (None: it does)
        # What W&B did, for the summary: its mode, whether it started, and why it did not or stopped (None: it did not
        # fail).
        self.wandb_record: dict[str, Any] = {"mode": str(cfg.logger.wandb.mode), "started": False, "problem": None}
        try:
            self._metrics = os.open(self.run_dir / METRICS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._whole_bytes = os.fstat(self._metrics).st_size  # where a failed write is cut back to
        except OSError as error:
            raise StorageError(f"cannot open {self.run_dir / METRICS_FILE}: {error.strerror}") from None
        try:
            self._wandb = self._start_wandb(cfg, name, tags, group, resume)
        except BaseException:  # a stop during W&B's start-up
            self._close_metrics()
            raise

    def _start_wandb(
        self, cfg: DictConfig, name: str, tags: list[str], group: str | None, resume: bool
    ) -> wandb.Run | None:
        wandb_cfg = cfg.logger.wandb
        if wandb_cfg.mode == "disabled":
            return None
        id_file = self.run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if resume and id_file.exists() else None
        try:
            import wandb

            run = wandb.init(
                id=run_id,
                resume="allow" if run_id else None,
                project=wandb_cfg.project,
                entity=wandb_cfg.entity,
                group=wandb_cfg.group or group,
                job_type=wandb_cfg.job_type,
                name=name,
                tags=sorted(set(list(wandb_cfg.tags) + tags)),
                mode=wandb_cfg.mode,
                dir=str(self.run_dir),
                config=cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)),  # a mapping
                reinit="finish_previous",
                # System-stats sampling runs in W&B's service process and competes for the cores the step needs.
                settings=wandb.Settings(x_disable_stats=True, init_timeout=wandb_cfg.init_timeout),
            )
            id_file.write_text(run.id)
            self.wandb_record["started"] = True
            return run
        except Exception as error:  # a dashboard failure must not end the experiment
            why = f"{type(error).__name__}: {_first_line(error)}"
            self.wandb_record["problem"] = f"did not start ({why})"
            warnings.warn(
                f"W&B did not start in {wandb_cfg.mode} mode within logger.wandb.init_timeout="
                f"{wandb_cfg.init_timeout:g} s ({why}); logging to metrics.jsonl only, and "
                f"{SUMMARY_FILE} records it",
                stacklevel=2,
            )
            return None

    def _append(self, data: bytes) -> None:
        """Write all of `data` at the end of metrics.jsonl (a disk that fills on the way writes part, then fails)."""
        while data:
            data = data[os.write(self._metrics, data) :]

    def _cut_back(self, step: int) -> str:
        """After a failed write: cut metrics.jsonl back to its last whole line; say what was cut, if anything."""
        try:
            if os.fstat(self._metrics).st_size == self._whole_bytes:
                return ""
            os.ftruncate(self._metrics, self._whole_bytes)
        except OSError as error:
            return f" and a partial line of step {step} that could not be cut off ({error.strerror})"
        return f" (the partial line of step {step} was cut off)"

    @property
    def wandb_active(self) -> bool:
        return self._wandb is not None

    def _failed(self, error: OSError, what: str, cut: str = "") -> StorageError:
        held = f"it holds steps up to {self.last_step}" if self.last_step is not None else "it holds no step"
        if self.lost is not None:
            held = "the log is gone with it"
        return StorageError(f"cannot write {what} in {self.run_dir}: {error.strerror}; {held}{cut}")

    def _check_still_there(self, step: int) -> None:
        """Raise `StorageError` when the log this writer holds open is no longer the run directory's `metrics.jsonl`
        (the directory or the file was removed, or the file replaced), naming the step about to be logged."""
        path = self.run_dir / METRICS_FILE
        held = os.fstat(self._metrics)
        try:
            here = os.stat(path)
        except FileNotFoundError:
            here = None
        if held.st_nlink > 0 and here is not None and (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino):
            return
        after = f"after step {self.last_step}" if self.last_step is not None else "before its first step"
        if not self.run_dir.is_dir():
            self.lost = f"the run directory {self.run_dir} was removed {after}"
        elif here is None:
            self.lost = f"{path} was removed {after}"
        else:
            self.lost = f"{path} was replaced by another file {after}"
        raise StorageError(
            f"{self.lost} (noticed as step {step} was to be logged): the steps it held are gone, and "
            "the run stops rather than log into a file nobody can read"
        )

    def log(self, record: dict[str, Any]) -> None:
        self._check_still_there(int(record[STEP]))
        clean = _clean(record)
        line = (json.dumps(clean) + "\n").encode("utf-8")
        try:
            self._append(line)
        except OSError as error:
            raise self._failed(error, METRICS_FILE, self._cut_back(int(record[STEP]))) from None
        self._whole_bytes += len(line)
        self.last_step = int(record[STEP])
        if self._wandb is not None:
            try:
                self._wandb.log(flatten_for_wandb(clean), step=int(record[STEP]))
            except Exception as error:
                warnings.warn(f"W&B log failed ({error}); continuing with metrics.jsonl only", stacklevel=2)
                self.wandb_record["problem"] = f"stopped logging at step {record[STEP]} ({_first_line(error)})"
                self._wandb = None

    def finish(self, summary: dict[str, Any], exit_code: int = 0) -> None:
        """Write `summary.json` (its status says how the run ended, its `wandb` what W&B did), close the log, finish
        W&B with `exit_code`."""
        summary = {**summary, "wandb": self.wandb_record}
        try:
            write_summary(self.run_dir, summary)
            self._close_metrics()
        except OSError as error:
            self.abort()
            raise self._failed(error, SUMMARY_FILE) from None
        if self._wandb is not None:
            try:
                self._wandb.summary.update(_clean(summary))
                self._wandb.finish(exit_code=exit_code)
            except Exception as error:
                warnings.warn(f"W&B finish failed ({error}); the local summary.json is complete", stacklevel=2)

    def _close_metrics(self) -> None:
        """Close metrics.jsonl once: a second close of its number could close a file another thread opened since."""
        fd, self._metrics = self._metrics, -1
        if fd >= 0:
            os.close(fd)

    def abort(self) -> None:
        """Close files after a failure; the run stays marked incomplete (no summary.json). Never raises: it runs
        while another error is on its way out."""
        try:
            self._close_metrics()
        except OSError:
            pass  # the write that failed has been reported; closing cannot lose more than that
        if self._wandb is not None:
            try:
                self._wandb.finish(exit_code=1)
            except Exception as error:
                warnings.warn(f"W&B finish failed ({error}) while closing a failed run", stacklevel=2)


def sweep_group(hydra_cfg: Any) -> str | None:
    """Runs of one Hydra multirun share a W&B group: the sweep directory's name."""
    if hydra_cfg is not None and hydra_cfg.mode == RunMode.MULTIRUN:
        return Path(hydra_cfg.sweep.dir).name
    return None
