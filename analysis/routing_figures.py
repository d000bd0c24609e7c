"""The report's figures of routing: drift (the GSPO paper's §5.3 statistic, the share of activated experts that changed
since θ_old) per layer and against depth, and the routing part of the ratio's noise; one function each over the
shared prelude (analysis.plotting).

4. routing drift: layer × minibatch index, layer × step, drift against depth    — paper §5.3 statistic
8. where the ratio noise comes from: the routing part's share of the log-ratio variance against updates since θ_old
9. drift against an engine k versions behind (rollout.lag): its routes and its log-probs against θ_old's, per lag
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from analysis.diagnostics import (
    drift_by_depth,
    drift_layer_by_minibatch,
    drift_layer_by_step,
    layer_counts,
    staleness_by_lag,
)
from analysis.plotting import (
    DRIFT_LABEL,
    STEP_LABEL,
    FigureOutput,
    FigureSettings,
    arm_styles,
    figure,
    legend,
    legend_rows_in,
    new_figure,
    plot_band,
    series_styles,
)
from analysis.records import RunSet
from analysis.style import COLUMN_WIDTH_IN, TEXT_WIDTH_IN
from experiments.step import metrics as m

# GSPO paper §5.3: ~10% of activated experts change after one update, 48-layer Qwen3-30B-A3B.
PAPER_DRIFT = 0.10
PAPER_LAYERS = 48


def _edges(values: np.ndarray) -> np.ndarray:
    """Cell edges around sorted centres, for pcolormesh."""
    values = np.asarray(values, dtype=float)
    if len(values) == 1:
        return np.array([values[0] - 0.5, values[0] + 0.5])
    mids = (values[1:] + values[:-1]) / 2
    return np.concatenate([[values[0] - (mids[0] - values[0])], mids, [values[-1] + (values[-1] - mids[-1])]])


def heatmaps(tables: dict[str, pd.DataFrame], xlabel: str, integer_x: bool = False) -> Figure:
    """A `[layers × x]` heat map of drift per series (`tables`), on one colour scale, three to a row."""
    labels = list(tables)
    ncols = min(len(labels), 3)
    nrows = math.ceil(len(labels) / ncols)
    vmax = max(float(np.nanmax(t.to_numpy(float))) for t in tables.values())
    vmax = vmax if vmax > 0 else 1.0
    width = COLUMN_WIDTH_IN if ncols == 1 else TEXT_WIDTH_IN
    fig = new_figure(width, 1.7 * nrows + 0.3)
    grid = fig.subplots(nrows, ncols, squeeze=False)
    mesh = None
    for k, ax in enumerate(grid.flat):
        if k >= len(labels):
            ax.set_visible(False)
            continue
        table = tables[labels[k]]
        xs = table.columns.to_numpy(float)
        layers = table.index.to_numpy(float)
        mesh = ax.pcolormesh(
            _edges(xs), _edges(layers), table.to_numpy(float), vmin=0.0, vmax=vmax, cmap="viridis", shading="flat"
        )
        ax.set_title(labels[k])
        if integer_x:
            ax.set_xticks(xs)
        if k % ncols == 0:
            ax.set_ylabel("layer (0 = first)")
        ax.grid(False)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # a layer is a whole number: no tick at 2.5
        if len(layers) <= 12:
            ax.set_yticks(layers)
    assert mesh is not None  # every series draws one, and there is one at least (`max` above)
    fig.colorbar(mesh, ax=grid.ravel().tolist(), label=DRIFT_LABEL, shrink=0.9)
    fig.supxlabel(xlabel)  # one label under all panels: per-panel labels would overlap
    return fig


def _drift_heatmaps(
    runset: RunSet,
    out: FigureOutput,
    tables: dict[str, pd.DataFrame],
    level: str,
    xlabel: str,
    caption: str,
    integer_x: bool = False,
) -> Figure | None:
    """Per-series layer heat maps of drift, or why not (no per-layer values at this `level`)."""
    if not tables:
        out.notes.append(
            f"No {level} `routing/expert_change_frac/layer_<i>` values (dense model, or not logged); figure not drawn."
        )
        return None
    without = [lab for lab in runset.labels if lab not in tables]
    if without:
        out.notes.append(f"No per-layer drift for {', '.join(without)}.")
    out.caption = caption
    return heatmaps(tables, xlabel, integer_x=integer_x)


@figure("4a", "fig4a_drift_layer_minibatch", "Routing drift: layer × updates since θ_old")
def fig_drift_layer_minibatch(runset: RunSet, settings: FigureSettings, out: FigureOutput) -> Figure | None:
    """Routing drift per layer against the number of optimizer updates since θ_old (per-minibatch records)."""
    return _drift_heatmaps(
        runset,
        out,
        drift_layer_by_minibatch(runset),
        "per-minibatch",
        "optimizer updates since θ_old (minibatch index)",
        "Share of activated (token, layer, slot) experts under θ that were not activated under θ_old, per layer and "
        "per number of updates since θ_old, averaged over steps within each seed and then over seeds.",
        integer_x=True,
    )


@figure("4b", "fig4b_drift_layer_step", "Routing drift: layer × step")
def fig_drift_layer_step(runset: RunSet, settings: FigureSettings, out: FigureOutput) -> Figure | None:
    """Routing drift per layer over training (after one update: the per-minibatch record with index 1)."""
    return _drift_heatmaps(
        runset,
        out,
        drift_layer_by_step(runset),
        "after-one-update (minibatch 1)",
        STEP_LABEL,
        "Per-layer share of activated experts that changed after one optimizer update since θ_old (minibatch index "
        "1) at each RL step, averaged over seeds.",
    )


@figure("4c", "fig4c_drift_depth", "Routing drift against depth")
def fig_drift_depth(runset: RunSet, settings: FigureSettings, out: FigureOutput) -> Figure | None:
    """Routing drift against depth, with the paper's ~10% per update as a reference where it fits the scale."""
    table, basis = drift_by_depth(runset)
    if table.empty:
        out.notes.append(
            "No `routing/expert_change_frac/layer_<i>` values (dense model, or not logged); figure not drawn."
        )
        return None
    styles = series_styles(runset)
    labels = [lab for lab in runset.labels if lab in set(table["label"])]
    top = float(np.nanmax(table["mean"] + table["std"].fillna(0)))
    # The reference only helps when the data are within a factor of 5 of it; otherwise it flattens the curves.
    show_reference = top >= PAPER_DRIFT / 5
    entries = [*labels, *(["paper reference"] if show_reference else [])]
    fig = new_figure(COLUMN_WIDTH_IN, 2.1 + legend_rows_in(entries, COLUMN_WIDTH_IN))
    ax = fig.subplots()
    for label in labels:
        part = table[table["label"] == label].rename(columns={"layer": "x"})
        plot_band(ax, part, styles[label], marker="o" if part["x"].nunique() <= 12 else None)
    extra = []
    if show_reference:
        ax.axhline(PAPER_DRIFT, color="black", linestyle=(0, (1, 2)), linewidth=0.8)
        extra.append(
            (Line2D([], [], color="black", linestyle=(0, (1, 2))), f"paper: ≈10%/update, {PAPER_LAYERS} layers")
        )
    ax.set_ylim(bottom=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("layer (0 = first)")
    ax.set_ylabel(DRIFT_LABEL)
    legend(fig, labels, styles, extra)
    depth = ", ".join(sorted({str(n) for n in layer_counts(runset).values()})) or "unknown"
    reference = (
        f"the dotted line is the paper's ≈10% per update on a {PAPER_LAYERS}-layer MoE"
        if show_reference
        else f"the paper's ≈10% per update on a {PAPER_LAYERS}-layer MoE is off this scale (largest value here "
        f"{top:.2g})"
    )
    out.caption = (
        f"Share of activated experts that changed per layer, {basis}, mean ± 1 sample std across seeds "
        f"on a model with {depth} layers; {reference}."
    )
    return fig


@figure("8", "fig8_decomposition", "Where the ratio noise comes from: routing against weights")
def fig_decomposition(runset: RunSet, settings: FigureSettings, out: FigureOutput) -> Figure | None:
    """The routing part's share of the variance of log π_θ/π_old against updates since θ_old, per series."""
    rows = runset.minibatches[runset.minibatches["metric"] == m.ROUTING_SHARE]
    if rows.empty:
        out.notes.append(f"No run logged `{m.ROUTING_SHARE}` (routing.decompose_every=0); figure not drawn.")
        return None
    per_run = (
        rows.groupby(["run", "minibatch"])["value"].mean().reset_index().merge(runset.runs[["run", "label"]], on="run")
    )
    table = per_run.groupby(["label", "minibatch"])["value"].agg(mean="mean", std="std", n="count").reset_index()
    styles = series_styles(runset)
    labels = [lab for lab in runset.labels if lab in set(table["label"])]
    fig = new_figure(COLUMN_WIDTH_IN, 2.1 + legend_rows_in(labels, COLUMN_WIDTH_IN))
    ax = fig.subplots()
    for label in labels:
        part = table[table["label"] == label].rename(columns={"minibatch": "x"})
        plot_band(ax, part, styles[label], marker="o")
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set_xlabel("optimizer updates since θ_old (minibatch index)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("routing share of log-ratio variance")
    legend(fig, labels, styles)
    out.caption = (
        "Each off-policy token's log π_θ/π_old split into a routing part, log π_θ(y | θ's experts) − log π_θ(y | "
        "θ_old's experts), and a weights part, log π_θ(y | θ_old's experts) − log π_old(y); the routing part's share "
        "Cov(routing, total) / Var(total) of the variance (the weights part has the rest), against the number of "
        "updates since θ_old, mean over the steps it was measured within each seed, ± 1 std across seeds."
    )
    return fig


STALENESS_PANELS = {
    m.ENGINE_EXPERTS: "experts the engine chose\nthat θ_old did not (fraction)",
    m.ENGINE_GATES: "gate mass they move (TV)",
    m.MISMATCH_K3: "KL(μ_old ‖ π_old), k3",
}


@figure("9", "fig9_staleness", "Drift against an engine k versions behind")
def fig_staleness(runset: RunSet, settings: FigureSettings, out: FigureOutput) -> Figure | None:
    """Per lag, how far the engine's routes and log-probs are from θ_old's: where a run's staleness is about routes
    and where about log-probs (docs/async.md)."""
    table = staleness_by_lag(runset)
    if table.empty:
        out.notes.append(
            "The runs share one rollout.lag (or log nothing against their engine): no drift against the "
            "engine per lag to draw."
        )
        return None
    styles = arm_styles(runset)
    arms = [arm for arm in styles if arm in set(table["arm"])]
    fig = new_figure(TEXT_WIDTH_IN, 2.0 + legend_rows_in(arms, TEXT_WIDTH_IN))
    axes = fig.subplots(1, len(STALENESS_PANELS))
    for ax, (metric, ylabel) in zip(axes, STALENESS_PANELS.items()):
        for arm in arms:
            part = table[(table["arm"] == arm) & (table["metric"] == metric)].rename(columns={"lag": "x"})
            if not part.empty:
                plot_band(ax, part, styles[arm], marker="o")
        ax.set_xlabel("lag k (versions behind θ_old)")
        ax.set_ylabel(ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(bottom=0)
    legend(fig, arms, styles)
    out.caption = (
        "Against the rollout engine that sampled, k weight versions behind θ_old (rollout.lag), per arm: "
        "the share of the engine's activated experts θ_old's routers did not choose on the same tokens, "
        "the gate mass that moves, and the k3 estimate of KL(μ_old ‖ π_old); each run's mean over the "
        "steps sampled at its full lag (the first k sample with the start), mean ± 1 sample std across "
        "seeds. Where π_old is the engine's own (bypass) only the first minibatch of a step holds the "
        "trainer's numbers at θ_old."
    )
    return fig
