"""The routing hooks: Routing Replay and its variants, RSPO's shift, PR2's predictors, the routing measurements and
the ratio's decomposition, and the router switches (`algos.routers`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import cast

import torch

from algos.objective import ObjectiveInputs
from algos.routers import RouterSwitch
from algos.routing_variants import RoutingVariant
from algos.routing_variants.predictive import Predictive
from algos.routing_variants.router_shift import RouterShift
from experiments.ranks import Ranks
from experiments.step import metrics as m
from experiments.step.data_parallel import reduce_value, reshard, summed
from experiments.step.hooks.base import Rows, StepHook, Update
from experiments.step.old_policy import AtOld, Score
from experiments.step.scoring import FED, ScoreOptions, margin_stats
from models.routing.hooks import RouterCalls
from models.routing.measures import gate_shift, load_max_violation, routing_drift
from models.routing.trace import RoutingTrace


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

    variant: RouterShift
    device: torch.device
    layers: int
    summed: Callable[[torch.Tensor], torch.Tensor]

    def options(self, update: Update, options: ScoreOptions) -> ScoreOptions:
        if update.old.on_policy:
            return options
        rule = self.variant.replay_rule()
        update.held[self, "rule"] = rule
        # off the update's own forward, θ_old's routing is recorded (with its gates: the variant reads θ_old's router)
        old_routes = cast(RoutingTrace, update.old.routes)
        return replace(options, replay=old_routes.to(self.device), rule=rule, score_replayed=True)

    def objective_inputs(self, update: Update, inputs: ObjectiveInputs) -> ObjectiveInputs:
        mb, old = update.mb, update.old
        shift = (
            self.variant.unshifted(mb.response_mask, self.layers)
            if old.on_policy
            else self.variant.shift(
                # `options` asked the forward to score the replayed experts; θ_old's routing carries its gates
                cast(torch.Tensor, update.scored.replayed_logprobs),
                cast(torch.Tensor, cast(RoutingTrace, old.routes).logprobs),
                mb.prompt_width,
                mb.response_mask,
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

    variant: Predictive
    routers: list[torch.nn.Module]  # the trainer's, in layer order
    ranks: Ranks

    def loss(self, update: Update) -> torch.Tensor | float:
        states = cast(RoutingTrace, update.mb.engine_routes)  # PR2 replays the engine's routes (r3), states and all
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
        mb, old, scores, ranks = update.mb, update.old, update.scored, self.ranks
        token_mask = rows(mb.token_mask, fill=False)
        # `options` asked the forward to record its routing (under replay: the router's own top-k, beside the replayed
        # experts), the balancing loss and the routers' fragility; and π_old recorded θ_old's routing
        own = rows.routes(cast(RoutingTrace, scores.routes).to("cpu"))
        theta_old = own if old.on_policy else rows.routes(cast(RoutingTrace, old.routes))
        metrics = m.drift_metrics(routing_drift(theta_old, own, token_mask))
        if theta_old.weights is not None:  # θ_old's gates: its own forward's, the recompute's, or the engine's
            metrics.update(m.gate_drift_metrics(gate_shift(theta_old, own, token_mask)))
        metrics[m.LOAD_MAX_VIOLATION] = load_max_violation(theta_old, token_mask)
        metrics[m.AUX_LOSS] = cast(float, scores.aux_loss_value)
        mine = float(mb.attention_mask[:, FED].sum())  # the weight of this rank's fragility means
        fed = reduce_value(mine, ranks)
        router_stats = cast(dict[str, float], scores.router_stats)
        metrics.update({name: reduce_value(value * mine, ranks) / fed for name, value in router_stats.items()})
        margins, weights = cast(tuple[torch.Tensor, torch.Tensor], scores.router_margins)
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
    flips: Callable[[], contextlib.AbstractContextManager[object]]

    @torch.no_grad()
    def before_step(self, update: Update) -> dict[str, float]:
        mb, old = update.mb, update.old
        if mb.index == 0 or update.step % self.every:
            return {}
        logp = update.scored.logp.detach()
        if old.replay is None:
            routes = cast(RoutingTrace, old.routes)  # decomposing tracks routing: π_old recorded θ_old's (StepPlan)
            own, replayed = logp, self.score(self.model, mb, ScoreOptions(replay=routes.to(self.device))).logp
        else:
            with self.flips():
                own = self.score(self.model, mb, ScoreOptions()).logp
            replayed = (
                self.score(self.model, mb, ScoreOptions(replay=old.replay.to(self.device))).logp
                if (self.variant_changes_replay)
                else logp
            )
        reshard(self.model)  # forwards without a backward: a sharded model's parameters go back into their shards
        update.held[self] = (own - replayed, replayed - old.pi_old_logp(update.scored))
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
        return sum(switch.loss(self._calls(update), self.over_ranks) for switch in self.switches)

    def after_step(self, update: Update) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for switch in self.switches:
            metrics.update(switch.after_update(self.model, self._calls(update), self.summed))
        return metrics

    @staticmethod
    def _calls(update: Update) -> RouterCalls:
        return cast(RouterCalls, update.scored.routers)  # `options` asks every update's forward for them
