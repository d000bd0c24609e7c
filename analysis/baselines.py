"""Whether each result's baseline learned (docs/results/baselines.md): a verdict about an arm is a verdict about
learning only where the arm it is compared with gains held-out accuracy over the run.

A declaration file (docs/results/baselines.yaml) names, per result, the committed per-seed table that holds its runs,
the baseline arm and the cell it is read in (the synchronous, un-intervened one where the result has it). For each,
from that table alone (no run is made again): the baseline's held-out greedy gain over the run (`gain`: accuracy at
its last evaluation minus at its start), its mean with the 95% interval — the two-level bootstrap over cold starts and
seeds where the table holds several starts (`statistics.starts_interval`), the bootstrap over seeds otherwise
(`statistics.mean_interval`) — and the verdict: **learns** where the interval lies above 0, **loses** where it lies
below, **holds level** otherwise; a single run gets its gain and no verdict.

    python -m analysis.baselines docs/results/baselines.yaml --out docs/results/baselines.md
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from analysis import statistics
from analysis.cli import Command, writable_out
from analysis.tables import markdown_table

MEASURE = "gain"  # held-out greedy accuracy at the run's last evaluation minus at its start
START = "start_sha256"  # the cold start a run came from (tables made before several starts lack it: one start)
VERDICTS = ("learns", "loses", "holds level")
PER_SEED = "per_seed.csv"


@dataclass(frozen=True)
class Baseline:
    """One result's baseline, as the declaration names it."""

    result: str  # the result's name in docs/results/README.md's table
    table: str  # the folder under docs/results whose per_seed.csv holds the runs
    arm: str  # the baseline arm, as the table names it
    where: dict[str, Any] = field(default_factory=dict)  # the cell: {column: value} every counted row must match
    note: str = ""  # what the reader must know (a SYNTHETIC cell, an off-policy loop)


def load_declaration(path: Path) -> list[Baseline]:
    """The declared baselines of `path`; a ValueError names an entry with a missing or unknown key."""
    entries = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path} declares no baseline: a list of entries is expected")
    allowed = set(Baseline.__dataclass_fields__)
    baselines = []
    for number, entry in enumerate(entries, start=1):
        if not isinstance(entry, dict) or not {"result", "table", "arm"} <= set(entry) or set(entry) - allowed:
            raise ValueError(
                f"{path}: entry {number} ({entry!r}) must have result, table and arm, and may have "
                f"only {', '.join(sorted(allowed))}"
            )
        baselines.append(Baseline(**entry))
    return baselines


@dataclass(frozen=True)
class Learned:
    """What one baseline gained over the run."""

    runs: int
    starts: int
    mean: float
    low: float  # the 95% interval's ends; NaN for a single run
    high: float
    verdict: str  # one of VERDICTS, or "" for a single run


def rows_of(baseline: Baseline, results: Path) -> pd.DataFrame:
    """The counted rows of the baseline's arm and cell; a ValueError names an absent table, arm, column or cell."""
    path = results / baseline.table / PER_SEED
    if not path.is_file():
        raise ValueError(f"{baseline.result}: no {path}")
    table = pd.read_csv(path)
    rows = table[table["arm"] == baseline.arm]
    if rows.empty:
        raise ValueError(
            f"{baseline.result}: {path} has no arm {baseline.arm!r}; its arms: "
            f"{', '.join(sorted(table['arm'].unique()))}"
        )
    for column, value in baseline.where.items():
        if column not in rows:
            raise ValueError(f"{baseline.result}: {path} has no column {column!r} to read the cell in")
        rows = rows[np.isclose(rows[column].astype(float), float(value))]
    if rows.empty:
        raise ValueError(f"{baseline.result}: {path} has no run of {baseline.arm!r} where {baseline.where}")
    if "counted" in rows:
        rows = rows[rows["counted"] == "yes"]
    rows = rows[np.isfinite(rows[MEASURE])]
    if rows.empty:
        raise ValueError(f"{baseline.result}: {path} has no counted run of {baseline.arm!r} with a finite {MEASURE}")
    return rows


def learned(rows: pd.DataFrame) -> Learned:
    """The baseline's gain over the run, its interval and verdict (module docstring)."""
    starts = rows[START].fillna("").astype(str) if START in rows else pd.Series([""] * len(rows), index=rows.index)
    by_start = {start: group[MEASURE].to_numpy(float) for start, group in rows.groupby(starts)}
    mean = float(np.mean([values.mean() for values in by_start.values()]))
    if len(rows) < 2:
        return Learned(len(rows), len(by_start), mean, math.nan, math.nan, "")
    interval = (
        statistics.starts_interval(by_start)
        if len(by_start) > 1
        else statistics.mean_interval(next(iter(by_start.values())))
    )
    verdict = VERDICTS[0] if interval.low > 0 else VERDICTS[1] if interval.high < 0 else VERDICTS[2]
    return Learned(len(rows), len(by_start), interval.estimate, interval.low, interval.high, verdict)


def _points(value: float) -> str:
    """An accuracy difference in points, signed, with the typographic minus the results' prose uses."""
    return f"{value * 100:+.1f}".replace("-", "−")


def words(result: Learned) -> str:
    """The README's column: the verdict with the mean gain and its interval, in points of accuracy."""
    if not result.verdict:
        return f"{_points(result.mean)} pts (one run: no interval)"
    return f"{result.verdict} {_points(result.mean)} pts [{_points(result.low)}, {_points(result.high)}]"


def report(baselines: list[Baseline], results: list[Learned], command: str) -> str:
    """baselines.md: one row per result."""
    header = ["result", "baseline (cell)", "runs (starts)", "held-out greedy gain over the run [95% CI]", "note"]
    rows = [
        [
            b.result,
            b.arm + (f" ({', '.join(f'{k}={v}' for k, v in b.where.items())})" if b.where else ""),
            f"{r.runs} ({r.starts})",
            words(r),
            b.note,
        ]
        for b, r in zip(baselines, results)
    ]
    return (
        f"Made with `{command}`.\n\n"
        "Whether each result's baseline learned: its held-out greedy accuracy at the run's end minus at its start,"
        " over its counted runs (two-level interval where several cold starts ran; learns / loses where the 95%"
        " interval excludes 0, holds level otherwise).\n\n" + markdown_table(header, rows)
    )


def arguments(parser: argparse.ArgumentParser) -> None:
    """The declaration and where the table goes."""
    parser.add_argument("declaration", type=Path, help="the yaml naming each result's baseline")
    parser.add_argument("--out", type=Path, required=True, help="the markdown file the table goes to")


def read(args: argparse.Namespace) -> tuple[list[Baseline], list[Learned]]:
    """Every declared baseline read from its table (refused in one line when one cannot be)."""
    baselines = load_declaration(args.declaration)
    results = [learned(rows_of(baseline, args.declaration.parent)) for baseline in baselines]
    writable_out(args.out.parent)
    return baselines, results


def write(read_: tuple[list[Baseline], list[Learned]], args: argparse.Namespace, command: str) -> str:
    """The table, and the line saying where."""
    baselines, results = read_
    args.out.write_text(report(baselines, results, command) + "\n", encoding="utf-8")
    counts = {verdict: sum(r.verdict == verdict for r in results) for verdict in VERDICTS}
    return f"baselines: {args.out} ({', '.join(f'{n} {verdict}' for verdict, n in counts.items())})"


main = Command("analysis.baselines", __doc__, arguments, read, write).main

if __name__ == "__main__":
    main()
