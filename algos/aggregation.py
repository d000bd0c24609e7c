"""How an objective reduces its per-token loss to one number, and the masked reductions every objective and measure
shares: `aggregate` in verl's four modes (`LossAgg`) over the whole minibatch's counts (`Totals`: the same gradient on
any number of data-parallel ranks), masked means and variances that ignore padding, and Schulman's k3.
"""

from dataclasses import dataclass
from enum import StrEnum

import torch
from torch import Tensor

# verl's names, hyphens included: each member's name is its value (StrEnum's own values: the name, lowercased), which
# is what Hydra checks an override against.
LossAgg = StrEnum("LossAgg", "token-mean seq-mean-token-mean seq-mean-token-sum seq-mean-token-sum-norm")
LOSS_AGG_MODES = tuple(LossAgg)


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


def aggregate(
    per_token_loss: Tensor, mask: Tensor, mode: str, norm_tokens: int | None = None, totals: Totals | None = None
) -> Tensor:
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
