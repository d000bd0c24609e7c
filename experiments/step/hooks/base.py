"""The update as the hooks see it (`Update`), every rank's rows of it (`Rows`), and the hook's base (`StepHook`):
every fixed point a no-op until a hook says otherwise (the package's docstring lists them)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch

from algos.objective import ObjectiveInputs
from experiments.ranks import Ranks
from experiments.step.batch import Minibatch
from experiments.step.data_parallel import gather_rows
from experiments.step.old_policy import OldPolicy
from experiments.step.scoring import ScoreOptions, Scores
from models.routing.trace import NO_ROUTE, RoutingTrace


@dataclass
class Update:
    """One optimizer update of a minibatch as it goes: the `step` it belongs to, the minibatch, its π_old, the forward's
    `scores` once it has run, and what each hook `held` between its fixed points."""

    step: int
    mb: Minibatch
    old: OldPolicy
    scores: Scores | None = None
    held: dict[Any, Any] = field(default_factory=dict)

    @property
    def scored(self) -> Scores:
        """The forward's `scores`, as the fixed points after it read them (`loss` on): the forward has run."""
        return cast(Scores, self.scores)


@dataclass(frozen=True)
class Rows:
    """Tensors of one minibatch over every rank's rows (`gather_rows`; the identity on one rank), and the response
    mask gathered once."""

    ranks: Ranks
    mask: torch.Tensor

    @classmethod
    def of(cls, ranks: Ranks, mb: Minibatch) -> Rows:
        return cls(ranks, gather_rows(mb.response_mask, ranks, fill=False))

    def __call__(self, tensor: torch.Tensor, dim: int = 0, fill: float = 0) -> torch.Tensor:
        return gather_rows(tensor, self.ranks, dim=dim, fill=fill)

    def routes(self, trace: RoutingTrace) -> RoutingTrace:
        """A trace's experts, and its gate weights where it carries them, over every rank's rows (its router
        log-scores and states are not measured)."""
        weights = self(trace.weights, dim=1) if trace.weights is not None else None
        return replace(
            trace.without_states(), experts=self(trace.experts, dim=1, fill=NO_ROUTE), weights=weights, logprobs=None
        )

    def gathered(self, output: Any) -> Any:
        """An output that gathers itself (`.gathered(rows)`: the objective's, a correction's), over every rank's
        rows."""
        return output.gathered(self) if self.ranks.active else output


class StepHook:
    """A part of the run at the step's fixed points (module docstring); every method does nothing here."""

    def options(self, update: Update, options: ScoreOptions) -> ScoreOptions:
        return options

    def around_forward(self, update: Update) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext()

    def objective_inputs(self, update: Update, inputs: ObjectiveInputs) -> ObjectiveInputs:
        return inputs

    def loss(self, update: Update) -> torch.Tensor | float:
        return 0.0

    def before_step(self, update: Update) -> dict[str, float]:
        return {}

    def after_step(self, update: Update) -> dict[str, float]:
        return {}

    def measure(self, update: Update, rows: Rows) -> dict[str, float]:
        return {}
