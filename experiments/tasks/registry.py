"""Task registry: name -> task class, and `build_task`, the one way the loops construct a task.

The pattern and its errors are `models.registry.Registry`, shared with the objectives: unknown names and
parameters fail with the list of valid ones, so a typo in a config or a test names itself.
"""

from models.registry import Registry
from experiments.tasks.base import Task

TASKS: Registry[Task] = Registry("task", Task)


def build_task(name: str, **params: object) -> Task:
    """The task registered as `name`, with `params` overriding its defaults."""
    return TASKS.build(name, **params)
