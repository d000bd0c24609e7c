"""Auxiliary-loss-free balancing, the sigmoid family's own (Wang et al. 2024, arXiv 2408.15664; DeepSeek-V3 report
§2.1.2): after each applied update every router's selection bias b (`e_score_correction_bias`) moves towards balance,

    b_e ← b_e + rate · sign(mean_e' c_e' − c_e)

with c_e the expert's load in the update's forward: the (token, slot) assignments of the router's own top-k, each
token weighted as it counts in the batch (0 on padding), summed over every rank. An overloaded expert is chosen less
next time, an underloaded one more. It comes with the complementary sequence-wise loss, `seq_coef` times
`algos.routers.balancing.sequence_balance_loss` (eqs. 17-20). DeepSeek-V3 pre-trained with rate 0.001 and α = 0.0001
(Moonlight, issue #21, pairs the same rate with a 1e-4 sequence-wise loss): the defaults. The bias is a buffer, not a
weight: no gradient reaches it, `freeze` leaves it moving, checkpoints and engine syncs carry it.

What it does under replay. The bias changes which experts the router chooses, never their gate weights
(`models.routing.families.replayed_gate_weights`), so a replayed forward, which computes with the recorded experts, does
not feel it: the bias moves the rollout's routes (the engine routes with it after the next sync) and an unreplayed
update's, not the replayed training routes. Measured after every update, on its tokens (prime-rl #2953 argued it
without a number):

    routers/bias_route_change_frac          share of the router's own activated (token, layer, slot) experts that this
                                            bias step changes: what the next rollout routes otherwise because of it
    routers/bias_route_change_trained_frac  share of the experts the update computed with that it changes: the same
                                            on unreplayed tokens, 0 on replayed ones
    routers/bias_abs_mean                   mean |b| over experts and layers after the step
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from algos.routers.balancing import sequence_balance_loss
from algos.routers.base import ROUTER_SWITCHES, RouterSwitch, Summed
from models.routing.families import chosen, router_top_k, selection_bias
from models.routing.hooks import RouterCalls

ROUTE_CHANGE = "routers/bias_route_change_frac"
TRAINED_ROUTE_CHANGE = "routers/bias_route_change_trained_frac"
BIAS = "routers/bias_abs_mean"


@torch.no_grad()
def update_biases(routers: RouterCalls, rate: float, summed: Summed) -> dict[str, float]:
    """Move each router's selection bias by `rate` towards balance (module docstring) and measure what the step
    changes on the forward's tokens; `summed` adds a count over data-parallel ranks."""
    w = routers.flat_weights
    trained = w if routers.replayed is None else w * (~routers.replayed.reshape(-1)).float()
    moved = torch.zeros(2, dtype=torch.float64)
    activated = torch.zeros(2, dtype=torch.float64)
    sizes = []
    for layer, (router, logits) in enumerate(routers.calls):
        before = routers.chosen(layer)  # [T, E], the router's own top-k with the bias its forward saw
        load = summed((before * w.unsqueeze(-1)).sum(dim=0))
        bias = selection_bias(router)
        bias.add_(rate * torch.sign(load.mean() - load).to(bias))
        changed = (chosen(router, logits) - before).clamp_min(0).sum(dim=-1)  # experts newly chosen, per token
        moved += torch.stack([(changed * w).sum(), (changed * trained).sum()]).double().cpu()
        activated += torch.stack([w.sum(), trained.sum()]).double().cpu() * router_top_k(router)
        sizes.append(bias.abs().mean())
    moved, activated = summed(moved), summed(activated)
    share = (moved / activated.clamp_min(1.0)).tolist()
    return {ROUTE_CHANGE: share[0], TRAINED_ROUTE_CHANGE: share[1], BIAS: float(torch.stack(sizes).mean())}


@ROUTER_SWITCHES.register("bias_update")
@dataclass(frozen=True)
class BiasUpdate(RouterSwitch):
    needs_selection_bias: ClassVar[bool] = True
    in_cold_start: ClassVar[bool] = True

    rate: float = 1e-3  # γ: how far each bias moves per update (DeepSeek-V3: 0.001)
    seq_coef: float = 1e-4  # α of the sequence-wise loss added to the loss (DeepSeek-V3: 0.0001); 0: none

    def validate(self) -> None:
        if not (math.isfinite(self.rate) and 0 < self.rate < 1):
            self._fail(
                f"rate={self.rate} must be in (0, 1): a step of 1 would jump past every sigmoid score "
                "(DeepSeek-V3 trains with 0.001)"
            )
        if not (math.isfinite(self.seq_coef) and 0 <= self.seq_coef <= 1):
            self._fail(f"seq_coef={self.seq_coef} must be in [0, 1] (0: no sequence-wise loss; DeepSeek-V3: 0.0001)")

    def loss(self, routers: RouterCalls, over_ranks: Summed | None) -> torch.Tensor | float:
        return self.seq_coef * sequence_balance_loss(routers, over_ranks)[0] if self.seq_coef else 0.0

    def after_update(self, model: torch.nn.Module, routers: RouterCalls, summed: Summed) -> dict[str, float]:
        return update_biases(routers, self.rate, summed)
