"""The run directory: owned by one run at a time, never silently reused, and the files `analysis/` reads.

A run claims its directory before any work starts: it takes an exclusive lock (`.lock`, released when the process
ends, however it ends) and refuses a directory that already holds a run's log, so two runs can never write into one
`metrics.jsonl` and a re-run never wipes an earlier one. Only then does it write the resolved config
(`.hydra/config.yaml`, with Hydra's `overrides.yaml` and `hydra.yaml` when Hydra started the run): Hydra itself is
told not to (`hydra.output_subdir: null`), because it would overwrite the config of the run that owns the directory.
A resumed run (`resume`) is compared with the config its directory recorded (`experiments.run.resume`) and records
its own only once it goes on (`RunDirectory.record`): a resume that finds nothing to do changes nothing.

Files that are rewritten (the config, `summary.json`, the log cut back on resume) are replaced whole
(`replace_file`): a kill at any instant leaves the old file or the new one, never a part of either.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from pathlib import Path
from typing import Any, cast

import yaml
from omegaconf import DictConfig, OmegaConf

from experiments.run.resume import described, differences, length_change
from models.registry import ConfigError, RunFailed, flat

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
LOCK_FILE = ".lock"
CONFIG_DIR = ".hydra"


class StorageError(OSError, RunFailed):
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

    def record(self, cfg: DictConfig, hydra_cfg: Any = None) -> None:
        """Record `cfg` as this directory's run, before the run's first step (`ConfigError` when it cannot)."""
        try:
            _write_config(self.path / CONFIG_DIR, cfg, hydra_cfg)
        except OSError as error:
            raise ConfigError(f"run directory {str(self.path)!r} cannot be written: {error.strerror}") from None

    def release(self) -> None:
        if self._lock >= 0:
            os.close(self._lock)
            self._lock = -1


def _logged_steps(metrics: Path) -> int:
    with open(metrics, "rb") as handle:
        return sum(1 for line in handle if line.strip())


def claim(path: str | Path, cfg: DictConfig, hydra_cfg: Any = None, resume: bool = False) -> RunDirectory:
    """Take `path` for this run or refuse it with `ConfigError`, before any work; write the resolved config.

    `resume`: the directory may hold this run's own earlier log (checkpointed runs continue there), and its recorded
    config stays until the run goes on (`RunDirectory.record`).
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
        if resume:  # this run is the one the directory holds: it can only wait for the other to end
            raise ConfigError(
                f"run directory {str(path)!r} is in use by another run right now: resume it once that "
                "run has ended (or stop it first)"
            ) from None
        raise ConfigError(
            f"run directory {str(path)!r} is in use by another run right now; give this one its own hydra.run.dir"
        ) from None
    run = RunDirectory(path, lock)
    try:
        metrics = path / METRICS_FILE
        if resume:
            _refuse_another_experiment(path, cfg)
            return run
        if metrics.exists() or (path / SUMMARY_FILE).exists():
            steps = _logged_steps(metrics) if metrics.exists() else 0
            status = _status(path / SUMMARY_FILE)
            go_on = (
                ""
                if finished_summary(path) is not None
                else ("resume=auto continues it (from its newest checkpoint, or from its start when it has none), or ")
            )
            raise ConfigError(
                f"run directory {str(path)!r} already holds a run ({steps} logged steps, {status}); it is never "
                f"overwritten: {go_on}give this run another hydra.run.dir"
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
    """A resumed run continues its own log: refuse a directory whose recorded config is another experiment's, or
    another length of a schedule that depends on it, or cannot be compared (naming the file and what is wrong)."""
    recorded = path / CONFIG_DIR / "config.yaml"
    if not recorded.exists():
        return
    where = f"resume into {str(path)!r}"
    theirs = recorded_settings(recorded, where)
    differs = differences(theirs, cfg)
    if differs and all(difference.absent for difference in differs):
        raise ConfigError(
            f"{where} compares this run with the settings {recorded} records, and it lacks settings "
            f"this run has ({described(differs)}): it was written before they existed (resume with "
            "them at their defaults), or it is cut short"
        )
    if differs:
        raise ConfigError(f"{where}, which holds another experiment: {described(differs)}")
    length = length_change(theirs, cfg)
    if length is not None:
        raise ConfigError(f"{where}: {length}")


def recorded_settings(recorded: Path, where: str) -> dict[str, Any]:
    """The flat settings of a recorded config (`experiments.run.resume.settings`); `ConfigError` naming the file and
    what is wrong with it when they cannot be read."""

    def unreadable(problem: str) -> ConfigError:
        return ConfigError(
            f"{where} compares this run with the settings {recorded} records, which {problem}; "
            "restore the file, or start the run in a new directory"
        )

    try:
        text = recorded.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise unreadable(f"is not UTF-8 (byte {error.object[error.start]:#04x} at offset {error.start})") from None
    except OSError as error:
        raise unreadable(f"cannot be read ({error.strerror})") from None
    if not text.strip():
        raise unreadable("is empty")
    try:
        loaded = OmegaConf.create(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise unreadable(f"is not valid YAML ({getattr(error, 'problem', None) or error}{at})") from None
    if not isinstance(loaded, DictConfig):
        raise unreadable("holds no mapping of settings")
    return flat(cast(dict[str, Any], OmegaConf.to_container(loaded)))  # a run's config: a mapping


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
    replace_file(directory / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    if hydra_cfg is not None:
        replace_file(directory / "overrides.yaml", OmegaConf.to_yaml(OmegaConf.to_container(hydra_cfg.overrides.task)))
        replace_file(directory / "hydra.yaml", OmegaConf.to_yaml({"hydra": hydra_cfg}))


def replace_file(path: Path, content: str | bytes) -> None:
    """Write `path` whole or not at all: `content` goes into a temporary file beside it, flushed to the disk, which
    then replaces it in one rename; `OSError` when that fails, with the temporary file removed."""
    partial = path.with_name(f".{path.name}.tmp")
    data = content.encode("utf-8") if isinstance(content, str) else content
    try:
        with open(partial, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    sync_directory(path.parent)


def sync_directory(path: Path) -> None:
    """Flush a directory's entries (files created, renamed or removed in it) to the disk."""
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def make_writable_dir(path: str | Path) -> list[Path]:
    """Create `path` if needed and prove a file can be written in it; `OSError` otherwise. Return the directories
    it created, deepest first."""
    path = Path(path)
    created = [p for p in (path, *path.parents) if not p.exists()]
    path.mkdir(parents=True, exist_ok=True)
    # A name of its own: under torchrun every rank probes the same directory at once.
    with tempfile.NamedTemporaryFile(dir=path, prefix=".write_test"):
        pass
    return created


def remove_if_empty(created: list[Path]) -> None:
    """Remove the directories `make_writable_dir` created (deepest first) while they are still empty."""
    for directory in created:
        try:
            directory.rmdir()
        except OSError:
            return  # not empty (or gone): what holds something stays, and so do its parents
