"""The report's figures of what the runs logged along training: the GSPO paper's Figs. 1-3 (arXiv 2507.18071) and the
lab's own curves, one function each over the shared prelude (analysis.plotting).

1. reward (and held-out accuracy) against training compute, steps and tokens   — paper Fig. 1
2. mean fraction of clipped tokens per series, log scale                       — paper Fig. 2
3. GRPO with vs without Routing Replay, reward against compute                  — paper Fig. 3
5. importance-ratio variance, token level vs sequence level, against step       — GSPO's motivation (§3)
6. training–inference mismatch: k3 KL(μ_old‖π_old), χ² and ESS against step    — arXiv 2512.01374's diagnostic
7. early warning, per run: reward, entropy, mismatch KL and grad norm on one step axis, collapses marked
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from algos.objective import CLIP, SEQ_RATIO_VAR, TOKEN_RATIO_VAR
from analysis.diagnostics import MISMATCH_ROUNDING, early_warning, mismatch_is_rounding
from analysis.plotting import (
    STEP_LABEL,
    TOKENS_LABEL,
    FigureOutput,
    FigureSettings,
    SeriesStyle,
    figure,
    legend,
    legend_rows_in,
    log_limits,
    new_figure,
    plot_band,
    series_styles,
    smoothing_text,
)
from analysis.records import RunSet
from analysis.style import COLUMN_WIDTH_IN, TEXT_WIDTH_IN
from analysis.summaries import COLLAPSE_DROP, clip_fraction_by_label, curve, per_run_series
from experiments.step import metrics as m

EVAL_METRICS = {m.EVAL_ACCURACY: "held-out pass@1 (fraction)", m.EVAL_GREEDY: "held-out greedy acc. (fraction)"}
# Paper Fig. 2 read-offs (from a description of the figure, not measured on the PDF).
PAPER_CLIP_FRACTION = {"gspo": 0.15, "grpo": 0.0013}
CLIP_FLOOR = 1e-5
VARIANCE_FLOOR = 1e-10
MISMATCH_PANELS = [
    (m.MISMATCH_K3, "k3 KL(μ_old ‖ π_old)", True),
    (m.CHI2_TOKEN, "χ² (token)", True),
    (m.ESS, "effective sample size (share)", False),
]
EARLY_WARNING_ROWS = [
    (m.REWARD, "reward"),
    (m.ENTROPY, "entropy"),
    (m.MISMATCH_K3, "mismatch k3"),
    (m.GRAD_NORM, "grad norm"),
]
EARLY_WARNING_RUNS = 8


def _compute_panels(
    runset: RunSet,
    labels: Sequence[str],
    metrics: Sequence[str],
    alpha: float,
    styles: dict[str, SeriesStyle],
    notes: list[str],
) -> Figure:
    """Rows = metrics, columns = x axes (steps, and tokens when logged); shared by Figures 1 and 3. What it leaves
    out goes to `notes`."""
    axes_x = ["step"]
    if runset.has(m.TOKENS):
        axes_x.append("tokens")
        without = [lab for lab in labels if lab in runset.labels_without(m.TOKENS)]
        if without:
            notes.append(f"`{m.TOKENS}` is missing for {', '.join(without)}, left out of the token axis.")
    else:
        notes.append(f"`{m.TOKENS}` was not logged, so the token axis is left out.")
    width = TEXT_WIDTH_IN if len(axes_x) == 2 else COLUMN_WIDTH_IN
    fig = new_figure(width, 1.6 * len(metrics) + 0.2 + legend_rows_in(labels, width))
    grid = fig.subplots(len(metrics), len(axes_x), squeeze=False)
    for row, metric in enumerate(metrics):
        is_eval = metric in EVAL_METRICS
        for col, x in enumerate(axes_x):
            ax = grid[row][col]
            table = curve(runset, metric, x=x, alpha=None if is_eval else alpha)
            for label in labels:
                part = table[table["label"] == label]
                if len(part):
                    plot_band(ax, part, styles[label], marker="o" if is_eval and x == "step" else None)
            ax.set_xlabel(STEP_LABEL if x == "step" else TOKENS_LABEL)
            if x == "step":
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylabel(EVAL_METRICS.get(metric, "training reward (mean)"))
        missing = [lab for lab in labels if lab in runset.labels_without(metric)]
        if missing:
            notes.append(f"`{metric}` is missing for {', '.join(missing)}.")
    legend(fig, labels, styles)
    return fig


def _step_curves(
    ax: Axes, runset: RunSet, metric: str, alpha: float, styles: dict[str, SeriesStyle], floor: float | None
) -> tuple[pd.DataFrame, set[str]]:
    """Every series' smoothed curve of `metric` against step on `ax` (log scale where `floor` is given: drawn from
    `floor` up); the curves' table and the labels drawn."""
    table = curve(runset, metric, x="step", alpha=alpha)
    drawn = set()
    for label in runset.labels:
        part = table[table["label"] == label]
        if len(part):
            plot_band(ax, part, styles[label], floor=floor)
            drawn.add(label)
    if floor is not None:
        log_limits(ax, table, floor)  # before the log scale: constant curves give no data range
        ax.set_yscale("log")
    ax.set_xlabel(STEP_LABEL)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return table, drawn


