"""Router switches: what a run does to the MoE routers besides the policy gradient, each one on or off.

`routers=[aux_loss,bias_update]` turns on any set of them (an empty list, the default, turns on none); each is one
small module registered in `ROUTER_SWITCHES`, a frozen dataclass whose fields are its parameters (formula, source
and defaults in its docstring):

    aux_loss       a load-balancing loss added to the loss (the softmax family's own balancing, Qwen3)
    bias_update    the selection bias moved towards balance after each update, and a small sequence-wise loss
                   (the sigmoid family's own balancing, DeepSeek-V3)
    freeze         the routers left out of training (prime-rl's `freeze_moe_router`)
    lagged_replay  R2 replays the routing of the weights `lag` updates before θ_old (R2 is lag 0)

A switch acts at fixed points of training, each a method of the base that does nothing unless the switch overrides
it, so the RL step (`experiments.step.trainer`) and the cold start (`experiments.sft`) call them without knowing
which switches are on (they loop over the list of those that are: with none on, no switch code runs):

    start(model)                        once, after the policy is built and before the optimizer is
    loss(routers, over_ranks)           a term added to the update's loss, from its forward's router calls
    after_update(model, routers, summed) after each applied optimizer step (not after a skipped one), with the
                                        update's router calls; returns its metrics (`routers/*`)
    routing_model()                     the model whose routing a replayed forward takes, when not θ_old itself

`after_update` is the place for anything that acts on the weights between updates. What a switch cannot serve is
refused at start-up in one line (`check`, on the run's `RunFacts`): a family without a selection bias, a replay
mode, the cold start, a setting it would contradict.
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from models.registry import ConfigError, Registry, check_fields
from models.routing.hooks import RouterCalls

REPLAY_MODES = ("none", "r2", "r3")
Summed = Callable[[torch.Tensor], torch.Tensor]  # a tensor summed over data-parallel ranks (identity on one)


@dataclass(frozen=True)
class RunFacts:
    """What a switch may refuse a run for."""

    model: str  # the model's name, for messages
    selection_bias: bool  # its routers rank with a selection bias (the sigmoid family)
    replay: str | None = None  # the RL run's routing.replay; None: a cold start
    routing_variant: str = "none"
    router_lr_scale: float = 1.0  # trainer.router_lr_scale
    world: int = 1  # data-parallel ranks
    checkpoint_every: int = 0  # trainer.checkpoint_every
    # optimizer updates made before the run's last step starts, (trainer.steps − 1) × trainer.minibatches: how far
    # back any update's θ_old reaches (None: a cold start)
    updates_before_last_step: int | None = None


@dataclass(frozen=True)
class RouterSwitch(ABC):
    """Base of every router switch: a frozen dataclass whose fields are its parameters; every hook a no-op."""

    name: ClassVar[str] = "router switch"  # the registry key
    needs_selection_bias: ClassVar[bool] = False  # acts on the sigmoid family's selection bias
    in_cold_start: ClassVar[bool] = False  # serves a cold start (`experiments.sft`) too
    # The `routing.replay` modes it serves, and why it refuses the others (one clause).
    replay_modes: ClassVar[tuple[str, ...]] = REPLAY_MODES
    replay_modes_why: ClassVar[str] = ""

    def __post_init__(self) -> None:
        check_fields(self, f"routers.{self.name}")
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError for parameter values this switch cannot use."""

    def check(self, run: RunFacts) -> None:
        """Refuse, in one line, a run this switch cannot serve (a subclass extends this, calling it first)."""
        if self.needs_selection_bias and not run.selection_bias:
            self._fail(
                f"moves a selection bias, and model {run.model!r} routes by softmax without one: it serves the "
                "sigmoid family (model.architecture=deepseek_v3 or glm4_moe)"
            )
        if run.replay is None and not self.in_cold_start:
            self._fail("acts on RL updates only, not on a cold start: remove it from routers=[...]")
        if run.replay is not None and run.replay not in self.replay_modes:
            self._fail(
                f"{self.replay_modes_why}: use routing.replay={' or '.join(self.replay_modes)}, not {run.replay}"
            )

    def start(self, model: torch.nn.Module) -> None:
        """Once, after the policy is built and before its optimizer is."""

    def loss(self, routers: RouterCalls, over_ranks: Summed | None) -> torch.Tensor | float:
        """A term to add to the update's loss, from its forward's router calls (0.0: none)."""
        return 0.0

    def after_update(self, model: torch.nn.Module, routers: RouterCalls, summed: Summed) -> dict[str, float]:
        """After each applied optimizer step, with the update's router calls; returns `routers/*` metrics."""
        return {}

    def routing_model(self) -> torch.nn.Module | None:
        """The model whose routing replayed forwards take instead of θ_old's own (None: θ_old's)."""
        return None

    def _fail(self, message: str) -> None:
        raise ConfigError(f"routers.{self.name} {message}")


ROUTER_SWITCHES: Registry[RouterSwitch] = Registry("router switch", RouterSwitch)


def build_router_switches(config: dict[str, dict[str, Any]] | None) -> list[RouterSwitch]:
    """The switches of a `routers` config node, `{name: {name, **parameters}}` (empty or None: none), in its order."""
    switches = []
    for key, params in (config or {}).items():
        params = dict(params)
        name = params.pop("name", key)
        if name != key:
            raise ConfigError(
                f"routers.{key} holds the parameters of router switch {name!r}; select it as routers=[{name}]"
            )
        switches.append(ROUTER_SWITCHES.build(name, **params))
    return switches
