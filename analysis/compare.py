"""`python -m analysis.compare`: arms compared from the per-seed tables of several reports, without their logs.

    python -m analysis.compare REPORT_OR_CSV[:ARM[=NAME],...]... [--baseline ARM] [--primary SUMMARY]
                               [--family ARM...] --out DIR
    python -m analysis.compare docs/results/deep_long_seeds:gspo reports/confound_step:grpo=grpo-lr2.7e-4 \
        --baseline grpo-lr2.7e-4 --family gspo --out reports/gspo_vs_matched_grpo

Each input is a report folder (its `per_seed.csv`) or a per-seed CSV that `analysis.report` wrote, optionally
followed by the arms to take from it, each renamed where `=NAME` says (two inputs holding one arm name under
different settings, GRPO at two learning rates say, are told apart by renaming one). Their rows are pooled and every
arm is compared with the baseline arm exactly as a report compares the arms of one sweep (`verdicts.arm_comparisons`:
paired over shared cold starts and seeds, per cell of the swept axes and per gain measure; the primary summary and the
family Holm's correction runs over as `--primary` and `--family` say, by default the mean gain over the run and every
arm). This is how arms run in different sweeps, sessions or machines meet — a new arm against a committed result, an
outside re-run against ours — and the pairing is only honest when the runs of one seed started from the same weights,
so the inputs are checked first: the same swept axes in every file, one run per arm, cell, start and seed, and, at
each seed of a cell, arms that share a start (a seed whose arms come from different starts, each named by its weights'
sha256, is refused naming both runs), with one held-out start accuracy per start (another accuracy from the same
weights means other evaluation prompts: refused). A table written before per-seed tables named the start
(no `start_sha256` column) is taken to come from the start whose runs at the same seed start at the same held-out
accuracy, and the report says that this rests on the accuracy alone; where no table names a start, the pairing is
checked on that accuracy only, and said so. Rows a report did not count (`counted` = excluded: a run that did not
finish, or, in a table from before that column, any incomplete run) never enter a comparison and are named. Writes
`comparisons.csv`, the pooled `per_seed.csv` (with each row's `source`), `left_out.csv` and `report.md`, through a
staging folder.
Bad input ends with one `error:` line and exit code 2.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple, cast

import pandas as pd

from analysis import declaration as declared
from analysis.cli import Command, publishing, staged, writable_out
from analysis.gains import COUNTED, EXCLUDED, GAIN_MEASURES, LEFT_OUT_COLUMNS, with_missing_units
from analysis.records import UNKNOWN_START, cell_at
from analysis.tables import (
    COMPARISONS_FILE,
    LEFT_OUT_FILE,
    PER_SEED_FILE,
    REPORT_FILE,
    comparison_section,
    left_out_section,
    markdown_table,
)
from analysis.verdicts import DEFAULT_BASELINE, PRIMARY, arm_comparisons, baseline_arm

START_TOLERANCE = 1e-9  # starts are the same evaluation of the same weights: equal up to the CSV's printing
_LEADING = ["run", "arm", "seed"]  # a per-seed table's first columns; the swept axes follow, then "start"
_OUTPUT = {REPORT_FILE, PER_SEED_FILE, COMPARISONS_FILE, LEFT_OUT_FILE}  # what a comparison writes (and replaces)


class Source(NamedTuple):
    """One input: its per-seed table and the arms taken from it (`{arm: name}`; empty: every arm, as named)."""

    path: Path
    arms: dict[str, str]

    @classmethod
    def parse(cls, text: str) -> Source:
        """`PATH` or `PATH:ARM[=NAME],...`; a folder is a report's (its per-seed table)."""
        path, colon, picks = text.rpartition(":")
        if not colon or "/" in picks:
            path, picks = text, ""
        arms = {}
        for pick in filter(None, picks.split(",")):
            arm, _, name = pick.partition("=")
            arms[arm] = name or arm
        return cls(per_seed_file(Path(path)), arms)


def per_seed_file(path: Path) -> Path:
    """The per-seed table `path` names: the CSV itself, or a report folder's; a `ValueError` when there is none."""
    if path.is_dir():
        path = path / PER_SEED_FILE
    if not path.is_file():
        raise ValueError(f"{path} does not exist: give a report folder (with {PER_SEED_FILE}) or a per-seed CSV")
    return path


