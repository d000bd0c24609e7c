"""The base every policy-optimisation objective derives from, and what calling one returns.

An objective is a frozen dataclass whose fields are its hyperparameters (so it doubles as a typed Hydra schema).
Subclasses say how a batch turns into a per-token policy loss (`policy_loss`) and which hyperparameter values
they accept (`validate`); the base does the rest the same way for all of them:

1. validate the inputs and build the fp32, padding-safe quantities (`algos.common.PolicyBatch`);
2. weight the per-token policy loss by the rollout correction's weight when one is given (`weight`, no gradient:
   TIS, MIS, IcePop, OPSM in `algos.corrections`; a zero weight drops a token's term but not its place in the
   aggregation's denominators), add the KL penalty to the reference policy (`kl_estimator`, below), and
   aggregate the sum with the objective's mode;
3. compute the shared metrics (`policy_metrics`, below), the same way for every objective so that all compare.

Every objective has the hyperparameter `kl_coef` (β; default 0, as in the GSPO paper's comparison and in DAPO,
Dr. GRPO, CISPO; DeepSeekMath's GRPO used 0.04); `ref_logp` is required when it is positive. The KL term per token,
with k3 = π_ref/π_θ − log(π_ref/π_θ) − 1 and tokens sampled from π_old (the policy of `old_logp`):
- `k3` (DeepSeekMath eq. 4): β·k3. Its value estimates KL(π_θ ‖ π_ref) only on-policy, and its expected gradient
  is then ∇KL(π_ref ‖ π_θ), the reverse KL's; off-policy it follows neither.
- `unbiased_k3` (DeepSeek-V3.2 eq. 7; TRL's `use_bias_correction_kl`): β·(π_θ/π_old)·k3 with the ratio in the
  graph. Over tokens from π_old its expected value is KL(π_θ ‖ π_ref) and its expected gradient ∇KL(π_θ ‖ π_ref),
  on- and off-policy; per token, d/d log π_θ = β·(π_θ/π_old)·(log π_θ − log π_ref). A ratio without gradient
  would keep the value and turn the expected gradient into the reverse KL's.
Both claims are checked by exact expectation over a small categorical in tests/test_objectives.py
(`test_the_expected_kl_gradient_of_each_estimator`). Hyperparameter types
(floats, enums such as `loss_agg`) are checked by `models.registry.check_fields`; value ranges by `validate`.

Shared metrics. Definitions follow verl's and TRL's where they exist (the GSPO paper's Fig. 2 for GSPO's token
share), with lr = clamped token log-ratio log π_θ − log π_old:
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

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from algos.common import (
    KLEstimator, PolicyBatch, PolicyLoss, Totals, aggregate, k3, masked, masked_mean, masked_var, sequence_mean,
)
from models.registry import ConfigError, check_fields


@dataclass(frozen=True)
class ObjectiveOutput:
    """loss: 0-dim tensor to minimise (differentiable in logp); metrics: shared and objective-specific floats."""

    loss: Tensor
    metrics: dict[str, float]


@dataclass(frozen=True)
class Objective(ABC):
    """Base of every objective. Call it with keyword arguments:

    logp      [B, T] log π_θ of the response tokens (carries the gradient; any float dtype, used in fp32)
    old_logp  [B, T] log π_old of the same tokens (no gradient)
    advantages [B]   one advantage per response
    mask      [B, T] bool or 0/1, valid response tokens; padded positions may hold anything, NaN included
    ref_logp  [B, T] log π_ref, needed when kl_coef > 0
    rollout_logp [B, T] log μ_old, the engine that sampled: needed by objectives with `needs_rollout_logp` (MiniRL)
    weight    [B, T] a rollout correction's per-token weight (no gradient, >= 0), or None
    totals    the whole minibatch's aggregation denominators when this is one data-parallel rank's share (`Totals`)
    """

    name: ClassVar[str] = "objective"  # the registry key, set by `OBJECTIVES.register`
    # Group advantages divided by their std (GRPO) or only centred (Dr. GRPO): the default of the config key
    # `algo.advantage_std`, which sits beside the objective's hyperparameters.
    advantage_std: ClassVar[bool] = True
    needs_rollout_logp: ClassVar[bool] = False  # the loss itself reads μ_old (MiniRL's IS weight)

    kl_coef: float = 0.0  # β of the KL to the frozen reference policy (needs ref_logp when > 0)
    kl_estimator: KLEstimator = KLEstimator.k3  # k3, or unbiased_k3 (weighted by π_θ/π_old; module docstring)

    def __post_init__(self) -> None:
        check_fields(self, self.name)
        self._check_non_negative("kl_coef")
        self.validate()

    @abstractmethod
    def validate(self) -> None:
        """Raise ValueError for hyperparameter values this objective cannot use."""

    @abstractmethod
    def policy_loss(self, batch: PolicyBatch) -> PolicyLoss:
        """The per-token policy loss of `batch`, where its clip binds, and how to aggregate it."""

    def __call__(
        self, *, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, ref_logp: Tensor | None = None,
        rollout_logp: Tensor | None = None, weight: Tensor | None = None, totals: Totals | None = None,
    ) -> ObjectiveOutput:
        if self.kl_coef > 0 and ref_logp is None:
            raise ValueError(f"{self.name}: kl_coef = {self.kl_coef} > 0 needs ref_logp (log π_ref, [B, T])")
        if self.needs_rollout_logp and rollout_logp is None:
            raise ValueError(f"{self.name}: needs rollout_logp (log μ_old of the engine that sampled, [B, T])")
        batch = PolicyBatch.from_inputs(
            logp=logp, old_logp=old_logp, advantages=advantages, mask=mask, ref_logp=ref_logp,
            rollout_logp=rollout_logp, weight=weight,
        )
        policy = self.policy_loss(batch)
        per_token = policy.per_token if batch.weight is None else policy.per_token * batch.weight
        policy_only = aggregate(per_token, batch.mask, policy.aggregation, policy.norm_tokens, totals)
        loss = policy_only
        if self.kl_coef > 0:
            kl = k3(batch.ref_log_ratio)
            if self.kl_estimator == KLEstimator.unbiased_k3:
                kl = torch.exp(batch.log_ratio) * kl  # the ratio's gradient is what makes eq. 7's gradient unbiased
            loss = aggregate(per_token + self.kl_coef * kl, batch.mask, policy.aggregation, policy.norm_tokens, totals)
        return ObjectiveOutput(loss=loss, metrics=policy_metrics(batch, policy, policy_only))

    # Validation helpers: every message names the objective, the hyperparameter, the value and what is allowed.

    def _fail(self, message: str) -> None:
        raise ConfigError(f"{self.name}: {message}")

    def _check_non_negative(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if value is not None and value < 0:
                self._fail(f"{name} must be >= 0, got {value}")

    def _check_positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if value is not None and value <= 0:
                self._fail(f"{name} must be > 0, got {value}")

    def _check_ratio_lower_clip(self, name: str) -> None:
        """A ratio-space lower clip ε keeps the bound 1 − ε positive: 0 <= ε < 1."""
        self._check_non_negative(name)
        value = getattr(self, name)
        if value is not None and value >= 1:
            self._fail(f"{name} must be < 1 so that the lower ratio bound 1 - {name} stays positive, got {value}")


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
