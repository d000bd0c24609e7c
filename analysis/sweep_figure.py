"""The report's first figure (Figure 0): held-out accuracy gained from each run's own start against what the sweep
varied, drawn over the shared prelude (analysis.plotting) in the one of its three forms the sweep's shape asks for: a
line per arm (one swept setting), a grid per arm (two crossed: the phase diagram), a panel per cell (anything else).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, cast

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.typing import LineStyleType

from analysis.arms import arm_order, cell_name, sweep_axes, sweep_cells
from analysis.configs import FLIP_RATE, PERTURB_RATE, SYNTHETIC_KEYS
from analysis.diagnostics import LAG
from analysis.gains import EXCLUDED, GAIN_MEASURES, accuracy_gain
from analysis.plotting import LAG_LABEL, FigureOutput, FigureSettings, figure, new_figure
from analysis.records import RunSet
from analysis.style import COLUMN_WIDTH_IN, TEXT_WIDTH_IN, algo_color, replay_linestyle

SYNTHETIC_CAPTIONS = {
    FLIP_RATE: "The flips are a SYNTHETIC intervention (routing.flip_rate): they imitate routing drift in π_θ's update "
    "forwards only, which replay overrides by construction.",
    PERTURB_RATE: "The router noise is a SYNTHETIC intervention (routing.perturb_rate): θ carries it into rollouts, "
    "π_old and evaluations, as natural drift; it does not follow the gradient.",
}


def _axis_label(key: str) -> str:
    return {
        "trainer.lr": "learning rate",
        FLIP_RATE: "synthetic flip rate p (SYNTHETIC)",
        PERTURB_RATE: "router noise p, share moved per update (SYNTHETIC)",
        "model.num_hidden_layers": "MoE layers",
        "trainer.minibatches": "minibatches N",
        "dataset.digits": "digits (answer length)",
        "rollout.router_noise": "engine router noise σ",
        LAG: LAG_LABEL,
    }.get(key, key)


def _arm_color(arm: str) -> tuple[str, LineStyleType]:
    algo = arm.split(" ")[0]
    replay = arm.split(" + ")[1].split(" ")[0] if " + " in arm else "none"
    return algo_color(algo), replay_linestyle(replay)


@figure("0", "fig0_sweep_response", "Held-out accuracy gained, against what the sweep varied")
def fig_sweep_response(runset: RunSet, settings: FigureSettings, out: FigureOutput) -> Figure | None:
    """Held-out greedy accuracy gained from each run's start against what the sweep varied: one line per arm for one
    swept knob, a grid per arm (the phase diagram) for two whose values fill a grid; a panel per cell with every
    seed's `settings.primary` summary per arm where the cells fill no grid (two interventions swept apart, not
    crossed) or the sweep varied its arms alone. The runs the comparisons count (`accuracy_gain` under
    `settings.early_stopped`): a run that did not finish is not drawn as if it had."""
    gains = accuracy_gain(runset, settings.early_stopped)
    gains = gains[gains["counted"] != EXCLUDED]
    axes = [key for key in sweep_axes(runset) if gains[key].nunique() > 1] if not gains.empty else []
    arms = list(dict.fromkeys(sorted(gains["arm"], key=arm_order)))
    if gains.empty or (not axes and len(arms) < 2):
        out.notes.append(
            "The runs vary no numeric setting within an arm and hold one arm (or were not evaluated at "
            "start and end): nothing varied to draw the gain against; Figure 1 shows the runs."
        )
        return None
    cells = sweep_cells(gains, axes)
    a_grid = len(axes) >= 2 and len({tuple(cell[key] for key in axes[:2]) for cell, _ in cells}) == math.prod(
        gains[key].nunique() for key in axes[:2]
    )
    if a_grid and len(axes) > 2:
        out.notes.append(
            f"The sweep varies {len(axes)} settings ({', '.join(axes)}); the first two are drawn, "
            "averaging over the others."
        )
    if len(axes) == 1:
        fig = _gain_lines(out, gains, axes[0], arms)
    elif a_grid:
        fig = _gain_grids(out, gains, axes[0], axes[1], arms)
    else:
        fig = _gain_cells(out, cells, arms, settings.primary)
    seeds = ", ".join(sorted(set(gains["seed"]), key=lambda s: (len(s), s)))
    synthetic = [key for key in axes if key in SYNTHETIC_KEYS]
    out.caption += f" Seeds: {seeds}." + "".join(f" {SYNTHETIC_CAPTIONS[key]}" for key in synthetic)
    return fig


def _gain_lines(out: FigureOutput, gains: pd.DataFrame, axis: str, arms: list[str]) -> Figure:
    """One swept setting: each seed's gain a dot, each arm's mean a line, against the setting's values."""
    values = sorted(gains[axis].unique())
    fig = new_figure(COLUMN_WIDTH_IN, 2.2 + 0.14 * math.ceil(len(arms) / 2))
    ax = fig.subplots()
    handles = []
    for arm in arms:
        color, style = _arm_color(arm)
        part = gains[gains["arm"] == arm]
        x = [values.index(v) for v in part[axis]]
        ax.scatter(x, part["gain"], s=6, color=color, alpha=0.5, linewidths=0)
        mean = part.groupby(axis)["gain"].mean()
        ax.plot(
            [values.index(v) for v in mean.index],
            mean.to_numpy(),
            color=color,
            linestyle=style,
            marker="o",
            markersize=2.5,
        )
        handles.append((Line2D([], [], color=color, linestyle=style, marker="o", markersize=2.5), arm))
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set_xticks(range(len(values)), [f"{v:g}" for v in values])
    ax.set_xlabel(_axis_label(axis))
    ax.set_ylabel("held-out greedy acc., end − start")
    fig.legend(
        [h for h, _ in handles],
        [n for _, n in handles],
        loc="outside lower center",
        ncols=min(len(handles), 2),
        frameon=False,
    )
    out.caption = (
        f"Each run's held-out greedy accuracy at its last evaluation minus at its start (same prompts), "
        f"against {_axis_label(axis)}: one dot per seed, the line through the means."
    )
    return fig


