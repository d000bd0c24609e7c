"""Where a minibatch's π_old comes from: a source decided once at start-up (`StepPlan.pi_old`), called on every
minibatch before the step's first update (θ = θ_old then).

    Bypass      π_old := μ_old, the engine's own log-probs (and routing): no forward
    Recompute   a no-grad forward of the trainer at θ_old in the training shapes, recording θ_old's routing (r2
                replays it) or replaying the engine's (r3) or older weights' (lagged replay)
    FirstOnPolicy(source)   the first minibatch's π_old is its own update forward, where θ = θ_old: its log-probs and
                routing are what a recompute would give; the others' come from `source`

What the update's forward replays comes with π_old (`OldPolicy.replay`): θ_old's recorded routing under r2, the
engine's under r3, older weights' under lagged replay; and so do the frozen reference's log-probs (`ref_logp`,
for the KL term). `OldPolicy` also says where the trainer's own numbers at θ_old are, which the correction and the
mismatch measurements compare with the engine's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import cast

import torch

from algos.routers import RouterSwitch
from experiments.step.batch import Minibatch
from experiments.step.scoring import ScoreOptions, Scores
from models.routing.hooks import ReplayRule
from models.routing.trace import RoutingTrace

# Scores a minibatch under a model with the step's layout: `score(model, mb, options)`.
Score = Callable[[torch.nn.Module, Minibatch, ScoreOptions], Scores]


class AtOld(StrEnum):
    """Where the trainer's own log-probs (and routing) at θ_old of a minibatch are."""

    forward = "forward"  # the update's own forward: the first minibatch (θ = θ_old), unless SYNTHETIC flips change it
    recompute = "recompute"  # the π_old recompute
    nowhere = "nowhere"  # π_old is μ_old's (bypass): the step holds no trainer numbers at θ_old for it


@dataclass(frozen=True)
class OldPolicy:
    """What the update of one minibatch takes from the policies that stay fixed during the step.

    `on_policy`: π_old is the update's own forward (θ = θ_old there), so its log-probs and routing come from it.
    Otherwise `logp` is π_old's log-probs (μ_old's under bypass, a recompute otherwise) and `routes` θ_old's own
    routing when routing is tracked (with its gates when the routing variant reads or replays them). `replay`: the
    experts π_θ's forward is forced through (r2: θ_old's, r3: the engine's). `ref_logp`: the frozen reference's
    log-probs, for the KL term. `at_old`: where the trainer's own numbers at θ_old are.
    """

    on_policy: bool
    logp: torch.Tensor | None = None
    routes: RoutingTrace | None = None
    replay: RoutingTrace | None = None
    ref_logp: torch.Tensor | None = None
    at_old: AtOld = AtOld.nowhere

    def pi_old_logp(self, scores: Scores) -> torch.Tensor:
        """π_old's log-probs, given the update forward's `scores`."""
        # off the update's forward, π_old was computed beforehand (μ_old's under bypass, a recompute's otherwise)
        return scores.logp.detach() if self.on_policy else cast(torch.Tensor, self.logp)

    def trainer_logp(self, scores: Scores) -> torch.Tensor | None:
        """The trainer's log-probs at θ_old, given the update forward's `scores` (None: the step has none)."""
        return {AtOld.forward: scores.logp.detach(), AtOld.recompute: self.logp, AtOld.nowhere: None}[self.at_old]


class ReplayFrom(ABC):
    """The experts replayed in the step's forwards that θ_old's own π_old pass does not record, per minibatch."""

    @abstractmethod
    def __call__(self, mb: Minibatch) -> RoutingTrace | None: ...


class NothingElse(ReplayFrom):
    """No replay, or R2 (θ_old's own routing, which the recompute records)."""

    def __call__(self, mb: Minibatch) -> RoutingTrace | None:
        return None


class EngineRoutes(ReplayFrom):
    """R3: the engine's experts, recorded while it sampled (without the routers' states it may have recorded with
    them, which no replayed forward reads)."""

    def __call__(self, mb: Minibatch) -> RoutingTrace | None:
        return mb.engine_routes.without_states() if mb.engine_routes is not None else None


