"""`python -m analysis.family`: a declared family of comparisons across lags of the staleness study (by default the
pre-registered five), from the per-seed tables of the MoE rung's cells and, where the family compares models, of the
dense control's.

    python -m analysis.family --moe REPORT_OR_CSV --dense REPORT_OR_CSV --lag K --out DIR
    python -m analysis.family --family docs/results/async/exploratory_n4_family.yaml --moe REPORT_OR_CSV --lag 2 \
        --out DIR

A family is a data file beside the document that declared it, before its runs were read (`load_family`; a new family
is a new file): docs/results/async/family.yaml, the pre-registration's (docs/results/async/preregistration.md,
"Measure, family, verdict"): three differences of two arms at k* and a difference of two arms' falls from lag 0 to k*,
each paired per (start, seed) on the MoE rung, and the interaction of `minirl`'s fall on the MoE rung with its fall on
the dense control, unpaired between the two models; docs/results/async/exploratory_n4_family.yaml
(docs/results/async/exploratory_n4.md, outside the declared family): `minirl`'s fall and `minirl + r3` − `minirl` at
k, on the MoE rung alone. Each is computed on gain_area as analysis/contrasts.py says, with Holm's
correction over the family. Each table is read and checked as `analysis.compare` reads one (`compare.pool`: one run
per arm, lag, start and seed; arms of a seed from one start; runs that did not finish left out), and then refused in
one line where the family cannot be computed from it: no `rollout.lag` column, another axis varied, a lag (0 or k*) or
an arm the family needs absent, runs that name no start, fewer than 2 starts with a unit a comparison can use, starts
of two cold-start recipes in one table, a start on both models, or a dense table that holds an arm with routing (the
dense control runs only the arms without); `--dense` is refused for a family that compares no models and needed for
one that does. Writes `contrasts.csv` (every comparison's numbers), `units.csv` (every unit's value), `left_out.csv`
(every unit a comparison left out, with why) and `report.md`, through a staging folder.
Bad input ends with one `error:` line and exit code 2.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import pandas as pd

from analysis.cli import Command, publishing, staged, writable_out
from analysis.compare import Source, per_seed_file, pool, refuse_two_recipes
from analysis.contrasts import (
    DEFAULT_FAMILY,
    DIFFERENCE,
    FALL,
    FALL_DIFFERENCE,
    INTERACTION,
    LAG,
    MEASURE,
    WHY_COLUMNS,
    Contrast,
    Family,
    Judged,
    Values,
    judge,
    load_family,
    needed_runs,
    unit_values,
)
from analysis.gains import EXCLUDED
from analysis.records import UNKNOWN_START, rows_as_dicts
from analysis.statistics import ALPHA, AcrossStarts, smallest_p
from analysis.tables import LEFT_OUT_FILE, REPORT_FILE, markdown_table
from analysis.unpaired import smallest_permutation_p

MOE, DENSE = "moe", "dense"  # the two tables, as their flags and the output's `model` column name them
CONTRASTS_FILE, UNITS_FILE = "contrasts.csv", "units.csv"
_OUTPUT = {REPORT_FILE, CONTRASTS_FILE, UNITS_FILE, LEFT_OUT_FILE}  # what the command writes (and replaces)


class Read(NamedTuple):
    """What the command computes from: the family and its comparisons at k*, each comparison's per-unit values per
    model, the units left out, and each table's path."""

    declared: Family
    family: tuple[Contrast, ...]
    values: list[dict[str, Values]]  # per comparison, {model: values}; a paired comparison reads the MoE table only
    left_out: pd.DataFrame
    paths: dict[str, Path]


