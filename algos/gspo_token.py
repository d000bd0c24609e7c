"""GSPO-token (Zheng et al., Qwen, arXiv 2507.18071, §4.3, eqs. 13-14).

    J = E[ (1/G) Σ_i (1/|y_i|) Σ_t min( s_{i,t} Â_{i,t}, clip(s_{i,t}, 1 − ε_low, 1 + ε_high) Â_{i,t} ) ],
    s_{i,t} = sg[s_i] · π_θ(y_{i,t}) / sg[π_θ(y_{i,t})],
    i.e. log s_{i,t} = sg[log s_i] + log π_θ(y_{i,t}) − sg[log π_θ(y_{i,t})]

Every token carries the value of its response's GSPO ratio s_i but its own gradient path, which is what lets
GSPO take per-token advantages (multi-turn credit). Aggregation is fixed to `seq-mean-token-mean` (eq. 13; no
`loss_agg`). With one advantage per response, which is what this API takes, the loss, the clipping and the
gradient equal `gspo`'s (the paper: "numerically identical"). The one exception is a response whose mean
log-ratio passes the ±10 clamp: `gspo` then has no gradient, this form keeps −Â_i·s_i/|y_i| per token.
Its hyperparameters are `gspo`'s (it derives from it): the clip applies to s_{i,t}, whose value is s_i.
"""

from dataclasses import dataclass

import torch

from algos.gspo import GSPO
from algos.objective import OBJECTIVES, PolicyBatch, PolicyLoss, clipped_surrogate


@OBJECTIVES.register("gspo_token")
@dataclass(frozen=True)
class GSPOToken(GSPO):
    def policy_loss(self, batch: PolicyBatch) -> PolicyLoss:
        # batch.logp is zero at padding, so the token term is exactly 0 there and its gradient too.
        log_ratio = batch.seq_log_ratio.detach()[:, None] + (batch.logp - batch.logp.detach())
        loss, binding = clipped_surrogate(
            torch.exp(log_ratio), batch.advantages[:, None], self.clip_low, self.clip_high
        )
        token_clipped = binding & batch.mask
        return PolicyLoss(loss, token_clipped, token_clipped.any(dim=1), "seq-mean-token-mean")
