"""analysis/panels.py: a sweep in the paper's form, a column of panels per value of the swept key."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from analysis import panels
from analysis.load import load_runs
from experiments.step import metrics as m
from tests import synthetic_runs as syn


def _sweep(root):
    """GRPO and GSPO at 2 and 4 mini-batches per rollout batch, two seeds each; only GRPO's runs are evaluated."""
    job = 0
    for n in (2, 4):
        for algo in ("grpo", "gspo"):
            for seed in (0, 1):
                records = [syn.step_record(algo, seed, t, syn.reward(algo, seed, t) * n) for t in range(1, 9)]
                syn.write_run(root / str(job), syn.config(algo, seed, minibatches=n), records)
                job += 1
    return root


def test_each_value_of_the_swept_key_is_a_column_of_its_own_runs_labelled_by_arm(tmp_path):
    parts = panels.by_value(load_runs([str(_sweep(tmp_path / "sweep"))]), "trainer.minibatches")
    assert list(parts) == [2, 4]
    for part in parts.values():
        assert sorted(part.labels) == ["grpo", "gspo"] and len(part.runs) == 4
        assert set(part.scalars["run"]) == set(part.runs["run"]), "each column holds its own runs' records only"


def test_the_panels_are_drawn_and_a_measure_no_run_logged_is_named(tmp_path):
    runset = load_runs([str(_sweep(tmp_path / "sweep"))])
    files, left_out = panels.draw(runset, "trainer.minibatches", tmp_path / "out")
    assert [f.name for f in files] == ["panels.png"] and Image.open(files[0]).size[0] > 500
    assert "mismatch KL k3 (engine vs trainer) (no run logged it)" in left_out
    assert not [row for row in left_out if row.startswith("training reward")]


def test_a_measure_only_some_runs_of_a_column_logged_is_left_out_not_drawn_as_the_column(tmp_path):
    """Runs made before a measure existed sit beside runs that log it: a row of GSPO's line alone at N = 4 would
    read as the column's."""
    root = _sweep(tmp_path / "sweep")
    partial = root / "6"  # N = 4, gspo, seed 0
    lines = [json.loads(line) for line in (partial / "metrics.jsonl").read_text().splitlines()]
    for record in lines:
        record[m.GATE_DRIFT_PER_UPDATE] = 0.05
    (partial / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in lines))
    _, left_out = panels.draw(load_runs([str(root)]), "trainer.minibatches", tmp_path / "out")
    assert "gate mass moved after one update (TV) (only some runs logged it at minibatches = 4)" in left_out


def test_a_key_no_run_has_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as raised:
        panels.main([str(_sweep(tmp_path / "sweep")), "--by", "trainer.minibatchez", "--out", str(tmp_path / "o")])
    assert raised.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "error: --by trainer.minibatchez: no run's config has this key (a swept key, e.g. trainer.minibatches)"
    )
