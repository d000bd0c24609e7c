"""What routing is measured by: the drift between two traces of the same tokens, by count (the GSPO paper's "experts
changed") and by the gate mass it moves, the experts' load and its MaxVio, and the scale-free margin at the top-k cut
(colibri issue #119) with its summary."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.routing.trace import RoutingTrace
from models.statistics import weighted_median

# The scale-free margin of real routers at the top-8 cut, medians over tokens and layers (colibri issue #119, on
# 4-bit checkpoints): Qwen3.6-35B-A3B (softmax, 256 experts) and GLM-5.2 (sigmoid + bias, 256 experts).
MARGIN_ANCHORS = {"Qwen3.6-35B-A3B (softmax)": 0.0188, "GLM-5.2 (sigmoid + bias)": 0.0114}
SMALL_MARGIN = 0.01  # a token whose margin is below this sits at the top-k cut, at the anchors' scale


def topk_margin(scores: torch.Tensor, k: int) -> torch.Tensor:
    """`[T]`: (s[k−1] − s[k]) / (s[0] − s[2k−1]) over each row's 2k highest `scores [T, E]` (0-based ranks, so
    s[k−1] is the last chosen and s[k] the first left out), the scale-free distance from the top-k cut of colibri
    issue #119. Scores outside the row's allowed groups (−inf) do not count: with fewer than 2k allowed, s[2k−1] is
    the lowest allowed one (at least k + 1 must be). A row whose 2k highest scores tie has margin 0 (at the cut)."""
    return margin_of_ranked(scores.float().topk(min(2 * k, scores.shape[-1]), dim=-1).values, k)


def margin_of_ranked(top: torch.Tensor, k: int) -> torch.Tensor:
    """`topk_margin` from each row's highest scores already ranked, `top [T, min(2k, E)]` fp32 in descending order."""
    if top.shape[-1] <= k:
        raise ValueError(f"the margin at the top-{k} cut needs more than {k} experts; the scores have {top.shape[-1]}")
    if (top[:, k] == float("-inf")).any():  # (NaN scores pass through: a diverged model is told apart elsewhere)
        raise ValueError(
            f"the margin at the top-{k} cut needs {k + 1} allowed experts per token; a token's groups leave it {k}"
        )
    return _over_spread(top[:, k - 1] - top[:, k], top)


