"""The per-seed tables a declared family reads, each by its name (`moe`, `dense`, or the one a contrast names:
`contrasts.Contrast`): given on `analysis.family`'s command line (`tables_given`, `unread_or_missing`), then each read
and checked as `analysis.compare` reads one (`compare.pool`: one run per arm, lag, start and seed; arms of a seed from
one start; runs that did not finish left out) and refused in one line where the family cannot be computed from it
(`read_tables`).

A table a contrast reads at k* has a swept `rollout.lag` column holding 0 and k* (or k* alone where only differences
at k* read it); a table whose contrasts are all at lag 0 (a synchronous sweep) needs none: without one, every run is
taken to be at lag 0 (the per-seed table holds the swept settings alone), and a column there that holds another lag
is refused.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from pathlib import Path

import pandas as pd

from analysis.compare import Source, pool, refuse_two_recipes
from analysis.contrasts import DENSE, LAG, MOE, Contrast, Family, needed_runs
from analysis.gains import EXCLUDED
from analysis.records import UNKNOWN_START

# The two tables with flags of their own (--moe, --dense), as a report names them; any other is "the NAME table".
TITLES = {MOE: "the MoE rung", DENSE: "the dense control"}


def table_title(name: str) -> str:
    """A table as a report names it."""
    return TITLES.get(name, f"the {name} table")


def given(name: str, path: Path | str) -> str:
    """A table as a refusal names it: by its own flag (`--moe PATH`) where it has one, else `--table NAME=PATH`."""
    return f"--{name} {path}" if name in TITLES else f"--table {name}={path}"


def named_table(text: str) -> tuple[str, Path]:
    """`--table`'s `NAME=REPORT_OR_CSV` (an argparse type)."""
    name, equals, path = text.partition("=")
    if not (equals and name and path):
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=REPORT_OR_CSV")
    return name, Path(path)


def tables_given(args: argparse.Namespace) -> dict[str, Path]:
    """Every table the command line names, by name: `--moe`, `--dense` and each `--table NAME=...`; a ValueError
    where one name is given twice."""
    flags = [(f"--{name} {path}", name, path) for name in TITLES if (path := getattr(args, name)) is not None]
    flags += [(f"--table {name}={path}", name, path) for name, path in args.table or ()]
    tables: dict[str, Path] = {}
    said: dict[str, str] = {}
    for flag, name, path in flags:
        if name in tables:
            raise ValueError(f"{flag}: the {name} table is given twice ({said[name]})")
        tables[name], said[name] = path, flag
    return tables


def unread_or_missing(declared: Family, tables: dict[str, Path], family_file: Path) -> str | None:
    """The first table the family reads and the command line does not give, or gives and the family does not read,
    as a refusal says it."""
    for name in declared.tables:
        if name not in tables:
            names = ", ".join(contrast.name for contrast in declared.contrasts if name in contrast.tables)
            flag = f"--{name} " if name in TITLES else f"--table {name}="
            return f"--family {family_file} reads {table_title(name)} ({names}): give {flag}REPORT_OR_CSV"
    for name, path in tables.items():
        if name not in declared.tables:
            return (
                f"{given(name, path)}: --family {family_file} reads no {name} table (its: {', '.join(declared.tables)})"
            )
    return None


def read_tables(declared: Family, family: Sequence[Contrast], paths: dict[str, Path]) -> dict[str, pd.DataFrame]:
    """Each table the family reads (`paths`, by name, as the command line gave them), checked (the module's
    docstring); the two models an interaction compares share no start; every (arm, lag) a table's contrasts read is
    there."""
    tables = {}
    for name in declared.tables:
        reads = [contrast for contrast in family if name in contrast.tables]
        arms = declared.dense_arms if name == DENSE and declared.dense_arms else None
        tables[name] = read_table(paths[name], name, reads, declared.measure, arms)
    if declared.compares_models:
        shared = set(tables[MOE]["start_sha256"]) & set(tables[DENSE]["start_sha256"])
        if shared:
            raise ValueError(
                f"start {sorted(shared)[0][:12]} is in both {given(MOE, paths[MOE])} and "
                f"{given(DENSE, paths[DENSE])}: the interaction compares two models, each from its own starts"
            )
    for name, rows in tables.items():
        problem = missing_arm(
            rows, given(name, paths[name]), [contrast for contrast in family if name in contrast.tables]
        )
        if problem:
            raise ValueError(problem)
    return tables


