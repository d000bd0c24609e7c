"""Checkpoints for exact resume: a run killed after two hours continues where its last checkpoint left it.

`trainer.checkpoint_every=k` writes, after every k-th step's log line, `checkpoints/step_<k>/` in the run
directory:
    state/            model and optimizer, with `torch.distributed.checkpoint` (sharded over ranks under FSDP2,
                      one process otherwise): tensors only, loaded without pickle code execution
    trainer.json      step and token counters, skipped updates, the scheduler's state, the config that matters
    rng_rank<r>.pt    every random generator of rank r (torch's, the prompt sampler's, the engine's router noise),
                      loaded with `weights_only=True`
It is written into `step_<k>.tmp/` and renamed into place once every rank is done, so a crash while writing leaves
the previous checkpoint whole; `trainer.keep_checkpoints` bounds how many stay.

`resume=auto` continues from the newest intact checkpoint in the run directory (a fresh start when there is none),
saying which newer ones it passed over and why; `resume=/path/to/step_<k>` from that one. Every file a checkpoint is
loaded from is checked before any is loaded (`damage`): a deleted or truncated file (a copy cut short, a full disk)
is refused in one line naming it, and never leaves a trainer half restored. A checkpoint of another experiment
(model shape, objective, batch, task, seed, ...) is refused, naming what differs. The run's `metrics.jsonl` is cut
back to the checkpoint's step, so no line is logged twice, and W&B continues the same run.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig, OmegaConf
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from experiments.run.launch import barrier, broadcast
from experiments.step.metrics import STEP
from experiments.step.trainer import Ranks
from models.registry import ConfigError

DIRECTORY = "checkpoints"
PREFIX = "step_"
# What a resumed run must share with the run that wrote the checkpoint: what the saved state means. Run length,
# logging, evaluation and checkpointing may change.
EXPERIMENT_KEYS = ("algo", "model", "dataset", "correction", "rollout", "routing.replay", "routing_variant", "seed",
                   "trainer.prompts_per_step", "trainer.group_size", "trainer.minibatches", "trainer.max_new_tokens",
                   "trainer.temperature", "trainer.pi_old", "trainer.minibatch_layout", "trainer.lr",
                   "trainer.router_lr_scale", "trainer.lr_schedule", "trainer.warmup_steps", "trainer.weight_decay",
                   "trainer.adam_beta1", "trainer.adam_beta2", "trainer.grad_clip", "routers")


def experiment(cfg: DictConfig) -> dict[str, Any]:
    """The flat `{key: value}` of the config that a checkpoint's state depends on (`EXPERIMENT_KEYS`)."""
    flat: dict[str, Any] = {}
    for key in EXPERIMENT_KEYS:
        value = OmegaConf.select(cfg, key)
        if key == "routing_variant" and (value is None or value.name == "none"):
            continue  # runs from before routing variants existed ran without one: the same experiment as `none`
        if key == "routers" and not value:
            continue  # no router switch on, as every run from before they existed
        if isinstance(value, DictConfig):
            for sub, item in OmegaConf.to_container(value, resolve=True, enum_to_str=True).items():
                flat[f"{key}.{sub}"] = item
        else:
            flat[key] = str(value) if hasattr(value, "value") else value
    return flat


def step_of(path: Path) -> int:
    return int(path.name.removeprefix(PREFIX))


def checkpoints(run_dir: Path) -> list[Path]:
    """The complete checkpoints of `run_dir`, oldest first (an interrupted write's `.tmp` is not one)."""
    root = run_dir / DIRECTORY
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()]
    return sorted(found, key=step_of)


