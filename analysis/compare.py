"""`python -m analysis.compare`: arms compared from the per-seed tables of several reports, without their logs.

    python -m analysis.compare REPORT_OR_CSV[:ARM[=NAME],...]... [--baseline ARM] --out DIR
    python -m analysis.compare docs/results/deep_long_seeds:gspo reports/confound_step:grpo=grpo-lr2.7e-4 \
        --baseline grpo-lr2.7e-4 --out reports/gspo_vs_matched_grpo

Each input is a report folder (its `per_seed.csv`) or a per-seed CSV that `analysis.report` wrote, optionally
followed by the arms to take from it, each renamed where `=NAME` says (two inputs holding one arm name under
different settings, GRPO at two learning rates say, are told apart by renaming one). Their rows are
pooled and every arm is compared with the baseline arm exactly as a report compares the arms of one sweep
(`aggregate.arm_comparisons`: paired over shared seeds, per cell of the swept axes and per gain measure). This is
how arms run in different sweeps, sessions or machines meet — a new arm against a committed result, an outside
re-run against ours — and the pairing is only honest when the runs of one seed started from the same place, so the
inputs are checked first: the same swept axes in every file, one run per arm, cell and seed, and, for each cell and
seed, one held-out start accuracy across arms (a different start means another cold start or other eval prompts:
refused, naming both files). Writes `comparisons.csv`, the pooled `per_seed.csv` (with each row's `source`) and
`report.md`. Bad input ends with one `error:` line and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import pandas as pd

from analysis import aggregate as agg
from analysis.cli import command_line, refusing, writable_out
from analysis.report import COMPARISONS_FILE, PER_SEED_FILE, REPORT_FILE, comparison_section, markdown_table

START_TOLERANCE = 1e-9  # starts are the same evaluation of the same weights: equal up to the CSV's printing
_LEADING = ["run", "arm", "seed"]  # a per-seed table's first columns; the swept axes follow, then "start"


class Source(NamedTuple):
    """One input: its per-seed table and the arms taken from it (`{arm: name}`; empty: every arm, as named)."""

    path: Path
    arms: dict[str, str]

    @classmethod
    def parse(cls, text: str) -> "Source":
        """`PATH` or `PATH:ARM[=NAME],...`; a folder is a report's (its per-seed table)."""
        path, colon, picks = text.rpartition(":")
        if not colon or "/" in picks:
            path, picks = text, ""
        arms = {}
        for pick in filter(None, picks.split(",")):
            arm, _, name = pick.partition("=")
            arms[arm] = name or arm
        return cls(_per_seed_file(Path(path)), arms)


def _per_seed_file(path: Path) -> Path:
    if path.is_dir():
        path = path / PER_SEED_FILE
    if not path.is_file():
        raise ValueError(f"{path} does not exist: give a report folder (with {PER_SEED_FILE}) or a per-seed CSV")
    return path


def read_per_seed(path: Path) -> tuple[pd.DataFrame, list[str]]:
    """One report's per-seed table (seeds as text, as reports hold them) and its swept axes: the columns between
    `seed` and `start`."""
    table = pd.read_csv(path, dtype={"seed": str})
    required = [*_LEADING, "start", *agg.GAIN_MEASURES]
    missing = [column for column in required if column not in table.columns]
    if missing or list(table.columns[:3]) != _LEADING:
        lacks = ", ".join(missing) if missing else f"the leading columns {_LEADING}"
        raise ValueError(f"{path} is not a per-seed table of analysis.report: it lacks {lacks}")
    columns = list(table.columns)
    return table, columns[3:columns.index("start")]


