"""GSPO, Group Sequence Policy Optimization (Zheng et al., Qwen, arXiv 2507.18071, eqs. 5-7).

    J = E[ (1/G) Σ_i min( s_i Â_i, clip(s_i, 1 − ε_low, 1 + ε_high) Â_i ) ],
    s_i = (π_θ(y_i|x) / π_old(y_i|x))^{1/|y_i|} = exp( (1/|y_i|) Σ_t log r_{i,t} )

One length-normalised (geometric-mean) ratio per response, clipped per response: "the unit of optimisation
should match the unit of reward". Because s_i is a geometric mean, the clip range is ~1e-4, not 0.2; the
defaults are the paper's (§5.1). Aggregation is fixed (no `loss_agg`): a plain mean over responses
(those with at least one token), as eq. 5; a broadcast sequence loss summed over tokens would weigh each
response by its length. The mean log-ratio is clamped to ±10 before exp (`algos.objective`).
Gradient (eq. 10, unclipped): −Â_i · s_i / |y_i| · ∇log π_θ(y_{i,t}) per token, over the number of
responses; a response whose clip binds contributes none.
"""

from dataclasses import dataclass

import torch

from algos.objective import OBJECTIVES, Objective, PolicyBatch, PolicyLoss, clipped_surrogate


@OBJECTIVES.register("gspo")
@dataclass(frozen=True)
class GSPO(Objective):
    clip_low: float = 3e-4  # ε_low on the sequence ratio s_i: a geometric mean, so ~1e-4 rather than 0.2 (§5.1)
    clip_high: float = 4e-4  # ε_high

    def validate(self) -> None:
        self._check_ratio_lower_clip("clip_low")
        self._check_non_negative("clip_high")

    def policy_loss(self, batch: PolicyBatch) -> PolicyLoss:
        seq_ratio = torch.exp(batch.seq_log_ratio)
        seq_loss, binding = clipped_surrogate(seq_ratio, batch.advantages, self.clip_low, self.clip_high)
        seq_clipped = binding & batch.nonempty
        # seq-mean-token-mean of a loss constant along each response is the mean over responses of that loss.
        per_token = seq_loss[:, None].expand_as(batch.log_ratio)
        return PolicyLoss(per_token, seq_clipped[:, None] & batch.mask, seq_clipped, "seq-mean-token-mean")
