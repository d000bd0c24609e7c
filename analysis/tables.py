"""The files a report writes and the markdown tables every report shares: a number as a table shows it, a table, and
the sections `analysis.report` and `analysis.compare` both write (each arm against the baseline, beside the committed
results, the seeds left out).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pandas as pd

from analysis import statistics
from analysis.configs import SYNTHETIC_KEYS
from analysis.headline import difference, no_match
from analysis.records import rows_as_dicts
from analysis.references import Reference
from analysis.verdicts import PRIMARY, SECONDARY

REPORT_FILE = "report.md"
SUMMARY_FILE = "summary.csv"
PER_SEED_FILE = "per_seed.csv"  # every run's held-out gains: the numbers behind the sweep table and the comparisons
COMPARISONS_FILE = "comparisons.csv"  # every arm against the baseline arm, per cell and measure
LEFT_OUT_FILE = "left_out.csv"  # every (arm, cell, start, seed) the comparisons could have held and do not, with why


def num(value: Any, fmt: str = ".3g") -> str:
    """A number as a table shows it (`fmt`), a dash where there is none."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return format(value, fmt)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table of `header` and `rows` (each cell as `str` writes it, a `|` inside it escaped)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell).replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def axis_header(key: str) -> str:
    """A swept setting as a table's column names it (a SYNTHETIC intervention says so)."""
    return f"{key} (SYNTHETIC)" if key in SYNTHETIC_KEYS else key


def comparison_section(comparisons: pd.DataFrame, axes: list[str], baseline: str | None) -> list[str]:
    """Every arm against the baseline arm, paired over shared (start, seed) units: the declared family first (its
    verdicts under Holm's correction), then every other comparison, labelled secondary; with ≥ 2 starts the two-level
    statistics beside each, with one a sentence that says the numbers are that start's. `baseline` is None where the
    runs hold no arm (`verdicts.baseline_arm`), and then there is no comparison."""
    if comparisons.empty:
        return []
    title = f"## Each arm against {baseline}, paired over shared seeds"
    if "difference_estimate" not in comparisons or comparisons["difference_estimate"].isna().all():
        shared = " or ".join(str(n) for n in sorted(set(comparisons["seeds"])))
        return [
            title,
            "",
            f"None of the {len(comparisons)} comparisons (each arm against {baseline} in each cell, on "
            f"each summary; `{COMPARISONS_FILE}`) could be made: the two arms of each share {shared} "
            "seed(s) there, and a paired comparison needs 2.",
        ]
    records = rows_as_dicts(comparisons)
    across = any(row.get("starts", 1) >= 2 for row in records if not pd.isna(row.get("starts", math.nan)))
    primary = [row for row in records if row["role"] == PRIMARY]
    secondary = [row for row in records if row["role"] == SECONDARY]
    measure = primary[0]["measure"] if primary else "–"
    lines = [title, "", f"### The family: `{measure}`, the primary summary", ""]
    lines += (
        [_comparison_table(primary, axes, baseline, across, family=True), ""]
        if primary
        else ["No arm of the declared family was compared.", ""]
    )
    lines += (
        [
            "### Secondary: the other summaries and arms (not corrected for the family: suggestive at most)",
            "",
            _comparison_table(secondary, axes, baseline, across, family=False),
            "",
        ]
        if secondary
        else []
    )
    lines += [
        f"Per cell of the sweep, over the (cold start, seed) pairs both arms hold with a counted run "
        f"(`{COMPARISONS_FILE}` has every number): the mean of the per-pair differences with its 95% paired "
        f"percentile bootstrap interval ({statistics.RESAMPLES:,} resamples), the share of pairs the arm leads (a tie "
        "counts ½: the paired probability of improvement; rliable's unpaired P(X > Y), a seed of the arm against any "
        f"seed of the baseline, is in the CSV), each arm's interquartile mean from {statistics.IQM_FROM} pairs on, "
        "and the exact paired sign-flip test (ties on the k/n grid of accuracies counted as ties). "
        "**Separates** when the interval excludes 0 and the test's p is below 0.05 — for the family, its Holm-adjusted "
        "p over the family's comparisons; a secondary row keeps its own p and is labelled so. A sign-flip test on "
        "fewer than 6 units cannot reach 0.05; a row that does not separate names the smallest mean difference its "
        "pairs could have detected (a paired t-test at α = 0.05 with 80% power, given their spread). "
        "analysis/statistics.py says why these and not others.",
        "",
        _starts_note(records),
    ]
    return lines


