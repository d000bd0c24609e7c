"""What every policy-optimisation objective is and shares, and the registry that builds one by name (verl's
core_algos.py in one module): group advantages, the validated fp32 batch, loss aggregation, the clipped
surrogate, the base class, its shared metrics.

Numerics (where other frameworks broke: bf16 ratio noise, prime-rl #568; NaN padding; inf from exp, OpenRLHF #1293):
- log-ratios are taken in fp32 (`logp.float() - old_logp.float()`), because ratios of bf16 log-probs are noisy;
- padded positions are replaced with `torch.where(mask, x, 0)` before any reduction, never multiplied by the
  mask: `NaN * 0` is NaN, and the padding of a batch may hold anything (NaN, inf);
- token log-ratios are clamped to ±`TOKEN_LOG_RATIO_BOUND` (20, ratio in [2e-9, 4.9e8]) and the sequence mean
  log-ratio to ±`SEQ_LOG_RATIO_BOUND` (10, ratio in [4.5e-5, 2.2e4]) before `exp`, so that no ratio is inf and
  no backward pass meets `0 * inf`. The clamp also zeroes the gradient of a token beyond the bound; both bounds
  are far outside any clip range used here, so only pathological tokens are affected.

Loss aggregation (verl's `agg_loss`, verl/trainer/ppo/core_algos.py), for a per-token loss L and mask m of
shape [B, T]:
- `token-mean`:              Σ_{i,t} L·m / Σ_{i,t} m                (every token weighs the same; DAPO)
- `seq-mean-token-mean`:     mean over non-empty sequences of Σ_t L·m / Σ_t m   (GRPO eq. 3, GSPO eq. 5)
- `seq-mean-token-sum`:      mean over non-empty sequences of Σ_t L·m          (long responses weigh more)
- `seq-mean-token-sum-norm`: Σ_{i,t} L·m / (B · T_norm), T_norm = `norm_tokens` or T   (Dr. GRPO's constant
  generation budget; B counts every sequence, empty or not, so the normaliser is a constant)
An empty batch (no valid token) aggregates to 0 rather than 0/0.

Group-relative advantages (GRPO, DeepSeekMath arXiv 2402.03300; GSPO eq. 6), rewards group-contiguous (prompt j's
G completions at positions j·G .. j·G + G − 1):

    Â_i = (R_i − mean_group R) / (std_group R + eps)      (scale_by_std=True, GRPO / GSPO / DAPO)
    Â_i =  R_i − mean_group R                             (scale_by_std=False, Dr. GRPO arXiv 2503.20783)

std is Bessel-corrected (unbiased), as verl's `torch.std`, with eps = 1e-6. A group whose rewards are all equal
gets zero advantages either way: it carries no learning signal (DAPO's dynamic sampling drops such groups;
`zero_std_group_frac` measures how many there are).

An objective is a frozen dataclass whose fields are its hyperparameters (so it doubles as a typed Hydra schema).
Subclasses say how a batch turns into a per-token policy loss (`policy_loss`) and which hyperparameter values
they accept (`validate`); the base does the rest the same way for all of them:

1. validate the inputs and build the fp32, padding-safe quantities (`PolicyBatch`);
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
Every statistic over an empty set is 0. Their names are the constants below (`TOKEN_RATIO_VAR`, ...), which the
loop and `analysis/` import.
"""

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from typing import Any, ClassVar, cast

import torch
from torch import Tensor

from algos.aggregation import Totals, aggregate, k3, masked, masked_mean, masked_var, sequence_mean
from models.registry import ConfigError, Registry, check_fields

TOKEN_LOG_RATIO_BOUND = 20.0
SEQ_LOG_RATIO_BOUND = 10.0


class KLEstimator(StrEnum):
    """How the KL to the reference enters the loss, per token (β times it; aggregated as the policy loss)."""

    # Which KL each one's expected gradient follows: algos/objective.py's module docstring, and the test it names.
    k3 = "k3"  # Schulman's k3 of the reference against π_θ (DeepSeekMath eq. 4)
    unbiased_k3 = (
        "unbiased_k3"  # k3 weighted by π_θ / π_old, in the graph: tokens are sampled from π_old (DeepSeek-V3.2 eq. 7)
    )


