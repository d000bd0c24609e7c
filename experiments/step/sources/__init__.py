"""The rollout sources: where each step's rollouts come from, behind one interface, by name (`rollout.source`).

`sources.base` is the interface (`RolloutSource`, what a source is given: `SourceInputs`) and the registry
`ROLLOUT_SOURCES`; each source is one module that registers itself when imported here: `synchronous` (the engine
samples each step in the step, the default), `lagged` (the same engine exactly `rollout.lag` versions behind θ_old)
and `concurrent` (a worker process, or Ray actors: `rollout.transport`, samples while the trainer updates, at most
`rollout.max_staleness` behind, past which `rollout.overflow` says what happens: `sources.overflow`).
"""

from experiments.step.sources.base import ROLLOUT_SOURCES, RolloutSource, SamplingRun, SourceInputs

# Importing a module registers its source.
from experiments.step.sources import synchronous, lagged, concurrent  # noqa: E402,F401  isort: skip

__all__ = ["ROLLOUT_SOURCES", "RolloutSource", "SamplingRun", "SourceInputs"]
