"""The parts a run switches on, as hooks the step calls at fixed points: the update never asks which are on.

The start-up plan (`experiments.step.plan`) decides what a run is made of; `assemble` turns that into objects: where
π_old comes from (`experiments.step.old_policy`) and the list of step hooks, in the order they act. An update calls
every hook at each fixed point, in that order; a hook that has nothing to do there inherits the base's no-op:

    options(update, options)          what the update's forward computes (replay, recording, router calls, ...)
    around_forward(update)            a context held around the update's forward (SYNTHETIC flips, router inputs)
    objective_inputs(update, inputs)  what the objective is given (RSPO's shifted π_old, a correction's weights)
    loss(update)                      a term added to the update's loss (load balancing, PR2's predictors)
    before_step(update)               after the backward, before the optimizer step: metrics of θ before it moves
                                      (the ratio decomposition's extra forwards)
    after_step(update)                after an applied optimizer step: what acts on the weights between updates
                                      (router switches, the SYNTHETIC router noise), with its metrics
    measure(update, rows)             metrics of the update over every rank's rows (`Rows` gathers each tensor once)

A hook keeps what it needs between its fixed points in `update.held[hook]`. Each hook is the adapter of one part of
`algos/` or `models/` (a correction, a routing variant, the router switches, an intervention) to the step; the parts
themselves stay pure functions of tensors. A new switch is a new hook here and one line in `assemble`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from algos.aggregation import masked
from algos.corrections import Correction, CorrectionInputs
from algos.objective import ObjectiveInputs
from algos.routers import RouterSwitch
from algos.routing_variants import RoutingVariant
from experiments.ranks import Ranks
from experiments.step import metrics as m
from experiments.step.batch import Minibatch
from experiments.step.data_parallel import gather_rows, reduce_value, reshard, summed
from experiments.step.old_policy import (
    AtOld,
    Bypass,
    EngineRoutes,
    FirstOnPolicy,
    NothingElse,
    OlderWeights,
    OldPolicy,
    Recompute,
    ReferencePolicy,
    Score,
)
from experiments.step.plan import PiOld, Replay, StepPlan
from experiments.step.scoring import FED, ScoreOptions, Scores, margin_stats
from models.routing.flips import flip_routing
from models.routing.measures import gate_shift, load_max_violation, routing_drift
from models.routing.perturbation import perturb_routers, router_inputs
from models.routing.trace import NO_ROUTE, RoutingTrace, find_routers


@dataclass
class Update:
    """One optimizer update of a minibatch as it goes: the `step` it belongs to, the minibatch, its π_old, the forward's
    `scores` once it has run, and what each hook `held` between its fixed points."""

    step: int
    mb: Minibatch
    old: OldPolicy
    scores: Scores | None = None
    held: dict[Any, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Rows:
    """Tensors of one minibatch over every rank's rows (`gather_rows`; the identity on one rank), and the response
    mask gathered once."""

    ranks: Ranks
    mask: torch.Tensor

    @classmethod
    def of(cls, ranks: Ranks, mb: Minibatch) -> Rows:
        return cls(ranks, gather_rows(mb.response_mask, ranks, fill=False))

    def __call__(self, tensor: torch.Tensor, dim: int = 0, fill: float = 0) -> torch.Tensor:
        return gather_rows(tensor, self.ranks, dim=dim, fill=fill)

    def routes(self, trace: RoutingTrace) -> RoutingTrace:
        """A trace's experts, and its gate weights where it carries them, over every rank's rows (its router
        log-scores and states are not measured)."""
        weights = self(trace.weights, dim=1) if trace.weights is not None else None
        return replace(
            trace.without_states(), experts=self(trace.experts, dim=1, fill=NO_ROUTE), weights=weights, logprobs=None
        )

    def gathered(self, output: Any) -> Any:
        """An output that gathers itself (`.gathered(rows)`: the objective's, a correction's), over every rank's
        rows."""
        return output.gathered(self) if self.ranks.active else output


class StepHook:
    """A part of the run at the step's fixed points (module docstring); every method does nothing here."""

    def options(self, update: Update, options: ScoreOptions) -> ScoreOptions:
        return options

    def around_forward(self, update: Update) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def objective_inputs(self, update: Update, inputs: ObjectiveInputs) -> ObjectiveInputs:
        return inputs

    def loss(self, update: Update) -> torch.Tensor | float:
        return 0.0

    def before_step(self, update: Update) -> dict[str, float]:
        return {}

    def after_step(self, update: Update) -> dict[str, float]:
        return {}

    def measure(self, update: Update, rows: Rows) -> dict[str, float]:
        return {}


