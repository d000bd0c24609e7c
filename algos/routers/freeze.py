"""Router freezing (prime-rl #1836, `freeze_moe_router`; xtuner #1179): the routers' weights take no gradient and
stay out of the optimizer, so every update trains the rest of the policy and no router.

A frozen router still routes, and its choice still moves when the hidden states reaching it do: drift then comes
from the layers below it only. The sigmoid family's selection bias is not a weight, so `bias_update` still moves it.
Unlike `trainer.router_lr_scale` near 0, a frozen router's gradient is not computed, does not count in the
gradient-norm clip and takes no weight decay; the scale is then meaningless, so it must stay 1. RSPO (arXiv
2510.23027) argues freezing costs exploration; it is the arm that asks whether routing needs training at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from algos.routers.base import ROUTER_SWITCHES, RouterSwitch, RunFacts
from models.routing.trace import find_routers


@ROUTER_SWITCHES.register("freeze")
@dataclass(frozen=True)
class Freeze(RouterSwitch):
    def check(self, run: RunFacts) -> None:
        super().check(run)
        if run.router_lr_scale != 1:
            self._fail(
                f"leaves the routers out of the optimizer, so trainer.router_lr_scale={run.router_lr_scale} would "
                "scale nothing: use trainer.router_lr_scale=1"
            )

    def start(self, model: torch.nn.Module) -> None:
        for router in find_routers(model).values():
            router.requires_grad_(False)
