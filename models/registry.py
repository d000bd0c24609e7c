"""The one pattern for named, configurable parts, and the two errors a run ends on in one line.

It sits in the lowest room (`models/`) so that every room can use it and no import runs back up
(docs/architecture.md). A part is filed under a name in its kind's registry: objectives, rollout corrections, routing
variants and tasks are frozen dataclasses whose fields are their parameters,

    OBJECTIVES = Registry("objective", Objective)

    @OBJECTIVES.register("grpo")
    @dataclass(frozen=True)
    class GRPO(Objective): ...

    OBJECTIVES.build("grpo", clip_low=0.1)

and the dataclass doubles as the typed Hydra schema of its config group (`experiments.config`), so a parameter and
its default are declared once, in the dataclass. `check_fields` is the shared type check every such part runs
first. Rollout engines are registered the same way but are not dataclasses: an engine builds itself from the run's
config (`experiments.step.engines`).

`ConfigError` is what every start-up refusal raises: a bad setting, named with its value and what is allowed.
`Diverged` is what a run raises when its numbers turned non-finite for good (the loss or gradient of too many updates
in a row, the weights, the logits it samples from). The entry points turn exactly these two types into a one-line
exit; any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from collections.abc import Callable, ItemsView, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar, cast

from omegaconf import OmegaConf

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


class Part(Protocol):
    """What a registry files: a class with a `name`, the registry key (`Registry.register` sets it)."""

    name: ClassVar[str]


T = TypeVar("T", bound=Part)


class ConfigError(ValueError):
    """A bad setting, found before any work starts; its message is one line naming the value and what is allowed."""


class Diverged(ArithmeticError):
    """The run's numbers are non-finite and will stay so; the message (one line) says which, and where."""


class RunFailed(Exception):
    """The run cannot go on for a cause outside its settings and its numbers (its directory could not be written, a
    process it relies on died); the message (one line) says what. The life cycle ends it with its log whole and status
    failed, whatever part raised it (`experiments.run.life`), without naming that part."""


class Registry(Generic[T]):
    """Named subclasses of `base`. With `fields_are_parameters` (the default) each is a frozen dataclass whose fields
    are its parameters, and `build(name, **params)` makes one; without, the classes build themselves (the rollout
    engines, from the run's config)."""

    def __init__(self, kind: str, base: type, fields_are_parameters: bool = True) -> None:
        self.kind = kind
        self.base = base
        self.fields_are_parameters = fields_are_parameters
        self._classes: dict[str, type[T]] = {}

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        """Class decorator (outermost, above `@dataclass(frozen=True)`): file the class under `name` and set its
        `name` class attribute."""

        def register(cls: type[T]) -> type[T]:
            if name in self._classes:
                raise ValueError(f"{self.kind} {name!r} is already registered (by {self._classes[name].__qualname__})")
            if not (isinstance(cls, type) and issubclass(cls, self.base)):
                raise ValueError(
                    f"registering {self.kind} {name!r} needs a subclass of {self.base.__name__}, got {cls!r}"
                )
            if self.fields_are_parameters:
                if not _frozen_dataclass(cls):
                    raise ValueError(
                        f"{self.kind} {cls.__name__} must be a frozen dataclass (its fields are its parameters)"
                    )
                fields = dataclasses.fields(cast("type[DataclassInstance]", cls))  # a dataclass: checked above
                if "name" in {f.name for f in fields}:
                    raise ValueError(f"{self.kind} {cls.__name__} has a field 'name': the name is the registry key")
            cls.name = name
            self._classes[name] = cls
            return cls

        return register

    def __getitem__(self, name: str) -> type[T]:
        if name not in self._classes:
            raise ConfigError(f"unknown {self.kind} {name!r}; valid names: {', '.join(sorted(self._classes))}")
        return self._classes[name]

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def __iter__(self) -> Iterator[str]:
        return iter(self._classes)

    def __len__(self) -> int:
        return len(self._classes)

    def items(self) -> ItemsView[str, type[T]]:
        return self._classes.items()

    def parameters(self, name: str) -> tuple[str, ...]:
        """The parameter (field) names of the class registered as `name`, in the order its constructor takes them
        (keyword-only fields, such as the split sizes every synthetic task shares, last)."""
        # A registry whose fields are parameters files frozen dataclasses only (`register` refuses any other class).
        parameters = dataclasses.fields(cast("type[DataclassInstance]", self[name]))
        # `fields` resolves every field's kw_only to a bool (never MISSING): keyword-only fields sort last.
        return tuple(f.name for f in sorted(parameters, key=lambda f: f.kw_only is True))

    def build(self, name: str, **params: Any) -> T:
        """The part registered as `name` with `params` overriding its defaults; unknown names or parameters raise
        `ConfigError` listing the valid ones."""
        cls = self[name]
        allowed = self.parameters(name)
        unknown = sorted(set(params) - set(allowed))
        if unknown:
            raise ConfigError(
                f"{self.kind} {name!r} has no parameter {', '.join(unknown)}; it takes {', '.join(allowed)}"
            )
        return cls(**params)


