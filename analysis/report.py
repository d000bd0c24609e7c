"""`python -m analysis.report`: figures, a stability table and report.md from run directories or W&B.

    python -m analysis.report RUN_OR_SWEEP_DIR... [--out DIR] [--pdf]
    python -m analysis.report --wandb ENTITY/PROJECT [--group G ...] [--out DIR] [--refresh]

Writes into the output folder one PNG per figure (analysis/figures.py; a PDF beside it with `--pdf`, for a paper),
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
import math
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from algos.objective import CLIP, SEQ_RATIO_VAR, TOKEN_RATIO_VAR
from analysis import declaration as declared
from analysis import statistics
from analysis.arms import arm_names, arm_order, seed_order, sweep_axes, sweep_cells
from analysis.cli import Interrupted, command_line, refusing, staged, stopped, writable_out
from analysis.configs import FLIP_RATE, PERTURB_RATE, SYNTHETIC_KEYS, schema_defaults
from analysis.diagnostics import WARNING_SIGNALS, WARNING_SUSTAIN, early_warning
from analysis.figures import all_figures
from analysis.gains import EXCLUDED, GAIN_MEASURES, accuracy_gain, how_it_ended, left_out
from analysis.headline import TITLE, difference, first_screen, headline_figure, no_match
from analysis.load import load_runs
from analysis.plotting import FigureOutput, FigureSettings
from analysis.records import UNKNOWN_START, RunSet
from analysis.references import Reference, beside, held_settings
from analysis.summaries import (
    COLLAPSE_DROP, COLLAPSE_MIN_TAIL, COLLAPSE_TAIL_FRACTION, EMA_ALPHA, LAST_N, stability_table,
)
from analysis.verdicts import DEFAULT_BASELINE, PRIMARY, SECONDARY, arm_comparisons, check_pairable
from analysis.wandb_runs import default_wandb_api, load_wandb, wandb_cache_dir
from experiments.step.metrics import DRIFT, FRAGILE, MISMATCH_K3, REWARD, ROUTING_SHARE, SKIPPED, STEP_TIME

REPORT_FILE = "report.md"
SUMMARY_FILE = "summary.csv"
PER_SEED_FILE = "per_seed.csv"  # every run's held-out gains: the numbers behind the sweep table and the comparisons
COMPARISONS_FILE = "comparisons.csv"  # every arm against the baseline arm, per cell and measure
LEFT_OUT_FILE = "left_out.csv"  # every (arm, cell, start, seed) the comparisons could have held and do not, with why
# The files a report writes, and so replaces (`cli.staged`): nothing else in its folder is touched.
REPORT_OUTPUT = re.compile(r"^(fig\w*\.(png|pdf)|report\.md|(summary|per_seed|comparisons|left_out)\.csv)$")
# Stability-table columns whose source metric may be absent, with the metric named in the note.
_TABLE_METRICS = {
    "clip_frac_mean": CLIP,
    "ratio_token_var_mean": TOKEN_RATIO_VAR,
    "ratio_seq_var_mean": SEQ_RATIO_VAR,
    "skipped_steps": SKIPPED,
}


def _num(value: Any, fmt: str = ".3g") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return format(value, fmt)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell).replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _collapse_cell(row: pd.Series) -> str:
    if row["collapse_evaluated_seeds"] == 0:
        return "n/a (too short)"
    verdict = "yes" if row["collapse"] else "no"
    return f"{verdict} ({row['collapsed_seeds']}/{row['collapse_evaluated_seeds']})"


def stability_markdown(table: pd.DataFrame, last_n: int) -> str:
    """The stability table as markdown, numbers rounded for reading (summary.csv keeps full precision)."""
    header = ["series", "seeds", "incomplete", f"final reward (last {last_n})", "best reward", "collapse",
              "clip frac", "experts changed per update", "… mean over minibatches", "ratio var (token)", "ratio var (seq)",
              "mismatch k3", "fragile tokens", "routing share", "skipped steps", "s / step"]
    rows = []
    for _, row in table.iterrows():
        std = row["final_reward_std"]
        final = _num(row["final_reward_mean"], ".3f") + ("" if math.isnan(std) else f" ± {std:.3f}")
        rows.append([
            row["label"], row["seeds"], row["incomplete_runs"], final, _num(row["best_reward"], ".3f"),
            _collapse_cell(row), _num(row["clip_frac_mean"]), _num(row["expert_change_per_update_mean"]),
            _num(row["expert_change_over_minibatches_mean"]),
            _num(row["ratio_token_var_mean"]), _num(row["ratio_seq_var_mean"]), _num(row["mismatch_kl_k3_mean"]),
            _num(row["fragile_frac_mean"]), _num(row["routing_share_mean"]), _num(row["skipped_steps"], ".0f"),
            _num(row["step_s_mean"], ".2f"),
        ])
    return markdown_table(header, rows)


def _runs_section(runset: RunSet) -> list[str]:
    runs = runset.runs
    rows = []
    for label in runset.labels:
        group = runs[runs["label"] == label]
        seeds = ", ".join(sorted((s for s in group["seed"] if s), key=seed_order)) or "–"
        rows.append([label, len(group), seeds, int(group["incomplete"].sum()), int(group["last_step"].max()),
                     ", ".join(sorted(set(group["model"]) - {""})) or "–"])
    lines = ["## Runs", "", markdown_table(["series", "runs", "seeds", "incomplete", "last step", "model"], rows)]
    lines += ["", _starts_sentence(runs)]
    incomplete = runs[runs["incomplete"]]
    if len(incomplete):
        lines += ["", "Runs that did not finish, drawn up to their last valid line (the comparisons count them only as "
                      "the declared rule says: see *Seeds left out*):", ""]
        lines += [f"- `{r.run}` ({r.label}): last step {r.last_step}, "
                  f"{how_it_ended(r.status, r.last_step, json.loads(r.config))}" for r in incomplete.itertuples()]
    if runset.problems:
        lines += ["", "Problems found while loading (each also printed to stderr):", ""]
        lines += [f"- {problem}" for problem in runset.problems]
    return lines


def _starts_sentence(runs: pd.DataFrame) -> str:
    """Which cold starts the runs come from: each start's sha256 (its first 12 digits) and its runs."""
    named = runs[runs["start_sha256"] != UNKNOWN_START]
    counts = named.groupby("start_sha256").size()
    said = ", ".join(f"`{start[:12]}` ({n} runs)" for start, n in counts.items())
    unnamed = len(runs) - len(named)
    if not said:
        return ("Cold start: no run names its start (their summaries hold no start_sha256: unfinished, or written "
                "before it was recorded); runs are paired by seed alone.")
    return (f"Cold start{'s' if len(counts) > 1 else ''} (the sha256 of the weights each run started from, as its "
            f"summary names them): {said}" + (f"; {unnamed} runs name none (no summary)" if unnamed else "") + ".")