@figure("1", "fig1_reward_vs_compute", "Reward and held-out accuracy against training compute")
def fig_reward_vs_compute(runset: RunSet, settings: FigureSettings, out: FigureOutput) -> Figure | None:
    """Paper Fig. 1: training reward, and held-out accuracy when evaluated, against steps and tokens."""
    if not runset.has(m.REWARD):
        out.notes.append(f"No run logged `{m.REWARD}`; figure not drawn.")
        return None
    metrics = [m.REWARD] + [name for name in EVAL_METRICS if runset.has(name)]
    if len(metrics) == 1:
        out.notes.append(f"No run logged `{m.EVAL_ACCURACY}` or `{m.EVAL_GREEDY}`; only training reward is shown.")
    fig = _compute_panels(runset, runset.labels, metrics, settings.alpha, series_styles(runset), out.notes)
    out.caption = (
        "Mean across seeds with a ±1 sample-std band of the training reward ("
        + smoothing_text(settings.alpha)
        + ") and, where evaluated, held-out pass@1 (mean over k samples) and greedy accuracy (unsmoothed) against "
        "RL steps and cumulative completion tokens, each seed interpolated onto a common token grid inside its "
        "own range; where not every seed of a series covers a point (one ended early or ran fewer tokens) the "
        "mean of the others is a thin dotted line."
    )
    return fig


@figure("2", "fig2_clip_fraction", "Average fraction of clipped tokens")
def fig_clip_fraction(runset: RunSet, settings: FigureSettings, out: FigureOutput) -> Figure | None:
    """Paper Fig. 2: average fraction of clipped tokens per series, bars ± std across seeds, log y."""
    table = clip_fraction_by_label(runset)
    if table.empty:
        out.notes.append(f"No run logged `{CLIP}`; figure not drawn.")
        return None
    missing = runset.labels_without(CLIP)
    if missing:
        out.notes.append(f"`{CLIP}` is missing for {', '.join(missing)} (no bar).")
    styles = series_styles(runset)
    algos = runset.runs.drop_duplicates("label").set_index("label")["algo"]
    means = table["mean"].to_numpy(float)
    heights = np.maximum(means, CLIP_FLOOR)
    std = np.nan_to_num(table["std"].to_numpy(float))
    lower = np.minimum(std, np.maximum(heights - CLIP_FLOOR, 0.0))
    positions = np.arange(len(table))
    width = COLUMN_WIDTH_IN if len(table) <= 6 else TEXT_WIDTH_IN
    fig = new_figure(width, 2.4 if len(table) <= 3 else 3.4)  # rotated names need room below the axes
    ax = fig.subplots()
    for i, label in enumerate(table["label"]):
        style = styles[label]
        ax.bar(i, heights[i], width=0.6, color=style.color, hatch=style.hatch, edgecolor="white", linewidth=0.3)
    ax.errorbar(positions, heights, yerr=np.vstack([lower, std]), fmt="none", ecolor="black", elinewidth=0.6, capsize=2)
    paper = [
        (i, PAPER_CLIP_FRACTION[algos[lab]])
        for i, lab in enumerate(table["label"])
        if algos[lab] in PAPER_CLIP_FRACTION
    ]
    if paper:
        ax.hlines(
            [p[1] for p in paper],
            [p[0] - 0.4 for p in paper],
            [p[0] + 0.4 for p in paper],
            colors="black",
            linestyles=(0, (3, 1.5)),
            linewidth=0.9,
            zorder=3,
        )
        fig.legend(
            [Line2D([], [], color="black", linestyle=(0, (3, 1.5)))],
            ["paper Fig. 2 (Qwen3-30B-A3B)"],
            loc="outside lower center",
            frameon=False,
        )
    ax.set_yscale("log")
    top = max(float(np.max(heights + std)), max((p[1] for p in paper), default=0.0))
    ax.set_ylim(CLIP_FLOOR / 2, top * 3)
    # The value goes under the name: above the bar it would collide with the paper's reference.
    values = ["<" + format(CLIP_FLOOR, "g") if mean < CLIP_FLOOR else format(mean, ".2g") for mean in means]
    if len(table) > 3:
        names = [f"{lab} ({v})" for lab, v in zip(table["label"], values)]
        ax.set_xticks(positions, names, rotation=30, ha="right", rotation_mode="anchor")
    else:
        ax.set_xticks(positions, [f"{lab}\n{v}" for lab, v in zip(table["label"], values)])
    ax.set_ylabel("clipped tokens (fraction)")
    floor_note = f"means below {CLIP_FLOOR:g} are drawn at {CLIP_FLOOR:g} and labelled <{CLIP_FLOOR:g}"
    out.caption = (
        f"Mean over training of `{CLIP}` (for sequence-level objectives, the tokens of clipped responses; value "
        f"next to each name), averaged over seeds with ±1 sample-std error bars on a log scale ({floor_note}), with "
        "the paper's ≈0.15 (GSPO) and ≈0.0013 (GRPO) as dashed segments where those algorithms ran."
    )
    return fig


