"""CISPO, Clipped IS-weight Policy Optimization (MiniMax-M1, arXiv 2506.13585, eqs. 4-5).

    J = E[ (1 / Σ_i |y_i|) Σ_i Σ_t sg( clip(r_{i,t}, 1 − ε_low, 1 + ε_high) ) · Â_i · log π_θ(y_{i,t}) ]

REINFORCE with a clipped, stop-gradient importance weight: the clip bounds the weight instead of dropping
the token, so every token keeps the gradient clip(r)·Â·∇log π_θ. Per-token loss −sg(clip(r))·Â·log π_θ (its
value depends on log π_θ itself, not only on the ratio; only its gradient is meaningful). Aggregation is fixed to
`token-mean` (eq. 4; no `loss_agg`). `clip_low = None` (default) means no lower bound, as MiniMax-M1 ("we did
not impose a lower bound"); `clip_high` 0.2 is verl's example, the paper does not disclose its value.
Clip metrics count the tokens whose weight was changed, r ≠ clip(r), whatever the advantage's sign.
"""

from dataclasses import dataclass

import torch

from algos.objective import OBJECTIVES, Objective, PolicyBatch, PolicyLoss


@OBJECTIVES.register("cispo")
@dataclass(frozen=True)
class CISPO(Objective):
    clip_low: float | None = None  # None: no lower bound on the weight, as MiniMax-M1
    clip_high: float = 0.2  # weight cap 1 + clip_high (verl's example; the paper does not disclose its value)

    def validate(self) -> None:
        self._check_ratio_lower_clip("clip_low")
        self._check_non_negative("clip_high")

    def policy_loss(self, batch: PolicyBatch) -> PolicyLoss:
        ratio = torch.exp(batch.log_ratio).detach()
        lower = None if self.clip_low is None else 1 - self.clip_low
        weight = ratio.clamp(min=lower, max=1 + self.clip_high)
        per_token = -weight * batch.advantages[:, None] * batch.logp
        token_clipped = (weight != ratio) & batch.mask
        return PolicyLoss(per_token, token_clipped, token_clipped.any(dim=1), "token-mean")
