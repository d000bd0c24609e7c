"""Pieces every objective shares: group advantages, the validated batch, log-ratios, loss aggregation, the clipped
surrogate.

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
"""

from dataclasses import dataclass, field
from enum import StrEnum

import torch
from torch import Tensor

TOKEN_LOG_RATIO_BOUND = 20.0
SEQ_LOG_RATIO_BOUND = 10.0

# verl's names, hyphens included: each member's name is its value, which is what Hydra checks an override against.
LossAgg = StrEnum(
    "LossAgg", [(mode, mode) for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")]
)
LOSS_AGG_MODES = tuple(LossAgg)


class KLEstimator(StrEnum):
    """How the KL to the reference enters the loss, per token (β times it; aggregated as the policy loss)."""

    # Which KL each one's expected gradient follows: algos/objective.py's module docstring, and the test it names.
    k3 = "k3"  # Schulman's k3 of the reference against π_θ (DeepSeekMath eq. 4)
    unbiased_k3 = "unbiased_k3"  # k3 weighted by π_θ / π_old, in the graph: tokens are sampled from π_old (DeepSeek-V3.2 eq. 7)


def group_advantages(rewards: Tensor, group_size: int, scale_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Advantages `[N]` of rewards `[N]` laid out in contiguous groups of `group_size` (N = prompts · G)."""
    groups = _grouped(rewards, group_size)
    if not eps > 0:
        raise ValueError(f"eps must be > 0 (it keeps a zero-std group at 0 instead of 0/0), got {eps}")
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale_by_std:
        centred = centred / (groups.std(dim=1, unbiased=True, keepdim=True) + eps)
    return centred.reshape(-1)


def zero_std_group_frac(rewards: Tensor, group_size: int) -> float:
    """Share of groups whose `group_size` rewards are all equal (no learning signal), rewards `[N]`."""
    groups = _grouped(rewards, group_size)
    constant = groups.amax(dim=1) == groups.amin(dim=1)
    return constant.float().mean().item()


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """Rewards `[N]` as `[N / group_size, group_size]` in fp32, after checking the layout."""
    if not isinstance(rewards, Tensor) or rewards.dim() != 1 or rewards.numel() == 0:
        shape = tuple(rewards.shape) if isinstance(rewards, Tensor) else type(rewards).__name__
        raise ValueError(f"rewards must be a non-empty 1-D tensor [N], got {shape}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(
            f"group_size must be an int >= 2 (a group-relative baseline needs 2 samples), got {group_size!r}"
        )
    if rewards.numel() % group_size:
        raise ValueError(
            f"the number of rewards N = {rewards.numel()} is not divisible by group_size = {group_size}"
        )
    return rewards.detach().float().reshape(-1, group_size)


def k3(log_ratio: Tensor) -> Tensor:
    """Schulman's k3 KL estimator per token: ρ − 1 − log ρ with log ρ = `log_ratio` (≥ 0, unbiased)."""
    return torch.expm1(log_ratio) - log_ratio


def masked(x: Tensor, mask: Tensor) -> Tensor:
    """`x` with every position outside the bool `mask` set to 0 (select, not multiply: padding may be NaN)."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of `x` over the positions where the bool `mask` is set; 0 when there are none."""
    return masked(x, mask).sum() / mask.sum().clamp(min=1)


def masked_var(x: Tensor, mask: Tensor) -> Tensor:
    """Population variance of `x` over the positions where the bool `mask` is set; 0 when there are none."""
    mean = masked_mean(x, mask)
    return masked_mean((x - mean) ** 2, mask)


@dataclass(frozen=True)
class Totals:
    """The denominators of an aggregation over the whole minibatch when each of `ranks` data-parallel ranks holds a
    share: valid tokens, sequences and non-empty sequences summed over ranks, and the padded length T maximised.
    A rank's loss is its own numerator over these, times `ranks`, because the data-parallel reduction averages the
    ranks' gradients: the average is then the gradient of the whole minibatch (verl's `agg_loss`, `dp_size`)."""

    tokens: float
    sequences: float
    nonempty: float
    width: int
    ranks: int

    @classmethod
    def local(cls, mask: Tensor) -> "Totals":
        """The totals of `mask [B, T]` alone (one rank)."""
        lengths = mask.sum(dim=1)
        return cls(float(mask.sum()), float(mask.shape[0]), float((lengths > 0).sum()), int(mask.shape[1]), 1)


def aggregate(per_token_loss: Tensor, mask: Tensor, mode: str, norm_tokens: int | None = None,
              totals: Totals | None = None) -> Tensor:
    """Reduce a per-token loss `[B, T]` to a scalar with one of `LOSS_AGG_MODES` (see the module docstring).

    `mask` is `[B, T]` bool. `norm_tokens` is T_norm of `seq-mean-token-sum-norm` (default: T). `totals`: this
    batch is one rank's share of a data-parallel minibatch, and the denominators are the whole one's (`Totals`).
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg must be one of {', '.join(LOSS_AGG_MODES)}; got {mode!r}")
    if norm_tokens is not None and mode != "seq-mean-token-sum-norm":
        raise ValueError(f"norm_tokens is only used by loss_agg 'seq-mean-token-sum-norm'; got mode {mode!r}")
    totals = totals or Totals.local(mask)
    loss = masked(per_token_loss, mask)
    if mode == "token-mean":
        return loss.sum() / max(totals.tokens, 1.0) * totals.ranks
    if mode == "seq-mean-token-sum-norm":
        width = norm_tokens if norm_tokens is not None else totals.width
        return loss.sum() / (totals.sequences * width) * totals.ranks
    lengths = mask.sum(dim=1)
    per_sequence = loss.sum(dim=1)
    if mode == "seq-mean-token-mean":
        per_sequence = per_sequence / lengths.clamp(min=1)
    return masked(per_sequence, lengths > 0).sum() / max(totals.nonempty, 1.0) * totals.ranks


def sequence_mean(per_sequence: Tensor, nonempty: Tensor) -> Tensor:
    """Mean of a per-sequence quantity `[B]` over the sequences flagged in `nonempty` `[B]`; 0 if none."""
    return masked(per_sequence, nonempty).sum() / nonempty.sum().clamp(min=1)


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
    def from_inputs(
        cls, *, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, ref_logp: Tensor | None,
        rollout_logp: Tensor | None = None, weight: Tensor | None = None,
    ) -> "PolicyBatch":
        """Validate shapes and dtypes (ValueError naming the offender) and build the fp32 quantities."""
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
    extra_metrics: objective-specific statistics (0-dim tensors), logged next to the shared ones.
    """

    per_token: Tensor
    token_clipped: Tensor
    seq_clipped: Tensor
    aggregation: str
    norm_tokens: int | None = None
    extra_metrics: dict[str, Tensor] = field(default_factory=dict)


def token_clip_policy_loss(
    batch: PolicyBatch, clip_low: float, clip_high: float, aggregation: str, norm_tokens: int | None = None
) -> PolicyLoss:
    """PPO's token-level clipped surrogate on r_{i,t} = exp(log_ratio) with Â_{i,t} = Â_i (GRPO, Dr. GRPO, DAPO)."""
    loss, binding = clipped_surrogate(torch.exp(batch.log_ratio), batch.advantages[:, None], clip_low, clip_high)
    token_clipped = binding & batch.mask
    return PolicyLoss(loss, token_clipped, token_clipped.any(dim=1), aggregation, norm_tokens)