def _over_spread(gap: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """`gap [T]` over each ranked row's spread s[0] − s[2k−1] (its lowest allowed score: −inf outside the allowed
    groups does not count); 0 where the spread is 0."""
    spread = top[:, 0] - torch.where(top == float("-inf"), torch.inf, top).min(dim=-1).values
    return torch.where(spread > 0, gap / spread.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(gap))


def top_gap_share(top: torch.Tensor) -> torch.Tensor:
    """`[T]`: (s[0] − s[1]) / (s[0] − s[2k−1]) of ranked rows `top [T, min(2k, E)]` (as `margin_of_ranked` reads
    them): the share of the margin's denominator that the best expert's lead takes. Where one expert dominates a
    softmax router's probabilities that share is near 1 and every gap further down, the cut's among them, is a small
    fraction of the spread, however far apart the logits at the cut are: what a small `topk_margin` means. Rows whose
    scores tie have share 0."""
    return _over_spread(top[:, 0] - top[:, 1], top)


@dataclass(frozen=True)
class MarginSummary:
    """`topk_margin` over tokens: the weighted `median`, `mean` and share `small` below `SMALL_MARGIN`."""

    median: float
    mean: float
    small: float

    @classmethod
    def of(cls, margins: torch.Tensor, weights: torch.Tensor) -> MarginSummary:
        """Of `margins [N]` with token `weights [N]` (at least one positive)."""
        weights = weights.float()
        total = weights.sum()
        return cls(
            weighted_median(margins, weights),
            float((margins * weights).sum() / total),
            float(((margins < SMALL_MARGIN).float() * weights).sum() / total),
        )


@dataclass
class RoutingDrift:
    """Share of activated experts that changed between two routings of the same tokens.

    `per_layer [L]`: for each MoE layer, the share of activated (token, slot) experts in `new` that are not in
    `old`'s top-k set for that token (the GSPO paper's "~10% of activated experts differ"). `expert_change_frac`:
    its mean over layers. `token_any_change_frac`: share of tokens whose expert set changed in at least one layer.
    Only positions inside `mask` that carry a route in both traces count.
    """

    per_layer: torch.Tensor
    expert_change_frac: float
    token_any_change_frac: float
    tokens: int


def routing_drift(old: RoutingTrace, new: RoutingTrace, mask: torch.Tensor) -> RoutingDrift:
    """Compare two traces of the same tokens (`[L, B, S, K]` each) on the positions in `mask [B, S]`."""
    if old.shape != new.shape:
        raise ValueError(f"cannot compare routing traces of shapes {old.shape} and {new.shape}")
    L, B, S, K = new.shape
    if tuple(mask.shape) != (B, S):
        raise ValueError(f"drift mask has shape {tuple(mask.shape)}, the traces cover {(B, S)}")
    valid = mask.to(new.experts.device).bool().unsqueeze(0) & old.recorded() & new.recorded()  # [L, B, S]
    valid = valid.all(dim=0)  # [B, S]: a token counts when every layer has both routes
    tokens = int(valid.sum())
    if tokens == 0:
        per_layer = torch.zeros(L)
        any_change = 0.0
    else:
        # [L, B, S, K]: slot k of `new` is an expert that `old` also activated for this token and layer
        kept = (new.experts.unsqueeze(-1) == old.experts.unsqueeze(-2)).any(-1)
        changed = (~kept).float() * valid.unsqueeze(0).unsqueeze(-1)
        per_layer = changed.sum(dim=(1, 2, 3)) / (tokens * K)
        any_change = float((changed.sum(dim=(0, 3)) > 0).sum()) / tokens
    return RoutingDrift(per_layer, float(per_layer.mean()), any_change, tokens)


@dataclass
class GateShift:
    """How much of each token's expert mixture moved between two routings of the same tokens: per MoE layer and
    token, the total-variation distance ½ Σ_e |ĝ_old(e) − ĝ_new(e)| between its gate weights over all experts, ĝ
    the weights of its chosen experts normalised to sum 1 (0 for the others). 0 when the same experts carry the same
    weights, 1 when no expert is shared. Where the paper's count (`RoutingDrift`) weighs every changed expert alike,
    this weighs it by the gate mass it carried: swapping a slot whose renormalised weight is 1e-4 (a near-one-hot
    router's second expert) changes a count of experts and almost nothing the token computes. `per_layer [L]`, the
    mean over tokens; `mean`, over layers. Only positions inside the mask that carry a route and gates in both count."""

    per_layer: torch.Tensor
    mean: float
    tokens: int


def gate_shift(old: RoutingTrace, new: RoutingTrace, mask: torch.Tensor) -> GateShift:
    """`GateShift` of two traces of the same tokens recorded with their gates (`[L, B, S, K]` each), on `mask [B,
    S]`."""
    if old.weights is None or new.weights is None:
        raise ValueError("the gate shift needs both traces recorded with their gates (record_routing(gates=True))")
    if old.shape != new.shape:
        raise ValueError(f"cannot compare routing traces of shapes {old.shape} and {new.shape}")
    L, B, S, K = new.shape
    valid = (mask.to(new.experts.device).bool().unsqueeze(0) & old.recorded() & new.recorded()).all(dim=0)  # [B, S]
    tokens = int(valid.sum())
    if tokens == 0:
        return GateShift(torch.zeros(L), 0.0, 0)

    def normalised(weights: torch.Tensor) -> torch.Tensor:
        total = weights.float().sum(dim=-1, keepdim=True)
        return weights.float() / torch.where(total > 0, total, torch.ones_like(total))

    w_old, w_new = normalised(old.weights), normalised(new.weights)
    same = new.experts.unsqueeze(-1) == old.experts.unsqueeze(-2)  # [L, B, S, K_new, K_old]
    old_at_new = (same * w_old.unsqueeze(-2)).sum(dim=-1)  # each new slot's expert's old weight (0: not chosen)
    dropped = w_old * ~same.any(dim=-2)  # old experts the new routing left out
    distance = 0.5 * ((w_new - old_at_new).abs().sum(dim=-1) + dropped.sum(dim=-1))  # [L, B, S]
    per_layer = (distance * valid).sum(dim=(1, 2)) / tokens
    return GateShift(per_layer, float(per_layer.mean()), tokens)


def expert_load(trace: RoutingTrace, mask: torch.Tensor) -> torch.Tensor:
    """`[L, E]` share of (token, slot) assignments each expert received on the positions in `mask [B, S]`."""
    L, B, S, K = trace.shape
    valid = (mask.to(trace.experts.device).bool().unsqueeze(0) & trace.recorded()).unsqueeze(-1).expand(L, B, S, K)
    ids = trace.experts.long().clamp_min(0)
    counts = torch.zeros(L, trace.num_experts, device=ids.device)
    counts.scatter_add_(1, ids.reshape(L, -1), valid.reshape(L, -1).float())
    return counts / counts.sum(dim=1, keepdim=True).clamp_min(1.0)


def load_max_violation(trace: RoutingTrace, mask: torch.Tensor) -> float:
    """MaxVio (DeepSeek's loss-free balancing): mean over layers of max_e load_e / mean load − 1 (0 = balanced)."""
    load = expert_load(trace, mask)
    return float((load.max(dim=1).values * trace.num_experts - 1.0).mean())
