"""docs/architecture.md kept true: every import runs down the rooms and round no circle, a function-local import of the
project says why, a class name means one thing, a step runs code of the step's rooms only and its update asks no part
whether it is on, and no file names a path outside the project."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from experiments.config import PROJECT_ROOT

# The rooms, bottom to top; rooms on one level stand side by side and import neither each other nor anything above.
LEVELS = [
    ("models",),
    ("algos",),
    ("tasks", "ranks"),
    ("step",),
    ("config", "run"),
    ("doors",),
    ("analysis",),
    ("benchmarks",),
]
LEVEL = {room: level for level, rooms in enumerate(LEVELS) for room in rooms}
PACKAGES = ("models", "algos", "experiments", "analysis", "benchmarks")


def room(module: str) -> str | None:
    """The room of a dotted module name of this project (None: not ours, or the `tests` package)."""
    parts = module.split(".")
    if parts[0] != "experiments":
        return parts[0] if parts[0] in PACKAGES else None
    if len(parts) == 1:
        return "doors"
    rooms = {
        "tasks": "tasks",
        "ranks": "ranks",
        "step": "step",
        "run": "run",
        "config": "config",
        "conf_files": "config",
        "config_reference": "config",
    }
    return rooms.get(parts[1], "doors")


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, at any depth (imports inside functions count too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (PROJECT_ROOT / package).rglob("*.py"))


def test_every_import_runs_down_the_rooms():
    upward = []
    for path in sources():
        module = ".".join(path.relative_to(PROJECT_ROOT).with_suffix("").parts)
        mine = room(module)
        for line, name in imported(path):
            theirs = room(name)
            if name.split(".")[0] == "tests":
                upward.append(f"{path.relative_to(PROJECT_ROOT)}:{line} imports {name} (nothing imports the tests)")
            elif theirs is not None and theirs != mine and LEVEL[theirs] >= LEVEL[mine]:
                upward.append(f"{path.relative_to(PROJECT_ROOT)}:{line} ({mine}) imports {name} ({theirs})")
    assert not upward, "imports that run back up (docs/architecture.md):\n" + "\n".join(upward)


def test_the_lower_rooms_import_no_higher_room():
    """The arrows the issue named: models/ imports no other room, algos/ only models/."""
    for package, allowed in (("models", {"models"}), ("algos", {"models", "algos"})):
        for path in (PROJECT_ROOT / package).rglob("*.py"):
            rooms = {name.split(".")[0] for _, name in imported(path)} & {*PACKAGES, "tests"}
            assert rooms <= allowed, f"{path.relative_to(PROJECT_ROOT)} imports {sorted(rooms - allowed)}"


# A machine's own folders, or folders beside the project: nothing a clone of the repository holds.
OUTSIDE = re.compile(r"(?<![\w.])/(?:work|home|Users|mnt)/|(?<![\w/.-])(?:shared|research)/\w")


def test_no_file_names_a_path_outside_the_project():
    files = [
        *sources(),
        *(PROJECT_ROOT / "conf").rglob("*.yaml"),
        *(PROJECT_ROOT / "docs").glob("*.md"),
        PROJECT_ROOT / "README.md",
        PROJECT_ROOT / "Makefile",
        PROJECT_ROOT / "pyproject.toml",
    ]
    named = [
        f"{path.relative_to(PROJECT_ROOT)}:{number}: {line.strip()}"
        for path in files
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not named, "paths outside the project:\n" + "\n".join(named)


# The rooms one RL step lives in (docs/architecture.md): the policy and its routing, the objectives and the parts that
# switch on, the task, which rank it is, the step itself. The run around the steps (experiments/run), the doors,
# analysis and benchmarks are not the step's.
STEP_ROOMS = ("models/", "algos/", "experiments/tasks/", "experiments/ranks.py", "experiments/step/")
# Frames that only pass a call on (decorators, context managers): the call is their caller's.
WRAPPERS = ("torch/utils/_contextlib.py", "/contextlib.py", "/functools.py")


@pytest.mark.parametrize(
    "overrides",
    [
        [],  # the default step
        [
            "routing.replay=r2",
            "correction=tis",
            "rollout.precision=bf16",
            "routing.flip_rate=0.2",
            "routers=[aux_loss]",
            "routing.decompose_every=1",
            "routing_variant=full_replay",
        ],  # many parts on at once
    ],
)
def test_a_step_runs_code_of_the_step_rooms_only(overrides):
    """Calls the step's own code makes, on one rank; what transformers and torch call back (the model's forward with
    its kernels and routing hooks, the learning-rate schedule) is theirs and not counted."""
    import sys

    from experiments.step.trainer import RLTrainer
    from tests.test_train import compose_train

    trainer = RLTrainer(compose_train(*overrides))
    trainer.step()  # the first step builds what later ones reuse
    ours = tuple(f"{PROJECT_ROOT}/{package}/" for package in PACKAGES)  # not tests/, nor a virtualenv in the clone
    ran: set[str] = set()

    def called(frame, event, arg):
        path = frame.f_code.co_filename
        if event != "call" or not path.startswith(ours):
            return
        caller = frame.f_back
        while caller is not None and caller.f_code.co_filename.endswith(WRAPPERS):
            caller = caller.f_back
        if caller is None or not caller.f_code.co_filename.startswith(ours):
            return
        outer = frame.f_back
        while outer is not None:
            name = outer.f_code.co_filename
            if "/transformers/" in name or name.endswith("torch/nn/modules/module.py"):
                return
            outer = outer.f_back
        ran.add(str(Path(path).relative_to(PROJECT_ROOT)))

    sys.setprofile(called)
    try:
        trainer.step()
    finally:
        sys.setprofile(None)
    outside = sorted(path for path in ran if not path.startswith(STEP_ROOMS))
    assert "experiments/step/trainer.py" in ran and not outside, f"the step ran {outside}, outside {STEP_ROOMS}"


def test_the_update_asks_no_part_whether_it_is_on():
    """`RLTrainer.update` calls every hook at every fixed point (docs/architecture.md): no `if`, no conditional
    expression, no comparison with a part's name in its body; what a run switches on is assembled at start-up."""
    tree = ast.parse((PROJECT_ROOT / "experiments" / "step" / "trainer.py").read_text(encoding="utf-8"))
    update = next(node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == "update")
    branches = [f"line {node.lineno}" for node in ast.walk(update) if isinstance(node, (ast.If, ast.IfExp, ast.Match))]
    assert not branches, f"RLTrainer.update branches at {', '.join(branches)}: a switch belongs in a hook"