@dataclass(frozen=True)
class OlderWeights(ReplayFrom):
    """Lagged replay: the experts of the model whose weights a router switch keeps (`RouterSwitch.routing_model`,
    asked at every minibatch: the weights it holds move with the run; `algos.routers.lagged_replay`); none while no
    switch holds one."""

    switches: list[RouterSwitch]
    score: Score

    @torch.no_grad()
    def __call__(self, mb: Minibatch) -> RoutingTrace | None:
        model = next((m for m in (switch.routing_model() for switch in self.switches) if m is not None), None)
        if model is None:
            return None
        return cast(RoutingTrace, self.score(model, mb, ScoreOptions(record=True)).routes).to("cpu")  # recorded


@dataclass(frozen=True)
class ReferencePolicy:
    """The frozen reference policy of the KL term (`model` None: no KL term, no reference log-probs)."""

    model: torch.nn.Module | None
    score: Score

    @torch.no_grad()
    def __call__(self, mb: Minibatch) -> torch.Tensor | None:
        return self.score(self.model, mb, ScoreOptions()).logp if self.model is not None else None


@dataclass(frozen=True)
class OldPolicySource(ABC):
    """π_old of one minibatch, computed before any update of the step. `replay_from`: what the forwards replay
    beyond θ_old's own routing; `reference`: the KL reference; `flips`: SYNTHETIC flips change the update forwards,
    so none of them is the trainer at θ_old."""

    replay_from: ReplayFrom
    reference: ReferencePolicy
    flips: bool

    @abstractmethod
    def __call__(self, mb: Minibatch) -> OldPolicy: ...

    def _at_old(self, mb: Minibatch, own: AtOld) -> AtOld:
        """Where the trainer's numbers at θ_old are: the first minibatch's update forward (θ = θ_old there, unless
        flipped), else what this source computes (`own`)."""
        return AtOld.forward if mb.index == 0 and not self.flips else own


@dataclass(frozen=True)
class Bypass(OldPolicySource):
    """π_old := μ_old: the engine's log-probs, and its routing as θ_old's when routing is tracked (`track`)."""

    track: bool

    @torch.no_grad()
    def __call__(self, mb: Minibatch) -> OldPolicy:
        return OldPolicy(
            on_policy=False,
            logp=mb.mu_logp,
            routes=mb.engine_routes if self.track else None,
            replay=self.replay_from(mb),
            ref_logp=self.reference(mb),
            at_old=self._at_old(mb, AtOld.nowhere),
        )


@dataclass(frozen=True)
class Recompute(OldPolicySource):
    """π_old recomputed at θ_old without gradient. `record`: the pass records θ_old's routing (routing is tracked,
    or the variant reads its gates), with its gates when `record_gates`; `r2`: that routing is what the update
    replays; `rule`: what a replayed pass computes with (the routing variant's)."""

    model: torch.nn.Module
    score: Score
    record: bool
    record_gates: bool
    r2: bool
    rule: Callable[[], ReplayRule]

    @torch.no_grad()
    def __call__(self, mb: Minibatch) -> OldPolicy:
        replay, ref_logp = self.replay_from(mb), self.reference(mb)
        options = ScoreOptions(
            record=self.record and replay is None,
            record_gates=self.record_gates,
            replay=replay,
            rule=self.rule() if replay is not None else None,
        )
        scored = self.score(self.model, mb, options)
        routes = scored.routes.to("cpu") if scored.routes is not None else None
        return OldPolicy(
            on_policy=False,
            logp=scored.logp,
            routes=routes,
            replay=routes if self.r2 and replay is None else replay,
            ref_logp=ref_logp,
            at_old=self._at_old(mb, AtOld.recompute),
        )


@dataclass(frozen=True)
class FirstOnPolicy:
    """The first minibatch on-policy (its update forward is π_old), the others from `source`."""

    source: OldPolicySource

    def __call__(self, mb: Minibatch) -> OldPolicy:
        if mb.index > 0:
            return self.source(mb)
        return OldPolicy(
            on_policy=True, replay=self.source.replay_from(mb), ref_logp=self.source.reference(mb), at_old=AtOld.forward
        )