def save(trainer: Any, run_dir: Path, keep: int) -> Path:
    """Write the trainer's state after its current step (every rank calls this); return the checkpoint's path."""
    ranks: Ranks = trainer.ranks
    final = run_dir / DIRECTORY / f"{PREFIX}{trainer.step_index:06d}"
    partial = final.with_name(final.name + ".tmp")
    if ranks.main:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    barrier(ranks)
    model_state, optimizer_state = get_state_dict(trainer.model, trainer.optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(partial / "state"),
             no_dist=not ranks.active)
    torch.save(_generators(trainer), partial / f"rng_rank{ranks.rank}.pt")
    (partial / f"python_random_rank{ranks.rank}.json").write_text(json.dumps(random.getstate()))
    if ranks.main:
        (partial / "trainer.json").write_text(json.dumps({
            "step": trainer.step_index,
            "tokens_seen": trainer.tokens_seen,
            "skipped_updates": trainer.skipped_updates,
            "consecutive_skips": trainer.consecutive_skips,
            "scheduler": trainer.scheduler.state_dict(),
            "experiment": experiment(trainer.cfg),
            "world": ranks.world,
        }, indent=1, default=str))
    barrier(ranks)
    if ranks.main:
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        for old in checkpoints(run_dir)[:-keep] if keep else []:
            shutil.rmtree(old)
    barrier(ranks)
    return final


def _generators(trainer: Any) -> dict[str, torch.Tensor]:
    return {"torch": torch.get_rng_state(), "sampler": trainer.generator.get_state(), "noise": trainer.engine.noise.get_state()}


TRAINER_KEYS = ("step", "tokens_seen", "skipped_updates", "consecutive_skips", "scheduler", "experiment", "world")
RANK_GENERATORS = ("torch", "sampler", "noise")


def find(run_dir: Path, resume: str) -> tuple[Path | None, list[str]]:
    """The checkpoint `resume` asks for, intact (`damage`), and the damage of the newer ones it passed over: with
    `auto`, the newest intact checkpoint of the run (None when the run has none at all); with a path, that one.
    `ConfigError` naming the damaged file when there is no intact one to take."""
    if resume == "auto":
        passed_over = []
        for candidate in reversed(checkpoints(run_dir)):
            problem = damage(candidate)
            if problem is None:
                return candidate, passed_over
            passed_over.append(problem)
        if passed_over:
            raise ConfigError(f"resume=auto finds no intact checkpoint in {run_dir / DIRECTORY}: {len(passed_over)} "
                              f"damaged, the newest because {passed_over[0]}")
        return None, []
    path = Path(resume).expanduser()
    lacking = [part for part in (path / "trainer.json", path / "state") if not part.exists()]
    if lacking:
        raise ConfigError(f"resume={resume!r} holds no checkpoint: {lacking[0]} is missing (a "
                          f"{DIRECTORY}/{PREFIX}<step> directory holds trainer.json and state/); use resume=auto or "
                          "point at one")
    problem = damage(path)
    if problem is not None:
        raise ConfigError(f"resume={resume!r} is a damaged checkpoint: {problem}; resume=auto takes the newest intact "
                          "one")
    return path, []


