"""`docs/extending.md`'s analysis recipes are code a newcomer copies: a figure, a command and a declared family, each
run as printed against runs whose numbers are known."""

from __future__ import annotations

import types

import numpy as np
import pandas as pd
import pytest
import yaml

from analysis.contrasts import DIFFERENCE, load_family
from analysis.load import load_runs
from analysis.plotting import FigureSettings
from experiments.config import PROJECT_ROOT
from tests import synthetic_runs as syn

EXTENDING = PROJECT_ROOT / "docs" / "extending.md"


def _block(title: str, language: str = "python") -> str:
    text = EXTENDING.read_text(encoding="utf-8").split(f"## {title}\n", 1)[1]
    return text.split(f"```{language}\n", 1)[1].split("```", 1)[0]


def _module(title: str, name: str) -> types.ModuleType:
    """The recipe's code run as a module of its own (its `__future__`-free source, as a newcomer's file would be)."""
    module = types.ModuleType(name)
    exec(compile(_block(title), str(EXTENDING), "exec", dont_inherit=True), module.__dict__)
    return module


def test_the_documented_figure_draws_a_series_per_arm_and_says_why_when_it_cannot(tmp_path):
    for seed in (0, 1):
        syn.mismatch_run(tmp_path / "runs" / f"s{seed}", seed)
    recipe = _module("Add a figure", "readme_figure")
    out = recipe.fig_entropy(load_runs([tmp_path / "runs"]), FigureSettings(out_dir=tmp_path / "figures"))
    assert [path.name for path in out.files] == ["fig12_entropy.png"] and (tmp_path / "figures" / out.files[0].name)
    assert out.caption.startswith("Mean token entropy")
    syn.make_sweep(tmp_path / "without")  # its runs log no entropy
    empty = recipe.fig_entropy(load_runs([tmp_path / "without"]), FigureSettings(out_dir=tmp_path / "none"))
    assert empty.files == [] and "No run logged" in empty.notes[0]


def test_the_documented_command_writes_each_runs_last_rewards_and_refuses_an_empty_folder(tmp_path, capsys):
    sweep = syn.make_sweep(tmp_path / "sweep")
    recipe = _module("Add an analysis command", "readme_command")
    recipe.main([str(sweep), "--out", str(tmp_path / "out" / "final.csv")])
    rows = pd.read_csv(tmp_path / "out" / "final.csv")
    assert len(rows) == 6 and "final rewards:" in capsys.readouterr().out
    last = {
        (algo, seed): 12 if (algo, seed) == ("gspo", 2) else syn.STEPS for algo in ("grpo", "gspo") for seed in range(3)
    }  # the fixture's gspo seed 2 crashed after 12 steps
    expected = {
        run: np.mean([syn.reward(*run, t) for t in range(end - recipe.LAST + 1, end + 1)]) for run, end in last.items()
    }
    assert sorted(rows["final_reward"]) == pytest.approx(sorted(expected.values()))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as stop:
        recipe.main([str(tmp_path / "empty"), "--out", str(tmp_path / "never.csv")])
    assert stop.value.code == 2 and capsys.readouterr().err.startswith("error: ")
    assert not (tmp_path / "never.csv").exists()


def test_the_documented_family_file_is_a_family(tmp_path):
    path = tmp_path / "family.yaml"
    path.write_text(_block("Add a declared family", "yaml"), encoding="utf-8")
    family = load_family(path)
    assert [(c.name, c.kind, c.arm, c.other) for c in family.contrasts] == [
        ("1", DIFFERENCE, "minirl + r3", "minirl"),
        ("2", DIFFERENCE, "minirl + r3 + predictive", "minirl"),
    ]
    assert not family.compares_models and yaml.safe_load(path.read_text())["declared"].endswith('("Family")')
