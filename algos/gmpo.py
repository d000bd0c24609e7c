"""GMPO, Geometric-Mean Policy Optimization (Zhao et al., arXiv 2507.20673), in verl's form.

    J = E[ (1/G) Σ_i Â_i · exp( (1/|y_i|) Σ_t ℓ̃_{i,t} ) ],
    ℓ̃_{i,t} = min(lr, clip(lr, −ε_low, ε_high)) if Â_i > 0,  max(lr, clip(lr, −ε_low, ε_high)) if Â_i < 0,
    lr = log π_θ(y_{i,t}) − log π_old(y_{i,t})

The geometric instead of the arithmetic mean of the token-level clipped objective: tokens are clipped in LOG
space, sign-aware (the min of PPO), before the mean; the sequence ratio is then exp of the mean (clamped to ±10
before exp), and the loss is −Â_i times it. The default (ε_low, ε_high) gives a ratio range of about
(0.67, 1.49). Without clipping the sequence ratio equals GSPO's s_i; GMPO clips tokens inside
the mean, GSPO clips the mean. Aggregation is fixed (no `loss_agg`): a mean over responses with at least one
token. A token's clip binds when Â_i > 0 ∧ lr > ε_high or Â_i < 0 ∧ lr < −ε_low.
"""

from dataclasses import dataclass

import torch

from algos.objective import OBJECTIVES, SEQ_LOG_RATIO_BOUND, Objective, PolicyBatch, PolicyLoss


@OBJECTIVES.register("gmpo")
@dataclass(frozen=True)
class GMPO(Objective):
    clip_low: float = 0.4  # log space: a token's log-ratio is kept above −clip_low (ratio ≥ e^-0.4 ≈ 0.67)
    clip_high: float = 0.4  # and below clip_high (ratio ≤ e^0.4 ≈ 1.49)

    def validate(self) -> None:
        # Log-space bounds: any non-negative width keeps the ratio bound e^-clip_low positive.
        self._check_non_negative("clip_low", "clip_high")

    def policy_loss(self, batch: PolicyBatch) -> PolicyLoss:
        log_ratio = batch.log_ratio
        advantages = batch.advantages[:, None]
        binding = ((advantages > 0) & (log_ratio > self.clip_high)) | ((advantages < 0) & (log_ratio < -self.clip_low))
        # Where the clip binds the bound replaces lr (no gradient); elsewhere the sign-aware min keeps lr.
        clipped = torch.where(binding, log_ratio.clamp(-self.clip_low, self.clip_high), log_ratio)
        token_clipped = binding & batch.mask
        mean_log_ratio = clipped.sum(dim=1) / batch.lengths.clamp(min=1)
        seq_ratio = torch.exp(mean_log_ratio.clamp(-SEQ_LOG_RATIO_BOUND, SEQ_LOG_RATIO_BOUND))
        # seq-mean-token-mean of a loss constant along each response is the mean over responses of that loss.
        per_token = (-batch.advantages * seq_ratio)[:, None].expand_as(log_ratio)
        return PolicyLoss(per_token, token_clipped, token_clipped.any(dim=1), "seq-mean-token-mean")
