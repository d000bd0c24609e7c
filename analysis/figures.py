"""The GSPO paper's figures (arXiv 2507.18071, Figs. 1-3 and §5.3) and the lab's mechanism figures, one function each.

Every function takes a RunSet and an output folder, writes `<name>.png` (and `<name>.pdf` with `pdf=True`), and
returns a `FigureOutput` with a one-sentence caption for report.md and notes on panels it had to leave out (a metric
no run logged, or a quantity the runs did not vary). When nothing at all can be drawn it writes no file and says why
in `notes`; it never raises on missing data. Figures are built on `matplotlib.figure.Figure` directly (no pyplot
state; PNGs render with Agg).

1. reward (and held-out accuracy) against training compute, steps and tokens   — paper Fig. 1
2. mean fraction of clipped tokens per series, log scale                       — paper Fig. 2
3. GRPO with vs without Routing Replay, reward against compute                  — paper Fig. 3
4. routing drift: layer × minibatch index, layer × step, drift against depth    — paper §5.3 statistic
5. importance-ratio variance, token level vs sequence level, against step       — GSPO's motivation (§3)
6. training–inference mismatch: k3 KL(μ_old‖π_old), χ² and ESS against step    — arXiv 2512.01374's diagnostic
7. early warning, per run: reward, entropy, mismatch KL and grad norm on one step axis, collapses marked
8. where the ratio noise comes from: the routing part's share of the log-ratio variance against updates since θ_old
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator
from PIL import Image

from algos.objective import CLIP, SEQ_RATIO_VAR, TOKEN_RATIO_VAR
from analysis.arms import arm_order, cell_name, sweep_axes, sweep_cells
from analysis.diagnostics import (
    MISMATCH_ROUNDING, drift_by_depth, drift_layer_by_minibatch, drift_layer_by_step, early_warning, layer_counts, mismatch_is_rounding,
)
from analysis.gains import EXCLUDED, GAIN_MEASURES, accuracy_gain
from analysis.summaries import COLLAPSE_DROP, EMA_ALPHA, clip_fraction_by_label, curve, per_run_series
from experiments.config import EarlyStopped, Summary
from analysis.configs import FLIP_RATE, PERTURB_RATE, SYNTHETIC_KEYS
from analysis.records import RunSet
from analysis.style import (
    COLUMN_WIDTH_IN, RC_PARAMS, TEXT_WIDTH_IN, algo_color, replay_hatch, replay_linestyle, shade,
)
from experiments.step import metrics as m

EVAL_METRICS = {
    m.EVAL_ACCURACY: "held-out pass@1 (fraction)",
    m.EVAL_GREEDY: "held-out greedy acc. (fraction)",
}
# Paper Fig. 2 read-offs (from a description of the figure, not measured on the PDF).
PAPER_CLIP_FRACTION = {"gspo": 0.15, "grpo": 0.0013}
# GSPO paper §5.3: ~10% of activated experts change after one update, 48-layer Qwen3-30B-A3B.
PAPER_DRIFT = 0.10
PAPER_LAYERS = 48
CLIP_FLOOR = 1e-5
VARIANCE_FLOOR = 1e-10
STEP_LABEL = "RL step"
TOKENS_LABEL = "completion tokens (cumulative)"
DRIFT_LABEL = "experts changed (fraction)"


@dataclass
class FigureOutput:
    """One figure as the report needs it: file stem, title, caption sentence, files written, notes."""

    number: str
    name: str
    title: str
    caption: str
    files: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class SeriesStyle:
    color: str
    linestyle: str
    hatch: str


def series_styles(runset: RunSet) -> dict[str, SeriesStyle]:
    """Colour by algorithm, line style (bars: hatch) by replay mode, a shade per further split of the same pair."""
    rows = runset.runs.drop_duplicates("label").set_index("label")
    seen: dict[tuple[str, str], int] = {}
    styles = {}
    for label in runset.labels:
        algo, replay = rows.loc[label, "algo"], rows.loc[label, "replay"]
        rank = seen.get((algo, replay), 0)
        seen[(algo, replay)] = rank + 1
        styles[label] = SeriesStyle(shade(algo_color(algo), rank), replay_linestyle(replay), replay_hatch(replay))
    return styles


def _figure(width: float, height: float) -> Figure:
    return Figure(figsize=(width, height), layout="constrained")


def save_png(fig: Figure, png: Path, dpi: int) -> Path:
    """`fig` as `png`, its colours reduced to a 256-colour palette (plots hold few colours: a third of the bytes, no
    visible change). Every figure the analysis writes goes through it."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    Image.open(buffer).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(png, optimize=True)
    return png


