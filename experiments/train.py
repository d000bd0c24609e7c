"""`python -m experiments.train`: one RL run (or, with `-m`, a Hydra sweep of runs), logged to its run directory.

The step itself is `experiments.step.trainer.RLTrainer.step`; this module claims the run directory, runs the steps,
evaluates on held-out prompts, logs every step to `metrics.jsonl` and W&B, and ends with `summary.json` and a
one-paragraph summary, however the run ends:

- bad settings are refused before any work, in one line (`ConfigError`); any other exception is a bug and keeps its
  traceback (the run directory keeps every finished step and no `summary.json`);
- SIGTERM or Ctrl-C: the steps finished so far stay logged, W&B is finished, `summary.json` says
  `status: interrupted`, and one line says so (exit code 143 or 130), also when the stop arrives while a
  checkpoint is being written (it lands after the write);
- a loss, gradient, weights or logits that turn non-finite for good (`models.registry`): the steps before
  stay logged, `summary.json` says `status: diverged`, and one line says where and why (exit code 1);
- a full disk or a vanished run directory: one line naming the file and the last step it holds (exit code 1).

Under torchrun every rank meets the same refusal, and rank 0 alone prints it.

In a sweep (`-m`), every job is checked before the first one starts, and a refused or failed job is reported while
the others run; the sweep exits non-zero when any job failed, listing them.

    python -m experiments.train algo=gspo routing.replay=none model.path=checkpoints/cold_start/tiny_moe-addition
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig
from tqdm import tqdm

from algos.objective import CLIP, TOKEN_RATIO_VAR
from experiments.config import register_configs
from experiments.run import checkpoint, launch, rundir
from experiments.run.launch import exit_once
from experiments.run.logger import RunLogger
from experiments.run.threads import ThreadBudget
from experiments.step import metrics as m
from experiments.step.checks import check_run
from experiments.step.trainer import RLTrainer
from models import cpu_kernels
from models.policy import describe_policy
from models.registry import ConfigError, Diverged

register_configs()


class Interrupted(BaseException):
    """The run was asked to stop (SIGTERM, or SIGINT / Ctrl-C). A BaseException, as KeyboardInterrupt: the
    `except Exception` of a library the signal lands in (W&B's logging, say) must not swallow it."""

    def __init__(self, signal_name: str, exit_code: int) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name
        self.exit_code = exit_code


class _Deferral:
    """Whether a block a stop must not cut is running (see `stop_deferred`), and the stop that arrived meanwhile."""

    active = False
    pending: Interrupted | None = None


@contextmanager
def stop_signals() -> Iterator[None]:
    """Turn SIGTERM and SIGINT into `Interrupted` for the run inside; the previous handlers come back after."""

    def stop(signum: int, frame: Any) -> None:
        interrupted = Interrupted(signal.Signals(signum).name, 128 + signum)
        if _Deferral.active:  # raised when the block is done (stop_deferred)
            _Deferral.pending = _Deferral.pending or interrupted
            return
        raise interrupted

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def stop_deferred() -> Iterator[None]:
    """Run the block whole: a stop that arrives meanwhile is raised after it. Two blocks need this: a step's commit
    (its log line written, then counted: never a line the summary does not count) and a checkpoint's write
    (`torch.distributed.checkpoint` catches whatever is raised inside it, `Interrupted` included, and raises its
    own `CheckpointException` instead). Blocking the signals on this thread is not enough: the kernel hands a
    process's signal to any thread that does not block it (W&B's, torch's), and Python then runs the handler on this
    thread at its next instruction, so the handler itself defers while a block is active."""
    _Deferral.active, _Deferral.pending = True, None
    try:
        yield
    finally:
        _Deferral.active = False
    if _Deferral.pending is not None:
        pending, _Deferral.pending = _Deferral.pending, None
        raise pending


def run_name(cfg: DictConfig) -> str:
    replay = "" if cfg.routing.replay == "none" else f"+{cfg.routing.replay}"
    variant = "" if cfg.routing_variant.name == "none" else f"+{cfg.routing_variant.name}"
    return f"{cfg.algo.name}{replay}{variant}-{cfg.model.name}-s{cfg.seed}"


def _hydra() -> Any:
    try:
        return HydraConfig.get()
    except ValueError:
        return None


def _sweep_group(hydra_cfg: Any) -> str | None:
    """Runs of one Hydra multirun share a W&B group: the sweep directory's name."""
    if hydra_cfg is not None and hydra_cfg.mode == RunMode.MULTIRUN:
        return Path(hydra_cfg.sweep.dir).name
    return None


def summarize(trainer: RLTrainer, history: list[dict[str, Any]], status: str, run: str, run_dir: Path,
              wall_s: float, cpu_s: float) -> dict[str, Any]:
    """`summary.json`: how the run ended and its headline numbers (None where no step finished)."""
    rewards = [r[m.REWARD] for r in history]
    final = history[-1] if history else {}

    def over_steps(key: str) -> float | None:
        values = [r[key] for r in history if r.get(key) is not None]
        return m.mean_of(values) if values else None

    summary = {
        "status": status,
        "ranks": trainer.ranks.world,
        "run": run,
        "run_dir": str(run_dir),
        "steps": len(history),
        "steps_planned": trainer.cfg.trainer.steps,
        "wall_s": wall_s,
        "cpu_s": cpu_s,  # this process's CPU time over the run's steps: what the run cost
        "step_s_mean": over_steps(m.STEP_TIME),
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "reward_best": max(rewards) if rewards else None,
        "eval_greedy_accuracy_start": history[0].get(m.started(m.EVAL_GREEDY)) if history else None,
        "eval_accuracy": final.get(m.EVAL_ACCURACY),
        "eval_greedy_accuracy": final.get(m.EVAL_GREEDY),
        # the mean gain over the run's evaluations (the area above its start, per step; `metrics.gain_area`)
        "eval_greedy_gain_area": greedy_gain_area(history),
        "eval_split_greedy_accuracy_start": history[0].get(m.started(m.EVAL_SPLIT_GREEDY)) if history else None,
        "eval_split_greedy_accuracy": final.get(m.EVAL_SPLIT_GREEDY),
        "clip_token_frac_mean": over_steps(CLIP),
        "ratio_token_var_mean": over_steps(TOKEN_RATIO_VAR),
        "skipped_steps": trainer.skipped_updates,
        "engine": trainer.engine.name,
        "engine_numerics": "the trainer's own model" if trainer.engine.shares_trainer_weights else str(trainer.engine.numerics),
        "engine_details": trainer.engine.describe(),
        "correction": trainer.correction.name,
        **trainer.plan.describe(),
        "policy": describe_policy(trainer.model),
        "start_sha256": trainer.start_sha256,  # the weights the run started from (a cold start's weights_sha256)
        "kernels": cpu_kernels.describe(trainer.cfg.cpu_kernels),
    }
    if trainer.plan.track_routing:
        # The GSPO paper's "experts changed per update" is the drift after one update (minibatch index 1); the mean
        # over a step's minibatches counts minibatch 0, whose drift is 0 by construction.
        summary["expert_change_per_update"] = over_steps(m.DRIFT_PER_UPDATE)
        summary["expert_change_mean_over_minibatches"] = over_steps(m.DRIFT_OVER_MINIBATCHES)
    return summary


def greedy_gain_area(history: list[dict[str, Any]]) -> float | None:
    """`metrics.gain_area` of the held-out greedy curve, its start at step 0; None without a start and one more."""
    start = history[0].get(m.started(m.EVAL_GREEDY)) if history else None
    points = [(r[m.STEP], r[m.EVAL_GREEDY]) for r in history if m.EVAL_GREEDY in r]
    if start is None or not points:
        return None
    return m.gain_area([0, *(step for step, _ in points)], [start, *(value for _, value in points)])


def summary_paragraph(summary: dict[str, Any]) -> str:
    def number(key: str, fmt: str) -> str:
        value = summary.get(key)
        return "n/a" if value is None else format(value, fmt)

    return (
        f"{summary['run']}: {summary['steps']} steps in {summary['wall_s']:.0f} s "
        f"({number('step_s_mean', '.2f')} s/step). Reward {number('reward_first', '.3f')} -> "
        f"{number('reward_last', '.3f')} (best {number('reward_best', '.3f')}); held-out pass@1 "
        f"{number('eval_accuracy', '.3f')}, greedy {number('eval_greedy_accuracy_start', '.3f')} -> "
        f"{number('eval_greedy_accuracy', '.3f')} (mean gain over the run {number('eval_greedy_gain_area', '+.3f')}; "
        f"whole test split {number('eval_split_greedy_accuracy_start', '.3f')} -> "
        f"{number('eval_split_greedy_accuracy', '.3f')}). Mean clipped-token "
        f"fraction {number('clip_token_frac_mean', '.2e')}, token-ratio variance {number('ratio_token_var_mean', '.2e')}, "
        f"experts changed after one update {number('expert_change_per_update', '.2%')}; "
        f"{summary['skipped_steps']} skipped updates. Logs: {summary['run_dir']}"
    )


def train(cfg: DictConfig, run_dir: str | Path, hydra_cfg: Any = None) -> dict[str, Any]:
    """Run the configured RL job in `run_dir` (on every rank under torchrun); return its summary (rank 0 also
    writes it to `summary.json`)."""
    run_dir = Path(run_dir)
    with stop_signals():
        try:
            cpu_kernels.pin(cfg.cpu_kernels)  # before the process computes anything: the libraries fix their choice then
            ranks = launch.start(cfg.device)
        except ConfigError as error:
            exit_once(f"moe-rl-lab: {error}")
        claimed, problem, finished = None, None, None
        if ranks.main:
            try:
                claimed = rundir.claim(run_dir, cfg, hydra_cfg, resume=cfg.resume is not None)
                finished = rundir.finished_summary(run_dir) if cfg.resume is not None else None
            except ConfigError as error:
                problem = str(error)
        problem, finished = launch.broadcast((problem, finished), ranks)  # every rank does what rank 0 found
        if problem:
            exit_once(f"moe-rl-lab: {problem}")
        if finished is not None:  # a re-launched sweep skips the jobs that are done
            if claimed is not None:
                claimed.release()
                print(f"moe-rl-lab: {run_dir} already holds this run, finished after {finished['steps']} steps; "
                      "nothing to resume", file=sys.stderr)
            return finished
        try:
            threads = ThreadBudget(cfg.trainer.threads)
            trainer = RLTrainer(cfg, ranks)
            history = restore(trainer, cfg, run_dir)
        except BaseException as error:
            if claimed is not None:
                claimed.release()
            if isinstance(error, ConfigError):
                exit_once(f"moe-rl-lab: {error}")
            if isinstance(error, Interrupted):
                if ranks.main:
                    print(f"moe-rl-lab: interrupted by {error.signal_name} before the first step", file=sys.stderr)
                raise SystemExit(error.exit_code) from None
            raise
        try:
            return _run(trainer, threads, cfg, run_dir, history, hydra_cfg)
        finally:
            if claimed is not None:
                claimed.release()


def restore(trainer: RLTrainer, cfg: DictConfig, run_dir: Path) -> list[dict[str, Any]]:
    """With `resume`, load the checkpoint it names and return the log lines up to its step (the rest of
    `metrics.jsonl` is cut: those steps run again); a fresh start otherwise, or when `auto` finds no checkpoint."""
    if cfg.resume is None:
        return []
    ranks = trainer.ranks
    found, passed_over = launch.broadcast(checkpoint.find(run_dir, cfg.resume) if ranks.main else None, ranks)
    step = 0
    if found is not None:
        checkpoint.load(trainer, found)
        step = trainer.step_index
    if not ranks.main:
        return []
    metrics = run_dir / rundir.METRICS_FILE
    dropped = checkpoint.cut_log(metrics, step)
    where = f"from {found} (step {step})" if found is not None else "from the start: no checkpoint in the run directory"
    if passed_over:
        where += f", the newest intact checkpoint, passing over {len(passed_over)} damaged: {'; '.join(passed_over)}"
    print(f"moe-rl-lab: resuming {where}; {dropped} later line(s) of {metrics} are logged again", file=sys.stderr)
    return [json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines()] if metrics.exists() else []


class _Silent:
    """The logger of a rank other than 0: the run directory, W&B and the summary are rank 0's."""

    def log(self, record: dict[str, Any]) -> None:
        pass

    def finish(self, summary: dict[str, Any], exit_code: int = 0) -> None:
        pass

    def abort(self) -> None:
        pass


def _run(trainer: RLTrainer, threads: ThreadBudget, cfg: DictConfig, run_dir: Path, history: list[dict[str, Any]],
         hydra_cfg: Any) -> dict[str, Any]:
    t = cfg.trainer
    main = trainer.ranks.main
    name = run_name(cfg)
    tags = [f"algo:{cfg.algo.name}", f"replay:{cfg.routing.replay}", f"routing_variant:{cfg.routing_variant.name}",
            f"model:{cfg.model.name}"]
    try:
        logger = RunLogger(run_dir, cfg, name, tags, _sweep_group(hydra_cfg), resume=bool(history)) if main else _Silent()
    except rundir.StorageError as error:
        raise SystemExit(f"moe-rl-lab: {error}") from None
    start, cpu_start = time.perf_counter(), time.process_time()
    try:
        bar = tqdm(range(trainer.step_index, t.steps), desc=name, unit="step", dynamic_ncols=True,
                   initial=trainer.step_index, total=t.steps, disable=not main)
        # the run's change on held-out prompts is measured against its own start, on the same prompts
        start_eval = trainer.evaluate() if t.eval_prompts and t.eval_start and trainer.step_index == 0 else {}
        if t.eval_split and trainer.step_index == 0:
            start_eval.update(trainer.evaluate(whole_split=True))
        for _ in bar:
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
            record[m.ELAPSED] = time.perf_counter() - start
            with stop_deferred():  # the step's commit
                logger.log(record)
                history.append(record)
            if t.checkpoint_every and trainer.step_index % t.checkpoint_every == 0:
                with stop_deferred():
                    checkpoint.save(trainer, run_dir, t.keep_checkpoints)
            bar.set_postfix(reward=f"{record[m.REWARD]:.3f}", clip=f"{record[CLIP]:.1e}")
        bar.close()
    except Interrupted as stop:
        summary = summarize(trainer, history, "interrupted", name, run_dir, time.perf_counter() - start,
                            time.process_time() - cpu_start)
        try:
            logger.finish(summary, exit_code=stop.exit_code)
        except rundir.StorageError as error:
            raise SystemExit(f"moe-rl-lab: interrupted by {stop.signal_name}, and {error}") from None
        if main:
            print(f"\nmoe-rl-lab: interrupted by {stop.signal_name} after {len(history)} of {t.steps} steps; "
                  f"{run_dir / rundir.METRICS_FILE} holds them and {run_dir / rundir.SUMMARY_FILE} says status "
                  "'interrupted'", file=sys.stderr)
        raise SystemExit(stop.exit_code) from None
    except Diverged as error:
        summary = summarize(trainer, history, "diverged", name, run_dir, time.perf_counter() - start,
                            time.process_time() - cpu_start)
        diverged(summary, f"step {trainer.step_index}: {error}", logger, run_dir)
    except rundir.StorageError as error:
        logger.abort()
        raise SystemExit(f"moe-rl-lab: {error}") from None
    except BaseException:
        logger.abort()
        raise
    summary = summarize(trainer, history, "finished", name, run_dir, time.perf_counter() - start,
                        time.process_time() - cpu_start)
    if t.save_checkpoint:
        summary["checkpoint"] = str(export(trainer, run_dir / "checkpoint"))
    try:
        logger.finish(summary)
    except rundir.StorageError as error:
        raise SystemExit(f"moe-rl-lab: {error}") from None
    if main:
        print(summary_paragraph(summary))
    return summary


def diverged(summary: dict[str, Any], where: str, logger: Any, run_dir: Path) -> NoReturn:
    """End a run that diverged (every rank raises `Diverged` together) `where` says: `summary.json` with status
    `diverged` and why, W&B finished as failed, one line from rank 0; exit code 1."""
    summary["diverged"] = where
    try:
        logger.finish(summary, exit_code=1)
    except rundir.StorageError as storage:
        raise SystemExit(f"moe-rl-lab: the run diverged in {where}; and {storage}") from None
    exit_once(f"moe-rl-lab: the run diverged in {where}. {run_dir / rundir.METRICS_FILE} holds the step(s) before "
              f"it ({summary['steps']}), and {run_dir / rundir.SUMMARY_FILE} says status 'diverged'")


def export(trainer: RLTrainer, directory: Path) -> Path:
    """`save_pretrained` of the policy and its tokenizer (the full weights, gathered from every rank under FSDP2)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if trainer.ranks.main:
        trainer.model.save_pretrained(directory, state_dict=state)
        trainer.tokenizer.save_pretrained(directory)
    launch.barrier(trainer.ranks)
    return directory


# -- sweeps: every job checked first, a failed job reported while the others run ------------------------------------

def torchrun_command(cfg: DictConfig, hydra_cfg: Any) -> list[str]:
    """The command that runs this job again as `launch.nproc_per_node` ranks on this node, into this job's
    directory (a SLURM job's, under `cluster=slurm`)."""
    overrides = [o for o in hydra_cfg.overrides.task if not o.startswith(("launch.", "hydra.run.dir="))]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cfg.launch.nproc_per_node}",
            "-m", "experiments.train", *overrides, f"hydra.run.dir={hydra_cfg.runtime.output_dir}"]


