"""Task registry: name -> task class, and `build_task`, the one way the loops construct a task.

Unknown names and parameters fail with the list of valid ones, so a typo in a config or a test names itself.
"""

import dataclasses
from collections.abc import Callable

from experiments.tasks.base import Task

TASKS: dict[str, type[Task]] = {}


def register_task(name: str) -> Callable[[type[Task]], type[Task]]:
    """Class decorator: register a frozen dataclass `Task` subclass under `name` and set its `name`."""

    def register(cls: type[Task]) -> type[Task]:
        if name in TASKS:
            raise ValueError(f"task name {name!r} is already registered by {TASKS[name].__name__}")
        if not (isinstance(cls, type) and issubclass(cls, Task)):
            raise ValueError(f"register_task({name!r}) needs a Task subclass, got {cls!r}")
        if not dataclasses.is_dataclass(cls) or not cls.__dataclass_params__.frozen:
            raise ValueError(f"task {cls.__name__} must be a frozen dataclass (its fields are its parameters)")
        if "name" in {f.name for f in dataclasses.fields(cls)}:
            raise ValueError(f"task {cls.__name__} has a field 'name': the name is the registry key, not a field")
        cls.name = name
        TASKS[name] = cls
        return cls

    return register


def build_task(name: str, **params: object) -> Task:
    """The task registered as `name`, with `params` overriding its defaults."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {sorted(TASKS)}")
    cls = TASKS[name]
    fields = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(params) - set(fields))
    if unknown:
        raise ValueError(f"task {name!r} has no parameter {', '.join(map(repr, unknown))}; its parameters: {fields}")
    return cls(**params)
