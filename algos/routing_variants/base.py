"""Routing variants: what a run does about routing beyond Routing Replay's ID replay (`routing.replay`).

Orthogonal to the objective and to the rollout correction: `routing_variant=<name>` picks one, each one small module
registered in `ROUTING_VARIANTS` with its formula, source and defaults. A variant acts in one of two places:

- in the replayed forwards (r2 / r3), through the `models.routing.hooks.ReplayRule` it hands the router hooks:
  `full_replay` replays the recorded gate weights too, `soft_replay` keeps only the replayed experts the current
  router still ranks high;
- on the ratio the objective clips, without replay: `router_shift` (RSPO) multiplies each token's π_θ/π_old by a
  stop-gradient factor from how far the router moved on θ_old's experts;
- in the engine and beside the routers: `predictive` (PR2) gives every router a trained predictor of its logits'
  change, and the engine routes by it (what r3 then replays).

What a variant needs beyond ID replay (gate weights in the replayed trace, θ_old's router, an engine that routes by
predictors) it declares once, as `VariantNeeds`; the step's plan (`experiments.step.plan`) reads that declaration and
turns it into what the engine records, what the π_old pass keeps and which hooks run, so nothing else reads the variant
for it. What a variant cannot serve is refused at start-up in one line (`check`): the replay modes it needs, a dense
model; an engine that cannot report what it replays is refused by the engine's own check.
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from models.registry import ConfigError, Registry, check_fields
from models.routing.hooks import ReplayRule

REPLAY_MODES = ("none", "r2", "r3")


@dataclass(frozen=True)
class VariantNeeds:
    """What a routing variant needs from the rollout engine and the trainer's π_old pass, beyond ID replay's
    experts."""

    # The replayed trace carries gate weights: the π_old pass records θ_old's for r2, the engine reports its own for r3.
    gate_weights: bool = False
    # θ_old's router log-probabilities of θ_old's own experts, which only the trainer's π_old pass records.
    old_router: bool = False
    # The engine routes by the routers' predictors and records their inputs and logits, on which the predictors are
    # trained from a step's second minibatch on.
    predicted_routes: bool = False


@dataclass(frozen=True)
class RoutingVariant(ABC):
    """Base of every routing variant: a frozen dataclass whose fields are its parameters. The defaults of the class
    attributes and methods are ID replay's: the variant `none`."""

    name: ClassVar[str] = "routing variant"  # the registry key
    # The `routing.replay` modes the variant serves, and why it refuses the others (one clause).
    replay_modes: ClassVar[tuple[str, ...]] = REPLAY_MODES
    replay_modes_why: ClassVar[str] = ""
    # What it needs from the engine and the π_old pass (ID replay's: nothing more).
    needs: ClassVar[VariantNeeds] = VariantNeeds()
    # Its replayed forwards compute with other experts or gates than ID replay's (the ratio decomposition then
    # replays θ_old's experts by ID in a forward of its own).
    changes_replay: ClassVar[bool] = False

    def __post_init__(self) -> None:
        check_fields(self, f"routing_variant {self.name}")
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError for parameter values this variant cannot use."""

    def start(self, model: torch.nn.Module) -> None:
        """What the variant adds to the policy before the engine copies it and the optimizer takes its parameters (after
        the start's sha256 is taken)."""

    @property
    def predictor_lr_scale(self) -> float:
        """The learning rate of the parameters `start` added, as a multiple of `trainer.lr`."""
        return 1.0

    def replay_rule(self) -> ReplayRule:
        """A fresh rule for one replayed forward (it may count what it did there)."""
        return ReplayRule()

    def rule_metrics(self, rule: ReplayRule, summed: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """What `rule` did in the forward it served, as `routing/*` metrics; `summed` adds a count over ranks."""
        return {}

    def check(self, replay: str, model: str, is_moe: bool) -> None:
        """Refuse, in one line, a run this variant cannot serve (what it needs from the engine, the gate weights r3
        would replay, is the engine's check: `experiments.step.engines.base.RolloutEngine.check`)."""
        if self.name == "none":
            return
        if not is_moe:
            self._fail(f"changes how MoE routers route or weigh tokens, and model {model!r} has no MoE layers")
        if replay not in self.replay_modes:
            self._fail(f"{self.replay_modes_why}: use routing.replay={' or '.join(self.replay_modes)}, not {replay}")

    def _fail(self, message: str) -> None:
        raise ConfigError(f"routing_variant={self.name} {message}")


ROUTING_VARIANTS: Registry[RoutingVariant] = Registry("routing variant", RoutingVariant)


@ROUTING_VARIANTS.register("none")
@dataclass(frozen=True)
class NoVariant(RoutingVariant):
    """Routing Replay as `routing.replay` says, with nothing more: ID replay under r2 / r3, the router's own choice
    without."""


def build_routing_variant(name: str, **params: object) -> RoutingVariant:
    return ROUTING_VARIANTS.build(name, **params)
