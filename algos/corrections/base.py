"""Rollout corrections: what a run does about the engine's numbers differing from the trainer's (μ_old ≠ π_old).

The token ratio the loss sees factors as π_θ/μ_old = (π_old/μ_old) · (π_θ/π_old) (arXiv 2512.01374 eq. 5): the
first factor is training–inference mismatch, the second staleness. A correction turns the mismatch ratio
ρ_t = π_old(y_t)/μ_old(y_t) (log ρ = `log_rho`), or for OPSM π_θ against μ_old, into a per-token weight w_t that
multiplies the objective's per-token loss (no gradient; `algos.objective`). A weight of 0 drops a token's term while
the token keeps its place in the aggregation's denominators, as verl's rollout IS weights and IcePop do.

Orthogonal to the objective, like Routing Replay: `correction=<name>` picks one (`none`, `tis`, `mis`, `icepop`,
`geo_rs`, `opsm`), each one small module registered in `CORRECTIONS` with its formula, source and defaults.
Everything is computed in fp32 and in log space; sequence products are sums of log ratios, clamped before `exp`.

The mismatch itself is measured by the loop, with or without a correction (`experiments.step.metrics`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar

import torch
from torch import Tensor

from algos.aggregation import masked, masked_mean, sequence_mean
from algos.objective import SEQ_LOG_RATIO_BOUND, TOKEN_LOG_RATIO_BOUND
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
    """The per-token `weight`, and what the correction did to the tokens of `mask`: `hits`, by what was done
    ("truncated", "masked", ...), the tokens it was done to ([B, T] bool). Its `metrics` are the share of valid tokens
    hit and of non-empty sequences holding one (`token_frac`, `seq_frac`), read from these tensors, so that on several
    data-parallel ranks they are taken over every rank's rows (`gathered`) without running the correction again."""

    weight: Tensor  # [B, T] >= 0, 0 at padding
    mask: Tensor  # [B, T] bool: the valid tokens
    hits: dict[str, Tensor] = field(default_factory=dict)

    @property
    def metrics(self) -> dict[str, float]:
        nonempty = self.mask.sum(dim=1) > 0
        values = {}
        for what, token_hit in self.hits.items():
            hit = token_hit & self.mask
            values[token_frac(what)] = masked_mean(hit.float(), self.mask)
            values[seq_frac(what)] = sequence_mean(hit.any(dim=1).float(), nonempty)
        return dict(zip(values, torch.stack(list(values.values())).tolist())) if values else {}

    def gathered(self, rows: Callable[[Tensor], Tensor]) -> CorrectionOutput:
        """This output over the rows of every data-parallel rank (`rows` concatenates them, padding with 0 / False)."""
        return CorrectionOutput(
            rows(self.weight), rows(self.mask), {what: rows(hit) for what, hit in self.hits.items()}
        )


@dataclass(frozen=True)
class Correction(ABC):
    """Base of every correction: a frozen dataclass whose fields are its parameters."""

    name: ClassVar[str] = "correction"  # the registry key
    # Reads π_old/μ_old, which is 1 when π_old := μ_old (trainer.pi_old=bypass): the correction would do nothing.
    needs_decoupled: ClassVar[bool] = True
    weighs_tokens: ClassVar[bool] = True  # its weights change the loss (the null correction's do not: all 1)

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
    weighs_tokens: ClassVar[bool] = False

    def __call__(self, inputs: CorrectionInputs) -> CorrectionOutput:
        return CorrectionOutput(inputs.mask.float(), inputs.mask)


def build_correction(name: str, **params: object) -> Correction:
    return CORRECTIONS.build(name, **params)


def token_frac(what: str) -> str:
    """The name of the share of valid tokens a correction did `what` to (truncated, masked, ...)."""
    return f"mismatch/{what}_token_frac"


def seq_frac(what: str) -> str:
    """The name of the share of non-empty sequences holding a token a correction did `what` to."""
    return f"mismatch/{what}_seq_frac"


def clamped_exp(log_value: Tensor, upper: float = SEQ_LOG_RATIO_BOUND) -> Tensor:
    """exp of a log ratio clamped to [−TOKEN bound, `upper`]: never inf, never 0·inf in backward."""
    return torch.exp(log_value.clamp(-TOKEN_LOG_RATIO_BOUND, upper))
