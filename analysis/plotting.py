"""What every figure shares: the record a report keeps of it, where and how it is written, its series' styles, its
legend, bands and log scales, and the `figure` decorator that gives one figure's drawing function all of that.

A figure of the report is one function, decorated with `figure(number, name, title)`: it gets the runs, the
`FigureSettings` and the figure's `FigureOutput`, adds its caption and notes there, and returns the matplotlib `Figure`
it drew, or None when nothing can be drawn (a metric no run logged, a quantity the runs did not vary: its notes say
why; it never raises on missing data). The decorator does the rest once for every figure: the record, the style's
rc parameters (analysis/style.py), `<name>.png` (and `<name>.pdf` when asked). Figures are built on
`matplotlib.figure.Figure` directly (no pyplot state; PNGs render with Agg).
"""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.typing import LineStyleType
from PIL import Image

from analysis.arms import arm_order, arms_of
from analysis.records import RunSet
from analysis.style import COLUMN_WIDTH_IN, RC_PARAMS, algo_color, replay_hatch, replay_linestyle, shade
from analysis.summaries import EMA_ALPHA
from experiments.config import AccuracySummary, EarlyStopped

STEP_LABEL = "RL step"
TOKENS_LABEL = "completion tokens (cumulative)"
DRIFT_LABEL = "experts changed (fraction)"
LAG_LABEL = "lag k (weight versions the engine is behind θ_old)"  # rollout.lag, wherever it is an axis


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
class FigureSettings:
    """Where and how the report's figures are written, and the report's settings some of them read: the EMA weight of
    the smoothed curves, how the gain figure counts runs that ended themselves (`early_stopped`) and the summary it
    shows per seed where it draws a panel per cell (`primary`)."""

    out_dir: Path
    dpi: int = 150
    pdf: bool = False
    alpha: float = EMA_ALPHA
    early_stopped: str = EarlyStopped.exclude
    primary: str = AccuracySummary.gain_area
    only: tuple[str, ...] | None = None  # the numbers of the figures to draw (`--figures`); None: every figure


Draw = Callable[[RunSet, FigureSettings, FigureOutput], "Figure | None"]
T = TypeVar("T")


def in_style(draw: Callable[..., T]) -> Callable[..., T]:
    """`draw`, run with the lab's rc parameters (analysis/style.py) from its first artist to its saved file: every
    figure the analysis writes is drawn so, the report's (`figure`) and the commands' own."""

    @functools.wraps(draw)
    def styled(*args: Any, **kwargs: Any) -> T:
        with matplotlib.rc_context(RC_PARAMS):
            return draw(*args, **kwargs)

    return styled


# Every report figure's number, in the order the decorator met them: what `--figures` may name.
FIGURE_NUMBERS: list[str] = []


def figure(number: str, name: str, title: str) -> Callable[[Draw], Callable[[RunSet, FigureSettings], FigureOutput]]:
    """The report's figure `number` (file stem `name`) from the function that draws it (see the module's docstring):
    called with the runs and the settings, it returns the figure's record with the files it wrote; a figure the
    settings leave out (`FigureSettings.only`) is not drawn, and its record says so."""
    FIGURE_NUMBERS.append(number)

    def made_by(draw: Draw) -> Callable[[RunSet, FigureSettings], FigureOutput]:
        @functools.wraps(draw)
        @in_style
        def made(runset: RunSet, settings: FigureSettings) -> FigureOutput:
            out = FigureOutput(number, name, title, "")
            if settings.only is not None and number not in settings.only:
                out.notes.append(left_out_by_choice(settings.only))
                return out
            drawn = draw(runset, settings, out)
            if drawn is not None:
                out.files = save(drawn, settings.out_dir, name, settings.dpi, settings.pdf)
            return out

        return made

    return made_by


def left_out_by_choice(only: Sequence[str]) -> str:
    """The note of a figure the command line did not ask for (`--figures`)."""
    asked = ", ".join(only)
    return (
        f"Not drawn: this report was asked for figure{'s' if len(only) > 1 else ''} {asked} alone (`--figures`, "
        "which keeps a committed report small); the same command without `--figures` draws it from the runs."
    )


@dataclass(frozen=True)
class SeriesStyle:
    """How one series is drawn: its colour, its line style and, as a bar, its hatch."""

    color: str
    linestyle: LineStyleType
    hatch: str


