"""Which starts of each cold-start recipe a report's runs come from, and why a start inside that range is not there.

docs/results/router_starts.sh makes start k of recipe NAME at `NAME` (k = 0) or `NAME-startk`; a study's command
takes the starts from some k on and replaces one that missed its SFT's target (`reached_target` false in its
`cold_start.json`) by the next number. A report that pools the starts says which numbers it pools and, for each
number skipped between the first and the last, what the skipped start's own record says: that its SFT missed the
target, that it reached it (so something else left it out), that it does not say, or that its folder is not on this
machine. Nothing is read but the runs' recorded `model.path` and the `cold_start.json` beside each start.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

_START = re.compile(r"^(?P<recipe>.+?)(?:-start(?P<k>[1-9]\d*))?$")  # NAME (start 0) or NAME-startK


def start_of(path: str) -> tuple[Path, int]:
    """The recipe's start 0 folder and the start number of a start's folder (`.../NAME-start3` → `.../NAME`, 3)."""
    folder = Path(path.rstrip("/"))
    match = _START.match(folder.name)
    assert match is not None  # the pattern matches any non-empty name
    return folder.with_name(match["recipe"]), int(match["k"] or 0)


def start_folder(recipe: Path, k: int) -> Path:
    """Where start `k` of `recipe` (its start 0 folder) lives."""
    return recipe if k == 0 else recipe.with_name(f"{recipe.name}-start{k}")


def numbers_text(numbers: Iterable[int]) -> str:
    """Start numbers as runs: 3, 4, 6-13."""
    runs: list[list[int]] = []
    for k in sorted(set(numbers)):
        if runs and k == runs[-1][-1] + 1:
            runs[-1].append(k)
        else:
            runs.append([k])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs)


def why_not_among(recipe: Path, k: int) -> str:
    """What start `k`'s own record says of it, as the reason it is not among the runs' starts."""
    record = start_folder(recipe, k) / "cold_start.json"
    if not record.is_file():
        return f"start {k} is not on this machine (no cold_start.json in {record.parent})"
    summary = json.loads(record.read_text(encoding="utf-8"))
    reached, target = summary.get("reached_target"), summary.get("target_accuracy")
    accuracy = summary.get("eval_greedy_accuracy")
    if reached is False:
        said = f" ({accuracy:.1%} held-out greedy against {target:.0%})" if accuracy is not None and target else ""
        return f"start {k} missed its SFT's target{said}, so the next number stands in for it"
    if reached is True:
        return f"start {k} reached its SFT's target, yet no run here starts from it"
    return f"start {k}'s cold_start.json does not say whether it reached its target, and no run here starts from it"


def recipe_starts_sentence(configs: Iterable[Mapping[str, Any]]) -> str:
    """One sentence on the starts of each recipe the runs come from (empty when they name no start folder): the
    numbers, then each number skipped between the first and the last, with why."""
    numbers: dict[Path, set[int]] = {}
    for config in configs:
        path = config.get("model.path")
        if isinstance(path, str) and path:
            recipe, k = start_of(path)
            numbers.setdefault(recipe, set()).add(k)
    parts = []
    for recipe, used in sorted(numbers.items()):
        skipped = sorted(set(range(min(used), max(used) + 1)) - used)
        reasons = "".join(f"; {why_not_among(recipe, k)}" for k in skipped)
        parts.append(f"`{recipe.name}` start{'s' if len(used) > 1 else ''} {numbers_text(used)}{reasons}")
    return f"Starts by recipe (docs/results/router_starts.sh's numbers): {'. '.join(parts)}." if parts else ""
