"""Objectives by name: `@register_objective("name")` files a class, `build_objective` makes one from a config.

Registration happens when the objective's module is imported; `algos/__init__.py` imports every module, so
`import algos` is enough to see them all.
"""

from collections.abc import Callable
from dataclasses import fields, is_dataclass

from algos.objective import Objective

OBJECTIVES: dict[str, type[Objective]] = {}


def register_objective(name: str) -> Callable[[type[Objective]], type[Objective]]:
    """Class decorator: file a frozen-dataclass `Objective` subclass under `name`."""

    def register(cls: type[Objective]) -> type[Objective]:
        if name in OBJECTIVES:
            raise ValueError(f"objective {name!r} is already registered (by {OBJECTIVES[name].__qualname__})")
        if not (isinstance(cls, type) and issubclass(cls, Objective) and is_dataclass(cls)):
            raise ValueError(f"@register_objective({name!r}) needs a dataclass subclass of Objective, got {cls!r}")
        cls.registry_name = name
        OBJECTIVES[name] = cls
        return cls

    return register


def hyperparameter_names(name: str) -> tuple[str, ...]:
    """The hyperparameter (field) names of the objective registered as `name`."""
    return tuple(f.name for f in fields(_lookup(name)))


def build_objective(name: str, **hyperparameters: object) -> Objective:
    """The objective registered as `name` with the given hyperparameters (the others keep their defaults)."""
    cls = _lookup(name)
    allowed = hyperparameter_names(name)
    unknown = sorted(set(hyperparameters) - set(allowed))
    if unknown:
        raise ValueError(
            f"{name}: unknown hyperparameter(s) {', '.join(unknown)}; {name} takes {', '.join(allowed)}"
        )
    return cls(**hyperparameters)


def _lookup(name: str) -> type[Objective]:
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; valid names: {', '.join(sorted(OBJECTIVES))}")
    return OBJECTIVES[name]