def _gain_grids(out: FigureOutput, gains: pd.DataFrame, x_axis: str, y_axis: str, arms: list[str]) -> Figure:
    """Two crossed settings: per arm a grid of the mean gain over seeds (the phase diagram), on one colour scale."""
    xs, ys = sorted(gains[x_axis].unique()), sorted(gains[y_axis].unique())
    columns = min(len(arms), 4)
    rows = math.ceil(len(arms) / columns)
    fig = new_figure(TEXT_WIDTH_IN, 0.4 + 1.9 * rows)
    grid = fig.subplots(rows, columns, squeeze=False)
    limit = max(0.05, float(gains["gain"].abs().max()))
    image = None
    for index, arm in enumerate(arms):
        ax = grid[index // columns][index % columns]
        table = gains[gains["arm"] == arm].groupby([y_axis, x_axis])["gain"].agg(["mean", "count"])
        values = np.full((len(ys), len(xs)), np.nan)
        # A two-level index: each row's label is its (y, x) pair, which pandas types as any hashable.
        for (y, x), row in cast(Iterable[tuple[tuple[Any, Any], pd.Series]], table.iterrows()):
            values[ys.index(y), xs.index(x)] = row["mean"]
            ax.text(
                xs.index(x),
                ys.index(y),
                f"{row['mean']:+.2f}\n({int(row['count'])})",
                ha="center",
                va="center",
                fontsize=5,
            )
        image = ax.imshow(values, cmap="RdBu", vmin=-limit, vmax=limit, origin="lower", aspect="auto")
        ax.set_xticks(range(len(xs)), [f"{v:g}" for v in xs])
        ax.set_yticks(range(len(ys)), [f"{v:g}" for v in ys])
        ax.set_xlabel(_axis_label(x_axis))
        ax.set_ylabel(_axis_label(y_axis))
        ax.set_title(arm)
        ax.grid(False)
    for index in range(len(arms), rows * columns):
        grid[index // columns][index % columns].set_visible(False)
    assert image is not None  # every arm draws one, and there is one at least (`rows` above divides by their count)
    fig.colorbar(image, ax=grid, shrink=0.8, label="held-out greedy accuracy, end − start")
    out.caption = (
        f"The stability phase diagram: per arm, the mean over seeds (their count in brackets) of each "
        f"run's held-out greedy accuracy at its last evaluation minus at its start, over "
        f"{_axis_label(x_axis)} × {_axis_label(y_axis)}; blue gained, red lost."
    )
    return fig


def _gain_cells(
    out: FigureOutput, cells: list[tuple[dict[str, Any], pd.DataFrame]], arms: list[str], measure: str
) -> Figure:
    """A panel per cell: each seed's `measure` per arm (a dot; one seed's runs joined across the arms, the pairs the
    comparisons take) and each arm's mean (a bar), on one y scale."""
    columns = min(len(cells), 4)
    rows = math.ceil(len(cells) / columns)
    width = COLUMN_WIDTH_IN if columns == 1 else TEXT_WIDTH_IN
    fig = new_figure(width, 0.6 + 1.9 * rows)
    grid = fig.subplots(rows, columns, squeeze=False, sharey=True)
    name = GAIN_MEASURES[measure].split(":")[0]
    for index, (cell, part) in enumerate(cells):
        ax = grid[index // columns][index % columns]
        for _, seed in part.groupby(["start_sha256", "seed"]):
            values = seed.drop_duplicates("arm").set_index("arm").reindex(arms)[measure].to_numpy(float)
            ax.plot(range(len(arms)), values, color="grey", linewidth=0.5, alpha=0.6, zorder=1)
        for x, arm in enumerate(arms):
            own = part.loc[part["arm"] == arm, measure].dropna()
            if own.empty:
                continue
            color, style = _arm_color(arm)
            ax.scatter(np.full(len(own), x), own, s=8, color=color, linewidths=0, zorder=2)
            ax.hlines(own.mean(), x - 0.3, x + 0.3, color=color, linestyle=style, linewidth=1.5, zorder=3)
        ax.axhline(0, color="black", linewidth=0.5)
        ax.set_xlim(-0.5, len(arms) - 0.5)
        ax.set_xticks(
            range(len(arms)), arms, rotation=30 if len(arms) > 2 else 0, ha="right" if len(arms) > 2 else "center"
        )
        ax.set_title(cell_name(cell) if cell else "")
        ax.grid(False, axis="x")
        if index % columns == 0:
            ax.set_ylabel(f"{name}\n(held-out greedy acc.)")
    for index in range(len(cells), rows * columns):
        grid[index // columns][index % columns].set_visible(False)
    where = "Per cell of the sweep (a panel), each" if len(cells) > 1 else "Each"
    out.caption = (
        f"{where} run's {name} of held-out greedy accuracy (`{measure}`, from the run's own start), per "
        "arm: a dot per seed, one seed's runs joined by a grey line (the pairs the comparisons take), a bar "
        "at the arm's mean (its line style the arm's replay)."
    )
    return fig
