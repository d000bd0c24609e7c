"""Masked importance sampling (MIS; Yingru Li et al., "When Speed Kills Stability", 2025, and "Trust Region
Masking", arXiv 2512.23075; verl `decoupled_seq_is_rs`, TRL `*_mask`).

    token:     w_t = ρ_t · 1[ρ_t ≤ C]                          ρ_t = π_old(y_t) / μ_old(y_t)
    sequence:  w_t = ρ · 1[ρ ≤ C] for every token of the response, ρ = Π_s ρ_s

Like TIS, but a ratio beyond C removes the token (or the whole response) instead of capping it: the estimator
stays unbiased on what is kept, and a response whose numbers the engine got badly wrong teaches nothing. The
authors recommend the sequence level. The default C is TIS's. Metrics: `mismatch/masked_*`.
"""

import math
from dataclasses import dataclass

import torch

from algos.corrections.base import CORRECTIONS, Correction, CorrectionInputs, CorrectionOutput, Level, clamped_exp
from algos.corrections.tis import TruncatedIS


@CORRECTIONS.register("mis")
@dataclass(frozen=True)
class MaskedIS(Correction):
    level: Level = Level.sequence  # the authors' recommendation; token masks each token on its own ratio
    threshold: float = TruncatedIS.threshold  # C (TIS's): a ratio above it gets weight 0

    def validate(self) -> None:
        self._check_positive("threshold")

    def __call__(self, inputs: CorrectionInputs) -> CorrectionOutput:
        cap = math.log(self.threshold)
        log_weight = (
            inputs.log_rho
            if self.level == Level.token
            else inputs.sequence_log_rho()[:, None].expand_as(inputs.log_rho)
        )
        over = log_weight > cap
        weight = torch.where(inputs.mask & ~over, clamped_exp(log_weight, upper=cap), 0.0)
        return CorrectionOutput(weight, inputs.mask, {"masked": over})