def damage(path: Path) -> str | None:
    """What makes the checkpoint at `path` unloadable, naming the file, or None when it is intact: every file `load`
    reads is there and reads, and every tensor file is as long as the state's index needs. Checked before anything is
    loaded, so that a damaged checkpoint never leaves a trainer half restored."""
    try:
        saved = json.loads((path / "trainer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        return f"{path / 'trainer.json'} does not read ({_reason(error)})"
    missing = [key for key in TRAINER_KEYS if key not in saved] if isinstance(saved, dict) else list(TRAINER_KEYS)
    if missing:
        return f"{path / 'trainer.json'} lacks {', '.join(missing)}"
    for rank in range(saved["world"]):
        problem = _rank_damage(path, rank)
        if problem is not None:
            return problem
    return _state_damage(path / "state")


def _rank_damage(path: Path, rank: int) -> str | None:
    """What is wrong with rank `rank`'s random generator files, or None."""
    generators = path / f"rng_rank{rank}.pt"
    try:
        loaded = torch.load(generators, weights_only=True)
    except Exception as error:  # a truncated file fails anywhere in torch's zip and unpickling readers, with any type
        return f"{generators} does not load ({_reason(error)})"
    if not isinstance(loaded, dict) or set(loaded) != set(RANK_GENERATORS):
        return f"{generators} does not hold the generators {', '.join(RANK_GENERATORS)}"
    python_random = path / f"python_random_rank{rank}.json"
    try:
        state = json.loads(python_random.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        return f"{python_random} does not read ({_reason(error)})"
    if not isinstance(state, list) or len(state) != 3:
        return f"{python_random} is not a state of Python's random module"
    return None


def _state_damage(state: Path) -> str | None:
    """What is wrong with the model and optimizer state written by `torch.distributed.checkpoint`, or None: its index
    (`.metadata`) must read, and every file the index points into must be as long as the index needs."""
    try:
        index = FileSystemReader(str(state)).read_metadata()
    except Exception as error:  # a truncated index fails in torch's unpickling with whatever type it meets first
        return f"{state / '.metadata'} does not read ({_reason(error)})"
    needed: dict[str, int] = {}
    for item in index.storage_data.values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    for name, size in sorted(needed.items()):
        try:
            held = (state / name).stat().st_size
        except OSError as error:
            return f"{state / name} does not read ({_reason(error)})"
        if held < size:
            return f"{state / name} holds {held} of the {size} bytes its index needs"
    return None


def _reason(error: BaseException) -> str:
    """An error's reason in a few words: the OS's, or the exception's type and first line."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def check(path: Path, cfg: DictConfig, ranks: Ranks) -> dict[str, Any]:
    """The checkpoint's trainer.json, after refusing one written by another experiment or another number of ranks."""
    saved = json.loads((path / "trainer.json").read_text())
    ours = experiment(cfg)
    differs = [f"{key}={saved['experiment'].get(key)!r} there, {value!r} here"
               for key, value in ours.items() if saved["experiment"].get(key) != value]
    if differs:
        raise ConfigError(f"checkpoint {path} is of another experiment: {'; '.join(differs[:4])}"
                          + (f" (and {len(differs) - 4} more)" if len(differs) > 4 else ""))
    if saved["world"] != ranks.world:
        raise ConfigError(f"checkpoint {path} was written by {saved['world']} ranks, this run has {ranks.world}: "
                          "resume with as many (each rank's sampling continues from its own seed)")
    return saved


def load(trainer: Any, path: Path) -> None:
    """Restore the trainer's state from the checkpoint at `path` (every rank calls this)."""
    ranks: Ranks = trainer.ranks
    saved = broadcast(check(path, trainer.cfg, ranks) if ranks.main else None, ranks)
    model_state, optimizer_state = get_state_dict(trainer.model, trainer.optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(path / "state"), no_dist=not ranks.active)
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    trainer.scheduler.load_state_dict(saved["scheduler"])
    trainer.step_index = saved["step"]
    trainer.tokens_seen = saved["tokens_seen"]
    trainer.skipped_updates = saved["skipped_updates"]
    trainer.consecutive_skips = saved["consecutive_skips"]
    generators = torch.load(path / f"rng_rank{ranks.rank}.pt", weights_only=True)
    torch.set_rng_state(generators["torch"])
    trainer.generator.set_state(generators["sampler"])
    trainer.engine.noise.set_state(generators["noise"])
    state = json.loads((path / f"python_random_rank{ranks.rank}.json").read_text())
    random.setstate((state[0], tuple(state[1]), state[2]))
    trainer.engine.sync_weights(trainer.model)


def cut_log(metrics: Path, step: int) -> int:
    """Keep the lines of `metrics.jsonl` up to `step` (a resumed run logs the later ones again); return how many
    were dropped."""
    if not metrics.exists():
        return 0
    kept, dropped = [], 0
    for line in metrics.read_text(encoding="utf-8").splitlines():
        try:
            logged = json.loads(line).get(STEP)
        except ValueError:
            dropped += 1  # a line cut by the kill
            continue
        if isinstance(logged, int) and logged <= step:
            kept.append(line)
        else:
            dropped += 1
    metrics.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    return dropped
