"""How a run's ranks start and stay in step: torchrun's process group, one line on refusal, parents that die.

`torchrun --nproc_per_node=N -m experiments.train ...` (or `launch.nproc_per_node=N`, which runs the job again
under torchrun) starts N ranks; `start` joins them into a process group (gloo on CPU, nccl on CUDA) and returns this
process's `Ranks`. What each rank computes, and how the step's numbers combine over ranks, is the step's
(`experiments.step.trainer`); here are the run-level pieces: the group, the one line a refusal prints (rank 0 alone),
ranks that die with their parent, work done on rank 0 alone whose refusal every rank raises, a job of several ranks
that checks, before torchrun starts them, all they would refuse (settings, run directory, checkpoint), since torchrun
follows a refusal of its ranks with its own report (`exit_once`), and the Hydra callback that refuses an output
directory in one line before Hydra writes there and gives every rank rank 0's (`DirectoryGuard`). The collectives
themselves are `experiments.step.data_parallel`'.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, read_write

from experiments.ranks import Ranks, broadcast_object
from experiments.run import rundir
from models.registry import ConfigError

# How long a rank other than 0 that meets a refusal waits for rank 0 to print it (`exit_once`); rank 0 ends the wait.
QUIET_RANK_WAIT_S = 10.0


def start(device: str) -> Ranks:
    """Join the process group torchrun set up (its env vars), or run alone; refuse a backend the machine lacks."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Ranks()
    cuda = device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r} under torchrun needs CUDA (nccl), and this machine has none: device=cpu")
    die_with_parent(signal.SIGKILL)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
        atexit.register(_leave_group)
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return Ranks(dist.get_rank(), dist.get_world_size())


def _leave_group() -> None:
    """Destroy the process group while the interpreter is still whole: left to interpreter teardown, gloo's worker
    threads can still hold tensors whose release needs the GIL, and the rank ends by SIGABRT ("terminate called
    without an active exception") after its work is done; seen in 2 of 9 two-rank test runs under load."""
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_once(message: str) -> NoReturn:
    """End this process with `message` as its one line (exit code 1), printed by rank 0 alone: under torchrun every
    rank meets the same refusal, and N copies of one line would bury it. The other ranks end with the same code,
    silently (torchrun's `RANK`; a process without torchrun is rank 0).

    Plain torchrun then prints its own report of the failed ranks after the line (a traceback of its own process and
    a table of every rank's exit, some 40 lines), and no rank can keep it quiet without hiding a failure: torchrun's
    agent raises `ChildFailedError` for every rank that ends other than with exit code 0, whatever the rank wrote
    before (an error file only fills the table), and exit code 0 would tell a shell, SLURM or a sweep that a refused
    job finished. A refusal keeps its exit code 1; a job that starts its ranks itself (`launch.nproc_per_node` > 1,
    every `cluster=slurm` job) refuses before torchrun starts instead (`relaunch.launch_ranks`).

    The other ranks wait up to `QUIET_RANK_WAIT_S` before they end: torchrun ends every rank as soon as one fails, and
    a rank that ended first on a loaded machine would have rank 0 killed before its line is out. Rank 0's own end
    then ends their wait (torchrun's SIGTERM, taken with the default action)."""
    if int(os.environ.get("RANK", "0")) == 0:
        raise SystemExit(message) from None
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(QUIET_RANK_WAIT_S)
    raise SystemExit(1) from None


def die_with_parent(sig: signal.Signals = signal.SIGKILL) -> None:
    """End this process with `sig` when its parent dies (Linux's PR_SET_PDEATHSIG). A rank whose torchrun agent was
    killed (kill -9, a lost SLURM step) gets SIGKILL instead of waiting forever on a store nobody serves (SIGKILL: a
    rank blocked inside a collective runs no Python handler); `resume=auto` goes on from its last checkpoint. A joblib
    sweep worker whose Hydra process was killed gets SIGTERM, so its job ends as interrupted (summary written)
    instead of running on, orphaned."""
    if not sys.platform.startswith("linux"):
        return
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() == 1:  # the parent died before the call: nobody is left to send the signal
        os.kill(os.getpid(), sig)


def on_rank0(work: Callable[[], Any], ranks: Ranks) -> Any:
    """Run `work` on rank 0 alone (its result there, None on the others), and raise its refusal on every rank: a
    rank that stopped alone would leave the others waiting for it in their next collective, for ever. A file it
    cannot write (`OSError`) is refused in one line, naming the file."""
    result, refusal = None, None
    if ranks.main:
        try:
            result = work()
        except ConfigError as error:
            refusal = str(error)
        except OSError as error:
            refusal = f"cannot write {error.filename}: {error.strerror}"
    refusal = broadcast_object(refusal, ranks)
    if refusal is not None:
        raise ConfigError(refusal)
    return result


# -- the run's directory, before Hydra writes there --------------------------------------------------------------------


def _refuse_unwritable(key: str, path: str) -> list[Path]:
    try:
        return rundir.make_writable_dir(path)
    except OSError as error:
        exit_once(f"moe-rl-lab: {key}={path!r} cannot be created: {error.strerror}")


class DirectoryGuard(Callback):
    """Hydra creates its output directory before the task runs, with a traceback when it cannot: refuse such a
    directory first, in one line (`hydra.callbacks` in conf/train.yaml and conf/sft.yaml). Under torchrun every
    rank composes its own config, and a run directory named by the clock would differ from rank to rank: rank 0's
    is every rank's."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            try:
                ranks = start(config.get("device", "cpu"))
            except ConfigError as error:
                exit_once(f"moe-rl-lab: {error}")
            chosen = broadcast_object(str(config.hydra.run.dir), ranks)
            with read_write(config.hydra.run):
                config.hydra.run.dir = chosen
        _refuse_unwritable("hydra.run.dir", config.hydra.run.dir)

    created: list[Path] = []  # the directories the sweep's start created (`on_multirun_start`)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            exit_once(
                "moe-rl-lab: a sweep (-m) under torchrun would run every job on every rank; launch the sweep "
                "itself with cluster=slurm, or torchrun one run at a time"
            )
        self.created = _refuse_unwritable("hydra.sweep.dir", config.hydra.sweep.dir)
