"""vLLM as the rollout engine (`rollout.engine=vllm`): written next, behind `experiments.engine.RolloutEngine`."""

from __future__ import annotations

import importlib.util

from experiments.engine import RolloutEngine
from experiments.registry import ConfigError

INSTALL = "make test-vllm (or: pip install -e '.[vllm]', then the steps in docs/vllm.md)"


class VLLMEngine(RolloutEngine):
    name = "vllm"

    @classmethod
    def require(cls) -> None:
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError(f"rollout.engine=vllm needs vLLM, which is not installed here: {INSTALL}")