def series_styles(runset: RunSet) -> dict[str, SeriesStyle]:
    """Colour by algorithm, line style (bars: hatch) by replay mode, a shade per further split of the same pair."""
    rows = runset.runs.drop_duplicates("label").set_index("label")
    seen: dict[tuple[str, str], int] = {}
    styles = {}
    for label in runset.labels:
        algo, replay = rows["algo"].loc[label], rows["replay"].loc[label]  # a column's cell: typed as the column's
        rank = seen.get((algo, replay), 0)
        seen[(algo, replay)] = rank + 1
        styles[label] = SeriesStyle(shade(algo_color(algo), rank), replay_linestyle(replay), replay_hatch(replay))
    return styles


def arm_styles(runset: RunSet) -> dict[str, SeriesStyle]:
    """Per arm of `runset` (`arms.arms_of`), in `arms.arm_order`, a solid line of its algorithm's colour, a shade per
    place in that order: the figures drawn per arm (rather than per series) give an arm one colour in every panel and
    in each of them."""
    arms = sorted(set(arms_of(runset).values()), key=arm_order)
    return {arm: SeriesStyle(shade(algo_color(arm.split(" ")[0]), rank), "-", "") for rank, arm in enumerate(arms)}


def new_figure(width: float, height: float) -> Figure:
    """A figure of `width` × `height` inches whose axes, labels and legend share the space (constrained layout)."""
    return Figure(figsize=(width, height), layout="constrained")


def save_png(fig: Figure, png: Path, dpi: int) -> Path:
    """`fig` as `png`, its colours reduced to a 256-colour palette (plots hold few colours: a third of the bytes, no
    visible change). Every figure the analysis writes goes through it."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    Image.open(buffer).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(png, optimize=True)
    return png


def save(fig: Figure, out_dir: Path, name: str, dpi: int, pdf: bool = False) -> list[Path]:
    """`<name>.png` (`save_png`), and `<name>.pdf` when asked (a paper's vector copy)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    png = save_png(fig, out_dir / f"{name}.png", dpi)
    if not pdf:
        return [png]
    fig.savefig(out_dir / f"{name}.pdf")
    return [png, out_dir / f"{name}.pdf"]


LEGEND_CHAR_IN = 0.047  # width of a character at legend.fontsize 6 pt (style.RC_PARAMS)
LEGEND_HANDLE_IN = 0.3  # the line sample and the padding of one legend entry


def legend_columns(width: float, names: Sequence[str] = ()) -> int:
    """Two legend columns fit a paper column, three the text width; fewer when the longest entry would not fit
    (long labels, such as a sweep's every differing key, are otherwise cut off at the figure's edges)."""
    columns = 3 if width > COLUMN_WIDTH_IN + 0.1 else 2
    longest = max((len(name) for name in names), default=0) * LEGEND_CHAR_IN + LEGEND_HANDLE_IN
    while columns > 1 and columns * longest > width:
        columns -= 1
    return columns


def legend_rows_in(names: Sequence[str], width: float) -> float:
    """Height in inches that a legend of `names` takes below the axes."""
    return 0.14 * math.ceil(len(names) / legend_columns(width, names))


def legend(
    fig: Figure, labels: Sequence[str], styles: dict[str, SeriesStyle], extra: Sequence[tuple[Artist, str]] = ()
) -> None:
    """One legend below the axes: a line per label in its series' style, then the `extra` (handle, name) pairs."""
    handles: list[Artist] = [Line2D([], [], color=styles[lab].color, linestyle=styles[lab].linestyle) for lab in labels]
    names = list(labels)
    for handle, name in extra:
        handles.append(handle)
        names.append(name)
    if handles:
        columns = min(len(handles), legend_columns(fig.get_figwidth(), names))
        fig.legend(handles, names, loc="outside lower center", ncols=columns, frameon=False)


def plot_band(
    ax: Axes, table: pd.DataFrame, style: SeriesStyle, floor: float | None = None, marker: str | None = None
) -> None:
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


def smoothing_text(alpha: float) -> str:
    """How a caption names the curves' smoothing."""
    return f"per-seed EMA with α = {alpha:g}" if alpha < 1 else "no smoothing"


def log_limits(ax: Axes, table: pd.DataFrame, floor: float) -> None:
    """Y range covering mean ± std (floored), at least one decade, so constant curves stay visible."""
    std = table["std"].fillna(0).to_numpy(float)
    mean = table["mean"].to_numpy(float)
    lo = max(float(np.min(mean - std)), floor)
    hi = max(float(np.max(mean + std)), floor)
    lo = min(lo, float(np.min(np.maximum(mean, floor))))
    ax.set_ylim(lo / 3, max(hi * 3, lo * 10))