def pool(sources: Sequence[Source | Path]) -> tuple[pd.DataFrame, list[str]]:
    """The rows of every per-seed table (the arms each source names, renamed), with `source`, checked to pair: see
    the module's docstring."""
    tables, axes = [], None
    sources = [source if isinstance(source, Source) else Source(source, {}) for source in sources]
    for path, arms in sources:
        table, own_axes = read_per_seed(path)
        if axes is not None and set(own_axes) != set(axes):
            raise ValueError(f"{path} sweeps {own_axes or 'no axis'} but {sources[0].path} sweeps "
                             f"{axes or 'no axis'}: arms pair only within one cell of the same axes")
        axes = own_axes
        if arms:
            absent = sorted(set(arms) - set(table["arm"]))
            if absent:
                raise ValueError(f"{path} has no arm {', '.join(map(repr, absent))}; its arms: "
                                 f"{', '.join(sorted(set(table['arm'])))}")
            table = table[table["arm"].isin(arms)].assign(arm=lambda t: t["arm"].map(arms))
        tables.append(table.assign(source=str(path)))
    rows = pd.concat(tables, ignore_index=True)
    key = ["arm", *axes, "seed"]
    twice = rows[rows.duplicated(key, keep=False)]
    if not twice.empty:
        first = twice.iloc[0]
        where = "; ".join(f"{r.run} in {r.source}" for r in twice[(twice[key] == first[key]).all(axis=1)].itertuples())
        raise ValueError(f"arm {first['arm']!r} seed {first['seed']} has more than one run ({where}): a paired "
                         "comparison takes one run per arm, cell and seed")
    for _, runs in rows.groupby([*axes, "seed"], dropna=False):
        low, high = runs["start"].idxmin(), runs["start"].idxmax()
        if runs.at[high, "start"] - runs.at[low, "start"] > START_TOLERANCE:
            raise ValueError(
                f"seed {runs.at[low, 'seed']}: {runs.at[low, 'run']} ({runs.at[low, 'source']}) starts at "
                f"{runs.at[low, 'start']:.4f} held-out accuracy, {runs.at[high, 'run']} ({runs.at[high, 'source']}) at "
                f"{runs.at[high, 'start']:.4f}: they did not start from the same checkpoint on the same prompts, and "
                "pairing them would compare their starts")
    return rows, axes


def _arms_section(rows: pd.DataFrame) -> list[str]:
    """Each arm's seeds and mean ± sample std per measure, with where its rows came from."""
    table = []
    for arm, part in rows.groupby("arm", sort=True):
        table.append([arm, len(part), *[f"{part[m].mean():+.3f} ± {part[m].std():.3f}" for m in agg.GAIN_MEASURES],
                      ", ".join(f"`{source}`" for source in dict.fromkeys(part["source"]))])
    return ["## Arms", "", markdown_table(["arm", "runs", *agg.GAIN_MEASURES, "from"], table), "",
            "Mean ± sample std over each arm's runs; the measures are those of analysis.report "
            "(analysis/aggregate.py `GAIN_MEASURES`)."]


def write_comparison(rows: pd.DataFrame, axes: list[str], baseline: str | None, out_dir: Path,
                     command: str = "") -> Path:
    """comparisons.csv, the pooled per_seed.csv and report.md in `out_dir`; returns the path of report.md."""
    reference = agg.baseline_arm(rows, baseline)
    varied = [key for key in axes if rows[key].nunique() > 1]
    comparisons = agg.arm_comparisons(rows, reference, varied)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows.to_csv(out_dir / PER_SEED_FILE, index=False)
    comparisons.to_csv(out_dir / COMPARISONS_FILE, index=False)
    lines = ["# Arms compared from per-seed tables", "",
             f"{len(rows)} runs of {rows['arm'].nunique()} arms pooled from {rows['source'].nunique()} per-seed "
             "tables, checked to pair: one run per arm, cell and seed, and every arm of a seed starting from the "
             "same held-out accuracy."]
    if command:
        lines += ["", f"Made with `{command}`."]
    lines += ["", *_arms_section(rows), "", *comparison_section(comparisons, varied, reference)]
    report = out_dir / REPORT_FILE
    report.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return report


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m analysis.compare",
                                     description="Paired comparisons of arms pooled from reports' per-seed tables.")
    parser.add_argument("inputs", nargs="+", metavar="REPORT_OR_CSV[:ARM[=NAME],...]",
                        help=f"report folders (their {PER_SEED_FILE}) or per-seed CSVs, each optionally with the arms "
                             "to take from it, renamed where =NAME says")
    parser.add_argument("--baseline", metavar="ARM", help=f"the arm every other is compared with (default: "
                                                          f"{agg.DEFAULT_BASELINE} when present, else the first)")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    args = parser.parse_args(argv)
    with refusing():
        rows, axes = pool([Source.parse(text) for text in args.inputs])
        agg.baseline_arm(rows, args.baseline)
        writable_out(args.out)
    command = command_line("analysis.compare", argv)
    print(f"report: {write_comparison(rows, axes, args.baseline, args.out, command)}")


if __name__ == "__main__":
    main()
