"""`python -m experiments.config_reference` writes docs/configuration.md: every config key in one place (group, key,
type, default, meaning), generated from the dataclasses that declare the keys; its brief for the entry points' `--help`
is `experiments.conf_files.help_text`.

Nothing in it is written twice. A key, its type and its default are the schema's: the dataclasses of
`experiments.config`, and for a group whose choices are parts (objectives, rollout corrections, routing variants,
router switches, tasks) the schema Hydra's ConfigStore holds for each part, generated from the part's own dataclass.
A key's meaning is its field's comment in the source, read with `tokenize`: the lines of `# ...` comment just above
the field, then the comment on its own line(s); a field without one has no meaning to show, and the test of this
module fails on it. A section's meaning is its dataclass's docstring; what a group's choice is, the first sentence of
its yaml's leading comment (`conf/<group>/<choice>.yaml`); which groups an entry point picks, and their defaults, its
defaults list (`conf/train.yaml`, `conf/sft.yaml`, `conf/probe.yaml`). The values an entry point's yaml sets over its
schema are listed after its keys. `tests/test_config_reference.py` fails when the committed file is not what this
module writes.

The `--help` of `python -m experiments.train` (and sft, probe) is Hydra's `hydra/help` config `conf/hydra/help/
lab.yaml`, whose template asks `experiments.conf_files.help_text` (the `lab_help` resolver, registered with the
schemas) for the groups a user picks, their choices, and where every key is explained: Hydra's default help listed
every config group, the internal `schema/*` ones included, and no meaning.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import inspect
import io
import json
import re
import textwrap
import tokenize
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from algos import OBJECTIVES
from algos.corrections import CORRECTIONS
from algos.routers import ROUTER_SWITCHES
from algos.routing_variants import ROUTING_VARIANTS
from experiments.conf_files import (
    CONF,
    PROJECT_ROOT,
    REFERENCE_COMMAND,
    choices,
    default_choice,
    picked_groups,
    yaml_description,
)
from experiments.config import ProbeConfig, SFTConfig, TrainConfig, register_configs
from experiments.tasks import TASKS
from models.registry import Registry, flat

REFERENCE = PROJECT_ROOT / "docs" / "configuration.md"
ENTRY_POINTS = {"train": TrainConfig, "sft": SFTConfig, "probe": ProbeConfig}
# The groups whose choices are registered parts: each choice's keys are its schema's (`schema/<group>/<choice>`).
PART_GROUPS: dict[str, Registry[Any]] = {
    "algo": OBJECTIVES,
    "correction": CORRECTIONS,
    "routing_variant": ROUTING_VARIANTS,
    "routers": ROUTER_SWITCHES,
    "dataset": TASKS,
}


# --- the source: field comments, docstrings, yaml comments ----------------------------------------------------


def field_comments(cls: type) -> dict[str, str]:
    """The comment of each field of `cls`, its own and those it inherits (ClassVars included), as the source writes
    it: the comment lines just above the field, then the comment on its line; a subclass's own comment wins."""
    comments: dict[str, str] = {}
    for owner in reversed(cls.__mro__):
        if owner is not object and "__annotations__" in vars(owner):
            comments.update(_own_comments(owner))
    return comments


def _own_comments(cls: type) -> dict[str, str]:
    source = textwrap.dedent(inspect.getsource(cls))  # a class defined in a function is indented
    body = next(node for node in ast.parse(source).body if isinstance(node, ast.ClassDef)).body
    above_rows: dict[int, str] = {}  # comment text by source row: alone on its row, or after code
    on_rows: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            rows = above_rows if token.line.strip().startswith("#") else on_rows
            rows[token.start[0]] = token.string.lstrip("#").strip()
    comments = {}
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above: list[str] = []
        row = node.lineno - 1
        while row in above_rows:
            above.insert(0, above_rows[row])
            row -= 1
        last = cast(int, node.end_lineno)  # a node parsed from source knows where it ends
        own = " ".join(on_rows[row] for row in range(node.lineno, last + 1) if row in on_rows)
        if above and above[-1].endswith(".") and own:
            own = own[:1].upper() + own[1:]  # a new sentence after the block above
        comments[node.target.id] = " ".join(above + [own] if own else above)
    return comments


def docstring(cls: type) -> str:
    """A section's own docstring as one paragraph; "" when it has none (not the one it inherits)."""
    own = vars(cls).get("__doc__") or ""
    return " ".join(inspect.cleandoc(own).split()) if own and not own.startswith(f"{cls.__name__}(") else ""


# --- the groups an entry point picks --------------------------------------------------------------------------


