"""`python -m analysis.family`: a declared family of comparisons (by default the staleness study's pre-registered
five), from per-seed tables given by name: the MoE rung's cells (`--moe`) and, where the family compares models, the
dense control's (`--dense`), or any table a contrast names (`--table NAME=REPORT_OR_CSV`).

    python -m analysis.family --moe REPORT_OR_CSV --dense REPORT_OR_CSV --lag K --out DIR
    python -m analysis.family --family docs/results/async/exploratory_n4_family.yaml --moe REPORT_OR_CSV --lag 2 \
        --out DIR
    python -m analysis.family --family docs/results/learning/family.yaml --table sigmoid=REPORT_OR_CSV \
        --table softmax=REPORT_OR_CSV --table staleness=REPORT_OR_CSV --lag K --out DIR

A family is a data file beside the document that declared it, before its runs were read (`load_family`; a new family
is a new file): docs/results/async/family.yaml, the pre-registration's (docs/results/async/preregistration.md,
"Measure, family, verdict"): three differences of two arms at k* and a difference of two arms' falls from lag 0 to k*,
each paired per (start, seed) on the MoE rung, and the interaction of `minirl`'s fall on the MoE rung with its fall on
the dense control, unpaired between the two models; docs/results/async/exploratory_n4_family.yaml
(docs/results/async/exploratory_n4.md, outside the declared family): `minirl`'s fall and `minirl + r3` − `minirl` at
k, on the MoE rung alone; docs/results/learning/family.yaml (docs/results/learning/preregistration.md): nine paired
differences on split_gain, six at lag 0 from the synchronous sweeps of two rungs and three at k* from the staleness
cells. Each is computed on the family's measure (gain_area unless it declares another) as analysis/contrasts.py
says, with Holm's correction over the family. Every table a contrast reads must be given and every table given read
(`--moe` and `--dense` are the tables named moe and dense); `--lag` (k*) is needed by, and only by, a family with a
contrast at k*. Each table is read, checked and refused in one line where the family cannot be computed from it as
analysis/family_tables.py says: a `rollout.lag` column absent where a contrast reads the table at k*, or holding a lag
other than 0 where every contrast reads it at lag 0; another axis varied; a lag or an arm the family needs absent;
runs that name no start or lack the measure; fewer than 2 starts with a unit a comparison can use; fewer starts
than a comparison needs to separate under Holm over the family, whatever the data (its smallest Holm p, m · 2/2^K or
the permutation test's, at or above 0.05), unless `--interim` asks for a reading while runs are missing, whose report
says that no verdict in it is final; starts of two
cold-start recipes in one table; a start on both models; or a dense table that holds an arm with routing (the dense
control runs only the arms without). Writes `contrasts.csv` (every comparison's numbers), `units.csv` (every unit's
value, its table in `model`), `left_out.csv` (every unit a comparison left out, with why) and `report.md`, through a
staging folder.
Bad input ends with one `error:` line and exit code 2.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import pandas as pd

from analysis.cli import Command, publishing, staged, writable_out
from analysis.compare import per_seed_file
from analysis.contrasts import (
    DEFAULT_FAMILY,
    DIFFERENCE,
    FALL,
    FALL_DIFFERENCE,
    INTERACTION,
    WHY_COLUMNS,
    Contrast,
    Family,
    Judged,
    Values,
    judge,
    load_family,
    unit_values,
)
from analysis.family_tables import named_table, read_tables, table_title, tables_given, unread_or_missing
from analysis.records import rows_as_dicts
from analysis.statistics import ALPHA, AcrossStarts, smallest_p
from analysis.tables import LEFT_OUT_FILE, REPORT_FILE, markdown_table
from analysis.unpaired import smallest_permutation_p

CONTRASTS_FILE, UNITS_FILE = "contrasts.csv", "units.csv"
_OUTPUT = {REPORT_FILE, CONTRASTS_FILE, UNITS_FILE, LEFT_OUT_FILE}  # what the command writes (and replaces)


class Read(NamedTuple):
    """What the command computes from: the family and its comparisons at k* (or lag 0), each comparison's per-unit
    values per table, the units left out, and each table's path (in the order the family first reads them)."""

    declared: Family
    family: tuple[Contrast, ...]
    values: list[dict[str, Values]]  # per comparison, {table: values}; a paired comparison reads one table
    left_out: pd.DataFrame
    paths: dict[str, Path]
    short: tuple[str, ...] = ()  # the comparisons too few starts keep from separating (read only with --interim)


