"""The lagged source (`rollout.source=lagged`, `rollout.lag=k`; the exact lag, the science mode): the engine samples
every step in the step, with exactly the weights of k versions before θ_old (`experiments.step.versions`; the first k
steps sample with the start), deterministically, reproducibly and resumably. It keeps those versions itself and hands
them to the checkpoint. k = 0 is the synchronous loop, bit for bit: at k = 0 it builds the synchronous source."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from experiments.step import metrics as m
from experiments.step.batch import Rollout
from experiments.step.engines import RolloutEngine
from experiments.step.sources.base import ROLLOUT_SOURCES, SourceInputs
from experiments.step.sources.synchronous import SynchronousSource
from experiments.step.versions import Weights, WeightVersions
from models.registry import ConfigError


@ROLLOUT_SOURCES.register("lagged")
class LaggedSource(SynchronousSource):
    """The engine in this process, a copy of its own, samples step `step` with version max(0, step − 1 − k)."""

    settings = ("lag",)

    @classmethod
    def check(cls, rollout: Any, world: int, steps: int) -> None:
        lag = rollout.lag
        if lag < 0:
            raise ConfigError(
                f"rollout.lag={lag} must be >= 0: the weight versions the engine samples behind θ_old (0: "
                "the synchronous loop)"
            )
        if lag >= steps:
            raise ConfigError(
                f"rollout.lag={lag} is never reached in trainer.steps={steps}: step t samples min(t - 1, "
                f"{lag}) versions behind θ_old, so the lag is first served at step {lag + 1}; use a lag "
                f"below {steps}, or more steps"
            )

    @classmethod
    def engine_is_trainer(cls, rollout: Any, engine: type[RolloutEngine]) -> bool:
        """The trainer's module at most at lag 0 (the synchronous source's engine): behind θ_old, an engine holds older
        weights."""
        return rollout.lag == 0 and super().engine_is_trainer(rollout, engine)

    @classmethod
    def behind(cls, rollout: Any) -> str | None:
        return f"the engine samples {rollout.lag} versions behind θ_old" if rollout.lag else None

    @classmethod
    def build(cls, rollout: Any, given: SourceInputs) -> SynchronousSource:
        if rollout.lag == 0:
            return SynchronousSource.build(rollout, given)
        versions = WeightVersions(rollout.lag, given.weights())  # version 0, the start, on
        return cls(given.make_engine(), given.sample, given.weights, versions)

    def __init__(
        self,
        engine: RolloutEngine,
        sample: Callable[[RolloutEngine], Rollout],
        weights: Callable[[], Weights],
        versions: WeightVersions,
    ) -> None:
        super().__init__(engine, sample, weights)
        self.versions = versions

    def served(self, step: int) -> int:
        return self.versions.served

    def version_metrics(self, step: int) -> dict[str, float]:
        version = self.versions.served
        return {m.ENGINE_VERSION: version, m.LAG: step - 1 - version}

    def publish(self, version: int) -> None:
        """Keep the trainer's weights as `version`; the engine takes the version the next step samples with once it
        is not the one it holds."""
        weights = self.versions.publish(version, self.weights())
        if weights is not None:
            self.engine.sync_weights(weights)

    def described_lag(self) -> str:
        return f", with the weights {self.versions.lag} versions behind θ_old (rollout.lag)"

    def held(self) -> Mapping[int, Weights]:
        return self.versions.state()

    def restore(self, held: Mapping[int, Weights]) -> None:
        """Hold the checkpoint's versions; the engine takes the oldest, the one it sampled with when it was written."""
        self.engine.sync_weights(self.versions.restore(held))
