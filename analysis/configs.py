"""What a run's config says it is: its settings flat, in today's keys, which of them say what it computes, and the
label its series is drawn under.

A series is "grouped by what differs": the label of a run names its algorithm, its replay mode when not `none`, and
every other config key that separates runs which would otherwise share a label (seeds are not such a key: runs that
differ only in seed, paths or logging are the seeds of one series).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, cast

from omegaconf import OmegaConf

from experiments.config import TrainConfig
from experiments.run.resume import in_todays_terms, node_recorded, retired_as_today

# Config keys that never separate series: seeds are aggregated; logging, threads, checkpointing and the comparison an
# experiment declares (how its report decides) do not change what a run computes. Everything else does (a checkpoint
# path, a data file), so runs that differ there are never merged.
_IGNORED_PREFIXES = ("hydra.", "logger.", "wandb.", "comparison.")
_IGNORED_KEYS = frozenset(
    {
        "seed",
        "trainer.threads",
        "trainer.save_checkpoint",
        "trainer.checkpoint_every",
        "trainer.keep_checkpoints",
        "resume",
    }
)
_OUTPUT_LEAF = re.compile(r"^(.*_dir|dir|output.*)$")  # where results go, never what they are computed from


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config → `{"a.b.c": value}`. Lists become their JSON text so that values stay comparable."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_config(value, prefix=f"{name}."))
        elif isinstance(value, (list, tuple)):
            flat[name] = json.dumps(value, sort_keys=True, default=str)
        else:
            flat[name] = value
    return flat


def schema_defaults() -> dict[str, Any]:
    """Today's default of every key of the typed schema, flat, for configs written before the key existed."""
    schema = OmegaConf.to_container(OmegaConf.structured(TrainConfig), throw_on_missing=False)
    flat = flatten_config(cast(dict[str, Any], schema))  # a structured config's container is a dict of its fields
    return {k: v for k, v in flat.items() if v != "???"}