def launch_ranks(cfg: DictConfig, hydra_cfg: Any) -> float | None:
    """Run the job as `launch.nproc_per_node` ranks under torchrun; its exit code is the job's."""
    import subprocess

    if cfg.launch.nproc_per_node < 1:
        raise SystemExit(f"moe-rl-lab: launch.nproc_per_node={cfg.launch.nproc_per_node} must be >= 1")
    # What every rank would refuse is refused here, once, before torchrun starts ranks and adds its own traceback to
    # their exit. Not the memory: measuring a GPU's creates a CUDA context this process would hold while the ranks run.
    try:
        check_run(cfg, cfg.launch.nproc_per_node, memory=False)
    except ConfigError as error:
        raise SystemExit(f"moe-rl-lab: {error}") from None
    done = subprocess.run(torchrun_command(cfg, hydra_cfg))
    if done.returncode:
        raise SystemExit(done.returncode)
    summary = rundir.finished_summary(Path(hydra_cfg.runtime.output_dir))
    return summary["reward_last"] if summary else None


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    hydra_cfg = HydraConfig.get()
    if cfg.launch.nproc_per_node != 1 and "WORLD_SIZE" not in os.environ:
        return launch_ranks(cfg, hydra_cfg)
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return train(cfg, hydra_cfg.runtime.output_dir, hydra_cfg)["reward_last"]
    sweep = os.getppid()
    worker = multiprocessing.current_process().name != "MainProcess"  # a launcher's worker (joblib), not the sweep
    if worker:
        launch.die_with_parent(signal.SIGTERM)
    try:
        return train(cfg, hydra_cfg.runtime.output_dir, hydra_cfg)["reward_last"]
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


if __name__ == "__main__":
    main()
