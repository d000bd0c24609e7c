"""`python -m experiments.train`: one RL run (or, with `-m`, a Hydra sweep of runs), logged to its run directory.

The step itself is `experiments.trainer.RLTrainer.step`; this module runs the steps, evaluates on held-out prompts,
logs every step to `metrics.jsonl` and W&B, and ends with `summary.json` and a one-paragraph summary.

    python -m experiments.train algo=gspo routing.replay=none model.path=checkpoints/cold_start/tiny_moe-addition

Bad settings are refused before any work, in one line (`ConfigError`); any other exception is a bug and keeps its
traceback.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from tqdm import tqdm

from experiments.config import register_configs
from experiments.logger import RunLogger
from experiments.registry import ConfigError
from experiments.trainer import RLTrainer, mean_of
from models.policy import describe_policy

register_configs()


def run_name(cfg: DictConfig) -> str:
    replay = "" if cfg.routing.replay == "none" else f"+{cfg.routing.replay}"
    return f"{cfg.algo.name}{replay}-{cfg.model.name}-s{cfg.seed}"


def _sweep_group() -> str | None:
    """Runs of one Hydra multirun share a W&B group: the sweep directory's name."""
    try:
        hydra_cfg = HydraConfig.get()
    except ValueError:
        return None
    if hydra_cfg.mode is not None and hydra_cfg.mode.name == "MULTIRUN":
        return Path(hydra_cfg.sweep.dir).name
    return None


def summary_paragraph(summary: dict[str, Any]) -> str:
    def number(key: str, fmt: str) -> str:
        value = summary.get(key)
        return "n/a" if value is None else format(value, fmt)

    return (
        f"{summary['run']}: {summary['steps']} steps in {summary['wall_s']:.0f} s "
        f"({summary['step_s_mean']:.2f} s/step). Reward {summary['reward_first']:.3f} -> {summary['reward_last']:.3f} "
        f"(best {summary['reward_best']:.3f}); held-out pass@1 {number('eval_accuracy', '.3f')}, "
        f"greedy {number('eval_greedy_accuracy', '.3f')}. Mean clipped-token fraction "
        f"{summary['clip_token_frac_mean']:.2e}, token-ratio variance {summary['ratio_token_var_mean']:.2e}, "
        f"experts changed after one update {number('expert_change_per_update', '.2%')}; "
        f"{summary['skipped_steps']} skipped updates. Logs: {summary['run_dir']}"
    )


def train(cfg: DictConfig, run_dir: str | Path) -> dict[str, Any]:
    """Run the configured RL job in `run_dir`; return its summary (also written to `summary.json`)."""
    try:
        trainer = RLTrainer(cfg)
    except ConfigError as error:
        raise SystemExit(f"moe-rl-lab: {error}") from None
    t = cfg.trainer
    name = run_name(cfg)
    tags = [f"algo:{cfg.algo.name}", f"replay:{cfg.routing.replay}", f"model:{cfg.model.name}"]
    logger = RunLogger(run_dir, cfg, name, tags, _sweep_group())
    history: list[dict[str, Any]] = []
    start = time.perf_counter()
    try:
        bar = tqdm(range(t.steps), desc=name, unit="step", dynamic_ncols=True)
        for _ in bar:
            record = trainer.step()
            last = trainer.step_index == t.steps
            if last or (t.eval_every and trainer.step_index % t.eval_every == 0):
                record.update(trainer.evaluate())
            record["perf/elapsed_s"] = time.perf_counter() - start
            logger.log(record)
            history.append(record)
            bar.set_postfix(reward=f"{record['reward/mean']:.3f}", clip=f"{record['clip/token_frac']:.1e}")
    except BaseException:
        logger.abort()
        raise
    rewards = [r["reward/mean"] for r in history]
    final = history[-1]
    summary = {
        "status": "finished",
        "run": name,
        "run_dir": str(run_dir),
        "steps": len(history),
        "wall_s": time.perf_counter() - start,
        "step_s_mean": mean_of([r["perf/step_s"] for r in history]),
        "reward_first": rewards[0],
        "reward_last": rewards[-1],
        "reward_best": max(rewards),
        "eval_accuracy": final.get("eval/accuracy"),
        "eval_greedy_accuracy": final.get("eval/greedy_accuracy"),
        "clip_token_frac_mean": mean_of([r["clip/token_frac"] for r in history]),
        "ratio_token_var_mean": mean_of([r["ratio/token_var"] for r in history]),
        "skipped_steps": trainer.skipped_updates,
        "engine": trainer.engine.name,
        **trainer.plan.describe(),
        "policy": describe_policy(trainer.model),
    }
    if trainer.plan.track_routing:
        # The GSPO paper's "experts changed per update" is the drift after one update (minibatch index 1); the mean
        # over a step's minibatches counts minibatch 0, whose drift is 0 by construction.
        per_update = [r["routing/expert_change_per_update"] for r in history if "routing/expert_change_per_update" in r]
        summary["expert_change_per_update"] = mean_of(per_update) if per_update else None
        summary["expert_change_mean_over_minibatches"] = mean_of(
            [r["routing/expert_change_mean_over_minibatches"] for r in history]
        )
    if t.save_checkpoint:
        checkpoint = Path(run_dir) / "checkpoint"
        trainer.model.save_pretrained(checkpoint)
        trainer.tokenizer.save_pretrained(checkpoint)
        summary["checkpoint"] = str(checkpoint)
    logger.finish(summary)
    print(summary_paragraph(summary))
    return summary


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> float:
    run_dir = HydraConfig.get().runtime.output_dir
    summary = train(cfg, run_dir)
    return summary["reward_last"]


if __name__ == "__main__":
    main()
