"""SYNTHETIC routing drift that the policy itself carries: after each optimizer update, Gaussian noise on every
router's weights, sized so that it moves a chosen share of the activated experts of that update's own tokens.

Why another intervention than the flips (`models.routing.flips`): flips act in π_θ's update forwards only,
so Routing Replay, which computes with recorded experts there, never meets them — replay "holds" under flips by
construction. Noise on the router weights changes θ itself: the next rollout samples with it, π_old is computed with
it, the held-out evaluation routes with it, exactly as the drift an update causes. Within a step it is drift between
θ_old and θ that replay removes (and does not remove the gates' share of), as it removes natural drift; across steps
every arm carries it. So it can show whether an arm copes with routing that keeps moving; it cannot show what
natural drift does at that dose (natural drift follows the gradient, this noise does not: it also degrades the
routers' learned function, for every arm alike).

Sizing. For each router, a noise direction N (standard normal, the weight's shape) is drawn, and its scale σ found
by bisection so that, on the router's inputs captured in the update's forward (attended tokens, at most
`MAX_TOKENS` of them), the routing by `W + σ N` activates a share `rate` of (token, slot) experts that `W` did not
(the GSPO paper's "experts changed" statistic, `models.routing.measures.routing_drift`, for one layer at a time). Layers
are sized independently; a change in one layer also changes what later routers see, so the drift measured over the
whole model is larger than `rate` (reported by the run's routing metrics). The router computes its own selection
(`torch.func.functional_call` with the perturbed weight), so any family's top-k (bias, groups) is respected.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.func import functional_call

from models.routing.hooks import CallShape
from models.routing.trace import find_routers

MAX_TOKENS = 2048  # router inputs the sizing looks at per layer: enough for a share to 1/2048, cheap to route
BISECTIONS = 14  # halvings of the scale's bracket after it is found: σ to 2^-14 of its bracket
DOUBLINGS = 40  # at most this many doublings of the first guess (the weights' RMS) to bracket the scale


@dataclass(frozen=True)
class Perturbation:
    """What one perturbation did: per router, the share of activated experts it moved on the sized tokens and its
    scale σ relative to the router weights' RMS."""

    moved: list[float]
    relative_scale: list[float]

    @property
    def share(self) -> float:
        """The mean over routers of the share of activated experts moved."""
        return sum(self.moved) / len(self.moved) if self.moved else 0.0


@contextmanager
def router_inputs(model: torch.nn.Module) -> Iterator[dict[str, list[torch.Tensor]]]:
    """Capture, in the forwards run inside the context, each router's input rows of attended tokens (detached),
    keyed by router name."""
    routers = find_routers(model)
    if not routers:
        raise ValueError(f"{type(model).__name__} has no MoE router modules: nothing to perturb")
    call = CallShape()
    captured: dict[str, list[torch.Tensor]] = {name: [] for name in routers}

    def capture(name: str) -> Callable[[torch.nn.Module, tuple[torch.Tensor, ...]], None]:
        def hook(router: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            rows = args[0].detach().reshape(-1, args[0].shape[-1])
            if call.valid is not None:
                rows = rows[call.valid.reshape(-1).to(rows.device)]
            captured[name].append(rows)

        return hook

    handles = [model.register_forward_pre_hook(call, with_kwargs=True)]
    handles += [router.register_forward_pre_hook(capture(name)) for name, router in routers.items()]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def moved_share(before: torch.Tensor, after: torch.Tensor) -> float:
    """The share of (token, slot) experts in `after [T, K]` that are not among the token's experts in `before`."""
    kept = (after[:, :, None] == before[:, None, :]).any(-1)
    return float((~kept).float().mean())


def _selection(router: torch.nn.Module, weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The experts the router selects for `rows` with `weight` in place of its own (its top-k indices `[T, K]`)."""
    return functional_call(router, {"weight": weight}, (rows,))[2]


def _share_moved(
    router: torch.nn.Module,
    weight: torch.Tensor,
    noise: torch.Tensor,
    rows: torch.Tensor,
    before: torch.Tensor,
    scale: float,
) -> float:
    """The share of `before`'s experts that `weight + scale · noise` moves (`moved_share`)."""
    return moved_share(before, _selection(router, weight + scale * noise, rows))


@torch.no_grad()
def perturb_routers(
    model: torch.nn.Module, inputs: dict[str, list[torch.Tensor]], rate: float, generator: torch.Generator
) -> Perturbation:
    """Add to every router's weight the Gaussian noise that moves a share `rate` of the activated experts of its
    captured `inputs` (module docstring); `generator` draws the noise and the sized tokens. Returns what it did."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"perturbation rate {rate} must be in [0, 1)")
    moved, scales = [], []
    for name, router in find_routers(model).items():
        weight = getattr(router, "weight", None)
        if not isinstance(weight, torch.nn.Parameter):
            raise ValueError(f"router {name} ({type(router).__name__}) has no `weight` parameter to perturb")
        rows = torch.cat(inputs[name]) if inputs.get(name) else None
        if rate == 0 or rows is None or len(rows) == 0:
            moved.append(0.0)
            scales.append(0.0)
            continue
        if len(rows) > MAX_TOKENS:
            rows = rows[torch.randperm(len(rows), generator=generator)[:MAX_TOKENS].to(rows.device)]
        noise = torch.randn(weight.shape, generator=generator, dtype=torch.float32).to(weight.device, weight.dtype)
        before = _selection(router, weight, rows)
        share_at = functools.partial(_share_moved, router, weight, noise, rows, before)
        rms = float(weight.float().pow(2).mean().sqrt())
        low, high = 0.0, rms
        for _ in range(DOUBLINGS):
            if share_at(high) >= rate:
                break
            low, high = high, 2 * high
        for _ in range(BISECTIONS):
            middle = (low + high) / 2
            low, high = (low, middle) if share_at(middle) >= rate else (middle, high)
        weight.add_(high * noise)
        moved.append(share_at(0.0))
        scales.append(high / rms if rms else float("inf"))
    return Perturbation(moved, scales)