def read_per_seed(path: Path) -> tuple[pd.DataFrame, list[str]]:
    """One report's per-seed table (seeds and starts as text, as reports hold them) and its swept axes: the columns
    between `seed` and `start`. A table from before per-seed tables named the start and said what counted gets
    `start_sha256` = unknown and `counted` from `incomplete` (an incomplete run: excluded)."""
    table = pd.read_csv(path, dtype={"seed": str, "start_sha256": str, "start_recipe": str})
    required = [*_LEADING, "start", *GAIN_MEASURES]
    missing = [column for column in required if column not in table.columns]
    if missing or list(table.columns[:3]) != _LEADING:
        lacks = ", ".join(missing) if missing else f"the leading columns {_LEADING}"
        raise ValueError(f"{path} is not a per-seed table of analysis.report: it lacks {lacks}")
    columns = list(table.columns)
    axes = columns[3 : columns.index("start")]
    if "start_sha256" not in table:
        table["start_sha256"] = UNKNOWN_START
    table["start_sha256"] = table["start_sha256"].fillna(UNKNOWN_START)
    if "counted" not in table:
        # A table that says neither counts every run (nothing marked incomplete).
        incomplete = table["incomplete"].astype(bool) if "incomplete" in table else pd.Series(False, index=table.index)
        table["counted"] = pd.Series(COUNTED, index=table.index).where(~incomplete, EXCLUDED)
    return table, axes


def pool(sources: Sequence[Source | Path]) -> tuple[pd.DataFrame, list[str], list[str]]:
    """The rows of every per-seed table (the arms each source names, renamed), with `source`, checked to pair (see
    the module's docstring), and what the report must say of how the starts were checked (empty: every row named its
    start)."""
    tables: list[pd.DataFrame] = []
    axes: list[str] | None = None
    inputs = [source if isinstance(source, Source) else Source(source, {}) for source in sources]
    for path, arms in inputs:
        table, own_axes = read_per_seed(path)
        if axes is not None and set(own_axes) != set(axes):
            raise ValueError(
                f"{path} sweeps {own_axes or 'no axis'} but {inputs[0].path} sweeps "
                f"{axes or 'no axis'}: arms pair only within one cell of the same axes"
            )
        axes = own_axes
        if arms:
            absent = sorted(set(arms) - set(table["arm"]))
            if absent:
                raise ValueError(
                    f"{path} has no arm {', '.join(map(repr, absent))}; its arms: "
                    f"{', '.join(sorted(set(table['arm'])))}"
                )
            kept = table[table["arm"].isin(arms)]
            table = kept.assign(arm=kept["arm"].map(arms))
        tables.append(table.assign(source=str(path)))
    rows = pd.concat(tables, ignore_index=True)
    assert axes is not None  # set by the first table: pd.concat above refuses none
    notes = _assume_starts(rows, axes)
    counted = rows[rows["counted"] != EXCLUDED]
    key = ["arm", *axes, "start_sha256", "seed"]
    twice = counted[counted.duplicated(key, keep=False)]
    if not twice.empty:
        first = twice.iloc[0]
        where = "; ".join(f"{r.run} in {r.source}" for r in twice[(twice[key] == first[key]).all(axis=1)].itertuples())
        raise ValueError(
            f"arm {first['arm']!r} seed {first['seed']} has more than one run ({where}): a paired "
            "comparison takes one run per arm, cell, start and seed"
        )
    for _, runs in counted.groupby([*axes, "seed"], dropna=False):
        _refuse_foreign_starts(runs)
    if "start_recipe" in counted:
        for _, runs in counted.groupby(axes, dropna=False) if axes else [((), counted)]:
            refuse_two_recipes(runs)
    for _, runs in counted.groupby([*axes, "start_sha256", "seed"], dropna=False):
        low, high = runs["start"].idxmin(), runs["start"].idxmax()
        if cell_at(runs, high, "start") - cell_at(runs, low, "start") > START_TOLERANCE:
            raise ValueError(
                f"seed {cell_at(runs, low, 'seed')}: {cell_at(runs, low, 'run')} ({cell_at(runs, low, 'source')}) "
                f"starts at {cell_at(runs, low, 'start'):.4f} held-out accuracy, {cell_at(runs, high, 'run')} "
                f"({cell_at(runs, high, 'source')}) at {cell_at(runs, high, 'start'):.4f}: they did not start from "
                "the same checkpoint on the same prompts, and pairing them would compare their starts"
            )
    return rows, axes, notes


