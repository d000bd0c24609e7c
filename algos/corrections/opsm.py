"""Off-policy sequence masking (OPSM; DeepSeek-V3.2, arXiv 2512.02556 §3.1 eqs. 8-9; TRL
`off_policy_mask_threshold`, slime `--use-opsm`).

    w_t = 0 for every token of response i if Â_i < 0 and (1/|y_i|) Σ_t log(μ_old(y_t) / π_θ(y_t)) > δ, else 1

A response with a negative advantage that the current policy has drifted far from (mismatch and staleness
together: DeepSeek's "π_old" is "the sampling probability directly returned by the inference framework", our μ_old)
teaches nothing: pushing down an already unlikely response mostly adds noise. Positive responses are never masked.
DeepSeek publishes no δ; the default is TRL's suggestion (slime 1e-4, Trinity-RFT reports 0.05-0.2). Works with
any π_old (it compares π_θ with μ_old). Metrics: `mismatch/opsm_masked_*`.
"""

from dataclasses import dataclass
from typing import ClassVar

import torch

from algos.aggregation import masked
from algos.corrections.base import CORRECTIONS, Correction, CorrectionInputs, CorrectionOutput


@CORRECTIONS.register("opsm")
@dataclass(frozen=True)
class OffPolicySequenceMask(Correction):
    needs_decoupled: ClassVar[bool] = False

    delta: float = 0.5  # δ: the mean log(μ_old/π_θ) beyond which a negative response is masked

    def validate(self) -> None:
        if self.delta < 0:
            self._fail(f"delta must be >= 0, got {self.delta}")

    def __call__(self, inputs: CorrectionInputs) -> CorrectionOutput:
        drift = -masked(inputs.theta_log_ratio, inputs.mask).sum(dim=1) / inputs.lengths.clamp(min=1)
        masked_out = ((inputs.advantages < 0) & (drift > self.delta))[:, None] & inputs.mask
        weight = torch.where(inputs.mask & ~masked_out, 1.0, 0.0)
        return CorrectionOutput(weight, inputs.mask, {"opsm_masked": masked_out})
