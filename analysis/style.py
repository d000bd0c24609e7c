"""One place for the look of every figure: colours per algorithm, line styles per replay mode, sizes, fonts.

Conventions: a fixed colour per algorithm across all figures (the GSPO paper draws
GSPO red and GRPO blue, kept here), replay variants share their algorithm's hue and differ by line style (bars:
hatch), figures sized for a paper column (3.3 in) or the full text width (6.8 in), no LaTeX (CI lacks it).
"""

from __future__ import annotations

import zlib
from typing import Any

from matplotlib.colors import to_hex, to_rgb
from matplotlib.typing import LineStyleType, RcKeyType

COLUMN_WIDTH_IN = 3.3
TEXT_WIDTH_IN = 6.8

ALGO_COLORS: dict[str, str] = {
    "grpo": "#1f5fb4",
    "gspo": "#d62728",
    "gspo_token": "#ff7f0e",
    "dr_grpo": "#17becf",
    "dapo": "#2ca02c",
    "cispo": "#9467bd",
    "gmpo": "#8c564b",
    "sapo": "#e377c2",
}
# Algorithms outside the catalogue (plug-ins) get a colour from this list, chosen by a stable hash of the name so
# the same plug-in keeps its colour across reports.
OTHER_COLORS = ("#7f7f7f", "#bcbd22", "#393b79", "#637939", "#843c39", "#7b4173")

ALGO_ORDER = tuple(ALGO_COLORS)
REPLAY_ORDER = ("none", "r2", "r3")
REPLAY_LINESTYLES: dict[str, LineStyleType] = {"none": "-", "r2": "--", "r3": ":"}
REPLAY_HATCHES: dict[str, str] = {"none": "", "r2": "////", "r3": "...."}

RC_PARAMS: dict[RcKeyType, Any] = {
    "font.size": 7,
    "axes.titlesize": 7,
    "axes.labelsize": 7,
    "xtick.labelsize": 6,
    "ytick.labelsize": 6,
    "legend.fontsize": 6,
    "lines.linewidth": 1.2,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "grid.linewidth": 0.5,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "text.usetex": False,
    "pdf.fonttype": 42,  # embed TrueType so the PDF text stays editable and searchable
}


def algo_color(algo: str) -> str:
    """Hex colour of an algorithm; catalogue names are fixed, unknown names get a stable fallback."""
    if algo in ALGO_COLORS:
        return ALGO_COLORS[algo]
    return OTHER_COLORS[zlib.crc32(algo.encode()) % len(OTHER_COLORS)]


def shade(color: str, rank: int) -> str:
    """Variant `rank` of a colour: 0 is the colour itself, then alternately darker and lighter.

    Used when several series share algorithm and replay mode (they differ in another swept key), so they keep
    the algorithm's hue but stay distinguishable.
    """
    if rank == 0:
        return to_hex(color)
    amount = min(0.25 * ((rank + 1) // 2), 0.75)
    target = (0.0, 0.0, 0.0) if rank % 2 else (1.0, 1.0, 1.0)
    rgb = to_rgb(color)
    red, green, blue = (c + (t - c) * amount for c, t in zip(rgb, target))
    return to_hex((red, green, blue))


def replay_linestyle(replay: str) -> LineStyleType:
    return REPLAY_LINESTYLES.get(replay, "-.")


def replay_hatch(replay: str) -> str:
    return REPLAY_HATCHES.get(replay, "xxxx")
