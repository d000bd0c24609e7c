"""The synchronous source (`rollout.source=synchronous`, the default): the engine samples each step's rollouts in the
step, with the weights the step before made. On the trainer's own module (its numbers are then π_old's) where the
engine can, else on a copy of its own that takes the trainer's weights after every step."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from experiments.step.batch import Rollout, Served
from experiments.step.engines import RolloutEngine
from experiments.step.sources.base import ROLLOUT_SOURCES, RolloutSource, SourceInputs
from experiments.step.versions import Weights


@ROLLOUT_SOURCES.register("synchronous")
class SynchronousSource(RolloutSource):
    """The engine in this process samples every step with the newest weights (version step − 1 for step `step`)."""

    @classmethod
    def build(cls, rollout: Any, given: SourceInputs) -> SynchronousSource:
        return cls(given.make_engine(), given.sample, given.weights)

    def __init__(
        self, engine: RolloutEngine, sample: Callable[[RolloutEngine], Rollout], weights: Callable[[], Weights]
    ) -> None:
        self.engine = engine
        self.sample = sample
        self.weights = weights

    def take(self, step: int, seed: int) -> Served:
        self.engine.reseed(seed)
        start = time.perf_counter()
        rollout = self.sample(self.engine)
        sample_s = time.perf_counter() - start
        return Served(rollout, torch.full((rollout.size,), self.served(step)), sample_s, self.version_metrics(step))

    def served(self, step: int) -> int:
        """The version the engine samples step `step` with: θ_old's."""
        return step - 1

    def version_metrics(self, step: int) -> dict[str, float]:
        """The step's `async/*` record: none, as it samples with θ_old itself."""
        return {}

    def publish(self, version: int) -> None:
        """The engine takes the trainer's weights (nothing when it samples with the trainer's module itself)."""
        if not self.engine.shares_trainer_weights:
            self.engine.sync_weights(self.weights())

    def describe(self) -> dict[str, Any]:
        return {
            "rollouts": f"{self.name}: the engine samples each step's rollouts in the step" + self.described_lag(),
            "engine": self.engine.name,
            "engine_numerics": (
                "the trainer's own model" if self.engine.shares_trainer_weights else str(self.engine.numerics)
            ),
            "engine_details": self.engine.describe(),
        }

    def described_lag(self) -> str:
        """How far behind θ_old the engine samples, as the end of `describe`'s sentence: not at all."""
        return ""

    def restore(self, held: Mapping[int, Weights]) -> None:
        """An engine with a copy of its own takes the checkpoint's weights, which the trainer now holds."""
        if not self.engine.shares_trainer_weights:
            self.engine.sync_weights(self.weights())

    def generators(self) -> dict[str, torch.Generator]:
        return {"noise": self.engine.noise}  # the engine's router noise (`rollout.router_noise`)
