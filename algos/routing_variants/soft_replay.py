"""Soft replay (prime-rl #2703, where the test is the trainer's score against its weakest top-k score): a replayed
expert is kept only where the current router still stands behind it; elsewhere the router's own choice.

For each token and MoE layer, with p the current router's selection scores over all E experts (its softmax; for the
sigmoid family sigmoid + bias, `models.routing.families.selection_scores`) and top_n(p) its n best-ranked experts, a
replayed expert e (one of the trace's k for that token) is kept when

    e ∈ top_{k+m}(p)      (the router still ranks it within its top-(k + m); m = `top_margin`)
    or  p_e ≥ p_min       (the router still gives it at least `min_prob`)

Each rejected slot, in slot order, takes the router's own choice (its top-k in order; with synthetic flips, the
flipped experts), then its next-ranked experts, skipping those already chosen; gate weights come from the current
router's gate scores at the chosen experts, as the family computes them (as under ID replay, so the router keeps its
gradient). A token that keeps every replayed expert computes exactly as under ID replay, one that keeps none exactly
as without replay (the router's own experts and weights), so the extremes are the two switches it interpolates, bit
for bit: `min_prob=0` keeps every expert (ID replay); `top_margin=null` with `min_prob=null` (or above 1) keeps none
(no replay). `null` switches a test off; `top_margin=0` alone keeps only the replayed experts the router still
chooses, so it computes with no replay's experts.

Logged per update: `routing/soft_replay_kept_frac`, the share of replayed (token, slot) experts kept, and per layer
`routing/soft_replay_kept_frac/layer_<i>`, over the tokens the forward fed (a packed group's prompt once). Defaults
m = 2, no probability test: a replayed expert the router has pushed past its (k+2)-th rank is dropped. Unsearched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, cast

import torch

from algos.routing_variants.base import ROUTING_VARIANTS, RoutingVariant
from models.routing.families import replayed_gate_weights, selection_scores
from models.routing.hooks import ReplayedRoutes, ReplayRule

KEPT = "routing/soft_replay_kept_frac"


def kept_experts(
    probs: torch.Tensor, experts: torch.Tensor, top_margin: int | None, min_prob: float | None
) -> torch.Tensor:
    """`[T, K]` bool: the replayed `experts [T, K]` that pass either test under the current router's `probs [T, E]`."""
    keep = torch.zeros_like(experts, dtype=torch.bool)
    if min_prob is not None:
        keep |= probs.gather(-1, experts) >= min_prob
    if top_margin is not None:
        ranked = probs.topk(min(experts.shape[-1] + top_margin, probs.shape[-1]), dim=-1).indices
        keep |= (experts.unsqueeze(-1) == ranked.unsqueeze(-2)).any(-1)
    return keep


def fill_rejected(probs: torch.Tensor, own: torch.Tensor, experts: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """`experts [T, K]` with each slot not in `keep` replaced by the first of the router's `own` choice `[T, K]`,
    then its ranking by `probs [T, E]`, that is neither kept nor already given to an earlier slot."""
    k = experts.shape[-1]
    # At most k - 1 kept experts can sit among the router's best 2k, so the best 2k hold enough free ones.
    candidates = torch.cat([own, probs.topk(min(2 * k, probs.shape[-1]), dim=-1).indices], dim=-1)
    kept = torch.where(keep, experts, -1)
    earlier = torch.ones(candidates.shape[-1], candidates.shape[-1], dtype=torch.bool, device=own.device).tril(-1)
    repeated = ((candidates.unsqueeze(-1) == candidates.unsqueeze(-2)) & earlier).any(-1)
    taken = (candidates.unsqueeze(-1) == kept.unsqueeze(-2)).any(-1) | repeated
    free_first = torch.sort(taken.to(torch.uint8), dim=-1, stable=True).indices  # free candidates first, best first
    ranked_free = candidates.gather(-1, free_first)
    slot = (~keep).long().cumsum(-1) - 1  # the rejected slots, numbered in slot order
    return torch.where(keep, experts, ranked_free.gather(-1, slot.clamp_min(0)))


class SoftReplayRule(ReplayRule):
    """The soft replay of one forward; counts, per layer, the replayed experts it kept (`kept`, `replayed`)."""

    def __init__(self, top_margin: int | None, min_prob: float | None) -> None:
        self.top_margin = top_margin
        self.min_prob = min_prob
        self.kept: dict[int, torch.Tensor] = {}
        self.replayed: dict[int, torch.Tensor] = {}

    def __call__(
        self,
        layer: int,
        router: torch.nn.Module,
        logits: torch.Tensor,
        weights: torch.Tensor,
        indices: torch.Tensor,
        replayed: ReplayedRoutes,
        first: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        recorded = replayed.recorded[:, None]
        experts = replayed.experts.clamp_min(0)  # rows without a route keep the router's choice below
        probs = selection_scores(router, logits.detach())
        keep = kept_experts(probs, experts, self.top_margin, self.min_prob) & recorded
        none_kept = ~keep.any(-1, keepdim=True)
        chosen = torch.where(none_kept, indices, fill_rejected(probs, indices, experts, keep))
        gates = torch.where(none_kept, weights, replayed_gate_weights(router, logits, chosen, weights))
        if first:
            self.kept[layer] = keep.sum()
            self.replayed[layer] = recorded.sum() * experts.shape[-1]
        return gates, chosen


@ROUTING_VARIANTS.register("soft_replay")
@dataclass(frozen=True)
class SoftReplay(RoutingVariant):
    replay_modes: ClassVar[tuple[str, ...]] = ("r2", "r3")
    replay_modes_why: ClassVar[str] = "keeps some of a replayed routing's experts"
    changes_replay: ClassVar[bool] = True

    top_margin: int | None = 2  # m: keep a replayed expert the router ranks within its top-(k + m); null: no rank test
    min_prob: float | None = None  # keep a replayed expert the router gives at least this probability; null: no test

    def validate(self) -> None:
        if self.top_margin is not None and self.top_margin < 0:
            self._fail(
                f"top_margin={self.top_margin} must be >= 0 (the ranks past the top-k a kept expert may fall), or null"
            )
        if self.min_prob is not None and self.min_prob < 0:
            self._fail(f"min_prob={self.min_prob} must be >= 0 (a probability; above 1 nothing passes), or null")

    def replay_rule(self) -> SoftReplayRule:
        return SoftReplayRule(self.top_margin, self.min_prob)

    def rule_metrics(self, rule: ReplayRule, summed: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        own = cast(SoftReplayRule, rule)  # the step hands a variant the rule its own `replay_rule` made
        if not own.kept:
            return {}
        layers = sorted(own.kept)
        kept = summed(torch.stack([own.kept[layer] for layer in layers]).double())
        replayed = summed(torch.stack([own.replayed[layer] for layer in layers]).double())
        per_layer = (kept / replayed.clamp_min(1)).tolist()
        metrics = {KEPT: float(kept.sum() / replayed.sum().clamp_min(1))}
        metrics.update({f"{KEPT}/layer_{layer}": value for layer, value in zip(layers, per_layer)})
        return metrics