def read_table(path: Path, flag: str, lag: int, arms: Sequence[str] | None) -> pd.DataFrame:
    """One model's per-seed table, pooled and checked as `analysis.compare` pools one (`compare.pool`), then refused
    where the family cannot be computed from it (the module's docstring); `arms`: the only arms it may hold."""
    rows, axes, _ = pool([Source(path, {})])
    counted = rows[rows["counted"] != EXCLUDED]
    if LAG not in axes:
        raise ValueError(
            f"--{flag} {path} has no {LAG} column among its swept axes ({', '.join(axes) or 'none'}): "
            "not a table of the staleness study"
        )
    varied = [axis for axis in axes if axis != LAG and counted[axis].nunique() > 1]
    if varied:
        raise ValueError(
            f"--{flag} {path} varies {', '.join(varied)} beside {LAG}: a contrast pools one cell's runs "
            "across lags; give a table of one cell"
        )
    unnamed = counted[counted["start_sha256"] == UNKNOWN_START]
    if not unnamed.empty:
        raise ValueError(
            f"--{flag} {path}: {len(unnamed)} runs name no start (start_sha256), {unnamed['run'].iloc[0]} "
            "first: the contrasts are computed per start"
        )
    if "start_recipe" in counted:
        refuse_two_recipes(counted)
    if arms is not None:
        foreign = sorted(set(rows["arm"]) - set(arms))
        if foreign:
            raise ValueError(
                f"--{flag} {path} holds {', '.join(map(repr, foreign))}: the dense control runs only the "
                f"arms without routing ({', '.join(arms)})"
            )
    lags = sorted(set(counted[LAG].astype(float)))
    for needed in sorted({0, lag}):
        if float(needed) not in lags:
            raise ValueError(
                f"--{flag} {path} has no counted run at {LAG} {needed}; its lags: "
                f"{', '.join(f'{value:g}' for value in lags) or 'none'}"
            )
    starts = counted["start_sha256"].nunique()
    if starts < 2:
        raise ValueError(
            f"--{flag} {path} holds {starts} start(s): the family's intervals and tests are over starts, "
            "and need at least 2"
        )
    return rows


def missing_arm(rows: pd.DataFrame, path: Path, flag: str, family: Sequence[Contrast]) -> str | None:
    """The first (arm, lag) the family reads on this table that no counted run holds, as a refusal says it."""
    counted = rows[rows["counted"] != EXCLUDED]
    held = set(zip(counted["arm"], counted[LAG].astype(float)))
    for arm, lag in needed_runs(family):
        if (arm, float(lag)) not in held:
            arms = sorted(set(counted["arm"]))
            said = (
                f"has no arm {arm!r}; its arms: {', '.join(arms)}"
                if arm not in arms
                else f"has no counted run of {arm!r} at {LAG} {lag}"
            )
            return f"--{flag} {path} {said}: the declared family needs it"
    return None


def family_values(
    family: Sequence[Contrast], tables: dict[str, pd.DataFrame]
) -> tuple[list[dict[str, Values]], pd.DataFrame]:
    """Each comparison's per-unit values per model it reads, and every unit left out (with comparison and model);
    a comparison left with fewer than 2 starts on a model is refused, naming it."""
    values, left = [], []
    for contrast in family:
        models = (MOE, DENSE) if contrast.kind == INTERACTION else (MOE,)
        found = {}
        for model in models:
            found[model], out = unit_values(tables[model], contrast)
            left.append(out.assign(comparison=contrast.name, model=model))
            if len(found[model]) < 2:
                raise ValueError(
                    f"comparison {contrast.name} ({contrast.text}) has {len(found[model])} start(s) with "
                    f"a complete unit on the {model} table ({len(out)} units left out): it needs 2"
                )
        values.append(found)
    return values, pd.concat(left, ignore_index=True)[["comparison", "model", *WHY_COLUMNS]]


def arguments(parser: argparse.ArgumentParser) -> None:
    """The family, the models' per-seed tables, k*, where the report goes."""
    parser.add_argument(
        "--family",
        type=Path,
        default=DEFAULT_FAMILY,
        metavar="FILE",
        help="the declared family to judge, a yaml file beside the document that declared it "
        "(default: docs/results/async/family.yaml, the pre-registration's five)",
    )
    parser.add_argument(
        "--moe",
        type=Path,
        required=True,
        metavar="REPORT_OR_CSV",
        help="the MoE rung's cells: a report folder (its per_seed.csv) or a per-seed CSV",
    )
    parser.add_argument(
        "--dense",
        type=Path,
        metavar="REPORT_OR_CSV",
        help="the dense control's cells (a report folder or a per-seed CSV): needed by, and only by, a "
        "family that compares the two models",
    )
    parser.add_argument(
        "--lag",
        type=int,
        required=True,
        metavar="K",
        help="k*, the lag the pre-registered rule picked (docs/results/async/command.sh rule)",
    )
    parser.add_argument("--out", type=Path, required=True, help="output folder")


