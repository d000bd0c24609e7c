"""`python -m benchmarks.replay_gap`: how far the trainer's log-probs stay from the ones its ratios divide by, with no
replay, ID replay (the experts) and full replay (the experts and their gate weights: `routing_variant=full_replay`).

    python -m benchmarks.replay_gap model=tiny_moe model.path=CHECKPOINT rollout.precision=bf16 trainer.lr=3e-4

On the run the Hydra overrides describe (any `experiments.train` key), after `--warm-steps` ordinary RL steps:

- R3, training–inference mismatch: one rollout batch, sampled by the engine with its routing and gates recorded;
  at θ_old, before any update, the trainer scores it without replay, replaying the engine's experts, and replaying
  the engine's experts and gates; each against μ_old, the engine's own log-probs. The engine differs from the
  trainer as `rollout.*` says (with all of it off the gap is the KV cache's rounding).
- R2, staleness: the same batch's minibatches are trained on one after the other without replay (the update the
  gap is measured after), and before minibatch j's update (θ after j updates) it is scored without replay,
  replaying θ_old's experts, and replaying θ_old's experts and gates (both recorded by a π_old pass at θ_old);
  each against π_old.

Reported per setting: the mean |Δ log p| over the response tokens (the statistic of miles #2722), its maximum, and
the share of activated experts the unreplayed forward routes differently from the replayed trace. `--json-out`
writes every number.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, cast

import torch
from hydra import compose, initialize_config_dir

from algos import group_advantages
from algos.aggregation import masked, masked_mean
from algos.routing_variants.full_replay import GateReplay
from analysis.report import markdown_table
from experiments.config import PROJECT_ROOT, register_configs
from experiments.step.batch import Minibatch, collect_rollout, minibatch_order, split_minibatches
from experiments.step.engines import EngineNumerics, RolloutEngine, Sampling
from experiments.step.old_policy import OldPolicy
from experiments.step.scoring import ScoreOptions, Scores
from experiments.step.sources.synchronous import SynchronousSource
from experiments.step.trainer import RLTrainer
from models.registry import ConfigError
from models.routing.measures import routing_drift
from models.routing.trace import RoutingTrace

SETTINGS = ("none", "ID replay", "ID + gate weights")


def gap(logp: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mean and max |logp − reference| over the response tokens in `mask`."""
    diff = masked((logp - reference).abs(), mask)
    return {"mean_abs": float(masked_mean(diff, mask)), "max_abs": float(diff.max())}


def three_ways(trainer: RLTrainer, mb: Minibatch, trace: RoutingTrace, reference: torch.Tensor) -> dict[str, Any]:
    """The minibatch scored without replay, with `trace`'s experts, and with its experts and gates, against
    `reference`; the unreplayed forward's expert change against the trace too."""
    with torch.no_grad():
        scores: dict[str, Scores] = {
            "none": trainer.score(trainer.model, mb, ScoreOptions(record=True)),
            "ID replay": trainer.score(trainer.model, mb, ScoreOptions(replay=trace.to(trainer.device))),
            "ID + gate weights": trainer.score(
                trainer.model, mb, ScoreOptions(replay=trace.to(trainer.device), rule=GateReplay())
            ),
        }
    gaps: dict[str, Any] = {name: gap(scored.logp, reference, mb.response_mask) for name, scored in scores.items()}
    unreplayed = cast(RoutingTrace, scores["none"].routes)  # scored with record=True: its routes are there
    gaps["expert_change_frac"] = routing_drift(trace, unreplayed.to("cpu"), mb.token_mask).expert_change_frac
    return gaps


def sampler_of(trainer: RLTrainer) -> RolloutEngine:
    """The engine that samples the trainer's rollouts in this process: the synchronous source's (the lagged one's
    too). The concurrent source's samples in a worker process, out of this one's reach: refused."""
    source = trainer.rollouts
    if not isinstance(source, SynchronousSource):
        raise SystemExit(
            f"replay_gap: rollout.source={source.name} samples in another process; the gap is measured on an engine "
            "in this one: use rollout.source=synchronous or lagged"
        )
    return source.engine