# -- routing: replay and its variants, RSPO's shift, the measurements ----------------------------------------------


@dataclass(eq=False)
class ReplayHook(StepHook):
    """Routing Replay (r2, r3, lagged): the update's forward computes with `old.replay` as the routing variant's rule
    decides (ID replay by default), and the rule's metrics. The first minibatch under r2 replays nothing: its forward
    is θ_old's own."""

    variant: RoutingVariant
    device: torch.device
    summed: Callable[[torch.Tensor], torch.Tensor]

    def options(self, update: Update, options: ScoreOptions) -> ScoreOptions:
        if update.old.replay is None:
            return options
        update.held[self] = rule = self.variant.replay_rule()
        return replace(options, replay=update.old.replay.to(self.device), rule=rule)

    def measure(self, update: Update, rows: Rows) -> dict[str, float]:
        return self.variant.rule_metrics(update.held[self], self.summed) if self in update.held else {}


@dataclass(eq=False)
class RouterShiftHook(StepHook):
    """RSPO (`routing_variant=router_shift`): the update's forward keeps its own routing and reads θ's router on θ_old's
    experts; the objective sees π_θ/π_old · γ̃ with γ̃ a constant, given as π_old's log-probs less log γ̃ (ratio and
    gradient); the shift's metrics. None on the on-policy minibatch, where θ = θ_old."""

    variant: RoutingVariant
    device: torch.device
    layers: int
    summed: Callable[[torch.Tensor], torch.Tensor]

    def options(self, update: Update, options: ScoreOptions) -> ScoreOptions:
        if update.old.on_policy:
            return options
        rule = self.variant.replay_rule()
        update.held[self, "rule"] = rule
        return replace(options, replay=update.old.routes.to(self.device), rule=rule, score_replayed=True)

    def objective_inputs(self, update: Update, inputs: ObjectiveInputs) -> ObjectiveInputs:
        mb, old = update.mb, update.old
        shift = (
            self.variant.unshifted(mb.response_mask, self.layers)
            if old.on_policy
            else self.variant.shift(
                update.scores.replayed_logprobs, old.routes.logprobs, mb.prompt_width, mb.response_mask
            )
        )
        update.held[self, "shift"] = shift
        return replace(inputs, old_logp=inputs.old_logp - shift.log_weight)

    def measure(self, update: Update, rows: Rows) -> dict[str, float]:
        metrics = (
            self.variant.rule_metrics(update.held[self, "rule"], self.summed) if ((self, "rule") in update.held) else {}
        )
        return {**metrics, **update.held[self, "shift"].gathered(rows).metrics(rows.mask)}


@dataclass(eq=False)
class RoutePredictors(StepHook):
    """Predictive Routing Replay (`routing_variant=predictive`): each router's predictor is fitted to the current router
    on the engine's recorded inputs and logits of the minibatch (`Predictive.fit`), its loss added to the update's
    from the second update of a step on; measured at every update: the loss, and the predicted and unpredicted routes'
    agreement with the current router's own top-k."""

    variant: RoutingVariant
    routers: list[torch.nn.Module]  # the trainer's, in layer order
    ranks: Ranks

    def loss(self, update: Update) -> torch.Tensor | float:
        states = update.mb.engine_routes
        tokens = reduce_value(float(states.recorded()[0].sum()), self.ranks)
        update.held[self] = fit = self.variant.fit(
            self.routers, states, train=update.mb.index > 0, tokens=tokens, ranks=self.ranks.world
        )
        return fit.loss

    def measure(self, update: Update, rows: Rows) -> dict[str, float]:
        return update.held[self].metrics(lambda tensor: summed(tensor, self.ranks))