def check(args: argparse.Namespace) -> str | None:
    """A lag below 1 has no fall from lag 0 to compare; the dense table given where the family reads none, or missing
    where it does."""
    if args.lag < 1:
        return f"--lag {args.lag}: k* is a lag above 0 (a fall is from lag 0 to k*)"
    try:
        needs_dense = load_family(args.family).compares_models
    except ValueError as error:
        return str(error)
    if needs_dense and args.dense is None:
        return f"--family {args.family} compares the MoE rung with the dense control: give --dense REPORT_OR_CSV"
    if not needs_dense and args.dense is not None:
        return f"--dense {args.dense}: --family {args.family} compares no models, and reads the MoE rung's table alone"
    return None


def read(args: argparse.Namespace) -> Read:
    """The family's tables read and checked, its per-unit values computed and checked; the output folder proved
    writable."""
    declared = load_family(args.family)
    family = tuple(contrast.at(args.lag) for contrast in declared.contrasts)
    paths = {MOE: per_seed_file(args.moe)}
    tables = {MOE: read_table(paths[MOE], MOE, args.lag, None)}
    if declared.compares_models:
        paths[DENSE] = per_seed_file(args.dense)
        tables[DENSE] = read_table(paths[DENSE], DENSE, args.lag, declared.dense_arms)
        shared = set(tables[MOE]["start_sha256"]) & set(tables[DENSE]["start_sha256"])
        if shared:
            raise ValueError(
                f"start {sorted(shared)[0][:12]} is in both --moe {paths[MOE]} and --dense "
                f"{paths[DENSE]}: the interaction compares two models, each from its own starts"
            )
    for model in tables:
        reads = family if model == MOE else [contrast for contrast in family if contrast.kind == INTERACTION]
        problem = missing_arm(tables[model], paths[model], model, reads)
        if problem:
            raise ValueError(problem)
    values, left_out = family_values(family, tables)
    writable_out(args.out)
    return Read(declared, family, values, left_out, paths)


