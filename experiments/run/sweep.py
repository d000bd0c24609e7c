"""Sweeps (`-m`): every job checked before the first starts, a failed job reported while the others run.

`RunGuard` is the Hydra callback of `conf/train.yaml`. Before the sweep it refuses a SLURM launcher (`cluster=slurm`)
on a machine without SLURM's commands, composes every job the basic sweeper will launch and runs the start-up checks
of each (`experiments.step.checks.check_run`: settings, model files, task, memory), so a bad cell of a grid is named at
once and a sweep whose every job would be refused launches none (and leaves behind no directory it made), and
refuses a parallel launcher whose jobs would share more threads than the machine has (before a single run it refuses
`cluster=slurm`, which only submits a sweep's jobs); the entry point then reports a refused or crashing job and goes
on with the next, and the sweep exits non-zero at the end, listing the jobs whose directory holds no finished run
(whatever launcher ran them, in this process or others), each with why: refused by the start-up check (and its
reason), or refused or crashed as it ran. `as_sweep_job` is how a job of a sweep ends: an interrupt stops the sweep,
a refusal or a bug is reported and the next job runs.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from experiments.run import launch, rundir
from experiments.step.checks import check_run
from models.registry import ConfigError

SLURM_COMMANDS = ("sbatch", "srun")  # what submitit's SLURM launcher runs to submit and start each job


def submits_to_slurm(launcher: DictConfig) -> bool:
    """Whether Hydra's launcher (`cluster=slurm` sets it) is submitit's SLURM launcher."""
    return str(launcher.get("_target_", "")).endswith("SlurmLauncher")


def check_slurm_sweep(config: DictConfig) -> None:
    """`cluster=slurm` submits a sweep's jobs with SLURM's commands: refuse, in one line, a machine without them."""
    missing = [command for command in SLURM_COMMANDS if shutil.which(command) is None]
    if submits_to_slurm(config.hydra.launcher) and missing:
        raise SystemExit(
            f"moe-rl-lab: cluster=slurm submits every job of the sweep with {' and '.join(SLURM_COMMANDS)}, and this "
            f"machine has no {' or '.join(missing)}: run the sweep on a SLURM login node, or leave cluster=slurm out "
            "(hydra/launcher=joblib runs the jobs side by side on this machine)"
        )


def check_slurm_single_run(config: DictConfig) -> None:
    """Without `-m`, Hydra runs the job itself, here: `cluster=slurm` would then start its `launch.nproc_per_node`
    ranks (one per GPU of a SLURM node) on this machine. Refuse that in one line; the ranks of a SLURM job (torchrun
    set WORLD_SIZE) are single runs with `cluster=slurm` on purpose."""
    if submits_to_slurm(config.hydra.launcher) and "WORLD_SIZE" not in os.environ:
        raise SystemExit(
            "moe-rl-lab: cluster=slurm submits the jobs of a sweep to SLURM, and without -m this is one run on this "
            "machine (it would start a SLURM node's ranks, one per GPU, here): add -m to submit it (python -m "
            "experiments.train -m cluster=slurm ...), or leave cluster=slurm out"
        )


def unfinished_jobs(sweep_dir: Path, refused: dict[str, str] | None = None) -> list[str]:
    """The job directories of a sweep that hold no finished run, with why (the file system is the record every
    launcher shares: the basic launcher's jobs run here, joblib's and SLURM's in other processes). `refused`: the
    jobs the sweep's start-up check refused, {directory name: why}."""
    refused = refused or {}
    unfinished = []
    for job in sorted(p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
        summary = job / rundir.SUMMARY_FILE
        if job.name in refused and not summary.exists():
            unfinished.append(f"{job.name} (refused by the sweep's start-up check: {refused[job.name]})")
        elif not summary.exists():
            unfinished.append(f"{job.name} (refused or crashed as it ran: no {rundir.SUMMARY_FILE})")
        elif rundir.finished_summary(job) is None:
            unfinished.append(f"{job.name} (status {json.loads(summary.read_text()).get('status')!r})")
    return unfinished


def check_threads(config: DictConfig) -> None:
    """A parallel launcher's jobs x each job's threads must fit the machine's cores (oversubscribed OpenMP threads
    spin against each other: steps 10-20x slower here)."""
    launcher = str(config.hydra.launcher.get("_target_", ""))
    if not launcher.endswith("JoblibLauncher"):
        return
    cores = len(os.sched_getaffinity(0))
    jobs = config.hydra.launcher.n_jobs
    jobs = cores + 1 + jobs if jobs < 0 else jobs  # joblib's -1: every core, -2: all but one, ...
    threads = config.trainer.threads
    if threads is None or jobs * threads > cores:
        raise SystemExit(
            f"moe-rl-lab: hydra.launcher.n_jobs={config.hydra.launcher.n_jobs} ({jobs} jobs) x trainer.threads="
            f"{threads} threads each is more than the {cores} cores of this machine; set both so that n_jobs x "
            f"threads <= {cores}, e.g. hydra.launcher.n_jobs={cores} trainer.threads=1"
        )


def sweep_jobs(cfg: DictConfig) -> list[list[str]]:
    """The override list of every job the basic sweeper will launch for `cfg` (its params, then the command line)."""
    params = [f"{key}={value}" for key, value in (cfg.hydra.sweeper.get("params") or {}).items()]
    parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
    command_line = cast(list[str], OmegaConf.to_container(cfg.hydra.overrides.task))  # Hydra's list of overrides
    overrides = parser.parse_overrides([*params, *command_line])
    return [list(job) for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]


class RunGuard(launch.DirectoryGuard):
    """Hydra's output directory checked before Hydra writes there; in a sweep, every job checked before the first
    starts, and the sweep failed at the end if any job failed."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        check_slurm_single_run(config)
        super().on_run_start(config, **kwargs)

    refused: dict[str, str] = {}  # the jobs the start-up check refused: {job directory's name: why}

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        check_slurm_sweep(config)
        super().on_multirun_start(config, **kwargs)
        try:
            check_threads(config)
            self.check_jobs(config)
        except SystemExit:  # no job is launched: the sweep leaves no directory it made behind
            rundir.remove_if_empty(self.created)
            raise

    def check_jobs(self, config: DictConfig) -> None:
        """Every job the basic sweeper will launch, checked (`check_run`); refused jobs named at once, and none
        launched when every one is refused."""
        if not str(config.hydra.sweeper.get("_target_", "")).endswith("BasicSweeper"):
            return  # other sweepers choose their jobs as they go
        loader = GlobalHydra.instance().config_loader()
        jobs = sweep_jobs(config)
        refused = []
        self.refused = {}
        for number, overrides in enumerate(jobs):
            job = loader.load_sweep_config(master_config=config, sweep_overrides=overrides)
            try:
                check_run(job)
            except ConfigError as error:
                refused.append(f"  job {number} ({' '.join(overrides)}): {error}")
                with open_dict(job):  # the directory the launcher gives job `number` (hydra.sweep.subdir)
                    job.hydra.job.num = number
                try:
                    self.refused[str(job.hydra.sweep.subdir)] = str(error)
                except OmegaConfBaseException:  # a subdir naming what only the launcher sets: listed as unfinished
                    pass
        if refused and len(refused) == len(jobs):
            raise SystemExit(
                f"moe-rl-lab: every one of the {len(jobs)} jobs of this sweep would be refused, so none "
                "is launched:\n" + "\n".join(refused)
            )
        if refused:
            print(
                f"moe-rl-lab: {len(refused)} of {len(jobs)} jobs of this sweep will be refused; the other "
                f"{len(jobs) - len(refused)} run:\n" + "\n".join(refused),
                file=sys.stderr,
                flush=True,
            )

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        unfinished = unfinished_jobs(Path(config.hydra.sweep.dir), self.refused)
        if unfinished:
            raise SystemExit(
                f"moe-rl-lab: {len(unfinished)} job(s) of the sweep did not finish (each said why above):"
                "\n  " + "\n  ".join(unfinished)
            )


def as_sweep_job(run: Callable[[], dict[str, Any]]) -> float | None:
    """Run one job of a sweep (`run` returns its summary): its last reward, for Hydra's sweep return value. An
    interrupted job stops the sweep (its exit code); a refusal is printed and a bug's traceback too, and the sweep goes
    on with its next job (and lists the failed ones at its end, `RunGuard`). A joblib worker ends with the sweep that
    started it."""
    sweep = os.getppid()
    worker = multiprocessing.current_process().name != "MainProcess"  # a launcher's worker (joblib), not the sweep
    if worker:
        launch.die_with_parent(signal.SIGTERM)
    try:
        return run()["reward_last"]
    except SystemExit as exit:
        if isinstance(exit.code, int) and worker and os.getppid() != sweep:
            # Interrupted because the sweep died: nobody will collect this job, and joblib's worker would catch the
            # exit and wait for its next job, holding the sweep's stdout and stderr open. End the process now.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(exit.code)
        if isinstance(exit.code, int):  # interrupted: the sweep stops too
            raise
        print(exit.code, file=sys.stderr)
    except Exception:  # a bug: its traceback, then the next job
        traceback.print_exc()
    return None
