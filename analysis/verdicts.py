"""Arms against a baseline arm, paired over shared (start, seed) units (analysis.statistics), judged as a family:
which runs may pair at all, the comparisons per cell and summary, and the verdict each earns.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from typing import Any, cast

import pandas as pd

from analysis.arms import ARM_KEYS, NOT_AXES, arm_order, seed_order, sweep_cells
from analysis.configs import format_value, ignored_key
from analysis.gains import EXCLUDED, GAIN_MEASURES
from analysis.records import UNKNOWN_RECIPE, UNKNOWN_START, RunSet, run_configs, runs_of
from analysis.statistics import ALPHA, across_starts, compare, holm, smallest_p
from experiments.config import AccuracySummary

DEFAULT_BASELINE = "grpo"
PRIMARY, SECONDARY = "primary", "secondary"  # a comparison's role: in the declared family, or reported beside it


def baseline_arm(gains: pd.DataFrame, baseline: str | None) -> str | None:
    """The arm the others are compared with: `baseline` (refused, naming the arms, when no run has it), else GRPO
    when a run has it, else the first arm in name order; None without runs."""
    arms = sorted(set(gains["arm"]))
    if baseline is not None:
        if baseline not in arms:
            raise ValueError(f"--baseline {baseline!r} is not an arm of these runs; their arms: {', '.join(arms)}")
        return baseline
    if not arms:
        return None
    return DEFAULT_BASELINE if DEFAULT_BASELINE in arms else arms[0]


def check_pairable(runset: RunSet, gains: pd.DataFrame, axes: list[str]) -> None:
    """Refuse (`ValueError`, one line) runs that a comparison would pair although their configs differ beyond their
    arms: within one cell, start and seed, the counted runs must agree in every setting but the arm's own (the
    objective and its settings, replay, routing variant, router switches, the engine's precision), the swept axes and
    what never changes a run's numbers (`load.ignored_key`); `model.path` too where the start's sha256 names it. A
    setting one of two runs lacks altogether was recorded by the other only (added since, to a node the older run
    did not have): not compared. One arm holds at most one run there. Across the starts a cell pools (the recipe's
    view), the runs must agree in the same settings but `model.path`: starts of one recipe, never a start of another
    task or model whose only difference is a categorical key (a dataset's name is no axis)."""
    configs = run_configs(runset.runs)
    recipes = {
        row.run: json.loads(row.start_recipe) for row in runs_of(runset.runs) if row.start_recipe != UNKNOWN_RECIPE
    }
    counted = gains[gains["counted"] != EXCLUDED]
    _check_one_recipe(configs, recipes, counted, axes)
    # (start sha256, seed): text both, which pandas types as any hashable.
    units = cast(Iterable[tuple[tuple[str, str], pd.DataFrame]], counted.groupby(["start_sha256", "seed"], sort=True))
    for (start, seed), part in units:
        for cell, runs in sweep_cells(part, axes):
            twice = runs[runs.duplicated("arm", keep=False)]
            if not twice.empty:
                arm = twice["arm"].iloc[0]
                raise ValueError(
                    f"arm {arm!r} has {int((twice['arm'] == arm).sum())} runs at seed {seed} from start "
                    f"{start[:12] or '(unnamed)'}{_cell_text(cell)} ({', '.join(twice['run'])}): a paired "
                    "comparison takes one run per arm, cell, start and seed"
                )
            first, *others = runs["run"]
            for other in others:
                key, here, there = _first_difference(configs, first, other, axes, path=start == UNKNOWN_START)
                if key is not None:
                    arm = dict(zip(runs["run"], runs["arm"]))
                    raise ValueError(
                        f"runs of seed {seed} from start {start[:12] or '(unnamed)'}{_cell_text(cell)} disagree in "
                        f"{key} beyond their arms: {arm[first]} has {here} ({first}), {arm[other]} {there} "
                        f"({other}); pairing them would compare that setting too: report them apart, or pair "
                        "them with analysis.compare under names that say it"
                    )


def _first_difference(
    configs: dict[str, dict[str, Any]], first: str, other: str, axes: list[str], path: bool
) -> tuple[str | None, str, str]:
    """The first setting (in key order) two runs both recorded with different values, beyond their arms' own
    settings, the swept axes and what never changes a run's numbers; `model.path` only where `path`. (None, "", "")
    when they agree."""

    def settings(run: str) -> dict[str, str]:
        return {
            key: format_value(value)
            for key, value in configs[run].items()
            if not (
                key.startswith(ARM_KEYS)
                or key in axes
                or ignored_key(key)
                or key in NOT_AXES
                or (key == "model.path" and not path)
            )
        }

    mine, theirs = settings(first), settings(other)
    for key in sorted(set(mine) & set(theirs)):
        if mine[key] != theirs[key]:
            return key, mine[key], theirs[key]
    return None, "", ""


def _check_one_recipe(
    configs: dict[str, dict[str, Any]], recipes: dict[str, dict[str, Any]], counted: pd.DataFrame, axes: list[str]
) -> None:
    """Refuse a cell whose named starts' runs differ beyond their arms and `model.path`, or whose starts were made by
    two recipes (`recipes`: each run's start's SFT settings, where its summary holds them; `experiments.run.recipe`):
    a two-level comparison pools starts as draws of one recipe, and a start of another recipe (another task, model,
    SFT learning rate, budget, batch or kernels) is not one."""
    named = counted[counted["start_sha256"] != UNKNOWN_START]
    for cell, part in sweep_cells(named, axes):
        first_runs = part.drop_duplicates("start_sha256")
        if len(first_runs) < 2:
            continue
        first, *others = first_runs["run"]
        start = dict(zip(first_runs["run"], first_runs["start_sha256"]))
        for other in others:
            key, here, there = _first_difference(configs, first, other, axes, path=False)
            if key is not None:
                raise ValueError(
                    f"runs from starts {start[first][:12]} and {start[other][:12]}{_cell_text(cell)} disagree in "
                    f"{key}: {here} ({first}), {there} ({other}); a comparison across starts pools them as starts of "
                    "one recipe, which they are not: report each recipe's runs apart"
                )
        made = [(start[run], recipes[run]) for run in first_runs["run"] if run in recipes]
        for other_start, recipe in made[1:]:
            first_start, first_recipe = made[0]
            differs = next(
                (key for key in sorted({*first_recipe, *recipe}) if first_recipe.get(key, "—") != recipe.get(key, "—")),
                None,
            )
            if differs is not None:
                raise ValueError(
                    f"starts {first_start[:12]} and {other_start[:12]}{_cell_text(cell)} were made by two cold-start "
                    f"recipes (their SFT's {differs}: {first_recipe.get(differs, '—')} and "
                    f"{recipe.get(differs, '—')}); a comparison across starts pools them as draws of one recipe: "
                    "report each recipe's runs apart"
                )


def _cell_text(cell: dict[str, Any]) -> str:
    return "".join(f", {key}={format_value(value)}" for key, value in cell.items())


def _by_unit(rows: pd.DataFrame, measure: str) -> pd.Series:
    """One arm's values of `measure` in one cell, indexed by (start, seed)."""
    values = rows.dropna(subset=[measure]).set_index(["start_sha256", "seed"])[measure]
    if values.index.has_duplicates:
        unit = values.index[values.index.duplicated()][0]
        raise ValueError(
            f"more than one run of arm {rows['arm'].iloc[0]!r} at seed {unit[1]} from start "
            f"{unit[0][:12] or '(unnamed)'}: a paired comparison takes one run per arm, cell, start and "
            "seed"
        )
    return values


def arm_comparisons(
    gains: pd.DataFrame,
    baseline: str | None,
    axes: list[str],
    primary: str = AccuracySummary.gain_area,
    family: Sequence[str] = (),
) -> pd.DataFrame:
    """Per cell, per gain measure (`GAIN_MEASURES`) and per arm other than `baseline`: the paired comparison over the
    (start, seed) units both hold with a counted value (`statistics.compare`; runs whose `counted` is excluded never
    enter) and, where those units span ≥ 2 starts, the comparison across starts (`statistics.across_starts`). One row
    each with the cell's axes, `measure`, `arm`, `baseline`, `role` (primary: `primary` measure and an arm of
    `family`, every arm when empty; else secondary), the numbers and the `verdict`: Holm's correction over the
    primary rows decides theirs (on the start-level test where there are ≥ 2 starts), the secondary rows keep the
    uncorrected rule and say so. Fewer than 2 shared units give a row that says so. `baseline` is None where the runs
    hold no arm (`baseline_arm`)."""
    counted = gains[gains["counted"] != EXCLUDED] if "counted" in gains else gains
    if "start_sha256" not in counted:  # a table from before runs named their start: every run from one, unnamed
        counted = counted.assign(start_sha256=UNKNOWN_START)
    rows = []
    for cell, part in sweep_cells(counted, axes):
        reference = part[part["arm"] == baseline]
        for measure in GAIN_MEASURES:
            base = _by_unit(reference, measure)
            for arm in sorted(set(part["arm"]) - {baseline}, key=arm_order):
                own = _by_unit(part[part["arm"] == arm], measure)
                shared = sorted(set(own.index) & set(base.index), key=lambda unit: (unit[0], seed_order(unit[1])))
                role = PRIMARY if measure == primary and (not family or arm in family) else SECONDARY
                row = {**cell, "measure": measure, "arm": arm, "baseline": baseline, "role": role}
                if len(shared) < 2:
                    rows.append({**row, "seeds": len(shared), "verdict": f"not compared: {len(shared)} shared seed(s)"})
                    continue
                row.update(compare(own[shared].to_numpy(), base[shared].to_numpy()).row())
                differences: dict[str, list[float]] = {}
                for unit in shared:
                    differences.setdefault(unit[0], []).append(own[unit] - base[unit])
                row.update(
                    across_starts(differences).row()
                    if len(differences) >= 2
                    else {
                        "starts": 1,
                        "per_start": f"{shared[0][0][:12] or '?'}: {row['difference_estimate']:+.3f} ({len(shared)})",
                    }
                )
                rows.append(row)
    return _judged(pd.DataFrame(rows))


def _judged(table: pd.DataFrame) -> pd.DataFrame:
    """The verdict of every compared row: the primary rows as a family (Holm), the secondary ones alone."""
    if table.empty or "difference_estimate" not in table:
        return table
    for column in ("starts", "starts_p_value", "starts_difference_low", "starts_difference_high"):
        if column not in table:
            table[column] = math.nan
    compared = table["difference_estimate"].notna()
    across = compared & (table["starts"] >= 2)
    table["decisive_p"] = table["starts_p_value"].where(across, table["p_value"])
    low = table["starts_difference_low"].where(across, table["difference_low"])
    high = table["starts_difference_high"].where(across, table["difference_high"])
    interval_excludes = (low > 0) | (high < 0)
    family = compared & (table["role"] == PRIMARY)
    table["holm_p"] = math.nan
    table.loc[family, "holm_p"] = holm(table.loc[family, "decisive_p"].to_numpy(float))
    decides = table["holm_p"].where(family, table["decisive_p"])
    table["separates"] = (interval_excludes & (decides < ALPHA)).astype(object).where(compared, None)
    size = int(family.sum())
    for i in table.index[compared]:
        table.at[i, "verdict"] = _verdict(table.loc[i], size)
    return table


def _verdict(row: pd.Series, family_size: int) -> str:
    starts = int(row["starts"])
    where = f" across {starts} starts" if starts >= 2 else ""
    if row["role"] == PRIMARY:
        test = f"{'start-level ' if starts >= 2 else ''}Holm p = {row['holm_p']:.3g} over a family of {family_size}"
    else:
        test = f"{'start-level ' if starts >= 2 else ''}p = {row['decisive_p']:.3g}, uncorrected"
    interval = "two-level 95% CI" if starts >= 2 else "95% CI"
    units = starts if starts >= 2 else int(row["seeds"])
    if row["separates"]:
        said = f"separates{where} ({interval} of the difference excludes 0; {test})"
    elif row["role"] == PRIMARY and smallest_p(units) < ALPHA <= smallest_p(units, family_size):
        said = (
            f"not distinguishable{where} ({test}; with {units} {'starts' if starts >= 2 else 'seeds'} and a family "
            f"of {family_size} the smallest Holm p any comparison can reach is "
            f"{smallest_p(units, family_size):.3g}: this design cannot separate, whatever the data)"
        )
    elif starts >= 2 and smallest_p(starts) >= ALPHA:
        said = (
            f"not distinguishable{where} ({test}; with {starts} starts no start-level test reaches p < "
            f"{ALPHA:g}: at least 6 are needed)"
        )
    elif starts >= 2:
        said = f"not distinguishable{where} ({test})"
    elif math.isinf(row["detectable"]):
        said = (
            f"not distinguishable ({test}; with {int(row['seeds'])} seeds no paired test reaches p < {ALPHA:g}: "
            "at least 6 are needed)"
        )
    else:
        said = (
            f"not distinguishable ({test}; with {int(row['seeds'])} seeds the smallest effect this could detect "
            f"is {row['detectable']:.3f})"
        )
    return said if row["role"] == PRIMARY else f"secondary: {said}"