def _figure_section(figures: Sequence[FigureOutput], shown: str | None = None) -> list[str]:
    """Every figure with its caption and notes; the one the first screen shows (number `shown`) is named, not drawn
    twice."""
    lines = ["## Figures"]
    for figure in figures:
        lines += ["", f"### Figure {figure.number}: {figure.title}", ""]
        pngs = [f for f in figure.files if f.suffix == ".png"]
        pdfs = [f for f in figure.files if f.suffix == ".pdf"]
        if pngs and figure.number == shown:
            lines.append(f"Shown first, under *{TITLE[3:]}*" + (f" ([PDF]({pdfs[0].name}))." if pdfs else "."))
        elif pngs:
            lines += [f"![{figure.title}]({pngs[0].name})", ""]
            lines.append(figure.caption + (f" ([PDF]({pdfs[0].name}))" if pdfs else ""))
        else:
            lines.append("Not drawn.")
        for note in figure.notes:
            lines += ["", f"> Note: {note}"]
    return lines


def _stability_section(runset: RunSet, table: pd.DataFrame, last_n: int, drop: float, alpha: float) -> list[str]:
    tail = f"K = max({COLLAPSE_MIN_TAIL}, ⌈{COLLAPSE_TAIL_FRACTION:g}·T⌉)"
    lines = [
        "## Stability", "", stability_markdown(table, last_n), "",
        f"Also in `{SUMMARY_FILE}` (full precision, one row per series). Definitions:", "",
        f"- **final reward**: per seed, the mean of `{REWARD}` over its last {last_n} logged steps; then mean "
        "± sample std (ddof = 1) across seeds (no ± with one seed).",
        f"- **best reward**: per seed, the maximum of the EMA-smoothed reward (α = {alpha:g}); mean across seeds.",
        f"- **collapse**: a seed collapsed when its EMA-smoothed reward (α = {alpha:g}) is more than {drop:g} "
        f"(absolute, reward units) below its own best at every one of its last {tail} logged steps (T = logged "
        "steps): it fell and stayed down until the end. Seeds with T < 2K are not evaluated. The cell shows "
        "collapsed / evaluated seeds.",
        f"- **clip frac**, **ratio var**: per seed, the mean over all logged steps of "
        f"`{CLIP}`, `{TOKEN_RATIO_VAR}` and `{SEQ_RATIO_VAR}`; then mean across seeds.",
        f"- **experts changed per update**: per seed, the mean over steps of `{DRIFT}` after one optimizer "
        "update since θ_old (the per-minibatch record with index 1: the GSPO paper's statistic); then mean across "
        "seeds. **… mean over minibatches**: the same over every minibatch record of a step (index 0, on-policy, "
        "is 0 by construction; later ones have seen more updates).",
        f"- **mismatch k3**, **fragile tokens**: per seed, the mean over logged steps of `{MISMATCH_K3}` (k3 of "
        f"KL(μ_old ‖ π_old)) and `{FRAGILE}` (share of tokens whose k-th and (k+1)-th expert probabilities are "
        "within `routing.margin_threshold`); then mean across seeds.",
        f"- **routing share**: per seed, the mean over off-policy minibatch records of `{ROUTING_SHARE}`, the "
        "routing part's share of the variance of log π_θ/π_old (runs with `routing.decompose_every` > 0).",
        f"- **skipped steps**: last value of the cumulative `{SKIPPED}`, summed over seeds.",
        f"- **s / step**: mean `{STEP_TIME}` (else the finished run's wall time / steps), mean across seeds.",
        "- **incomplete**: runs whose `summary.json` does not say finished (none: crashed or still running; or "
        "diverged, interrupted, failed); their numbers here use the steps they logged.",
    ]
    for column, metric in _TABLE_METRICS.items():
        missing = runset.labels_without(metric)
        if missing:
            lines += ["", f"> Note: `{metric}` was not logged by {', '.join(missing)}; `{column}` is empty there."]
    drifting = set(runset.minibatches.loc[runset.minibatches["metric"] == DRIFT, "run"])
    missing = [lab for lab in runset.labels if not set(runset.runs.loc[runset.runs["label"] == lab, "run"]) & drifting]
    if missing:
        lines += ["", f"> Note: `{DRIFT}` was not logged by {', '.join(missing)}; the experts-changed columns are "
                      "empty there."]
    return lines