def _save(fig: Figure, out_dir: Path, name: str, dpi: int, pdf: bool = False) -> list[Path]:
    """`<name>.png` (`save_png`), and `<name>.pdf` when asked (a paper's vector copy)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    png = save_png(fig, out_dir / f"{name}.png", dpi)
    if not pdf:
        return [png]
    fig.savefig(out_dir / f"{name}.pdf")
    return [png, out_dir / f"{name}.pdf"]


LEGEND_CHAR_IN = 0.047  # width of a character at legend.fontsize 6 pt (style.RC_PARAMS)
LEGEND_HANDLE_IN = 0.3  # the line sample and the padding of one legend entry


def _legend_columns(width: float, names: Sequence[str] = ()) -> int:
    """Two legend columns fit a paper column, three the text width; fewer when the longest entry would not fit
    (long labels, such as a sweep's every differing key, are otherwise cut off at the figure's edges)."""
    columns = 3 if width > COLUMN_WIDTH_IN + 0.1 else 2
    longest = max((len(name) for name in names), default=0) * LEGEND_CHAR_IN + LEGEND_HANDLE_IN
    while columns > 1 and columns * longest > width:
        columns -= 1
    return columns


def _legend_rows_in(names: Sequence[str], width: float) -> float:
    """Height in inches that a legend of `names` takes below the axes."""
    return 0.14 * math.ceil(len(names) / _legend_columns(width, names))


def _legend(fig: Figure, labels: Sequence[str], styles: dict[str, SeriesStyle], extra: Sequence = ()) -> None:
    handles = [Line2D([], [], color=styles[lab].color, linestyle=styles[lab].linestyle) for lab in labels]
    names = list(labels)
    for handle, name in extra:
        handles.append(handle)
        names.append(name)
    if handles:
        columns = min(len(handles), _legend_columns(fig.get_figwidth(), names))
        fig.legend(handles, names, loc="outside lower center", ncols=columns, frameon=False)


def _plot_band(ax: Axes, table: pd.DataFrame, style: SeriesStyle, floor: float | None = None,
               marker: str | None = None) -> None:
    """Mean line with a ±1 std band (band drawn where at least two seeds cover the point). Where fewer of the
    series' seeds cover a point than cover its best-covered one (a seed that crashed or ran fewer tokens), the mean
    of the others would read as a change of the series: that part is a thin dotted line, without a band."""
    table = table.sort_values("x")
    x, mean, std = table["x"].to_numpy(float), table["mean"].to_numpy(float), table["std"].to_numpy(float)
    n = table["n"].to_numpy(float) if "n" in table else np.ones_like(x)
    lower, upper = mean - std, mean + std
    if floor is not None:
        mean, lower, upper = (np.maximum(v, floor) for v in (mean, lower, upper))
    full = n == n.max()
    ax.plot(x, np.where(full, mean, np.nan), color=style.color, linestyle=style.linestyle, marker=marker, markersize=2)
    if not full.all():
        ax.plot(x, mean, color=style.color, linestyle=":", linewidth=0.6)
    has_band = ~np.isnan(std) & full
    if has_band.any():
        ax.fill_between(x, lower, upper, where=has_band, color=style.color, alpha=0.18, linewidth=0)


def _smoothing_text(alpha: float) -> str:
    return f"per-seed EMA with α = {alpha:g}" if alpha < 1 else "no smoothing"


def _compute_panels(runset: RunSet, labels: Sequence[str], metrics: Sequence[str], alpha: float,
                    styles: dict[str, SeriesStyle]) -> tuple[Figure, list[str]]:
    """Rows = metrics, columns = x axes (steps, and tokens when logged); shared by Figures 1 and 3."""
    notes = []
    axes_x = ["step"]
    if runset.has(m.TOKENS):
        axes_x.append("tokens")
        without = [lab for lab in labels if lab in runset.labels_without(m.TOKENS)]
        if without:
            notes.append(f"`{m.TOKENS}` is missing for {', '.join(without)}, left out of the token axis.")
    else:
        notes.append(f"`{m.TOKENS}` was not logged, so the token axis is left out.")
    width = TEXT_WIDTH_IN if len(axes_x) == 2 else COLUMN_WIDTH_IN
    fig = _figure(width, 1.6 * len(metrics) + 0.2 + _legend_rows_in(labels, width))
    grid = fig.subplots(len(metrics), len(axes_x), squeeze=False)
    for row, metric in enumerate(metrics):
        is_eval = metric in EVAL_METRICS
        for col, x in enumerate(axes_x):
            ax = grid[row][col]
            table = curve(runset, metric, x=x, alpha=None if is_eval else alpha)
            for label in labels:
                part = table[table["label"] == label]
                if len(part):
                    _plot_band(ax, part, styles[label], marker="o" if is_eval and x == "step" else None)
            ax.set_xlabel(STEP_LABEL if x == "step" else TOKENS_LABEL)
            if x == "step":
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylabel(EVAL_METRICS.get(metric, "training reward (mean)"))
        missing = [lab for lab in labels if lab in runset.labels_without(metric)]
        if missing:
            notes.append(f"`{metric}` is missing for {', '.join(missing)}.")
    return fig, notes


def fig_reward_vs_compute(runset: RunSet, out_dir: Path, alpha: float = EMA_ALPHA,
                          dpi: int = 150, pdf: bool = False) -> FigureOutput:
    """Paper Fig. 1: training reward, and held-out accuracy when evaluated, against steps and tokens."""
    out = FigureOutput("1", "fig1_reward_vs_compute", "Reward and held-out accuracy against training compute", "")
    if not runset.has(m.REWARD):
        out.notes.append(f"No run logged `{m.REWARD}`; figure not drawn.")
        return out
    metrics = [m.REWARD] + [name for name in EVAL_METRICS if runset.has(name)]
    if len(metrics) == 1:
        out.notes.append(f"No run logged `{m.EVAL_ACCURACY}` or `{m.EVAL_GREEDY}`; only training reward is shown.")
    styles = series_styles(runset)
    with matplotlib.rc_context(RC_PARAMS):
        fig, notes = _compute_panels(runset, runset.labels, metrics, alpha, styles)
        _legend(fig, runset.labels, styles)
        out.files = _save(fig, out_dir, out.name, dpi, pdf)
    out.notes += notes
    out.caption = (
        "Mean across seeds with a ±1 sample-std band of the training reward (" + _smoothing_text(alpha)
        + ") and, where evaluated, held-out pass@1 (mean over k samples) and greedy accuracy (unsmoothed) against "
        "RL steps and cumulative completion tokens, each seed interpolated onto a common token grid inside its "
        "own range; where not every seed of a series covers a point (one ended early or ran fewer tokens) the "
        "mean of the others is a thin dotted line."
    )
    return out


def fig_clip_fraction(runset: RunSet, out_dir: Path, dpi: int = 150, pdf: bool = False) -> FigureOutput:
    """Paper Fig. 2: average fraction of clipped tokens per series, bars ± std across seeds, log y."""
    out = FigureOutput("2", "fig2_clip_fraction", "Average fraction of clipped tokens", "")
    table = clip_fraction_by_label(runset)
    if table.empty:
        out.notes.append(f"No run logged `{CLIP}`; figure not drawn.")
        return out
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
    with matplotlib.rc_context(RC_PARAMS):
        fig = _figure(width, 2.4 if len(table) <= 3 else 3.4)  # rotated names need room below the axes
        ax = fig.subplots()
        for i, label in enumerate(table["label"]):
            style = styles[label]
            ax.bar(i, heights[i], width=0.6, color=style.color, hatch=style.hatch, edgecolor="white",
                   linewidth=0.3)
        ax.errorbar(positions, heights, yerr=np.vstack([lower, std]), fmt="none", ecolor="black",
                    elinewidth=0.6, capsize=2)
        paper = [(i, PAPER_CLIP_FRACTION[algos[lab]]) for i, lab in enumerate(table["label"])
                 if algos[lab] in PAPER_CLIP_FRACTION]
        if paper:
            ax.hlines([p[1] for p in paper], [p[0] - 0.4 for p in paper], [p[0] + 0.4 for p in paper],
                      colors="black", linestyles=(0, (3, 1.5)), linewidth=0.9, zorder=3)
            fig.legend([Line2D([], [], color="black", linestyle=(0, (3, 1.5)))], ["paper Fig. 2 (Qwen3-30B-A3B)"],
                       loc="outside lower center", frameon=False)
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
        out.files = _save(fig, out_dir, out.name, dpi, pdf)
    floor_note = f"means below {CLIP_FLOOR:g} are drawn at {CLIP_FLOOR:g} and labelled <{CLIP_FLOOR:g}"
    out.caption = (
        f"Mean over training of `{CLIP}` (for sequence-level objectives, the tokens of clipped responses; value "
        f"next to each name), averaged over seeds with ±1 sample-std error bars on a log scale ({floor_note}), with "
        "the paper's ≈0.15 (GSPO) and ≈0.0013 (GRPO) as dashed segments where those algorithms ran."
    )
    return out


def fig_replay_grpo(runset: RunSet, out_dir: Path, alpha: float = EMA_ALPHA, dpi: int = 150,
                    pdf: bool = False) -> FigureOutput:
    """Paper Fig. 3: GRPO with vs without Routing Replay, training reward against compute."""
    out = FigureOutput("3", "fig3_grpo_routing_replay", "GRPO with and without Routing Replay", "")
    rows = runset.runs.drop_duplicates("label").set_index("label")
    grpo = [lab for lab in runset.labels if rows.loc[lab, "algo"] == "grpo"]
    replays = {rows.loc[lab, "replay"] for lab in grpo}
    if "none" not in replays or not replays - {"none"}:
        found = ", ".join(sorted(replays)) if replays else "no GRPO runs"
        out.notes.append(f"Needs GRPO runs both without and with Routing Replay (found replay modes: {found}); "
                         "figure not drawn.")
        return out
    if not runset.has(m.REWARD):
        out.notes.append(f"No run logged `{m.REWARD}`; figure not drawn.")
        return out
    styles = series_styles(runset)
    with matplotlib.rc_context(RC_PARAMS):
        fig, notes = _compute_panels(runset, grpo, [m.REWARD], alpha, styles)
        _legend(fig, grpo, styles)
        out.files = _save(fig, out_dir, out.name, dpi, pdf)
    out.notes += notes
    out.caption = (
        "Training reward of GRPO without Routing Replay (solid) and with it (dashed R2, dotted R3) against RL steps "
        f"and completion tokens, mean ± 1 sample std across seeds, {_smoothing_text(alpha)}."
    )
    return out


def _edges(values: np.ndarray) -> np.ndarray:
    """Cell edges around sorted centres, for pcolormesh."""
    values = np.asarray(values, dtype=float)
    if len(values) == 1:
        return np.array([values[0] - 0.5, values[0] + 0.5])
    mids = (values[1:] + values[:-1]) / 2
    return np.concatenate([[values[0] - (mids[0] - values[0])], mids, [values[-1] + (values[-1] - mids[-1])]])


def _heatmaps(tables: dict[str, pd.DataFrame], xlabel: str, out_dir: Path, name: str, dpi: int, pdf: bool,
              integer_x: bool = False) -> list[Path]:
    labels = list(tables)
    ncols = min(len(labels), 3)
    nrows = math.ceil(len(labels) / ncols)
    vmax = max(float(np.nanmax(t.to_numpy(float))) for t in tables.values())
    vmax = vmax if vmax > 0 else 1.0
    width = COLUMN_WIDTH_IN if ncols == 1 else TEXT_WIDTH_IN
    fig = _figure(width, 1.7 * nrows + 0.3)
    grid = fig.subplots(nrows, ncols, squeeze=False)
    mesh = None
    for k, ax in enumerate(grid.flat):
        if k >= len(labels):
            ax.set_visible(False)
            continue
        table = tables[labels[k]]
        xs = table.columns.to_numpy(float)
        layers = table.index.to_numpy(float)
        mesh = ax.pcolormesh(_edges(xs), _edges(layers), table.to_numpy(float), vmin=0.0, vmax=vmax,
                             cmap="viridis", shading="flat")
        ax.set_title(labels[k])
        if integer_x:
            ax.set_xticks(xs)
        if k % ncols == 0:
            ax.set_ylabel("layer (0 = first)")
        ax.grid(False)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # a layer is a whole number: no tick at 2.5
        if len(layers) <= 12:
            ax.set_yticks(layers)
    fig.colorbar(mesh, ax=grid.ravel().tolist(), label=DRIFT_LABEL, shrink=0.9)
    fig.supxlabel(xlabel)  # one label under all panels: per-panel labels would overlap
    return _save(fig, out_dir, name, dpi, pdf)


def _drift_heatmap_figure(runset: RunSet, out: FigureOutput, tables: dict[str, pd.DataFrame], level: str,
                          xlabel: str, out_dir: Path, dpi: int, pdf: bool, caption: str,
                          integer_x: bool = False) -> FigureOutput:
    """Draw per-series layer heatmaps of drift, or say why not (no per-layer values at this `level`)."""
    if not tables:
        out.notes.append(f"No {level} `routing/expert_change_frac/layer_<i>` values (dense model, or not "
                         "logged); figure not drawn.")
        return out
    without = [lab for lab in runset.labels if lab not in tables]
    if without:
        out.notes.append(f"No per-layer drift for {', '.join(without)}.")
    with matplotlib.rc_context(RC_PARAMS):
        out.files = _heatmaps(tables, xlabel, out_dir, out.name, dpi, pdf, integer_x=integer_x)
    out.caption = caption
    return out


def fig_drift_layer_minibatch(runset: RunSet, out_dir: Path, dpi: int = 150, pdf: bool = False) -> FigureOutput:
    """Routing drift per layer against the number of optimizer updates since θ_old (per-minibatch records)."""
    out = FigureOutput("4a", "fig4a_drift_layer_minibatch", "Routing drift: layer × updates since θ_old", "")
    return _drift_heatmap_figure(
        runset, out, drift_layer_by_minibatch(runset), "per-minibatch",
        "optimizer updates since θ_old (minibatch index)", out_dir, dpi, pdf,
        "Share of activated (token, layer, slot) experts under θ that were not activated under θ_old, per layer and "
        "per number of updates since θ_old, averaged over steps within each seed and then over seeds.",
        integer_x=True,
    )


def fig_drift_layer_step(runset: RunSet, out_dir: Path, dpi: int = 150, pdf: bool = False) -> FigureOutput:
    """Routing drift per layer over training (after one update: the per-minibatch record with index 1)."""
    out = FigureOutput("4b", "fig4b_drift_layer_step", "Routing drift: layer × step", "")
    return _drift_heatmap_figure(
        runset, out, drift_layer_by_step(runset), "after-one-update (minibatch 1)", STEP_LABEL, out_dir, dpi,
        pdf,
        "Per-layer share of activated experts that changed after one optimizer update since θ_old (minibatch index "
        "1) at each RL step, averaged over seeds.",
    )


def fig_drift_depth(runset: RunSet, out_dir: Path, dpi: int = 150, pdf: bool = False) -> FigureOutput:
    """Routing drift against depth, with the paper's ~10% per update as a reference where it fits the scale."""
    out = FigureOutput("4c", "fig4c_drift_depth", "Routing drift against depth", "")
    table, basis = drift_by_depth(runset)
    if table.empty:
        out.notes.append("No `routing/expert_change_frac/layer_<i>` values (dense model, or not logged); "
                         "figure not drawn.")
        return out
    styles = series_styles(runset)
    labels = [lab for lab in runset.labels if lab in set(table["label"])]
    top = float(np.nanmax(table["mean"] + table["std"].fillna(0)))
    # The reference only helps when the data are within a factor of 5 of it; otherwise it flattens the curves.
    show_reference = top >= PAPER_DRIFT / 5
    with matplotlib.rc_context(RC_PARAMS):
        entries = [*labels, *(["paper reference"] if show_reference else [])]
        fig = _figure(COLUMN_WIDTH_IN, 2.1 + _legend_rows_in(entries, COLUMN_WIDTH_IN))
        ax = fig.subplots()
        for label in labels:
            part = table[table["label"] == label].rename(columns={"layer": "x"})
            _plot_band(ax, part, styles[label], marker="o" if part["x"].nunique() <= 12 else None)
        extra = []
        if show_reference:
            ax.axhline(PAPER_DRIFT, color="black", linestyle=(0, (1, 2)), linewidth=0.8)
            extra.append((Line2D([], [], color="black", linestyle=(0, (1, 2))),
                          f"paper: ≈10%/update, {PAPER_LAYERS} layers"))
        ax.set_ylim(bottom=0)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("layer (0 = first)")
        ax.set_ylabel(DRIFT_LABEL)
        _legend(fig, labels, styles, extra)
        out.files = _save(fig, out_dir, out.name, dpi, pdf)
    counts = layer_counts(runset)
    depth = ", ".join(sorted({str(n) for n in counts.values()})) or "unknown"
    reference = (f"the dotted line is the paper's ≈10% per update on a {PAPER_LAYERS}-layer MoE"
                 if show_reference else
                 f"the paper's ≈10% per update on a {PAPER_LAYERS}-layer MoE is off this scale (largest value here "
                 f"{top:.2g})")
    out.caption = (f"Share of activated experts that changed per layer, {basis}, mean ± 1 sample std across seeds "
                   f"on a model with {depth} layers; {reference}.")
    return out


