"""analysis/ kept as rooms of one job each (docs/architecture.md), as tests/test_layout.py keeps the step's update:
every module small enough to read whole, no private name used across modules, one command-line shape for every
entry point, every figure of the report one function over the shared prelude and in the report's list."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

from analysis import figures
from analysis.cli import Command
from experiments.config import PROJECT_ROOT

ANALYSIS = PROJECT_ROOT / "analysis"
MODULES = sorted(path for path in ANALYSIS.glob("*.py") if path.name != "__init__.py")
MOST_LINES = 400  # a room read whole in one sitting; past it, a module holds more than one job
PACKAGES = ("models", "algos", "experiments", "analysis", "benchmarks")


def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(PROJECT_ROOT).with_suffix("").parts)


@pytest.mark.parametrize("path", MODULES, ids=lambda path: path.name)
def test_every_analysis_module_is_one_room_small_enough_to_read_whole(path):
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MOST_LINES, f"analysis/{path.name} has {lines} lines: split it by job (docs/architecture.md)"


def private_uses(path: Path, packages: tuple[str, ...]) -> list[str]:
    """Where the file takes a private name (`_name`) from a module of `packages`: `from x import _name`, or
    `x._name` of a module it imported."""
    found, modules = [], set()
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in packages:
            found += [
                f"{path.relative_to(PROJECT_ROOT)}:{node.lineno} imports {node.module}.{alias.name}"
                for alias in node.names
                if alias.name.startswith("_")
            ]
            modules |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            modules |= {alias.asname or alias.name for alias in node.names if alias.name.split(".")[0] in packages}
    return found + [
        f"{path.relative_to(PROJECT_ROOT)}:{node.lineno} uses {node.value.id}.{node.attr}"
        for node in ast.walk(tree(path))
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in modules
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
    ]


def test_no_private_name_crosses_a_module():
    """A private name is its module's own: no analysis module takes one from another project module, and no test
    takes one from analysis/ (what a test needs, a module offers by a public name)."""
    crossing = [use for path in MODULES for use in private_uses(path, PACKAGES)]
    crossing += [
        use for path in sorted((PROJECT_ROOT / "tests").glob("*.py")) for use in private_uses(path, ("analysis",))
    ]
    assert not crossing, "private names used outside their module:\n" + "\n".join(crossing)


ENTRY_POINTS = [path for path in MODULES if 'if __name__ == "__main__":' in path.read_text(encoding="utf-8")]


@pytest.mark.parametrize("path", ENTRY_POINTS, ids=lambda path: path.name)
def test_every_entry_point_has_the_one_command_line_shape(path):
    """`python -m analysis.<name>` is `cli.Command(...).main` with its module's name and docstring: one parser shape,
    one refusal of bad input, one printed line; its `__main__` block calls `main()` and nothing else."""
    module = importlib.import_module(module_name(path))
    command = getattr(module.main, "__self__", None)
    assert isinstance(command, Command), f"{path.name}: main is not a cli.Command's"
    assert command.module == module.__name__ and command.doc == module.__doc__
    block = next(
        node
        for node in tree(path).body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'"
    )
    assert [ast.unparse(statement) for statement in block.body] == ["main()"]


def test_every_figure_of_the_report_is_one_function_over_the_prelude_and_in_its_list():
    """A figure is a function decorated with `plotting.figure` in a module of figures; `figures.FIGURES` holds each
    once, so a figure written is a figure drawn."""
    decorated = {}
    for path in MODULES:
        for node in ast.walk(tree(path)):
            if isinstance(node, ast.FunctionDef) and any(
                isinstance(d, ast.Call) and ast.unparse(d.func) == "figure" for d in node.decorator_list
            ):
                decorated[node.name] = module_name(path)
    listed = [draw.__name__ for draw in figures.FIGURES]
    assert sorted(listed) == sorted(decorated) and len(set(listed)) == len(listed), (listed, decorated)
    for draw in figures.FIGURES:
        assert draw.__module__ == decorated[draw.__name__] and inspect.unwrap(draw) is not draw


def _one_edit_apart(a: str, b: str) -> bool:
    """Whether `b` is `a` with one letter added, removed or changed."""
    if abs(len(a) - len(b)) > 1 or a == b:
        return False
    if len(a) == len(b):
        return sum(x != y for x, y in zip(a, b)) == 1
    short, long = sorted((a, b), key=len)
    return any(long[:i] + long[i + 1 :] == short for i in range(len(long)))


def test_no_two_analysis_modules_are_named_one_letter_apart():
    """`contrast` and `contrasts` once sat side by side: a reader opens the wrong one. A module's name says its job."""
    names = sorted(path.stem for path in ANALYSIS.glob("*.py"))
    close = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :] if _one_edit_apart(a, b)]
    assert not close, f"analysis modules one letter apart: {close}"
