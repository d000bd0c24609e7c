"""What a rollout source is: where each step's rollouts come from, behind one interface, by name (`rollout.source`).

A source is given what it needs to serve the steps (`SourceInputs`), never the trainer: how to build the run's
engine (in this process, or in a worker's from a picklable recipe), how one step's rollout is drawn with an engine,
and the trainer's weights, which it publishes by version (version t: the weights after step t). What a source decides
before anything is built it says in class methods, read at start-up: its own settings and their refusals (`check`),
whether the engine that samples is the trainer's own module (`engine_is_trainer`, decided once, for the plan) and how
far behind θ_old it samples (`behind`). What it keeps across steps beyond the trainer's weights (the lagged source's
versions) and its random streams are its own to hand a checkpoint (`held`, `restore`, `generators`).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from omegaconf import DictConfig, OmegaConf

from experiments.ranks import Ranks
from experiments.step.batch import Rollout, Served
from experiments.step.engines import EngineFactory, EngineNumerics, RolloutEngine, Sampling
from experiments.step.versions import Weights
from models.policy import ModelConfig
from models.registry import Registry


@dataclass(frozen=True)
class SamplingRun:
    """What a process of its own needs to sample the run's steps (picklable: a spawned worker receives it): the model
    to build, the task, how many prompts a batch asks and how they are sampled, and how the engine is built."""

    model: ModelConfig
    dataset: dict[str, Any]  # the task's settings (`experiments.tasks.build_task`)
    device: str
    seed: int
    prompts: int  # per batch: trainer.prompts_per_step
    sampling: Sampling
    engines: EngineFactory
    # What the routing variant adds to the policy before its engine copies it (PR2's route predictors:
    # `RoutingVariant.start`), done to the worker's model as the trainer does it to its own, so that the two state
    # dicts match and every published version carries what the engine routes by.
    start_model: Callable[[torch.nn.Module], None]


@dataclass(frozen=True)
class SourceInputs:
    """What a rollout source is given to serve a run's steps."""

    # The run's engine in this process: on the trainer's own module where the plan says it is the trainer's
    # (`StepPlan.engine_is_trainer`), else on a copy of its own. Called only by a source that samples here.
    make_engine: Callable[[], RolloutEngine]
    # One step's rollout with an engine in this process: the step's prompts, drawn from the trainer's generator (seeded
    # per step), sampled as the run samples.
    sample: Callable[[RolloutEngine], Rollout]
    # The trainer's full (unsharded) weights now: before the first step the start (a resumed run's checkpoint loads
    # later: `restore`), after step t version t. Read only when a source needs them: under FSDP2 it gathers.
    weights: Callable[[], Weights]
    run: SamplingRun  # for a source that samples in a process of its own
    # This process's place among the trainer's ranks: a source whose workers sample every rank's rows starts them on
    # rank 0, and hands each rank its share of each batch.
    ranks: Ranks


class RolloutSource(ABC):
    """Where each step's rollouts come from. A subclass implements `build`, `take`, `publish` and `describe`; the
    class methods read at start-up and the checkpoint's have defaults it may extend."""

    name: ClassVar[str] = "source"  # the registry key, set by `ROLLOUT_SOURCES.register`
    # The `rollout` settings that are this source's own (dotted within `rollout`: `ray.workers`): under another
    # source one set off its schema default would change nothing, and is refused
    # (`experiments.step.checks.check_rollout_source`).
    settings: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def check(cls, rollout: Any, world: int, steps: int) -> None:
        """Refuse, in one line and before anything is built, settings of `rollout` this source cannot serve on `world`
        ranks over `steps` steps."""

    @classmethod
    def engine_is_trainer(cls, rollout: Any, engine: type[RolloutEngine]) -> bool:
        """Whether the engine that samples the steps is the trainer's own module, so that its numbers are π_old's: by
        default where the engine can (`RolloutEngine.shares_weights_with_trainer`). Decided once, for the plan."""
        return engine.shares_weights_with_trainer(EngineNumerics.of(rollout))

    @classmethod
    def behind(cls, rollout: Any) -> str | None:
        """How far behind θ_old the engine samples, as a clause of `summary.json`'s `pi_old_why`; None: it samples
        with θ_old itself."""
        return None

    @classmethod
    @abstractmethod
    def build(cls, rollout: Any, given: SourceInputs) -> RolloutSource:
        """The source of a run whose `rollout` settings it checked, given what it needs."""

    @abstractmethod
    def take(self, step: int, seed: int) -> Served:
        """Step `step`'s rollouts (it trains from θ_old = version step − 1), every row stamped with the version that
        sampled it. `seed`: the step's seed on this rank, for what samples in this process."""

    @abstractmethod
    def publish(self, version: int) -> None:
        """The trainer's weights after step `version` are version `version`: hand them to what samples the next
        rollouts (`SourceInputs.weights`)."""

    def close(self) -> None:
        """Stop what runs beside the trainer, however the run ends (nothing by default)."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """What `summary.json` says of the rollouts and their engine: `rollouts`, `engine`, `engine_numerics`,
        `engine_details`."""

    # -- checkpoints -------------------------------------------------------------------------------------------------

    def held(self) -> Mapping[int, Weights]:
        """The weight versions this source keeps beyond the trainer's own, by version, for a checkpoint to hold (its
        `engine_versions`); none by default."""
        return {}

    def restore(self, held: Mapping[int, Weights]) -> None:
        """Continue from a checkpoint, once the trainer's weights are loaded: `held` is what `held` gave when it was
        written (empty for a source that keeps nothing)."""

    def generators(self) -> dict[str, torch.Generator]:
        """The random streams of what samples in this process, by name, saved with each rank's in checkpoints."""
        return {}


def off_default(rollout: Any, key: str) -> tuple[Any, Any] | None:
    """`rollout`'s setting `key` (dotted within it: `ray.workers`) and its schema default, where the two differ;
    None where it is at its default, or `rollout` has no schema to say one (a plain mapping, a test's)."""
    node_key, _, name = key.rpartition(".")
    node = OmegaConf.select(rollout, node_key) if node_key else rollout
    schema = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
    if not dataclasses.is_dataclass(schema):
        return None
    for field in dataclasses.fields(schema):
        if field.name == name:
            default = field.default if field.default_factory is dataclasses.MISSING else field.default_factory()
            value = node[name]
            return None if value == default else (value, default)
    return None


def as_written(value: Any) -> str:
    """A setting's value as an override writes it (null, not None)."""
    return "null" if value is None else str(value)


ROLLOUT_SOURCES: Registry[RolloutSource] = Registry("rollout source", RolloutSource, fields_are_parameters=False)
