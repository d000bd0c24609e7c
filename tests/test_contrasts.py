"""`analysis.family`: the staleness study's declared family computed from planted per-seed tables of the MoE rung
and the dense control, paired where the pre-registration pairs and unpaired between the models, Holm over the five,
units that lack a run left out and named, and tables the family cannot be computed from refused in one line; the
exploratory family (an arm's fall, a difference at k) from the MoE table alone; the learning study's family on
split_gain from three named tables, two without a lag axis, and the arms it names composed as its sweeps run them."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from analysis import statistics, unpaired
from analysis.arms import arm_names
from analysis.compare import pool
from analysis.configs import flatten_config
from analysis.contrasts import DIFFERENCE, FALL, FALL_DIFFERENCE, Contrast, judge, needed_runs, unit_values
from analysis.family import DEFAULT_FAMILY, load_family, main
from experiments.config import PROJECT_ROOT, register_configs

K = 4  # k* in these tables
FAMILY = load_family(DEFAULT_FAMILY).contrasts  # the pre-registration's five, from their data file
EXPLORATORY = PROJECT_ROOT / "docs" / "results" / "async" / "exploratory_n4_family.yaml"
NAIVE, TIS, MINIRL, R3, PR2, GSPO = (
    "grpo (π_old = μ_old)",
    "grpo + tis",
    "minirl",
    "minirl + r3",
    "minirl + r3 + predictive",
    "gspo",
)
# The cells the pre-registration runs: every MoE arm at k*, three of them at 0 too; the dense control's minirl at both.
MOE_CELLS = [(arm, K) for arm in (NAIVE, TIS, MINIRL, R3, PR2, GSPO)] + [(arm, 0) for arm in (TIS, MINIRL, GSPO)]
DENSE_CELLS = [(MINIRL, 0), (MINIRL, K)]


def judge_family(family, tmp_path, *extra: str) -> None:
    """`analysis.family` on `family` over the MoE table planted at tmp_path/moe.csv, at k* = K, into tmp_path/out."""
    main(
        [
            "--family",
            str(family),
            "--moe",
            str(tmp_path / "moe.csv"),
            "--lag",
            str(K),
            "--out",
            str(tmp_path / "out"),
            *extra,
        ]
    )


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def per_seed(
    area: Callable[[str, int, int, int], float],
    cells=MOE_CELLS,
    starts: int = 8,
    seeds: int = 2,
    model: str = "moe",
    measure: str = "gain_area",
) -> pd.DataFrame:
    """A per-seed table with the columns analysis.report writes, `area(arm, lag, start, seed)` its `measure` (the
    other of gain_area and split_gain 0)."""
    rows = []
    for start in range(starts):
        for seed in range(seeds):
            for arm, lag in cells:
                begin, value = 0.3 + 0.01 * start, area(arm, lag, start, seed)
                rows.append(
                    {
                        "run": f"{model}/{arm}_k{lag}_st{start}_s{seed}",
                        "arm": arm,
                        "seed": seed,
                        "rollout.lag": lag,
                        "start": begin,
                        "end": begin + 2 * value,
                        "gain": 2 * value,
                        "split_start": begin,
                        "split_end": begin,
                        **{"gain_area": 0.0, "split_gain": 0.0, measure: value},
                        "incomplete": False,
                        "status": "finished",
                        "counted": "yes",
                        "start_sha256": sha(f"{model}-{start}"),
                        "start_recipe": sha(model),
                    }
                )
    return pd.DataFrame(rows)


def noise(arm: str, lag: int, start: int, seed: int) -> float:
    """A fixed pseudo-random gain_area per run."""
    return float(np.random.default_rng(int(sha(f"{arm}/{lag}/{start}/{seed}")[:8], 16)).normal(0.1, 0.05))


def run(tmp_path, moe: pd.DataFrame, dense: pd.DataFrame, lag: int = K) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The command on the two tables; its contrasts.csv (indexed by comparison) and left_out.csv."""
    moe.to_csv(tmp_path / "moe.csv", index=False)
    dense.to_csv(tmp_path / "dense.csv", index=False)
    out = tmp_path / "out"
    main(
        [
            "--moe",
            str(tmp_path / "moe.csv"),
            "--dense",
            str(tmp_path / "dense.csv"),
            "--lag",
            str(lag),
            "--out",
            str(out),
        ]
    )
    assert (out / "report.md").is_file() and (out / "units.csv").is_file()
    return (
        pd.read_csv(out / "contrasts.csv").set_index("comparison"),
        pd.read_csv(out / "left_out.csv", dtype={"seed": str}),
    )