def _refuse_foreign_starts(runs: pd.DataFrame) -> None:
    """At one seed of one cell: two arms that share no start are from different cold starts (one line naming both)."""
    # An arm's name is text; pandas types a group's key as any scalar.
    starts = {cast(str, arm): set(part["start_sha256"]) for arm, part in runs.groupby("arm")}
    for arm, own in starts.items():
        for other, theirs in starts.items():
            if arm < other and not own & theirs:
                a = runs[runs["arm"] == arm].iloc[0]
                b = runs[runs["arm"] == other].iloc[0]
                raise ValueError(
                    f"seed {a['seed']}: {a['run']} ({a['source']}) started from {_start(a)}, {b['run']} "
                    f"({b['source']}) from {_start(b)}: runs from other cold starts do not pair, whatever their "
                    "held-out start accuracy"
                )


def refuse_two_recipes(runs: pd.DataFrame) -> None:
    """In one cell: starts made by two cold-start recipes (their tables' `start_recipe`, the sha256 of each start's SFT
    settings; empty where a report did not know it) are never pooled as draws of one (one line naming both)."""
    known = runs[runs["start_recipe"].fillna("").astype(str) != ""].drop_duplicates("start_recipe")
    if len(known) > 1:
        a, b = known.iloc[0], known.iloc[1]
        raise ValueError(
            f"{a['run']} ({a['source']}) started from {_start(a)} of recipe {a['start_recipe'][:12]}, {b['run']} "
            f"({b['source']}) from {_start(b)} of recipe {b['start_recipe'][:12]}: a comparison across starts pools "
            "them as draws of one recipe, which they are not; compare each recipe's runs apart"
        )


def _start(row: pd.Series) -> str:
    return f"sha256 {row['start_sha256'][:12]}" if row["start_sha256"] != UNKNOWN_START else "an unnamed start"


def _assume_starts(rows: pd.DataFrame, axes: list[str]) -> list[str]:
    """Give each row whose table named no start the start of the named rows at its cell and seed that start at the same
    held-out accuracy (in place); returns what the report says of it."""
    unnamed = rows["start_sha256"] == UNKNOWN_START
    if not unnamed.any():
        return []
    if unnamed.all():
        return [
            "No table names its runs' start (they were written before per-seed tables recorded the weights' "
            "sha256): the runs of a seed are taken to share a start because their held-out start accuracy is "
            "the same, which two different starts can share (at 0, or on few evaluation prompts); the pairing "
            "is not checked beyond that."
        ]
    assumed = 0
    for _, part in rows.groupby([*axes, "seed"], dropna=False):
        named = part[part["start_sha256"] != UNKNOWN_START]
        for index in part.index[part["start_sha256"] == UNKNOWN_START]:
            same = named[(named["start"] - cell_at(rows, index, "start")).abs() <= START_TOLERANCE]
            if same["start_sha256"].nunique() == 1:
                rows.at[index, "start_sha256"] = same["start_sha256"].iloc[0]
                assumed += 1
    tables = ", ".join(f"`{source}`" for source in dict.fromkeys(rows.loc[unnamed, "source"]))
    return [
        f"{tables} name no start (written before per-seed tables recorded the weights' sha256): {assumed} of "
        f"their {int(unnamed.sum())} rows are taken to come from the named start whose runs at the same seed "
        "start at the same held-out accuracy — an assumption that accuracy alone supports, not a check of the "
        "weights."
    ]


def _arms_section(rows: pd.DataFrame) -> list[str]:
    """Each arm's seeds and mean ± sample std per measure, with where its rows came from."""
    table = []
    for arm, part in rows.groupby("arm", sort=True):
        table.append(
            [
                arm,
                len(part),
                *[f"{part[m].mean():+.3f} ± {part[m].std():.3f}" for m in GAIN_MEASURES],
                ", ".join(f"`{source}`" for source in dict.fromkeys(part["source"])),
            ]
        )
    return [
        "## Arms",
        "",
        markdown_table(["arm", "runs", *GAIN_MEASURES, "from"], table),
        "",
        # The committed comparisons hold this sentence as written, before GAIN_MEASURES moved to analysis/gains.py:
        # a new wording is a regeneration of every committed comparison (tests/test_committed_reports.py).
        "Mean ± sample std over each arm's runs; the measures are those of analysis.report "
        "(analysis/aggregate.py `GAIN_MEASURES`).",
    ]


