"""docs/configuration.md is what experiments.config_reference writes from the dataclasses and their field comments,
every key has a meaning, the comment reader takes the comments a field has (above it, on its line, inherited), and
the entry points' --help lists the groups a user picks and points to the reference, not Hydra's internal groups."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import ClassVar

import pytest
from hydra import compose, initialize_config_dir

from experiments import config_reference
from experiments.conf_files import REFERENCE_COMMAND, first_sentence
from experiments.config import PROJECT_ROOT, register_configs
from experiments.config_reference import REFERENCE, field_comments, missing_comments, reference


def test_the_committed_reference_is_what_the_source_writes():
    stale = f"docs/configuration.md is stale: run `{REFERENCE_COMMAND}`"
    assert REFERENCE.read_text(encoding="utf-8") == reference(), stale


def test_every_key_of_every_entry_point_and_part_has_a_meaning():
    assert missing_comments() == [], "add a comment where each of these fields is declared"


@dataclasses.dataclass(frozen=True)
class Base:
    # Two lines of comment
    # just above the field.
    above: int = 1
    beside: float = 0.5  # on the field's line
    weight: ClassVar[float] = 1.0  # a ClassVar's comment, for a key such as algo.advantage_std

    # a blank line cuts a comment off from the field below it

    bare: str = "x"
    both: bool = True  # second
    spread: tuple[int, ...] = (  # a field written over
        1,
        2,
    )  # two lines


@dataclasses.dataclass(frozen=True)
class Child(Base):
    beside: float = 0.25  # the subclass's own comment wins
    extra: int = 0


def test_field_comments_are_the_lines_above_then_the_one_beside():
    comments = field_comments(Child)
    assert comments == {
        "above": "Two lines of comment just above the field.",
        "beside": "the subclass's own comment wins",
        "weight": "a ClassVar's comment, for a key such as algo.advantage_std",
        "bare": "",
        "both": "second",
        "spread": "a field written over two lines",
        "extra": "",
    }


def test_a_field_without_a_comment_is_reported(monkeypatch):
    @dataclasses.dataclass
    class Schema:
        documented: int = 0  # a meaning
        undocumented: int = 0

    monkeypatch.setattr(config_reference, "ENTRY_POINTS", {"train": Schema})
    assert missing_comments() == ["top level: undocumented"]


@pytest.mark.parametrize(
    "text, sentence",
    [
        ("Dr. GRPO (arXiv 2503.20783): no std. The rest.", "Dr. GRPO (arXiv 2503.20783): no std."),
        ("GSPO (eqs. 5-7), e.g. Here. Next", "GSPO (eqs. 5-7), e.g. Here."),
        ("One sentence only", "One sentence only"),
    ],
)
def test_a_choice_is_described_by_its_first_sentence(text, sentence):
    assert first_sentence(text) == sentence


@pytest.mark.parametrize("entry", ["train", "sft", "probe"])
def test_help_lists_the_groups_a_user_picks_and_points_to_the_reference(entry):
    register_configs()
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        text = compose(entry, return_hydra_config=True).hydra.help.template
    assert "docs/configuration.md" in text and "schema/" not in text and "$" not in text
    assert "\n  model            " in text and "\n  dataset          addition " in text  # the default first
    assert ("\n  experiment       (none) " in text) == (entry == "train")


@pytest.mark.slow
def test_train_help_on_the_command_line():
    done = subprocess.run(
        [sys.executable, "-m", "experiments.train", "--help"],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("`python -m experiments.train`: one RL run.")
    assert "docs/configuration.md" in done.stdout and "schema/" not in done.stdout
    assert "\n  algo             grpo cispo dapo " in done.stdout