def _mean_std(values: pd.Series, fmt: str = "+.3f") -> str:
    values = values.dropna()
    if values.empty:
        return "–"
    return f"{values.mean():{fmt}}" + (f" ± {values.std(ddof=1):.3f}" if len(values) > 1 else "")


# What each SYNTHETIC intervention does, and what it can and cannot show, said wherever its runs are reported.
SYNTHETIC_MEANING = {
    FLIP_RATE: "in π_θ's update forwards a share p of the activated experts was swapped for the next-ranked one; "
               "replay (r2, r3) computes with recorded experts there, so no flip reaches a replayed arm: it shows "
               "what the flips do to the arms that feel them, not that replay would hold against drift the policy "
               "itself carries",
    PERTURB_RATE: "after each optimizer update the routers' weights got Gaussian noise sized to move a share p of "
                  "the update's activated experts in each layer; θ keeps it (rollouts, π_old and evaluations route "
                  "with it) and replay removes it only within a step, as it removes natural drift: it shows how each "
                  "arm copes with routing that keeps moving, not what natural drift does at that dose (the noise "
                  "does not follow the gradient, and degrades the routers for every arm)",
}


def _synthetic_note(runset: RunSet) -> str:
    """A sentence per SYNTHETIC intervention the runs had: which runs, what it did, what it can show."""
    notes = []
    for key, meaning in SYNTHETIC_MEANING.items():
        rates = sorted({float(json.loads(config).get(key, 0.0)) for config in runset.runs["config"]})
        if rates != [0.0]:
            notes.append(f" Runs with {key} = p > 0 ({', '.join(f'{p:g}' for p in rates if p)}) are SYNTHETIC: "
                         f"{meaning}.")
    return "".join(notes)


def _axis_header(key: str) -> str:
    return f"{key} (SYNTHETIC)" if key in SYNTHETIC_KEYS else key


