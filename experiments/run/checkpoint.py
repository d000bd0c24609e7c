"""Checkpoints for exact resume: a run killed after two hours continues where its last checkpoint left it.

`trainer.checkpoint_every=k` writes, after every k-th step's log line and after the run's last step,
`checkpoints/step_<k>/` in the run directory:
    state/            model and optimizer, with `torch.distributed.checkpoint` (sharded over ranks under FSDP2,
                      one process otherwise), and the weight versions the rollout source keeps beyond the trainer's
                      (`RolloutSource.held`: the lagged source's, which its engine will still sample with; full
                      weights, the same on every rank): its index
                      (`.metadata`) and the optimizer's hyperparameters are pickles, read as data only
                      (`read_index`, `_DataPlanner`): a checkpoint is never code
    rng_rank<r>.pt    every random generator of rank r (torch's, the prompt sampler's, the rollout source's: its
                      engine's router noise),
                      loaded with `weights_only=True`
    trainer.json      step and token counters, skipped updates, the scheduler's state, every setting of the run,
                      the environments its steps were computed under, and the sha256 of every other file `load`
                      reads (`files`), written last, by rank 0, once every rank's files are written
It is written into `step_<k>.tmp/`, every file flushed to the disk, checked whole (`damage`), and only then renamed
into place; only then are older checkpoints rotated out: of the intact ones older than it, those beyond the newest
`trainer.keep_checkpoints` (it counted among them), each renamed to `step_<k>.deleting` before it is deleted. A kill
at any instant leaves every checkpoint under its own name whole; a resume removes what a kill left of a partial or a
deleted one. A write that fails (a full disk, also inside `torch.save`) removes the partial checkpoint and raises
`StorageError` on every rank, naming why.

`resume=auto` continues from the newest intact checkpoint in the run directory (a fresh start when there is none),
saying which newer ones it passed over and why; `resume=/path/to/step_<k>` from that one. Every file a checkpoint is
loaded from is checked before any is loaded (`damage`): a deleted or truncated file (a copy cut short, a full disk),
one whose bytes are not those it was written with (its sha256), or a `trainer.json` whose values are not what a
checkpoint records, is refused in one line naming it, and never leaves a trainer half restored. A checkpoint of
another experiment (any setting but the few `experiments.run.resume` declares safe to change) is refused, naming what
differs. Checkpoints later than the one a run resumes from are set aside, never deleted, under names no scan reads as
a checkpoint: a damaged one as `step_<k>.damaged`, an intact one (of the continuation that a resume from an earlier
checkpoint abandons) as `step_<k>.superseded`. The run's `metrics.jsonl` is cut back to the checkpoint's step, so no
line is logged twice, and W&B continues the same run.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import random
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, cast

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from experiments.ranks import Ranks, barrier, gather_objects
from experiments.run import provenance
from experiments.run.resume import described, differences, length_change, settings
from experiments.run.rundir import SUMMARY_FILE, StorageError, replace_file, sync_directory
from experiments.step.engines import full_weights
from experiments.step.metrics import STEP
from models.registry import ConfigError
from models.routing.predictor import without_predictors

DIRECTORY = "checkpoints"
PREFIX = "step_"
PARTIAL = ".tmp"  # a checkpoint being written
DAMAGED = ".damaged"  # set aside at resume: it does not load
SUPERSEDED = ".superseded"  # set aside at resume: later than the checkpoint the run went back to
DELETING = ".deleting"  # rotated out: renamed first, so that a kill while it is deleted leaves no checkpoint half gone
ENGINE_VERSIONS = "engine_versions"  # the rollout source's weight versions (lagged), in trainer.json and the state
# A version's key in the state: not a bare number, which Distributed Checkpoint would read back as a list index.
VERSION_PREFIX = "version_"


def step_of(path: Path) -> int:
    return int(path.name.removeprefix(PREFIX))


def checkpoints(run_dir: Path) -> list[Path]:
    """The checkpoints of `run_dir`, oldest first (not a partial one, nor one set aside)."""
    root = run_dir / DIRECTORY
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX) :].isdigit()]
    return sorted(found, key=step_of)


def save(trainer: Any, run_dir: Path, keep: int) -> Path:
    """Write the trainer's state after its current step (every rank calls this); return the checkpoint's path."""
    ranks: Ranks = trainer.ranks
    final = run_dir / DIRECTORY / f"{PREFIX}{trainer.step_index:06d}"
    partial = final.with_name(final.name + PARTIAL)
    together = _Together(ranks, final, partial)
    together(lambda: _empty_directory(partial) if ranks.main else None)
    together(lambda: _write(trainer, partial))
    together(lambda: _publish(trainer, partial, final, keep) if ranks.main else None)
    return final


class _Together:
    """One phase of a checkpoint's write on every rank: a rank's failure to write (`OSError`, also inside
    `torch.distributed.checkpoint`) or a problem it finds is every rank's, which all raise `StorageError` after the
    partial checkpoint is removed; no rank is left waiting for another that gave up."""

    def __init__(self, ranks: Ranks, final: Path, partial: Path) -> None:
        self.ranks, self.final, self.partial = ranks, final, partial

    def __call__(self, phase: Callable[[], str | None]) -> None:
        try:
            problem = phase()
        except OSError as error:
            problem = _reason(error)
        except CheckpointException as error:
            causes = [_write_failure(failure[0]) for failure in error.failures.values()]
            if not all(causes):
                raise  # a bug, not the disk: its traceback
            problem = causes[0]
        problems = [p for p in gather_objects(problem, self.ranks) if p is not None]
        if not problems:
            return
        if self.ranks.main:
            shutil.rmtree(self.partial, ignore_errors=True)
        earlier = [p.name for p in checkpoints(self.final.parent.parent) if p != self.final]
        kept = f"{earlier[-1]} is the newest checkpoint" if earlier else "there is no earlier checkpoint"
        raise StorageError(
            f"cannot write checkpoint {self.final.name} in {self.final.parent}: {problems[0]}; the "
            f"partial one was removed, and {kept}"
        )


def _write_failure(cause: BaseException) -> str | None:
    """Why a file of the checkpoint could not be written, or None when `cause` is not a write failure (a bug). torch's
    zip writer (`torch.save`, which Distributed Checkpoint writes each tensor with) turns the `OSError` of a full disk
    into `RuntimeError: ... unexpected pos`, the `OSError` kept as its context."""
    if isinstance(cause, OSError):
        return _reason(cause)
    if isinstance(cause, RuntimeError) and "unexpected pos" in str(cause):
        if isinstance(cause.__context__, OSError):
            return _reason(cause.__context__)
        return "the file stopped growing while torch wrote it (a full disk?)"
    return None


def _empty_directory(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)


def _write(trainer: Any, partial: Path) -> None:
    """This rank's files of the checkpoint but `trainer.json`, each flushed to the disk (torch's writer flushes the
    state's own)."""
    ranks: Ranks = trainer.ranks
    model_state, optimizer_state = get_state_dict(trainer.model, trainer.optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
    held = trainer.rollouts.held()
    if held:
        state[ENGINE_VERSIONS] = {version_key(version): weights for version, weights in held.items()}
    dcp.save(state, checkpoint_id=str(partial / "state"), no_dist=not ranks.active)
    generators = io.BytesIO()
    torch.save(_generators(trainer), generators)
    replace_file(partial / f"rng_rank{ranks.rank}.pt", generators.getvalue())
    replace_file(partial / f"python_random_rank{ranks.rank}.json", json.dumps(random.getstate()))


def _write_trainer(trainer: Any, partial: Path) -> None:
    """(rank 0, once every rank's files are written) `trainer.json`, with the sha256 of every file `load` reads."""
    held = sorted(trainer.rollouts.held())
    replace_file(
        partial / "trainer.json",
        json.dumps(
            {
                "step": trainer.step_index,
                "tokens_seen": trainer.tokens_seen,
                "skipped_updates": trainer.skipped_updates,
                "consecutive_skips": trainer.consecutive_skips,
                "scheduler": trainer.scheduler.state_dict(),
                "experiment": settings(trainer.cfg),
                "world": trainer.ranks.world,
                "computed_under": computed_under(trainer),
                "files": {name: _sha256(partial / name) for name in files_read(partial, trainer.ranks.world)},
                **({ENGINE_VERSIONS: held} if held else {}),
            },
            indent=1,
            default=str,
        ),
    )


def computed_under(trainer: Any) -> list[dict[str, Any]]:
    """The environments (versions, kernels, threads) the trainer's steps were computed under, from which step on
    (`experiments.run.provenance`): those its checkpoint recorded and this process's, when it resumed (`load`), or
    this process's alone."""
    return trainer.computed_under or provenance.from_the_start(trainer.cfg.cpu_kernels, trainer.cfg.trainer.threads)


def _publish(trainer: Any, partial: Path, final: Path, keep: int) -> str | None:
    """Write `trainer.json`, check the written checkpoint whole, rename it into place, then rotate out the older ones;
    or say why not."""
    _write_trainer(trainer, partial)
    problem = damage(partial)
    if problem is not None:
        return f"it does not read back: {problem}"
    sync_directory(partial / "state")
    sync_directory(partial)
    if final.exists():  # not a checkpoint a resume set aside: never deleted unread
        _set_aside(final, SUPERSEDED)
    partial.rename(final)
    sync_directory(final.parent)
    _rotate(final, keep)
    return None


def _rotate(newest: Path, keep: int) -> None:
    """Delete the intact checkpoints older than `newest` beyond the `keep` newest (`newest` counted). Damaged ones are
    not counted, and later ones are not touched."""
    older = [p for p in checkpoints(newest.parent.parent) if step_of(p) < step_of(newest) and damage(p) is None]
    for old in older[: max(0, len(older) - (keep - 1))]:
        doomed = old.with_name(old.name + DELETING)
        old.rename(doomed)  # first: a kill during the deletion leaves a name no scan reads, which a resume removes
        sync_directory(old.parent)
        shutil.rmtree(doomed)


def _set_aside(path: Path, suffix: str) -> Path:
    """Rename the checkpoint at `path` to a name no scan reads as a checkpoint (numbered when taken); return it."""
    aside, number = path.with_name(path.name + suffix), 2
    while aside.exists():
        aside, number = path.with_name(f"{path.name}{suffix}-{number}"), number + 1
    path.rename(aside)
    return aside


def set_aside_after(run_dir: Path, step: int) -> list[str]:
    """Set aside every checkpoint of `run_dir` later than `step`, the one a run resumes from: a damaged one (which
    rotation would never count) and an intact one of the continuation the resume abandons (its log lines are cut).
    Return what each became. Partial ones, whose write a kill cut, are removed: they were never checkpoints; so are
    the remains of one whose deletion by rotation a kill cut."""
    for unfinished in (
        *(run_dir / DIRECTORY).glob(f"{PREFIX}*{PARTIAL}"),
        *(run_dir / DIRECTORY).glob(f"{PREFIX}*{DELETING}"),
    ):
        shutil.rmtree(unfinished)
    moved = []
    for later in checkpoints(run_dir):
        if step_of(later) > step:
            aside = _set_aside(later, DAMAGED if damage(later) is not None else SUPERSEDED)
            moved.append(f"{later.name} as {aside.name}")
    return moved


def _generators(trainer: Any) -> dict[str, torch.Tensor]:
    return {
        "torch": torch.get_rng_state(),
        "sampler": trainer.generator.get_state(),
        **{name: generator.get_state() for name, generator in trainer.rollouts.generators().items()},
    }


def version_key(version: int) -> str:
    return f"{VERSION_PREFIX}{version}"


TRAINER_KEYS = ("step", "tokens_seen", "skipped_updates", "consecutive_skips", "scheduler", "experiment", "world")
# The trainer's own random streams, in every rank's generator file; beside them, those of what samples in the trainer's
# process, by the source's names (`RolloutSource.generators`: the engine's router noise; none for a worker's source).
RANK_GENERATORS = ("torch", "sampler")


def find(run_dir: Path, resume: str) -> tuple[Path | None, list[str]]:
    """The checkpoint `resume` asks for, intact (`damage`), and the damage of the newer ones it passed over: with
    `auto`, the newest intact checkpoint of the run (None when the run has none at all); with a path, that one.
    `ConfigError` naming the damaged file when there is no intact one to take."""
    if resume == "auto":
        passed_over: list[str] = []
        for candidate in reversed(checkpoints(run_dir)):
            problem = damage(candidate)
            if problem is None:
                return candidate, passed_over
            passed_over.append(problem)
        if passed_over:
            raise ConfigError(
                f"resume=auto finds no intact checkpoint in {run_dir / DIRECTORY}: {len(passed_over)} "
                f"damaged, the newest because {passed_over[0]}"
            )
        return None, []
    path = Path(resume).expanduser()
    lacking = [part for part in (path / "trainer.json", path / "state") if not part.exists()]
    if lacking:
        raise ConfigError(
            f"resume={resume!r} holds no checkpoint: {lacking[0]} is missing (a "
            f"{DIRECTORY}/{PREFIX}<step> directory holds trainer.json and state/); use resume=auto or "
            "point at one"
        )
    problem = damage(path)
    if problem is not None:
        raise ConfigError(
            f"resume={resume!r} is a damaged checkpoint: {problem}; resume=auto takes the newest intact one"
        )
    return path, []


def damage(path: Path) -> str | None:
    """What makes the checkpoint at `path` unloadable, naming the file, or None when it is intact: `trainer.json`
    holds what a checkpoint records, every file `load` reads is there and reads, every tensor file is as long as the
    state's index needs, and every file has the bytes it was written with (its sha256, recorded in `trainer.json`: a
    payload in a tensor's bytes keeps every length; a checkpoint written before the hashes were recorded is checked
    without them). Checked before anything is loaded, so that a damaged checkpoint never leaves a trainer half
    restored, and `resume=auto` passes over it."""
    try:
        saved = json.loads((path / "trainer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        return f"{path / 'trainer.json'} does not read ({_reason(error)})"
    missing = [key for key in TRAINER_KEYS if key not in saved] if isinstance(saved, dict) else list(TRAINER_KEYS)
    if missing:
        return f"{path / 'trainer.json'} lacks {', '.join(missing)}"
    problem = _trainer_damage(saved)
    if problem is not None:
        return f"{path / 'trainer.json'} holds {problem}"
    for rank in range(saved["world"]):
        problem = _rank_damage(path, rank)
        if problem is not None:
            return problem
    problem = _state_damage(path / "state")
    if problem is not None or "files" not in saved:
        return problem
    return _contents_damage(path, saved["files"], saved["world"])


def _is_count(value: Any, least: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _trainer_damage(saved: dict[str, Any]) -> str | None:
    """Which value of `trainer.json` is not what a checkpoint records, and what it must be; or None."""
    wrong = next(
        (key for key in ("step", "tokens_seen", "skipped_updates", "consecutive_skips") if not _is_count(saved[key])),
        None,
    )
    if wrong is not None:
        return f"{wrong}={_shown(saved[wrong])}, not a count (an integer >= 0)"
    if not _is_count(saved["world"], least=1):
        return f"world={_shown(saved['world'])}, not a number of ranks (an integer >= 1)"
    wrong = next((key for key in ("scheduler", "experiment") if not isinstance(saved[key], dict)), None)
    if wrong is not None:
        return f"{wrong} as a {type(saved[wrong]).__name__}, not an object"
    environments = saved.get("computed_under")
    if environments is not None and not (
        isinstance(environments, list) and environments and all(map(_is_environment, environments))
    ):
        return (
            f"computed_under={_shown(environments)}, not a list of environments (each an object with first_step, "
            "an integer >= 1, versions, null or an object of version strings, kernels, an object or null, and "
            "threads, an integer >= 1 or null)"
        )
    files = saved.get("files")
    if files is not None and not (isinstance(files, dict) and all(isinstance(v, str) for v in files.values())):
        return f"files={_shown(files)}, not an object of each file's sha256"
    lag, versions = saved["experiment"].get("rollout.lag", 0), saved.get(ENGINE_VERSIONS)
    if (lag or versions is not None) and not (
        isinstance(versions, list) and versions and all(map(_is_count, versions))
    ):
        return (
            f"{ENGINE_VERSIONS}={_shown(versions)} of a run with rollout.lag={_shown(lag)}, not the list of weight "
            "versions its engine samples with (integers >= 0)"
        )
    return None


def _is_environment(part: Any) -> bool:
    """Whether `part` is an environment `experiments.run.provenance` records (threads: absent before recorded)."""
    versions = part.get("versions") if isinstance(part, dict) else None
    return (
        isinstance(part, dict)
        and _is_count(part.get("first_step"), least=1)
        and all(isinstance(part.get(key), (dict, type(None))) for key in ("versions", "kernels"))
        and all(isinstance(version, str) for version in (versions or {}).values())
        and (part.get("threads") is None or _is_count(part["threads"], least=1))
    )


def _shown(value: Any) -> str:
    """`value` as `trainer.json` holds it, cut to a line's share."""
    text = json.dumps(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def files_read(path: Path, world: int) -> list[str]:
    """Every file `load` reads from the checkpoint at `path` (of `world` ranks) but `trainer.json`, relative to it:
    each rank's generators, the state's index and every file the index points into."""
    index = read_index(path / "state" / INDEX)
    state_files = sorted({item.relative_path for item in index.storage_data.values()})
    return [
        *(name for rank in range(world) for name in (f"rng_rank{rank}.pt", f"python_random_rank{rank}.json")),
        f"state/{INDEX}",
        *(f"state/{name}" for name in state_files),
    ]


def _sha256(file: Path) -> str:
    with open(file, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _contents_damage(path: Path, recorded: dict[str, str], world: int) -> str | None:
    """Which file `load` reads is not recorded in `trainer.json`, or has other bytes than those it was written with
    (its sha256); or None."""
    for name in files_read(path, world):
        if name not in recorded:
            return f"{path / name} is not among the files {path / 'trainer.json'} records"
        try:
            held = _sha256(path / name)
        except OSError as error:
            return f"{path / name} does not read ({_reason(error)})"
        if held != recorded[name]:
            return (
                f"{path / name} is not the file the checkpoint was written with: its sha256 is {held[:12]}, "
                f"{path / 'trainer.json'} records {recorded[name][:12]}"
            )
    return None


def _rank_damage(path: Path, rank: int) -> str | None:
    """What is wrong with rank `rank`'s random generator files, or None."""
    generators = path / f"rng_rank{rank}.pt"
    try:
        loaded = torch.load(generators, weights_only=True)
    except Exception as error:  # a truncated file fails anywhere in torch's zip and unpickling readers, with any type
        return f"{generators} does not load ({_reason(error)})"
    if not isinstance(loaded, dict) or not set(RANK_GENERATORS) <= set(loaded):
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
    (`.metadata`) must read as an index (`read_index`: never as code), every file the index points into must be as
    long as the index needs, and every value stored as bytes (the optimizer's hyperparameters) must load as data."""
    try:
        index = read_index(state / INDEX)
    except NotAnIndex as refused:
        return str(refused)
    except Exception as error:  # a truncated index fails in unpickling with whatever type it meets first
        return f"{state / INDEX} does not read ({_reason(error)})"
    try:
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
        return _bytes_damage(state, index)
    except (AttributeError, KeyError, TypeError, ValueError) as error:  # index types holding what no index holds
        return f"{state / INDEX} is not a well-formed checkpoint index ({_reason(error)})"


def _bytes_damage(state: Path, index: Metadata) -> str | None:
    """What is wrong with the values the state stores as bytes, or None: each must load with `weights_only=True`
    (torch's own loader unpickles them with full pickle, `_DataPlanner`)."""
    for key, item in index.state_dict_metadata.items():
        if not isinstance(item, BytesStorageMetadata):
            continue
        stored = index.storage_data[MetadataIndex(key)]
        where = state / stored.relative_path
        if stored.transform_descriptors:
            return (
                f"{where} stores {key} transformed ({', '.join(stored.transform_descriptors)}), as no checkpoint "
                "of this project does"
            )
        try:
            with open(where, "rb") as handle:
                handle.seek(stored.offset)
                torch.load(io.BytesIO(handle.read(stored.length)), weights_only=True)
        except Exception as error:  # torch's weights-only unpickler refuses code with its own error types
            return f"{where} stores {key} as something other than data, refused unread ({_reason(error)})"
    return None


# -- the state's index, read as data ----------------------------------------------------------------------------------

INDEX = ".metadata"  # Distributed Checkpoint's index of the state: a pickle, which torch reads with plain pickle.load
# What the index may name: Distributed Checkpoint's own metadata types and the values they hold (a shape, a dtype, a
# layout by name, the checkpoint's path). Any other global in the pickle is code, and the index is refused unread.
INDEX_GLOBALS = frozenset(
    {
        *(
            ("torch.distributed.checkpoint.metadata", name)
            for name in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a layout by its name, as torch pickles `torch.strided`
        *(
            (module, name)
            for module in ("pathlib", "pathlib._local")
            for name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")
        ),
    }
)


class NotAnIndex(pickle.UnpicklingError):
    """The state's `.metadata` names something no index holds: it is refused before anything in it runs."""


class _IndexUnpickler(pickle.Unpickler):
    """An unpickler that admits `INDEX_GLOBALS` and torch's dtypes and nothing else (no `persistent_load`: a
    persistent id is refused by pickle itself)."""

    def __init__(self, file: BinaryIO, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in INDEX_GLOBALS or dtype:
            return super().find_class(module, name)
        raise NotAnIndex(
            f"{self.path} is not a checkpoint index: it names {module}.{name}, which Distributed "
            "Checkpoint's index never holds; refused unread (a checkpoint is data, never code)"
        )


def read_index(path: Path) -> Metadata:
    """The state's index at `path`, unpickled with `_IndexUnpickler` (`NotAnIndex` when it names anything else)."""
    with open(path, "rb") as handle:
        index = _IndexUnpickler(handle, path).load()
    if not isinstance(index, Metadata):
        raise NotAnIndex(f"{path} is not a checkpoint index: it holds a {type(index).__name__}")
    return index


class _IndexReader(FileSystemReader):
    """torch's reader of a checkpoint's state, whose index is read with `read_index` instead of `pickle.load`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        index = read_index(Path(self.path) / INDEX)
        if index.storage_meta is None:
            index.storage_meta = StorageMeta()
        index.storage_meta.load_id = self.load_id
        return index


class _DataPlanner(DefaultLoadPlanner):
    """torch's load planner, whose values stored as bytes (the optimizer's hyperparameters) must load with
    `weights_only=True` before torch's own `load_bytes` unpickles them (with full pickle)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        torch.load(value, weights_only=True)  # data, or an error before anything runs
        value.seek(0)
        super().load_bytes(read_item, value)


def _reason(error: BaseException) -> str:
    """An error's reason in a few words: the OS's, or the exception's type and first line."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def check(path: Path, cfg: DictConfig, world: int) -> None:
    """Refuse the checkpoint at `path` (intact: `damage`) for a run of `cfg` on `world` ranks when it was written by
    another experiment, for another length of a schedule that depends on it, or by another number of ranks."""
    saved = json.loads((path / "trainer.json").read_text(encoding="utf-8"))
    differs = differences(saved["experiment"], cfg)
    if differs:
        raise ConfigError(f"checkpoint {path} is of another experiment: {described(differs)}")
    length = length_change(saved["experiment"], cfg)
    if length is not None:
        raise ConfigError(f"checkpoint {path}: {length}")
    if saved["world"] != world:
        raise ConfigError(
            f"checkpoint {path} was written by {saved['world']} ranks, this run has {world}: "
            "resume with as many (each rank's sampling continues from its own seed)"
        )


def load(trainer: Any, path: Path) -> None:
    """Restore the trainer's state from the checkpoint at `path` (every rank calls this, once rank 0 has found it
    intact and this run's own: `damage`, `check`). The state's index and its values stored as bytes are read as data
    (`_IndexReader`, `_DataPlanner`), never unpickled as torch would. `trainer.computed_under` becomes the
    environments the checkpoint's steps were computed under, with this process's when it differs, which rank 0
    says in one line (`experiments.run.provenance`)."""
    ranks: Ranks = trainer.ranks
    saved = json.loads((path / "trainer.json").read_text(encoding="utf-8"))
    model_state, optimizer_state = get_state_dict(trainer.model, trainer.optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
    versions = saved.get(ENGINE_VERSIONS, [])
    if versions:  # room for each version the checkpoint holds, shaped as the full weights
        template = full_weights(trainer.model)
        state[ENGINE_VERSIONS] = {
            version_key(version): {name: torch.empty_like(tensor, device="cpu") for name, tensor in template.items()}
            for version in versions
        }
    dcp.load(state, storage_reader=_IndexReader(path / "state"), planner=_DataPlanner(), no_dist=not ranks.active)
    set_state_dict(
        trainer.model, trainer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )
    trainer.scheduler.load_state_dict(saved["scheduler"])
    trainer.step_index = saved["step"]
    trainer.tokens_seen = saved["tokens_seen"]
    trainer.skipped_updates = saved["skipped_updates"]
    trainer.consecutive_skips = saved["consecutive_skips"]
    generators = torch.load(path / f"rng_rank{ranks.rank}.pt", weights_only=True)
    torch.set_rng_state(generators["torch"])
    trainer.generator.set_state(generators["sampler"])
    for name, generator in trainer.rollouts.generators().items():
        generator.set_state(generators[name])
    python_random = json.loads((path / f"python_random_rank{ranks.rank}.json").read_text())
    random.setstate((python_random[0], tuple(python_random[1]), python_random[2]))
    trainer.rollouts.restore({version: state[ENGINE_VERSIONS][version_key(version)] for version in versions})
    trainer.computed_under, differs = provenance.resumed_under(
        saved.get("computed_under"), saved["step"], trainer.cfg.cpu_kernels, trainer.cfg.trainer.threads
    )
    if differs and ranks.main:
        print(
            f"moe-rl-lab: warning: {path.name} was computed under other libraries, kernels or threads than this "
            f"process ({'; '.join(differs)}): the steps after {saved['step']} are not the bits an uninterrupted run "
            f"would give; {SUMMARY_FILE}'s computed_under records both",
            file=sys.stderr,
        )


def saved_step(path: Path) -> int:
    """The step after which the (intact) checkpoint at `path` was written."""
    return json.loads((path / "trainer.json").read_text(encoding="utf-8"))["step"]


def cut_log(metrics: Path, step: int) -> int:
    """Keep the lines of `metrics.jsonl` up to `step` (a resumed run logs the later ones again); return how many
    were dropped. The file is replaced whole, never emptied first: a kill while it is rewritten leaves it as it was."""
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
    replace_file(metrics, "".join(line + "\n" for line in kept))
    return dropped


def export(trainer: Any, directory: Path) -> Path:
    """`save_pretrained` of the policy and its tokenizer (the full weights, gathered from every rank under FSDP2), as
    transformers loads it: without the routers' predictors (`routing_variant=predictive`), which only the run uses."""
    state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if trainer.ranks.main:
        # a full state dict (full_state_dict=True): plain tensors
        trainer.model.save_pretrained(directory, state_dict=without_predictors(cast(dict[str, torch.Tensor], state)))
        trainer.tokenizer.save_pretrained(directory)
    barrier(trainer.ranks)
    return directory