def dense_table(fall: Callable[[int, int], float] = lambda start, seed: 0.0, starts: int = 8) -> pd.DataFrame:
    """The dense control's minirl at 0 and k*, falling by `fall(start, seed)`."""
    return per_seed(
        lambda arm, lag, start, seed: 0.2 - (fall(start, seed) if lag else 0.0),
        DENSE_CELLS,
        starts=starts,
        model="dense",
    )


def test_a_planted_fall_difference_is_recovered_exactly_as_the_estimate(tmp_path):
    # gspo falls 0.10 more than grpo + tis on every unit, whatever each run's own level
    def area(arm, lag, start, seed):
        base = noise(arm, 0, start, seed)
        fall = {GSPO: 0.15, TIS: 0.05}.get(arm, 0.0)
        return base - (fall + 0.01 * start if lag else 0.0)

    contrasts, left = run(tmp_path, per_seed(area), dense_table())
    h3 = contrasts.loc["5 (H3)"]
    assert h3["estimate"] == pytest.approx(0.10, abs=1e-12)
    assert (h3["low"], h3["high"]) == pytest.approx((0.10, 0.10), abs=1e-12)
    assert h3["p_value"] == pytest.approx(2 / 2**8) and h3["signs_agree"] and left.empty


def test_the_paired_differences_equal_a_hand_computation(tmp_path):
    moe = per_seed(noise)
    contrasts, _ = run(tmp_path, moe, dense_table())
    area = moe.set_index(["arm", "rollout.lag", "start_sha256", "seed"])["gain_area"].sort_index()
    for name, arm, other in (("1 (H1)", TIS, NAIVE), ("2 (H2)", R3, MINIRL), ("3 (H2)", PR2, MINIRL)):
        by_unit = area.loc[arm, K] - area.loc[other, K]
        per_start = by_unit.groupby(level="start_sha256").mean()
        assert contrasts.loc[name, "estimate"] == pytest.approx(per_start.mean(), abs=1e-12)
        assert contrasts.loc[name, "p_value"] == pytest.approx(statistics.sign_flip_p(per_start.to_numpy()))
        written = dict(part.split(" (")[0].split("=") for part in contrasts.loc[name, "per_start"].split("; "))
        assert {start: float(value) for start, value in written.items()} == pytest.approx(per_start.to_dict())
    falls = (area.loc[GSPO, 0] - area.loc[GSPO, K]) - (area.loc[TIS, 0] - area.loc[TIS, K])
    assert contrasts.loc["5 (H3)", "estimate"] == pytest.approx(falls.groupby(level=0).mean().mean(), abs=1e-12)


def test_an_interaction_with_every_moe_fall_above_every_dense_fall_reaches_the_smallest_permutation_p(tmp_path):
    moe = per_seed(lambda arm, lag, start, seed: 0.3 - (0.2 + 0.01 * start + 0.002 * seed if lag else 0.0))
    contrasts, _ = run(tmp_path, moe, dense_table(lambda start, seed: 0.01 * start - 0.002 * seed))
    h2 = contrasts.loc["4 (H2, interaction)"]
    assert h2["p_value"] == pytest.approx(2 / 12870) == unpaired.smallest_permutation_p(8, 8)
    assert h2["low"] > 0 and h2["signs_agree"] and h2["starts"] == "8+8"
    assert h2["estimate"] == pytest.approx(0.2 + 0.001 - (-0.001), abs=1e-12)
    assert h2["holm_p"] < statistics.ALPHA and h2["verdict"] == "separates above 0"


@pytest.mark.parametrize(
    "dense_fall",
    [
        lambda start, seed: 0.2 + 0.01 * start,  # the MoE's falls, exactly
        lambda start, seed: 0.2 + 0.01 * ((start * 3) % 8) + 0.005,
    ],  # interleaved
    ids=["equal", "shuffled"],
)
def test_equal_or_shuffled_falls_do_not_separate(tmp_path, dense_fall):
    moe = per_seed(lambda arm, lag, start, seed: 0.3 - (0.2 + 0.01 * start if lag else 0.0))
    contrasts, _ = run(tmp_path, moe, dense_table(dense_fall))
    h2 = contrasts.loc["4 (H2, interaction)"]
    assert h2["p_value"] > 0.5 and not h2["separates"] and h2["verdict"] == "not separated"
    assert h2["low"] <= 0 <= h2["high"] and not h2["signs_agree"]