def _sweep_section(runset: RunSet, gains: pd.DataFrame) -> list[str]:
    """Held-out greedy accuracy gained from each run's own start, per arm and swept setting, by each of
    `GAIN_MEASURES` side by side (Figure 0's numbers)."""
    if gains.empty:
        return []
    axes = [key for key in sweep_axes(runset) if gains[key].nunique() > 1]
    order = {arm: i for i, arm in enumerate(sorted(gains["arm"].unique(), key=arm_order))}
    rows = []
    for (arm, *values), part in gains.groupby(["arm", *axes], sort=False):
        rows.append((order[arm], values, [arm, *[f"{v:g}" for v in values], f"{part['start'].mean():.3f}",
                                          _mean_std(part["gain"]), _mean_std(part["gain_area"]),
                                          _mean_std(part["split_gain"]), len(part)]))
    rows.sort(key=lambda row: (row[0], row[1]))
    header = ["arm", *[_axis_header(key) for key in axes], "start (greedy)",
              "final gain", "mean gain over the run", "final gain, whole test split", "seeds"]
    definitions = [f"- **{name.replace('_', ' ')}** (`{name}`): {text}." for name, text in GAIN_MEASURES.items()]
    return ["## Held-out accuracy gained", "", markdown_table(header, [row[2] for row in rows]), "",
            f"Per run, from its own start on the same prompts; mean ± sample std over seeds "
            f"({', '.join(sorted(set(gains['seed']), key=seed_order))}). Per-seed values: `{PER_SEED_FILE}`. An arm is the "
            "objective, its replay and, when it is not the trainer's own fp32 model, the engine's precision."
            + _synthetic_note(runset), "", "The measures:", "", *definitions]


def comparison_section(comparisons: pd.DataFrame, axes: list[str], baseline: str) -> list[str]:
    """Every arm against the baseline arm, paired over shared (start, seed) units: the declared family first (its
    verdicts under Holm's correction), then every other comparison, labelled secondary; with ≥ 2 starts the two-level
    statistics beside each, with one a sentence that says the numbers are that start's."""
    if comparisons.empty:
        return []
    title = f"## Each arm against {baseline}, paired over shared seeds"
    if "difference_estimate" not in comparisons or comparisons["difference_estimate"].isna().all():
        shared = " or ".join(str(n) for n in sorted(set(comparisons["seeds"])))
        return [title, "", f"None of the {len(comparisons)} comparisons (each arm against {baseline} in each cell, on "
                           f"each summary; `{COMPARISONS_FILE}`) could be made: the two arms of each share {shared} "
                           "seed(s) there, and a paired comparison needs 2."]
    records = comparisons.to_dict("records")
    across = any(row.get("starts", 1) >= 2 for row in records if not pd.isna(row.get("starts", math.nan)))
    primary = [row for row in records if row["role"] == PRIMARY]
    secondary = [row for row in records if row["role"] == SECONDARY]
    measure = primary[0]["measure"] if primary else "–"
    lines = [title, "", f"### The family: `{measure}`, the primary summary", ""]
    lines += [_comparison_table(primary, axes, baseline, across, family=True), ""] if primary else \
        ["No arm of the declared family was compared.", ""]
    lines += ["### Secondary: the other summaries and arms (not corrected for the family: suggestive at most)", "",
              _comparison_table(secondary, axes, baseline, across, family=False), ""] if secondary else []
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
        "analysis/statistics.py says why these and not others.", "", _starts_note(records)]
    return lines


def references_section(matched: pd.DataFrame, references: Sequence[Reference], axes: list[str]) -> list[str]:
    """Every comparison beside the row of each reference that matches it (`analysis.references.beside`), every
    summary; the references with no matching row and what their tables hold."""
    if not references:
        return []
    rows = [[*[_num(row["cell"].get(key), "g") for key in axes], row["arm"], row["measure"],
             f"{difference(row, 'here')} ({row['here_seeds']})", f"`{row['reference']}`",
             f"{difference(row, 'there')} ({row['there_seeds']})", row["there_verdict"], f"**{row['sign']}**"]
            for row in matched.to_dict("records")]
    lines = ["## Beside the committed results", ""]
    if rows:
        lines += [markdown_table([*[_axis_header(key) for key in axes], "arm", "measure",
                                  "here: arm − baseline [95% CI] (seeds)", "reference",
                                  "there: arm − baseline [95% CI] (seeds)", "its verdict", "sign"], rows), ""]
    lines += ["Each comparison here beside the row of a reference (`comparison.references`: the committed results "
              "these runs are a miniature of, read from their comparisons.csv) of the same arm, baseline, measure and "
              "cell: every setting either side varied at one value, a setting only this sweep varied taken at the "
              "schema's default in the reference (its table records only what it varied), a setting only the "
              "reference varied at the value every run here holds. **Sign**: whether the two estimates point the same "
              "way, the one thing a few seeds can agree with or contradict; the reference's verdict is as committed. "
              "Its runs are not paired with these (they may come from another cold start of the recipe): only the "
              "directions are compared."]
    for reference in references:
        if reference.path not in set(matched["reference"]):
            lines += ["", f"`{reference.path}`: no matching row; {no_match(reference)}."]
    return lines


