"""Route predictors (Predictive Routing Replay, PR2; `algos.routing_variants.predictive` has the method): a linear map
W_p beside every MoE router that predicts how the router's logits will change, and the engine's routing by it.

    p, h                                 a token's router logits `[E]` and the router's input `[H]`
    p̂ = p + h·W_p                        the predicted logits; W_p a `Linear(H, E, bias=False)`, zero at the start
    Î = TopK(selection_scores(p̂), k)     the predicted route: the family's ranking (softmax, or sigmoid + bias)
    g = replayed_gate_weights(p) at Î    its gates: the router's own scores at those experts

W_p is a submodule of its router (`router.predictor`), so it is part of the model's state dict: it is copied into an
engine that holds its own weights, versioned with the weights under `rollout.lag` (an engine k versions behind routes
with the predictor of its own version), checkpointed with them and sharded under FSDP2 with them. It is added after
the start's sha256 is taken, never enters a forward of the trainer (only `route_by_predictors`, which the engine
enters while it samples, calls it) and is left out of what `save_pretrained` writes (`without_predictors`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from models.routing.families import RouterOutput, replayed_gate_weights, router_top_k, router_weight, selection_scores
from models.routing.trace import find_routers

PREDICTOR = "predictor"  # the attribute (and state-dict name) of a router's predictor


def add_predictors(model: torch.nn.Module) -> None:
    """Give every MoE router of `model` a zero-initialised predictor `Linear(H, E, bias=False)` in the router weight's
    dtype and device: at zero it predicts no change, so the engine routes exactly as without it."""
    for name, router in find_routers(model).items():
        if hasattr(router, PREDICTOR):
            raise ValueError(f"router {name} already has a predictor")
        weight = router_weight(router)
        experts, hidden = weight.shape
        # skip_init: no draw from the global generator, which the rest of the run's start goes on drawing from
        predictor = torch.nn.utils.skip_init(
            torch.nn.Linear, hidden, experts, bias=False, dtype=weight.dtype, device=weight.device
        )
        torch.nn.init.zeros_(predictor.weight)
        router.add_module(PREDICTOR, predictor)


def predictors(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The routers' predictors, in layer order (none when `add_predictors` has not run)."""
    return [getattr(router, PREDICTOR) for router in find_routers(model).values() if hasattr(router, PREDICTOR)]


def policy_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Every parameter of `model` but its predictors': what the policy's loss trains (and its gradient clip bounds)."""
    theirs = {id(parameter) for predictor in predictors(model) for parameter in predictor.parameters()}
    return [parameter for parameter in model.parameters() if id(parameter) not in theirs]


def without_predictors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict of the model without its predictors' entries: the policy as transformers (and vLLM) load it."""
    return {name: tensor for name, tensor in state.items() if f".{PREDICTOR}." not in f".{name}"}


def predicted_logits(router: torch.nn.Module, inputs: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """`[T, E]` fp32: p + h·W_p, of the router's `logits [T, E]` and `inputs [T, H]`, with its predictor."""
    predictor = getattr(router, PREDICTOR)
    return logits.float() + predictor(inputs.to(predictor.weight.dtype)).float()


def predicted_route(
    router: torch.nn.Module, inputs: torch.Tensor, logits: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `(weights, indices) [T, K]` a router call computes with when it routes by its predictor: the top-k of the
    family's selection scores of the predicted logits, gated by the router's own scores at them. A token whose
    predicted experts are the router's own keeps the router's own output as it is (its slot order and arithmetic), so
    a predictor that predicts no change routes bit for bit as the router does."""
    chosen = (
        selection_scores(router, predicted_logits(router, inputs, logits)).topk(router_top_k(router), dim=-1).indices
    )
    own = (chosen.unsqueeze(-1) == indices.unsqueeze(-2)).any(-1).all(-1, keepdim=True)
    gates = replayed_gate_weights(router, logits, chosen, weights)
    return torch.where(own, weights, gates), torch.where(own, indices, chosen.to(indices.dtype))


class _RoutedByPredictor:
    """Forward hook on a router: route its call by its predictor (`predicted_route`); the logits stay its own."""

    def __call__(self, router: torch.nn.Module, args: tuple[Any, ...], output: RouterOutput) -> RouterOutput:
        logits, weights, indices = output
        inputs = args[0].reshape(-1, args[0].shape[-1])
        return (logits, *predicted_route(router, inputs, logits, weights, indices))


@contextmanager
def route_by_predictors(model: torch.nn.Module) -> Iterator[None]:
    """Every MoE router of `model` routes by its predictor in the forwards run inside the context, and only there
    (an engine that samples with the trainer's own module enters it while it samples). Enter it before a recording
    context: the recording hooks must see the predicted route."""
    routers = find_routers(model)
    missing = [name for name, router in routers.items() if not hasattr(router, PREDICTOR)]
    if missing:
        raise ValueError(f"routers {missing[:2]}... have no predictor to route by (`add_predictors`)")
    handles = [router.register_forward_hook(_RoutedByPredictor()) for router in routers.values()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
