"""How a sweep's comparisons stand beside the committed results it is a miniature of (`comparison.references`).

A reference is the folder of a report that compared arms (docs/results/<name>, relative to the project), read through
its `comparisons.csv`: one row per cell, measure and arm against its baseline, the cell's settings in the columns
before `measure`. Each comparison of this report is set beside the reference's row of the same arm, baseline and
measure in the same cell: every setting either side varied has the same value on both. A setting only this sweep
varied was, in the reference, at the schema's default (its table records only what it varied: flip_dose_seeds ran
no router noise, router_noise_dose no flips); a setting only the reference varied is, here, the value every run of
this report holds. Per match: the estimate here, the reference's estimate, interval and verdict, and whether the two
estimates have the same sign — the one thing a miniature of three seeds can agree or disagree with. A comparison no
reference holds a row for is named as such.

Bad input, refused in one line before any figure (`ValueError`): a reference that is not a folder, holds no
comparisons.csv or one that cannot be read, lacks a column the matching needs, or holds two rows for one arm,
baseline, measure and cell.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from experiments.config import PROJECT_ROOT

COMPARISONS = "comparisons.csv"  # the table a reference is read through (analysis.report writes it)
KEYS = ("measure", "arm", "baseline")  # with the cell's settings, what names one row of a comparisons table
NUMBERS = ("seeds", "difference_estimate", "difference_low", "difference_high", "verdict")  # what a match reports
SAME, OPPOSITE = "same sign", "opposite sign"
COLUMNS = [
    "reference",
    "cell",
    "measure",
    "arm",
    "baseline",
    "role",
    "here_seeds",
    "here_estimate",
    "here_low",
    "here_high",
    "there_seeds",
    "there_estimate",
    "there_low",
    "there_high",
    "there_verdict",
    "sign",
]


@dataclass(frozen=True)
class Reference:
    """A reference as declared (`path`), its comparisons table and the settings that table's cells vary."""

    path: str
    table: pd.DataFrame
    axes: tuple[str, ...]


def load(path: str, said: str = "comparison.references", root: Path = PROJECT_ROOT) -> Reference:
    """The reference at `path` (relative to `root` unless absolute); `ValueError`, one line naming it and what a
    reference is, when it is not one (`said`: the field or flag that named it)."""
    folder = root / path
    what = "a reference is the folder of a report that compared arms, holding its comparisons.csv"
    if not folder.is_dir():
        raise ValueError(f"{said} names {path!r}, which is not a folder ({folder}); {what}")
    file = folder / COMPARISONS
    if not file.is_file():
        raise ValueError(f"{said} names {path!r}, which holds no {COMPARISONS}; {what}")
    try:
        table = pd.read_csv(file)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as error:
        raise ValueError(f"{said} names {path!r}, whose {COMPARISONS} cannot be read ({error}); {what}") from None
    missing = [column for column in (*KEYS, *NUMBERS) if column not in table]
    if missing:
        raise ValueError(
            f"{said} names {path!r}, whose {COMPARISONS} has no column {', '.join(missing)}; a reference "
            f"needs {', '.join((*KEYS, *NUMBERS))}"
        )
    axes = tuple(table.columns[: list(table.columns).index("measure")])
    twice = table[table.duplicated([*axes, *KEYS], keep=False)]
    if len(twice):
        row = twice.iloc[0]
        raise ValueError(
            f"{said} names {path!r}, whose {COMPARISONS} holds {len(twice)} rows of {row['arm']} against "
            f"{row['baseline']} on {row['measure']}{''.join(f', {k}={row[k]}' for k in axes)}; a "
            "reference holds one row per arm, baseline, measure and cell"
        )
    return Reference(path, table, axes)


def load_all(paths: Iterable[str], said: str = "comparison.references", root: Path = PROJECT_ROOT) -> list[Reference]:
    return [load(path, said, root) for path in paths]


def held_settings(configs: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The settings every one of `configs` (flat run configs) holds at one value: what a sweep did not vary."""
    configs = list(configs)
    keys = set.intersection(*(set(cfg) for cfg in configs)) if configs else set()
    return {key: configs[0][key] for key in keys if len({_hashable(cfg[key]) for cfg in configs}) == 1}


def _hashable(value: Any) -> Any:
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


def _same(here: Any, there: Any) -> bool:
    if here is None or there is None:
        return False
    try:
        return math.isclose(float(here), float(there), rel_tol=1e-9, abs_tol=1e-12)
    except (TypeError, ValueError):
        return str(here) == str(there)


def sign(here: float, there: float) -> str:
    """Whether two estimated differences point the same way (a difference of exactly 0 points nowhere)."""
    # pandas-stubs type isna(x) as "x is NaT, NA or None" (TypeIs), which leaves out a float's NaN: mypy takes each
    # branch for dead.
    if pd.isna(here):
        return "not compared here"  # type: ignore[unreachable]
    if pd.isna(there):
        return "not compared in the reference"  # type: ignore[unreachable]
    if here == 0 or there == 0:
        return "no sign (a difference of 0)"
    return SAME if (here > 0) == (there > 0) else OPPOSITE


def beside(
    comparisons: pd.DataFrame,
    axes: Sequence[str],
    held: Mapping[str, Any],
    defaults: Mapping[str, Any],
    references: Sequence[Reference],
) -> pd.DataFrame:
    """Every comparison of this report (rows of `arm_comparisons` over the sweep's `axes`) beside each reference row
    that matches it (`COLUMNS`; `cell` is the cell's settings as a dict). `held`: the settings every run here holds
    (`held_settings`); `defaults`: the schema's (`analysis.load.schema_defaults`), what a reference that did not vary
    a setting ran it at. A comparison no reference matches is left out (`unmatched` names them)."""
    rows = []
    for comparison in comparisons.to_dict("records"):
        cell = {key: comparison[key] for key in axes}
        for reference in references:
            here = {**cell, **{key: held.get(key) for key in reference.axes if key not in cell}}
            for there in reference.table.to_dict("records"):
                if any(there[key] != comparison[key] for key in KEYS):
                    continue
                settings = {
                    **{key: defaults.get(key) for key in axes if key not in reference.axes},
                    **{key: there[key] for key in reference.axes},
                }
                if not all(_same(here[key], settings[key]) for key in here.keys() | settings.keys()):
                    continue
                estimate = comparison.get("difference_estimate", math.nan)
                rows.append(
                    {
                        "reference": reference.path,
                        "cell": cell,
                        **{key: comparison[key] for key in KEYS},
                        "role": comparison.get("role", ""),
                        "here_seeds": comparison["seeds"],
                        "here_estimate": estimate,
                        "here_low": comparison.get("difference_low", math.nan),
                        "here_high": comparison.get("difference_high", math.nan),
                        "there_seeds": there["seeds"],
                        "there_estimate": there["difference_estimate"],
                        "there_low": there["difference_low"],
                        "there_high": there["difference_high"],
                        "there_verdict": there["verdict"],
                        "sign": sign(estimate, there["difference_estimate"]),
                    }
                )
    return pd.DataFrame(rows, columns=COLUMNS)


def unmatched(comparisons: pd.DataFrame, axes: Sequence[str], matched: pd.DataFrame) -> pd.DataFrame:
    """The comparisons no reference holds a row for."""
    found = {(tuple(row["cell"].items()), *(row[key] for key in KEYS)) for row in matched.to_dict("records")}
    keep = [
        (tuple({key: row[key] for key in axes}.items()), *(row[key] for key in KEYS)) not in found
        for row in comparisons.to_dict("records")
    ]
    return comparisons[keep]
