"""How far the policy moved: each update's size against the weights and the KL from the start (opt-in,
`trainer.measure_learning`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from experiments.step import metrics as m
from experiments.step.hooks.base import Rows, StepHook, Update
from experiments.step.old_policy import Score
from experiments.step.scoring import ScoreOptions


@dataclass(eq=False)
class LearningMeasures(StepHook):
    """How far the policy moves (`trainer.measure_learning`): each update's size against the weights, and KL(π_θ ‖
    π_start) on the minibatch's response tokens after the update (`metrics.kl_k3` of log π_start − log π_θ; the
    tokens were sampled by μ_old, which is π_θ's neighbour, not π_θ)."""

    def __init__(self, model: torch.nn.Module, start: torch.nn.Module, score: Score) -> None:
        self.model, self.start, self.score = model, start, score

    def before_step(self, update: Update) -> dict[str, float]:
        update.held[self] = [p.detach().clone() for p in self.model.parameters()]
        return {}

    def after_step(self, update: Update) -> dict[str, float]:
        before = update.held.pop(self)
        moved = [p.detach() - old for p, old in zip(self.model.parameters(), before)]
        size = float(torch.nn.utils.get_total_norm(before))  # over every rank's shards under FSDP2
        return {m.UPDATE_RATIO: float(torch.nn.utils.get_total_norm(moved)) / max(size, 1e-30)}

    def measure(self, update: Update, rows: Rows) -> dict[str, float]:
        with torch.no_grad():
            start = self.score(self.start, update.mb, ScoreOptions()).logp
        return {m.KL_TO_START: float(m.kl_k3(rows(start - update.scored.logp.detach()), rows.mask))}
