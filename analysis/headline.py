"""A report's first screen: what ran, the one figure of what the sweep varied, the verdicts of the declared
comparisons in a line each, each beside the committed result the sweep is a miniature of (same sign or not), and what
the sweep cannot show, said once for every row it holds for. The long tables follow it in report.md
(analysis.report).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any, cast

import pandas as pd

from analysis.arms import arm_order, cell_name, seed_order, sweep_cells
from analysis.configs import SYNTHETIC_KEYS, format_value
from analysis.declaration import Declaration
from analysis.gains import EXCLUDED, GAIN_MEASURES
from analysis.plotting import FigureOutput
from analysis.records import UNKNOWN_START, RunSet, rows_as_dicts
from analysis.references import Reference
from analysis.statistics import ALPHA, smallest_p
from analysis.verdicts import PRIMARY
from experiments.step.metrics import SKIPPED

TITLE = "## What ran and what it shows"
# Fewer units than this and an exact paired sign-flip test cannot reach p < ALPHA (statistics.smallest_p).
UNITS_TO_SEPARATE = next(n for n in range(1, 64) if smallest_p(n) < ALPHA)


def _verdict_head(verdict: str) -> str:
    """A verdict without its reasons: "separates", "not distinguishable", "not compared: 1 shared seed(s)"."""
    return str(verdict).split(" (")[0]


def difference(row: dict[str, Any], prefix: str = "difference") -> str:
    """`prefix`_estimate [`prefix`_low, `prefix`_high] of a row, signed, to 3 decimals."""
    estimate, low, high = (row.get(f"{prefix}_{part}", math.nan) for part in ("estimate", "low", "high"))
    if pd.isna(estimate):
        return "–"
    return f"{estimate:+.3f}" + ("" if pd.isna(low) else f" [{low:+.3f}, {high:+.3f}]")


def what_ran(runset: RunSet, gains: pd.DataFrame, axes: list[str]) -> str:
    """Arms, cells, seeds and cold starts, in one paragraph."""
    runs = runset.runs
    arms = sorted(set(gains["arm"]) if not gains.empty else set(runs["label"]), key=arm_order)
    seeds = sorted({seed for seed in runs["seed"] if seed}, key=seed_order)
    cells = [cell_name(cell) for cell, _ in sweep_cells(gains, axes)] if axes and not gains.empty else []
    starts = runs.loc[runs["start_sha256"] != UNKNOWN_START].groupby("start_sha256").size()
    started = (
        f"cold start{'s' * (len(starts) > 1)} (the weights' sha256) "
        + ", ".join(f"`{start[:12]}` ({n} runs)" for start, n in zip(starts.index, starts))  # typed `items()`
        if len(starts)
        else "no run's summary names its cold start"
    )
    incomplete = int(runs["incomplete"].sum())
    return (
        f"**Ran**: {len(runs)} runs ({f'{incomplete} did not finish' if incomplete else 'all finished'}) of "
        f"{len(arms)} arm{'s' * (len(arms) != 1)} ({', '.join(arms)})"
        + (f" in {len(cells)} cells ({'; '.join(cells)})" if cells else "")
        + f", seeds {', '.join(seeds) or '–'}; {started}."
    )


def skipped_updates(runset: RunSet, gains: pd.DataFrame) -> str:
    """The optimizer updates each arm skipped for a non-finite loss or gradient (`optim/skipped_steps` at each run's
    last logged step), in one line: a run that skips updates computes fewer of them than its arm's others, and its
    numbers are not its arm's alone. The count also stands in the stability table; here a reader sees it first."""
    scalars = runset.scalars
    last = scalars[scalars["metric"] == SKIPPED].sort_values("step").groupby("run")["value"].last()
    arms = gains.set_index("run")["arm"] if not gains.empty else runset.runs.set_index("run")["label"]
    counted = pd.DataFrame({"arm": arms, "skipped": last.reindex(arms.index).fillna(0)})
    # An arm's name is text; pandas types a group's key as any scalar.
    skipping = [(cast(str, arm), group) for arm, group in counted.groupby("arm") if group["skipped"].sum() > 0]
    if not skipping:
        return "**Updates skipped** for a non-finite loss or gradient: none, in any arm."
    said = "; ".join(
        f"{arm} {int(group['skipped'].sum())} in {int((group['skipped'] > 0).sum())} of {len(group)} runs"
        for arm, group in sorted(skipping, key=lambda item: arm_order(item[0]))
    )
    others = "; none in the other arms" if len(skipping) < counted["arm"].nunique() else ""
    return (
        f"**Updates skipped** for a non-finite loss or gradient (each run's updates, minus these, are what it "
        f"trained on): {said}{others}."
    )


