"""The sections only `analysis.report` writes into report.md, after its first screen (analysis.headline) and beside
the shared tables (analysis.tables): what ran, the figures, the held-out gains per arm and swept setting, one arm's
mean gain, the stability table with the definition of every number, and the early-warning table.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import pandas as pd

from algos.objective import CLIP, SEQ_RATIO_VAR, TOKEN_RATIO_VAR
from analysis import statistics
from analysis.arms import arm_order, seed_order, sweep_axes, sweep_cells
from analysis.configs import FLIP_RATE, PERTURB_RATE
from analysis.diagnostics import WARNING_SIGNALS, WARNING_SUSTAIN, early_warning
from analysis.gains import GAIN_MEASURES, how_it_ended
from analysis.headline import TITLE
from analysis.plotting import FigureOutput
from analysis.recipe_starts import recipe_starts_sentence
from analysis.records import UNKNOWN_START, RunSet, run_configs, runs_of
from analysis.summaries import COLLAPSE_MIN_TAIL, COLLAPSE_TAIL_FRACTION
from analysis.tables import PER_SEED_FILE, SUMMARY_FILE, axis_header, markdown_table, num
from experiments.step.metrics import DRIFT, FRAGILE, MISMATCH_K3, REWARD, ROUTING_SHARE, SKIPPED, STEP_TIME

# Stability-table columns whose source metric may be absent, with the metric named in the note.
_TABLE_METRICS = {
    "clip_frac_mean": CLIP,
    "ratio_token_var_mean": TOKEN_RATIO_VAR,
    "ratio_seq_var_mean": SEQ_RATIO_VAR,
    "skipped_steps": SKIPPED,
}


def _collapse_cell(row: pd.Series) -> str:
    if row["collapse_evaluated_seeds"] == 0:
        return "n/a (too short)"
    verdict = "yes" if row["collapse"] else "no"
    return f"{verdict} ({row['collapsed_seeds']}/{row['collapse_evaluated_seeds']})"


def stability_markdown(table: pd.DataFrame, last_n: int) -> str:
    """The stability table as markdown, numbers rounded for reading (summary.csv keeps full precision)."""
    header = [
        "series",
        "seeds",
        "incomplete",
        f"final reward (last {last_n})",
        "best reward",
        "collapse",
        "clip frac",
        "experts changed per update",
        "… mean over minibatches",
        "ratio var (token)",
        "ratio var (seq)",
        "mismatch k3",
        "fragile tokens",
        "routing share",
        "skipped steps",
        "s / step",
    ]
    rows = []
    for _, row in table.iterrows():
        std = row["final_reward_std"]
        final = num(row["final_reward_mean"], ".3f") + ("" if math.isnan(std) else f" ± {std:.3f}")
        rows.append(
            [
                row["label"],
                row["seeds"],
                row["incomplete_runs"],
                final,
                num(row["best_reward"], ".3f"),
                _collapse_cell(row),
                num(row["clip_frac_mean"]),
                num(row["expert_change_per_update_mean"]),
                num(row["expert_change_over_minibatches_mean"]),
                num(row["ratio_token_var_mean"]),
                num(row["ratio_seq_var_mean"]),
                num(row["mismatch_kl_k3_mean"]),
                num(row["fragile_frac_mean"]),
                num(row["routing_share_mean"]),
                num(row["skipped_steps"], ".0f"),
                num(row["step_s_mean"], ".2f"),
            ]
        )
    return markdown_table(header, rows)


def runs_section(runset: RunSet) -> list[str]:
    """What ran: per series its runs, seeds and model, the cold starts (and each recipe's start numbers, with why
    one between them is missing: `analysis.recipe_starts`), the runs that did not finish and every problem met while
    loading."""
    runs = runset.runs
    rows = []
    for label in runset.labels:
        group = runs[runs["label"] == label]
        seeds = ", ".join(sorted((s for s in group["seed"] if s), key=seed_order)) or "–"
        rows.append(
            [
                label,
                len(group),
                seeds,
                int(group["incomplete"].sum()),
                int(group["last_step"].max()),
                ", ".join(sorted(set(group["model"]) - {""})) or "–",
            ]
        )
    lines = ["## Runs", "", markdown_table(["series", "runs", "seeds", "incomplete", "last step", "model"], rows)]
    lines += ["", _starts_sentence(runs)]
    numbered = recipe_starts_sentence(run_configs(runs).values())
    lines += ["", numbered] if numbered else []
    incomplete = runs[runs["incomplete"]]
    if len(incomplete):
        lines += [
            "",
            "Runs that did not finish, drawn up to their last valid line (the comparisons count them only as "
            "the declared rule says: see *Seeds left out*):",
            "",
        ]
        lines += [
            f"- `{r.run}` ({r.label}): last step {r.last_step}, "
            f"{how_it_ended(r.status, r.last_step, json.loads(r.config))}"
            for r in runs_of(incomplete)
        ]
    if runset.problems:
        lines += ["", "Problems found while loading (each also printed to stderr):", ""]
        lines += [f"- {problem}" for problem in runset.problems]
    return lines


def _starts_sentence(runs: pd.DataFrame) -> str:
    """Which cold starts the runs come from: each start's sha256 (its first 12 digits) and its runs."""
    named = runs[runs["start_sha256"] != UNKNOWN_START]
    counts = named.groupby("start_sha256").size()
    said = ", ".join(f"`{start[:12]}` ({n} runs)" for start, n in zip(counts.index, counts))  # typed `items()`
    unnamed = len(runs) - len(named)
    if not said:
        return (
            "Cold start: no run names its start (their summaries hold no start_sha256: unfinished, or written "
            "before it was recorded); runs are paired by seed alone."
        )
    pooled = (
        " A series pools the starts of one recipe: in the figures and per-series tables, its mean, band and "
        '"across seeds" are over every run of it, each start\'s seeds together, so the band spans the starts.'
        if len(counts) > 1
        else ""
    )
    return (
        f"Cold start{'s' if len(counts) > 1 else ''} (the sha256 of the weights each run started from, as its "
        f"summary names them): {said}" + (f"; {unnamed} runs name none (no summary)" if unnamed else "") + "." + pooled
    )


