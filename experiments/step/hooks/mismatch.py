"""Training–inference mismatch: a rollout correction's weights, and the mismatch measurements."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import cast

import torch

from algos.aggregation import masked
from algos.corrections import Correction, CorrectionInputs
from algos.objective import ObjectiveInputs
from experiments.step import metrics as m
from experiments.step.hooks.base import Rows, StepHook, Update


@dataclass(eq=False)
class RolloutCorrection(StepHook):
    """A rollout correction (`correction=`, `algos.corrections`): each token's weight from the mismatch ratio ρ =
    π_old/μ_old at θ_old (log ρ = 0 where the step holds no trainer numbers at θ_old) and π_θ against μ_old; the
    objective multiplies its per-token loss by it. Its metrics over every rank's rows."""

    correction: Correction

    def objective_inputs(self, update: Update, inputs: ObjectiveInputs) -> ObjectiveInputs:
        mb, scores = update.mb, update.scored
        mu_logp = cast(torch.Tensor, mb.mu_logp)  # a correction's run samples with the engine's log-probs (its check)
        trainer = update.old.trainer_logp(scores)
        log_rho = trainer - mu_logp if trainer is not None else torch.zeros_like(mu_logp)
        output = self.correction(
            CorrectionInputs(
                log_rho=masked(log_rho, mb.response_mask),
                mask=mb.response_mask,
                advantages=mb.advantages,
                theta_log_ratio=masked(scores.logp.detach() - mu_logp, mb.response_mask),
            )
        )
        update.held[self] = output
        return replace(inputs, weight=output.weight)

    def measure(self, update: Update, rows: Rows) -> dict[str, float]:
        return rows.gathered(update.held[self]).metrics


class Mismatch(StepHook):
    """The engine's log-probs against the trainer's at θ_old, where the step holds both (`metrics.mismatch_metrics`)."""

    def measure(self, update: Update, rows: Rows) -> dict[str, float]:
        trainer = update.old.trainer_logp(update.scored)
        if trainer is None or update.mb.mu_logp is None:
            return {}
        return m.mismatch_metrics(rows(trainer - update.mb.mu_logp), rows.mask)