def test_a_unit_missing_one_run_is_left_out_of_what_needs_it_and_named(tmp_path):
    moe = per_seed(noise)

    def run_of(arm, lag, start, seed):
        return (
            (moe["arm"] == arm)
            & (moe["rollout.lag"] == lag)
            & (moe["start_sha256"] == sha(f"moe-{start}"))
            & (moe["seed"] == seed)
        )

    lacking, stopped = run_of(R3, K, 3, 1), run_of(GSPO, 0, 5, 0)
    moe.loc[stopped, ["counted", "status", "incomplete"]] = ["excluded", "interrupted", True]
    contrasts, left = run(tmp_path, moe[~lacking], dense_table())
    assert list(zip(left["comparison"], left["start_sha256"], left["seed"])) == [
        ("2 (H2)", sha("moe-3"), "1"),
        ("5 (H3)", sha("moe-5"), "0"),
    ]
    assert left["why"].tolist() == [
        "no run of minirl + r3 at rollout.lag 4",
        "gspo at rollout.lag 0: moe/gspo_k0_st5_s0 did not finish (interrupted)",
    ]
    assert "(1)" in contrasts.loc["2 (H2)", "per_start"] and "(1)" not in contrasts.loc["3 (H2)", "per_start"]
    moe.to_csv(tmp_path / "table.csv", index=False)
    rows, _, _ = pool([tmp_path / "table.csv"])
    values, named = unit_values(rows, FAMILY[1].at(K))
    assert len(values) == 8 and named.empty  # the excluded gspo run is no run of minirl + r3 nor minirl


def test_holm_runs_over_the_five_comparisons(tmp_path):
    contrasts, _ = run(tmp_path, per_seed(noise), dense_table(lambda start, seed: noise("d", 1, start, seed)))
    assert len(contrasts) == 5 and set(contrasts["family"]) == {5}
    assert contrasts["holm_p"].tolist() == pytest.approx(list(statistics.holm(contrasts["p_value"].to_numpy())))
    assert (
        contrasts["separates"]
        == ((contrasts["low"] > 0) | (contrasts["high"] < 0)) & (contrasts["holm_p"] < statistics.ALPHA)
    ).all()


def test_judge_adjusts_over_the_contrasts_it_is_given():
    values = {f"s{start}": {"0": 0.1 + start, "1": 0.1 + start} for start in range(8)}
    judged = judge(
        [Contrast("a", DIFFERENCE, "x", "y", 1), Contrast("b", FALL_DIFFERENCE, "x", "y", 1)], [[values], [values]]
    )
    assert [result.holm_p for result in judged] == pytest.approx([2 * 2 / 2**8] * 2)
    assert all(result.separates for result in judged)


def test_a_fall_sets_one_arm_against_itself_and_takes_no_other_arm():
    assert Contrast("e", FALL, "x", lag=2).terms() == [("x", 0, 1), ("x", 2, -1)]
    with pytest.raises(ValueError, match="a fall takes no other arm"):
        Contrast("e", FALL, "x", "y")


def test_the_exploratory_family_reads_the_moe_table_alone_and_recovers_a_planted_fall(tmp_path):
    # minirl falls 0.05 + 0.01 · start from lag 0 to 2 on every start; minirl + r3 lies 0.02 above it at 2 on starts
    # 0-5 and 0.02 below on 6-7, so the fall separates and the replay's difference does not
    def area(arm, lag, start, seed):
        base = noise(MINIRL, 0, start, seed)
        if lag == 0:
            return base
        return base - 0.05 - 0.01 * start + ((0.02 if start < 6 else -0.02) if arm == R3 else 0.0)

    per_seed(area, [(MINIRL, 0), (MINIRL, 2), (R3, 2)], seeds=1).to_csv(tmp_path / "moe.csv", index=False)
    out = tmp_path / "out"
    main(["--family", str(EXPLORATORY), "--moe", str(tmp_path / "moe.csv"), "--lag", "2", "--out", str(out)])
    contrasts = pd.read_csv(out / "contrasts.csv").set_index("comparison")
    fall, replay = contrasts.loc["E1"], contrasts.loc["E2"]
    assert fall["estimate"] == pytest.approx(0.05 + 0.035, abs=1e-12) and fall["p_value"] == pytest.approx(2 / 2**8)
    assert fall["holm_p"] == pytest.approx(2 * 2 / 2**8) and fall["verdict"] == "separates above 0"
    assert replay["estimate"] == pytest.approx(0.01, abs=1e-12) and not replay["signs_agree"]
    assert replay["p_value"] == pytest.approx(74 / 256) and replay["verdict"] == "not separated"  # |Σ signs| ≥ 4
    report = (out / "report.md").read_text(encoding="utf-8")
    assert report.startswith("# Exploratory") and "dense" not in report and "Comparisons E1, E2 are paired" in report
    assert "Cold starts (the weights' sha256, its first 12 digits): the MoE rung's 8, " in report
    assert all(f"`{sha(f'moe-{start}')[:12]}`" in report for start in range(8))  # each start named where it ran


