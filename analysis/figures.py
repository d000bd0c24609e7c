"""The report's figures, in the order report.md shows them: the GSPO paper's (arXiv 2507.18071, Figs. 1-3 and §5.3)
and the lab's mechanism figures, each one function over the shared prelude (analysis.plotting).

0. held-out accuracy gained against what the sweep varied                      — analysis/sweep_figure.py
1-3, 5-7. curves along training: reward and held-out accuracy, clipping, GRPO with and without Routing Replay,
   ratio variance, training–inference mismatch, early warning                  — analysis/curve_figures.py
4, 8, 9. routing: drift per layer and against depth, the routing part of the ratio's noise, drift against an engine
   k versions behind                                                           — analysis/routing_figures.py
10, 11. an engine k versions behind: a column per lag against step (reward, held-out accuracy, the engine's routes,
   the behaviour weight's truncation, the mismatch KL), the gain against the lag — analysis/staleness_figures.py

A new figure is a function decorated with `plotting.figure` in the module of its kind, and its place in `FIGURES`.
"""

from __future__ import annotations

from analysis.curve_figures import (
    fig_clip_fraction,
    fig_early_warning,
    fig_mismatch,
    fig_ratio_variance,
    fig_replay_grpo,
    fig_reward_vs_compute,
)
from analysis.plotting import FigureOutput, FigureSettings
from analysis.records import RunSet
from analysis.routing_figures import (
    fig_decomposition,
    fig_drift_depth,
    fig_drift_layer_minibatch,
    fig_drift_layer_step,
    fig_staleness,
)
from analysis.staleness_figures import fig_gain_by_lag, fig_staleness_curves
from analysis.sweep_figure import fig_sweep_response

FIGURES = (
    fig_sweep_response,
    fig_reward_vs_compute,
    fig_clip_fraction,
    fig_replay_grpo,
    fig_drift_layer_minibatch,
    fig_drift_layer_step,
    fig_drift_depth,
    fig_ratio_variance,
    fig_mismatch,
    fig_early_warning,
    fig_decomposition,
    fig_staleness,
    fig_staleness_curves,
    fig_gain_by_lag,
)


def all_figures(runset: RunSet, settings: FigureSettings) -> list[FigureOutput]:
    """Every figure of `FIGURES`, in report order, drawn from `runset` as `settings` say."""
    return [draw(runset, settings) for draw in FIGURES]
