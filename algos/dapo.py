"""DAPO's policy loss (Yu et al., ByteDance Seed / Tsinghua, arXiv 2503.14476).

    J = E[ (1 / Σ_i |y_i|) Σ_i Σ_t min( r_{i,t} Â_i, clip(r_{i,t}, 1 − ε_low, 1 + ε_high) Â_i ) ]

Token-level ratios with "clip-higher" (ε_low 0.2, ε_high 0.28: room for low-probability tokens to grow) and
"token-level loss": aggregation `token-mean` by default, every token of the minibatch weighing the same.
DAPO's other two ingredients are not part of the loss: dynamic sampling (drop groups whose rewards are all
equal, refill the batch) belongs to the training loop, and overlong filtering / soft overlong punishment
belong to the reward and the data.
"""

from dataclasses import dataclass

from algos.aggregation import LossAgg
from algos.objective import OBJECTIVES, Objective, PolicyBatch, PolicyLoss, token_clip_policy_loss


@OBJECTIVES.register("dapo")
@dataclass(frozen=True)
class DAPO(Objective):
    clip_low: float = 0.2  # ε_low
    clip_high: float = 0.28  # ε_high, "clip-higher": room for low-probability tokens to grow
    loss_agg: LossAgg = LossAgg["token-mean"]  # DAPO's token-level loss: every token of the minibatch weighs the same

    def validate(self) -> None:
        self._check_ratio_lower_clip("clip_low")
        self._check_non_negative("clip_high")

    def policy_loss(self, batch: PolicyBatch) -> PolicyLoss:
        return token_clip_policy_loss(batch, self.clip_low, self.clip_high, self.loss_agg)