def family_values(
    family: Sequence[Contrast], tables: dict[str, pd.DataFrame], measure: str
) -> tuple[list[dict[str, Values]], pd.DataFrame]:
    """Each comparison's per-unit values on `measure` per table it reads, and every unit left out (with comparison
    and table, as `model`); a comparison left with fewer than 2 starts on a table is refused, naming it."""
    values, left = [], []
    for contrast in family:
        found = {}
        for model in contrast.tables:
            found[model], out = unit_values(tables[model], contrast, measure)
            left.append(out.assign(comparison=contrast.name, model=model))
            if len(found[model]) < 2:
                raise ValueError(
                    f"comparison {contrast.name} ({contrast.text}) has {len(found[model])} start(s) with "
                    f"a complete unit on the {model} table ({len(out)} units left out): it needs 2"
                )
        values.append(found)
    return values, pd.concat(left, ignore_index=True)[["comparison", "model", *WHY_COLUMNS]]


def smallest_holm_p(sides: Sequence[Values], family: int) -> float:
    """The smallest Holm p a comparison of these starts can reach in a family of `family`, whatever the data: the
    exact sign-flip test's over the starts of one side (paired), the permutation test's between two (unpaired)."""
    if len(sides) > 1:
        return smallest_permutation_p(len(sides[0]), len(sides[1]), family)
    return smallest_p(len(sides[0]), family)


def too_few_starts(family: Sequence[Contrast], values: Sequence[dict[str, Values]]) -> list[str]:
    """The comparisons whose starts cannot reach a Holm p below `ALPHA` in this family (whatever the data, they
    cannot separate), as "names (their starts: the smallest p)", those alike together."""
    short: dict[str, list[str]] = {}
    for contrast, found in zip(family, values):
        best = smallest_holm_p(list(found.values()), len(family))
        if best >= ALPHA:
            starts = " and ".join(f"{len(side)} starts" for side in found.values())
            short.setdefault(f"{starts}: at best {best:.3g}", []).append(contrast.name)
    return [
        f"{'comparison' if len(names) == 1 else 'comparisons'} {', '.join(names)} ({why})"
        for why, names in short.items()
    ]


def arguments(parser: argparse.ArgumentParser) -> None:
    """The family, its per-seed tables by name, k*, where the report goes."""
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
        metavar="REPORT_OR_CSV",
        help="the table named moe, the MoE rung's cells: a report folder (its per_seed.csv) or a per-seed CSV",
    )
    parser.add_argument(
        "--dense",
        type=Path,
        metavar="REPORT_OR_CSV",
        help="the table named dense, the dense control's cells (a report folder or a per-seed CSV), which an "
        "interaction compares with moe",
    )
    parser.add_argument(
        "--table",
        type=named_table,
        action="append",
        metavar="NAME=REPORT_OR_CSV",
        help="a table a contrast names (`table:` in the family file), as a report folder or a per-seed CSV; repeat "
        "for each",
    )
    parser.add_argument(
        "--lag",
        type=int,
        metavar="K",
        help="k*, the lag the study's pre-registered rule picked (docs/results/async/command.sh rule): needed by, "
        "and only by, a family with a contrast at k*",
    )
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument(
        "--interim",
        action="store_true",
        help="judge a family some of whose comparisons have too few starts to separate (a reading while runs are "
        "missing): refused without it; the report then says no verdict is final",
    )


def check(args: argparse.Namespace) -> str | None:
    """A lag below 1 has no fall from lag 0 to compare; k* missing where a contrast is at k*, or given where none is;
    a table given twice, missing where a contrast reads it, or given where none does."""
    if args.lag is not None and args.lag < 1:
        return f"--lag {args.lag}: k* is a lag above 0 (a fall is from lag 0 to k*)"
    try:
        declared = load_family(args.family)
        tables = tables_given(args)
    except ValueError as error:
        return str(error)
    at_k_star = ", ".join(contrast.name for contrast in declared.at_k_star)
    if at_k_star and args.lag is None:
        return f"--family {args.family} compares {at_k_star} at k*: give --lag K"
    if not at_k_star and args.lag is not None:
        return f"--lag {args.lag}: --family {args.family} compares every contrast at lag 0, and reads no k*"
    return unread_or_missing(declared, tables, args.family)


def read(args: argparse.Namespace) -> Read:
    """The family's tables read and checked, its per-unit values computed and checked; the output folder proved
    writable."""
    declared = load_family(args.family)
    family = tuple(contrast.at(args.lag) for contrast in declared.contrasts)
    given = tables_given(args)
    paths = {name: per_seed_file(given[name]) for name in declared.tables}
    values, left_out = family_values(family, read_tables(declared, family, paths), declared.measure)
    short = too_few_starts(family, values)
    if short and not args.interim:
        raise ValueError(
            f"the family's {len(family)} comparisons need the starts to separate under Holm (m · 2/2^K < {ALPHA:g}), "
            f"and {'; '.join(short)} cannot, whatever the data: more starts, or --interim for a reading that is "
            "no verdict"
        )
    writable_out(args.out)
    return Read(declared, family, values, left_out, paths, tuple(short))


