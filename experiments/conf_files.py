"""What conf/ says of itself, and the entry points' `--help` written from it: the groups an entry point picks (its
defaults list) with their choices, and what a yaml is (the first sentence of its leading comment).

`help_text` is the `lab_help` resolver that `experiments.config.register_configs` registers with the schemas, for
the template of `conf/hydra/help/lab.yaml`; `experiments.config_reference` writes the full reference
(docs/configuration.md) from the same pieces and the schemas. This module reads conf/ alone, so the schemas can
import it and the reference can import both, each import running one way.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any, cast

from omegaconf import OmegaConf

PROJECT_ROOT = Path(__file__).resolve().parent.parent
CONF = PROJECT_ROOT / "conf"
REFERENCE_COMMAND = "python -m experiments.config_reference"  # what writes docs/configuration.md
HELP_WIDTH = 100  # columns of the --help text
# Words after which a period does not end the sentence that describes a choice.
ABBREVIATIONS = {"Dr", "Drs", "eq", "eqs", "Eq", "Eqs", "Fig", "Figs", "al", "vs", "cf", "e.g", "i.e", "approx"}


def first_sentence(text: str) -> str:
    """The first sentence of `text` (a period followed by a capital ends it, unless it ends an abbreviation)."""
    for match in re.finditer(r"\.\s+(?=[A-Z`(])", text):
        word = re.findall(r"[\w.]+$", text[: match.start()])
        if not word or word[0] not in ABBREVIATIONS:
            return text[: match.start() + 1]
    return text


def yaml_description(path: Path) -> str:
    """What a yaml is: the first sentence of its leading comment (after `# @package`, before its command lines)."""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#") or line.startswith("#   "):
            break
        if not line.startswith("# @package"):
            lines.append(line.lstrip("#").strip())
    sentence = first_sentence(" ".join(lines))
    return sentence[:-1] + "." if sentence.endswith(":") else sentence  # one that leads into a command line


def picked_groups(entry: str) -> dict[str, Any]:
    """The groups of `conf/<entry>.yaml`'s defaults list, each with its default choice (None: none, [] for a set);
    not Hydra's own (`override hydra/...`)."""
    groups = {}
    entry_file = cast(dict[str, Any], OmegaConf.to_container(OmegaConf.load(CONF / f"{entry}.yaml")))  # a mapping
    for item in entry_file["defaults"]:
        if isinstance(item, dict):
            ((group, choice),) = item.items()
            if not group.startswith("override "):
                groups[group] = choice
    return groups


def choices(group: str) -> list[str]:
    return sorted(path.stem for path in (CONF / group).glob("*.yaml"))


def default_choice(choice: Any) -> str:
    """A group's default choice as the reference and `--help` write it."""
    if choice is None:
        return "none"
    if isinstance(choice, list):
        return "`[" + ",".join(choice) + "]`"
    return f"`{choice}`"


def help_text(entry: str) -> str:
    """`python -m experiments.<entry> --help`: what the entry point does, the groups a user picks with their choices
    (the default first), and where every key is explained. No `$`: Hydra substitutes the template's `$NAMES`."""
    command = f"python -m experiments.{entry}"
    lines = [
        *textwrap.wrap(yaml_description(CONF / f"{entry}.yaml"), HELP_WIDTH, break_on_hyphens=False),
        "",
        f"Usage: {command} [group=choice ...] [key=value ...]",
        f"       {command} -m [group=a,b ...] [key=a,b ...]      (a sweep: one run per combination)",
        "",
        "Groups (group=choice; the default first):",
    ]
    for group, default in picked_groups(entry).items():
        names = choices(group)
        if isinstance(default, list):
            shown = f"any set, e.g. {group}=[{names[0]}]; default {default_choice(default).strip('`')}: "
            shown += " ".join(names)
        else:
            first = [default] if default is not None else ["(none)"]
            shown = " ".join(first + [name for name in names if name != default])
        lines += textwrap.wrap(
            shown, HELP_WIDTH, initial_indent=f"  {group:<16} ", subsequent_indent=" " * 19, break_on_hyphens=False
        )
    lines += [
        "",
        f"Every key, its type, default and meaning: docs/configuration.md (written by `{REFERENCE_COMMAND}`).",
        f"The composed config, without running: python -m experiments.{entry} [overrides] --cfg job",
        "Hydra's own flags: --hydra-help",
    ]
    return "\n".join(lines).replace("$", "")