@dataclass(eq=False)
class RoutingMeasures(StepHook):
    """`routing.metrics`: the update's forward records the router's own choice with its gates (beside a replayed
    trace) and its decisiveness; measured are the drift since θ_old (by count, and by gate mass where θ_old's gates
    were recorded), the load, the balancing loss, the routers' fragility and margins, and the engine's routing against
    the trainer's at θ_old, over every rank's share of the minibatch."""

    margin_threshold: float
    ranks: Ranks

    def options(self, update: Update, options: ScoreOptions) -> ScoreOptions:
        return replace(
            options,
            aux_loss=True,
            aux_loss_grad=False,  # logged; routers=[aux_loss] adds it to the loss
            record=options.replay is None,
            record_gates=True,
            fragile_margin=self.margin_threshold,
        )

    def measure(self, update: Update, rows: Rows) -> dict[str, float]:
        mb, old, scores, ranks = update.mb, update.old, update.scores, self.ranks
        token_mask = rows(mb.token_mask, fill=False)
        own = rows.routes(scores.routes.to("cpu"))  # under replay: the router's own top-k, beside the replayed experts
        theta_old = own if old.on_policy else rows.routes(old.routes)
        metrics = m.drift_metrics(routing_drift(theta_old, own, token_mask))
        if theta_old.weights is not None:  # θ_old's gates: its own forward's, the recompute's, or the engine's
            metrics.update(m.gate_drift_metrics(gate_shift(theta_old, own, token_mask)))
        metrics[m.LOAD_MAX_VIOLATION] = load_max_violation(theta_old, token_mask)
        metrics[m.AUX_LOSS] = scores.aux_loss_value
        mine = float(mb.attention_mask[:, FED].sum())  # the weight of this rank's fragility means
        fed = reduce_value(mine, ranks)
        metrics.update({name: reduce_value(value * mine, ranks) / fed for name, value in scores.router_stats.items()})
        margins, weights = scores.router_margins
        metrics.update(margin_stats(rows(margins, dim=1), rows(weights)))  # medians: of every rank's tokens
        trainer = {AtOld.forward: own, AtOld.recompute: old.routes, AtOld.nowhere: None}[old.at_old]  # at θ_old
        if mb.engine_routes is not None and trainer is not None:
            trainer, engine = trainer if trainer is own else rows.routes(trainer), rows.routes(mb.engine_routes)
            metrics.update(m.routing_mismatch(engine, trainer, token_mask))
            if engine.weights is not None and trainer.weights is not None:  # and the gate mass they moved
                metrics.update(m.gate_mismatch_metrics(gate_shift(trainer, engine, token_mask)))
        return metrics