def report_lines(judged: Sequence[Judged], read: Read, command: str) -> list[str]:
    """report.md: the family's table, how each comparison is computed and the smallest p it can reach, the units
    left out."""
    m = len(judged)
    rows, reach = [], []
    for result, values in zip(judged, read.values):
        stats = result.statistics
        sides = [values[MOE]] if result.contrast.kind != INTERACTION else [values[MOE], values[DENSE]]
        per_start = [stats.per_start] if isinstance(stats, AcrossStarts) else list(stats.per_start)  # one side: paired
        units = ", ".join(
            f"{len(side)} × {_seeds(side)}" + (f" {model}" if len(sides) > 1 else "")
            for side, model in zip(sides, (MOE, DENSE))
        )
        shown = "; ".join(
            (f"{model}: " if len(sides) > 1 else "")
            + ", ".join(f"{start[:12]} {value:+.3f}" for start, value in starts.items())
            for starts, model in zip(per_start, (MOE, DENSE))
        )
        rows.append(
            [
                f"{result.contrast.name}: {result.contrast.text}",
                units,
                stats.difference.text(),
                f"{stats.p_value:.3g}",
                f"{result.holm_p:.3g}",
                shown,
                "yes" if stats.signs_agree else "no",
                result.verdict,
            ]
        )
        best = (
            smallest_permutation_p(len(sides[0]), len(sides[1]), m) if len(sides) > 1 else smallest_p(len(sides[0]), m)
        )
        reach.append(f"{result.contrast.name} {best:.3g}")
    kinds = {contrast.kind for contrast in read.family}
    paired = [
        what
        for kind, what in (
            (DIFFERENCE, "the difference of two arms at k*"),
            (FALL, "an arm's fall"),
            (FALL_DIFFERENCE, "the difference of two arms' falls"),
        )
        if kind in kinds
    ]
    model_names = {MOE: "the MoE rung", DENSE: "the dense control"}
    tables = " and ".join(f"`{path}` ({model_names[model]})" for model, path in read.paths.items())
    starts = {
        model: sorted({start for values in read.values for start in values.get(model, {})}) for model in read.paths
    }
    lines = [
        f"# {read.declared.title}",
        "",
        f"The {m} comparisons of {read.declared.declared} at k* = {read.family[0].lag}, on {MEASURE}, from "
        f"{tables}. Cold starts (the weights' sha256, its first 12 digits): "
        + "; ".join(
            f"{model_names[model]}'s {len(shas)}, " + ", ".join(f"`{sha[:12]}`" for sha in shas)
            for model, shas in starts.items()
        )
        + ".",
    ]
    if command:
        lines += ["", f"Made with `{command}`."]
    how = ["A fall is an arm's gain_area at lag 0 minus at k* (positive: it learns less behind)."]
    if paired:
        how.append(
            f"{_named(read.family, DIFFERENCE, FALL, FALL_DIFFERENCE)} paired per (start, seed) on the MoE "
            f"rung ({'; '.join(paired)}): the estimate is the mean over starts of each start's mean over its "
            "seeds, the interval the two-level bootstrap (starts resampled, then seeds within each drawn "
            "start; every start weighted equally), the p the exact sign-flip test on the starts' values."
        )
    if INTERACTION in kinds:
        how.append(
            f"{_named(read.family, INTERACTION)} unpaired between the two models: each start's fall with its "
            "seeds averaged; the interval is each model's two-level bootstrap apart and the difference of their "
            "draws, the p the two-sided permutation test of the starts' falls between the models (exact up to "
            "200,000 splits); its signs agree when every MoE start lies beyond every dense start."
        )
    how.append(
        f"Holm's correction runs over the {m}; a comparison **separates** when its 95% interval excludes 0 and "
        f"its Holm p < {ALPHA:g}. The smallest Holm p each can reach, whatever the data (m · 2/2^K with K "
        "starts paired"
        + ("; m · 2/C(K1 + K2, K1) for the permutation test over K1 + K2 starts" if INTERACTION in kinds else "")
        + f"): {'; '.join(reach)}."
    )
    lines += [
        "",
        markdown_table(
            [
                "comparison",
                "units (starts × seeds)",
                "estimate [95% interval]",
                "start-level p",
                f"Holm p over {m}",
                "per-start values",
                "signs agree",
                "verdict",
            ],
            rows,
        ),
        "",
        " ".join(how),
        "",
    ]
    left = read.left_out
    if left.empty:
        return lines + [
            f"Every unit of {'both tables' if DENSE in read.paths else 'the table'} entered every "
            "comparison that reads it."
        ]
    table = [[r["comparison"], r["model"], r["start_sha256"][:12], r["seed"], r["why"]] for r in rows_as_dicts(left)]
    return lines + [
        f"## Units left out ({len(left)})",
        "",
        markdown_table(["comparison", "model", "start", "seed", "why"], table),
    ]


def _named(family: Sequence[Contrast], *kinds: str) -> str:
    """The comparisons of those kinds as a sentence's subject, with its verb: "Comparisons 1, 2 are"."""
    names = [contrast.name for contrast in family if contrast.kind in kinds]
    return f"Comparison {names[0]} is" if len(names) == 1 else f"Comparisons {', '.join(names)} are"


def _seeds(values: Values) -> str:
    counts = sorted({len(by_seed) for by_seed in values.values()})
    return str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"


def write(read: Read, args: argparse.Namespace, command: str) -> str:
    """The family judged from what `read` computed, its files through a staging folder; the line saying where its
    report is."""
    judged = judge(read.family, [[side for model, side in values.items()] for values in read.values])
    units = pd.DataFrame(
        [
            {"comparison": contrast.name, "model": model, "start_sha256": start, "seed": seed, "value": value}
            for contrast, values in zip(read.family, read.values)
            for model, side in values.items()
            for start, by_seed in side.items()
            for seed, value in by_seed.items()
        ]
    )
    with staged(args.out, _OUTPUT.__contains__, REPORT_FILE) as stage:
        pd.DataFrame([result.row() for result in judged]).to_csv(stage / CONTRASTS_FILE, index=False)
        units.to_csv(stage / UNITS_FILE, index=False)
        read.left_out.to_csv(stage / LEFT_OUT_FILE, index=False)
        (stage / REPORT_FILE).write_text("\n".join(report_lines(judged, read, command)) + "\n", encoding="utf-8")
    return f"report: {args.out / REPORT_FILE}"


main = Command(
    "analysis.family",
    __doc__,
    arguments,
    read,
    write,
    check=check,
    around=lambda args: publishing(args.out, REPORT_FILE),
).main

if __name__ == "__main__":
    main()