@pytest.mark.parametrize(
    "family, dense, said",
    [
        (
            DEFAULT_FAMILY,
            False,
            f"--family {DEFAULT_FAMILY} reads the dense control (4 (H2, interaction)): give --dense REPORT_OR_CSV",
        ),
        (EXPLORATORY, True, f"dense.csv: --family {EXPLORATORY} reads no dense table (its: moe)"),
    ],
)
def test_the_dense_table_is_needed_by_and_only_by_a_family_that_compares_models(tmp_path, capsys, family, dense, said):
    per_seed(noise).to_csv(tmp_path / "moe.csv", index=False)
    dense_table().to_csv(tmp_path / "dense.csv", index=False)
    with pytest.raises(SystemExit) as stop:
        judge_family(family, tmp_path, *(["--dense", str(tmp_path / "dense.csv")] if dense else []))
    assert stop.value.code == 2 and said in capsys.readouterr().err  # a usage error, as a lag below 1
    assert not (tmp_path / "out").exists()


def test_the_permutation_p_of_two_small_groups_is_the_hand_counted_share():
    # splits of {1, 2, 3, 4} into two pairs: {1, 2} | {3, 4} and its mirror reach |1.5 − 3.5|; the four others not
    assert unpaired.permutation_p([1.0, 2.0], [3.0, 4.0]) == pytest.approx(2 / 6)
    assert unpaired.permutation_p([1.0, 2.0], [2.0, 1.0]) == 1.0


def test_beyond_the_exact_splits_the_permutation_p_is_drawn_from_a_fixed_stream():
    # 12 + 12 starts: C(24, 12) = 2,704,156 splits, past EXACT_SPLITS_UP_TO; every first value above every second
    first, second = np.arange(12.0) + 100, np.arange(12.0)
    drawn = unpaired.permutation_p(first, second)
    assert drawn == unpaired.permutation_p(first, second) and 1 / 100_001 <= drawn < 1e-3
    assert unpaired.permutation_p(second, second[::-1]) == 1.0
    assert unpaired.permutation_p(np.arange(24.0)[::2], np.arange(24.0)[1::2]) > 0.5