def _frozen_dataclass(cls: type) -> bool:
    # typeshed's DataclassInstance declares `__dataclass_fields__` only; every dataclass has `__dataclass_params__`.
    return dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen  # type: ignore[attr-defined]


def check_fields(part: DataclassInstance, label: str) -> None:
    """Refuse a parameter of the wrong type, naming `label.field`; convert where the value is unambiguous.

    Fields are `float`, `int`, `str`, `bool`, a `StrEnum` of allowed values, a `dict[...]` or `list[...]` (its
    container type checked, its items left to the part), or `X | None`. An int is accepted (and stored) for a float,
    a bool never for an int, a float must be finite, a string for an enum must be one of its values (and is stored
    as the member).
    """
    hints = typing.get_type_hints(type(part))
    for f in dataclasses.fields(part):
        value = getattr(part, f.name)
        options = _options(hints[f.name])
        if value is None:
            if type(None) not in options:
                raise ConfigError(f"{label}.{f.name} must not be None")
            continue
        kind = next(option for option in options if option is not type(None))
        kind = typing.get_origin(kind) or kind  # dict[str, Any] -> dict
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            if not isinstance(value, kind):
                allowed = [member.value for member in kind]
                if value not in allowed:
                    raise ConfigError(f"{label}.{f.name}={value!r} is not one of {allowed}")
                object.__setattr__(part, f.name, kind(value))
            continue
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
            object.__setattr__(part, f.name, value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            names = " | ".join("None" if t is type(None) else t.__name__ for t in options)
            raise ConfigError(f"{label}.{f.name}={value!r} must be of type {names}")
        if kind is float and not math.isfinite(value):
            raise ConfigError(f"{label}.{f.name}={value} must be finite")


def _options(annotation: Any) -> tuple[Any, ...]:
    """`int` -> (int,), `str | None` -> (str, NoneType); a generic alias (`dict[str, Any]`) stays one."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return tuple(typing.get_args(annotation))
    return (annotation,)


def node_settings(node: Any) -> dict[str, Any]:
    """A config group's node (an omegaconf DictConfig) as the plain dict of settings a part is built from, its
    interpolations resolved: `OmegaConf.to_container(node, resolve=True)`, typed as the mapping it is (OmegaConf types
    a container as any of its kinds)."""
    return cast(dict[str, Any], OmegaConf.to_container(node, resolve=True))


def flat(node: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping of settings as `{dotted key: value}` (`trainer.lr`: how a setting is named on the command
    line)."""
    found: dict[str, Any] = {}
    for key, value in node.items():
        if isinstance(value, dict):
            found.update(flat(value, f"{prefix}{key}."))
        else:
            found[f"{prefix}{key}"] = value
    return found