def _comparison_table(rows: list[dict], axes: list[str], baseline: str, across: bool, family: bool) -> str:
    header = [*[_axis_header(key) for key in axes], "arm", *([] if family else ["measure"]), "pairs",
              f"arm − {baseline}, mean [95% CI]", "pairs ahead", "IQM arm / baseline", "sign-flip p"]
    if across:
        header += ["starts", "across starts, mean [two-level 95% CI]", "start-level p", "each start (pairs)"]
    header += [*(["Holm p"] if family else []), "verdict"]
    table = []
    for row in rows:
        cells = [*[f"{row[key]:g}" for key in axes], row["arm"], *([] if family else [row["measure"]]), row["seeds"]]
        if pd.isna(row.get("difference_estimate")):
            table.append([*cells, "–", "–", "–", "–", *(["–"] * 4 if across else []), *(["–"] if family else []),
                          row["verdict"]])
            continue
        iqm = "–" if pd.isna(row["arm_iqm_estimate"]) else \
            f"{row['arm_iqm_estimate']:+.3f} / {row['baseline_iqm_estimate']:+.3f}"
        cells += [f"{row['difference_estimate']:+.3f} [{row['difference_low']:+.3f}, {row['difference_high']:+.3f}]",
                  f"{row['pairs_ahead']:.2f}", iqm, f"{row['p_value']:.3g}"]
        if across and row["starts"] >= 2:
            agree = "same sign on every start" if row["starts_agree"] else "signs differ"
            cells += [int(row["starts"]), f"{row['starts_difference_estimate']:+.3f} "
                      f"[{row['starts_difference_low']:+.3f}, {row['starts_difference_high']:+.3f}]",
                      f"{row['starts_p_value']:.3g}", f"{row['per_start']} ({agree})"]
        elif across:
            cells += [1, "–", "–", row["per_start"]]
        cells += [*([f"{row['holm_p']:.3g}"] if family else []),
                  f"**{row['verdict']}**" if row["separates"] and family else row["verdict"]]
        table.append(cells)
    return markdown_table(header, table)


def _starts_note(records: list[dict]) -> str:
    """What the comparisons' numbers are about: one start (that checkpoint), or several (the recipe)."""
    starts = {str(row.get("per_start", "")).split(":")[0] for row in records if row.get("starts", 0) == 1}
    if any(row.get("starts", 0) >= 2 for row in records):
        return ("Pairs from two or more cold starts: beside the within-start numbers (every pair pooled, as if the "
                "starts were fixed), the two-level bootstrap (starts resampled with replacement, then seeds within "
                "each, every start weighted equally) and the exact sign-flip test on the starts' own mean differences "
                "speak for the recipe; they decide the family's verdicts. Six starts are needed for that test to "
                "reach 0.05.")
    start = next(iter(starts - {""}), "?")
    if start == "?":
        return ("One start, unnamed (the summaries hold no start_sha256): within-start statistics only. They cover "
                "the RL seeds' noise from that checkpoint, not another start's: a two-level interval needs ≥ 2 starts.")
    return (f"One start (sha256 `{start}`): within-start statistics only. They cover the RL seeds' noise from that "
            "checkpoint, not what another start of the same recipe would give: a two-level interval needs ≥ 2 starts.")


