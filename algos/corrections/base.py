"""Rollout corrections: what a run does about the engine's numbers differing from the trainer's (μ_old ≠ π_old).

The token ratio the loss sees factors as π_θ/μ_old = (π_old/μ_old) · (π_θ/π_old) (arXiv 2512.01374 eq. 5): the
first factor is training–inference mismatch, the second staleness. A correction turns the mismatch ratio
ρ_t = π_old(y_t)/μ_old(y_t) (log ρ = `log_rho`), or for OPSM π_θ against μ_old, into a per-token weight w_t that
multiplies the objective's per-token loss (no gradient; `algos.objective`). A weight of 0 drops a token's term while
the token keeps its place in the aggregation's denominators, as verl's rollout IS weights and IcePop do.

Orthogonal to the objective, like Routing Replay: `correction=<name>` picks one (`none`, `tis`, `mis`, `icepop`,
`geo_rs`, `opsm`), each one small module registered in `CORRECTIONS` with its formula, source and defaults.
Everything is computed in fp32 and in log space; sequence products are sums of log ratios, clamped before `exp`.

`mismatch_metrics` measures the mismatch itself, with or without a correction (`mismatch/*`).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar

import torch
from torch import Tensor

from algos.common import SEQ_LOG_RATIO_BOUND, TOKEN_LOG_RATIO_BOUND, masked, masked_mean, sequence_mean
from models.registry import ConfigError, Registry, check_fields


class Level(StrEnum):
    token = "token"  # one weight per token, from its own ratio
    sequence = "sequence"  # one weight per response, from the product of its token ratios


@dataclass(frozen=True)
class CorrectionInputs:
    """What a correction may read, all `[B, T]` fp32 with zeros at padding (`mask` bool), `advantages` `[B]`."""

    log_rho: Tensor  # log π_old − log μ_old: training–inference mismatch at θ_old
    theta_log_ratio: Tensor  # log π_θ − log μ_old (no gradient): mismatch and staleness together
    mask: Tensor
    advantages: Tensor

    @property
    def lengths(self) -> Tensor:
        return self.mask.sum(dim=1)

    @property
    def nonempty(self) -> Tensor:
        return self.lengths > 0

    def sequence_log_rho(self) -> Tensor:
        """`[B]` Σ_t log ρ_t: the log of the sequence's product of ratios."""
        return masked(self.log_rho, self.mask).sum(dim=1)


@dataclass(frozen=True)
class CorrectionOutput:
    weight: Tensor  # [B, T] >= 0, 0 at padding
    metrics: dict[str, Tensor] = field(default_factory=dict)  # 0-dim tensors, logged under mismatch/