def report_lines(judged: Sequence[Judged], read: Read, command: str) -> list[str]:
    """report.md: the family's table, how each comparison is computed and the smallest p it can reach, the units
    left out."""
    m = len(judged)
    paired_tables: dict[str, list[str]] = {}  # the comparisons paired within each table
    for contrast in read.family:
        if contrast.kind != INTERACTION:
            paired_tables.setdefault(contrast.table, []).append(contrast.name)
    rows, reach = [], []
    for result, values in zip(judged, read.values):
        stats = result.statistics
        models = result.contrast.tables
        sides = [values[model] for model in models]
        per_start = [stats.per_start] if isinstance(stats, AcrossStarts) else list(stats.per_start)  # one side: paired
        units = ", ".join(  # each side's table named where an interaction reads two, or the paired ones several
            f"{len(side)} × {_seeds(side)}" + (f" {model}" if len(sides) > 1 or len(paired_tables) > 1 else "")
            for side, model in zip(sides, models)
        )
        shown = "; ".join(
            (f"{model}: " if len(sides) > 1 else "")
            + ", ".join(f"{start[:12]} {value:+.3f}" for start, value in starts.items())
            for starts, model in zip(per_start, models)
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
        reach.append(f"{result.contrast.name} {smallest_holm_p(sides, m):.3g}")
    kinds = {contrast.kind for contrast in read.family}
    at_zero = [contrast.name for contrast in read.family if contrast.lag == 0]
    paired = [
        what
        for present, what in (
            (any(c.kind == DIFFERENCE and c.lag for c in read.family), "the difference of two arms at k*"),
            (bool(at_zero), "the difference of two arms at lag 0"),
            (FALL in kinds, "an arm's fall"),
            (FALL_DIFFERENCE in kinds, "the difference of two arms' falls"),
        )
        if present
    ]
    given = [f"`{path}` ({table_title(model)})" for model, path in read.paths.items()]
    k_star = next((contrast.lag for contrast in read.family if contrast.lag), None)
    at = f"at k* = {k_star}" + (
        f" (comparison{'s' * (len(at_zero) > 1)} {', '.join(at_zero)} at lag 0)" if at_zero else ""
    )
    starts = {
        model: sorted({start for values in read.values for start in values.get(model, {})}) for model in read.paths
    }
    lines = [
        f"# {read.declared.title}",
        "",
        f"The {m} comparisons of {read.declared.declared} {at if k_star else 'at lag 0'}, on "
        f"{read.declared.measure}, from {' and '.join([', '.join(given[:-1]), given[-1]] if given[1:] else given)}. "
        "Cold starts (the weights' sha256, its first 12 digits): "
        + "; ".join(
            f"{table_title(model)}'s {len(shas)}, " + ", ".join(f"`{sha[:12]}`" for sha in shas)
            for model, shas in starts.items()
        )
        + ".",
    ]
    if command:
        lines += ["", f"Made with `{command}`."]
    if read.short:
        lines += [
            "",
            f"**Interim reading (`--interim`): no verdict here is final.** Too few starts for Holm over the {m} to "
            f"separate: {'; '.join(read.short)}, whatever the data.",
        ]
    how = []
    if kinds - {DIFFERENCE}:
        how.append(
            f"A fall is an arm's {read.declared.measure} at lag 0 minus at k* (positive: it learns less behind)."
        )
    if len(paired_tables) > 1:
        how.append(
            "Each paired comparison reads one table: "
            + "; ".join(f"{', '.join(names)}, {table_title(model)}" for model, names in paired_tables.items())
            + "."
        )
    if paired:
        where = f" on {table_title(next(iter(paired_tables)))}" if len(paired_tables) == 1 else ", each on its table"
        how.append(
            f"{_named(read.family, DIFFERENCE, FALL, FALL_DIFFERENCE)} paired per (start, seed){where} "
            f"({'; '.join(paired)}): the estimate is the mean over starts of each start's mean over its "
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
        every = {1: "the table", 2: "both tables"}.get(len(read.paths), "every table")
        return lines + [f"Every unit of {every} entered every comparison that reads it."]
    table = [[r["comparison"], r["model"], r["start_sha256"][:12], r["seed"], r["why"]] for r in rows_as_dicts(left)]
    return lines + [
        f"## Units left out ({len(left)})",
        "",
        markdown_table(["comparison", "table", "start", "seed", "why"], table),
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
