"""`python -m experiments.train`: one RL run (or, with `-m`, a Hydra sweep of runs), logged to its run directory.

    python -m experiments.train algo=gspo routing.replay=none model.path=checkpoints/cold_start/tiny_moe-addition

The step is `experiments.step.trainer.RLTrainer.step`; this door runs the steps, evaluates on held-out prompts, logs
every step to `metrics.jsonl` and W&B and ends with `summary.json` and a one-paragraph summary. How the run lives
and ends, whatever happens (a refusal, a stop, divergence, a full disk), is `experiments.run.life`'s; a resumed run's
checkpoint and log, `experiments.run.continuing`'s; a job of several ranks runs itself again under torchrun
(`experiments.run.launch`); a job of a sweep ends as `experiments.run.sweep.as_sweep_job` says.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any, cast

if __name__ == "__main__":
    # Ctrl-C during the seconds the imports below take ends the process as it ends any program (exit code 130), not
    # in a traceback of whichever import it cut; `stop_signals` takes over once the run starts.
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from algos.objective import CLIP
from experiments.config import TrainConfig, refuse_mistyped_overrides, register_configs
from experiments.run import checkpoint, launch, relaunch
from experiments.run.continuing import restore
from experiments.run.life import Job, Life, live
from experiments.run.logger import sweep_group
from experiments.run.rundir import RunDirectory
from experiments.run.summary import run_name, summarize, summary_paragraph
from experiments.run.sweep import as_sweep_job
from experiments.run.threads import ThreadBudget
from experiments.step import metrics as m
from experiments.step.trainer import RLTrainer

register_configs()


def train(cfg: DictConfig, run_dir: str | Path, hydra_cfg: Any = None) -> dict[str, Any]:
    """Run the configured RL job in `run_dir` (on every rank under torchrun); return its summary (rank 0 also
    writes it to `summary.json`). A resumed run whose directory holds it finished is left as it is."""

    def build(life: Life) -> tuple[RLTrainer, ThreadBudget, list[dict[str, Any]]]:
        threads = ThreadBudget(cfg.trainer.threads)
        trainer = RLTrainer(cfg, life.ranks)
        history = restore(trainer, cfg, life.run_dir, life.finished)
        if cfg.resume is not None:  # the run goes on: the directory's record becomes this run's settings
            # rank 0 claimed the directory when the life began (`Life.begin`)
            life.on_rank0(lambda: cast(RunDirectory, life.claimed).record(cfg, hydra_cfg))
        return trainer, threads, history

    def run(life: Life, built: tuple[RLTrainer, ThreadBudget, list[dict[str, Any]]]) -> dict[str, Any]:
        try:
            return run_steps(life, *built, hydra_cfg)
        finally:
            built[0].close()  # what runs beside the trainer (the concurrent sampler's worker) stops with the run

    return live(
        Job(
            "the run",
            run,
            build,
            prepare=lambda: launch.start(cfg.device),
            resume=cfg.resume is not None,
            done=lambda finished: finished["steps"] >= cfg.trainer.steps,
        ),
        run_dir,
        cfg,
        hydra_cfg,
    )


def run_steps(
    life: Life, trainer: RLTrainer, threads: ThreadBudget, history: list[dict[str, Any]], hydra_cfg: Any
) -> dict[str, Any]:
    """The run's steps from where `history` ends, each evaluated where the settings say and committed whole."""
    cfg, t = trainer.cfg, trainer.cfg.trainer
    name = run_name(cfg)
    life.records = history

    def summary(status: str) -> dict[str, Any]:
        return summarize(trainer, life.records, status, name, life.run_dir, *life.elapsed())

    tags = [
        f"algo:{cfg.algo.name}",
        f"replay:{cfg.routing.replay}",
        f"routing_variant:{cfg.routing_variant.name}",
        f"model:{cfg.model.name}",
    ]
    with life.running(summary, t.steps, cfg, name, tags, sweep_group(hydra_cfg), resume=bool(history)):
        say_once_per_run(trainer, life)
        bar = life.progress(done=trainer.step_index)
        # the run's change on held-out prompts is measured against its own start, on the same prompts
        start_eval = trainer.evaluate() if t.eval_prompts and t.eval_start and trainer.step_index == 0 else {}
        if t.eval_split and trainer.step_index == 0:
            start_eval.update(trainer.evaluate(whole_split=True))
        for _ in range(trainer.step_index, t.steps):
            used = threads.threads  # the step's threads, measured over the step: the next step's follow the load
            threads.begin()
            record = trainer.step()
            threads.end()
            record[m.THREADS] = used
            record.update({m.started(name): value for name, value in start_eval.items()})
            start_eval = {}
            last = trainer.step_index == t.steps
            if t.eval_prompts and (last or (t.eval_every and trainer.step_index % t.eval_every == 0)):
                record.update(trainer.evaluate())
            if t.eval_split and last:
                record.update(trainer.evaluate(whole_split=True))
            record[m.ELAPSED] = life.elapsed()[0]
            saving = t.checkpoint_every and (last or trainer.step_index % t.checkpoint_every == 0)
            life.commit(
                record, then=(lambda: checkpoint.save(trainer, life.run_dir, t.keep_checkpoints)) if saving else None
            )
            bar.update(1)
            bar.set_postfix(reward=f"{record[m.REWARD]:.3f}", clip=f"{record[CLIP]:.1e}")
    result = summary("finished")
    if t.save_checkpoint:
        result["checkpoint"] = str(checkpoint.export(trainer, life.run_dir / "checkpoint"))
    life.finish(result)
    if trainer.ranks.main:
        print(summary_paragraph(result))
    return result


def say_once_per_run(trainer: RLTrainer, life: Life) -> None:
    """What a run's settings mean that a user may not expect, said once (rank 0)."""
    t = trainer.cfg.trainer
    if not trainer.ranks.main:
        return
    if t.checkpoint_every > t.steps:
        print(
            f"moe-rl-lab: trainer.checkpoint_every={t.checkpoint_every} is more than trainer.steps={t.steps}: the "
            "run's one checkpoint is its last step's",
            file=sys.stderr,
        )
    if t.eval_split and trainer.eval_split_batch * trainer.ranks.world < len(trainer.test_examples):
        print(
            f"moe-rl-lab: trainer.eval_split evaluates the {len(trainer.test_examples)} test prompts in batches of "
            f"{trainer.eval_split_batch} (per rank), as many as fit in the step's own memory",
            file=sys.stderr,
        )


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    hydra_cfg = HydraConfig.get()
    if cfg.launch.nproc_per_node != 1 and "WORLD_SIZE" not in os.environ:
        return relaunch.launch_ranks(cfg, hydra_cfg)
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return train(cfg, hydra_cfg.runtime.output_dir, hydra_cfg)["reward_last"]
    return as_sweep_job(lambda: train(cfg, hydra_cfg.runtime.output_dir, hydra_cfg))


if __name__ == "__main__":
    refuse_mistyped_overrides(sys.argv[1:], TrainConfig)
    main()
