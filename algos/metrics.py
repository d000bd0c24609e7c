"""The statistics every objective reports, computed in one place so that all objectives are comparable.

Definitions follow verl's and TRL's where they exist (the GSPO paper's Fig. 2 for GSPO's token share), with
lr = clamped token log-ratio log π_θ − log π_old:
- `ratio/token_mean`, `ratio/token_var`, `ratio/token_max`: of the token ratios exp(lr) over valid tokens
  (population variance);
- `ratio/seq_mean`, `ratio/seq_var`: of the sequence ratios exp(masked mean of lr) (GSPO's s_i) over
  sequences with at least one valid token;
- `clip/token_frac`: share of valid tokens whose clip binds; `clip/seq_frac`: share of non-empty sequences
  whose clip binds (sequence-level objectives) or that hold a binding-clipped token (token-level ones). For
  GSPO a clipped sequence clips all its tokens, so `clip/token_frac` is the token-weighted share
  Σ|y_i|·1[clipped_i] / Σ|y_i| of the GSPO paper's Fig. 2;
- `kl/old_k3`: mean over valid tokens of r − 1 − log r (k3 estimate of KL(π_old ‖ π_θ), ≥ 0 per token);
- `kl/ref_k3`: mean over valid tokens of the k3 KL to the reference policy (only when ref_logp is given);
- `loss/policy`: the aggregated policy loss without the KL term.
Every statistic over an empty set is 0.
"""

import torch
from torch import Tensor

from algos.common import PolicyBatch, PolicyLoss, k3, masked, masked_mean, masked_var, sequence_mean


@torch.no_grad()
def policy_metrics(batch: PolicyBatch, policy: PolicyLoss, policy_loss: Tensor) -> dict[str, float]:
    """The shared statistics of one objective call, as Python floats (one device sync for all of them)."""
    token_ratio = torch.exp(batch.log_ratio)
    seq_ratio = torch.exp(batch.seq_log_ratio)
    values: dict[str, Tensor] = {
        "ratio/token_mean": masked_mean(token_ratio, batch.mask),
        "ratio/token_var": masked_var(token_ratio, batch.mask),
        # Ratios are positive, so zero at padding never wins the max over a non-empty mask.
        "ratio/token_max": masked(token_ratio, batch.mask).max() if batch.mask.numel() else token_ratio.new_zeros(()),
        "ratio/seq_mean": masked_mean(seq_ratio, batch.nonempty),
        "ratio/seq_var": masked_var(seq_ratio, batch.nonempty),
        "clip/token_frac": masked_mean(policy.token_clipped.float(), batch.mask),
        "clip/seq_frac": sequence_mean(policy.seq_clipped.float(), batch.nonempty),
        "kl/old_k3": masked_mean(k3(batch.log_ratio), batch.mask),
        "loss/policy": policy_loss.detach().float(),
    }
    if batch.ref_log_ratio is not None:
        values["kl/ref_k3"] = masked_mean(k3(batch.ref_log_ratio), batch.mask)
    values.update({name: value.detach().float() for name, value in policy.extra_metrics.items()})
    floats = torch.stack(list(values.values())).tolist()
    return dict(zip(values, floats))