@dataclass(frozen=True)
class ObjectiveInputs:
    """What an objective is given besides π_θ's log-probs and the aggregation's totals: built once per update by the
    trainer (`experiments.step.trainer`), changed only by the hooks that own a field (RSPO's shift of `old_logp`, a
    rollout correction's `weight`), and taken whole by every objective (`Objective.__call__`)."""

    old_logp: Tensor  # [B, T] π_old's, or what stands in for it (RSPO: π_old less log γ̃)
    advantages: Tensor  # [B] one per sequence
    mask: Tensor  # [B, T] the valid response tokens
    ref_logp: Tensor | None = None  # [B, T] the KL reference's
    rollout_logp: Tensor | None = None  # [B, T] μ_old's, the engine that sampled (MiniRL's IS weight)
    weight: Tensor | None = None  # [B, T] a rollout correction's per-token weight


@dataclass(frozen=True)
class PolicyBatch:
    """One validated minibatch, with the quantities every objective derives from it (all fp32).

    logp:          [B, T] current log-probs, zero at padding; carries the gradient.
    log_ratio:     [B, T] logp - old_logp, zero at padding, clamped to ±TOKEN_LOG_RATIO_BOUND.
    seq_log_ratio: [B]    masked mean of log_ratio, clamped to ±SEQ_LOG_RATIO_BOUND (0 for empty sequences).
    advantages:    [B]    one advantage per sequence (no gradient).
    mask:          [B, T] bool, valid response tokens.
    lengths:       [B]    valid tokens per sequence.
    ref_log_ratio: [B, T] ref_logp - logp, zero at padding, clamped like log_ratio; None without ref_logp.
    rollout_log_ratio: [B, T] logp - rollout_logp (π_θ against the engine that sampled, μ_old), zero at padding,
                   clamped like log_ratio; None without rollout_logp.
    weight:        [B, T] the rollout correction's per-token weight (no gradient, >= 0), 1 without one, 0 at padding.
    """

    logp: Tensor
    log_ratio: Tensor
    seq_log_ratio: Tensor
    advantages: Tensor
    mask: Tensor
    lengths: Tensor
    ref_log_ratio: Tensor | None
    rollout_log_ratio: Tensor | None = None
    weight: Tensor | None = None

    @property
    def nonempty(self) -> Tensor:
        """[B] bool: sequences with at least one valid token."""
        return self.lengths > 0

    @classmethod
    def from_inputs(cls, logp: Tensor, inputs: ObjectiveInputs) -> "PolicyBatch":
        """Validate shapes and dtypes (ValueError naming the offender) and build the fp32 quantities."""
        old_logp, advantages, mask = inputs.old_logp, inputs.advantages, inputs.mask
        ref_logp, rollout_logp, weight = inputs.ref_logp, inputs.rollout_logp, inputs.weight
        tensors = {"logp": logp, "old_logp": old_logp, "advantages": advantages, "mask": mask}
        optional = {"ref_logp": ref_logp, "rollout_logp": rollout_logp, "weight": weight}
        tensors.update({name: value for name, value in optional.items() if value is not None})
        for name, value in tensors.items():
            if not isinstance(value, Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
        if logp.dim() != 2:
            raise ValueError(f"logp must have shape [B, T] (response tokens only), got {tuple(logp.shape)}")
        expected = tuple(logp.shape)
        others = {name: value for name, value in tensors.items() if name not in ("logp", "advantages")}
        for name, value in others.items():
            if tuple(value.shape) != expected:
                raise ValueError(f"{name} must have the shape of logp {expected}, got {tuple(value.shape)}")
        if tuple(advantages.shape) != expected[:1]:
            raise ValueError(
                f"advantages must have shape [B] = {expected[:1]} (one per sequence), got {tuple(advantages.shape)}"
            )
        for name, value in tensors.items():
            if name != "mask" and not value.is_floating_point():
                raise ValueError(f"{name} must be a floating-point tensor, got {value.dtype}")
        mask = _bool_mask(mask)

        logp = masked(logp.float(), mask)
        log_ratio = masked(logp - old_logp.detach().float(), mask).clamp(-TOKEN_LOG_RATIO_BOUND, TOKEN_LOG_RATIO_BOUND)
        lengths = mask.sum(dim=1)
        seq_log_ratio = (log_ratio.sum(dim=1) / lengths.clamp(min=1)).clamp(-SEQ_LOG_RATIO_BOUND, SEQ_LOG_RATIO_BOUND)

        def against(other: Tensor | None, sign: float) -> Tensor | None:
            if other is None:
                return None
            ratio = masked(sign * (logp - other.detach().float()), mask)
            return ratio.clamp(-TOKEN_LOG_RATIO_BOUND, TOKEN_LOG_RATIO_BOUND)

        if weight is not None and bool((masked(weight.detach().float(), mask) < 0).any()):
            raise ValueError("weight must be >= 0 on valid tokens (a correction weight or mask)")
        return cls(
            logp=logp,
            log_ratio=log_ratio,
            seq_log_ratio=seq_log_ratio,
            advantages=advantages.detach().float(),
            mask=mask,
            lengths=lengths,
            ref_log_ratio=against(ref_logp, -1.0),
            rollout_log_ratio=against(rollout_logp, 1.0),
            weight=masked(weight.detach().float(), mask) if weight is not None else None,
        )


def _bool_mask(mask: Tensor) -> Tensor:
    if mask.dtype == torch.bool:
        return mask
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("mask must be bool or hold only 0 and 1 (1 = valid response token)")
    return mask != 0


def clipped_surrogate(ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic clipped surrogate as a loss, and where its clip binds.

    loss = max(−Â·ratio, −Â·clip(ratio, 1−clip_low, 1+clip_high)) elementwise (`ratio` and `advantages`
    broadcast). The max picks the clipped branch exactly where the clip binds, (Â > 0 ∧ ratio > 1+clip_high) ∨
    (Â < 0 ∧ ratio < 1−clip_low), and the plain surrogate everywhere else, which is how it is written here: the
    gradient is then the plain one, −Â·ratio·∇log ratio, or zero where the clip binds.
    Returns (loss, binding), both of the broadcast shape.
    """
    binding = ((advantages > 0) & (ratio > 1 + clip_high)) | ((advantages < 0) & (ratio < 1 - clip_low))
    bounded = ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.where(binding, -advantages * bounded, -advantages * ratio)
    return loss, binding


@dataclass(frozen=True)
class PolicyLoss:
    """What an objective computes from a batch, before the shared KL term, aggregation and metrics.

    per_token:     [B, T] policy loss per token (padding is ignored by the aggregation). A sequence-level
                   objective broadcasts its per-sequence loss over the sequence's tokens and aggregates with
                   `seq-mean-token-mean`, which gives back the plain mean over sequences.
    token_clipped: [B, T] bool, valid tokens whose clip binds (whose gradient the clip removes).
    seq_clipped:   [B] bool, sequences whose clip binds (sequence-level objectives) or that hold at least one
                   binding-clipped token (token-level objectives).
    aggregation:   one of LOSS_AGG_MODES; `norm_tokens` goes with `seq-mean-token-sum-norm`.
    token_means:   objective-specific per-token statistics [B, T] (no gradient), each logged as its mean over valid
                   tokens next to the shared metrics (kept per token so that a mean over every rank's tokens is one).
    """

    per_token: Tensor
    token_clipped: Tensor
    seq_clipped: Tensor
    aggregation: str
    norm_tokens: int | None = None
    token_means: dict[str, Tensor] = field(default_factory=dict)


def token_clip_policy_loss(
    batch: PolicyBatch, clip_low: float, clip_high: float, aggregation: str, norm_tokens: int | None = None
) -> PolicyLoss:
    """PPO's token-level clipped surrogate on r_{i,t} = exp(log_ratio) with Â_{i,t} = Â_i (GRPO, Dr. GRPO, DAPO)."""
    loss, binding = clipped_surrogate(torch.exp(batch.log_ratio), batch.advantages[:, None], clip_low, clip_high)
    token_clipped = binding & batch.mask
    return PolicyLoss(loss, token_clipped, token_clipped.any(dim=1), aggregation, norm_tokens)


# The names of the shared metrics (module docstring), as `metrics.jsonl` and W&B log them.
TOKEN_RATIO_MEAN = "ratio/token_mean"
TOKEN_RATIO_VAR = "ratio/token_var"
TOKEN_RATIO_MAX = "ratio/token_max"
SEQ_RATIO_MEAN = "ratio/seq_mean"
SEQ_RATIO_VAR = "ratio/seq_var"
CLIP = "clip/token_frac"
CLIP_SEQ = "clip/seq_frac"
KL_OLD = "kl/old_k3"
KL_REF = "kl/ref_k3"
POLICY_LOSS = "loss/policy"


@dataclass(frozen=True)
class ObjectiveOutput:
    """`loss`: the 0-dim tensor to minimise (differentiable in logp). What it was computed from stays with it, so that
    its metrics (`metrics`: the shared and the objective's own, as floats) are read from the very tensors the loss
    used, and, on several data-parallel ranks, over every rank's rows without running the objective again
    (`gathered`): the validated `batch`, the objective's `policy` loss, `per_token` the per-token policy loss the
    aggregation reduced (times the correction's weight; the KL term excluded) and its aggregate `policy_loss`."""

    loss: Tensor
    batch: PolicyBatch
    policy: PolicyLoss
    per_token: Tensor
    policy_loss: Tensor

    @property
    def metrics(self) -> dict[str, float]:
        return policy_metrics(self.batch, self.policy, self.policy_loss)

    def gathered(self, rows: Callable[[Tensor], Tensor]) -> "ObjectiveOutput":
        """This output over the rows of every data-parallel rank: each per-row tensor concatenated by `rows` (which
        pads with 0, False for masks), and the policy loss aggregated again over them as one process would; `loss`
        stays this rank's."""
        gather = lambda tensor: rows(tensor) if tensor is not None else None  # noqa: E731
        # Any: each field's tensor, or None where the batch has none (`ref_log_ratio`, ...), taken by name.
        gathered: dict[str, Any] = {f.name: gather(getattr(self.batch, f.name)) for f in fields(PolicyBatch)}
        batch = PolicyBatch(**gathered)
        policy = replace(
            self.policy,
            per_token=rows(self.policy.per_token),
            token_clipped=rows(self.policy.token_clipped),
            seq_clipped=rows(self.policy.seq_clipped),
            token_means={name: rows(value) for name, value in self.policy.token_means.items()},
        )
        per_token = rows(self.per_token)
        policy_loss = aggregate(per_token, batch.mask, policy.aggregation, policy.norm_tokens)
        return ObjectiveOutput(self.loss, batch, policy, per_token, policy_loss)


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

    def __call__(self, logp: Tensor, inputs: ObjectiveInputs, totals: Totals | None = None) -> ObjectiveOutput:
        """The loss of π_θ's log-probs `logp` [B, T] (differentiable) on `inputs`, aggregated with `totals` (the whole
        minibatch's counts over every rank; this batch's own without)."""
        if self.kl_coef > 0 and inputs.ref_logp is None:
            raise ValueError(f"{self.name}: kl_coef = {self.kl_coef} > 0 needs ref_logp (log π_ref, [B, T])")
        if self.needs_rollout_logp and inputs.rollout_logp is None:
            raise ValueError(f"{self.name}: needs rollout_logp (log μ_old of the engine that sampled, [B, T])")
        batch = PolicyBatch.from_inputs(logp, inputs)
        policy = self.policy_loss(batch)
        per_token = policy.per_token if batch.weight is None else policy.per_token * batch.weight
        policy_only = aggregate(per_token, batch.mask, policy.aggregation, policy.norm_tokens, totals)
        loss = policy_only
        if self.kl_coef > 0:
            kl = k3(cast(Tensor, batch.ref_log_ratio))  # kl_coef > 0: refused above without ref_logp
            if self.kl_estimator == KLEstimator.unbiased_k3:
                kl = torch.exp(batch.log_ratio) * kl  # the ratio's gradient is what makes eq. 7's gradient unbiased
            loss = aggregate(per_token + self.kl_coef * kl, batch.mask, policy.aggregation, policy.norm_tokens, totals)
        return ObjectiveOutput(loss, batch, policy, per_token, policy_only)

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
        TOKEN_RATIO_MEAN: masked_mean(token_ratio, batch.mask),
        TOKEN_RATIO_VAR: masked_var(token_ratio, batch.mask),
        # Ratios are positive, so zero at padding never wins the max over a non-empty mask.
        TOKEN_RATIO_MAX: masked(token_ratio, batch.mask).max() if batch.mask.numel() else token_ratio.new_zeros(()),
        SEQ_RATIO_MEAN: masked_mean(seq_ratio, batch.nonempty),
        SEQ_RATIO_VAR: masked_var(seq_ratio, batch.nonempty),
        CLIP: masked_mean(policy.token_clipped.float(), batch.mask),
        CLIP_SEQ: sequence_mean(policy.seq_clipped.float(), batch.nonempty),
        KL_OLD: masked_mean(k3(batch.log_ratio), batch.mask),
        POLICY_LOSS: policy_loss.detach().float(),
    }
    if batch.ref_log_ratio is not None:
        values[KL_REF] = masked_mean(k3(batch.ref_log_ratio), batch.mask)
    values.update({name: masked_mean(value.detach().float(), batch.mask) for name, value in policy.token_means.items()})
    floats = torch.stack(list(values.values())).tolist()
    return dict(zip(values, floats))


OBJECTIVES: Registry[Objective] = Registry("objective", Objective)


def build_objective(name: str, **hyperparameters: object) -> Objective:
    """The objective registered as `name` with the given hyperparameters (the others keep their defaults).
    Registration happens when an objective's module is imported; `algos/__init__.py` imports every one."""
    return OBJECTIVES.build(name, **hyperparameters)