def fig_ratio_variance(runset: RunSet, out_dir: Path, alpha: float = EMA_ALPHA, dpi: int = 150,
                       pdf: bool = False) -> FigureOutput:
    """Token-level vs sequence-level importance-ratio variance per series against step, log y."""
    out = FigureOutput("5", "fig5_ratio_variance", "Importance-ratio variance, token vs sequence level", "")
    panels = [(name, title) for name, title in ((TOKEN_RATIO_VAR, "token-level ratio r_t"),
                                                 (SEQ_RATIO_VAR, "sequence-level ratio s_i")) if runset.has(name)]
    for metric in (TOKEN_RATIO_VAR, SEQ_RATIO_VAR):
        if not runset.has(metric):
            out.notes.append(f"No run logged `{metric}`; its panel is left out.")
    if not panels:
        out.notes.append("Figure not drawn.")
        return out
    styles = series_styles(runset)
    below_floor = False
    drawn: set[str] = set()
    with matplotlib.rc_context(RC_PARAMS):
        width = TEXT_WIDTH_IN if len(panels) == 2 else COLUMN_WIDTH_IN
        fig = _figure(width, 2.0 + _legend_rows_in(runset.labels, width))
        axes = fig.subplots(1, len(panels), squeeze=False)[0]
        for ax, (metric, title) in zip(axes, panels):
            table = curve(runset, metric, x="step", alpha=alpha)
            below_floor |= bool((table["mean"] < VARIANCE_FLOOR).any())
            for label in runset.labels:
                part = table[table["label"] == label]
                if len(part):
                    _plot_band(ax, part, styles[label], floor=VARIANCE_FLOOR)
                    drawn.add(label)
            _log_limits(ax, table, VARIANCE_FLOOR)  # before the log scale: constant curves give no data range
            ax.set_yscale("log")
            ax.set_title(title)
            ax.set_xlabel(STEP_LABEL)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylabel("variance of the ratio (log)")
            missing = runset.labels_without(metric)
            if missing:
                out.notes.append(f"`{metric}` is missing for {', '.join(missing)}.")
        _legend(fig, [lab for lab in runset.labels if lab in drawn], styles)
        out.files = _save(fig, out_dir, out.name, dpi, pdf)
    floor = f"; values below {VARIANCE_FLOOR:g} are drawn at {VARIANCE_FLOOR:g}" if below_floor else ""
    out.caption = (
        "Variance of the token-level importance ratio and of the sequence-level ratio against RL step (mean over "
        f"the step's minibatches), mean ± 1 sample std across seeds, {_smoothing_text(alpha)}, log scale{floor}."
    )
    return out


