"""What a run is made of, assembled from the start-up plan: where π_old comes from and the hooks, in the order they
act (`assemble`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

from algos.corrections import Correction
from algos.routers import RouterSwitch
from algos.routing_variants import RoutingVariant
from algos.routing_variants.predictive import Predictive
from algos.routing_variants.router_shift import RouterShift
from experiments.ranks import Ranks
from experiments.step.batch import Minibatch
from experiments.step.data_parallel import summed
from experiments.step.hooks.base import StepHook
from experiments.step.hooks.interventions import Flips, RouterNoise
from experiments.step.hooks.learning import LearningMeasures
from experiments.step.hooks.mismatch import Mismatch, RolloutCorrection
from experiments.step.hooks.routing import (
    Decomposition,
    ReplayHook,
    RoutePredictors,
    RouterShiftHook,
    RouterSwitches,
    RoutingMeasures,
)
from experiments.step.old_policy import (
    Bypass,
    EngineRoutes,
    FirstOnPolicy,
    NothingElse,
    OlderWeights,
    OldPolicy,
    OldPolicySource,
    Recompute,
    ReferencePolicy,
    ReplayFrom,
    Score,
)
from experiments.step.plan import PiOld, Replay, StepPlan
from models.routing.trace import find_routers


@dataclass(frozen=True)
class Assembly:
    """What the step is made of: where π_old comes from, and the hooks in the order they act."""

    old_policy: Callable[[Minibatch], OldPolicy]
    hooks: list[StepHook]


@dataclass(frozen=True)
class StepParts:
    """What a run's step is assembled from: its `plan` and settings (`cfg`), the trainer's `model`, the frozen KL
    `reference` (None without a KL term) and `start`, how a minibatch is scored (`score`), the routing variant, the
    rollout correction and the router switches that are on, the ranks, the number of MoE `layers`, and the SYNTHETIC
    flips' and router noise's own random streams."""

    plan: StepPlan
    cfg: Any
    model: torch.nn.Module
    reference: torch.nn.Module | None
    start: torch.nn.Module | None  # the start, frozen (with `trainer.measure_learning` or a KL term; else None)
    score: Score
    variant: RoutingVariant
    correction: Correction
    switches: list[RouterSwitch]
    ranks: Ranks
    layers: int
    flip_generator: torch.Generator
    perturb_generator: torch.Generator


def assemble(parts: StepParts) -> Assembly:
    """The objects of a run's step (module docstring), from its plan and parts."""
    plan, cfg, model, score, variant, switches, ranks = (
        parts.plan,
        parts.cfg,
        parts.model,
        parts.score,
        parts.variant,
        parts.switches,
        parts.ranks,
    )
    device = torch.device(cfg.device)
    over_all = lambda tensor: summed(tensor, ranks)  # noqa: E731  a count over every rank's share of the batch
    replay_from: ReplayFrom
    if plan.replay == Replay.r3:
        replay_from = EngineRoutes()
    elif switches:
        replay_from = OlderWeights(switches, score)
    else:
        replay_from = NothingElse()
    common: dict[str, Any] = dict(  # Any: the sources' shared arguments, each of its own type
        replay_from=replay_from, reference=ReferencePolicy(parts.reference, score), flips=bool(plan.flip_rate)
    )
    source: OldPolicySource
    if plan.pi_old == PiOld.bypass:
        source = Bypass(**common, track=plan.track_routing)
    else:
        source = Recompute(
            **common,
            model=model,
            score=score,
            record=plan.track_routing or plan.pi_old_records_gates,
            record_gates=plan.pi_old_records_gates or plan.track_routing,
            r2=plan.replay == Replay.r2,
            rule=variant.replay_rule,
        )
    old_policy = FirstOnPolicy(source) if plan.first_minibatch_on_policy else source

    hooks: list[StepHook] = []
    if plan.reads_old_router:
        # the one variant that reads θ_old's router: RSPO's
        hooks.append(RouterShiftHook(cast(RouterShift, variant), device, parts.layers, over_all))
    if plan.replay != Replay.none:
        hooks.append(ReplayHook(variant, device, over_all))
    if plan.engine_predicts_routes:
        # the one variant that predicts routes: PR2's
        hooks.append(RoutePredictors(cast(Predictive, variant), list(find_routers(model).values()), ranks))
    if plan.track_routing:
        hooks.append(RoutingMeasures(cfg.routing.margin_threshold, ranks))
    if switches:
        hooks.append(RouterSwitches(switches, model, over_all, over_all if ranks.active else None))
    flips = Flips(model, plan.flip_rate, parts.flip_generator, ranks) if plan.flip_rate else None
    if flips is not None:
        hooks.append(flips)
    if plan.perturb_rate:
        hooks.append(RouterNoise(model, plan.perturb_rate, parts.perturb_generator))
    if parts.correction.weighs_tokens:
        hooks.append(RolloutCorrection(parts.correction))
    hooks.append(Mismatch())
    if cfg.trainer.measure_learning:
        # with trainer.measure_learning the start is kept (`StepParts.start`)
        hooks.append(LearningMeasures(model, cast(torch.nn.Module, parts.start), score))
    if cfg.routing.decompose_every:
        hooks.append(
            Decomposition(
                cfg.routing.decompose_every,
                model,
                score,
                device,
                variant.changes_replay,
                flips.flipping if flips is not None else contextlib.nullcontext,
            )
        )
    return Assembly(old_policy, hooks)
