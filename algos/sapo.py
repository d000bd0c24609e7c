"""SAPO, Soft Adaptive Policy Optimization (Gao, Zheng et al., Qwen, arXiv 2511.20347).

    J = E[ (1/G) Σ_i (1/|y_i|) Σ_t f_{i,t}(r_{i,t}) Â_i ],   f(r) = (4/τ) · σ(τ (r − 1)),
    τ = τ_pos if Â_i > 0 else τ_neg

A smooth trust region instead of a hard clip: ∂f/∂r = sech²(τ(r − 1)/2), so a token's gradient
−Â · sech²(τ(r − 1)/2) · r · ∇log π_θ has weight 1 on-policy (r = 1), like GRPO's, and fades as r moves
away from 1.
τ_neg > τ_pos (by default) because negative-advantage updates spread probability over the whole
vocabulary and are the less stable ones. Per-token loss −f(r)·Â; aggregation fixed to `seq-mean-token-mean`
(no `loss_agg`). Nothing is clipped, so the clip metrics are 0; `sapo/gate_weight_mean` is the mean over valid
tokens of the gradient weight sech²(τ(r − 1)/2).
"""

from dataclasses import dataclass

import torch

from algos.objective import OBJECTIVES, Objective, PolicyBatch, PolicyLoss


@OBJECTIVES.register("sapo")
@dataclass(frozen=True)
class SAPO(Objective):
    tau_pos: float = 1.0  # gate temperature for positive advantages
    tau_neg: float = 1.05  # for negative ones: sharper, since those updates are the less stable

    def validate(self) -> None:
        self._check_positive("tau_pos", "tau_neg")

    def policy_loss(self, batch: PolicyBatch) -> PolicyLoss:
        ratio = torch.exp(batch.log_ratio)
        advantages = batch.advantages[:, None]
        tau = torch.where(advantages > 0, self.tau_pos, self.tau_neg)
        gate = torch.sigmoid(tau * (ratio - 1))
        per_token = -(4 / tau) * gate * advantages
        # 4σ(x)(1 − σ(x)) = sech²(x/2): the gate's gradient weight, without evaluating cosh of a large x.
        gate_weight = 4 * gate * (1 - gate)
        no_clip = torch.zeros_like(batch.mask)
        return PolicyLoss(
            per_token,
            no_clip,
            no_clip.any(dim=1),
            "seq-mean-token-mean",
            token_means={"sapo/gate_weight_mean": gate_weight.detach()},
        )