@dataclass(frozen=True)
class Correction(ABC):
    """Base of every correction: a frozen dataclass whose fields are its parameters."""

    name: ClassVar[str] = "correction"  # the registry key
    # Reads π_old/μ_old, which is 1 when π_old := μ_old (trainer.pi_old=bypass): the correction would do nothing.
    needs_decoupled: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_fields(self, f"correction {self.name}")
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError for parameter values this correction cannot use."""

    @abstractmethod
    def __call__(self, inputs: CorrectionInputs) -> CorrectionOutput:
        """The per-token weights of the minibatch and what the correction did to it."""

    def _fail(self, message: str) -> None:
        raise ConfigError(f"correction {self.name}: {message}")

    def _check_positive(self, *names: str) -> None:
        for name in names:
            if getattr(self, name) <= 0:
                self._fail(f"{name} must be > 0, got {getattr(self, name)}")


CORRECTIONS: Registry[Correction] = Registry("rollout correction", Correction)


@CORRECTIONS.register("none")
@dataclass(frozen=True)
class NoCorrection(Correction):
    """No correction: every token weighs 1 (the mismatch is still measured, `mismatch_metrics`)."""

    needs_decoupled: ClassVar[bool] = False

    def __call__(self, inputs: CorrectionInputs) -> CorrectionOutput:
        return CorrectionOutput(inputs.mask.float())


def build_correction(name: str, **params: object) -> Correction:
    return CORRECTIONS.build(name, **params)


def fractions(inputs: CorrectionInputs, token_hit: Tensor, what: str) -> dict[str, Tensor]:
    """`mismatch/<what>_token_frac` and `_seq_frac`: share of valid tokens in `token_hit` (`[B, T]` bool), and of
    non-empty sequences holding at least one."""
    hit = token_hit & inputs.mask
    return {
        f"mismatch/{what}_token_frac": masked_mean(hit.float(), inputs.mask),
        f"mismatch/{what}_seq_frac": sequence_mean(hit.any(dim=1).float(), inputs.nonempty),
    }


def clamped_exp(log_value: Tensor, upper: float = SEQ_LOG_RATIO_BOUND) -> Tensor:
    """exp of a log ratio clamped to [−TOKEN bound, `upper`]: never inf, never 0·inf in backward."""
    return torch.exp(log_value.clamp(-TOKEN_LOG_RATIO_BOUND, upper))


@torch.no_grad()
def mismatch_metrics(log_rho: Tensor, mask: Tensor) -> dict[str, float]:
    """How far the engine's log-probs are from the trainer's at θ_old, on the valid tokens of `mask`.

    With ρ_t = π_old(y_t)/μ_old(y_t) and tokens sampled from μ_old (verl's `rollout_corr/*` definitions):
    `kl_k1` = mean(−log ρ) and `kl_k3` = mean(ρ − 1 − log ρ), estimates of KL(μ_old ‖ π_old) (k3 ≥ 0 per token);
    `chi2_token` = mean ρ² − 1; `chi2_seq` = mean over responses of (Π_t ρ_t)² − 1 (log-sum clamped at 10);
    `ess` = (mean ρ)² / mean ρ², the effective sample size of the weights ρ as a share in (0, 1];
    `log_ppl_gap` = mean over responses of (mean_t log μ_old − mean_t log π_old) = log PPL(π_old) − log PPL(μ_old);
    `max_abs_logp_diff` = max |log ρ|; `extreme_token_frac` = share of tokens with |log ρ| > ln 2 (a ratio beyond
    2 or below 1/2, R3's F(2)); `is_weight_mean/min/max` = of ρ.
    """
    mask = mask.bool()
    log_rho = masked(log_rho.float(), mask).clamp(-TOKEN_LOG_RATIO_BOUND, TOKEN_LOG_RATIO_BOUND)
    rho = torch.exp(log_rho)
    lengths = mask.sum(dim=1)
    nonempty = lengths > 0
    seq_sum = log_rho.sum(dim=1)
    mean_rho = masked_mean(rho, mask)
    second = masked_mean(rho**2, mask)
    values = {
        "mismatch/kl_k1": masked_mean(-log_rho, mask),
        "mismatch/kl_k3": masked_mean(rho - 1 - log_rho, mask),
        "mismatch/chi2_token": second - 1,
        "mismatch/chi2_seq": sequence_mean(torch.exp(2 * seq_sum.clamp(max=SEQ_LOG_RATIO_BOUND)), nonempty) - 1,
        "mismatch/ess": mean_rho**2 / second.clamp(min=1e-30),
        "mismatch/log_ppl_gap": sequence_mean(-seq_sum / lengths.clamp(min=1), nonempty),
        "mismatch/max_abs_logp_diff": masked(log_rho.abs(), mask).max() if mask.any() else log_rho.new_zeros(()),
        "mismatch/extreme_token_frac": masked_mean((log_rho.abs() > math.log(2)).float(), mask),
        "mismatch/is_weight_mean": mean_rho,
        "mismatch/is_weight_min": torch.where(mask, rho, torch.inf).min() if mask.any() else rho.new_ones(()),
        "mismatch/is_weight_max": masked(rho, mask).max() if mask.any() else rho.new_ones(()),
    }
    return dict(zip(values, torch.stack(list(values.values())).tolist()))
