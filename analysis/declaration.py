"""What a report decides by: the comparison an experiment declares before its runs.

An experiment file sets `comparison` (experiments.config.ComparisonConfig): the baseline arm, the one primary summary,
the arms whose comparisons with the baseline form the family Holm's correction runs over, how runs that ended themselves
early count, and the committed results the sweep is a miniature of (`analysis.references`). Every run records it in its
`.hydra/config.yaml`; `analysis.report` reads it from there, and every run of a report must declare the same (a report
of runs recorded before `comparison` existed applies the schema's defaults and says that they were not declared). A
command-line flag may override a field; the report names each field it took from the command line. Everything is checked
against the arms the runs hold before any figure is drawn: a family or baseline naming an arm the sweep did not run, a
primary measure that is not a summary the analysis computes, a rule that is not one, a reference with no
comparisons.csv, each ends the report with one line.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from analysis.gains import GAIN_MEASURES
from analysis.references import Reference
from analysis.references import load_all as load_references
from analysis.verdicts import DEFAULT_BASELINE
from experiments.config import PROJECT_ROOT, AccuracySummary, ComparisonConfig, EarlyStopped

KEY = "comparison"  # the config node (`comparison.<field>` in a run's flat config)
FIELDS = tuple(f.name for f in fields(ComparisonConfig))
_UNDECLARED = object()  # what a run recorded before `comparison` existed declares
FLAGS = {
    "baseline": "--baseline",
    "primary": "--primary",
    "family": "--family",
    "early_stopped": "--early-stopped",
    "references": "--references",
}


@dataclass(frozen=True)
class Declaration:
    """A report's comparison, the fields of `ComparisonConfig`, and where they came from."""

    baseline: str | None = ComparisonConfig.baseline
    primary: str = ComparisonConfig.primary.value
    family: tuple[str, ...] = ()  # empty: every arm the runs hold
    early_stopped: str = ComparisonConfig.early_stopped.value
    references: tuple[str, ...] = ()  # the committed results' folders, as declared (relative to the project)
    declared: bool = False  # the runs' configs declared it (else: the schema's defaults, or the command line)
    overridden: tuple[str, ...] = ()  # the fields the command line set
    read_from: str = "runs"  # runs (their configs), or tables (per-seed tables, which carry no declaration)

    def checked(self, arms: Iterable[str]) -> Declaration:
        """This declaration, refused (`ValueError`, one line) where it does not fit the runs' `arms`: a primary that
        is not a summary, a rule that is not one and, where the runs hold more than one arm (one arm is compared in
        another report, by analysis.compare), a baseline or a family arm they do not hold, or the baseline in the
        family."""
        arms = sorted(set(arms))
        if self.primary not in GAIN_MEASURES:
            raise ValueError(
                f"{self._said('primary')} {self.primary!r} is not a summary the analysis computes; the "
                f"summaries: {', '.join(GAIN_MEASURES)}"
            )
        if self.early_stopped not in set(EarlyStopped):
            raise ValueError(
                f"{self._said('early_stopped')} {self.early_stopped!r} is not a rule; the rules: "
                f"{', '.join(EarlyStopped)}"
            )
        if len(arms) < 2:
            return self
        if self.baseline is not None and self.baseline not in arms:
            raise ValueError(
                f"{self._said('baseline')} {self.baseline!r} is not an arm of these runs; their arms: {', '.join(arms)}"
            )
        absent = [arm for arm in self.family if arm not in arms]
        if absent:
            raise ValueError(
                f"{self._said('family')} names {', '.join(map(repr, absent))}, an arm these runs did not "
                f"run; their arms: {', '.join(arms)}"
            )
        if self.baseline is not None and self.baseline in self.family:
            raise ValueError(
                f"{self._said('family')} names the baseline {self.baseline!r}, which is compared with "
                "every other arm, not with itself"
            )
        return self

    def reference(self, arms: Iterable[str]) -> str:
        """The baseline arm: the declared one, else GRPO when the runs have it, else the first arm by name."""
        arms = sorted(set(arms))
        return self.baseline or (DEFAULT_BASELINE if DEFAULT_BASELINE in arms else arms[0])

    def family_of(self, arms: Iterable[str]) -> list[str]:
        """The arms compared in the family: the declared ones, or every arm but the baseline."""
        baseline = self.reference(arms)
        return list(self.family) or sorted(set(arms) - {baseline})

    def read_references(self, root: Path = PROJECT_ROOT) -> list[Reference]:
        """The declared references, each read through its comparisons.csv (`analysis.references.load`); one that is
        not the folder of a report that compared arms is refused (`ValueError`, one line naming it)."""
        return load_references(self.references, self._said("references"), root)

    def _said(self, name: str) -> str:
        return FLAGS[name] if name in self.overridden else f"{KEY}.{name}"

    def lines(self, arms: Iterable[str], comparisons: int) -> list[str]:
        """The report's account of it: what decides, over how many comparisons, and who declared it."""
        arms = sorted(set(arms))
        baseline, family = self.reference(arms), self.family_of(arms)
        rule = {
            EarlyStopped.exclude: "excluded, and named below",
            EarlyStopped.failed: "scored as failed: held-out accuracy 0 at every evaluation it did not reach",
        }
        if self.declared:
            origin = f"Declared by the runs (`{KEY}` in every run's recorded config, the same in each)"
        elif self.read_from == "tables":
            origin = "Per-seed tables carry no declaration: the schema's defaults where the command line sets none"
        else:
            origin = (
                f"The runs declare no comparison (recorded before `{KEY}` existed): the schema's defaults where "
                "the command line sets none, chosen after the runs, so not a pre-registration"
            )
        if self.overridden:
            origin += "; set on the command line: " + ", ".join(
                f"{name} ({FLAGS[name]})" for name in FIELDS if name in self.overridden
            )
        return [
            "## The declared comparison",
            "",
            f"- **baseline**: {baseline}",
            f"- **primary summary**: `{self.primary}` ({GAIN_MEASURES[self.primary]}); the other summaries are "
            "secondary",
            f"- **family**: {', '.join(family) or '–'} against {baseline} on `{self.primary}` in every cell "
            f"({comparisons} comparison{'' if comparisons == 1 else 's'}): Holm's correction over them decides each "
            "verdict",
            f"- **runs that ended themselves early** (status diverged): {rule[EarlyStopped(self.early_stopped)]}; "
            "a run stopped from outside (crashed, killed, interrupted) never counts",
            *(
                [
                    f"- **references** (the committed results these runs are a miniature of): "
                    f"{', '.join(f'`{path}`' for path in self.references)}"
                ]
                if self.references
                else []
            ),
            "",
            f"{origin}.",
        ]


