"""Sweeps (`-m`): every job checked before the first starts, a failed job reported while the others run.

`RunGuard` is the Hydra callback of `conf/train.yaml`. Before the sweep it composes every job the basic sweeper will
launch and runs the start-up checks of each (`experiments.trainer.check_run`: settings, model files, task, memory),
so a bad cell of a grid is named at once; the entry point then reports a refused or crashing job and goes on with
the next (`job_failed`), and the sweep exits non-zero at the end, listing the failed jobs.
"""

from __future__ import annotations

import sys
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from experiments import rundir
from experiments.registry import ConfigError
from experiments.trainer import check_run

FAILED_JOBS: list[str] = []  # this process's failed jobs, for `RunGuard.on_multirun_end`


def job_failed(hydra_cfg: Any, why: str) -> None:
    """Record a sweep job that was refused or crashed (its message or traceback is already printed)."""
    FAILED_JOBS.append(f"job {hydra_cfg.job.num} ({' '.join(hydra_cfg.overrides.task)}): {why}")


def sweep_jobs(cfg: DictConfig) -> list[list[str]]:
    """The override list of every job the basic sweeper will launch for `cfg` (its params, then the command line)."""
    params = [f"{key}={value}" for key, value in (cfg.hydra.sweeper.get("params") or {}).items()]
    parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
    overrides = parser.parse_overrides([*params, *OmegaConf.to_container(cfg.hydra.overrides.task)])
    return [list(job) for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]


class RunGuard(rundir.DirectoryGuard):
    """Hydra's output directory checked before Hydra writes there; in a sweep, every job checked before the first
    starts, and the sweep failed at the end if any job failed."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        super().on_multirun_start(config, **kwargs)
        FAILED_JOBS.clear()
        if not str(config.hydra.sweeper.get("_target_", "")).endswith("BasicSweeper"):
            return  # other sweepers choose their jobs as they go
        loader = GlobalHydra.instance().config_loader()
        jobs = sweep_jobs(config)
        refused = []
        for number, overrides in enumerate(jobs):
            try:
                check_run(loader.load_sweep_config(master_config=config, sweep_overrides=overrides))
            except ConfigError as error:
                refused.append(f"  job {number} ({' '.join(overrides)}): {error}")
        if refused:
            print(f"moe-rl-lab: {len(refused)} of {len(jobs)} jobs of this sweep will be refused; the other "
                  f"{len(jobs) - len(refused)} run:\n" + "\n".join(refused), file=sys.stderr, flush=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if FAILED_JOBS:
            raise SystemExit(f"moe-rl-lab: {len(FAILED_JOBS)} job(s) of the sweep failed:\n  " + "\n  ".join(FAILED_JOBS))


