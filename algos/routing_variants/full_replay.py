"""Replay with gate weights ("full replay"): replayed forwards compute with the recorded experts *and* the gate
weights they were given, not the current router's.

    ID replay (routing.replay=r2|r3):  y = Σ_{e ∈ S_old} g_e(θ) · E_e(x; θ),   g(θ) the current router's softmax
                                                                               at S_old, renormalised as the family does
    full replay:                       y = Σ_{e ∈ S_old} g_e^rec · E_e(x; θ),   g^rec the recorded gate weights

What it removes: with ID replay the forward still differs from the recorded one through the gates (their values, and
the renormalisation over the replayed experts); miles #2722 measured, on DeepSeek-V4-Flash, a log-prob error of
0.369 without replay and 0.139 with ID replay, the rest being gates and normalisation. Under r2 the gates are
θ_old's, recorded by the trainer's π_old pass; under r3 the engine's, as the engine computed them (in its dtype,
after its router noise), which only an engine that reports gate weights can give: transformers' engine does,
vLLM and SGLang return expert ids only, so r3 with `rollout.engine=vllm` is refused.

The router's gradient: the router's only differentiable output into the policy's log-probabilities is the gate
weights (the top-k choice is discrete). Replaying them with constants cuts that path, so the policy loss gives
every router parameter exactly zero gradient in every update; under r2 the first minibatch, whose own forward would
otherwise serve as its π_old and train the routers alone, is replayed too (`StepPlan.first_minibatch_on_policy`).
The router still computes its own top-k (drift is still measured), and it still learns from the load-balancing loss
of `routers=[aux_loss]`, which reads the router's logits directly: the only thing that trains it.
The experts, attention and embeddings learn as under ID replay. A variant with no parameters: the yaml only
selects it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, cast

import torch

from algos.routing_variants.base import ROUTING_VARIANTS, RoutingVariant, VariantNeeds
from models.routing.hooks import ReplayedRoutes, ReplayRule


class GateReplay(ReplayRule):
    """The trace's experts with the trace's gate weights (cast to the router's dtype); the router's own choice and
    weights where the trace has no route (padding, whose outputs feed no scored log-probability)."""

    needs_gates = True

    def __call__(
        self,
        layer: int,
        router: torch.nn.Module,
        logits: torch.Tensor,
        weights: torch.Tensor,
        indices: torch.Tensor,
        replayed: ReplayedRoutes,
        first: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        recorded = replayed.recorded[:, None]
        forced = torch.where(recorded, replayed.experts, indices)
        gates = cast(torch.Tensor, replayed.weights)  # needs_gates: `replay_routing` refuses a trace without them
        return torch.where(recorded, gates.to(weights.dtype), weights), forced


@ROUTING_VARIANTS.register("full_replay")
@dataclass(frozen=True)
class FullReplay(RoutingVariant):
    replay_modes: ClassVar[tuple[str, ...]] = ("r2", "r3")
    replay_modes_why: ClassVar[str] = "replays the gate weights of a replayed routing"
    needs: ClassVar[VariantNeeds] = VariantNeeds(gate_weights=True)
    changes_replay: ClassVar[bool] = True

    def replay_rule(self) -> ReplayRule:
        return GateReplay()