def entry_values(entry: str) -> dict[str, Any]:
    """What `conf/<entry>.yaml` sets over its schema (its keys other than the defaults list and Hydra's), flattened."""
    own = cast(dict[str, Any], OmegaConf.to_container(OmegaConf.load(CONF / f"{entry}.yaml")))  # a mapping
    return flat({key: value for key, value in own.items() if key not in ("defaults", "hydra")})


# --- rows -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    key: str
    type: str
    default: str
    meaning: str


@dataclass(frozen=True)
class Section:
    path: str  # "trainer", "rollout.vllm", "algo=grpo", "" for the top level
    about: str
    rows: tuple[Row, ...]


def type_text(annotation: Any) -> str:
    """`int`, `float or null`, `{none, r2, r3}` (an enum's values), `list of str`, `dict`."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        options = typing.get_args(annotation)
        named = " or ".join(type_text(option) for option in options if option is not type(None))
        return named + (" or null" if type(None) in options else "")
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "{" + ", ".join(member.value for member in annotation) + "}"
    if typing.get_origin(annotation) is list:
        return f"list of {type_text(typing.get_args(annotation)[0])}"
    if typing.get_origin(annotation) is dict or annotation is dict:
        return "dict"
    return getattr(annotation, "__name__", str(annotation))


def value_text(value: Any) -> str:
    """A default as yaml would write it: null, true, an enum's value, a list; strings with spaces or escapes quoted;
    `required` for a value the schema leaves missing."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(value_text(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {value_text(item)}" for key, item in value.items()) + "}"
    if value == MISSING:
        return "required"
    if isinstance(value, str):
        return value if re.fullmatch(r"[\w.,:/${}%@+=-]+", value) else json.dumps(value, ensure_ascii=False)
    return repr(value)


def field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return MISSING


def is_group(annotation: Any) -> bool:
    """A field that a config group fills (`Any`, or the `dict[str, Any]` of the router switches)."""
    return annotation is Any or typing.get_origin(annotation) is dict and typing.get_args(annotation)[1] is Any


def sections(cls: type, path: str = "", instance: Any = None) -> Iterator[Section]:
    """The section of `cls`'s leaves, then, in the order of its fields, those of its nested dataclasses (with the
    defaults of `instance`: a nested default may differ from its class's, as the cold start's logger does) and of the
    part groups it holds (`part_sections`)."""
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    rows, nested = [], []
    for f in dataclasses.fields(cls):
        value = getattr(instance, f.name) if instance is not None else field_default(f)
        key = f"{path}.{f.name}".lstrip(".")
        if dataclasses.is_dataclass(hints[f.name]):
            nested.append(sections(hints[f.name], key, value))
        elif is_group(hints[f.name]):
            nested.append(part_sections(f.name) if f.name in PART_GROUPS else iter(()))
        else:
            rows.append(Row(key, type_text(hints[f.name]), value_text(value), comments[f.name]))
    if rows:
        yield Section(path, docstring(cls) if path else "", tuple(rows))
    for children in nested:
        yield from children


def part_sections(group: str) -> Iterator[Section]:
    """One section per choice of a part group: the keys of its stored schema (`schema/<group>/<choice>`), each
    described by the comment of the part's own field (or ClassVar, for keys such as `algo.advantage_std`)."""
    register_configs()
    stored = ConfigStore.instance().repo["schema"][group]
    for choice in choices(group):
        schema = cast(type[Any], OmegaConf.get_type(stored[f"{choice}.yaml"].node))  # a stored schema: a dataclass
        part = PART_GROUPS[group][choice]
        comments = field_comments(part)
        hints = typing.get_type_hints(schema)
        prefix = f"routers.{choice}" if group == "routers" else group
        rows = tuple(
            Row(f"{prefix}.{f.name}", type_text(hints[f.name]), value_text(field_default(f)), comments[f.name])
            for f in dataclasses.fields(schema)
            if f.name != "name"
        )
        yield Section(f"{group}={choice}", yaml_description(CONF / group / f"{choice}.yaml"), rows)


def missing_comments() -> list[str]:
    """Every key of every entry point and part whose field has no comment, as `section: key`."""
    found = {
        f"{section.path or 'top level'}: {row.key}"
        for schema in ENTRY_POINTS.values()
        for section in sections(schema)
        for row in section.rows
        if not row.meaning
    }
    return sorted(found)


# --- the reference --------------------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _table(rows: tuple[Row, ...]) -> list[str]:
    if not rows:
        return ["No keys: choosing it is the whole setting."]
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    lines += [f"| `{row.key}` | {_cell(row.type)} | `{_cell(row.default)}` | {_cell(row.meaning)} |" for row in rows]
    return lines