@figure("3", "fig3_grpo_routing_replay", "GRPO with and without Routing Replay")
def fig_replay_grpo(runset: RunSet, settings: FigureSettings, out: FigureOutput) -> Figure | None:
    """Paper Fig. 3: GRPO with vs without Routing Replay, training reward against compute."""
    rows = runset.runs.drop_duplicates("label").set_index("label")
    grpo = [lab for lab in runset.labels if rows.loc[lab, "algo"] == "grpo"]
    replays = {rows["replay"].loc[lab] for lab in grpo}  # a column's cell: typed as the column's
    if "none" not in replays or not replays - {"none"}:
        found = ", ".join(sorted(replays)) if replays else "no GRPO runs"
        out.notes.append(
            f"Needs GRPO runs both without and with Routing Replay (found replay modes: {found}); figure not drawn."
        )
        return None
    if not runset.has(m.REWARD):
        out.notes.append(f"No run logged `{m.REWARD}`; figure not drawn.")
        return None
    fig = _compute_panels(runset, grpo, [m.REWARD], settings.alpha, series_styles(runset), out.notes)
    out.caption = (
        "Training reward of GRPO without Routing Replay (solid) and with it (dashed R2, dotted R3) against RL steps "
        f"and completion tokens, mean ± 1 sample std across seeds, {smoothing_text(settings.alpha)}."
    )
    return fig


@figure("5", "fig5_ratio_variance", "Importance-ratio variance, token vs sequence level")
def fig_ratio_variance(runset: RunSet, settings: FigureSettings, out: FigureOutput) -> Figure | None:
    """Token-level vs sequence-level importance-ratio variance per series against step, log y."""
    panels = [
        (name, title)
        for name, title in ((TOKEN_RATIO_VAR, "token-level ratio r_t"), (SEQ_RATIO_VAR, "sequence-level ratio s_i"))
        if runset.has(name)
    ]
    for metric in (TOKEN_RATIO_VAR, SEQ_RATIO_VAR):
        if not runset.has(metric):
            out.notes.append(f"No run logged `{metric}`; its panel is left out.")
    if not panels:
        out.notes.append("Figure not drawn.")
        return None
    styles = series_styles(runset)
    below_floor = False
    drawn: set[str] = set()
    width = TEXT_WIDTH_IN if len(panels) == 2 else COLUMN_WIDTH_IN
    fig = new_figure(width, 2.0 + legend_rows_in(runset.labels, width))
    for ax, (metric, title) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        table, labels = _step_curves(ax, runset, metric, settings.alpha, styles, VARIANCE_FLOOR)
        below_floor |= bool((table["mean"] < VARIANCE_FLOOR).any())
        drawn |= labels
        ax.set_title(title)
        ax.set_ylabel("variance of the ratio (log)")
        missing = runset.labels_without(metric)
        if missing:
            out.notes.append(f"`{metric}` is missing for {', '.join(missing)}.")
    legend(fig, [lab for lab in runset.labels if lab in drawn], styles)
    floor = f"; values below {VARIANCE_FLOOR:g} are drawn at {VARIANCE_FLOOR:g}" if below_floor else ""
    out.caption = (
        "Variance of the token-level importance ratio and of the sequence-level ratio against RL step (mean over "
        f"the step's minibatches), mean ± 1 sample std across seeds, {smoothing_text(settings.alpha)}, log "
        f"scale{floor}."
    )
    return fig


