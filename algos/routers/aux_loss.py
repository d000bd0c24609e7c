"""The load-balancing loss as a term of the loss, the softmax family's own balancing:

    loss = (policy or SFT loss) + coef · L_balance,   L_balance = `algos.routers.balancing.global_balance_loss`

the Switch Transformer loss (Fedus et al. 2021, eqs. 4-6) over every layer's tokens of the whole batch, as
transformers' Qwen3-MoE computes it (`load_balancing_loss_func`, transformers 5.24) and as Qwen3 trains with
global-batch balancing; Qwen3-MoE's configs set its coefficient `router_aux_loss_coef` to 0.001, the default here.
On the sigmoid family the same loss is taken on the normalised sigmoid scores
(`models.routing.families.normalised_scores`); that family's own balancing is `bias_update`. It reaches the routers
through their scores (and, through the hidden states, the layers below); under full replay it is the only thing that
trains them. Whether on or off, every RL update logs the loss's value as `moe/aux_loss`. In RL, Megatron's Qwen3-MoE
recipes turn it off (`moe_router_load_balancing_type="none"`): this switch is the other arm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from algos.routers.balancing import global_balance_loss
from algos.routers.base import ROUTER_SWITCHES, RouterSwitch, Summed
from models.routing.hooks import RouterCalls


@ROUTER_SWITCHES.register("aux_loss")
@dataclass(frozen=True)
class AuxLoss(RouterSwitch):
    in_cold_start: ClassVar[bool] = True

    coef: float = 1e-3  # the loss's coefficient: Qwen3-MoE's router_aux_loss_coef

    def validate(self) -> None:
        if not (math.isfinite(self.coef) and 0 < self.coef <= 1):
            self._fail(f"coef={self.coef} must be in (0, 1] (Qwen3-MoE trains with 0.001)")

    def loss(self, routers: RouterCalls, over_ranks: Summed | None) -> torch.Tensor:
        return self.coef * global_balance_loss(routers, over_ranks)[0]