def write_comparison(
    rows: pd.DataFrame,
    axes: list[str],
    baseline: str | None,
    out_dir: Path,
    command: str = "",
    declaration: declared.Declaration | None = None,
    notes: Sequence[str] = (),
) -> Path:
    """comparisons.csv, the pooled per_seed.csv and report.md in `out_dir` (through a staging folder); returns the
    path of report.md. `declaration`: the command line's baseline, primary summary and family (default: the schema's);
    `notes`: what `pool` said of the starts."""
    declaration = (declaration or declared.Declaration(read_from="tables")).checked(rows["arm"])
    reference = baseline_arm(rows, baseline or declaration.baseline)
    arms = sorted(set(rows["arm"]))
    declaration = replace(declaration, baseline=reference)
    varied = [key for key in axes if rows[key].nunique() > 1]
    comparisons = arm_comparisons(rows, reference, varied, declaration.primary, declaration.family_of(arms))
    excluded = rows[rows["counted"] == EXCLUDED]
    status = excluded["status"] if "status" in excluded else pd.Series("incomplete", index=excluded.index)
    named = pd.DataFrame(
        {
            "arm": excluded["arm"],
            "seed": excluded["seed"],
            **{key: excluded[key] for key in varied},
            "start_sha256": excluded["start_sha256"],
            "run": excluded["run"],
            "why": [
                f"did not finish ({state}, in {source}): a run that did not finish never counts"
                for source, state in zip(excluded["source"], status)
            ],
        },
        columns=[*LEFT_OUT_COLUMNS[:2], *varied, *LEFT_OUT_COLUMNS[2:]],
    )
    left_out = with_missing_units(named, rows, varied)
    checked = (
        "checked to pair: one run per arm, cell, start and seed; at each seed, arms from a shared cold start "
        "(its weights' sha256), with one held-out start accuracy per start"
        if not notes
        else "checked: one run per arm, cell and seed, with one held-out start accuracy at each seed; what the "
        "starts' identity rests on is said below"
    )
    lines = [
        "# Arms compared from per-seed tables",
        "",
        f"{len(rows)} runs of {rows['arm'].nunique()} arms pooled from {rows['source'].nunique()} per-seed "
        f"tables, {checked}.",
    ]
    for note in notes:
        lines += ["", note]
    if command:
        lines += ["", f"Made with `{command}`."]
    size = int((comparisons["role"] == PRIMARY).sum()) if not comparisons.empty else 0
    lines += [
        "",
        *_arms_section(rows),
        "",
        *declaration.lines(arms, size),
        "",
        *comparison_section(comparisons, varied, reference),
        "",
        *left_out_section(left_out, varied),
    ]
    with staged(out_dir, _OUTPUT.__contains__, REPORT_FILE) as stage:
        rows.to_csv(stage / PER_SEED_FILE, index=False)
        comparisons.to_csv(stage / COMPARISONS_FILE, index=False)
        left_out.to_csv(stage / LEFT_OUT_FILE, index=False)
        (stage / REPORT_FILE).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out_dir / REPORT_FILE


def arguments(parser: argparse.ArgumentParser) -> None:
    """The per-seed tables (each with the arms to take from it), the declaration's fields, where the report goes."""
    parser.add_argument(
        "inputs",
        nargs="+",
        metavar="REPORT_OR_CSV[:ARM[=NAME],...]",
        help=f"report folders (their {PER_SEED_FILE}) or per-seed CSVs, each optionally with the arms "
        "to take from it, renamed where =NAME says",
    )
    declared.add_flags(
        parser,
        baseline_help=f"the arm every other is compared with (default: {DEFAULT_BASELINE} "
        "when present, else the first)",
    )
    parser.add_argument("--out", type=Path, required=True, help="output folder")


def read(args: argparse.Namespace) -> tuple[pd.DataFrame, list[str], list[str], declared.Declaration]:
    """The pooled rows checked to pair (`pool`), their axes and what was said of their starts, the command line's
    declaration checked against their arms; the output folder proved writable."""
    rows, axes, notes = pool([Source.parse(text) for text in args.inputs])
    declaration = replace(
        declared.read({}, declared.overrides(args, ("baseline", "primary", "family"))), read_from="tables"
    )
    declaration.checked(rows["arm"])
    baseline_arm(rows, args.baseline)
    writable_out(args.out)
    return rows, axes, notes, declaration


def write(
    pooled: tuple[pd.DataFrame, list[str], list[str], declared.Declaration], args: argparse.Namespace, command: str
) -> str:
    """The comparison of what `read` pooled; the line saying where its report is."""
    rows, axes, notes, declaration = pooled
    return f"report: {write_comparison(rows, axes, args.baseline, args.out, command, declaration, notes)}"


main = Command(
    "analysis.compare", __doc__, arguments, read, write, around=lambda args: publishing(args.out, REPORT_FILE)
).main

if __name__ == "__main__":
    main()