def left_out_section(table: pd.DataFrame, axes: list[str]) -> list[str]:
    """Every (arm, cell, start, seed) the comparisons could have held and do not, with why."""
    lines = ["## Seeds left out of the comparisons", ""]
    if table.empty:
        return lines + ["None: every arm holds a counted run at every (start, seed) of its cell that another arm "
                        "holds."]
    rows = [[row["arm"], *[_num(row[key], "g") for key in axes], f"`{row['start_sha256'][:12]}`" if row["start_sha256"]
             else "–", row["seed"] or "–", f"`{row['run']}`" if row["run"] != "–" else "–", row["why"]]
            for row in table.to_dict("records")]
    return lines + [markdown_table(["arm", *[_axis_header(key) for key in axes], "start", "seed", "run", "why"], rows),
                    "", f"Also in `{LEFT_OUT_FILE}`. A pair is compared only where both arms hold a counted run; each "
                        "row here is a pair some comparison lost."]


def _one_arm_section(runset: RunSet, gains: pd.DataFrame) -> list[str]:
    """With one arm there is nothing to compare: its mean gain per measure (and swept cell) with the 95% interval of
    that mean over its counted seeds (`statistics.mean_interval`); `analysis.compare` pairs it with arms of other
    reports."""
    axes = [key for key in sweep_axes(runset) if gains[key].nunique() > 1]
    rows = []
    for cell, part in sweep_cells(gains, axes):
        values = [part[measure].dropna() for measure in GAIN_MEASURES]
        rows.append([*[f"{cell[key]:g}" for key in axes], len(part),
                     *[statistics.mean_interval(v).text() if len(v) >= 2 else "–" for v in values]])
    header = [*[_axis_header(key) for key in axes], "seeds",
              *[f"{name.replace('_', ' ')}, mean [95% CI]" for name in GAIN_MEASURES]]
    return [f"## {gains['arm'].iloc[0]}: its mean gain with a 95% interval", "", markdown_table(header, rows), "",
            "One arm, so nothing to compare it with here: each mean over seeds with its 95% percentile bootstrap "
            f"interval ({statistics.RESAMPLES:,} resamples), how far other seeds could move it. To pair it with the "
            "arms of another report on shared seeds: `python -m analysis.compare`."]


def _early_warning_section(runset: RunSet, drop: float, alpha: float) -> list[str]:
    """The runs that collapsed, with the step each signal first moved and its lead over the reward's fall."""
    table = early_warning(runset, drop=drop, alpha=alpha)
    if table.empty or not table["collapsed"].any():
        return ["## Early warning", "", "No run collapsed, so there is no fall for a signal to precede."]
    signals = [m for m in WARNING_SIGNALS if f"{m}_moved_step" in table]
    rows = []
    for _, row in table[table["collapsed"]].iterrows():
        cells = [f"{row['label']} (`{row['run']}`)", _num(row["collapse_step"], ".0f")]
        for metric in signals:
            moved, lead = row.get(f"{metric}_moved_step"), row.get(f"{metric}_lead")
            cells.append("–" if moved is None or math.isnan(moved) else f"{moved:.0f} ({lead:+.0f})")
        rows.append(cells)
    alarms = {m: int(table.loc[~table["collapsed"], f"{m}_moved_step"].notna().sum()) for m in signals}
    header = ["collapsed run", "reward fell at step", *[f"`{m}` moved at (lead)" for m in signals]]
    return [
        "## Early warning", "", markdown_table(header, rows), "",
        "The reward fell at the first step of the final stretch where its EMA stayed more than the collapse drop below "
        "its best. A signal moved at the first step, after the first fifth of the run, from which its EMA stayed "
        f"for {WARNING_SUSTAIN} logged steps outside its early band (the first fifth's mean ± max(3 std, 20% of "
        "|mean|)); the lead is the fall's step minus that step (positive: the signal moved first). In the runs that "
        "did not collapse the same test fired (false alarms) for "
        + ", ".join(f"`{m}` in {n} of {int((~table['collapsed']).sum())}" for m, n in alarms.items()) + ".",
    ]


def decide(runset: RunSet, overrides: dict[str, Any] | None = None
           ) -> tuple[declared.Declaration, pd.DataFrame, list[str], list[Reference]]:
    """The runs' declared comparison (with the command line's `overrides`), checked against their arms, the per-run
    gains it counts, the swept axes and the declared references, read; `ValueError` (one line) for a declaration that
    does not fit the runs, a reference that is not a report's folder, and runs of one cell, start and seed that
    differ beyond their arms. Everything a report refuses, before any figure."""
    configs = {row.run: json.loads(row.config) for row in runset.runs.itertuples()}
    declaration = declared.read(configs, overrides)
    declaration.checked(arm_names(configs).values())
    references = declaration.read_references()
    gains = accuracy_gain(runset, declaration.early_stopped)
    axes = [key for key in sweep_axes(runset) if gains[key].nunique() > 1] if not gains.empty else []
    check_pairable(runset, gains, axes)
    return declaration, gains, axes, references


