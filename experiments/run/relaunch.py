"""A job of several ranks on this node (`launch.nproc_per_node` > 1, every `cluster=slurm` job): the job runs itself
again under torchrun, once what its ranks would refuse has been refused here, in one line (torchrun follows a refusal
of its ranks with its own report: `launch.exit_once`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from experiments.run import rundir
from experiments.run.continuing import resumable_checkpoint
from experiments.step.checks import check_run
from models.registry import ConfigError


def torchrun_command(cfg: DictConfig, hydra_cfg: Any) -> list[str]:
    """The command that runs this job again as `launch.nproc_per_node` ranks on this node, into this job's
    directory (a SLURM job's, under `cluster=slurm`)."""
    overrides = [o for o in hydra_cfg.overrides.task if not o.startswith(("launch.", "hydra.run.dir="))]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={cfg.launch.nproc_per_node}",
        "-m",
        "experiments.train",
        *overrides,
        f"hydra.run.dir={hydra_cfg.runtime.output_dir}",
    ]


def launch_ranks(cfg: DictConfig, hydra_cfg: Any) -> float | None:
    """Run the job as `launch.nproc_per_node` ranks under torchrun, once what they would refuse has been refused here
    in one line; its exit code is the job's."""
    if cfg.launch.nproc_per_node < 1:
        raise SystemExit(f"moe-rl-lab: launch.nproc_per_node={cfg.launch.nproc_per_node} must be >= 1")
    # What every rank would refuse is refused here, once, before torchrun starts ranks and adds its own traceback to
    # their exit. Not the memory: measuring a GPU's creates a CUDA context this process would hold while the ranks run.
    try:
        check_run(cfg, cfg.launch.nproc_per_node, memory=False)
        check_run_directory(cfg, hydra_cfg)
    except ConfigError as error:
        raise SystemExit(f"moe-rl-lab: {error}") from None
    done = subprocess.run(torchrun_command(cfg, hydra_cfg))
    if done.returncode:
        raise SystemExit(done.returncode)
    summary = rundir.finished_summary(Path(hydra_cfg.runtime.output_dir))
    return summary["reward_last"] if summary else None


def check_run_directory(cfg: DictConfig, hydra_cfg: Any) -> None:
    """What rank 0 alone checks once the ranks have started, checked here first: that the run directory can be this
    run's (`rundir.claim`, whose lock is released again for rank 0 to take), and with `resume` the checkpoint the run
    continues from (`continuing.resumable_checkpoint`, on `launch.nproc_per_node` ranks), unless the run is finished
    and there is nothing to resume. A directory that changes between this check and the ranks' own is refused by
    the ranks, with torchrun's report after the line."""
    run_dir = Path(hydra_cfg.runtime.output_dir)
    resuming = cfg.resume is not None
    claimed = rundir.claim(run_dir, cfg, hydra_cfg, resume=resuming)
    try:
        finished = rundir.finished_summary(run_dir) if resuming else None
        if resuming and (finished is None or finished["steps"] < cfg.trainer.steps):
            resumable_checkpoint(cfg, run_dir, cfg.launch.nproc_per_node, finished)
    finally:
        claimed.release()