def figure_section(figures: Sequence[FigureOutput], shown: str | None = None) -> list[str]:
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


def stability_section(runset: RunSet, table: pd.DataFrame, last_n: int, drop: float, alpha: float) -> list[str]:
    """The stability table and the definition of every number in it, with the columns a series left
    empty."""
    tail = f"K = max({COLLAPSE_MIN_TAIL}, ⌈{COLLAPSE_TAIL_FRACTION:g}·T⌉)"
    lines = [
        "## Stability",
        "",
        stability_markdown(table, last_n),
        "",
        f"Also in `{SUMMARY_FILE}` (full precision, one row per series). Definitions:",
        "",
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
        lines += [
            "",
            f"> Note: `{DRIFT}` was not logged by {', '.join(missing)}; the experts-changed columns are empty there.",
        ]
    return lines


def _mean_std(values: pd.Series, fmt: str = "+.3f") -> str:
    """Mean ± sample std of the values given (no ± with one; a dash with none)."""
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
            notes.append(
                f" Runs with {key} = p > 0 ({', '.join(f'{p:g}' for p in rates if p)}) are SYNTHETIC: {meaning}."
            )
    return "".join(notes)


def sweep_section(runset: RunSet, gains: pd.DataFrame) -> list[str]:
    """Held-out greedy accuracy gained from each run's own start, per arm and swept setting, by each of
    `GAIN_MEASURES` side by side (Figure 0's numbers)."""
    if gains.empty:
        return []
    axes = [key for key in sweep_axes(runset) if gains[key].nunique() > 1]
    order = {arm: i for i, arm in enumerate(sorted(gains["arm"].unique(), key=arm_order))}
    rows = []
    for (arm, *values), part in gains.groupby(["arm", *axes], sort=False):
        rows.append(
            (
                order[arm],
                values,
                [
                    arm,
                    *[f"{v:g}" for v in values],
                    f"{part['start'].mean():.3f}",
                    _mean_std(part["gain"]),
                    _mean_std(part["gain_area"]),
                    _mean_std(part["split_gain"]),
                    len(part),
                ],
            )
        )
    rows.sort(key=lambda row: (row[0], row[1]))
    header = [
        "arm",
        *[axis_header(key) for key in axes],
        "start (greedy)",
        "final gain",
        "mean gain over the run",
        "final gain, whole test split",
        "seeds",
    ]
    definitions = [f"- **{name.replace('_', ' ')}** (`{name}`): {text}." for name, text in GAIN_MEASURES.items()]
    return [
        "## Held-out accuracy gained",
        "",
        markdown_table(header, [row[2] for row in rows]),
        "",
        f"Per run, from its own start on the same prompts; mean ± sample std over seeds "
        f"({', '.join(sorted(set(gains['seed']), key=seed_order))}). Per-seed values: `{PER_SEED_FILE}`. An arm "
        "is the objective, its replay and, when it is not the trainer's own fp32 model, the engine's precision."
        + _synthetic_note(runset),
        "",
        "The measures:",
        "",
        *definitions,
        "",
        held_out_prompts(runset),
    ]


def held_out_prompts(runset: RunSet) -> str:
    """How many test prompts these runs' gains are measured on, as their recorded configs say: an evaluation's
    standard error, and so what a gain can show, follows from it."""
    configs = run_configs(runset.runs).values()

    def counts(key: str) -> str:
        values = sorted({int(config[key]) for config in configs if config.get(key) is not None})
        return " or ".join(f"{value:,}" for value in values) or "not recorded"

    return (
        f"Prompts: each evaluation's greedy accuracy is on {counts('trainer.eval_prompts')} test prompts "
        f"(`trainer.eval_prompts`), the whole test split {counts('dataset.test_size')} (`dataset.test_size`)."
    )


def one_arm_section(runset: RunSet, gains: pd.DataFrame) -> list[str]:
    """With one arm there is nothing to compare: its mean gain per measure (and swept cell) with the 95% interval of
    that mean over its counted seeds (`statistics.mean_interval`); `analysis.compare` pairs it with arms of other
    reports."""
    axes = [key for key in sweep_axes(runset) if gains[key].nunique() > 1]
    rows = []
    for cell, part in sweep_cells(gains, axes):
        values = [part[measure].dropna() for measure in GAIN_MEASURES]
        rows.append(
            [
                *[f"{cell[key]:g}" for key in axes],
                len(part),
                *[statistics.mean_interval(v).text() if len(v) >= 2 else "–" for v in values],
            ]
        )
    header = [
        *[axis_header(key) for key in axes],
        "seeds",
        *[f"{name.replace('_', ' ')}, mean [95% CI]" for name in GAIN_MEASURES],
    ]
    return [
        f"## {gains['arm'].iloc[0]}: its mean gain with a 95% interval",
        "",
        markdown_table(header, rows),
        "",
        "One arm, so nothing to compare it with here: each mean over seeds with its 95% percentile bootstrap "
        f"interval ({statistics.RESAMPLES:,} resamples), how far other seeds could move it. To pair it with the "
        "arms of another report on shared seeds: `python -m analysis.compare`.",
    ]


def early_warning_section(runset: RunSet, drop: float, alpha: float) -> list[str]:
    """The runs that collapsed, with the step each signal first moved and its lead over the reward's fall."""
    table = early_warning(runset, drop=drop, alpha=alpha)
    if table.empty or not table["collapsed"].any():
        return ["## Early warning", "", "No run collapsed, so there is no fall for a signal to precede."]
    signals = [m for m in WARNING_SIGNALS if f"{m}_moved_step" in table]
    rows = []
    for _, row in table[table["collapsed"]].iterrows():
        cells = [f"{row['label']} (`{row['run']}`)", num(row["collapse_step"], ".0f")]
        for metric in signals:
            moved, lead = row.get(f"{metric}_moved_step"), row.get(f"{metric}_lead")
            cells.append("–" if moved is None or math.isnan(moved) else f"{moved:.0f} ({lead:+.0f})")
        rows.append(cells)
    alarms = {m: int(table.loc[~table["collapsed"], f"{m}_moved_step"].notna().sum()) for m in signals}
    header = ["collapsed run", "reward fell at step", *[f"`{m}` moved at (lead)" for m in signals]]
    return [
        "## Early warning",
        "",
        markdown_table(header, rows),
        "",
        "The reward fell at the first step of the final stretch where its EMA stayed more than the collapse drop below "
        "its best. A signal moved at the first step, after the first fifth of the run, from which its EMA stayed "
        f"for {WARNING_SUSTAIN} logged steps outside its early band (the first fifth's mean ± max(3 std, 20% of "
        "|mean|)); the lead is the fall's step minus that step (positive: the signal moved first). In the runs that "
        "did not collapse the same test fired (false alarms) for "
        + ", ".join(f"`{m}` in {n} of {int((~table['collapsed']).sum())}" for m, n in alarms.items())
        + ".",
    ]
