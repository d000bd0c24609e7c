"""The drift law's figures (`python -m analysis.drift_law`): drift against the learning rate, depth, layer and
routing share per probe, and drift against the cold start's margin with the law's line and real checkpoints' anchors."""

from __future__ import annotations

from pathlib import Path

import matplotlib.ticker
import numpy as np
import pandas as pd

from analysis.drift_fit import PAPER_DRIFT, PAPER_SHAPE, TARGET_DRIFT, Fit, fitted_rows, ladder_point, paper_point
from analysis.plotting import in_style, new_figure, save_png
from analysis.style import TEXT_WIDTH_IN, shade
from models.routing.measures import MARGIN_ANCHORS


@in_style
def figure(rows: pd.DataFrame, fit: Fit, out: Path, dpi: int = 150) -> Path:
    """(a) drift against lr per cold start, (b) against depth per lr, (c) per-layer profiles, (d) routing share."""
    fig = new_figure(TEXT_WIDTH_IN, 4.6)
    (a, b), (c, d) = fig.subplots(2, 2)
    ordered = rows.sort_values(["experts_per_slot", "layers"])[["model", "task"]]
    models = list(dict.fromkeys(ordered.itertuples(index=False)))
    lrs = sorted(rows["lr"].unique())
    for i, (model, task) in enumerate(models):
        part = rows[(rows["model"] == model) & (rows["task"] == task)].sort_values("lr")
        a.plot(part["lr"], part["drift"], marker="o", ms=3, color=shade("#1f5fb4", i), label=f"{model}, {task}")
    a.axhline(PAPER_DRIFT, color="0.4", ls=":", lw=0.8)
    a.set(
        xscale="log",
        yscale="log",
        xlabel="learning rate",
        ylabel="experts changed after one update",
        title="(a) drift against lr",
    )
    a.legend(fontsize=5, loc="lower right")
    for j, lr in enumerate(lrs):
        part = rows[rows["lr"] == lr].sort_values("layers")
        b.scatter(part["layers"], part["drift"], s=8, color=shade("#d62728", j), label=f"lr {lr:.0e}")
        grid = np.geomspace(max(1, part["layers"].min()), PAPER_SHAPE["layers"], 20)
        if "layers" in fit.regressors:
            point = paper_point(fit, rows, lr)
            b.plot(grid, [fit.predict({**point, "layers": g}) for g in grid], color=shade("#d62728", j), lw=0.6)
    b.axhline(PAPER_DRIFT, color="0.4", ls=":", lw=0.8)
    b.set(
        xscale="log",
        yscale="log",
        xlabel="MoE layers",
        ylabel="experts changed after one update",
        title="(b) drift against depth; lines: the law at 128 experts top-8",
    )
    depths = sorted(int(layers) for layers in rows["layers"].unique())
    b.set_xticks(depths, [str(layers) for layers in depths])
    b.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    b.legend(fontsize=5)
    middle = lrs[len(lrs) // 2]
    for i, (model, task) in enumerate(models):
        part = rows[(rows["model"] == model) & (rows["task"] == task) & (rows["lr"] == middle)]
        for profile in part["drift_per_layer"]:
            if profile:
                depth = np.arange(len(profile)) / max(1, len(profile) - 1)
                c.plot(depth, profile, color=shade("#1f5fb4", i), lw=0.8)
    c.set(
        xlabel="layer (0 = first, 1 = last)",
        ylabel="experts changed after one update",
        title=f"(c) per layer, lr {middle:.0e}",
    )
    for i, slots in enumerate(sorted(rows["experts_per_slot"].unique())):  # what sets the share: the experts per slot
        part = rows[rows["experts_per_slot"] == slots]
        d.scatter(part["drift"], part["routing_share"], s=8, color=f"C{i}", label=f"E/k = {slots:g}")
    d.set(
        xscale="log",
        xlabel="experts changed after one update",
        ylabel="routing share of Var(log-ratio)",
        title="(d) routing share against drift",
    )
    d.legend(fontsize=5)
    path = out / "drift_law.png"
    return save_png(fig, path, dpi)


@in_style
def margin_figure(rows: pd.DataFrame, fit: Fit, out: Path, dpi: int = 150) -> Path:
    """Drift against the cold start's margin, one colour per learning rate, one marker per family; the law's line
    for the softmax family at each lr, and the anchors of real checkpoints."""
    fig = new_figure(TEXT_WIDTH_IN / 2, 2.6)
    ax = fig.subplots()
    usable = fitted_rows(rows)
    grid = np.geomspace(
        min(usable["start_margin"].min(), min(MARGIN_ANCHORS.values())) / 2, usable["start_margin"].max() * 2, 30
    )
    for j, lr in enumerate(sorted(usable["lr"].unique())):
        colour = shade("#d62728", j)
        for sigmoid, marker in ((0.0, "o"), (1.0, "^")):
            part = usable[(usable["lr"] == lr) & (usable["sigmoid_family"].fillna(0.0) == sigmoid)]
            ax.scatter(
                part["start_margin"],
                part["drift"],
                s=10,
                marker=marker,
                color=colour,
                label=f"lr {lr:.0e}" if sigmoid == 0.0 else None,
            )
        ax.plot(grid, [fit.predict({**ladder_point(rows, lr), "margin": g}) for g in grid], color=colour, lw=0.6)
    for name, value in MARGIN_ANCHORS.items():
        ax.axvline(value, color="0.4", ls="--", lw=0.6)
        ax.annotate(name.split(" ")[0], (value, ax.get_ylim()[1]), fontsize=5, rotation=90, va="top", ha="right")
    ax.axhline(TARGET_DRIFT, color="0.4", ls=":", lw=0.8)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="start's top-k margin (o softmax, ^ sigmoid)",
        ylabel="experts changed after one update",
        title="drift against how decisive the start's routers are",
    )
    ax.legend(fontsize=5)
    path = out / "drift_margin.png"
    return save_png(fig, path, dpi)