def measure(trainer: RLTrainer, warm_steps: int) -> dict[str, Any]:
    t = trainer.cfg.trainer
    for _ in range(warm_steps):
        trainer.step()
    examples = [
        trainer.train_examples[i]
        for i in torch.randint(len(trainer.train_examples), (t.prompts_per_step,), generator=trainer.generator).tolist()
    ]
    sampling = Sampling(t.group_size, t.max_new_tokens, t.temperature, record_routing=True, record_gates=True)
    rollout = collect_rollout(sampler_of(trainer), trainer.task, examples, sampling)
    advantages = group_advantages(rollout.rewards, t.group_size, scale_by_std=trainer.advantage_std)
    order = minibatch_order(trainer.plan.layout, rollout.size, t.group_size, trainer.generator)
    minibatches = split_minibatches(rollout, advantages, order, t.minibatches, trainer.device)
    # Sampled with record_routing by an engine that returns its log-probs: every minibatch holds both.
    results: dict[str, Any] = {
        "r3": [
            three_ways(trainer, mb, cast(RoutingTrace, mb.engine_routes), cast(torch.Tensor, mb.mu_logp))
            for mb in minibatches
        ]
    }
    with torch.no_grad():
        olds = [trainer.score(trainer.model, mb, ScoreOptions(record=True, record_gates=True)) for mb in minibatches]
    results["r2"] = []
    for j, (mb, old) in enumerate(zip(minibatches, olds)):
        routes = cast(RoutingTrace, old.routes).to("cpu")  # scored with record=True
        if j > 0:
            results["r2"].append({"updates": j, **three_ways(trainer, mb, routes, old.logp)})
        trainer.update(mb, OldPolicy(on_policy=False, logp=old.logp, routes=routes))
    return results


def table(results: dict[str, Any], engine: str) -> str:
    rows = []
    r3 = results["r3"]
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    rows.append(
        [
            f"R3: to μ_old ({engine}), at θ_old",
            *[
                f"{mean([m[name]['mean_abs'] for m in r3]):.2e} ({max(m[name]['max_abs'] for m in r3):.1e})"
                for name in SETTINGS
            ],
            f"{mean([m['expert_change_frac'] for m in r3]):.2%}",
        ]
    )
    for m in results["r2"]:
        rows.append(
            [
                f"R2: to π_old, after {m['updates']} update(s)",
                *[f"{m[name]['mean_abs']:.2e} ({m[name]['max_abs']:.1e})" for name in SETTINGS],
                f"{m['expert_change_frac']:.2%}",
            ]
        )
    return markdown_table(["gap, mean abs (max)", *SETTINGS, "experts routed otherwise without replay"], rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the training config (experiments.train)")
    parser.add_argument("--warm-steps", type=int, default=2, help="ordinary RL steps before measuring")
    parser.add_argument("--json-out", type=Path, help="write every measured number here")
    args = parser.parse_args(argv)
    if args.warm_steps < 0:
        parser.error(f"--warm-steps={args.warm_steps} must be >= 0")
    register_configs()
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=["logger.wandb.mode=disabled", "trainer.pi_old=decoupled", *args.overrides])
    if cfg.routing.replay != "none" or cfg.routing_variant.name != "none" or cfg.trainer.minibatches < 2:
        parser.error(
            "the gap is measured around ordinary updates: leave routing.replay and routing_variant at none, "
            "and use trainer.minibatches >= 2"
        )
    try:
        trainer = RLTrainer(cfg)
    except ConfigError as error:
        raise SystemExit(f"replay_gap: {error}") from None
    sampler = sampler_of(trainer)
    if not sampler.returns_gate_weights:
        raise SystemExit(f"replay_gap: rollout.engine={sampler.name} reports no gate weights to replay")
    results = measure(trainer, args.warm_steps)
    numerics = sampler.numerics
    engine = (
        "the trainer's own model"
        if sampler.shares_trainer_weights
        else ", ".join(
            f"{key}={getattr(numerics, key)}"
            for key in ("precision", "weight_quant", "router_noise")
            if getattr(numerics, key) != getattr(EngineNumerics(), key)
        )
    )
    print(f"# replay gap: {' '.join(args.overrides)}; {args.warm_steps} warm steps")
    print(table(results, engine))
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps({"argv": sys.argv[1:] if argv is None else argv, **results}, indent=1))
    return results


if __name__ == "__main__":
    main()
