"""GRPO as the GSPO paper's tuned baseline (Zheng et al., arXiv 2507.18071, eq. 2; Shao et al., arXiv 2402.03300).

    J = E[ (1/G) Σ_i (1/|y_i|) Σ_t min( r_{i,t} Â_i, clip(r_{i,t}, 1 − ε_low, 1 + ε_high) Â_i ) ],
    r_{i,t} = π_θ(y_{i,t} | x, y_{i,<t}) / π_old(y_{i,t} | x, y_{i,<t})

Token-level ratios and clipping. Aggregation: `seq-mean-token-mean` by default (a token mean inside each
response, then a mean over responses, as eq. 2), selectable with `loss_agg`. The default clip range is the one
the GSPO paper tuned for its GRPO baseline (§5.1). Gradient of an unclipped token:
−Â_i · r_{i,t} / |y_i| · ∇log π_θ(y_{i,t}), over the number of responses; a binding clip removes it.
"""

from dataclasses import dataclass

from algos.aggregation import LossAgg
from algos.objective import OBJECTIVES, Objective, PolicyBatch, PolicyLoss, token_clip_policy_loss


@OBJECTIVES.register("grpo")
@dataclass(frozen=True)
class GRPO(Objective):
    clip_low: float = 0.2  # ε_low: the ratio's lower bound is 1 − ε_low
    clip_high: float = 0.27  # ε_high: the upper bound 1 + ε_high (the GSPO paper's tuned GRPO baseline)
    loss_agg: LossAgg = LossAgg["seq-mean-token-mean"]  # how per-token losses reduce (algos.objective)

    def validate(self) -> None:
        self._check_ratio_lower_clip("clip_low")
        self._check_non_negative("clip_high")

    def policy_loss(self, batch: PolicyBatch) -> PolicyLoss:
        return token_clip_policy_loss(batch, self.clip_low, self.clip_high, self.loss_agg)
