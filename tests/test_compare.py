"""`analysis.compare`: arms from several reports' per-seed tables are paired as one report pairs them, and tables
that cannot pair (another start, the same arm and seed twice, other axes) are refused before anything is written."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from analysis.compare import main, pool, write_comparison
from analysis.verdicts import arm_comparisons


def per_seed(arm: str, gains: list[float], start: float = 0.5, prefix: str = "sweep", **axes) -> pd.DataFrame:
    """A per-seed table as analysis.report writes it: one row per seed 0..n-1, every measure shifted alike."""
    rows = [
        {
            "run": f"{prefix}/{i}_{arm}_s{i}",
            "arm": arm,
            "seed": i,
            **axes,
            "start": start,
            "end": start + gain,
            "gain": gain,
            "gain_area": gain / 2,
            "split_start": start,
            "split_end": start + gain,
            "split_gain": gain,
            "incomplete": False,
        }
        for i, gain in enumerate(gains)
    ]
    return pd.DataFrame(rows)


def write(tmp_path, name: str, table: pd.DataFrame):
    path = tmp_path / name
    path.mkdir()
    table.to_csv(path / "per_seed.csv", index=False)
    return path


def test_arms_from_two_reports_pair_over_shared_seeds_as_one_report_pairs_them(tmp_path):
    rng = np.random.default_rng(0)
    baseline = rng.normal(0.0, 0.3, 10)
    arm = baseline + rng.normal(0.2, 0.1, 10)
    committed = write(
        tmp_path, "committed", pd.concat([per_seed("grpo", list(baseline)), per_seed("gspo", list(arm[:8]))])
    )  # gspo: 8 seeds only
    new = write(tmp_path, "new", per_seed("grpo + r2", list(baseline - 0.3), prefix="other"))
    out = tmp_path / "out"
    main([str(committed), str(new / "per_seed.csv"), "--out", str(out)])
    comparisons = pd.read_csv(out / "comparisons.csv")
    gain = comparisons[comparisons["measure"] == "gain"].set_index("arm")
    assert gain.loc["gspo", "seeds"] == 8 and gain.loc["grpo + r2", "seeds"] == 10
    assert gain.loc["gspo", "difference_estimate"] == pytest.approx(float(np.mean(arm[:8] - baseline[:8])))
    assert gain.loc["grpo + r2", "difference_estimate"] == pytest.approx(-0.3)
    assert gain.loc["grpo + r2", "separates"]  # ten seeds all 0.3 below: the rule calls it
    pooled = pd.read_csv(out / "per_seed.csv")
    assert set(pooled["source"]) == {str(committed / "per_seed.csv"), str(new / "per_seed.csv")}
    report = (out / "report.md").read_text()
    assert "Each arm against grpo, paired over shared seeds" in report and "analysis.compare" in report


def test_the_pooled_comparison_equals_the_one_report_of_the_same_runs(tmp_path):
    """Splitting one report's table by arm into two files changes nothing in its comparisons."""
    table = pd.concat(
        [per_seed("grpo", [0.1, -0.2, 0.3, 0.0, 0.05, -0.1]), per_seed("gspo", [0.2, 0.0, 0.25, 0.1, 0.2, 0.0])]
    )
    table["seed"] = table["seed"].astype(str)
    whole = arm_comparisons(table, "grpo", [])
    rows, axes, _ = pool_from(tmp_path, table[table["arm"] == "grpo"], table[table["arm"] == "gspo"])
    split = arm_comparisons(rows, "grpo", axes)
    pd.testing.assert_frame_equal(whole, split)


def pool_from(folder, *tables: pd.DataFrame):
    paths = [folder / f"{i}.csv" for i in range(len(tables))]
    for path, table in zip(paths, tables):
        table.to_csv(path, index=False)
    return pool(paths)