REFUSALS = {
    "a lag not in the tables": (
        lambda moe, dense: (moe, dense),
        2,
        "has no counted run at rollout.lag 2; its lags: 0, 4",
    ),
    "an arm missing": (lambda moe, dense: (moe[moe["arm"] != PR2], dense), K, "has no arm 'minirl + r3 + predictive'"),
    "an arm missing at 0": (
        lambda moe, dense: (moe[(moe["arm"] != GSPO) | (moe["rollout.lag"] != 0)], dense),
        K,
        "has no counted run of 'gspo' at rollout.lag 0",
    ),
    "one start": (lambda moe, dense: (moe[moe["start_sha256"] == sha("moe-0")], dense), K, "holds 1 start(s)"),
    "a routing arm on the dense model": (
        lambda moe, dense: (moe, pd.concat([dense, per_seed(noise, [(R3, K)], model="dense")])),
        K,
        "holds 'minirl + r3': the dense control runs only the arms without routing",
    ),
    "two recipes": (
        lambda moe, dense: (
            moe.assign(start_recipe=np.where(moe["start_sha256"] == sha("moe-7"), sha("x"), moe["start_recipe"])),
            dense,
        ),
        K,
        "of recipe " + sha("x")[:12],
    ),
    "a start on both models": (
        lambda moe, dense: (
            moe,
            dense.assign(
                start_sha256=dense["start_sha256"].where(dense["start_sha256"] != sha("dense-0"), sha("moe-0"))
            ),
        ),
        K,
        f"start {sha('moe-0')[:12]} is in both",
    ),
    "no lag column": (
        lambda moe, dense: (moe[moe["rollout.lag"] == K].drop(columns="rollout.lag"), dense),
        K,
        "has no rollout.lag column",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_tables_the_family_cannot_be_computed_from_are_refused_in_one_line(tmp_path, capsys, case):
    edit, lag, said = REFUSALS[case]
    moe, dense = edit(per_seed(noise), dense_table())
    with pytest.raises(SystemExit) as stop:
        run(tmp_path, moe, dense, lag)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ") and said in err, err
    assert not (tmp_path / "out" / "report.md").exists()


def test_a_lag_below_1_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        run(tmp_path, per_seed(noise), dense_table(), lag=0)
    assert stop.value.code == 2 and "--lag 0: k* is a lag above 0" in capsys.readouterr().err


def test_a_family_is_a_data_file_and_a_new_one_needs_no_code(tmp_path):
    """The declared families load from the files beside their documents, as the pre-registration wrote them; a family
    written to a new file is judged as declared there."""
    declared = load_family(DEFAULT_FAMILY)
    assert [(c.name, c.kind, c.arm, c.other) for c in declared.contrasts] == [
        ("1 (H1)", DIFFERENCE, TIS, NAIVE),
        ("2 (H2)", DIFFERENCE, R3, MINIRL),
        ("3 (H2)", DIFFERENCE, PR2, MINIRL),
        ("4 (H2, interaction)", "interaction", MINIRL, None),
        ("5 (H3)", FALL_DIFFERENCE, GSPO, TIS),
    ]
    assert declared.dense_arms == (NAIVE, TIS, MINIRL, GSPO) and "preregistration.md" in declared.declared
    mine = tmp_path / "mine.yaml"
    mine.write_text(
        'title: Mine\ndeclared: my notes\ncontrasts:\n  - {name: M1, kind: difference, arm: "minirl + r3", '
        "other: minirl}\n",
        encoding="utf-8",
    )
    per_seed(noise).to_csv(tmp_path / "moe.csv", index=False)
    main(["--family", str(mine), "--moe", str(tmp_path / "moe.csv"), "--lag", str(K), "--out", str(tmp_path / "out")])
    report = (tmp_path / "out" / "report.md").read_text(encoding="utf-8")
    assert report.startswith("# Mine") and "The 1 comparisons of my notes" in report


@pytest.mark.parametrize(
    "text, said",
    [
        ("title: t\ndeclared: d\n", "must be a mapping with title, declared and contrasts"),
        ("title: t\ndeclared: d\ncontrasts: []\nseeds: 3\n", "has seeds: a family holds only"),
        ("title: t\ndeclared: d\ncontrasts: [{name: a, kind: sum, arm: x}]\n", "kind 'sum' is not one of"),
        (
            "title: t\ndeclared: d\ncontrasts: [{name: a, kind: difference, arm: x}]\n",
            "a difference needs an other arm",
        ),
        ("title: t\ndeclared: d\ncontrasts: [{name: a, kind: interaction, arm: x}]\n", "it must name dense_arms"),
        ("title: t\ndeclared: d\ncontrasts: [{name: a, kind: fall, arm: x, k: 2}]\n", "must have name, kind and arm"),
        (
            "title: t\ndeclared: d\ncontrasts: [{name: a, kind: difference, arm: x, other: y, lag: 2}]\n",
            "contrast 1 declares lag 2: a contrast is at k* (the command's --lag), or at lag 0",
        ),
        (
            "title: t\ndeclared: d\ncontrasts: [{name: a, kind: fall, arm: x, lag: 0}]\n",
            "contrast 'a' (fall) compares lag 0 with k*: only a difference is at lag 0",
        ),
        (
            "title: t\ndeclared: d\ndense_arms: [x]\ncontrasts: [{name: a, kind: interaction, arm: x, table: t}]\n",
            "an interaction reads the moe and dense tables, and names no table",
        ),
        (
            "title: t\ndeclared: d\nmeasure: reward\ncontrasts: [{name: a, kind: fall, arm: x}]\n",
            "measure 'reward' is not a measure of the per-seed tables (gain, gain_area, split_gain)",
        ),
        ("title: [\n", "is not yaml"),
    ],
)
def test_a_family_file_that_is_not_a_family_is_refused_in_one_line(tmp_path, capsys, text, said):
    (tmp_path / "bad.yaml").write_text(text, encoding="utf-8")
    per_seed(noise).to_csv(tmp_path / "moe.csv", index=False)
    with pytest.raises(SystemExit) as stop:
        judge_family(tmp_path / "bad.yaml", tmp_path)
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == 2 and said in error and str(tmp_path / "bad.yaml") in error
    assert not (tmp_path / "out").exists()


LEARNING = PROJECT_ROOT / "docs" / "results" / "learning" / "family.yaml"
GRPO_BF16, GSPO_BF16 = "grpo (bf16 engine)", "gspo (bf16 engine)"
PR2_LAB, PR2_PAPER = (f"grpo + r3 + predictive (bf16 engine) (lr_scale={scale})" for scale in ("1", "10000"))
SIGMOID_ARMS = [GRPO_BF16, GSPO_BF16, "grpo + r2 (bf16 engine)", "grpo + r3 (bf16 engine)", PR2_LAB, PR2_PAPER]
# The staleness cells of the learning study: the async study's arms at k*, three of them at 0 too (no minirl_pr2).
STALENESS_CELLS = [(arm, K) for arm in (NAIVE, TIS, MINIRL, R3, GSPO)] + [(arm, 0) for arm in (TIS, MINIRL, GSPO)]


def learning_tables(tmp_path, starts: int = 10) -> dict[str, pd.DataFrame]:
    """The learning family's three tables from `starts` starts (the declared K, 10, by default), planted at
    tmp_path/NAME.csv, split_gain a fixed noise per run: sigmoid and softmax, synchronous sweeps without a lag column;
    staleness, the sigmoid rung's starts at 0 and K."""

    def table(name: str, cells, starts_of: str) -> pd.DataFrame:
        gain = lambda arm, lag, start, seed: noise(f"{name}/{arm}", lag, start, seed)  # noqa: E731
        return per_seed(gain, cells, starts=starts, model=starts_of, measure="split_gain")

    tables = {
        "sigmoid": table("sigmoid", [(arm, 0) for arm in SIGMOID_ARMS], "sigmoid").drop(columns="rollout.lag"),
        "softmax": table("softmax", [(GRPO_BF16, 0), (GSPO_BF16, 0)], "softmax").drop(columns="rollout.lag"),
        "staleness": table("staleness", STALENESS_CELLS, "sigmoid"),
    }
    for name, rows in tables.items():
        rows.to_csv(tmp_path / f"{name}.csv", index=False)
    return tables


def learning_argv(tmp_path, *extra: str, tables=("sigmoid", "softmax", "staleness")) -> list[str]:
    """`analysis.family` on the learning family over the planted tables, at k* = K, into tmp_path/out."""
    named = [argument for name in tables for argument in ("--table", f"{name}={tmp_path / name}.csv")]
    return ["--family", str(LEARNING), *named, "--lag", str(K), "--out", str(tmp_path / "out"), *extra]


def test_the_learning_family_is_judged_on_split_gain_each_comparison_on_the_table_it_names(tmp_path):
    tables = learning_tables(tmp_path)
    main(learning_argv(tmp_path))
    out = tmp_path / "out"
    contrasts = pd.read_csv(out / "contrasts.csv", dtype={"comparison": str}).set_index("comparison")
    gain = {
        name: rows.assign(**{"rollout.lag": rows.get("rollout.lag", 0)})
        .set_index(["arm", "rollout.lag", "start_sha256", "seed"])["split_gain"]
        .sort_index()
        for name, rows in tables.items()
    }
    by_hand = {  # per comparison, its value per (start, seed) unit from the table it names
        "1": gain["sigmoid"].loc[GSPO_BF16, 0] - gain["sigmoid"].loc[GRPO_BF16, 0],
        "2": gain["softmax"].loc[GSPO_BF16, 0] - gain["softmax"].loc[GRPO_BF16, 0],
        **{
            name: gain["sigmoid"].loc[arm, 0] - gain["sigmoid"].loc[GRPO_BF16, 0]
            for name, arm in zip("3456", SIGMOID_ARMS[2:])
        },
        "7": gain["staleness"].loc[TIS, K] - gain["staleness"].loc[NAIVE, K],
        "8": gain["staleness"].loc[R3, K] - gain["staleness"].loc[MINIRL, K],
        "9": (gain["staleness"].loc[GSPO, 0] - gain["staleness"].loc[GSPO, K])
        - (gain["staleness"].loc[TIS, 0] - gain["staleness"].loc[TIS, K]),
    }
    assert list(contrasts.index) == list(by_hand) and set(contrasts["family"]) == {9}
    for name, by_unit in by_hand.items():
        per_start = by_unit.groupby(level="start_sha256").mean()
        assert contrasts.loc[name, "estimate"] == pytest.approx(per_start.mean(), abs=1e-12), name
        assert contrasts.loc[name, "p_value"] == pytest.approx(statistics.sign_flip_p(per_start.to_numpy())), name
    assert contrasts["lag"].tolist() == [0] * 6 + [K] * 3
    assert contrasts["holm_p"].tolist() == pytest.approx(list(statistics.holm(contrasts["p_value"].to_numpy())))
    units = pd.read_csv(out / "units.csv", dtype={"comparison": str}).groupby("comparison")["model"].unique()
    assert {name: list(tables) for name, tables in units.items()} == {
        name: ["softmax" if name == "2" else "staleness" if name in "789" else "sigmoid"] for name in by_hand
    }
    report = (out / "report.md").read_text(encoding="utf-8")
    assert report.startswith("# The learning study's declared family")
    assert "at k* = 4 (comparisons 1, 2, 3, 4, 5, 6 at lag 0), on split_gain, from " in report
    assert f"`{tmp_path / 'softmax.csv'}` (the softmax table) and `{tmp_path / 'staleness.csv'}`" in report
    assert "| 2: `gspo (bf16 engine)` − `grpo (bf16 engine)` at k = 0 | 10 × 2 softmax |" in report
    assert "Interim" not in report
    assert "Each paired comparison reads one table: 1, 3, 4, 5, 6, the sigmoid table; 2, the softmax table; " in report
    assert "A fall is an arm's split_gain at lag 0 minus at k*" in report and "gain_area" not in report
    assert "the difference of two arms at k*; the difference of two arms at lag 0;" in report
    assert "Every unit of every table entered every comparison that reads it." in report


def test_a_family_whose_starts_cannot_separate_is_refused_unless_read_as_an_interim(tmp_path, capsys):
    """Eight starts in a family of nine reach at best 9 · 2/2^8 = 0.070: no comparison can separate, whatever the
    data (the issue's "K below what the family needs"). One line before anything is written; `--interim` reads it,
    and the report says that no verdict is final."""
    learning_tables(tmp_path, starts=8)
    with pytest.raises(SystemExit) as stop:
        main(learning_argv(tmp_path))
    assert stop.value.code == 2 and not (tmp_path / "out").exists()
    assert capsys.readouterr().err == (
        "error: the family's 9 comparisons need the starts to separate under Holm (m · 2/2^K < 0.05), and comparisons "
        "1, 2, 3, 4, 5, 6, 7, 8, 9 (8 starts: at best 0.0703) cannot, whatever the data: more starts, or --interim for "
        "a reading that is no verdict\n"
    )
    main(learning_argv(tmp_path, "--interim"))
    report = (tmp_path / "out" / "report.md").read_text(encoding="utf-8")
    assert (
        "**Interim reading (`--interim`): no verdict here is final.** Too few starts for Holm over the 9 to " in report
    )
    contrasts = pd.read_csv(tmp_path / "out" / "contrasts.csv")
    assert not contrasts["separates"].any() and (contrasts["holm_p"] >= 0.0703 - 1e-4).all()


def test_a_family_of_differences_at_lag_0_needs_no_lag_column_and_takes_no_lag(tmp_path, capsys):
    learning_tables(tmp_path)
    mine = tmp_path / "sync.yaml"
    mine.write_text(
        "title: Sync\ndeclared: my notes\nmeasure: split_gain\ncontrasts:\n  - {name: S, kind: difference, "
        f'arm: "{GSPO_BF16}", other: "{GRPO_BF16}", table: softmax, lag: 0}}\n',
        encoding="utf-8",
    )
    argv = ["--family", str(mine), "--table", f"softmax={tmp_path / 'softmax.csv'}", "--out", str(tmp_path / "out")]
    main(argv)
    report = (tmp_path / "out" / "report.md").read_text(encoding="utf-8")
    assert "comparisons of my notes at lag 0, on split_gain, from" in report and "fall" not in report
    assert (
        "Comparison S is paired per (start, seed) on the softmax table (the difference of two arms at lag 0)" in report
    )
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--lag", "2"])
    said = f"--lag 2: --family {mine} compares every contrast at lag 0, and reads no k*"
    assert stop.value.code == 2 and said in capsys.readouterr().err.splitlines()[-1]


@pytest.mark.parametrize(
    "argv, said",
    [
        (
            lambda tmp: learning_argv(tmp, tables=("sigmoid", "staleness")),
            f"--family {LEARNING} reads the softmax table (2): give --table softmax=REPORT_OR_CSV",
        ),
        (
            lambda tmp: learning_argv(tmp, "--table", "extra=x.csv"),
            f"--table extra=x.csv: --family {LEARNING} reads no extra table (its: sigmoid, softmax, staleness)",
        ),
        (
            lambda tmp: learning_argv(tmp, "--moe", "x.csv", "--table", "moe=y.csv"),
            "--table moe=y.csv: the moe table is given twice (--moe x.csv)",
        ),
        (
            lambda tmp: learning_argv(tmp)[:-4] + ["--out", "o"],
            f"--family {LEARNING} compares 7, 8, 9 at k*: give --lag K",
        ),
        (lambda tmp: learning_argv(tmp, "--table", "sigmoid"), "'sigmoid' is not NAME=REPORT_OR_CSV"),
    ],
    ids=["a table not given", "a table no contrast reads", "one table twice", "no k*", "a table without its name"],
)
def test_the_tables_and_k_star_a_family_reads_are_given_and_only_those(tmp_path, capsys, argv, said):
    learning_tables(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(argv(tmp_path))
    assert stop.value.code == 2 and said in capsys.readouterr().err.splitlines()[-1]  # a usage error, as a lag below 1
    assert not (tmp_path / "out").exists()


def _nan_split_gain(tables):
    tables["staleness"].loc[0, "split_gain"] = float("nan")
    return tables


LEARNING_REFUSALS = {
    "a lag-0 table with other lags": (
        lambda tables: {**tables, "sigmoid": tables["staleness"]},
        "sigmoid.csv holds runs at rollout.lag 0, 4: comparisons 1, 3, 4, 5, 6 compare at lag 0, from a table of "
        "synchronous runs",
    ),
    "a k* table without lags": (
        lambda tables: {**tables, "staleness": tables["sigmoid"]},
        "staleness.csv has no rollout.lag column among its swept axes (none): its runs are all at lag 0, and "
        "comparisons 7, 8, 9 compare at k*",
    ),
    "a run without the measure": (
        _nan_split_gain,
        "staleness.csv: 1 counted runs of the arms the family reads have no split_gain, sigmoid/grpo (π_old = μ_old)",
    ),
    "a PR2 setting missing": (
        lambda tables: {**tables, "sigmoid": tables["sigmoid"][tables["sigmoid"]["arm"] != PR2_PAPER]},
        f"sigmoid.csv has no arm {PR2_PAPER!r}; its arms: ",
    ),
}


@pytest.mark.parametrize("case", list(LEARNING_REFUSALS))
def test_named_tables_the_family_cannot_be_computed_from_are_refused_in_one_line(tmp_path, capsys, case):
    edit, said = LEARNING_REFUSALS[case]
    for name, rows in edit(learning_tables(tmp_path)).items():
        rows.to_csv(tmp_path / f"{name}.csv", index=False)
    with pytest.raises(SystemExit) as stop:
        main(learning_argv(tmp_path))
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and err.startswith("error: --table ") and said in err, err
    assert not (tmp_path / "out" / "report.md").exists()


# The sweeps each table of the learning family pools, as docs/results/learning/command.sh runs them with
# experiment=learning_family (the rung as its model): sync's sigmoid sweeps, four arms and then grpo_pr2 at predictor
# lr_scale 1 and 1e4, pooled in one report, and its softmax sweep of the experiment's own arms (None: read from it); the
# staleness cells at k* and 0, which command.sh does not run yet, with the pre-registration's fp32 engine ("Arms").
LEARNING_SWEEPS = {
    "sigmoid": [
        (["model=glm4_moe_l16"], ["grpo", "gspo", "grpo_r2", "grpo_r3"]),
        *((["model=glm4_moe_l16", f"routing_variant.lr_scale={scale}"], ["grpo_pr2"]) for scale in ("1", "10000")),
    ],
    "softmax": [(["model=qwen30b_l16"], None)],
    "staleness": [
        (["experiment=learning_staleness", f"rollout.lag={lag}"], arms)
        for lag, arms in (
            (K, ["grpo_naive_async", "grpo_decoupled", "minirl", "minirl_r3", "gspo"]),
            (0, ["grpo_decoupled", "minirl", "gspo"]),
        )
    ],
}


def test_the_learning_family_names_arms_its_tables_sweeps_run():
    """Composed as its sweeps run them and named as a report names them (`arms.arm_names` over one table's runs), each
    table's arms hold every arm the family reads there; the two PR2 settings are two arms by their lr_scale."""
    declared = load_family(LEARNING)
    assert declared.measure == "split_gain" and declared.tables == tuple(LEARNING_SWEEPS)
    assert [contrast.name for contrast in declared.at_k_star] == ["7", "8", "9"]
    register_configs()
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        for table, sweeps in LEARNING_SWEEPS.items():
            configs = {}
            for number, (overrides, arms) in enumerate(sweeps):
                # The synchronous family's experiment, unless the sweep names its own (the staleness cells').
                named = any(override.startswith("experiment=") for override in overrides)
                base = [*([] if named else ["experiment=learning_family"]), *overrides]
                if arms is None:  # the experiment's own sweep of arms
                    sweep = compose("train", overrides=base, return_hydra_config=True)
                    arms = str(sweep.hydra.sweeper.params.arm).split(",")
                for arm in arms:
                    run = compose("train", overrides=[*base, f"arm={arm}"])
                    configs[f"{number} {arm}"] = flatten_config(OmegaConf.to_container(run, resolve=False))
            names = set(arm_names(configs).values())
            reads = [contrast.at(K) for contrast in declared.contrasts if contrast.table == table]
            assert {arm for arm, _ in needed_runs(reads)} <= names, (table, names)
    assert {PR2_LAB, PR2_PAPER} <= {contrast.arm for contrast in declared.contrasts}