def read_table(
    path: Path, name: str, reads: Sequence[Contrast], measure: str, arms: Sequence[str] | None
) -> pd.DataFrame:
    """One table, pooled and checked as `analysis.compare` pools one (`compare.pool`), then refused where `reads`, the
    contrasts that read it (at k*), cannot be computed from it on `measure` (the module's docstring); `arms`: the only
    arms it may hold. Without a `rollout.lag` column, it gets one: every run at lag 0."""
    flag = given(name, path)
    rows, axes, _ = pool([Source(path, {})])
    lags = sorted({lag for contrast in reads for lag in contrast.lags})
    if LAG not in axes:
        if lags != [0]:
            raise ValueError(
                f"{flag} has no {LAG} column among its swept axes ({', '.join(axes) or 'none'}): its runs are all at "
                f"lag 0, and {_names(contrast for contrast in reads if contrast.lag)} compare at k*"
            )
        rows = rows.assign(**{LAG: 0})
    elif lags == [0] and set(rows[LAG].astype(float)) - {0.0}:
        raise ValueError(
            f"{flag} holds runs at {LAG} {', '.join(f'{lag:g}' for lag in sorted(set(rows[LAG].astype(float))))}: "
            f"{_names(reads)} compare at lag 0, from a table of synchronous runs"
        )
    counted = rows[rows["counted"] != EXCLUDED]
    varied = [axis for axis in axes if axis != LAG and counted[axis].nunique() > 1]
    if varied:
        raise ValueError(
            f"{flag} varies {', '.join(varied)} beside {LAG}: a contrast pools one cell's runs across lags; give a "
            "table of one cell"
        )
    unnamed = counted[counted["start_sha256"] == UNKNOWN_START]
    if not unnamed.empty:
        raise ValueError(
            f"{flag}: {len(unnamed)} runs name no start (start_sha256), {unnamed['run'].iloc[0]} first: the contrasts "
            "are computed per start"
        )
    if "start_recipe" in counted:
        refuse_two_recipes(counted)
    if arms is not None:
        foreign = sorted(set(rows["arm"]) - set(arms))
        if foreign:
            raise ValueError(
                f"{flag} holds {', '.join(map(repr, foreign))}: the dense control runs only the arms without routing "
                f"({', '.join(arms)})"
            )
    held = sorted(set(counted[LAG].astype(float)))
    for needed in lags:
        if float(needed) not in held:
            raise ValueError(
                f"{flag} has no counted run at {LAG} {needed}; its lags: "
                f"{', '.join(f'{lag:g}' for lag in held) or 'none'}"
            )
    starts = counted["start_sha256"].nunique()
    if starts < 2:
        raise ValueError(
            f"{flag} holds {starts} start(s): the family's intervals and tests are over starts, and need at least 2"
        )
    read_arms = counted["arm"].isin({arm for arm, _ in needed_runs(reads)})
    lacking = counted[read_arms & counted[measure].isna()]
    if not lacking.empty:
        raise ValueError(
            f"{flag}: {len(lacking)} counted runs of the arms the family reads have no {measure}, "
            f"{lacking['run'].iloc[0]} first: the family is judged on {measure}"
        )
    return rows


def missing_arm(rows: pd.DataFrame, flag: str, reads: Sequence[Contrast]) -> str | None:
    """The first (arm, lag) the contrasts `reads` read on this table that no counted run holds, as a refusal says it."""
    counted = rows[rows["counted"] != EXCLUDED]
    held = set(zip(counted["arm"], counted[LAG].astype(float)))
    for arm, lag in needed_runs(reads):
        if (arm, float(lag)) not in held:
            arms = sorted(set(counted["arm"]))
            said = (
                f"has no arm {arm!r}; its arms: {', '.join(arms)}"
                if arm not in arms
                else f"has no counted run of {arm!r} at {LAG} {lag}"
            )
            return f"{flag} {said}: the declared family needs it"
    return None


def _names(contrasts: Iterable[Contrast]) -> str:
    """Comparisons by name, as a refusal's subject: "comparisons 7, 8"."""
    names = [contrast.name for contrast in contrasts]
    return f"comparison{'s' if len(names) > 1 else ''} {', '.join(names)}"