def test_every_class_name_is_defined_once():
    """A class name means one thing in the project: two modules defining `Replay` (a step's setting and a routing
    handle, say) mislead a reader, a search and an import that picks the wrong one."""
    defined: dict[str, list[str]] = {}
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                defined.setdefault(node.name, []).append(f"{path.relative_to(PROJECT_ROOT)}:{node.lineno}")
    twice = [f"{name}: {', '.join(places)}" for name, places in sorted(defined.items()) if len(places) > 1]
    assert not twice, "class names defined more than once:\n" + "\n".join(twice)


def module_name(path: Path) -> str:
    parts = path.relative_to(PROJECT_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolved(name: str, known: set[str]) -> str | None:
    """The project module an import of `name` runs: the module itself, or the module that holds the imported name
    (`from experiments.run import launch` runs `experiments.run.launch`; `from models.policy import ModelConfig`,
    `models.policy`). None: not a module of this project."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def test_no_module_imports_itself_round_a_circle():
    """An import circle works only in the order the imports happen to run, and one hidden by an import inside a
    function is still a circle: every import counts, at any depth, and each pair's dependency has one direction."""
    paths = {module_name(path): path for path in sources()}
    graph = {
        module: {theirs for _, name in imported(path) if (theirs := resolved(name, set(paths)))} - {module}
        for module, path in paths.items()
    }
    circles, done = [], set()

    def visit(module: str, trail: list[str]) -> None:
        if module in trail:
            circles.append(" -> ".join(trail[trail.index(module) :] + [module]))
            return
        if module in done:
            return
        for imported_module in sorted(graph[module]):
            visit(imported_module, trail + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    assert not circles, "import circles:\n" + "\n".join(circles)


# A function-local import of a project module hides what a module depends on from whoever reads the file's head;
# one that is needed (a heavy or optional library behind it, say) says why on its line or the line above:
# `# local import: <reason>`.
LOCAL_IMPORT_REASON = "# local import:"


def test_every_function_local_import_of_the_project_says_why():
    unexplained = []
    for path in sources():
        where = str(path.relative_to(PROJECT_ROOT))
        lines = path.read_text(encoding="utf-8").splitlines()
        for function in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    modules = [node.module or ""]
                else:
                    continue
                ours = [name for name in modules if name.split(".")[0] in PACKAGES]
                said = any(LOCAL_IMPORT_REASON in line for line in lines[max(0, node.lineno - 2) : node.lineno])
                if ours and not said:
                    unexplained.append(f"{where}:{node.lineno} imports {', '.join(ours)} inside {function.name}")
    assert not unexplained, (
        f"function-local imports of the project without `{LOCAL_IMPORT_REASON} <reason>`:\n"
        + "\n".join(sorted(set(unexplained)))
    )


@pytest.mark.parametrize("door", ["train.py", "sft.py", "probe.py"])
def test_each_door_enters_the_life_cycle_in_one_call(door):
    """The run's life (stop signals, the claimed directory, one-line refusals, the release) is `life.live`'s: a door
    describes its job and calls `live` once, and writes none of the life's own steps around it."""
    tree = ast.parse((PROJECT_ROOT / "experiments" / door).read_text(encoding="utf-8"))
    names = [ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)]
    assert names.count("live") == 1, f"experiments/{door} calls live {names.count('live')} times"
    own = sorted({"Life.begin", "stop_signals", "life.starting", "life.release"} & set(names))
    assert not own, f"experiments/{door} writes the life's own steps: {own}"
    # Nor its chores: the clocks, the log and the progress bar are `Life.running`'s (`elapsed`, `progress`).
    chores = sorted({"time.perf_counter", "time.process_time", "tqdm", "life.start_logging"} & set(names))
    assert not chores, f"experiments/{door} does the life's chores itself: {chores}"


def test_the_life_cycle_imports_nothing_from_the_step():
    """A run ends on a failure's kind (`models.registry.RunFailed`: a sampler that died, a directory that vanished),
    never on a class the life cycle imports from the part that raised it; its ranks are `experiments.ranks`'."""
    names = [name for _, name in imported(PROJECT_ROOT / "experiments" / "run" / "life.py")]
    assert not [name for name in names if name.startswith("experiments.step")], names


def test_the_objectives_request_is_written_once():
    """`ObjectiveInputs` is algos/objective.py's own type: no other module defines it, and the objective takes it
    whole (its call names no field of it)."""
    import inspect

    from algos.objective import Objective, ObjectiveInputs

    defined = [
        path.relative_to(PROJECT_ROOT).as_posix() for path in sources() if "class ObjectiveInputs" in path.read_text()
    ]
    assert defined == ["algos/objective.py"], defined
    called_with = set(inspect.signature(Objective.__call__).parameters)
    assert called_with == {"self", "logp", "inputs", "totals"}, called_with
    assert not called_with & {field.name for field in dataclasses.fields(ObjectiveInputs)}


def test_make_lint_type_checks_every_package_before_the_suite():
    """The type checker is part of `make lint`, which `make test` (so CI) runs before any test, and of the pre-commit
    hooks; it checks every package the project installs (pyproject.toml's [tool.mypy])."""
    import subprocess
    import tomllib

    import yaml

    planned = subprocess.run(
        ["make", "-n", "-B", "test"], cwd=PROJECT_ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    ruff, mypy, pytest_run = (
        next(index for index, line in enumerate(planned) if re.search(pattern, line))
        for pattern in (r"/ruff check\b", r"/mypy$", r"-m pytest\b")
    )
    assert ruff < mypy < pytest_run, planned
    checked = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["files"]
    assert sorted(checked) == sorted(PACKAGES), checked
    hooks = yaml.safe_load((PROJECT_ROOT / ".pre-commit-config.yaml").read_text())["repos"][0]["hooks"]
    assert any(hook["entry"] == ".venv/bin/mypy" and hook["pass_filenames"] is False for hook in hooks), hooks
