"""One run's life, the same for an RL run, a cold start and a probe: its directory claimed, its stops turned into a
summary, its records committed whole, and one line however it ends. Each door enters it in one call, `live(job, ...)`,
with its `Job`: what it is called, its start-up checks, what builds it and what runs it.

    live(job, run_dir, cfg, hydra_cfg):
        with stop_signals():                               SIGTERM, Ctrl-C: `StopRequested`, raised where it is safe
            life = Life.begin(...)                         kernels pinned, `job.prepare`, the directory claimed (rank 0)
            with life.starting():                          what a bad setting or a stop does before the first step
                built = job.build(life)
            job.run(life, built):
                life.start_logging(cfg, name, tags, group) metrics.jsonl and W&B (rank 0)
                with life.running(summary):                how the job ends when it cannot go on
                    for ...: life.commit(record, then=...) a record logged and counted whole, a stop after it
                life.finish(summary(...))                  summary.json, W&B finished
            life.release()                                 however it ended

How it ends: bad settings are refused before any work, in one line (`ConfigError`, exit code 1); any other exception is
a bug and keeps its traceback (the run directory keeps every committed record and no summary); SIGTERM or Ctrl-C keeps
the records committed so far, finishes W&B, writes `summary.json` with `status: interrupted` and says so in one line
(exit code 143 or 130), also when the stop arrives while W&B starts or while a record is committed (it lands after the
commit); numbers non-finite for good (`Diverged`) end with `status: diverged`; a failure outside the run's settings and
numbers (`models.registry.RunFailed`: a full disk or a vanished directory, a concurrent sampler whose worker raised or
died or sent a batch the trainer must not train on) with `status: failed` where it can still be written, each in one
line (exit code 1); the life cycle names no part that raises them. With several ranks a stop any rank receives ends
every rank after the same record (`commit`), and rank 0 alone prints.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, NoReturn, TypeVar, cast

from omegaconf import DictConfig
from tqdm import tqdm

from experiments.ranks import Ranks, broadcast_object, gather_objects
from experiments.run import launch, rundir
from experiments.run.launch import exit_once
from experiments.run.logger import RunLogger, write_summary
from experiments.run.stops import Deferral, StopRequested, raise_stop, stop_deferred, stop_signals
from models import cpu_kernels
from models.registry import ConfigError, Diverged, RunFailed


def stop_together(ranks: Ranks) -> None:
    """With several ranks, a stop waits for the end of the record, where every rank learns whether any rank received
    one and all stop together: a rank that stopped on its own would leave the others waiting for it in the next
    collective, for ever. One process stops where the signal finds it (`stop_signals`)."""
    if not ranks.active:
        return
    signums = gather_objects(Deferral.pending.signum if Deferral.pending else 0, ranks)
    if any(signums):
        raise_stop(StopRequested(max(signums)))


class _Unstarted:
    """The logger of a rank other than 0 (the run directory, W&B and the summary are rank 0's), and rank 0's until
    its `RunLogger` has started: a stop during W&B's start-up still leaves `summary.json`."""

    lost = None  # no log was opened, so none can be lost

    def __init__(self, summary_dir: Path | None) -> None:
        self.summary_dir = summary_dir

    def log(self, record: dict[str, Any]) -> None:
        pass

    def finish(self, summary: dict[str, Any], exit_code: int = 0) -> None:
        if self.summary_dir is None:
            return
        try:
            write_summary(self.summary_dir, summary)
        except OSError as error:
            raise rundir.StorageError(
                f"cannot write {rundir.SUMMARY_FILE} in {self.summary_dir}: {error.strerror}"
            ) from None

    def abort(self) -> None:
        pass


class Life:
    """The life cycle of the job in `run_dir` on `ranks` (module docstring); `what` names the job in its lines (an RL
    run, a cold start, a probe); `finished`, the summary of the finished run a resumed job's directory holds (None:
    none)."""

    def __init__(
        self,
        run_dir: Path,
        ranks: Ranks,
        claimed: rundir.RunDirectory | None,
        what: str,
        finished: dict[str, Any] | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.ranks = ranks
        self.claimed = claimed
        self.what = what
        self.finished = finished
        self.logger: Any = _Unstarted(run_dir if ranks.main else None)
        self.records: list[dict[str, Any]] = []  # every record committed (a resumed run's earlier ones first)
        Deferral.joint = ranks.active

    @classmethod
    def begin(
        cls,
        run_dir: str | Path,
        cfg: DictConfig,
        hydra_cfg: Any,
        what: str,
        prepare: Callable[[], Ranks | None] = lambda: None,
        resume: bool = False,
    ) -> Life:
        """Begin the job in `run_dir`: pin the CPU kernels before anything computes (the libraries fix their choice
        then), `prepare` (the job's own start-up checks, or the start of its ranks: their `Ranks`), then claim the
        directory (rank 0; every rank meets its refusal, in one line); with `resume`, read the summary of the
        finished run the directory holds."""
        try:
            cpu_kernels.pin(cfg.cpu_kernels)
            ranks = prepare() or Ranks()
        except ConfigError as error:
            exit_once(f"moe-rl-lab: {error}")
        run_dir = Path(run_dir)
        claimed, problem, finished = None, None, None
        if ranks.main:
            try:
                claimed = rundir.claim(run_dir, cfg, hydra_cfg, resume=resume)
                finished = rundir.finished_summary(run_dir) if resume else None
            except ConfigError as error:
                problem = str(error)
        problem, finished = broadcast_object((problem, finished), ranks)  # every rank does what rank 0 found
        if problem:
            exit_once(f"moe-rl-lab: {problem}")
        return cls(run_dir, ranks, claimed, what, finished)

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """What builds the job: a refusal ends it in one line, a stop says it came before the first record; either
        way the directory is released."""
        try:
            yield
        except BaseException as error:
            self.release()
            if isinstance(error, ConfigError):
                exit_once(f"moe-rl-lab: {error}")
            if isinstance(error, StopRequested):
                if self.ranks.main:
                    print(
                        f"moe-rl-lab: {self.what} was interrupted by {error.signal_name} before its first step",
                        file=sys.stderr,
                    )
                raise SystemExit(error.exit_code) from None
            raise

    def start_logging(
        self, cfg: DictConfig, name: str, tags: list[str], group: str | None = None, resume: bool = False
    ) -> None:
        """`metrics.jsonl` and W&B in the run directory (rank 0)."""
        if self.ranks.main:
            self.logger = RunLogger(self.run_dir, cfg, name, tags, group, resume=resume)

    @contextlib.contextmanager
    def running(
        self,
        summary: Callable[[str], dict[str, Any]],
        total: int,
        cfg: DictConfig,
        name: str,
        tags: list[str],
        group: str | None = None,
        resume: bool = False,
    ) -> Iterator[None]:
        """The job's records, `name`: its log opened (`start_logging`: `tags`, `group`, `resume`), its clocks started
        (`elapsed`), its progress bar (`progress`) closed before any last line, and how it ends when it cannot go on
        (module docstring). `summary(status)` is the summary of the job as it stands; `total` the records it was to
        commit."""
        self._clock = (time.perf_counter(), time.process_time())
        self._name, self._total = name, total
        try:
            with contextlib.ExitStack() as self._closing:
                self.start_logging(cfg, name, tags, group, resume)
                yield
        except StopRequested as stop:
            try:
                self.logger.finish(summary("interrupted"), exit_code=stop.exit_code)
            except rundir.StorageError as error:
                raise SystemExit(f"moe-rl-lab: interrupted by {stop.signal_name}, and {error}") from None
            if self.ranks.main:
                print(
                    f"\nmoe-rl-lab: interrupted by {stop.signal_name} after {len(self.records)} of {total} steps; "
                    f"{self.run_dir / rundir.METRICS_FILE} holds them and {self.run_dir / rundir.SUMMARY_FILE} says "
                    "status 'interrupted'",
                    file=sys.stderr,
                )
            raise SystemExit(stop.exit_code) from None
        except Diverged as error:
            step = len(self.records) + 1
            self.end_early(
                summary("diverged"),
                "diverged",
                f"step {step}: {error}",
                f"{self.what} diverged in step {step}: {error}",
            )
        except RunFailed as error:  # a StorageError, a concurrent sampler that failed, ...
            self.end_early(summary("failed"), "failed", str(error), str(error))
        except ConfigError as error:  # a setting only the job's own start could refuse (a probe's later setting)
            self.logger.abort()
            exit_once(f"moe-rl-lab: {error}")
        except BaseException:
            self.logger.abort()
            raise

    def elapsed(self) -> tuple[float, float]:
        """Wall-clock and this process's CPU seconds since the job's records began (`running`): what the job took, and
        what it cost."""
        wall, cpu = self._clock
        return time.perf_counter() - wall, time.process_time() - cpu

    def progress(self, done: int = 0) -> tqdm[NoReturn]:
        """The job's progress bar, `done` of its records already behind it (a resumed run's): drawn by rank 0, closed
        when `running` ends, before any line it prints."""
        bar = tqdm(
            total=self._total,
            initial=done,
            desc=self._name,
            unit="step",
            dynamic_ncols=True,
            disable=not self.ranks.main,
        )
        return self._closing.enter_context(bar)

    def commit(self, record: dict[str, Any], then: Callable[[], object] | None = None) -> None:
        """Log `record` and count it (`records`), then run `then` (a checkpoint), all before a stop can land; with
        several ranks, stop together after it."""
        with stop_deferred():
            self.logger.log(record)
            self.records.append(record)
            if then is not None:
                then()
        stop_together(self.ranks)

    def finish(self, summary: dict[str, Any]) -> None:
        """`summary.json`, W&B finished: the job ended as planned."""
        try:
            self.logger.finish(summary)
        except rundir.StorageError as error:
            raise SystemExit(f"moe-rl-lab: {error}") from None

    def end_early(self, summary: dict[str, Any], status: str, why: str, line: str) -> NoReturn:
        """End a job that cannot go on (every rank raises together): `summary.json` with `status` and, under that
        key, `why`, W&B finished as failed, and `line` from rank 0, saying what the run directory holds (exit code
        1)."""
        summary[status] = why
        try:
            self.logger.finish(summary, exit_code=1)
        except rundir.StorageError as storage:
            raise SystemExit(f"moe-rl-lab: {line}; and {storage}") from None
        held = (
            f"{self.run_dir / rundir.METRICS_FILE} holds {len(self.records)} step(s), and "
            if self.logger.lost is None
            else ""
        )  # a log removed under the run holds nothing to point to
        exit_once(f"moe-rl-lab: {line}. {held}{self.run_dir / rundir.SUMMARY_FILE} says status '{status}'")

    def on_rank0(self, work: Callable[[], Any]) -> Any:
        """`launch.on_rank0`: work of rank 0 alone whose refusal every rank raises."""
        return launch.on_rank0(work, self.ranks)

    def release(self) -> None:
        if self.claimed is not None:
            self.claimed.release()
            self.claimed = None


Built = TypeVar("Built")
Result = TypeVar("Result")


@dataclass(frozen=True)
class Job(Generic[Built, Result]):
    """A job as `live` runs it. `what` names it in its lines ("the run", "the cold start", "the probe"); `prepare` is
    its own start-up checks, or the start of its ranks (their `Ranks`), before its directory is claimed; `build`
    makes what it runs with (a refusal or a stop there ends it in one line, `Life.starting`); `run` commits its
    records and returns its result. A job that may `resume` finds the summary of the finished run its directory holds
    in `Life.finished`, and `done` says whether that run is already this job (a re-launched sweep skips it)."""

    what: str
    run: Callable[[Life, Built], Result]
    build: Callable[[Life], Built] = lambda life: cast(Built, None)  # a job that builds nothing: Built is None
    prepare: Callable[[], Ranks | None] = lambda: None
    resume: bool = False
    done: Callable[[dict[str, Any]], bool] = lambda finished: False


def live(job: Job[Built, Result], run_dir: str | Path, cfg: DictConfig, hydra_cfg: Any) -> Result | dict[str, Any]:
    """Run `job` in `run_dir` as every job lives (module docstring); its result, or the summary of the finished run
    the directory already holds when that run is `job.done`. The directory is released however the job ends."""
    with stop_signals():
        life = Life.begin(run_dir, cfg, hydra_cfg, job.what, job.prepare, resume=job.resume)
        try:
            if life.finished is not None and job.done(life.finished):
                if life.claimed is not None:
                    print(
                        f"moe-rl-lab: {life.run_dir} already holds this {job.what.removeprefix('the ')}, finished "
                        f"after {life.finished['steps']} steps; nothing to resume",
                        file=sys.stderr,
                    )
                return life.finished
            with life.starting():
                built = job.build(life)
            return job.run(life, built)
        finally:
            life.release()