@dataclass(eq=False)
class Decomposition(StepHook):
    """`routing.decompose_every`: every that many steps, split each off-policy token's log π_θ/π_old into a routing
    part, log π_θ(y | θ's experts) − log π_θ(y | θ_old's experts), and a weights part, log π_θ(y | θ_old's experts) −
    log π_old(y), with one extra no-grad forward at θ before this minibatch's optimizer step: replayed when the
    update's forward was not, un-replayed when it was. θ_old's experts are the ones π_old was computed with: the
    replayed trace under r2 / r3, θ_old's recorded routing otherwise; replayed by ID, so a routing variant whose
    replayed forwards compute otherwise (full or soft replay) costs one more forward. The un-replayed counterfactual
    drifts as the update's own routing would: under the SYNTHETIC flips (`flips`) too."""

    every: int
    model: torch.nn.Module
    score: Score
    device: torch.device
    variant_changes_replay: bool
    flips: Callable[[], contextlib.AbstractContextManager]

    @torch.no_grad()
    def before_step(self, update: Update) -> dict[str, float]:
        mb, old = update.mb, update.old
        if mb.index == 0 or update.step % self.every:
            return {}
        logp = update.scores.logp.detach()
        if old.replay is None:
            own, replayed = logp, self.score(self.model, mb, ScoreOptions(replay=old.routes.to(self.device))).logp
        else:
            with self.flips():
                own = self.score(self.model, mb, ScoreOptions()).logp
            replayed = (
                self.score(self.model, mb, ScoreOptions(replay=old.replay.to(self.device))).logp
                if (self.variant_changes_replay)
                else logp
            )
        reshard(self.model)  # forwards without a backward: a sharded model's parameters go back into their shards
        update.held[self] = (own - replayed, replayed - old.pi_old_logp(update.scores))
        return {}

    def measure(self, update: Update, rows: Rows) -> dict[str, float]:
        if self not in update.held:
            return {}
        routing, weights = update.held[self]
        return m.decomposition_metrics(rows(routing), rows(weights), rows.mask)


# -- the router switches (algos.routers) -------------------------------------------------------------------------------


@dataclass(eq=False)
class RouterSwitches(StepHook):
    """The router switches that are on (`routers=[...]`): the update's forward keeps its router calls, each switch adds
    its term to the loss, and acts after each applied optimizer step with them (`algos.routers`)."""

    switches: list[RouterSwitch]
    model: torch.nn.Module
    summed: Callable[[torch.Tensor], torch.Tensor]
    over_ranks: Callable[[torch.Tensor], torch.Tensor] | None

    def options(self, update: Update, options: ScoreOptions) -> ScoreOptions:
        return replace(options, routers=True)

    def loss(self, update: Update) -> torch.Tensor | float:
        return sum(switch.loss(update.scores.routers, self.over_ranks) for switch in self.switches)

    def after_step(self, update: Update) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for switch in self.switches:
            metrics.update(switch.after_update(self.model, update.scores.routers, self.summed))
        return metrics


# -- the SYNTHETIC interventions ---------------------------------------------------------------------------------------


@dataclass(eq=False)
class Flips(StepHook):
    """SYNTHETIC flips (`routing.flip_rate`) in π_θ's update forwards (`models.routing.flips`), from their own random
    stream, and the share of activated experts they swapped."""

    model: torch.nn.Module
    rate: float
    generator: torch.Generator
    ranks: Ranks

    def flipping(self) -> contextlib.AbstractContextManager:
        return flip_routing(self.model, self.rate, self.generator)

    @contextlib.contextmanager
    def around_forward(self, update: Update):
        with self.flipping() as flips:
            update.held[self] = flips
            yield

    def measure(self, update: Update, rows: Rows) -> dict[str, float]:
        return {m.FLIP_FRAC: reduce_value(update.held[self].share, self.ranks) / self.ranks.world}


@dataclass(eq=False)
class RouterNoise(StepHook):
    """SYNTHETIC router noise (`routing.perturb_rate`, `models.routing.perturbation`): the routers' inputs in the
    update's forward are kept, and after the optimizer step noise on the router weights moves that share of their
    activated experts; θ keeps it."""

    model: torch.nn.Module
    rate: float
    generator: torch.Generator

    @contextlib.contextmanager
    def around_forward(self, update: Update):
        with router_inputs(self.model) as inputs:
            update.held[self] = inputs
            yield

    def after_step(self, update: Update) -> dict[str, float]:
        return {m.PERTURB_FRAC: perturb_routers(self.model, update.held[self], self.rate, self.generator).share}


# -- training–inference mismatch ---------------------------------------------------------------------------------------


