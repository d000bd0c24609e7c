"""A run that goes on from a checkpoint (`resume=auto` or a checkpoint's path): which checkpoint it takes, the state
loaded into the trainer, and `metrics.jsonl` cut back to the checkpoint's step, said in one line."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from experiments.ranks import broadcast_object
from experiments.run import checkpoint, launch, rundir
from experiments.run.stops import stop_deferred
from experiments.step.trainer import RLTrainer
from models.registry import ConfigError


def restore(
    trainer: RLTrainer, cfg: DictConfig, run_dir: Path, finished: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """With `resume`, load the checkpoint it names and return the log lines up to its step (the rest of
    `metrics.jsonl` is cut: those steps run again); a fresh start otherwise, or when `auto` finds no checkpoint.
    `finished`: the summary of the finished run this one extends to a larger `trainer.steps`. Rank 0 finds and
    checks the checkpoint, and every rank meets its refusal before any collective."""
    if cfg.resume is None:
        return []
    ranks = trainer.ranks
    found = broadcast_object(launch.on_rank0(lambda: own_checkpoint(cfg, run_dir, ranks.world, finished), ranks), ranks)
    if found.path is not None:
        checkpoint.load(trainer, found.path)
    return launch.on_rank0(lambda: continue_log(run_dir, trainer.step_index, found, finished), ranks) or []


@dataclass(frozen=True)
class Found:
    """The checkpoint a run resumes from (None: from the start), and what was passed over or set aside to take it."""

    path: Path | None
    passed_over: list[str]  # why each newer checkpoint `auto` passed over does not load
    set_aside: list[str]  # each later checkpoint, and the name it was set aside as


def own_checkpoint(cfg: DictConfig, run_dir: Path, world: int, finished: dict[str, Any] | None) -> Found:
    """(rank 0) The checkpoint `resume` asks for (`resumable_checkpoint`), with the later ones set aside."""
    path, passed_over = resumable_checkpoint(cfg, run_dir, world, finished)
    if path is None:
        return Found(None, [], [])
    return Found(path, passed_over, checkpoint.set_aside_after(run_dir, checkpoint.saved_step(path)))


def resumable_checkpoint(
    cfg: DictConfig, run_dir: Path, world: int, finished: dict[str, Any] | None
) -> tuple[Path | None, list[str]]:
    """The checkpoint `resume` asks for, intact and this run's own on `world` ranks (`checkpoint.check`), and why
    each newer one `auto` passed over does not load; None from the start; `ConfigError` when there is none to take.
    It changes nothing in `run_dir`."""
    path, passed_over = checkpoint.find(run_dir, cfg.resume)
    if path is None and finished is not None:
        raise ConfigError(
            f"{run_dir} holds this run, finished after {finished['steps']} steps, and no checkpoint to "
            "extend it from (it ran with trainer.checkpoint_every=0): run the longer one in a new "
            "directory"
        )
    if path is not None:
        checkpoint.check(path, cfg, world)
    return path, passed_over


def continue_log(run_dir: Path, step: int, found: Found, finished: dict[str, Any] | None) -> list[dict[str, Any]]:
    """(rank 0) Cut `metrics.jsonl` back to `step`, say where the run resumes from, and return the lines it keeps."""
    metrics = run_dir / rundir.METRICS_FILE
    with stop_deferred():  # a stop lands after the cut
        dropped = checkpoint.cut_log(metrics, step)
    where = f"from {found.path} (step {step})" if found.path else "from the start: no checkpoint in the run directory"
    if found.passed_over:
        where += (
            f", the newest intact checkpoint, passing over {len(found.passed_over)} damaged: "
            f"{'; '.join(found.passed_over)}"
        )
    if found.set_aside:
        where += f"; kept for inspection, the later {', '.join(found.set_aside)}"
    extending = f"extending the run finished after {finished['steps']} steps: " if finished else ""
    print(
        f"moe-rl-lab: {extending}resuming {where}; {dropped} later line(s) of {metrics} are logged again",
        file=sys.stderr,
    )
    return [json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines()] if metrics.exists() else []
