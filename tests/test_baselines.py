"""Whether each result's baseline learned (analysis.baselines): the verdict from a committed per-seed table, read in
the declared cell only, over counted runs, two-level where several cold starts ran; the committed table and the
results README's column are what the command computes."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import yaml

from analysis import baselines
from experiments.config import PROJECT_ROOT

RESULTS = PROJECT_ROOT / "docs" / "results"


def _table(folder: Path, rows: list[dict]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(folder / baselines.PER_SEED, index=False)


def _declare(root: Path, entries: list[dict]) -> Path:
    path = root / "baselines.yaml"
    path.write_text(yaml.safe_dump(entries), encoding="utf-8")
    return path


def test_the_baselines_verdict_is_read_in_its_cell_over_counted_runs_and_across_starts(tmp_path):
    """A baseline that gains in its un-intervened cell learns, although its SYNTHETIC cell and an uncounted run lose;
    one whose starts disagree holds level under the two-level interval, though its seeds pooled would look steady;
    a single run gets its gain and no verdict."""
    rows = [
        {"arm": "grpo", "seed": s, "routing.flip_rate": 0.0, "gain": 0.10 + 0.01 * s, "counted": "yes"}
        for s in range(5)
    ]
    rows += [{"arm": "grpo", "seed": s, "routing.flip_rate": 0.2, "gain": -0.3, "counted": "yes"} for s in range(5)]
    rows += [
        {"arm": "grpo", "seed": 9, "routing.flip_rate": 0.0, "gain": -0.9, "counted": "no"},
        {"arm": "gspo", "seed": 0, "routing.flip_rate": 0.0, "gain": -0.5, "counted": "yes"},
    ]
    _table(tmp_path / "dose", rows)
    # Two starts that disagree, each steady over its seeds.
    _table(
        tmp_path / "starts",
        [
            {"arm": "minirl", "seed": s, "start_sha256": start, "gain": gain + 0.001 * s}
            for start, gain in (("a", 0.08), ("b", -0.06))
            for s in range(4)
        ],
    )
    _table(tmp_path / "map", [{"arm": "grpo", "seed": 100, "gain": 0.05}])
    declaration = _declare(
        tmp_path,
        [
            {"result": "dose", "table": "dose", "arm": "grpo", "where": {"routing.flip_rate": 0.0}},
            {"result": "starts", "table": "starts", "arm": "minirl"},
            {"result": "map", "table": "map", "arm": "grpo"},
        ],
    )
    found = [baselines.learned(baselines.rows_of(b, tmp_path)) for b in baselines.load_declaration(declaration)]
    dose, starts, single = found
    assert (dose.verdict, dose.runs, dose.starts) == ("learns", 5, 1) and dose.mean == pytest.approx(0.12)
    assert dose.low > 0.10 and dose.high < 0.14
    assert (starts.verdict, starts.starts) == ("holds level", 2) and starts.low < 0 < starts.high
    assert (single.verdict, single.runs) == ("", 1) and baselines.words(single) == "+5.0 pts (one run: no interval)"
    assert baselines.words(dose).startswith("learns +12.0 pts [+1")
    baselines.main([str(declaration), "--out", str(tmp_path / "out" / "baselines.md")])
    text = (tmp_path / "out" / "baselines.md").read_text()
    assert "| dose | grpo (routing.flip_rate=0.0) | 5 (1) | learns +12.0 pts" in text


@pytest.mark.parametrize(
    "entry, said",
    [
        (
            {"result": "x", "table": "dose", "arm": "grpo + r9"},
            "x: tmp/dose/per_seed.csv has no arm 'grpo + r9'; its arms: grpo",
        ),
        ({"result": "x", "table": "nowhere", "arm": "grpo"}, "x: no tmp/nowhere/per_seed.csv"),
        (
            {"result": "x", "table": "dose", "arm": "grpo", "where": {"routing.perturb_rate": 0.1}},
            "x: tmp/dose/per_seed.csv has no column 'routing.perturb_rate'",
        ),
        (
            {"result": "x", "table": "dose", "arm": "grpo", "where": {"routing.flip_rate": 0.5}},
            "has no run of 'grpo' where",
        ),
        ({"result": "x", "table": "dose", "arms": "grpo"}, "must have result, table and arm"),
        ({"result": "x", "table": "uncounted", "arm": "grpo"}, "has no counted run of 'grpo' with a finite gain"),
    ],
)
def test_a_baseline_the_table_cannot_give_is_refused_in_one_line(tmp_path, capsys, entry, said):
    _table(tmp_path / "dose", [{"arm": "grpo", "seed": s, "routing.flip_rate": 0.0, "gain": 0.1} for s in range(3)])
    _table(tmp_path / "uncounted", [{"arm": "grpo", "seed": s, "gain": 0.1, "counted": "no"} for s in range(3)])
    with pytest.raises(SystemExit) as exit_:
        baselines.main([str(_declare(tmp_path, [entry])), "--out", str(tmp_path / "out.md")])
    error = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(error) == 1 and not (tmp_path / "out.md").exists()
    assert said.replace("tmp/", f"{tmp_path}/") in error[0]


def test_the_committed_baselines_and_the_results_readmes_column_are_what_the_command_computes(tmp_path):
    """docs/results/baselines.md regenerates as committed, and each declared baseline's verdict stands in the results
    README's table."""
    declaration = RESULTS / "baselines.yaml"
    out = tmp_path / "baselines.md"
    baselines.main([str(declaration), "--out", str(out)])
    committed = (RESULTS / "baselines.md").read_text(encoding="utf-8")
    assert out.read_text(encoding="utf-8").split("\n", 1)[1] == committed.split("\n", 1)[1]
    table = [
        line for line in (RESULTS / "README.md").read_text(encoding="utf-8").splitlines() if line.startswith("| [")
    ]
    for baseline in baselines.load_declaration(declaration):
        said = baselines.words(baselines.learned(baselines.rows_of(baseline, RESULTS)))
        assert any(said in line for line in table), f"{baseline.result}: {said!r} is not in the README's table"
