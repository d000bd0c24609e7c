"""A cold start's recipe: every setting of the SFT that made it but the two that tell a recipe's starts apart.

Start k of a recipe (docs/results/router_starts.sh) draws the built model's weights (`model.init_seed`) and the SFT's
data order (`seed`); everything else (the model, the task, the learning rate, the budget, the batch, the kernels,
the threads, the evaluation that decides when the target is met) is the recipe, and two starts are two draws of one
recipe only when all of it is the same. A result's two-level statistics resample starts as draws of one recipe, so
a report must never pool starts of two recipes as one (`analysis.records`): the cold start records its recipe and
its hash in `cold_start.json`, and every RL run copies them from its start into `summary.json`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from experiments.run.resume import settings

# What is not the recipe: the start's own draws, and where the cold start writes and is watched.
NOT_RECIPE = ("seed", "model.init_seed", "sft.output_dir", "logger.", "hydra.")
COLD_START_FILE = "cold_start.json"


def recipe_of(cfg: DictConfig) -> dict[str, Any]:
    """The recipe of the cold start `cfg` makes: its settings, flat, less `NOT_RECIPE`."""
    return {
        key: value
        for key, value in settings(cfg).items()
        if not any(key == skip or (skip.endswith(".") and key.startswith(skip)) for skip in NOT_RECIPE)
    }


def recipe_sha256(recipe: dict[str, Any]) -> str:
    """The recipe's identity: the sha256 of its settings as sorted JSON."""
    return hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()


def start_recipe(model_path: str | None) -> dict[str, Any]:
    """What an RL run records of its start's recipe (`start_recipe`, `start_recipe_sha256`): read from the cold start's
    `cold_start.json` beside the checkpoint; both None for a model built in code, a checkpoint made elsewhere, or a
    cold start made before starts recorded their recipe."""
    record = Path(model_path) / COLD_START_FILE if model_path else None
    recorded = json.loads(record.read_text(encoding="utf-8")) if record is not None and record.is_file() else {}
    return {"start_recipe": recorded.get("recipe"), "start_recipe_sha256": recorded.get("recipe_sha256")}
