"""What a resumed run must share with the run it continues: every setting of the composed config, except the few
declared safe to change.

A run's settings are compared key by key, over every key of its config, whatever the schema holds today: a field
added tomorrow (a kernel choice, an evaluation setting, a synthetic perturbation) is compared from the day it exists,
unless it is added to `SAFE_TO_CHANGE`. A key the recorded run lacks is a setting added since it was written: it is
the same setting when this run holds what runs did before it existed (a field's schema default, a config group's
choice that changes nothing: `BEFORE_THE_GROUP`), and another experiment otherwise. A key the recorded run holds and
today's schema lacks is a setting retired since: the same experiment only at the value that means what today's
config does without it (`RETIRED`). Where a setting took over from retired ones (`rollout.source` from `rollout.lag`
and `rollout.concurrent`) both runs' settings are compared in today's terms (`in_todays_terms`). The run's length is
the one setting that may change under a rule of its own (`length_change`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple, cast

from omegaconf import DictConfig, OmegaConf

from experiments.step.optimizer import LRSchedule
from models.registry import flat

# The keys (with everything under them) that may differ between a run and its resume: how the same steps are
# computed, watched and saved, never what they compute.
SAFE_TO_CHANGE = (
    "resume",  # how this start finds the run it continues
    "trainer.steps",  # the run's length: `length_change` says when it may grow
    "trainer.threads",  # CPU threads computing the same steps
    "cpu_kernels",  # the CPU kernels computing them (other rounding, as other threads give)
    "device",  # the device computing them (the number of ranks is the checkpoint's to compare)
    "launch",  # how the ranks start
    "rollout.vllm",  # vLLM's memory budget
    # Where the concurrent source's batches are sampled (a worker process, or Ray actors on this machine or a
    # cluster's), not what a step computes from them: under that source which version samples a batch rests on the
    # processes' timing wherever they run.
    "rollout.transport",
    "rollout.ray",
    "trainer.eval_every",  # when the held-out evaluation runs, not what it measures
    "trainer.eval_start",  # the start's evaluation, long past when a run resumes
    "trainer.eval_split",  # whether the whole test split is evaluated too, at the start and the last step
    "trainer.checkpoint_every",  # when checkpoints are written,
    "trainer.keep_checkpoints",  # how many stay,
    "trainer.save_checkpoint",  # and whether the final weights are exported
    "trainer.max_consecutive_skips",  # how long a run whose updates keep failing goes on before it stops
    "logger",  # where the numbers are sent
    "comparison",  # how the experiment's report compares its runs, not what a run computes
    "hydra",  # Hydra's own node, which a config composed with it carries
)
# The config groups added since runs were first recorded, and the choice of each that runs made before it existed.
BEFORE_THE_GROUP = {
    "routing_variant.name": "none"  # no routing variant: plain replay, as before routing variants
}
# The settings retired since runs were first recorded, and the value at which a recorded run computed what today's
# config computes without them.
RETIRED = {
    "trainer.router_aux_loss_coef": 0.0  # the load-balancing loss's weight, now routers=[aux_loss]: 0 is no switch
}


class Difference(NamedTuple):
    """A compared setting in which this run is another experiment than the recorded one."""

    key: str
    there: Any
    here: Any
    absent: bool  # the recorded run lacks the key
    retired: bool = False  # today's schema lacks the key

    def __str__(self) -> str:
        there = " absent" if self.absent else f"={self.there!r}"
        return f"{self.key}{there} there, {'absent' if self.retired else repr(self.here)} here"


def settings(cfg: DictConfig) -> dict[str, Any]:
    """Every setting of `cfg`, resolved, as a flat `{dotted key: value}` (lists are values)."""
    return flat(cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)))  # a mapping


def declared_safe(key: str) -> bool:
    return any(key == safe or key.startswith(f"{safe}.") for safe in SAFE_TO_CHANGE)


def in_todays_terms(flat: Mapping[str, Any]) -> dict[str, Any]:
    """A run's flat settings as today's keys say them. A run recorded before `rollout.source` existed ran the source
    its `rollout.concurrent` (retired) and `rollout.lag` named: concurrent, lagged or synchronous. The lagged source at
    lag 0 is the synchronous loop, bit for bit (it builds the synchronous source), and is named so: a sweep over lags
    under `rollout.source=lagged` continues runs recorded at lag 0 without a source."""
    today = dict(flat)
    if "rollout.source" not in today and node_recorded(today, "rollout.source"):
        concurrent = today.pop("rollout.concurrent", False)
        today["rollout.source"] = (
            "concurrent" if concurrent else "lagged" if today.get("rollout.lag") else "synchronous"
        )
    if today.get("rollout.source") == "lagged" and not today.get("rollout.lag"):
        today["rollout.source"] = "synchronous"
    return today


def differences(recorded: dict[str, Any], cfg: DictConfig) -> list[Difference]:
    """Every compared setting in which `cfg` is another experiment than the run whose `settings` are `recorded`."""
    found = []
    recorded = in_todays_terms(recorded)
    today = in_todays_terms(settings(cfg))
    for key, ours in today.items():
        if declared_safe(key):
            continue
        if key in recorded:
            if recorded[key] != ours:
                found.append(Difference(key, recorded[key], ours, absent=False))
        elif not _as_before_it_existed(recorded, cfg, key, ours):
            found.append(Difference(key, None, ours, absent=True))
    for key, there in recorded.items():
        if key not in today and not declared_safe(key) and not retired_as_today(key, there):
            found.append(Difference(key, there, None, absent=False, retired=True))
    return found


def _as_before_it_existed(recorded: dict[str, Any], cfg: DictConfig, key: str, value: Any) -> bool:
    """Whether `value` of `key`, which the recorded run lacks, is what runs did before the key existed."""
    if key in BEFORE_THE_GROUP:
        return BEFORE_THE_GROUP[key] == value
    return node_recorded(recorded, key) and _is_schema_default(cfg, key, value)


def retired_as_today(key: str, value: Any) -> bool:
    """Whether `key`, retired since a run recorded it, holds the value at which that run computed what today's config
    computes without it (`RETIRED`)."""
    return key in RETIRED and RETIRED[key] == value


def node_recorded(recorded: Mapping[str, Any], key: str) -> bool:
    """Whether the recorded run holds the node `key` sits in: a field added to a node it had, not a node it lacks."""
    node = key.rpartition(".")[0]
    return not node or any(other.startswith(f"{node}.") for other in recorded)


def _is_schema_default(cfg: DictConfig, key: str, value: Any) -> bool:
    node_key, _, name = key.rpartition(".")
    schema = OmegaConf.get_type(OmegaConf.select(cfg, node_key) if node_key else cfg)
    if not dataclasses.is_dataclass(schema):
        return False
    for field in dataclasses.fields(schema):
        if field.name == name:
            if field.default is not dataclasses.MISSING:
                return field.default == value
            return field.default_factory is not dataclasses.MISSING and field.default_factory() == value
    return False


def described(found: list[Difference]) -> str:
    """The first few differences, and how many more."""
    return "; ".join(map(str, found[:4])) + (f" (and {len(found) - 4} more)" if len(found) > 4 else "")


def length_change(recorded: dict[str, Any], cfg: DictConfig) -> str | None:
    """Why this run cannot take the length `trainer.steps` asks for, or None: a schedule that decays over
    `trainer.steps` would restart its decay at the resume, joining two schedules; a constant one (its warm-up counts
    updates, not the run's length) lets a run grow, or a finished run be extended."""
    planned, asked = recorded.get("trainer.steps"), cfg.trainer.steps
    if planned is None or planned == asked or cfg.trainer.lr_schedule == LRSchedule.constant:
        return None
    return (
        f"its run was planned for trainer.steps={planned} under trainer.lr_schedule={cfg.trainer.lr_schedule}, "
        f"whose learning rate decays over trainer.steps: trainer.steps={asked} would join two schedules (a run "
        "changes length on resume under trainer.lr_schedule=constant only); start a new run for another length"
    )
