"""Dr. GRPO (Liu et al., "Understanding R1-Zero-Like Training: A Critical Perspective", arXiv 2503.20783).

    J = E[ (1/G) Σ_i Σ_t min( r_{i,t} Â_i, clip(r_{i,t}, 1 − ε, 1 + ε) Â_i ) ] / T_norm,
    Â_i = R_i − mean_j R_j

GRPO without its two biases: no 1/|y_i| (a long wrong answer is no longer penalised less per token) and no
division of the advantage by the group std (`advantage_std = False`, the default of `algo.advantage_std` here;
`group_advantages(..., scale_by_std=False)`). Aggregation: `seq-mean-token-sum-norm` by default, i.e. the masked token
sum divided by the constant B · T_norm, T_norm = `norm_tokens` (the generation budget, as the released code's
MAX_TOKENS) or, when unset, the padded length T of the batch. Token-level ratios, clip 0.2 / 0.2, no KL (paper's
settings).
"""

from dataclasses import dataclass
from typing import ClassVar

from algos.aggregation import LossAgg
from algos.objective import OBJECTIVES, Objective, PolicyBatch, PolicyLoss, token_clip_policy_loss


@OBJECTIVES.register("dr_grpo")
@dataclass(frozen=True)
class DrGRPO(Objective):
    advantage_std: ClassVar[bool] = False  # advantage = reward − group mean

    clip_low: float = 0.2  # ε, symmetric (the paper's setting)
    clip_high: float = 0.2  # the same ε above 1: the clip is symmetric
    loss_agg: LossAgg = LossAgg["seq-mean-token-sum-norm"]  # token sum over the constant B · T_norm
    norm_tokens: int | None = None  # T_norm, the generation budget; None: the batch's padded length T

    def validate(self) -> None:
        self._check_ratio_lower_clip("clip_low")
        self._check_non_negative("clip_high")
        self._check_positive("norm_tokens")
        if self.norm_tokens is not None and self.loss_agg != "seq-mean-token-sum-norm":
            self._fail(
                f"norm_tokens = {self.norm_tokens} is only used by loss_agg 'seq-mean-token-sum-norm', "
                f"got loss_agg {self.loss_agg!r}; set norm_tokens to null or change loss_agg"
            )

    def policy_loss(self, batch: PolicyBatch) -> PolicyLoss:
        return token_clip_policy_loss(batch, self.clip_low, self.clip_high, self.loss_agg, self.norm_tokens)