@figure("6", "fig6_mismatch", "Training–inference mismatch")
def fig_mismatch(runset: RunSet, settings: FigureSettings, out: FigureOutput) -> Figure | None:
    """Training–inference mismatch against step: k3 KL, χ² (token) and the IS weights' effective sample size."""
    panels = [panel for panel in MISMATCH_PANELS if runset.has(panel[0])]
    if not panels:
        out.notes.append("No run logged `mismatch/*` (runs from before the mismatch metrics); figure not drawn.")
        return None
    if mismatch_is_rounding(runset):
        out.notes.append(
            "Every run sampled with the trainer's own model (no rollout.precision, weight_quant or "
            f"router_noise): the mismatch is the KV-cache path's rounding (k3 below "
            f"{MISMATCH_ROUNDING:g}), not a quantity these runs varied; figure not drawn."
        )
        return None
    styles = series_styles(runset)
    fig = new_figure(TEXT_WIDTH_IN, 2.0 + legend_rows_in(runset.labels, TEXT_WIDTH_IN))
    for ax, (metric, title, log) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        _step_curves(ax, runset, metric, settings.alpha, styles, VARIANCE_FLOOR if log else None)
        ax.set_title(title)
    legend(fig, runset.labels, styles)
    out.caption = (
        "How far the rollout engine's log-probs μ_old are from the trainer's π_old at the same weights, per RL step "
        "(mean over the minibatches where the trainer computed π_old): k3 estimate of KL(μ_old ‖ π_old), "
        f"χ² = mean ρ² − 1 and ESS = (mean ρ)² / mean ρ² of ρ = π_old/μ_old; mean ± 1 std across seeds, "
        f"{smoothing_text(settings.alpha)}, log scale for the first two."
    )
    return fig


@figure("7", "fig7_early_warning", "Early warning: what moves before the reward falls")
def fig_early_warning(runset: RunSet, settings: FigureSettings, out: FigureOutput) -> Figure | None:
    """Per run, on one step axis: training reward, policy entropy, mismatch KL and gradient norm; collapsed runs
    first, with the step their reward fell and the steps their signals moved (`early_warning`, at the default
    collapse drop)."""
    rows = [
        (metric, name)
        for metric, name in EARLY_WARNING_ROWS
        if runset.has(metric) and not (metric == m.MISMATCH_K3 and mismatch_is_rounding(runset))
    ]
    if not runset.has(m.REWARD) or len(rows) < 2:
        out.notes.append("Needs the reward and at least one of entropy, mismatch KL, grad norm; figure not drawn.")
        return None
    warnings = early_warning(runset, drop=COLLAPSE_DROP, alpha=settings.alpha)
    if not warnings["collapsed"].fillna(False).astype(bool).any():  # a figure only of what the sweep showed
        out.notes.append("No run collapsed, so there is no fall for a signal to precede; figure not drawn.")
        return None
    order = warnings.sort_values(["collapsed", "run"], ascending=[False, True])["run"].tolist()
    shown = order[:EARLY_WARNING_RUNS]
    if len(order) > len(shown):
        out.notes.append(f"{len(order) - len(shown)} of {len(order)} runs are left out (collapsed runs come first).")
    labels = runset.runs.set_index("run")["label"]
    styles = series_styles(runset)
    fig = new_figure(min(TEXT_WIDTH_IN * 1.6, 1.6 * len(shown) + 0.6), 1.2 * len(rows) + 0.4)
    grid = fig.subplots(len(rows), len(shown), squeeze=False, sharex="col")
    for col, run in enumerate(shown):
        info = warnings.set_index("run").loc[run]
        for row, (metric, name) in enumerate(rows):
            ax = grid[row][col]
            series = per_run_series(runset, metric, alpha=settings.alpha)
            part = series[series["run"] == run]
            ax.plot(part["x"], part["y"], color=styles[labels[run]].color, linewidth=0.9)
            if bool(info["collapsed"]) and not math.isnan(info["collapse_step"]):
                ax.axvline(info["collapse_step"], color="black", linewidth=0.6, linestyle=(0, (1, 2)))
            moved = info.get(f"{metric}_moved_step", math.nan)
            if isinstance(moved, float) and not math.isnan(moved):
                ax.axvline(moved, color=styles[labels[run]].color, linewidth=0.6, linestyle="--")
            if col == 0:
                ax.set_ylabel(name)
            if row == 0:
                ax.set_title(f"{labels[run]}\n{Path(run).name}", fontsize="small")
        grid[-1][col].set_xlabel(STEP_LABEL)
    out.caption = (
        f"Per run ({smoothing_text(settings.alpha)}), reward, policy entropy, k3 KL(μ_old ‖ π_old) and the gradient "
        "norm against RL step. In a collapsed run the dotted line marks where the smoothed reward fell for good and a "
        "dashed line where each signal first moved beyond its early range (definitions in the report's early-warning "
        "table)."
    )
    return fig
