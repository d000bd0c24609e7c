"""`python -m experiments.train`: one RL run (or, with `-m`, a Hydra sweep of runs), logged to its run directory.

The step itself is `experiments.step.trainer.RLTrainer.step`; this module claims the run directory, runs the steps,
evaluates on held-out prompts, logs every step to `metrics.jsonl` and W&B, and ends with `summary.json` and a
one-paragraph summary, however the run ends:

- bad settings are refused before any work, in one line (`ConfigError`); any other exception is a bug and keeps its
  traceback (the run directory keeps every finished step and no `summary.json`);
- SIGTERM or Ctrl-C: the steps finished so far stay logged, W&B is finished, `summary.json` says
  `status: interrupted`, and one line says so (exit code 143 or 130), also when the stop arrives while W&B starts or
  while a step is committed (it lands after the commit: the step's log line and its checkpoint); with several ranks,
  a stop any rank receives ends every rank after the same step;
- a loss, gradient, weights or logits that turn non-finite for good (`models.registry`): the steps before
  stay logged, `summary.json` says `status: diverged`, and one line says where and why (exit code 1);
- a full disk or a vanished run directory: one line naming the file and the last step the log holds,
  `summary.json` says `status: failed` where it can still be written, and a partial checkpoint is removed (exit
  code 1).

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, NoReturn

if __name__ == "__main__":
    # Ctrl-C during the seconds the imports below take ends the process as it ends any program (exit code 130), not
    # in a traceback of whichever import it cut; `stop_signals` takes over once the run starts.
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig
from tqdm import tqdm

from algos.objective import CLIP, TOKEN_RATIO_VAR
from experiments.config import register_configs
from experiments.run import checkpoint, launch, provenance, rundir
from experiments.run.launch import exit_once
from experiments.run.logger import RunLogger, write_summary
from experiments.run.threads import ThreadBudget
from experiments.step import metrics as m
from experiments.step.checks import check_run
from experiments.step.ranks import Ranks, barrier, broadcast_object, gather_objects
from experiments.step.trainer import RLTrainer
from models import cpu_kernels
from models.policy import describe_policy
from models.registry import ConfigError, Diverged

register_configs()


class Interrupted(BaseException):
    """The run was asked to stop (SIGTERM, or SIGINT / Ctrl-C). A BaseException, as KeyboardInterrupt: the
    `except Exception` of a library the signal lands in (W&B's logging, say) must not swallow it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.signal_name = signal.Signals(signum).name
        self.exit_code = 128 + signum


class _Deferral:
    """Whether a block a stop must not cut is running (see `stop_deferred`), whether the run's ranks stop together
    (see `stop_together`), the stop that arrived meanwhile, and whether the run is already stopping."""

    active = False
    joint = False
    pending: Interrupted | None = None
    stopping = False


def _stop(interrupted: Interrupted) -> NoReturn:
    """Raise the stop. Later signals change nothing while the run ends: a launcher that sees one rank end signals the
    others, which must still finish their summary."""
    _Deferral.pending, _Deferral.stopping = None, True
    raise interrupted


@contextmanager
def stop_signals() -> Iterator[None]:
    """Turn SIGTERM and SIGINT into `Interrupted` for the run inside; the previous handlers come back after."""

    def stop(signum: int, frame: Any) -> None:
        if _Deferral.stopping:
            return
        if _Deferral.active or _Deferral.joint:  # raised after the block, or where the ranks decide together
            _Deferral.pending = _Deferral.pending or Interrupted(signum)
            return
        _stop(Interrupted(signum))

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _Deferral.joint, _Deferral.pending, _Deferral.stopping = False, None, False


@contextmanager
def stop_deferred() -> Iterator[None]:
    """Run the block whole: a stop that arrives meanwhile is raised after it. A step's commit needs this (its log
    line written, then counted: never a line the summary does not count; then its checkpoint, whose writer,
    `torch.distributed.checkpoint`, catches whatever is raised inside it, `Interrupted` included, and raises its own
    `CheckpointException` instead), and so does the log's cut on resume. Blocking the signals on this thread is not
    enough: the kernel hands a process's signal to any thread that does not block it (W&B's, torch's), and Python
    then runs the handler on this thread at its next instruction, so the handler itself defers while a block is
    active. With several ranks the stop is left for `stop_together`."""
    _Deferral.active = True
    try:
        yield
    finally:
        _Deferral.active = False
    if _Deferral.pending is not None and not _Deferral.joint:
        _stop(_Deferral.pending)


def stop_together(ranks: Ranks) -> None:
    """With several ranks, a stop waits for the end of the step, where every rank learns whether any rank received
    one and all stop together: a rank that stopped on its own would leave the others waiting for it in the next
    collective, for ever. One process stops where the signal finds it (`stop_signals`)."""
    if not ranks.active:
        return
    signums = gather_objects(_Deferral.pending.signum if _Deferral.pending else 0, ranks)
    if any(signums):
        _stop(Interrupted(max(signums)))


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
        # the versions and kernels of this process, of every process that computed its steps, and of its start
        **provenance.run_fields(trainer.cfg, checkpoint.computed_under(trainer)),
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
        _Deferral.joint = ranks.active
        claimed, problem, finished = None, None, None
        if ranks.main:
            try:
                claimed = rundir.claim(run_dir, cfg, hydra_cfg, resume=cfg.resume is not None)
                finished = rundir.finished_summary(run_dir) if cfg.resume is not None else None
            except ConfigError as error:
                problem = str(error)
        problem, finished = broadcast_object((problem, finished), ranks)  # every rank does what rank 0 found
        if problem:
            exit_once(f"moe-rl-lab: {problem}")
        if finished is not None and finished["steps"] >= cfg.trainer.steps:  # a re-launched sweep skips what is done
            if claimed is not None:
                claimed.release()
                print(f"moe-rl-lab: {run_dir} already holds this run, finished after {finished['steps']} steps; "
                      "nothing to resume", file=sys.stderr)
            return finished
        try:
            threads = ThreadBudget(cfg.trainer.threads)
            trainer = RLTrainer(cfg, ranks)
            history = restore(trainer, cfg, run_dir, finished)
            if cfg.resume is not None:  # the run goes on: the directory's record becomes this run's settings
                launch.on_rank0(lambda: claimed.record(cfg, hydra_cfg), ranks)
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


def restore(trainer: RLTrainer, cfg: DictConfig, run_dir: Path,
            finished: dict[str, Any] | None) -> list[dict[str, Any]]:
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
    """(rank 0) The checkpoint `resume` asks for, intact and this run's own (`checkpoint.check`), with the later ones
    set aside; `ConfigError` when there is none to take."""
    path, passed_over = checkpoint.find(run_dir, cfg.resume)
    if path is None and finished is not None:
        raise ConfigError(f"{run_dir} holds this run, finished after {finished['steps']} steps, and no checkpoint to "
                          "extend it from (it ran with trainer.checkpoint_every=0): run the longer one in a new "
                          "directory")
    if path is None:
        return Found(None, [], [])
    checkpoint.check(path, cfg, world)
    return Found(path, passed_over, checkpoint.set_aside_after(run_dir, checkpoint.saved_step(path)))


def continue_log(run_dir: Path, step: int, found: Found, finished: dict[str, Any] | None) -> list[dict[str, Any]]:
    """(rank 0) Cut `metrics.jsonl` back to `step`, say where the run resumes from, and return the lines it keeps."""
    metrics = run_dir / rundir.METRICS_FILE
    with stop_deferred():  # a stop lands after the cut
        dropped = checkpoint.cut_log(metrics, step)
    where = f"from {found.path} (step {step})" if found.path else "from the start: no checkpoint in the run directory"
    if found.passed_over:
        where += (f", the newest intact checkpoint, passing over {len(found.passed_over)} damaged: "
                  f"{'; '.join(found.passed_over)}")
    if found.set_aside:
        where += f"; kept for inspection, the later {', '.join(found.set_aside)}"
    extending = f"extending the run finished after {finished['steps']} steps: " if finished else ""
    print(f"moe-rl-lab: {extending}resuming {where}; {dropped} later line(s) of {metrics} are logged again",
          file=sys.stderr)
    return [json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines()] if metrics.exists() else []


class _Unstarted:
    """The logger of a rank other than 0 (the run directory, W&B and the summary are rank 0's), and rank 0's until
    its `RunLogger` has started: a stop during W&B's start-up still leaves `summary.json`."""

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
            raise rundir.StorageError(f"cannot write {rundir.SUMMARY_FILE} in {self.summary_dir}: "
                                      f"{error.strerror}") from None

    def abort(self) -> None:
        pass


def _run(trainer: RLTrainer, threads: ThreadBudget, cfg: DictConfig, run_dir: Path, history: list[dict[str, Any]],
         hydra_cfg: Any) -> dict[str, Any]:
    t = cfg.trainer
    main = trainer.ranks.main
    name = run_name(cfg)
    tags = [f"algo:{cfg.algo.name}", f"replay:{cfg.routing.replay}", f"routing_variant:{cfg.routing_variant.name}",
            f"model:{cfg.model.name}"]
    logger: Any = _Unstarted(run_dir if main else None)
    start, cpu_start = time.perf_counter(), time.process_time()

    def summary(status: str) -> dict[str, Any]:
        return summarize(trainer, history, status, name, run_dir, time.perf_counter() - start,
                         time.process_time() - cpu_start)

    try:
        if main:
            logger = RunLogger(run_dir, cfg, name, tags, _sweep_group(hydra_cfg), resume=bool(history))
            if t.checkpoint_every > t.steps:
                print(f"moe-rl-lab: trainer.checkpoint_every={t.checkpoint_every} is more than trainer.steps="
                      f"{t.steps}: the run's one checkpoint is its last step's", file=sys.stderr)
            if t.eval_split and trainer.eval_split_batch * trainer.ranks.world < len(trainer.test_examples):
                print(f"moe-rl-lab: trainer.eval_split evaluates the {len(trainer.test_examples)} test prompts in "
                      f"batches of {trainer.eval_split_batch} (per rank), as many as fit in the step's own memory",
                      file=sys.stderr)
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
            with stop_deferred():  # the step's commit: its log line, then counted, then its checkpoint
                logger.log(record)
                history.append(record)
                if t.checkpoint_every and (last or trainer.step_index % t.checkpoint_every == 0):
                    checkpoint.save(trainer, run_dir, t.keep_checkpoints)
            stop_together(trainer.ranks)
            bar.set_postfix(reward=f"{record[m.REWARD]:.3f}", clip=f"{record[CLIP]:.1e}")
        bar.close()
    except Interrupted as stop:
        try:
            logger.finish(summary("interrupted"), exit_code=stop.exit_code)
        except rundir.StorageError as error:
            raise SystemExit(f"moe-rl-lab: interrupted by {stop.signal_name}, and {error}") from None
        if main:
            print(f"\nmoe-rl-lab: interrupted by {stop.signal_name} after {len(history)} of {t.steps} steps; "
                  f"{run_dir / rundir.METRICS_FILE} holds them and {run_dir / rundir.SUMMARY_FILE} says status "
                  "'interrupted'", file=sys.stderr)
        raise SystemExit(stop.exit_code) from None
    except Diverged as error:
        end_early(summary("diverged"), "diverged", f"step {trainer.step_index}: {error}",
                  f"the run diverged in step {trainer.step_index}: {error}", logger, run_dir)
    except rundir.StorageError as error:
        end_early(summary("failed"), "failed", str(error), str(error), logger, run_dir)
    except BaseException:
        logger.abort()
        raise
    result = summary("finished")
    if t.save_checkpoint:
        result["checkpoint"] = str(export(trainer, run_dir / "checkpoint"))
    try:
        logger.finish(result)
    except rundir.StorageError as error:
        raise SystemExit(f"moe-rl-lab: {error}") from None
    if main:
        print(summary_paragraph(result))
    return result


def end_early(summary: dict[str, Any], status: str, why: str, line: str, logger: Any, run_dir: Path) -> NoReturn:
    """End a run that cannot go on (every rank raises together): `summary.json` with `status` and, under that key,
    `why`, W&B finished as failed, and `line` from rank 0, saying what the run directory holds (exit code 1)."""
    summary[status] = why
    try:
        logger.finish(summary, exit_code=1)
    except rundir.StorageError as storage:
        raise SystemExit(f"moe-rl-lab: {line}; and {storage}") from None
    exit_once(f"moe-rl-lab: {line}. {run_dir / rundir.METRICS_FILE} holds {summary['steps']} step(s), and "
              f"{run_dir / rundir.SUMMARY_FILE} says status '{status}'")


def export(trainer: RLTrainer, directory: Path) -> Path:
    """`save_pretrained` of the policy and its tokenizer (the full weights, gathered from every rank under FSDP2)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if trainer.ranks.main:
        trainer.model.save_pretrained(directory, state_dict=state)
        trainer.tokenizer.save_pretrained(directory)
    barrier(trainer.ranks)
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