def references_section(matched: pd.DataFrame, references: Sequence[Reference], axes: list[str]) -> list[str]:
    """Every comparison beside the row of each reference that matches it (`analysis.references.beside`), every
    summary; the references with no matching row and what their tables hold."""
    if not references:
        return []
    rows = [
        [
            *[num(row["cell"].get(key), "g") for key in axes],
            row["arm"],
            row["measure"],
            f"{difference(row, 'here')} ({row['here_seeds']})",
            f"`{row['reference']}`",
            f"{difference(row, 'there')} ({row['there_seeds']})",
            row["there_verdict"],
            f"**{row['sign']}**",
        ]
        for row in rows_as_dicts(matched)
    ]
    lines = ["## Beside the committed results", ""]
    if rows:
        lines += [
            markdown_table(
                [
                    *[axis_header(key) for key in axes],
                    "arm",
                    "measure",
                    "here: arm − baseline [95% CI] (seeds)",
                    "reference",
                    "there: arm − baseline [95% CI] (seeds)",
                    "its verdict",
                    "sign",
                ],
                rows,
            ),
            "",
        ]
    lines += [
        "Each comparison here beside the row of a reference (`comparison.references`: the committed results "
        "these runs are a miniature of, read from their comparisons.csv) of the same arm, baseline, measure and "
        "cell: every setting either side varied at one value, a setting only this sweep varied taken at the "
        "schema's default in the reference (its table records only what it varied), a setting only the "
        "reference varied at the value every run here holds. **Sign**: whether the two estimates point the same "
        "way, the one thing a few seeds can agree with or contradict; the reference's verdict is as committed. "
        "Its runs are not paired with these (they may come from another cold start of the recipe): only the "
        "directions are compared."
    ]
    for reference in references:
        if reference.path not in set(matched["reference"]):
            lines += ["", f"`{reference.path}`: no matching row; {no_match(reference)}."]
    return lines


def _comparison_table(
    rows: list[dict[str, Any]], axes: list[str], baseline: str | None, across: bool, family: bool
) -> str:
    header = [
        *[axis_header(key) for key in axes],
        "arm",
        *([] if family else ["measure"]),
        "pairs",
        f"arm − {baseline}, mean [95% CI]",
        "pairs ahead",
        "IQM arm / baseline",
        "sign-flip p",
    ]
    if across:
        header += ["starts", "across starts, mean [two-level 95% CI]", "start-level p", "each start (pairs)"]
    header += [*(["Holm p"] if family else []), "verdict"]
    table = []
    for row in rows:
        cells = [*[f"{row[key]:g}" for key in axes], row["arm"], *([] if family else [row["measure"]]), row["seeds"]]
        if pd.isna(row.get("difference_estimate")):
            table.append(
                [*cells, "–", "–", "–", "–", *(["–"] * 4 if across else []), *(["–"] if family else []), row["verdict"]]
            )
            continue
        iqm = (
            "–"
            if pd.isna(row["arm_iqm_estimate"])
            else f"{row['arm_iqm_estimate']:+.3f} / {row['baseline_iqm_estimate']:+.3f}"
        )
        cells += [
            f"{row['difference_estimate']:+.3f} [{row['difference_low']:+.3f}, {row['difference_high']:+.3f}]",
            f"{row['pairs_ahead']:.2f}",
            iqm,
            f"{row['p_value']:.3g}",
        ]
        if across and row["starts"] >= 2:
            agree = "same sign on every start" if row["starts_agree"] else "signs differ"
            cells += [
                int(row["starts"]),
                f"{row['starts_difference_estimate']:+.3f} "
                f"[{row['starts_difference_low']:+.3f}, {row['starts_difference_high']:+.3f}]",
                f"{row['starts_p_value']:.3g}",
                f"{row['per_start']} ({agree})",
            ]
        elif across:
            cells += [1, "–", "–", row["per_start"]]
        cells += [
            *([f"{row['holm_p']:.3g}"] if family else []),
            f"**{row['verdict']}**" if row["separates"] and family else row["verdict"],
        ]
        table.append(cells)
    return markdown_table(header, table)


def _starts_note(records: list[dict[str, Any]]) -> str:
    """What the comparisons' numbers are about: one start (that checkpoint), or several (the recipe)."""
    starts = {str(row.get("per_start", "")).split(":")[0] for row in records if row.get("starts", 0) == 1}
    if any(row.get("starts", 0) >= 2 for row in records):
        return (
            "Pairs from two or more cold starts: beside the within-start numbers (every pair pooled, as if the "
            "starts were fixed), the two-level bootstrap (starts resampled with replacement, then seeds within "
            "each, every start weighted equally) and the exact sign-flip test on the starts' own mean differences "
            "speak for the recipe; they decide the family's verdicts. Six starts are needed for that test to "
            "reach 0.05."
        )
    start = next(iter(starts - {""}), "?")
    if start == "?":
        return (
            "One start, unnamed (the summaries hold no start_sha256): within-start statistics only. They cover "
            "the RL seeds' noise from that checkpoint, not another start's: a two-level interval needs ≥ 2 starts."
        )
    return (
        f"One start (sha256 `{start}`): within-start statistics only. They cover the RL seeds' noise from that "
        "checkpoint, not what another start of the same recipe would give: a two-level interval needs ≥ 2 starts."
    )


def left_out_section(table: pd.DataFrame, axes: list[str]) -> list[str]:
    """Every (arm, cell, start, seed) the comparisons could have held and do not, with why."""
    lines = ["## Seeds left out of the comparisons", ""]
    if table.empty:
        return lines + [
            "None: every arm holds a counted run at every (start, seed) of its cell that another arm holds."
        ]
    rows = [
        [
            row["arm"],
            *[num(row[key], "g") for key in axes],
            f"`{row['start_sha256'][:12]}`" if row["start_sha256"] else "–",
            row["seed"] or "–",
            f"`{row['run']}`" if row["run"] != "–" else "–",
            row["why"],
        ]
        for row in table.to_dict("records")
    ]
    return lines + [
        markdown_table(["arm", *[axis_header(key) for key in axes], "start", "seed", "run", "why"], rows),
        "",
        f"Also in `{LEFT_OUT_FILE}`. A pair is compared only where both arms hold a counted run; each "
        "row here is a pair some comparison lost.",
    ]
