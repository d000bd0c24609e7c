"""What a run is in a comparison: its arm (the objective with its own settings, replay, routing variant, router
switches, correction, where π_old comes from, the engine's precision), the sweep's axes (the numeric settings that vary
within an arm) and its cells.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from analysis.configs import SYNTHETIC_KEYS, format_value, ignored_key, method_name, short_key
from analysis.records import RunSet, run_configs

# Config keys that are never a sweep's axis: who the run is (algorithm and replay make the arm; the seed is
# averaged over) and what an arm implies or a run records about itself.
NOT_AXES = ("algo.name", "routing.replay", "routing_variant.name", "rollout.precision", "seed")
# The settings an arm brings (conf/arm/*.yaml and the groups it picks): they may differ between the arms of one seed.
# Where π_old comes from and the rollout correction are an arm's too: the naive and the decoupled asynchronous GRPO
# differ in nothing else (conf/arm/grpo_naive_async.yaml, grpo_decoupled.yaml).
ARM_KEYS = (
    "algo.",
    "routing.replay",
    "routing_variant.",
    "routers.",
    "rollout.precision",
    "trainer.pi_old",
    "correction.",
)


def arm_of(cfg: dict[str, Any]) -> str:
    """The arm: objective, replay and routing variant, and the engine's precision when it is not the trainer's fp32."""
    arm = method_name(cfg)
    if cfg.get("rollout.precision", "fp32") != "fp32":
        arm += f" ({cfg['rollout.precision']} engine)"
    return arm


def arm_names(configs: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Per run its arm (`arm_of`), and, where runs that share that name differ in another of the arm's own settings
    (`minirl` with and without `algo.mask_stale`), those settings in parentheses: two arms are never pooled as one."""
    names = {run: arm_of(cfg) for run, cfg in configs.items()}
    parts: dict[str, list[str]] = {run: [] for run in configs}

    def name(run: str) -> str:
        return names[run] + (f" ({', '.join(parts[run])})" if parts[run] else "")

    all_keys = sorted({key for cfg in configs.values() for key in cfg})
    for key in (k for k in all_keys if k.startswith(ARM_KEYS)):
        values: dict[str, set[str]] = {}
        for run, cfg in configs.items():
            values.setdefault(name(run), set()).add(format_value(cfg.get(key, "—")))
        split = {run for run in configs if len(values[name(run)]) > 1}
        for run in split:
            parts[run].append(f"{short_key(key, all_keys)}={format_value(configs[run].get(key, '—'))}")
    return {run: name(run) for run in configs}


def arms_of(runset: RunSet) -> dict[str, str]:
    """Per run of `runset` its arm (`arm_names`)."""
    return arm_names(run_configs(runset.runs))


def sweep_axes(runset: RunSet) -> list[str]:
    """The numeric config keys a sweep varied within at least one arm (an arm's own settings are not axes), in
    sorted order. Categorical keys (a model's name, a path) are left out: a numeric key varies with them."""
    configs = run_configs(runset.runs)
    arms = arm_names(configs)
    by_arm: dict[str, list[dict[str, Any]]] = {}
    for run, cfg in configs.items():
        by_arm.setdefault(arms[run], []).append(cfg)
    keys = sorted({k for cfg in configs.values() for k in cfg})
    axes = []
    for key in keys:
        if key in NOT_AXES or ignored_key(key):
            continue
        values = [cfg.get(key) for cfg in configs.values()]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            continue
        if any(len({cfg.get(key) for cfg in arm}) > 1 for arm in by_arm.values()):
            axes.append(key)
    return axes


def arm_order(arm: str) -> tuple[bool, str]:
    """GRPO's arms first, then by name."""
    return (arm.split(" ")[0] != "grpo", arm)


def sweep_cells(gains: pd.DataFrame, axes: list[str]) -> list[tuple[dict[str, Any], pd.DataFrame]]:
    """The sweep's cells: (the axes' values, its runs), one per combination of swept values, in sorted order."""
    if not axes:
        return [({}, gains)]
    return [
        (dict(zip(axes, key if isinstance(key, tuple) else (key,))), part)
        for key, part in gains.groupby(axes, sort=True)
    ]


def cell_name(cell: dict[str, Any]) -> str:
    """A cell of a sweep as a reader names it: a SYNTHETIC intervention by what it is and its dose where it is on
    ("SYNTHETIC flips p=0.2"), any other setting as key=value; a cell whose interventions are all off and that sets
    nothing else says so."""
    parts = [
        f"{SYNTHETIC_KEYS[key]} p={format_value(value)}" if key in SYNTHETIC_KEYS else f"{key}={format_value(value)}"
        for key, value in cell.items()
        if key not in SYNTHETIC_KEYS or float(value)
    ]
    if parts:
        return ", ".join(parts)
    return "no SYNTHETIC intervention" if cell else "every run"


def seed_order(seed: str) -> tuple[bool, int, str]:
    """Numeric seeds in numeric order (a sweep's parts can land in any order), then any other label."""
    return (not seed.isdigit(), int(seed) if seed.isdigit() else 0, seed)


def in_cell(frame: pd.DataFrame, cell: dict[str, Any]) -> pd.Series:
    """Which rows of `frame` hold the cell's value of every axis."""
    inside = pd.Series(True, index=frame.index)
    for key, value in cell.items():
        inside &= frame[key] == value
    return inside