def write_report(runset: RunSet, out_dir: Path, *, last_n: int = LAST_N, drop: float = COLLAPSE_DROP,
                 alpha: float = EMA_ALPHA, dpi: int = 150, pdf: bool = False, command: str = "",
                 baseline: str | None = None, overrides: dict[str, Any] | None = None) -> Path:
    """Write every figure (PNG; and PDF with `pdf`), summary.csv, per_seed.csv, comparisons.csv (every arm against
    the baseline: the declared one, `baseline`, or GRPO), left_out.csv and report.md into `out_dir`, through a staging
    folder (`cli.staged`); returns the path of report.md. `overrides`: the command line's fields of the declaration."""
    out_dir = Path(out_dir)
    overrides = {**(overrides or {}), **({"baseline": baseline} if baseline is not None else {})}
    declaration, gains, axes, references = decide(runset, overrides)
    with staged(out_dir, REPORT_OUTPUT.match, REPORT_FILE) as stage:
        _write(runset, stage, declaration, gains, axes, references, last_n=last_n, drop=drop, alpha=alpha, dpi=dpi,
               pdf=pdf, command=command)
    return out_dir / REPORT_FILE


def _write(runset: RunSet, out_dir: Path, declaration: declared.Declaration, gains: pd.DataFrame, axes: list[str],
           references: list[Reference], *, last_n: int, drop: float, alpha: float, dpi: int, pdf: bool,
           command: str) -> None:
    """report.md: the first screen (`analysis.headline`: what ran, the headline figure, the verdicts, the references,
    what the sweep cannot show), then the tables behind it (the gains, the declared comparison, every comparison,
    each beside its reference), then the long ones (runs, figures, seeds left out, stability, early warning)."""
    figures = all_figures(runset, FigureSettings(out_dir, dpi, pdf, alpha, declaration.early_stopped,
                                                 declaration.primary))
    table = stability_table(runset, last_n=last_n, drop=drop, alpha=alpha)
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
        "# moe-rl-lab report", "",
        f"Source: {runset.source}. {len(runset.runs)} runs in {len(runset.labels)} series "
        f"({n_incomplete} incomplete). Series are labelled by the config keys that differ between them; seeds "
        "are aggregated.",
    ]
    if command:
        lines += ["", f"Made with `{command}`."]
    lines += ["", *first_screen(runset, gains, axes, declaration, comparisons, matched, references, figures,
                                missing)]
    sweep = _sweep_section(runset, counted)
    lines += sweep + ([""] if sweep else [])
    if len(set(counted["arm"])) > 1:
        size = int((comparisons["role"] == PRIMARY).sum()) if not comparisons.empty else 0
        lines += declaration.lines(arms, size) + [""] + comparison_section(comparisons, axes, baseline) + [""]
        lines += references_section(matched, references, axes) + ([""] if references else [])
    elif len(set(counted["arm"])) == 1:
        lines += _one_arm_section(runset, counted) + [""] + declaration.lines(arms, 0) + [
            "", "One arm here, so the declared comparison is made where its baseline's runs are: `python -m "
                "analysis.compare` with that report's per-seed table.", ""]
    shown = headline_figure(figures)
    lines += _runs_section(runset) + [""] + _figure_section(figures, shown.number if shown else None) + [""]
    if not gains.empty or not runset.unstarted.empty:  # without any evaluated run there was nothing to compare
        lines += left_out_section(missing, axes) + [""]
    lines += _stability_section(runset, table, last_n, drop, alpha)
    lines += [""] + _early_warning_section(runset, drop, alpha)
    (out_dir / REPORT_FILE).write_text("\n".join(lines) + "\n", encoding="utf-8")


