"""Router-shift importance weighting (RSPO; Zhang et al., "Towards Stable and Effective Reinforcement Learning for
Mixture-of-Experts", arXiv 2510.23027): no replay; each token's ratio π_θ/π_old is multiplied, before the objective
clips and aggregates it, by a stop-gradient factor that shrinks as the router moves away from θ_old on the experts
θ_old activated.

For response token y_t, at every MoE layer ℓ of the L, at the position whose output predicts it (context x, y_<t),
with e_1..e_K the experts θ_old's router chose there and r^ℓ the router's softmax over all experts:

    d_t^ℓ = (1/K) Σ_k | log r_θ^ℓ(e_k) − log r_θold^ℓ(e_k) |      mean over θ_old's K experts
    Δ_t   = (1/L) Σ_ℓ d_t^ℓ                                       mean over the MoE layers
    γ_t   = exp(−Δ_t) ∈ (0, 1]
    γ̃_t   = sg[max(γ_t, γ_min)]                                   floor (`floor` = γ_min), then stop-gradient
    r̃_t   = γ̃_t · π_θ(y_t) / π_old(y_t)                          the ratio the objective clips and aggregates

It enters as log π_old − log γ̃ in place of π_old's log-probs: the same ratio r̃ and, γ̃ being a constant, the
gradient γ̃ ∇r. So every objective composes: token-level ones clip r̃ per token, GSPO's sequence ratio becomes
s_i · (Π_t γ̃_t)^{1/|y_i|}, GMPO's geometric mean likewise (the paper's RSPO is GMPO with this factor:
`algo=gmpo routing_variant=router_shift`); CISPO's weight is sg[clip(r̃)]; MiniRL's IS weight is π_θ/μ_old, so
there γ̃ reaches only its staleness mask. The logged ratios, clip shares and `kl/old_k3` are r̃'s.

Where the paper leaves a choice, or we could not read it, what we chose and why:
- where γ̃ enters: before the clip, as the paper's second version says ("softly rescales importance ratios prior to
  clipping and aggregation"); restatements of its first version multiplied the clipped ratio instead;
- r: the softmax over all experts, the router's distribution, not the renormalised top-K gate weights (renormalising
  would cancel a shift θ_old's experts share); for the sigmoid family, which scores each expert on its own, the
  sigmoid score (`models.routing.families.router_logprobs`);
- means over k and over ℓ, as Δ is written; a sum over layers would make γ fall with depth alone;
- γ_min: its value in the paper was not available to us; 0.8 lets router shift take at most a fifth of a token's
  ratio. Unsearched;
- θ_old's router log-probabilities come from the trainer's π_old pass (so `trainer.pi_old` resolves to decoupled);
  on the first minibatch θ = θ_old and γ̃ = 1; padding gets γ̃ = 1 and is masked before every reduction.

Logged per update: `routing/router_shift_weight` (mean γ̃), `routing/router_shift_floor_frac` (share of tokens whose
γ fell below γ_min), `routing/router_shift_deviation` (mean Δ) and per layer `.../layer_<i>` (mean d^ℓ).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from algos.aggregation import masked_mean
from algos.routing_variants.base import ROUTING_VARIANTS, RoutingVariant, VariantNeeds
from models.routing.hooks import ReplayedRoutes, ReplayRule

WEIGHT, FLOOR_FRAC, DEVIATION = (
    "routing/router_shift_weight",
    "routing/router_shift_floor_frac",
    "routing/router_shift_deviation",
)


class KeepOwnRouting(ReplayRule):
    """Replays nothing: every token keeps the router's own experts and weights. With `score_replayed`, the forward
    still reads the current router's log-probabilities of a recorded trace's experts (θ_old's)."""

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
        return weights, indices


@dataclass(frozen=True)
class Shift:
    """Router shift of a minibatch's response tokens: `log_weight [B, T]` = log γ̃ (≤ 0), `deviation [L, B, T]` = d^ℓ,
    `floored [B, T]`: γ fell below γ_min; all 0 / False at padding."""

    log_weight: torch.Tensor
    deviation: torch.Tensor
    floored: torch.Tensor

    @classmethod
    def none(cls, mask: torch.Tensor, layers: int) -> Shift:
        """θ = θ_old: no shift, γ̃ = 1."""
        zeros = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        return cls(zeros, zeros.expand(layers, *mask.shape), torch.zeros_like(mask, dtype=torch.bool))

    def gathered(self, rows: Callable[..., torch.Tensor]) -> Shift:
        """The shift of every data-parallel rank's rows (`rows(tensor, dim=...)` concatenates them, padding with 0 /
        False)."""
        return Shift(rows(self.log_weight), rows(self.deviation, dim=1), rows(self.floored))

    def metrics(self, mask: torch.Tensor) -> dict[str, float]:
        mask = mask.bool()
        values = {
            WEIGHT: masked_mean(torch.exp(self.log_weight), mask),
            FLOOR_FRAC: masked_mean(self.floored.float(), mask),
            DEVIATION: masked_mean(self.deviation.mean(dim=0), mask),
        }
        values.update({f"{DEVIATION}/layer_{layer}": masked_mean(d, mask) for layer, d in enumerate(self.deviation)})
        return dict(zip(values, torch.stack(list(values.values())).tolist()))


def router_shift(current: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, floor: float) -> Shift:
    """The shift of `current` against `old` (`[L, B, T, K]` fp32 log-probabilities of θ_old's experts under θ's and
    θ_old's routers, at the positions predicting the response tokens) on the tokens in `mask [B, T]`."""
    mask = mask.bool()
    deviation = torch.where(mask, (current.float() - old.float()).abs().mean(dim=-1), 0.0)  # [L, B, T]
    log_gamma = -deviation.mean(dim=0)
    log_floor = math.log(floor) if floor > 0 else -math.inf
    floored = (log_gamma < log_floor) & mask
    return Shift(torch.where(mask, log_gamma.clamp(min=log_floor), 0.0), deviation, floored)


def response_positions(trace: torch.Tensor, prompt_width: int, tokens: int) -> torch.Tensor:
    """`[L, B, P+T-1, K]` values of a scoring forward's fed positions -> `[L, B, T, K]` at the positions whose output
    predicts each response token (P-1 .. P+T-2)."""
    return trace[:, :, prompt_width - 1 : prompt_width - 1 + tokens]


@ROUTING_VARIANTS.register("router_shift")
@dataclass(frozen=True)
class RouterShift(RoutingVariant):
    replay_modes: ClassVar[tuple[str, ...]] = ("none",)
    replay_modes_why: ClassVar[str] = "weighs each token's ratio by how far the router moved, instead of replaying"
    needs: ClassVar[VariantNeeds] = VariantNeeds(old_router=True)

    floor: float = 0.8  # γ_min: γ̃ = max(γ, γ_min); 1 turns the weighting off, 0 leaves γ unfloored

    def validate(self) -> None:
        if not 0.0 <= self.floor <= 1.0:
            self._fail(f"floor={self.floor} must be in [0, 1] (γ_min, a floor on exp(−mean |Δ log r|))")

    def replay_rule(self) -> ReplayRule:
        return KeepOwnRouting()

    def shift(self, current: torch.Tensor, old: torch.Tensor, prompt_width: int, mask: torch.Tensor) -> Shift:
        """The shift of a minibatch's response tokens (`mask [B, T]`) from the log-probabilities of θ_old's experts
        under θ's router (`current`) and θ_old's (`old`), both `[L, B, P+T-1, K]` over a scoring forward's fed
        positions (prompts of width `prompt_width`)."""
        tokens = mask.shape[1]
        current = response_positions(current, prompt_width, tokens)
        return router_shift(current, response_positions(old, prompt_width, tokens).to(current.device), mask, self.floor)

    def unshifted(self, mask: torch.Tensor, layers: int) -> Shift:
        """θ = θ_old (the on-policy minibatch): γ̃ = 1."""
        return Shift.none(mask, layers)
