"""What a verifiable task is: examples with a canonical answer, and a reward the task itself owns.

The shape follows nanochat's Task abstraction (a dataset plus its evaluation criterion): the training loop,
SFT and evaluation never look inside an answer, they only call `examples`, `reward` and `is_correct`. Tasks deal
in text only; tokenisation belongs to the policy.

A task is a frozen dataclass whose fields are its parameters (the Hydra `dataset` group is generated from
those fields), registered under a name with `register_task`.
"""

import dataclasses
import types
import typing
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

SPLITS = ("train", "test")


@dataclass(frozen=True)
class Example:
    """One prompt with its reference.

    prompt: the exact text fed to the model.
    answer: the canonical final answer that `Task.reward` compares a completion to.
    demonstration: the completion an SFT step teaches, without eos (the loop appends the tokenizer's).
    """

    prompt: str
    answer: str
    demonstration: str


class Task(ABC):
    """Base of every task. Subclasses are frozen dataclasses and call `super().__post_init__()` first."""

    name: ClassVar[str]  # the registry key, set by `register_task`; not a parameter

    def __post_init__(self) -> None:
        check_field_types(self)

    @abstractmethod
    def examples(self, split: str) -> list[Example]:
        """The examples of `split` ("train" or "test"), in a fixed order."""

    @abstractmethod
    def reward(self, completion: str, example: Example) -> float:
        """A score in [0, 1] for `completion` (decoded text up to, not including, eos); 1.0 means correct."""

    def is_correct(self, completion: str, example: Example) -> bool:
        """What accuracy counts: full reward."""
        return self.reward(completion, example) == 1.0


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not one of {list(SPLITS)}")


def _allowed_types(annotation: object) -> tuple[type, ...]:
    """`int` -> (int,), `str | None` -> (str, NoneType)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return tuple(typing.get_args(annotation))
    return (annotation,)


def check_field_types(task: object) -> None:
    """Refuse a parameter of the wrong type, naming it; ints pass for floats, bools never pass for ints."""
    hints = typing.get_type_hints(type(task))
    for field in dataclasses.fields(task):
        value = getattr(task, field.name)
        allowed = _allowed_types(hints[field.name])
        if isinstance(value, bool):
            ok = bool in allowed
        else:
            ok = isinstance(value, allowed) or (isinstance(value, int) and float in allowed)
        if not ok:
            names = " | ".join("None" if t is type(None) else t.__name__ for t in allowed)
            raise ValueError(f"{type(task).__name__}.{field.name}={value!r} must be of type {names}")