def as_today(flat: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """A recorded flat config in today's keys, by the rules resume applies (`experiments.run.resume`): the settings
    that took over from retired ones as the run's said them (`in_todays_terms`: its `rollout.source` from its
    `rollout.lag` and `rollout.concurrent`), every other setting added to one of its nodes since it was written at the
    schema's default (what the run computed with), and every setting retired since dropped where it holds the value
    that means what today's config does without it (`RETIRED`). Without this, a field added or retired between two
    parts of a sweep splits its series by the key's absence alone."""
    flat = in_todays_terms(flat)
    added = {key: value for key, value in defaults.items() if key not in flat and node_recorded(flat, key)}
    kept = {key: value for key, value in flat.items() if not retired_as_today(key, value)}
    return {**kept, **added}


def ignored_key(key: str) -> bool:
    """Keys that say where a run writes or how it runs (seeds, threads, logging), never what it computes."""
    return key.startswith(_IGNORED_PREFIXES) or key in _IGNORED_KEYS or bool(_OUTPUT_LEAF.match(key.rsplit(".", 1)[-1]))


def short_key(key: str, all_keys: Iterable[str]) -> str:
    """Shortest dotted suffix of `key` that no other key ends with (`trainer.lr` → `lr` unless `optim.lr` exists)."""
    parts = key.split(".")
    others = [k for k in all_keys if k != key]
    for n in range(1, len(parts) + 1):
        suffix = ".".join(parts[-n:])
        if not any(k == suffix or k.endswith("." + suffix) for k in others):
            return suffix
    return key


def format_value(value: Any, key: str = "") -> str:
    """A config value as a label or table shows it: floats short, a path by its last part."""
    if isinstance(value, float):
        return f"{value:g}"
    if key.endswith("path") and isinstance(value, str) and "/" in value:
        return Path(value).name  # a start's own directory name: the same on every machine, unlike where it lives
    return str(value)


FLIP_RATE = "routing.flip_rate"  # the config key of the SYNTHETIC flips (models/routing.py): named in every label
PERTURB_RATE = "routing.perturb_rate"  # the SYNTHETIC router noise's (models/routing/perturbation.py): likewise
CORRECTION = "correction.name"  # the rollout correction: named in every label where it is on
PI_OLD = "trainer.pi_old"  # where π_old comes from: named where it is the engine's (bypass)
SYNTHETIC_KEYS = {FLIP_RATE: "SYNTHETIC flips", PERTURB_RATE: "SYNTHETIC router noise"}  # key: what a label calls it


_START_SUFFIX = re.compile(r"-start\d+$")  # start k >= 1 of a recipe (docs/results/router_starts.sh)


def _recipe_of(value: Any, key: str) -> Any:
    """A start's path as the recipe it is a start of (`.../NAME-start3` → `.../NAME`); any other value as it is."""
    if key == "model.path" and isinstance(value, str):
        return _START_SUFFIX.sub("", value.rstrip("/"))
    return value


def label_runs(configs: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """Readable series label per run from its flattened config.

    The base is `method_name` (the objective, its replay, routing variant, correction and router switches, and
    whether π_old is the engine's),
    ` + SYNTHETIC flips p=<p>` when `routing.flip_rate` is not 0 and ` + SYNTHETIC router noise p=<p>` when
    `routing.perturb_rate` is not 0. Then, in sorted key order, every
    config key that differs between runs (ignoring seeds, threads, checkpointing, output dirs, logger/W&B/Hydra
    keys; a checkpoint or data path does count, shown by its last part: a start's directory name, except that the
    starts of one recipe, `NAME` and `NAME-startK` as docs/results/router_starts.sh makes them, are one series whose
    band spans them) and still
    splits runs sharing a label so far is appended to all labels as `key=value`, with the shortest unambiguous
    key suffix. Keys that only restate the algorithm (its clip range, say) therefore never clutter a label.
    """
    labels = {run: _base_label(cfg) for run, cfg in configs.items()}
    configs = {run: {key: _recipe_of(value, key) for key, value in cfg.items()} for run, cfg in configs.items()}
    all_keys = sorted({k for cfg in configs.values() for k in cfg})
    candidates = [
        k
        for k in all_keys
        if k not in ("algo.name", "routing.replay", "routing_variant.name", CORRECTION, *SYNTHETIC_KEYS)
        and not ignored_key(k)
        and len({format_value(cfg.get(k, "—"), k) for cfg in configs.values()}) > 1
    ]
    for key in candidates:
        groups: dict[str, set[str]] = {}
        for run, cfg in configs.items():
            groups.setdefault(labels[run], set()).add(format_value(cfg.get(key, "—"), key))
        if any(len(values) > 1 for values in groups.values()):
            short = short_key(key, all_keys)
            labels = {run: f"{labels[run]}, {short}={format_value(configs[run].get(key, '—'), key)}" for run in configs}
    return labels


def method_name(cfg: Mapping[str, Any]) -> str:
    """The objective, then ` + <routing.replay>`, ` + <routing_variant.name>` and ` + <correction.name>` where they are
    on (a run from before variants or corrections existed ran without one), then ` + <switch>` for each router switch
    on (`routers.<switch>.name`), and ` (π_old = μ_old)` where π_old is asked to be the engine's own log-probs
    (`trainer.pi_old=bypass`: under a lag, the naive asynchronous arm): what a series and an arm are named by first."""
    name = str(cfg.get("algo.name", "unknown"))
    for key in ("routing.replay", "routing_variant.name", CORRECTION):
        if str(cfg.get(key, "none")) != "none":
            name += f" + {cfg[key]}"
    name += "".join(f" + {cfg[key]}" for key in cfg if key.startswith("routers.") and key.endswith(".name"))
    return name + (" (π_old = μ_old)" if cfg.get(PI_OLD) == "bypass" else "")


def _base_label(cfg: Mapping[str, Any]) -> str:
    label = method_name(cfg)
    for key, called in SYNTHETIC_KEYS.items():  # an intervention, never to be read as a natural regime
        if float(cfg.get(key, 0.0)):
            label += f" + {called} p={float(cfg[key]):g}"
    return label
