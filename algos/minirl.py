"""MiniRL, the baseline of "Stabilizing Reinforcement Learning with LLMs: Formulation and Practices" (Zheng et al.,
Qwen, arXiv 2512.01374, §4.1-4.2).

    J = E_{x, y ~ μ_old}[ Σ_t M_t · sg[ min(π_θ(y_t) / μ_old(y_t), C) ] · Â · log π_θ(y_t) ],
    Â = R − mean_group R,
    M_t = 0 if (Â > 0 ∧ r_t > 1 + ε_high) ∨ (Â < 0 ∧ r_t < 1 − ε_low), else 1,   r_t = π_θ(y_t) / π_old(y_t)

REINFORCE with the token-level IS weight against the engine that sampled (μ_old, so the training–inference
discrepancy π_old/μ_old is corrected inside the objective), truncated at C (TIS, §4.2), and PPO-style
masking by the staleness ratio r_t decided against π_old, the proximal policy (GRPO's clip range). The group
advantage is only centred (`advantage_std = False`). Aggregation is fixed to `seq-mean-token-sum`: the token sum of
each response, then the mean over responses, as the expectation is written (the paper's point: no length
normalisation, which would invalidate the first-order approximation). Gradient of an unmasked token:
−w_t · Â · ∇log π_θ(y_t) / B with w_t = min(π_θ/μ_old, C); a masked token contributes none.
Clip metrics count the masked tokens (M_t = 0); `minirl/is_weight_mean` and `minirl/truncated_frac` describe w_t.

`train_infer_is = False` is the paper's "w/o train-infer IS" ablation (its Fig. 2): the weight drops the
training–inference factor π_old/μ_old and keeps the staleness one, w_t = min(π_θ/π_old, C), which is 1 in value
on-policy, so the gradient follows samples of μ_old as if they were π_old's. `mask_stale = False` is its "w/o
clipping" ablation: M_t = 1 for every token.
"""

from dataclasses import dataclass
from typing import ClassVar, cast

import torch

from algos.grpo import GRPO
from algos.objective import OBJECTIVES, Objective, PolicyBatch, PolicyLoss

IS_WEIGHT_MEAN = "minirl/is_weight_mean"  # of the truncated weight w_t over valid tokens
TRUNCATED = "minirl/truncated_frac"  # share of valid tokens whose weight was truncated at C


@OBJECTIVES.register("minirl")
@dataclass(frozen=True)
class MiniRL(Objective):
    advantage_std: ClassVar[bool] = False  # Â = R − group mean
    needs_rollout_logp: ClassVar[bool] = True  # the IS weight is against μ_old

    clip_low: float = GRPO.clip_low  # ε_low of the staleness mask (r_t against π_old): GRPO's, as the paper's
    clip_high: float = GRPO.clip_high  # ε_high
    is_truncation: float = 5.0  # C: the token IS weight π_θ/μ_old is truncated at C (§4.2)
    mask_stale: bool = True  # false: no staleness mask, M_t = 1 (the paper's "w/o clipping" ablation)
    train_infer_is: bool = True  # false: the weight is min(π_θ/π_old, C), without the π_old/μ_old factor (ablation)

    def validate(self) -> None:
        self._check_ratio_lower_clip("clip_low")
        self._check_non_negative("clip_high")
        self._check_positive("is_truncation")

    def policy_loss(self, batch: PolicyBatch) -> PolicyLoss:
        advantages = batch.advantages[:, None]
        ratio = torch.exp(batch.log_ratio).detach()
        masked_out = ((advantages > 0) & (ratio > 1 + self.clip_high)) | (
            (advantages < 0) & (ratio < 1 - self.clip_low)
        )
        masked_out &= self.mask_stale
        # needs_rollout_logp: `Objective.__call__` refuses a batch without μ_old, so rollout_log_ratio is there.
        is_log_ratio = cast(torch.Tensor, batch.rollout_log_ratio) if self.train_infer_is else batch.log_ratio
        raw_weight = torch.exp(is_log_ratio).detach()
        weight = raw_weight.clamp(max=self.is_truncation)
        per_token = torch.where(masked_out, 0.0, -weight * advantages * batch.logp)
        token_clipped = masked_out & batch.mask
        return PolicyLoss(
            per_token,
            token_clipped,
            token_clipped.any(dim=1),
            "seq-mean-token-sum",
            token_means={IS_WEIGHT_MEAN: weight, TRUNCATED: (raw_weight > self.is_truncation).float()},
        )