def headline_figure(figures: Sequence[FigureOutput]) -> FigureOutput | None:
    """The figure of what the sweep varied (Figure 0); without one, the runs' held-out curves (Figure 1)."""
    drawn = {figure.number: figure for figure in figures if any(f.suffix == ".png" for f in figure.files)}
    return drawn.get("0") or drawn.get("1")


def _figure_lines(figure: FigureOutput | None) -> list[str]:
    if figure is None:
        return ["No figure of what the sweep varied could be drawn (the notes under *Figures* say why)."]
    png = next(f for f in figure.files if f.suffix == ".png")
    return [f"![{figure.title}]({png.name})", "", f"Figure {figure.number}: {figure.caption}"]


def verdict_lines(
    comparisons: pd.DataFrame,
    declaration: Declaration,
    gains: pd.DataFrame,
    axes: list[str],
    beside: pd.DataFrame,
    references: Sequence[Reference],
) -> list[str]:
    """The declared family's verdicts, a line per comparison: its cell, both arms' mean of the primary summary there,
    the difference with its interval, the verdict and, with references, the matching committed row (estimate,
    interval, verdict) and whether the two share a sign; then each reference no comparison matched, and what its
    table holds."""
    arms = sorted(set(gains["arm"]))
    if len(set(arms)) < 2:
        return [
            "**Compared**: nothing here (one arm); `python -m analysis.compare` pairs it with the arms of another "
            "report."
        ]
    baseline, family = declaration.reference(arms), declaration.family_of(arms)
    primary = [row for row in rows_as_dicts(comparisons) if row["role"] == PRIMARY] if len(comparisons) else []
    said = (
        f"**The declared comparisons**: {', '.join(family)} against {baseline} on `{declaration.primary}` "
        f"({GAIN_MEASURES[declaration.primary].split(':')[0]}), Holm's correction over {len(primary)}"
    )
    if not any(not pd.isna(row.get("difference_estimate", math.nan)) for row in primary):
        return [f"{said}: none could be compared (each holds fewer than 2 seeds both arms ran)."]
    if references:
        said += (
            "; each beside the row of the committed result it is a miniature of (same arm, measure and cell; "
            "every measure under *Beside the committed results*)"
        )
    lines = [f"{said}:", ""]
    counted = {tuple(cell.values()): part for cell, part in sweep_cells(gains[gains["counted"] != EXCLUDED], axes)}
    for row in primary:
        cell = {key: row[key] for key in axes}
        part = counted[tuple(cell.values())]
        means = ", ".join(
            f"{arm} {part.loc[part['arm'] == arm, row['measure']].mean():+.3f}" for arm in (baseline, row["arm"])
        )
        starts = row.get("starts")
        # starts == starts: not NaN (a table from before starts were counted)
        if starts == starts and (starts or 0) >= 2:
            assert starts is not None  # (None or 0) >= 2 is False
            # several starts: the two-level interval decides, and it is the one said
            said = (
                f"{difference(row, 'starts_difference')} over {row['seeds']} (start, seed) pairs from "
                f"{int(starts)} starts"
            )
        else:
            said = f"{difference(row)} over {row['seeds']} seeds"
        line = f"- {_cell_prefix(cell)}{means}; {row['arm']} − {baseline} {said}: **{_verdict_head(row['verdict'])}**"
        there = [
            match
            for match in rows_as_dicts(beside)
            if match["measure"] == row["measure"] and match["arm"] == row["arm"] and match["cell"] == cell
        ]
        line += "".join(
            f"; `{match['reference']}` {difference(match, 'there')} over {match['there_seeds']} seeds, "
            f"{_verdict_head(match['there_verdict'])}: **{match['sign']}**"
            + (" (its interval holds 0)" if match["there_low"] <= 0 <= match["there_high"] else "")
            for match in there
        )
        lines.append(line + ("; no reference holds a matching row" if references and not there else ""))
    lines += [
        f"- `{reference.path}`: no matching row ({no_match(reference)})"
        for reference in references
        if reference.path not in set(beside["reference"])
    ]
    return lines


def _cell_prefix(cell: dict[str, Any]) -> str:
    return f"{cell_name(cell)}: " if cell else ""