def _log_limits(ax: Axes, table: pd.DataFrame, floor: float) -> None:
    """Y range covering mean ± std (floored), at least one decade, so constant curves stay visible."""
    std = table["std"].fillna(0).to_numpy(float)
    mean = table["mean"].to_numpy(float)
    lo = max(float(np.min(mean - std)), floor)
    hi = max(float(np.max(mean + std)), floor)
    lo = min(lo, float(np.min(np.maximum(mean, floor))))
    ax.set_ylim(lo / 3, max(hi * 3, lo * 10))


MISMATCH_PANELS = [
    (m.MISMATCH_K3, "k3 KL(μ_old ‖ π_old)", True),
    (m.CHI2_TOKEN, "χ² (token)", True),
    (m.ESS, "effective sample size (share)", False),
]


def fig_mismatch(runset: RunSet, out_dir: Path, alpha: float = EMA_ALPHA, dpi: int = 150,
                 pdf: bool = False) -> FigureOutput:
    """Training–inference mismatch against step: k3 KL, χ² (token) and the IS weights' effective sample size."""
    out = FigureOutput("6", "fig6_mismatch", "Training–inference mismatch", "")
    panels = [panel for panel in MISMATCH_PANELS if runset.has(panel[0])]
    if not panels:
        out.notes.append("No run logged `mismatch/*` (runs from before the mismatch metrics); figure not drawn.")
        return out
    if mismatch_is_rounding(runset):
        out.notes.append("Every run sampled with the trainer's own model (no rollout.precision, weight_quant or "
                         f"router_noise): the mismatch is the KV-cache path's rounding (k3 below "
                         f"{MISMATCH_ROUNDING:g}), not a quantity these runs varied; figure not drawn.")
        return out
    styles = series_styles(runset)
    with matplotlib.rc_context(RC_PARAMS):
        fig = _figure(TEXT_WIDTH_IN, 2.0 + _legend_rows_in(runset.labels, TEXT_WIDTH_IN))
        axes = fig.subplots(1, len(panels), squeeze=False)[0]
        for ax, (metric, title, log) in zip(axes, panels):
            table = curve(runset, metric, x="step", alpha=alpha)
            for label in runset.labels:
                part = table[table["label"] == label]
                if len(part):
                    _plot_band(ax, part, styles[label], floor=VARIANCE_FLOOR if log else None)
            if log:
                _log_limits(ax, table, VARIANCE_FLOOR)
                ax.set_yscale("log")
            ax.set_title(title)
            ax.set_xlabel(STEP_LABEL)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        _legend(fig, runset.labels, styles)
        out.files = _save(fig, out_dir, out.name, dpi, pdf)
    out.caption = (
        "How far the rollout engine's log-probs μ_old are from the trainer's π_old at the same weights, per RL step "
        "(mean over the minibatches where the trainer computed π_old): k3 estimate of KL(μ_old ‖ π_old), "
        f"χ² = mean ρ² − 1 and ESS = (mean ρ)² / mean ρ² of ρ = π_old/μ_old; mean ± 1 std across seeds, "
        f"{_smoothing_text(alpha)}, log scale for the first two."
    )
    return out


