"""Geometric-mean rejection sampling (Geo-RS; verl `rollout_rs=seq_mean_k1`-style, `decoupled_geo_rs` preset;
Yingru Li et al.'s recommendation for long responses, whose product of ratios explodes).

    ρ_geo = (Π_t ρ_t)^{1/|y|} = exp(mean_t log ρ_t);   w_t = 1 if low ≤ ρ_geo ≤ high, else 0 (the whole response)

A length-normalised test of the response's mismatch: kept responses are not reweighted, rejected ones are removed.
The default band is verl's typical one: tight, because a geometric mean moves little. Metrics:
`mismatch/masked_*` (a rejected response masks every one of its tokens).
"""

import math
from dataclasses import dataclass

import torch

from algos.corrections.base import CORRECTIONS, Correction, CorrectionInputs, CorrectionOutput


@CORRECTIONS.register("geo_rs")
@dataclass(frozen=True)
class GeometricRejection(Correction):
    low: float = 0.999  # responses with a geometric-mean ratio below it are rejected
    high: float = 1.001  # and above it

    def validate(self) -> None:
        if not 0 < self.low < self.high:
            self._fail(f"needs 0 < low < high, got low={self.low}, high={self.high}")

    def __call__(self, inputs: CorrectionInputs) -> CorrectionOutput:
        mean_log = inputs.sequence_log_rho() / inputs.lengths.clamp(min=1)
        rejected = ((mean_log < math.log(self.low)) | (mean_log > math.log(self.high)))[:, None] & inputs.mask
        weight = torch.where(inputs.mask & ~rejected, 1.0, 0.0)
        return CorrectionOutput(weight, inputs.mask, {"masked": rejected})