def _value(name: str, value: Any) -> Any:
    """A field as a run's flat config records it (a list as its JSON text) in the declaration's own types."""
    if name in ("family", "references"):
        items = json.loads(value) if isinstance(value, str) else value
        return tuple(items or ())
    return value


def read(configs: Mapping[str, Mapping[str, Any]], overrides: Mapping[str, Any] | None = None) -> Declaration:
    """The declaration every run of `configs` (`{run: flat config}`) makes, with the `overrides` the command line gave
    (`{field: value}`; None values are not given). Runs that declare different values of a field the command line
    does not set, or that declare where others do not, are refused in one line naming two of them."""
    overrides = {name: value for name, value in (overrides or {}).items() if value is not None}
    declared: dict[str, tuple[Any, ...] | None] = {}
    for run, cfg in configs.items():
        keys = [f"{KEY}.{name}" for name in FIELDS]
        declared[run] = (
            tuple(_value(name, cfg.get(key)) for name, key in zip(FIELDS, keys))
            if any(key in cfg for key in keys)
            else None
        )
    fields_found: dict[str, Any] = {}
    if any(value is not None for value in declared.values()):
        for i, name in enumerate(FIELDS):
            if name in overrides:
                continue
            values = {run: _UNDECLARED if value is None else value[i] for run, value in declared.items()}
            if len(set(values.values())) > 1:
                (a, there), (b, here) = _two_that_differ(values)
                raise ValueError(
                    f"the runs of this report declare different comparisons: {a} "
                    f"{_declares(name, there)}, {b} {_declares(name, here)}; every run of a report "
                    f"declares the same, or {FLAGS[name]} sets it for the report"
                )
            fields_found[name] = next(iter(values.values()))
    given = {name: tuple(value) if name in ("family", "references") else value for name, value in overrides.items()}
    return replace(
        Declaration(),
        **{**fields_found, **given},
        declared=bool(fields_found),
        overridden=tuple(name for name in FIELDS if name in given),
    )


def _two_that_differ(values: Mapping[str, Any]) -> tuple[tuple[str, Any], tuple[str, Any]]:
    first = next(iter(values.items()))
    other = next((run, value) for run, value in values.items() if value != first[1])
    return first, other


def _declares(name: str, value: Any) -> str:
    if value is _UNDECLARED:
        return f"declares no {KEY}"
    shown = list(value) if isinstance(value, tuple) else value
    return f"declares {KEY}.{name}={shown!r}"


def add_flags(parser: Any, baseline_help: str, early_stopped: bool = False, references: bool = False) -> None:
    """The command-line flags that override a declaration's fields (analysis.report, analysis.compare; the rule for
    early-stopped runs only where runs are read, not per-seed tables, which already applied it; the references where
    a report sets its comparisons beside them)."""
    parser.add_argument("--baseline", metavar="ARM", help=baseline_help)
    parser.add_argument(
        "--primary",
        choices=list(AccuracySummary),
        metavar="SUMMARY",
        help=f"the summary whose comparisons decide ({', '.join(AccuracySummary)}; default: the runs' "
        f"declaration, else {ComparisonConfig.primary.value})",
    )
    parser.add_argument(
        "--family",
        nargs="+",
        metavar="ARM",
        help="the arms whose comparisons with the baseline form the family Holm's correction runs "
        "over (default: the runs' declaration, else every arm)",
    )
    if early_stopped:
        parser.add_argument(
            "--early-stopped",
            choices=list(EarlyStopped),
            dest="early_stopped",
            help="how a run that ended itself early counts (default: the runs' declaration, else "
            f"{ComparisonConfig.early_stopped.value})",
        )
    if references:
        parser.add_argument(
            "--references",
            nargs="+",
            metavar="DIR",
            help="the committed results these runs are a miniature of: folders holding a report's "
            "comparisons.csv (default: the runs' declaration, else none)",
        )


def overrides(args: Any, names: Sequence[str] = FIELDS) -> dict[str, Any]:
    """The fields the command line set (`args` from `add_flags`; absent attributes are not given)."""
    return {name: getattr(args, name, None) for name in names}
