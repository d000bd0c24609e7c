"""The SYNTHETIC interventions: flips in π_θ's update forwards, router noise the policy carries."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from experiments.ranks import Ranks
from experiments.step import metrics as m
from experiments.step.data_parallel import reduce_value
from experiments.step.hooks.base import Rows, StepHook, Update
from models.routing.flips import Flipping, flip_routing
from models.routing.perturbation import perturb_routers, router_inputs


@dataclass(eq=False)
class Flips(StepHook):
    """SYNTHETIC flips (`routing.flip_rate`) in π_θ's update forwards (`models.routing.flips`), from their own random
    stream, and the share of activated experts they swapped."""

    model: torch.nn.Module
    rate: float
    generator: torch.Generator
    ranks: Ranks

    def flipping(self) -> contextlib.AbstractContextManager[Flipping]:
        return flip_routing(self.model, self.rate, self.generator)

    @contextlib.contextmanager
    def around_forward(self, update: Update) -> Iterator[None]:
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
    def around_forward(self, update: Update) -> Iterator[None]:
        with router_inputs(self.model) as inputs:
            update.held[self] = inputs
            yield

    def after_step(self, update: Update) -> dict[str, float]:
        return {m.PERTURB_FRAC: perturb_routers(self.model, update.held[self], self.rate, self.generator).share}