def test_runs_that_did_not_start_alike_are_refused_naming_both(tmp_path, capsys):
    ours = write(tmp_path, "ours", per_seed("grpo", [0.1, 0.2, 0.3], start=0.515625))
    theirs = write(tmp_path, "theirs", per_seed("gspo", [0.1, 0.2, 0.3], start=0.79, prefix="outside"))
    with pytest.raises(SystemExit) as exit_info:
        main([str(ours), str(theirs), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "did not start from the same checkpoint" in err and "0.5156" in err and "0.7900" in err
    assert "outside/0_gspo_s0" in err and not (tmp_path / "out").exists()


def test_the_same_arm_and_seed_twice_is_refused(tmp_path, capsys):
    first = write(tmp_path, "a", per_seed("grpo", [0.1, 0.2]))
    again = write(tmp_path, "b", per_seed("grpo", [0.1, 0.25], prefix="rerun"))
    with pytest.raises(SystemExit):
        main([str(first), str(again), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert "arm 'grpo' seed 0 has more than one run" in err and "rerun/0_grpo_s0" in err


def test_arms_picked_from_each_source_and_renamed_meet_the_same_arm_name_of_another(tmp_path, capsys):
    """GRPO at two learning rates in two reports: the second, renamed, is the baseline of the first's arms."""
    committed = write(
        tmp_path,
        "committed",
        pd.concat([per_seed("grpo", [0.0, 0.1, 0.2, 0.3]), per_seed("gspo", [0.2, 0.3, 0.4, 0.5])]),
    )
    matched = write(tmp_path, "matched", per_seed("grpo", [0.1, 0.2, 0.3, 0.4], prefix="matched"))
    out = tmp_path / "out"
    main([str(committed), f"{matched}:grpo=grpo-matched", "--baseline", "grpo-matched", "--out", str(out)])
    gain = pd.read_csv(out / "comparisons.csv").query("measure == 'gain'").set_index("arm")["difference_estimate"]
    assert gain.to_dict() == pytest.approx({"grpo": -0.1, "gspo": 0.1})
    main([f"{committed}:gspo", f"{matched}:grpo", "--out", str(tmp_path / "picked")])
    assert set(pd.read_csv(tmp_path / "picked" / "per_seed.csv")["run"].str.split("/").str[0]) == {"sweep", "matched"}
    with pytest.raises(SystemExit):
        main([f"{committed}:grpo_r2", "--out", str(tmp_path / "none")])
    assert "has no arm 'grpo_r2'; its arms: grpo, gspo" in capsys.readouterr().err


def test_tables_of_other_axes_and_files_that_are_not_tables_are_refused(tmp_path, capsys):
    flat = write(tmp_path, "flat", per_seed("grpo", [0.1, 0.2]))
    swept = write(tmp_path, "swept", per_seed("gspo", [0.1, 0.2], **{"routing.flip_rate": 0.1}))
    with pytest.raises(SystemExit):
        main([str(flat), str(swept), "--out", str(tmp_path / "out")])
    assert "sweeps ['routing.flip_rate'] but" in capsys.readouterr().err
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    with pytest.raises(SystemExit):
        main([str(tmp_path / "other.csv"), "--out", str(tmp_path / "out")])
    assert "is not a per-seed table" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(tmp_path / "missing"), "--out", str(tmp_path / "out")])
    assert "missing does not exist: give a report folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(flat), "--baseline", "gspo", "--out", str(tmp_path / "out")])
    assert "--baseline 'gspo' is not an arm" in capsys.readouterr().err


def test_cells_of_a_swept_axis_are_compared_apart(tmp_path):
    table = pd.concat(
        [
            per_seed(arm, gains, **{"routing.flip_rate": rate})
            for rate, offset in ((0.0, 0.0), (0.2, 0.5))
            for arm, gains in (("grpo", [0.0, 0.1, 0.2]), ("gspo", [offset, 0.1 + offset, 0.2 + offset]))
        ]
    )
    rows, axes, _ = pool_from(tmp_path, table)
    assert axes == ["routing.flip_rate"]
    write_comparison(rows, axes, None, tmp_path / "out")
    comparisons = pd.read_csv(tmp_path / "out" / "comparisons.csv")
    gain = comparisons[comparisons["measure"] == "gain"].set_index("routing.flip_rate")["difference_estimate"]
    assert gain[0.0] == pytest.approx(0.0) and gain[0.2] == pytest.approx(0.5)


def test_runs_from_other_cold_starts_are_refused_even_at_the_same_start_accuracy(tmp_path, capsys):
    """Starts at 0 (or few evaluation prompts) give two cold starts one held-out accuracy: the weights' sha256 tells
    them apart, and the pairing refuses them in one line naming both runs and both starts."""
    ours = write(tmp_path, "ours", per_seed("grpo", [0.1, 0.2, 0.3], start=0.0).assign(start_sha256="a" * 64))
    theirs = write(
        tmp_path, "theirs", per_seed("gspo", [0.1, 0.2, 0.3], start=0.0, prefix="outside").assign(start_sha256="b" * 64)
    )
    with pytest.raises(SystemExit) as exit_info:
        main([str(ours), str(theirs), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "runs from other cold starts do not pair" in err
    assert "sha256 aaaaaaaaaaaa" in err and "sha256 bbbbbbbbbbbb" in err and "outside/0_gspo_s0" in err
    assert not (tmp_path / "out").exists()


def test_starts_of_two_cold_start_recipes_are_never_pooled(tmp_path, capsys):
    """Two reports, each of GRPO and GSPO from a start of its own: the starts pair within each report, and pooled
    they would be two draws of one recipe; their tables say the recipes differ (`start_recipe`), and the comparison
    refuses in one line naming both. Two starts of one recipe pool."""

    def report(name, start, recipe):
        table = pd.concat([per_seed(arm, [0.1, 0.2, 0.3], prefix=name) for arm in ("grpo", "gspo")])
        return write(tmp_path, name, table.assign(start_sha256=start * 64, start_recipe=recipe * 64))

    ours, theirs = report("ours", "a", "1"), report("theirs", "b", "2")
    with pytest.raises(SystemExit) as exit_info:
        main([str(ours), str(theirs), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert "of recipe 111111111111" in err and "of recipe 222222222222" in err and "draws of one recipe" in err
    assert not (tmp_path / "out").exists()
    main([str(ours), str(report("same", "c", "1")), "--out", str(tmp_path / "out")])
    assert (tmp_path / "out" / "report.md").exists()


def test_tables_that_name_no_start_are_paired_on_their_accuracy_and_the_report_says_only_that(tmp_path):
    old = write(tmp_path, "old", per_seed("grpo", [0.0, 0.1, 0.2]))  # written before per-seed tables named the start
    main(
        [
            str(old),
            str(write(tmp_path, "also_old", per_seed("gspo", [0.1, 0.2, 0.3], prefix="b"))),
            "--out",
            str(tmp_path / "out"),
        ]
    )
    report = (tmp_path / "out" / "report.md").read_text()
    assert "No table names its runs' start" in report and "the pairing is not checked beyond that" in report
    assert "arms from a shared cold start (its weights' sha256)" not in report
    new = write(tmp_path, "new", per_seed("gspo", [0.1, 0.2, 0.3], prefix="c").assign(start_sha256="c" * 64))
    main([str(old), str(new), "--out", str(tmp_path / "mixed")])
    report = (tmp_path / "mixed" / "report.md").read_text()
    assert "3 of their 3 rows are taken to come from the named start" in report
    gain = pd.read_csv(tmp_path / "mixed" / "comparisons.csv").query("measure == 'gain'")
    assert gain["seeds"].tolist() == [3] and gain["per_start"].str.startswith("cccccccccccc").all()
    pooled = pd.read_csv(tmp_path / "mixed" / "per_seed.csv", dtype={"start_sha256": str})
    assert set(pooled["start_sha256"]) == {"c" * 64}


def test_a_row_its_report_did_not_count_never_enters_and_is_named(tmp_path):
    """A run that did not finish: excluded by the report that wrote the table (`counted`), or, in a table from before
    that column, any incomplete run."""
    grpo = per_seed("grpo", [0.0, 0.1, 0.2, 0.3])
    gspo = per_seed("gspo", [0.2, 0.3, 0.9, 0.5])
    gspo.loc[2, "incomplete"] = True  # crashed at its last evaluation's 0.9: not a finished seed
    main([str(write(tmp_path, "t", pd.concat([grpo, gspo]))), "--out", str(tmp_path / "out")])
    gain = pd.read_csv(tmp_path / "out" / "comparisons.csv").query("measure == 'gain'").iloc[0]
    assert gain["seeds"] == 3 and gain["difference_estimate"] == pytest.approx(0.2)
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## Seeds left out of the comparisons" in report and "`sweep/2_gspo_s2`" in report
    assert "a run that did not finish never counts" in report


def test_a_table_that_says_neither_what_counted_nor_what_was_incomplete_counts_every_run(tmp_path):
    """The oldest per-seed tables hold neither `counted` nor `incomplete`: every seed is compared (mypy found this
    path raising on its `~False` condition)."""
    grpo, gspo = per_seed("grpo", [0.0, 0.1, 0.2]), per_seed("gspo", [0.1, 0.3, 0.4])
    main([str(write(tmp_path, "t", pd.concat([grpo, gspo]).drop(columns="incomplete"))), "--out", str(tmp_path / "o")])
    gain = pd.read_csv(tmp_path / "o" / "comparisons.csv").query("measure == 'gain'").iloc[0]
    assert gain["seeds"] == 3 and gain["difference_estimate"] == pytest.approx(0.1667, abs=1e-3)
