"""What an RL run's summary says: `summary.json`'s fields and the paragraph the run ends with, from the trainer and the
records logged so far, however the run ended (`status`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from algos.objective import CLIP, TOKEN_RATIO_VAR
from experiments.run import checkpoint, provenance
from experiments.run.recipe import start_recipe
from experiments.step import metrics as m
from experiments.step.trainer import RLTrainer
from models.policy import describe_policy


def run_name(cfg: DictConfig) -> str:
    replay = "" if cfg.routing.replay == "none" else f"+{cfg.routing.replay}"
    variant = "" if cfg.routing_variant.name == "none" else f"+{cfg.routing_variant.name}"
    return f"{cfg.algo.name}{replay}{variant}-{cfg.model.name}-s{cfg.seed}"


def summarize(
    trainer: RLTrainer, history: list[dict[str, Any]], status: str, run: str, run_dir: Path, wall_s: float, cpu_s: float
) -> dict[str, Any]:
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
        **trainer.rollouts.describe(),  # where the rollouts came from, and their engine
        "correction": trainer.correction.name,
        **trainer.plan.describe(),
        "policy": describe_policy(trainer.model),
        "start_sha256": trainer.start_sha256,  # the weights the run started from (a cold start's weights_sha256)
        **start_recipe(trainer.cfg.model.path),  # and the recipe they are a draw of (experiments.run.recipe)
        # the versions and kernels of this process, of every process that computed its steps, and of its start
        **provenance.run_fields(trainer.cfg, checkpoint.computed_under(trainer)),
    }
    staleness = [r[m.STALENESS_MAX] for r in history if m.STALENESS_MAX in r]
    if staleness:  # the concurrent source's: how far behind θ_old its samples were, and what its policy did past it
        summary["staleness_mean"] = over_steps(m.STALENESS_MEAN)
        summary["staleness_max"] = max(staleness)
        for key, name in (
            (m.SAMPLER_WAIT_TIME, "sampler_wait_s"),
            (m.DROPPED_BATCHES, "dropped_batches"),
            (m.PAST_BOUND_ROWS, "past_bound_rows"),
        ):
            summary[name] = sum(r[key] for r in history if key in r)
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
        f"fraction {number('clip_token_frac_mean', '.2e')}, token-ratio variance "
        f"{number('ratio_token_var_mean', '.2e')}, "
        f"experts changed after one update {number('expert_change_per_update', '.2%')}; "
        f"{summary['skipped_steps']} skipped updates. Logs: {summary['run_dir']}"
    )
