"""Verifiable tasks: prompts, canonical answers, SFT demonstrations and the reward each task owns.

Importing this package registers every task in `TASKS`; `build_task(name, **params)` is how the training
loop, SFT and evaluation get one. The Hydra `dataset` group (`conf/dataset/<name>.yaml`) holds the parameters.
"""

from experiments.tasks.base import TASKS, Example, Task, build_task

# Imported for their registration side effect.
from experiments.tasks import addition, gsm8k, reasoning_gym, scratchpad, sorting  # noqa: E402,F401  isort: skip

__all__ = ["Example", "Task", "TASKS", "build_task"]
