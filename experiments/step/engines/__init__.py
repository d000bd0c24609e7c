"""The rollout engines: what samples the completions of an RL step (μ_old), behind one interface, by name.

`engines.base` is the interface (`RolloutEngine`, `Samples`, `EngineNumerics`) and the registry `ENGINES`; each
engine is one module that registers itself when imported here: `hf` (transformers' `generate`, the default) and
`vllm` (vLLM in this process; `vllm` itself is imported only when such an engine starts).
"""

from experiments.step.engines.base import (
    ENGINES,
    EngineFactory,
    EngineNumerics,
    KVCache,
    Needs,
    Precision,
    RolloutEngine,
    Samples,
    Sampling,
    WeightQuant,
    full_weights,
)

# Importing a module registers its engine.
from experiments.step.engines import hf, vllm  # noqa: E402,F401  isort: skip
from experiments.step.engines.hf import HFEngine  # noqa: E402

__all__ = [
    "ENGINES",
    "EngineFactory",
    "EngineNumerics",
    "HFEngine",
    "KVCache",
    "Needs",
    "Precision",
    "RolloutEngine",
    "Samples",
    "Sampling",
    "WeightQuant",
    "full_weights",
]
