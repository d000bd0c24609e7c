"""The trainer's weights by version, for a rollout engine that samples an exact number of versions behind θ_old.

A version is the weights after one RL step: version 0 is the start, version t the weights after step t. Step t
trains from θ_old = version t − 1; with `rollout.lag=k` its rollouts are sampled with version max(0, t − 1 − k), so
the engine is exactly k versions behind θ_old once the run has taken k steps (and as far behind as the run allows
before: the first k steps sample with the start). k = 0 is the synchronous loop: the engine takes the weights every
step has just made (`rollout.source=lagged` then builds the synchronous source). This is the exact lag the experiments
use (what an asynchronous trainer bounded at k versions serves at worst, every step at that bound), the lagged source's
(`experiments.step.sources.lagged`); `experiments.step.sources.concurrent` is the sampler that runs beside the trainer.

Where the versions live: a CPU copy of the full (unsharded) weights per version the engine may still need, from
the one it holds to the newest: k + 1 copies once the run is k steps in (each rank holds its own under FSDP2, as
every rank gathers the full weights for its engine). At a 30B scale that is (k + 1) × 60 GB of bf16 host memory per
rank, which is why a run at that scale is the concurrent sampler's, whose engine keeps only the version it serves.
A checkpoint holds the copies (`state`, `restore`; `experiments.run.checkpoint`), so that a resumed lagged run samples
what the uninterrupted one sampled.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

import torch

Weights = Mapping[str, torch.Tensor]


def cpu_copy(weights: Weights) -> dict[str, torch.Tensor]:
    """A copy of `weights` on the CPU that no later update of the model changes (a full state dict of an unsharded
    model holds the parameters themselves)."""
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in weights.items()}


class WeightVersions:
    """The versions an engine `lag` versions behind θ_old will still sample with, oldest first; the oldest is the one
    it holds now (`served`). `publish(t, weights)` after step t returns the weights the engine must take for step
    t + 1, or None when it keeps those it holds."""

    def __init__(self, lag: int, start: Weights) -> None:
        if lag < 1:
            raise ValueError(f"lag={lag}: WeightVersions keeps versions for an engine at least one behind")
        self.lag = lag
        self.held: deque[tuple[int, dict[str, torch.Tensor]]] = deque([(0, cpu_copy(start))])

    @property
    def served(self) -> int:
        """The version the engine holds."""
        return self.held[0][0]

    def publish(self, version: int, weights: Weights) -> dict[str, torch.Tensor] | None:
        """Keep `weights`, the trainer's after step `version`, and drop what the engine will never sample with again;
        return the version the next step samples with when the engine does not hold it yet."""
        if version != self.held[-1][0] + 1:
            raise RuntimeError(
                f"weight version {version} published after version {self.held[-1][0]}: versions must "
                "follow each other one step at a time"
            )
        self.held.append((version, cpu_copy(weights)))
        before = self.served
        while self.held[0][0] < version - self.lag:
            self.held.popleft()
        return self.held[0][1] if self.served != before else None

    # -- checkpoints -------------------------------------------------------------------------------------------------

    def state(self) -> dict[int, dict[str, torch.Tensor]]:
        """Every held version's weights, by version (a checkpoint's `engine_versions`)."""
        return dict(self.held)

    def restore(self, state: Mapping[int, Weights]) -> dict[str, torch.Tensor]:
        """Hold the versions of a checkpoint's `state` instead; return the one the engine must take (the oldest)."""
        versions = sorted(state)
        if versions != list(range(versions[0], versions[0] + len(versions))) or len(versions) > self.lag + 1:
            raise ValueError(
                f"a checkpoint's weight versions {versions} are not the consecutive versions, at most "
                f"{self.lag + 1}, that rollout.lag={self.lag} keeps"
            )
        self.held = deque((version, cpu_copy(state[version])) for version in versions)
        return self.held[0][1]
