"""SYNTHETIC routing drift in the forwards run inside a context: each activated expert, with a given probability,
swapped for the one its router ranks next (`flip_routing`). Its twin, drift the policy carries, is `perturbation`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from models.routing.families import RouterOutput, replayed_gate_weights, selection_scores
from models.routing.trace import find_routers


def next_ranked(scores: torch.Tensor, indices: torch.Tensor, flip: torch.Tensor) -> torch.Tensor:
    """`indices [T, K]` with the slots in `flip [T, K]` (bool) replaced by the experts ranked next after the top-k by
    the selection `scores [T, E]`: a token's first flipped slot takes the (K+1)-th ranked expert, its second the
    (K+2)-th, and so on. Slots past the E − K experts outside the top-k stay as they are."""
    k = indices.shape[-1]
    spare_count = min(k, scores.shape[-1] - k)
    if spare_count < 1:
        return indices
    spare = scores.topk(k + spare_count, dim=-1).indices[:, k:]  # [T, spare_count], best first
    rank = flip.long().cumsum(-1) - 1  # which spare a flipped slot takes
    flip = flip & (rank < spare_count)
    replacement = spare.gather(-1, rank.clamp(0, spare_count - 1))
    return torch.where(flip, replacement, indices)


class _FlipHook:
    """Forward hook on one router: the synthetic drift of `flip_routing`."""

    def __init__(self, rate: float, generator: torch.Generator) -> None:
        self.rate = rate
        self.generator = generator
        self.flipped = 0
        self.activated = 0

    def __call__(self, router: torch.nn.Module, args: tuple[Any, ...], output: RouterOutput) -> RouterOutput:
        logits, weights, indices = output
        draw = torch.rand(indices.shape, generator=self.generator, device=self.generator.device)
        flip = (draw < self.rate).to(indices.device)
        flipped = next_ranked(selection_scores(router, logits.detach()), indices, flip)
        changed = flipped != indices
        self.flipped += int(changed.sum())
        self.activated += indices.numel()
        rows = changed.any(-1, keepdim=True)
        weights = torch.where(rows, replayed_gate_weights(router, logits, flipped, weights), weights)
        return logits, weights, flipped


class Flipping:
    """Handle yielded by `flip_routing`: `.share` is the realised share of activated experts that were flipped."""

    def __init__(self, hooks: list[_FlipHook]) -> None:
        self._hooks = hooks

    @property
    def share(self) -> float:
        activated = sum(hook.activated for hook in self._hooks)
        return sum(hook.flipped for hook in self._hooks) / activated if activated else 0.0


@contextmanager
def flip_routing(model: torch.nn.Module, rate: float, generator: torch.Generator) -> Iterator[Flipping]:
    """SYNTHETIC routing drift: in the forwards run inside the context, each activated (token, layer, slot) expert is
    replaced, independently with probability `rate`, by the expert its router ranks next after the top-k
    (`next_ranked` on the family's selection scores). The gate weights of a token with a flipped slot come from the
    current router's gate scores at its new experts, as the family computes them (as under replay), so the router keeps
    its gradient.

    It imitates what an update does to routing (experts near the top-k cut swap in) at a dose that does not depend
    on the learning rate, to test whether routing changes alone make token-level ratios fail. The flip is part of
    the router's own choice: `record_routing` inside the context records the flipped experts, and
    `replay_routing` inside it overrides them, as replay overrides any drift. Enter it before record or replay
    (its hooks must run first). `rate` must be in [0, 1]; at 0 nothing is installed and the forward is untouched.
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"flip rate {rate} is not a probability in [0, 1]")
    routers = find_routers(model)
    if not routers:
        raise ValueError(f"{type(model).__name__} has no MoE router modules: nothing to flip")
    hooks = [_FlipHook(rate, generator) for _ in routers] if rate > 0 else []
    handles = [router.register_forward_hook(hook) for router, hook in zip(routers.values(), hooks)]
    try:
        yield Flipping(hooks)
    finally:
        for handle in handles:
            handle.remove()
