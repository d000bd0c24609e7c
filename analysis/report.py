"""`python -m analysis.report`: figures, a stability table and report.md from run directories or W&B.

    python -m analysis.report RUN_OR_SWEEP_DIR... [--out DIR] [--pdf] [--figures N ...]
    python -m analysis.report --wandb ENTITY/PROJECT [--group G ...] [--out DIR] [--refresh]

Writes into the output folder one PNG per figure (analysis/figures.py; a PDF beside it with `--pdf`, for a paper; only
the figures `--figures` names, where it is given, each other named in the report with why it is not drawn),
`summary.csv` (the stability table, one row per series), `per_seed.csv`, `comparisons.csv`, `left_out.csv` and
`report.md`, which opens on what ran and what it shows (analysis/headline.py: the figure of what the sweep varied, the
declared comparisons' verdicts, each beside the committed result the runs declare they are a miniature of,
analysis/references.py, and what the sweep cannot show), then embeds every other PNG with a one-sentence caption, lists
incomplete runs and loading problems, says which panels were left out and why (a metric not logged, a quantity the runs
did not vary), defines every number in the tables, states the comparison the runs declared (`analysis.declaration`: the
baseline, the primary summary, the family Holm's correction runs over, how early-stopped runs count) and names every
seed the comparisons left out.
Runs are paired by their cold start (the weights' sha256 each summary names) and seed; with runs from two or more starts
each comparison also gets the two-level statistics across starts (`statistics.across_starts`). Bad input (no runs, a
missing directory, a declaration that does not fit the runs, a declared reference that is not a report's folder, runs of
one start and seed that differ beyond their arms) ends with a one-line `error:` message and exit code 2, before any
figure is drawn. The report is written into a staging folder and put in place whole (`cli.staged`): an interrupt
(SIGTERM, Ctrl-C) or a crash leaves the previous report untouched, or none, and the interrupt says which in one line. A
report that fails removes the output folders it created while they are still empty.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from analysis import declaration as declared
from analysis.arms import arm_names, sweep_axes
from analysis.cli import Command, publishing, staged, writable_out
from analysis.configs import schema_defaults
from analysis.figures import all_figures
from analysis.gains import EXCLUDED, accuracy_gain, left_out
from analysis.headline import first_screen, headline_figure
from analysis.load import load_runs
from analysis.plotting import FIGURE_NUMBERS, FigureSettings
from analysis.records import RunSet, run_configs
from analysis.references import Reference, beside, held_settings
from analysis.sections import (
    early_warning_section,
    figure_section,
    one_arm_section,
    runs_section,
    stability_section,
    sweep_section,
)
from analysis.summaries import COLLAPSE_DROP, EMA_ALPHA, LAST_N, stability_table
from analysis.tables import (
    COMPARISONS_FILE,
    LEFT_OUT_FILE,
    PER_SEED_FILE,
    REPORT_FILE,
    SUMMARY_FILE,
    comparison_section,
    left_out_section,
    markdown_table,  # noqa: F401  (benchmarks/ import it from here)
    references_section,
)
from analysis.verdicts import DEFAULT_BASELINE, PRIMARY, arm_comparisons, check_pairable
from analysis.wandb_runs import default_wandb_api, load_wandb, wandb_cache_dir

# The files a report writes, and so replaces (`cli.staged`): nothing else in its folder is touched.
REPORT_OUTPUT = re.compile(r"^(fig\w*\.(png|pdf)|report\.md|(summary|per_seed|comparisons|left_out)\.csv)$")


@dataclass(frozen=True)
class ReportSettings:
    """How a report reads its runs and draws them (the command line's numbers), and the command it names."""

    last_n: int = LAST_N  # steps averaged for the final reward
    drop: float = COLLAPSE_DROP  # the reward drop below the best that counts as a collapse
    alpha: float = EMA_ALPHA  # the EMA weight of the smoothed curves
    dpi: int = 150
    pdf: bool = False
    command: str = ""  # the command line that made the report ("Made with"), where one did
    figures: tuple[str, ...] | None = None  # the figures to draw (`--figures`); None: every figure


@dataclass(frozen=True)
class Decision:
    """What a report decides by, read and checked before any figure (`decide`)."""

    declaration: declared.Declaration
    gains: pd.DataFrame  # every run's held-out gains and whether it counts (`gains.accuracy_gain`)
    axes: list[str]  # the swept settings that vary among the runs with gains
    references: list[Reference]


def decide(runset: RunSet, overrides: dict[str, Any] | None = None) -> Decision:
    """The runs' declared comparison (with the command line's `overrides`), checked against their arms, the per-run
    gains it counts, the swept axes and the declared references, read; `ValueError` (one line) for a declaration that
    does not fit the runs, a reference that is not a report's folder, and runs of one cell, start and seed that
    differ beyond their arms. Everything a report refuses, before any figure."""
    configs = run_configs(runset.runs)
    declaration = declared.read(configs, overrides)
    declaration.checked(arm_names(configs).values())
    references = declaration.read_references()
    gains = accuracy_gain(runset, declaration.early_stopped)
    axes = [key for key in sweep_axes(runset) if gains[key].nunique() > 1] if not gains.empty else []
    check_pairable(runset, gains, axes)
    return Decision(declaration, gains, axes, references)


def write_report(
    runset: RunSet,
    out_dir: Path,
    settings: ReportSettings = ReportSettings(),
    overrides: dict[str, Any] | None = None,
    decision: Decision | None = None,
) -> Path:
    """Write every figure (PNG; and PDF with `settings.pdf`), summary.csv, per_seed.csv, comparisons.csv (every arm
    against the baseline: the declared one, or GRPO), left_out.csv and report.md into `out_dir`, through a staging
    folder (`cli.staged`); returns the path of report.md. `overrides`: the command line's fields of the declaration;
    `decision`: what `decide` made of the runs and `overrides`, where the caller has it already."""
    out_dir = Path(out_dir)
    decision = decision or decide(runset, overrides)
    with staged(out_dir, REPORT_OUTPUT.match, REPORT_FILE) as stage:
        assemble(runset, stage, decision, settings)
    return out_dir / REPORT_FILE


def assemble(runset: RunSet, out_dir: Path, decision: Decision, settings: ReportSettings) -> None:
    """report.md and the files beside it: the first screen (`analysis.headline`: what ran, the headline figure, the
    verdicts, the references, what the sweep cannot show), then the tables behind it (the gains, the declared
    comparison, every comparison, each beside its reference), then the long ones (runs, figures, seeds left out,
    stability, early warning)."""
    declaration, gains, axes, references = (decision.declaration, decision.gains, decision.axes, decision.references)
    figures = all_figures(
        runset,
        FigureSettings(
            out_dir,
            settings.dpi,
            settings.pdf,
            settings.alpha,
            declaration.early_stopped,
            declaration.primary,
            settings.figures,
        ),
    )
    table = stability_table(runset, last_n=settings.last_n, drop=settings.drop, alpha=settings.alpha)
    table.to_csv(out_dir / SUMMARY_FILE, index=False)
    gains.to_csv(out_dir / PER_SEED_FILE, index=False)
    counted = gains[gains["counted"] != EXCLUDED]
    arms = sorted(set(gains["arm"]))
    comparisons, baseline = pd.DataFrame(), declaration.reference(arms) if arms else None
    if len(set(counted["arm"])) > 1:
        comparisons = arm_comparisons(gains, baseline, axes, declaration.primary, declaration.family_of(arms))
        comparisons.to_csv(out_dir / COMPARISONS_FILE, index=False)
    missing = left_out(runset, gains, axes, declaration.early_stopped)
    missing.to_csv(out_dir / LEFT_OUT_FILE, index=False)
    held = held_settings(json.loads(config) for config in runset.runs["config"])
    matched = beside(comparisons, axes, held, schema_defaults() if references else {}, references)
    n_incomplete = int(runset.runs["incomplete"].sum())
    lines = [
        "# moe-rl-lab report",
        "",
        f"Source: {runset.source}. {len(runset.runs)} runs in {len(runset.labels)} series "
        f"({n_incomplete} incomplete). Series are labelled by the config keys that differ between them; seeds "
        "are aggregated.",
    ]
    if settings.command:
        lines += ["", f"Made with `{settings.command}`."]
    lines += ["", *first_screen(runset, gains, axes, declaration, comparisons, matched, references, figures, missing)]
    sweep = sweep_section(runset, counted)
    lines += sweep + ([""] if sweep else [])
    if len(set(counted["arm"])) > 1:
        size = int((comparisons["role"] == PRIMARY).sum()) if not comparisons.empty else 0
        lines += declaration.lines(arms, size) + [""] + comparison_section(comparisons, axes, baseline) + [""]
        lines += references_section(matched, references, axes) + ([""] if references else [])
    elif len(set(counted["arm"])) == 1:
        lines += (
            one_arm_section(runset, counted)
            + [""]
            + declaration.lines(arms, 0)
            + [
                "",
                "One arm here, so the declared comparison is made where its baseline's runs are: `python -m "
                "analysis.compare` with that report's per-seed table.",
                "",
            ]
        )
    shown = headline_figure(figures)
    lines += runs_section(runset) + [""] + figure_section(figures, shown.number if shown else None) + [""]
    if not gains.empty or not runset.unstarted.empty:  # without any evaluated run there was nothing to compare
        lines += left_out_section(missing, axes) + [""]
    lines += stability_section(runset, table, settings.last_n, settings.drop, settings.alpha)
    lines += [""] + early_warning_section(runset, settings.drop, settings.alpha)
    (out_dir / REPORT_FILE).write_text("\n".join(lines) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------------------------


def default_out_dir(paths: Sequence[str], wandb_path: str | None, groups: Sequence[str]) -> Path:
    """`reports/<name>`: the last two components of the first directory, or the W&B project and groups."""
    if wandb_path:
        return Path("reports") / wandb_cache_dir(Path("."), wandb_path, groups).name
    parts = Path(paths[0]).resolve().parts[-2:]
    return Path("reports") / "_".join(p.strip("/") for p in parts if p.strip("/"))


def output_folder(args: argparse.Namespace) -> Path:
    """Where the report goes: `--out`, else `default_out_dir`."""
    return args.out or default_out_dir(args.paths, args.wandb, args.group)


def arguments(parser: argparse.ArgumentParser) -> None:
    """The report's flags: the runs (directories or a W&B project), where it goes, how it reads and draws them, and
    the fields of the declared comparison the command line may set."""
    parser.add_argument(
        "paths",
        nargs="*",
        metavar="RUN_OR_SWEEP_DIR",
        help="run directories or sweep directories, searched recursively",
    )
    parser.add_argument("--wandb", metavar="ENTITY/PROJECT", help="read runs from this W&B project instead")
    parser.add_argument(
        "--group",
        nargs="+",
        action="extend",
        default=[],
        metavar="G",
        help="with --wandb: only runs in these groups (sweep names)",
    )
    parser.add_argument("--out", type=Path, help="output folder (default: reports/<name of the input>)")
    parser.add_argument(
        "--cache-dir", type=Path, help="with --wandb: where the parquet cache lives (default: OUT/.cache)"
    )
    parser.add_argument("--refresh", action="store_true", help="with --wandb: ignore the cache and fetch again")
    parser.add_argument(
        "--last-n", type=int, default=LAST_N, help="steps averaged for the final reward (default: %(default)s)"
    )
    parser.add_argument(
        "--collapse-drop",
        type=float,
        default=COLLAPSE_DROP,
        help="absolute reward drop below the best that counts as collapse (default: %(default)s)",
    )
    parser.add_argument(
        "--ema-alpha",
        type=float,
        default=EMA_ALPHA,
        help="EMA smoothing weight of the newest point, 1 = none (default: %(default)s)",
    )
    parser.add_argument("--dpi", type=int, default=150, help="PNG resolution (default: %(default)s)")
    parser.add_argument("--pdf", action="store_true", help="also a PDF of every figure (for a paper)")
    parser.add_argument(
        "--figures",
        nargs="+",
        metavar="N",
        help="draw only these figures, by number (0, 1, ..., 4a, ...); the others are named, with why they are "
        "not drawn (default: every figure)",
    )
    declared.add_flags(
        parser,
        early_stopped=True,
        references=True,
        baseline_help=f"the arm every other is compared with, paired over seeds (default: the runs' "
        f"declaration, else {DEFAULT_BASELINE} when the runs have it, else the first "
        "arm by name)",
    )


def usage_error(args: argparse.Namespace) -> str | None:
    """The first flag that contradicts another or is out of range, in words (argparse reports it with the usage)."""
    if bool(args.paths) == bool(args.wandb):
        return "give run/sweep directories or --wandb ENTITY/PROJECT (one of the two)"
    if args.group and not args.wandb:
        return "--group only applies with --wandb"
    if args.last_n < 1:
        return f"--last-n must be at least 1, got {args.last_n}"
    if not 0.0 < args.ema_alpha <= 1.0:
        return f"--ema-alpha must be in (0, 1], got {args.ema_alpha}"
    if args.collapse_drop <= 0:
        return f"--collapse-drop must be positive, got {args.collapse_drop}"
    if args.dpi < 10:
        return f"--dpi must be at least 10, got {args.dpi}"
    unknown = [number for number in args.figures or [] if number not in FIGURE_NUMBERS]
    if unknown:
        return f"--figures: no figure {', '.join(unknown)}; the report's figures are {', '.join(report_order())}"
    return None


def report_order() -> list[str]:
    """The figures' numbers as the report orders them: 0, 1, ..., 4a, 4b, 4c, 5, ..."""
    return sorted(FIGURE_NUMBERS, key=lambda number: (int(number.rstrip("abc")), number))


def read(args: argparse.Namespace, wandb_api_factory: Callable[[], Any] = default_wandb_api) -> tuple[RunSet, Decision]:
    """Check that the output folder can be written, load the runs, check their declared comparison and pairing."""
    out = output_folder(args)
    writable_out(out)
    if args.wandb:
        runset = load_wandb(
            args.wandb,
            args.group,
            cache_root=args.cache_dir or out / ".cache",
            refresh=args.refresh,
            api_factory=wandb_api_factory,
        )
    else:
        runset = load_runs(args.paths, skip=[out])  # the report's own folder may lie inside the sweep
    return runset, decide(runset, declared.overrides(args))


def write(loaded: tuple[RunSet, Decision], args: argparse.Namespace, command: str) -> str:
    """The report of what `read` loaded and decided; the line saying where it is."""
    runset, decision = loaded
    figures = tuple(dict.fromkeys(args.figures)) if args.figures else None
    settings = ReportSettings(args.last_n, args.collapse_drop, args.ema_alpha, args.dpi, args.pdf, command, figures)
    return f"report: {write_report(runset, output_folder(args), settings, decision=decision)}"


main = Command(
    "analysis.report",
    __doc__,
    arguments,
    read,
    write,
    check=usage_error,
    refuses=(ValueError, FileNotFoundError),
    around=lambda args: publishing(output_folder(args), REPORT_FILE, tidy=True),
).main

if __name__ == "__main__":
    main()
