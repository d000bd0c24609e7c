"""`python -m analysis.legacy_intervals RESULT_DIR...`: intervals and verdicts for reports made before per-seed values
were kept.

Such a report (docs/results/<name>/report.md, written by an earlier `analysis.report`) holds each arm's mean ± sample
std over its seeds, not the seeds' values, so the paired comparison of `analysis.statistics` cannot be made from it.
What can be: per cell of its held-out gain table (or, without one, of its stability table's final reward), each arm
against GRPO in the same cell, the difference of means with Welch's 95% interval (unpaired: wider than a paired one
would have been) and a verdict by the same rule as the paired reports': **separates** when the interval excludes 0
and an exact test on that many seeds could reach p < 0.05 at all (an unpaired permutation test of n and m seeds has
its smallest two-sided p at 2 / C(n + m, n): 0.1 for 3 against 3), otherwise **not distinguishable**; one seed gives
no interval. The section is written into the report (replacing an earlier one), naming this command.
Exit code 2 and one `error:` line on bad input.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass
from pathlib import Path

from scipy import stats

from analysis.cli import Command, command_line
from analysis.statistics import ALPHA, CONFIDENCE

SECTION = "## Intervals from the recorded means"
BASELINE = "grpo"
_MEAN_STD = re.compile(r"^([+-]?\d*\.?\d+)(?: ± (\d*\.?\d+))?$")


@dataclass(frozen=True)
class Summary:
    """One arm's recorded mean, sample std (None with one seed) and seed count."""

    mean: float
    std: float | None
    seeds: int


def read_tables(text: str) -> dict[str, list[dict[str, str]]]:
    """Every markdown table of a report under the heading it follows: rows as {column: cell}."""
    tables: dict[str, list[dict[str, str]]] = {}
    heading, header = "", None
    for line in text.splitlines():
        if line.startswith("## "):
            heading, header = line[3:].strip(), None
        elif line.startswith("|"):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if header is None:
                header = cells
            elif not set("".join(cells)) <= set("-: "):
                tables.setdefault(heading, []).append(dict(zip(header, cells)))
        else:
            header = None
    return tables


def parse_summary(cell: str, seeds: str) -> Summary | None:
    match = _MEAN_STD.match(cell.replace("−", "-"))
    if match is None or not seeds.isdigit():
        return None
    return Summary(float(match.group(1)), float(match.group(2)) if match.group(2) else None, int(seeds))


def measured_cells(tables: dict[str, list[dict[str, str]]]) -> tuple[str, dict[str, dict[str, Summary]]]:
    """(what was measured, {cell: {arm: Summary}}): the held-out gain per arm and swept setting when the report has
    it, else the final reward per series (a series label's part after the method names its cell)."""
    cells: dict[str, dict[str, Summary]] = {}
    if "Held-out accuracy gained" in tables:
        for row in tables["Held-out accuracy gained"]:
            gain = next(key for key in row if key.startswith("gain"))
            axes = [key for key in row if key not in ("arm", "start (greedy)", gain, "seeds")]
            summary = parse_summary(row[gain], row["seeds"])
            if summary is not None:
                cell = ", ".join(f"{key}={row[key]}" for key in axes)
                cells.setdefault(cell, {})[row["arm"]] = summary
        return "held-out greedy accuracy gained, end − start", cells
    for row in tables.get("Stability", []):
        final = next((key for key in row if key.startswith("final reward")), None)
        summary = parse_summary(row[final], row["seeds"]) if final else None
        if summary is not None:
            arm, _, cell = row["series"].partition(", ")
            cells.setdefault(cell, {})[arm] = summary
    return "final training reward (mean of the last logged steps)", cells


def smallest_unpaired_p(n: int, m: int) -> float:
    """The smallest two-sided p an exact unpaired permutation test of n against m seeds can give."""
    return 2 / math.comb(n + m, n)


def verdict(arm: Summary, base: Summary) -> tuple[str, str]:
    """(the Welch interval of arm − base as text, the verdict)."""
    if arm.std is None or base.std is None or arm.seeds < 2 or base.seeds < 2:
        return "–", "one seed: no interval"
    difference = arm.mean - base.mean
    variances = arm.std**2 / arm.seeds, base.std**2 / base.seeds
    error = math.sqrt(sum(variances))
    if error == 0:
        return f"{difference:+.3f}", "no spread recorded: no interval"
    df = sum(variances) ** 2 / (variances[0] ** 2 / (arm.seeds - 1) + variances[1] ** 2 / (base.seeds - 1))
    half = stats.t.ppf(1 - (1 - CONFIDENCE) / 2, df) * error
    interval = f"{difference:+.3f} [{difference - half:+.3f}, {difference + half:+.3f}]"
    floor = smallest_unpaired_p(arm.seeds, base.seeds)
    if floor >= ALPHA:
        return interval, (
            f"not distinguishable ({arm.seeds} against {base.seeds} seeds: no exact test reaches "
            f"p < {ALPHA:g}, its smallest p is {floor:.2g})"
        )
    if abs(difference) > half:
        return interval, "separates (95% Welch CI of the difference excludes 0)"
    return interval, "not distinguishable (95% Welch CI of the difference includes 0)"


def section(measured: str, cells: dict[str, dict[str, Summary]], command: str) -> list[str]:
    rows = []
    for cell, arms in cells.items():
        reference = BASELINE if BASELINE in arms else sorted(arms)[0]
        for arm, summary in arms.items():
            if arm != reference:
                interval, words = verdict(summary, arms[reference])
                rows.append(f"| {cell or '–'} | {arm} − {reference} | {summary.seeds} | {interval} | {words} |")
    lines = [
        SECTION,
        "",
        f"Added by `{command}` to a report made before per-seed values were kept: each arm against "
        f"{BASELINE} in the same cell (or, in a cell without it, the first arm by name), on the {measured}, from "
        "the recorded mean ± sample std (unpaired: Welch's 95% interval; analysis/legacy_intervals.py says how "
        "the verdict is decided).",
        "",
    ]
    if not rows:
        return lines + ["No cell holds two arms: nothing to compare."]
    return lines + [
        "| cell | comparison | seeds | difference of means [95% Welch CI] | verdict |",
        "|---|---|---|---|---|",
        *rows,
    ]


def annotate(report: Path, command: str) -> Path:
    text = report.read_text(encoding="utf-8")
    kept = text.split(f"\n{SECTION}\n", 1)[0].rstrip("\n")
    measured, cells = measured_cells(read_tables(kept))
    report.write_text(kept + "\n\n" + "\n".join(section(measured, cells, command)) + "\n", encoding="utf-8")
    return report


def arguments(parser: argparse.ArgumentParser) -> None:
    """The result folders, each holding a report.md."""
    parser.add_argument("results", nargs="+", type=Path, metavar="RESULT_DIR", help="folders holding a report.md")


def read(args: argparse.Namespace) -> list[Path]:
    """The reports, every folder holding one."""
    missing = [str(folder) for folder in args.results if not (folder / "report.md").is_file()]
    if missing:
        raise ValueError(f"no report.md in {', '.join(missing)}")
    return [folder / "report.md" for folder in args.results]


def write(reports: list[Path], args: argparse.Namespace, command: str) -> str:
    """Each report with its section; a line per report. Each names the command that annotates its own folder, the
    line that makes it again."""
    return "\n".join(
        f"report: {annotate(report, command_line('analysis.legacy_intervals', [report.parent]))}" for report in reports
    )


main = Command("analysis.legacy_intervals", __doc__, arguments, read, write).main

if __name__ == "__main__":
    main()
