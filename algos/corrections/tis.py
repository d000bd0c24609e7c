"""Truncated importance sampling (TIS; Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training", 2025; verl `rollout_is`, TRL `*_truncate`).

    token:     w_t = min(ρ_t, C)                              ρ_t = π_old(y_t) / μ_old(y_t)
    sequence:  w_t = min(Π_s ρ_s, C) for every token t of the response

The weight corrects the training–inference mismatch that decoupled PPO leaves (verl `rollout_corr_math`): the
clip ratio stays π_θ/π_old, the weight is the stop-gradient π_old/μ_old, truncated at C so one extreme token cannot
dominate. The default C is verl's `rollout_is_threshold` (its docs: typically 1.5-5 per token, 2-10 per sequence).
Metrics: the share of tokens and sequences whose weight was truncated (`mismatch/truncated_*`).
"""

import math
from dataclasses import dataclass

import torch

from algos.corrections.base import CORRECTIONS, Correction, CorrectionInputs, CorrectionOutput, Level, clamped_exp

TRUNCATED = "truncated"  # what it does to a token whose weight passes C: its metrics are token_frac/seq_frac of it


@CORRECTIONS.register("tis")
@dataclass(frozen=True)
class TruncatedIS(Correction):
    level: Level = Level.token  # token: each token's own ratio; sequence: the response's product of ratios
    threshold: float = 2.0  # C: weights above it are truncated to it

    def validate(self) -> None:
        self._check_positive("threshold")

    def __call__(self, inputs: CorrectionInputs) -> CorrectionOutput:
        cap = math.log(self.threshold)
        if self.level == Level.token:
            log_weight, over = inputs.log_rho, inputs.log_rho > cap
        else:
            total = inputs.sequence_log_rho()[:, None].expand_as(inputs.log_rho)
            log_weight, over = total, total > cap
        weight = torch.where(inputs.mask, clamped_exp(log_weight, upper=cap), 0.0)
        return CorrectionOutput(weight, inputs.mask, {TRUNCATED: over})