def groups_table() -> list[str]:
    """Every group an entry point picks: which entry points pick it, their defaults, the choices."""
    picks: dict[str, dict[str, Any]] = {}
    for entry in ENTRY_POINTS:
        for group, choice in picked_groups(entry).items():
            picks.setdefault(group, {})[entry] = choice
    lines = ["| group | default | choices |", "|---|---|---|"]
    for group, by_entry in picks.items():
        defaults = {default_choice(choice) for choice in by_entry.values()}
        if len(defaults) == 1:
            default = f"{defaults.pop()} ({', '.join(by_entry)})"
        else:
            default = ", ".join(f"{entry} {default_choice(choice)}" for entry, choice in by_entry.items())
        listed = " ".join(f"`{choice}`" for choice in choices(group))
        if isinstance(next(iter(by_entry.values())), list):
            listed = f"any set of {listed}"
        lines.append(f"| `{group}` | {default} | {listed} |")
    return lines


def choices_table(group: str) -> list[str]:
    lines = ["| choice | what it is |", "|---|---|"]
    for choice in choices(group):
        lines.append(f"| `{choice}` | {_cell(yaml_description(CONF / group / f'{choice}.yaml'))} |")
    return lines


def _paths(paths: list[str]) -> str:
    """Section paths as a list, the choices of a part group as one `group=<name>` when all of them are there."""
    named = []
    for path in paths:
        group, _, choice = path.partition("=")
        if choice and set(choices(group)) <= {p.partition("=")[2] for p in paths if p.startswith(f"{group}=")}:
            path = f"{group}=<name>"
        if path not in named:
            named.append(path)
    return ", ".join(f"`{path}`" if path else "the top-level keys" for path in named)


def reference() -> str:
    """docs/configuration.md."""
    out = [
        "# Configuration reference",
        "",
        f"Generated by `{REFERENCE_COMMAND}` from the dataclasses that declare each key and from their own field "
        "comments: edit those, then run the command (`tests/test_config_reference.py` fails when this file is stale, "
        "or when a field has no comment). `python -m experiments.train --help` lists the groups in brief.",
        "",
        "Hydra composes a run from groups (`algo=gspo` picks a part) and keys (`trainer.lr=1e-4` sets a value; "
        "`-m key=a,b` sweeps). A misspelt key, a wrong type or a value outside an enum's values fails at composition; "
        "what no single key can check is refused before any work, in one line. The defaults below are the schemas'. "
        "A group's yaml (a model, an arm), an experiment or a search sets some keys over them, and an entry point's "
        "own yaml sets the values listed under it; `--cfg job` prints the composed config without running.",
        "",
        "## Groups",
        "",
        *groups_table(),
    ]
    printed: dict[tuple[str, tuple[Row, ...]], str] = {}  # each section written, and the entry point it is under
    listed: set[str] = set()  # the groups whose choices are listed
    for entry, schema in ENTRY_POINTS.items():
        about = yaml_description(CONF / f"{entry}.yaml").removeprefix(f"`python -m experiments.{entry}`: ")
        out += ["", f"## `python -m experiments.{entry}`", "", about[:1].upper() + about[1:]]
        same: dict[str, list[str]] = {}  # sections written under another entry point, by that entry point
        for section in sections(schema):
            if (section.path, section.rows) in printed:
                same.setdefault(printed[section.path, section.rows], []).append(section.path)
                continue
            printed[section.path, section.rows] = entry
            out += ["", f"### {f'`{section.path}`' if section.path else 'top-level keys'}", ""]
            out += [section.about, ""] if section.about else []
            out += _table(section.rows)
            if section.path == "model":
                out += [
                    "",
                    "Its choices (`model=<name>`), each a yaml of values over these defaults:",
                    "",
                    *choices_table("model"),
                ]
        for group in picked_groups(entry):
            if group not in (*PART_GROUPS, "model") and group not in listed:
                listed.add(group)
                out += ["", f"### `{group}=<name>`", "", *choices_table(group)]
        for other, paths in same.items():
            out += ["", f"As for `python -m experiments.{other}` above: {_paths(paths)}."]
        values = entry_values(entry)
        if values:
            out += [
                "",
                f"`conf/{entry}.yaml` sets, over these defaults: "
                + "; ".join(f"`{key}` = `{value_text(value)}`" for key, value in values.items())
                + ".",
            ]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    missing = missing_comments()
    if missing:
        raise SystemExit("fields without a comment (add one where the field is declared): " + ", ".join(missing))
    REFERENCE.write_text(reference(), encoding="utf-8")
    print(f"wrote {REFERENCE.relative_to(PROJECT_ROOT)}")


if __name__ == "__main__":
    main()
