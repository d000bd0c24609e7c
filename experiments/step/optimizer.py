"""AdamW and its learning-rate schedule, for RL runs (`rl_optimizer`) and cold starts (`cold_start_optimizer`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from enum import StrEnum
from typing import Any

import torch

from models.routing.predictor import predictors
from models.routing.trace import find_routers


class LRSchedule(StrEnum):
    constant = "constant"
    linear = "linear"  # linear decay to 0 after the warm-up
    cosine = "cosine"  # cosine decay to 0 after the warm-up


def lr_lambda(schedule: LRSchedule, warmup: int, total: int) -> Callable[[int], float]:
    """Multiplier of the base learning rate after `update` optimizer updates (linear warm-up, then decay)."""

    def factor(update: int) -> float:
        if warmup and update < warmup:
            return (update + 1) / warmup
        progress = (update - warmup) / max(1, total - warmup)
        if schedule == LRSchedule.linear:
            return max(0.0, 1.0 - progress)
        if schedule == LRSchedule.cosine:
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return factor


def rl_optimizer(
    model: torch.nn.Module, t: Any, predictor_lr_scale: float = 1.0
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the trainable parameters of `model` with the settings of `trainer` (`t`), the routers at
    `lr × router_lr_scale` (frozen routers, `routers=[freeze]`, are left out), the routers' predictors (Predictive
    Routing Replay, `models.routing.predictor`) at `lr × predictor_lr_scale`, and its schedule over every optimizer
    update of the run (steps × minibatches)."""
    routers = {id(router.weight) for router in find_routers(model).values()}
    predicting = {id(p) for predictor in predictors(model) for p in predictor.parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    rest = [p for p in trainable if id(p) not in routers and id(p) not in predicting]
    scaled = [
        ([p for p in trainable if id(p) in routers], t.router_lr_scale),
        ([p for p in trainable if id(p) in predicting], predictor_lr_scale),
    ]
    # fused: one kernel for all parameters instead of a Python loop over them (4x faster on the tiny MoE's CPU
    # update); the same AdamW.
    optimizer = torch.optim.AdamW(
        [{"params": rest}] + [{"params": group, "lr": t.lr * scale} for group, scale in scaled if group],
        lr=t.lr,
        betas=(t.adam_beta1, t.adam_beta2),
        weight_decay=t.weight_decay,
        fused=True,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(t.lr_schedule, t.warmup_steps, t.steps * t.minibatches)
    )
    return optimizer, scheduler


def cold_start_optimizer(
    model: torch.nn.Module, s: Any, updates: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over every parameter of `model` with the cold start's settings (`sft`, `s`): one learning rate, torch's
    default betas and its loop over the parameters, as every committed cold start was made (`rl_optimizer`'s fused
    kernel is another implementation, with no promise of the same bits), and its schedule over the cold start's
    `updates` (pretraining and task steps)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=s.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(s.lr_schedule, s.warmup_steps, updates))
    return optimizer, scheduler
