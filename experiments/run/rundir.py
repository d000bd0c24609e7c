"""The run directory: owned by one run at a time, never silently reused, and the files `analysis/` reads.

A run claims its directory before any work starts: it takes an exclusive lock (`.lock`, released when the process
ends, however it ends) and refuses a directory that already holds a run's log, so two runs can never write into one
`metrics.jsonl` and a re-run never wipes an earlier one. Only then does it write the resolved config
(`.hydra/config.yaml`, with Hydra's `overrides.yaml` and `hydra.yaml` when Hydra started the run): Hydra itself is
told not to (`hydra.output_subdir: null`), because it would overwrite the config of the run that owns the directory.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, read_write

from models.registry import ConfigError

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
LOCK_FILE = ".lock"
CONFIG_DIR = ".hydra"


class StorageError(OSError):
    """The run directory could not be written while the run went on (disk full, directory removed, ...)."""


class RunDirectory:
    """A claimed run directory; keep the object alive for as long as the run writes into it (it holds the lock)."""

    def __init__(self, path: Path, lock: int) -> None:
        self.path = path
        self._lock = lock

    @property
    def metrics(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def summary(self) -> Path:
        return self.path / SUMMARY_FILE

    def release(self) -> None:
        if self._lock >= 0:
            os.close(self._lock)
            self._lock = -1


def _logged_steps(metrics: Path) -> int:
    with open(metrics, "rb") as handle:
        return sum(1 for line in handle if line.strip())


def claim(path: str | Path, cfg: DictConfig, hydra_cfg: Any = None, resume: bool = False) -> RunDirectory:
    """Take `path` for this run or refuse it with `ConfigError`, before any work; write the resolved config.

    `resume`: the directory may hold this run's own earlier log (checkpointed runs continue there).
    """
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        lock = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise ConfigError(f"run directory {str(path)!r} cannot be written: {error.strerror}") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock)
        raise ConfigError(
            f"run directory {str(path)!r} is in use by another run right now; give this one its own hydra.run.dir"
        ) from None
    run = RunDirectory(path, lock)
    try:
        metrics = path / METRICS_FILE
        if resume:
            _refuse_another_experiment(path, cfg)
        if not resume and (metrics.exists() or (path / SUMMARY_FILE).exists()):
            steps = _logged_steps(metrics) if metrics.exists() else 0
            status = _status(path / SUMMARY_FILE)
            raise ConfigError(
                f"run directory {str(path)!r} already holds a run ({steps} logged steps, {status}); it is never "
                "overwritten: give this run another hydra.run.dir"
            )
        _write_config(path / CONFIG_DIR, cfg, hydra_cfg)
    except OSError as error:
        run.release()
        raise ConfigError(f"run directory {str(path)!r} cannot be written: {error.strerror}") from None
    except ConfigError:
        run.release()
        raise
    return run


def _refuse_another_experiment(path: Path, cfg: DictConfig) -> None:
    """A resumed run continues its own log: refuse a directory whose recorded config is another experiment's."""
    from experiments.run.checkpoint import experiment

    recorded = path / CONFIG_DIR / "config.yaml"
    if not recorded.exists():
        return
    theirs, ours = experiment(OmegaConf.load(recorded)), experiment(cfg)
    differs = [f"{key}={theirs.get(key)!r} there, {value!r} here" for key, value in ours.items() if theirs.get(key) != value]
    if differs:
        raise ConfigError(f"resume into {str(path)!r}, which holds another experiment: {'; '.join(differs[:4])}")


def finished_summary(path: Path) -> dict[str, Any] | None:
    """The summary of the finished run in `path`, or None (no summary, or one of a run that did not finish)."""
    try:
        summary = json.loads((path / SUMMARY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return summary if summary.get("status") == "finished" else None


def _status(summary: Path) -> str:
    if not summary.exists():
        return "no summary.json: crashed, killed or still running"
    try:
        return f"status {json.loads(summary.read_text(encoding='utf-8')).get('status')!r}"
    except (OSError, ValueError):
        return "an unreadable summary.json"


def _write_config(directory: Path, cfg: DictConfig, hydra_cfg: Any) -> None:
    directory.mkdir(exist_ok=True)
    (directory / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True), encoding="utf-8")
    if hydra_cfg is not None:
        overrides = OmegaConf.to_container(hydra_cfg.overrides.task)
        (directory / "overrides.yaml").write_text(OmegaConf.to_yaml(overrides), encoding="utf-8")
        (directory / "hydra.yaml").write_text(OmegaConf.to_yaml({"hydra": hydra_cfg}), encoding="utf-8")


def make_writable_dir(path: str | Path) -> None:
    """Create `path` if needed and prove a file can be written in it; `OSError` otherwise."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # A name of its own: under torchrun every rank probes the same directory at once.
    with tempfile.NamedTemporaryFile(dir=path, prefix=".write_test"):
        pass


def _refuse_unwritable(key: str, path: str) -> None:
    from experiments.run.launch import exit_once

    try:
        make_writable_dir(path)
    except OSError as error:
        exit_once(f"moe-rl-lab: {key}={path!r} cannot be created: {error.strerror}")


class DirectoryGuard(Callback):
    """Hydra creates its output directory before the task runs, with a traceback when it cannot: refuse such a
    directory first, in one line (`hydra.callbacks` in conf/train.yaml and conf/sft.yaml). Under torchrun every
    rank composes its own config, and a run directory named by the clock would differ from rank to rank: rank 0's
    is every rank's."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            from experiments.run import launch

            try:
                ranks = launch.start(config.get("device", "cpu"))
            except ConfigError as error:
                launch.exit_once(f"moe-rl-lab: {error}")
            chosen = launch.broadcast(str(config.hydra.run.dir), ranks)
            with read_write(config.hydra.run):
                config.hydra.run.dir = chosen
        _refuse_unwritable("hydra.run.dir", config.hydra.run.dir)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            from experiments.run.launch import exit_once

            exit_once("moe-rl-lab: a sweep (-m) under torchrun would run every job on every rank; launch the sweep "
                      "itself with cluster=slurm, or torchrun one run at a time")
        _refuse_unwritable("hydra.sweep.dir", config.hydra.sweep.dir)