EARLY_WARNING_ROWS = [
    (m.REWARD, "reward"),
    (m.ENTROPY, "entropy"),
    (m.MISMATCH_K3, "mismatch k3"),
    (m.GRAD_NORM, "grad norm"),
]
EARLY_WARNING_RUNS = 8


def fig_early_warning(runset: RunSet, out_dir: Path, alpha: float = EMA_ALPHA, dpi: int = 150,
                      drop: float = COLLAPSE_DROP, pdf: bool = False) -> FigureOutput:
    """Per run, on one step axis: training reward, policy entropy, mismatch KL and gradient norm; collapsed runs
    first, with the step their reward fell and the steps their signals moved (`early_warning`)."""
    out = FigureOutput("7", "fig7_early_warning", "Early warning: what moves before the reward falls", "")
    rows = [(metric, name) for metric, name in EARLY_WARNING_ROWS if runset.has(metric)
            and not (metric == m.MISMATCH_K3 and mismatch_is_rounding(runset))]
    if not runset.has(m.REWARD) or len(rows) < 2:
        out.notes.append("Needs the reward and at least one of entropy, mismatch KL, grad norm; figure not drawn.")
        return out
    warnings = early_warning(runset, drop=drop, alpha=alpha)
    if not warnings["collapsed"].fillna(False).astype(bool).any():  # a figure only of what the sweep showed
        out.notes.append("No run collapsed, so there is no fall for a signal to precede; figure not drawn.")
        return out
    order = warnings.sort_values(["collapsed", "run"], ascending=[False, True])["run"].tolist()
    shown = order[:EARLY_WARNING_RUNS]
    if len(order) > len(shown):
        out.notes.append(f"{len(order) - len(shown)} of {len(order)} runs are left out (collapsed runs come first).")
    labels = runset.runs.set_index("run")["label"]
    styles = series_styles(runset)
    with matplotlib.rc_context(RC_PARAMS):
        fig = _figure(min(TEXT_WIDTH_IN * 1.6, 1.6 * len(shown) + 0.6), 1.2 * len(rows) + 0.4)
        grid = fig.subplots(len(rows), len(shown), squeeze=False, sharex="col")
        for col, run in enumerate(shown):
            info = warnings.set_index("run").loc[run]
            for row, (metric, name) in enumerate(rows):
                ax = grid[row][col]
                series = per_run_series(runset, metric, alpha=alpha)
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
        out.files = _save(fig, out_dir, out.name, dpi, pdf)
    out.caption = (
        f"Per run ({_smoothing_text(alpha)}), reward, policy entropy, k3 KL(μ_old ‖ π_old) and the gradient norm "
        "against RL step. In a collapsed run the dotted line marks where the smoothed reward fell for good and a "
        "dashed line where each signal first moved beyond its early range (definitions in the report's early-warning "
        "table)."
    )
    return out