def default_out_dir(paths: Sequence[str], wandb_path: str | None, groups: Sequence[str]) -> Path:
    """`reports/<name>`: the last two components of the first directory, or the W&B project and groups."""
    if wandb_path:
        return Path("reports") / wandb_cache_dir(Path("."), wandb_path, groups).name
    parts = Path(paths[0]).resolve().parts[-2:]
    return Path("reports") / "_".join(p.strip("/") for p in parts if p.strip("/"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m analysis.report",
        description="Figures (GSPO paper Figs. 1-3, routing drift, ratio variance), a stability table and "
                    "report.md from run/sweep directories or a W&B project.",
    )
    parser.add_argument("paths", nargs="*", metavar="RUN_OR_SWEEP_DIR",
                        help="run directories or sweep directories, searched recursively")
    parser.add_argument("--wandb", metavar="ENTITY/PROJECT", help="read runs from this W&B project instead")
    parser.add_argument("--group", nargs="+", action="extend", default=[], metavar="G",
                        help="with --wandb: only runs in these groups (sweep names)")
    parser.add_argument("--out", type=Path, help="output folder (default: reports/<name of the input>)")
    parser.add_argument("--cache-dir", type=Path,
                        help="with --wandb: where the parquet cache lives (default: OUT/.cache)")
    parser.add_argument("--refresh", action="store_true", help="with --wandb: ignore the cache and fetch again")
    parser.add_argument("--last-n", type=int, default=LAST_N,
                        help="steps averaged for the final reward (default: %(default)s)")
    parser.add_argument("--collapse-drop", type=float, default=COLLAPSE_DROP,
                        help="absolute reward drop below the best that counts as collapse (default: %(default)s)")
    parser.add_argument("--ema-alpha", type=float, default=EMA_ALPHA,
                        help="EMA smoothing weight of the newest point, 1 = none (default: %(default)s)")
    parser.add_argument("--dpi", type=int, default=150, help="PNG resolution (default: %(default)s)")
    parser.add_argument("--pdf", action="store_true", help="also a PDF of every figure (for a paper)")
    declared.add_flags(parser, early_stopped=True, references=True,
                       baseline_help=f"the arm every other is compared with, paired over seeds (default: the runs' "
                                     f"declaration, else {DEFAULT_BASELINE} when the runs have it, else the first "
                                     "arm by name)")
    return parser


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if bool(args.paths) == bool(args.wandb):
        parser.error("give run/sweep directories or --wandb ENTITY/PROJECT (one of the two)")
    if args.group and not args.wandb:
        parser.error("--group only applies with --wandb")
    if args.last_n < 1:
        parser.error(f"--last-n must be at least 1, got {args.last_n}")
    if not 0.0 < args.ema_alpha <= 1.0:
        parser.error(f"--ema-alpha must be in (0, 1], got {args.ema_alpha}")
    if args.collapse_drop <= 0:
        parser.error(f"--collapse-drop must be positive, got {args.collapse_drop}")
    if args.dpi < 10:
        parser.error(f"--dpi must be at least 10, got {args.dpi}")


def main(argv: Sequence[str] | None = None, *, wandb_api_factory: Callable[[], Any] = default_wandb_api) -> None:
    """CLI entry point; prints where the report is. Exits with code 2 and one `error:` line on bad input, and with
    128 + the signal's number and one line saying what the output folder holds when interrupted."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    out = args.out or default_out_dir(args.paths, args.wandb, args.group)
    created = [folder for folder in (out.resolve(), *out.resolve().parents) if not folder.exists()]
    try:
        report = _report(args, argv, out, wandb_api_factory)
    except BaseException as error:
        for folder in created:  # deepest first; a folder that holds anything, a file the report wrote, stays
            try:
                folder.rmdir()
            except OSError:
                break
        if isinstance(error, Interrupted):
            raise stopped(error, out, REPORT_FILE) from None
        raise
    print(f"report: {report}")


def _report(args: argparse.Namespace, argv: Sequence[str], out: Path, wandb_api_factory: Callable[[], Any]) -> Path:
    """Check that `out` can be written, load the runs, check their declared comparison and pairing, write the report;
    exit code 2 and one `error:` line on bad input."""
    with refusing(ValueError):
        writable_out(out)
    with refusing(ValueError, FileNotFoundError):
        if args.wandb:
            runset = load_wandb(args.wandb, args.group, cache_root=args.cache_dir or out / ".cache",
                                refresh=args.refresh, api_factory=wandb_api_factory)
        else:
            runset = load_runs(args.paths, skip=[out])  # the report's own folder may lie inside the sweep
    command = command_line("analysis.report", argv)
    overrides = declared.overrides(args)
    with refusing(ValueError):
        decide(runset, overrides)
    return write_report(runset, out, last_n=args.last_n, drop=args.collapse_drop, alpha=args.ema_alpha,
                        dpi=args.dpi, pdf=args.pdf, command=command, overrides=overrides)


if __name__ == "__main__":
    main()