def no_match(reference: Reference) -> str:
    """What a reference's table does hold, for a reader to see why nothing here matched it."""
    table = reference.table
    held = "; ".join(f"{key} = {', '.join(map(format_value, sorted(set(table[key]))))}" for key in reference.axes)
    arms, baselines = (", ".join(sorted(set(table[column]))) for column in ("arm", "baseline"))
    return (
        f"its table holds {arms} against {baselines}"
        + (f" at {held}" if held else " in one cell")
        + "; a setting its table does not vary is taken at the schema's default there"
    )


def limits(runset: RunSet, comparisons: pd.DataFrame, left_out: pd.DataFrame) -> list[str]:
    """What the sweep cannot show, said once: too few seeds (or starts) for any verdict to separate, one start, the
    SYNTHETIC interventions, the runs the comparisons lost."""
    lines = []
    compared = (
        comparisons[comparisons["difference_estimate"].notna()]
        if "difference_estimate" in comparisons
        else comparisons.iloc[0:0]
    )
    if len(comparisons) and compared.empty:
        lines.append(
            "- Fewer than 2 seeds shared by two arms in any cell: no comparison and no interval here: "
            "without a 95% interval no difference in it can be told from noise (a "
            f"paired comparison needs 2 shared seeds, a verdict that can separate {UNITS_TO_SEPARATE})."
        )
    elif len(compared):
        across = compared["starts"].fillna(1) >= 2 if "starts" in compared else pd.Series(False, compared.index)
        units = compared["starts"].where(across, compared["seeds"]).astype(int)
        if units.max() < UNITS_TO_SEPARATE:
            unit = "starts" if across.all() else "seeds"
            count = f"{units.min()}" if units.min() == units.max() else f"{units.min()}-{units.max()}"
            lines.append(
                f"- {count} {unit}: an exact sign-flip test on fewer than {UNITS_TO_SEPARATE} cannot reach "
                f"p < {ALPHA:g}, so no verdict here can separate; an estimate gives a direction, not a "
                "finding."
            )
        family = int((compared["role"] == PRIMARY).sum()) if "role" in compared else 0
        reachable = smallest_p(units[compared["role"] == PRIMARY].max(), family) if family else 0.0
        if units.max() >= UNITS_TO_SEPARATE and reachable >= ALPHA:
            unit = "starts" if across.all() else "seeds"
            lines.append(
                f"- {units.max()} {unit} and a declared family of {family}: the smallest Holm-adjusted p any "
                f"comparison of the family can reach is {reachable:.3g}, so none can separate, whatever the "
                "data; the intervals and each start's sign say what the runs show."
            )
    starts = set(runset.runs["start_sha256"]) - {UNKNOWN_START}
    if len(starts) == 1:
        lines.append(
            f"- One cold start (`{next(iter(starts))[:12]}`): how far another start of the same recipe would "
            "move these numbers is not measured."
        )
    configs = [json.loads(config) for config in runset.runs["config"]]
    synthetic = [name for key, name in SYNTHETIC_KEYS.items() if any(float(cfg.get(key, 0.0)) for cfg in configs)]
    if synthetic:
        lines.append(
            f"- {' and '.join(synthetic)} are imposed at a dose: they show how each arm copes with that "
            "drift, not what natural drift does (*Held-out accuracy gained* says what each can show)."
        )
    if len(left_out):
        many = len(left_out) != 1
        lines.append(
            f"- {len(left_out)} (arm, seed) pair{'s' * many} the comparisons could have held "
            f"{'are' if many else 'is'} left out (*Seeds left out of the comparisons* names each and why)."
        )
    return ["**What this sweep cannot show**:", "", *lines] if lines else []


def first_screen(
    runset: RunSet,
    gains: pd.DataFrame,
    axes: list[str],
    declaration: Declaration,
    comparisons: pd.DataFrame,
    beside: pd.DataFrame,
    references: Sequence[Reference],
    figures: Sequence[FigureOutput],
    left_out: pd.DataFrame,
) -> list[str]:
    """The report's first screen, in the order a reader asks: what ran, what it looks like, what was decided, how it
    stands beside the lab's results, what it cannot show."""
    arms = sorted(set(gains["arm"])) if not gains.empty else []
    lines = [
        TITLE,
        "",
        what_ran(runset, gains, axes),
        "",
        skipped_updates(runset, gains),
        "",
        *_figure_lines(headline_figure(figures)),
        "",
    ]
    if arms:
        lines += [*verdict_lines(comparisons, declaration, gains, axes, beside, references), ""]
    cannot = limits(runset, comparisons, left_out)
    return lines + ([*cannot, ""] if cannot else [])