def fig_decomposition(runset: RunSet, out_dir: Path, dpi: int = 150, pdf: bool = False) -> FigureOutput:
    """The routing part's share of the variance of log π_θ/π_old against updates since θ_old, per series."""
    out = FigureOutput("8", "fig8_decomposition", "Where the ratio noise comes from: routing against weights", "")
    rows = runset.minibatches[runset.minibatches["metric"] == m.ROUTING_SHARE]
    if rows.empty:
        out.notes.append(f"No run logged `{m.ROUTING_SHARE}` (routing.decompose_every=0); figure not drawn.")
        return out
    per_run = rows.groupby(["run", "minibatch"])["value"].mean().reset_index().merge(
        runset.runs[["run", "label"]], on="run")
    table = per_run.groupby(["label", "minibatch"])["value"].agg(mean="mean", std="std", n="count").reset_index()
    styles = series_styles(runset)
    labels = [lab for lab in runset.labels if lab in set(table["label"])]
    with matplotlib.rc_context(RC_PARAMS):
        fig = _figure(COLUMN_WIDTH_IN, 2.1 + _legend_rows_in(labels, COLUMN_WIDTH_IN))
        ax = fig.subplots()
        for label in labels:
            part = table[table["label"] == label].rename(columns={"minibatch": "x"})
            _plot_band(ax, part, styles[label], marker="o")
        ax.axhline(0, color="black", linewidth=0.5)
        ax.set_xlabel("optimizer updates since θ_old (minibatch index)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("routing share of log-ratio variance")
        _legend(fig, labels, styles)
        out.files = _save(fig, out_dir, out.name, dpi, pdf)
    out.caption = (
        "Each off-policy token's log π_θ/π_old split into a routing part, log π_θ(y | θ's experts) − log π_θ(y | "
        "θ_old's experts), and a weights part, log π_θ(y | θ_old's experts) − log π_old(y); the routing part's share "
        "Cov(routing, total) / Var(total) of the variance (the weights part has the rest), against the number of "
        "updates since θ_old, mean over the steps it was measured within each seed, ± 1 std across seeds."
    )
    return out


SYNTHETIC_CAPTIONS = {
    FLIP_RATE: "The flips are a SYNTHETIC intervention (routing.flip_rate): they imitate routing drift in π_θ's update "
               "forwards only, which replay overrides by construction.",
    PERTURB_RATE: "The router noise is a SYNTHETIC intervention (routing.perturb_rate): θ carries it into rollouts, "
                  "π_old and evaluations, as natural drift; it does not follow the gradient.",
}


def _axis_label(key: str) -> str:
    return {"trainer.lr": "learning rate", FLIP_RATE: "synthetic flip rate p (SYNTHETIC)",
            PERTURB_RATE: "router noise p, share moved per update (SYNTHETIC)",
            "model.num_hidden_layers": "MoE layers", "trainer.minibatches": "minibatches N",
            "dataset.digits": "digits (answer length)", "rollout.router_noise": "engine router noise σ"}.get(key, key)


def _arm_color(arm: str) -> tuple[str, str]:
    algo = arm.split(" ")[0]
    replay = arm.split(" + ")[1].split(" ")[0] if " + " in arm else "none"
    return algo_color(algo), replay_linestyle(replay)


def fig_sweep_response(runset: RunSet, out_dir: Path, dpi: int = 150, pdf: bool = False,
                       early_stopped: str = EarlyStopped.exclude,
                       primary: str = Summary.gain_area) -> FigureOutput:
    """Held-out greedy accuracy gained from each run's start against what the sweep varied: one line per arm for one
    swept knob, a grid per arm (the phase diagram) for two whose values fill a grid; a panel per cell with every
    seed's `primary` summary per arm where the cells fill no grid (two interventions swept apart, not crossed) or
    the sweep varied its arms alone. The runs the comparisons count (`accuracy_gain` under `early_stopped`): a
    run that did not finish is not drawn as if it had."""
    out = FigureOutput("0", "fig0_sweep_response", "Held-out accuracy gained, against what the sweep varied", "")
    gains = accuracy_gain(runset, early_stopped)
    gains = gains[gains["counted"] != EXCLUDED]
    axes = [key for key in sweep_axes(runset) if gains[key].nunique() > 1] if not gains.empty else []
    arms = list(dict.fromkeys(sorted(gains["arm"], key=arm_order)))
    if gains.empty or (not axes and len(arms) < 2):
        out.notes.append("The runs vary no numeric setting within an arm and hold one arm (or were not evaluated at "
                         "start and end): nothing varied to draw the gain against; Figure 1 shows the runs.")
        return out
    cells = sweep_cells(gains, axes)
    a_grid = len(axes) >= 2 and len({tuple(cell[key] for key in axes[:2]) for cell, _ in cells}) == math.prod(
        gains[key].nunique() for key in axes[:2])
    if a_grid and len(axes) > 2:
        out.notes.append(f"The sweep varies {len(axes)} settings ({', '.join(axes)}); the first two are drawn, "
                         "averaging over the others.")
    with matplotlib.rc_context(RC_PARAMS):
        if len(axes) == 1:
            _gain_lines(out, gains, axes[0], arms, out_dir, dpi, pdf)
        elif a_grid:
            _gain_grids(out, gains, axes[0], axes[1], arms, out_dir, dpi, pdf)
        else:
            _gain_cells(out, cells, arms, primary, out_dir, dpi, pdf)
    seeds = ", ".join(sorted(set(gains["seed"]), key=lambda s: (len(s), s)))
    synthetic = [key for key in axes if key in SYNTHETIC_KEYS]
    out.caption += f" Seeds: {seeds}." + "".join(f" {SYNTHETIC_CAPTIONS[key]}" for key in synthetic)
    return out


def _gain_lines(out: FigureOutput, gains: pd.DataFrame, axis: str, arms: list[str], out_dir: Path, dpi: int,
                pdf: bool) -> None:
    values = sorted(gains[axis].unique())
    fig = _figure(COLUMN_WIDTH_IN, 2.2 + 0.14 * math.ceil(len(arms) / 2))
    ax = fig.subplots()
    handles = []
    for arm in arms:
        color, style = _arm_color(arm)
        part = gains[gains["arm"] == arm]
        x = [values.index(v) for v in part[axis]]
        ax.scatter(x, part["gain"], s=6, color=color, alpha=0.5, linewidths=0)
        mean = part.groupby(axis)["gain"].mean()
        ax.plot([values.index(v) for v in mean.index], mean.to_numpy(), color=color, linestyle=style, marker="o",
                markersize=2.5)
        handles.append((Line2D([], [], color=color, linestyle=style, marker="o", markersize=2.5), arm))
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set_xticks(range(len(values)), [f"{v:g}" for v in values])
    ax.set_xlabel(_axis_label(axis))
    ax.set_ylabel("held-out greedy acc., end − start")
    fig.legend([h for h, _ in handles], [n for _, n in handles], loc="outside lower center",
               ncols=min(len(handles), 2), frameon=False)
    out.files = _save(fig, out_dir, out.name, dpi, pdf)
    out.caption = (f"Each run's held-out greedy accuracy at its last evaluation minus at its start (same prompts), "
                   f"against {_axis_label(axis)}: one dot per seed, the line through the means.")


def _gain_grids(out: FigureOutput, gains: pd.DataFrame, x_axis: str, y_axis: str, arms: list[str], out_dir: Path,
                dpi: int, pdf: bool) -> None:
    xs, ys = sorted(gains[x_axis].unique()), sorted(gains[y_axis].unique())
    columns = min(len(arms), 4)
    rows = math.ceil(len(arms) / columns)
    fig = _figure(TEXT_WIDTH_IN, 0.4 + 1.9 * rows)
    grid = fig.subplots(rows, columns, squeeze=False)
    limit = max(0.05, float(gains["gain"].abs().max()))
    image = None
    for index, arm in enumerate(arms):
        ax = grid[index // columns][index % columns]
        table = gains[gains["arm"] == arm].groupby([y_axis, x_axis])["gain"].agg(["mean", "count"])
        values = np.full((len(ys), len(xs)), np.nan)
        for (y, x), row in table.iterrows():
            values[ys.index(y), xs.index(x)] = row["mean"]
            ax.text(xs.index(x), ys.index(y), f"{row['mean']:+.2f}\n({int(row['count'])})", ha="center",
                    va="center", fontsize=5)
        image = ax.imshow(values, cmap="RdBu", vmin=-limit, vmax=limit, origin="lower", aspect="auto")
        ax.set_xticks(range(len(xs)), [f"{v:g}" for v in xs])
        ax.set_yticks(range(len(ys)), [f"{v:g}" for v in ys])
        ax.set_xlabel(_axis_label(x_axis))
        ax.set_ylabel(_axis_label(y_axis))
        ax.set_title(arm)
        ax.grid(False)
    for index in range(len(arms), rows * columns):
        grid[index // columns][index % columns].set_visible(False)
    fig.colorbar(image, ax=grid, shrink=0.8, label="held-out greedy accuracy, end − start")
    out.files = _save(fig, out_dir, out.name, dpi, pdf)
    out.caption = (f"The stability phase diagram: per arm, the mean over seeds (their count in brackets) of each "
                   f"run's held-out greedy accuracy at its last evaluation minus at its start, over "
                   f"{_axis_label(x_axis)} × {_axis_label(y_axis)}; blue gained, red lost.")


def _gain_cells(out: FigureOutput, cells: list[tuple[dict, pd.DataFrame]], arms: list[str], measure: str,
                out_dir: Path, dpi: int, pdf: bool) -> None:
    """A panel per cell: each seed's `measure` per arm (a dot; one seed's runs joined across the arms, the pairs the
    comparisons take) and each arm's mean (a bar), on one y scale."""
    columns = min(len(cells), 4)
    rows = math.ceil(len(cells) / columns)
    width = COLUMN_WIDTH_IN if columns == 1 else TEXT_WIDTH_IN
    fig = _figure(width, 0.6 + 1.9 * rows)
    grid = fig.subplots(rows, columns, squeeze=False, sharey=True)
    name = GAIN_MEASURES[measure].split(":")[0]
    for index, (cell, part) in enumerate(cells):
        ax = grid[index // columns][index % columns]
        for _, seed in part.groupby(["start_sha256", "seed"]):
            values = seed.drop_duplicates("arm").set_index("arm").reindex(arms)[measure].to_numpy(float)
            ax.plot(range(len(arms)), values, color="grey", linewidth=0.5, alpha=0.6, zorder=1)
        for x, arm in enumerate(arms):
            values = part.loc[part["arm"] == arm, measure].dropna()
            if values.empty:
                continue
            color, style = _arm_color(arm)
            ax.scatter(np.full(len(values), x), values, s=8, color=color, linewidths=0, zorder=2)
            ax.hlines(values.mean(), x - 0.3, x + 0.3, color=color, linestyle=style, linewidth=1.5, zorder=3)
        ax.axhline(0, color="black", linewidth=0.5)
        ax.set_xlim(-0.5, len(arms) - 0.5)
        ax.set_xticks(range(len(arms)), arms, rotation=30 if len(arms) > 2 else 0,
                      ha="right" if len(arms) > 2 else "center")
        ax.set_title(cell_name(cell) if cell else "")
        ax.grid(False, axis="x")
        if index % columns == 0:
            ax.set_ylabel(f"{name}\n(held-out greedy acc.)")
    for index in range(len(cells), rows * columns):
        grid[index // columns][index % columns].set_visible(False)
    out.files = _save(fig, out_dir, out.name, dpi, pdf)
    where = "Per cell of the sweep (a panel), each" if len(cells) > 1 else "Each"
    out.caption = (f"{where} run's {name} of held-out greedy accuracy (`{measure}`, from the run's own start), per "
                   "arm: a dot per seed, one seed's runs joined by a grey line (the pairs the comparisons take), a bar "
                   "at the arm's mean (its line style the arm's replay).")


def all_figures(runset: RunSet, out_dir: Path, alpha: float = EMA_ALPHA, dpi: int = 150,
                pdf: bool = False, early_stopped: str = EarlyStopped.exclude,
                primary: str = Summary.gain_area) -> list[FigureOutput]:
    """Every figure in report order (`early_stopped`: how the gain figure counts runs that ended themselves;
    `primary`: the summary it shows per seed where it draws a panel per cell)."""
    out_dir = Path(out_dir)
    return [
        fig_sweep_response(runset, out_dir, dpi=dpi, pdf=pdf, early_stopped=early_stopped, primary=primary),
        fig_reward_vs_compute(runset, out_dir, alpha=alpha, dpi=dpi, pdf=pdf),
        fig_clip_fraction(runset, out_dir, dpi=dpi, pdf=pdf),
        fig_replay_grpo(runset, out_dir, alpha=alpha, dpi=dpi, pdf=pdf),
        fig_drift_layer_minibatch(runset, out_dir, dpi=dpi, pdf=pdf),
        fig_drift_layer_step(runset, out_dir, dpi=dpi, pdf=pdf),
        fig_drift_depth(runset, out_dir, dpi=dpi, pdf=pdf),
        fig_ratio_variance(runset, out_dir, alpha=alpha, dpi=dpi, pdf=pdf),
        fig_mismatch(runset, out_dir, alpha=alpha, dpi=dpi, pdf=pdf),
        fig_early_warning(runset, out_dir, alpha=alpha, dpi=dpi, pdf=pdf),
        fig_decomposition(runset, out_dir, dpi=dpi, pdf=pdf),
    ]
