"""The routing trace of a batch and where a model's routers are (the package docstring gives the layout)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, cast

import torch

from models.routing.families import router_num_experts

NO_ROUTE = -1
TRACE_DTYPE = torch.int16  # expert ids < 32768; a quarter of int64's memory for long rollouts
# What a trace may carry beside its experts, each laid out `[L, B, S, ...]` like them.
OPTIONAL_PARTS = ("weights", "logprobs", "inputs", "logits")


@dataclass
class RoutingTrace:
    """Selected experts of every MoE layer for every token: `experts [L, B, S, K]`, `NO_ROUTE` where none; when
    recorded with gates, `weights` and `logprobs [L, B, S, K]` (fp32, 0 where `NO_ROUTE`): the gate weight each chosen
    expert got and the router's log-score of it (`router_logprobs`); when recorded with the routers' states (what
    Predictive Routing Replay trains its predictors on), `inputs [L, B, S, H]` and `logits [L, B, S, E]`: each
    router's input and logits, in their own dtypes (0 where `NO_ROUTE`)."""

    experts: torch.Tensor
    layer_names: tuple[str, ...]
    num_experts: int
    weights: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    inputs: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return cast(tuple[int, int, int, int], tuple(self.experts.shape))  # experts is [L, B, S, K]

    @property
    def has_gates(self) -> bool:
        return self.weights is not None and self.logprobs is not None

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> RoutingTrace:
        """The trace with `fn` applied to its experts and to whatever else it recorded (all laid out alike)."""
        # Any: the parts are tensors, which `replace` takes by name beside fields of other types.
        recorded: dict[str, Any] = {
            name: fn(getattr(self, name)) for name in OPTIONAL_PARTS if getattr(self, name) is not None
        }
        return replace(self, experts=fn(self.experts), **recorded)

    def without_states(self) -> RoutingTrace:
        """The trace without the routers' states: what a replayed forward reads, not carried into it."""
        return replace(self, inputs=None, logits=None) if self.inputs is not None or self.logits is not None else self

    def rows(self, index: torch.Tensor | slice) -> RoutingTrace:
        """The trace of a subset of batch rows (a minibatch), in the given order."""
        return self.map(lambda tensor: tensor[:, index])

    def positions(self, index: slice) -> RoutingTrace:
        """The trace of a range of positions (e.g. those a scoring forward feeds the model)."""
        return self.map(lambda tensor: tensor[:, :, index])

    def to(self, device: torch.device | str) -> RoutingTrace:
        return self.map(lambda tensor: tensor.to(device))

    def recorded(self) -> torch.Tensor:
        """`[L, B, S]` bool: positions that carry a route."""
        return self.experts[..., 0] != NO_ROUTE


def find_routers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Every MoE router of `model`, keyed by module name, in layer order.

    transformers 5.x gives each MoE block a router module (`*TopKRouter`) that returns
    `(router_logits, top_k_weights, top_k_indices)`; that is the one place where experts are chosen.
    """
    return {
        name: module
        for name, module in model.named_modules()
        if type(module).__name__.endswith(("TopKRouter", "TopkRouter"))
    }


def expert_count(model: torch.nn.Module) -> int:
    """The number of experts each router of `model` chooses among."""
    router = next(iter(find_routers(model).values()))
    return int(router_num_experts(router))
