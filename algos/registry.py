"""Objectives by name: `@OBJECTIVES.register("name")` files a class, `build_objective` makes one from a config.

Registration happens when the objective's module is imported; `algos/__init__.py` imports every module, so
`import algos` is enough to see them all. The pattern (and its errors) is `models.registry.Registry`, shared
with the tasks.
"""

from algos.objective import Objective
from models.registry import Registry

OBJECTIVES: Registry[Objective] = Registry("objective", Objective)


def build_objective(name: str, **hyperparameters: object) -> Objective:
    """The objective registered as `name` with the given hyperparameters (the others keep their defaults)."""
    return OBJECTIVES.build(name, **hyperparameters)
