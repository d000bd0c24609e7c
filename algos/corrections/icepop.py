"""IcePop (Ant Group, Ring-1T, arXiv 2510.18855; blog "IcePop"): a two-sided band on the mismatch ratio.

    w_t = ρ_t if α ≤ ρ_t ≤ β, else 0,        ρ_t = π_old(y_t) / μ_old(y_t)

Tokens whose engine and trainer disagree beyond the band in either direction are masked (not truncated), the rest
are reweighted by their ratio. The default band is verl's `decoupled_token_icepop` preset; the paper reports
1-2‰ of tokens masked at Ring-mini scale. Metrics: `mismatch/masked_*`.
"""

import math
from dataclasses import dataclass

import torch

from algos.corrections.base import CORRECTIONS, Correction, CorrectionInputs, CorrectionOutput, clamped_exp


@CORRECTIONS.register("icepop")
@dataclass(frozen=True)
class IcePop(Correction):
    low: float = 0.5  # α: ratios below it are masked
    high: float = 5.0  # β: ratios above it are masked

    def validate(self) -> None:
        if not 0 <= self.low < self.high:
            self._fail(f"needs 0 <= low < high, got low={self.low}, high={self.high}")

    def __call__(self, inputs: CorrectionInputs) -> CorrectionOutput:
        lower = math.log(self.low) if self.low > 0 else -math.inf
        outside = (inputs.log_rho < lower) | (inputs.log_rho > math.log(self.high))
        weight = torch.where(inputs.mask & ~outside, clamped_exp(inputs.log_rho, upper=math.log(self.high)), 0.0)
        return CorrectionOutput(weight, inputs.mask, {"masked": outside})