@dataclass(eq=False)
class RolloutCorrection(StepHook):
    """A rollout correction (`correction=`, `algos.corrections`): each token's weight from the mismatch ratio ρ =
    π_old/μ_old at θ_old (log ρ = 0 where the step holds no trainer numbers at θ_old) and π_θ against μ_old; the
    objective multiplies its per-token loss by it. Its metrics over every rank's rows."""

    correction: Correction

    def objective_inputs(self, update: Update, inputs: ObjectiveInputs) -> ObjectiveInputs:
        mb, scores = update.mb, update.scores
        trainer = update.old.trainer_logp(scores)
        log_rho = trainer - mb.mu_logp if trainer is not None else torch.zeros_like(mb.mu_logp)
        output = self.correction(
            CorrectionInputs(
                log_rho=masked(log_rho, mb.response_mask),
                mask=mb.response_mask,
                advantages=mb.advantages,
                theta_log_ratio=masked(scores.logp.detach() - mb.mu_logp, mb.response_mask),
            )
        )
        update.held[self] = output
        return replace(inputs, weight=output.weight)

    def measure(self, update: Update, rows: Rows) -> dict[str, float]:
        return rows.gathered(update.held[self]).metrics


@dataclass(eq=False)
class LearningMeasures(StepHook):
    """How far the policy moves (`trainer.measure_learning`): each update's size against the weights, and KL(π_θ ‖
    π_start) on the minibatch's response tokens after the update (`metrics.kl_k3` of log π_start − log π_θ; the
    tokens were sampled by μ_old, which is π_θ's neighbour, not π_θ)."""

    def __init__(self, model: torch.nn.Module, start: torch.nn.Module, score: Score) -> None:
        self.model, self.start, self.score = model, start, score

    def before_step(self, update: Update) -> dict[str, float]:
        update.held[self] = [p.detach().clone() for p in self.model.parameters()]
        return {}

    def after_step(self, update: Update) -> dict[str, float]:
        before = update.held.pop(self)
        moved = [p.detach() - old for p, old in zip(self.model.parameters(), before)]
        size = float(torch.nn.utils.get_total_norm(before))  # over every rank's shards under FSDP2
        return {m.UPDATE_RATIO: float(torch.nn.utils.get_total_norm(moved)) / max(size, 1e-30)}

    def measure(self, update: Update, rows: Rows) -> dict[str, float]:
        with torch.no_grad():
            start = self.score(self.start, update.mb, ScoreOptions()).logp
        return {m.KL_TO_START: float(m.kl_k3(rows(start - update.scores.logp.detach()), rows.mask))}


class Mismatch(StepHook):
    """The engine's log-probs against the trainer's at θ_old, where the step holds both (`metrics.mismatch_metrics`)."""

    def measure(self, update: Update, rows: Rows) -> dict[str, float]:
        trainer = update.old.trainer_logp(update.scores)
        if trainer is None or update.mb.mu_logp is None:
            return {}
        return m.mismatch_metrics(rows(trainer - update.mb.mu_logp), rows.mask)


# -- assembly
# ------------------------------------------------------------------------------------------------------------


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
    if plan.replay == Replay.r3:
        replay_from = EngineRoutes()
    elif switches:
        replay_from = OlderWeights(switches, score)
    else:
        replay_from = NothingElse()
    common = dict(
        replay_from=replay_from, reference=ReferencePolicy(parts.reference, score), flips=bool(plan.flip_rate)
    )
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
    if variant.reads_old_router:
        hooks.append(RouterShiftHook(variant, device, parts.layers, over_all))
    if plan.replay != Replay.none:
        hooks.append(ReplayHook(variant, device, over_all))
    if variant.predicts_routes:
        hooks.append(RoutePredictors(variant, list(find_routers(model).values()), ranks))
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
        hooks.append(LearningMeasures(model, parts.start, score))
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
