"""The drift scaling law: a power law fitted by least squares on logarithms to the drift probes' rows
(analysis.drift_law reads them),

    log drift = c + a_L log L + a_lr log lr + a_E log(E/k) + a_T log T + a_H log H + a_m log m + b · sigmoid,

with L the MoE layers, E/k the experts per top-k slot, H the hidden width, T the task's answer length by design (the
sampled length is an outcome: a breaking update changes it), m the cold start's top-k margin median (its
`cold_start.json`: how decisive the routers are before any update, a property of the start, not of the probe) and
`sigmoid` 1 for the sigmoid + bias family, 0 for the softmax one (a factor e^b, not a power), over the regressors that
vary among the rows with every known regressor known (a constant one would make the fit singular; the report names
the ones used). Each coefficient comes with its standard error (ordinary least squares), the fit with R² and its
residual spread.

The extrapolation evaluates the fit at Qwen3-30B-A3B's routing (48 layers, 128 experts, top-8) at each probed
learning rate, the answer length and width held at the fitted rows' medians (and, on a line of its own, at its width
2048), a softmax router at the softmax anchor's margin when the margin is fitted (Qwen3.6-35B-A3B's: the nearest real
softmax router measured), and solves for the learning rate at which the law reaches the GSPO paper's ~10% there; with
the margin fitted it also solves for the margin a start of the probed ladder would need for a drift of `TARGET_DRIFT`
at each probed learning rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from models.routing.measures import MARGIN_ANCHORS

PAPER_DRIFT = 0.10  # GSPO paper §5.3: ~10% of activated experts change per update (Qwen3-30B-A3B, 48 layers)
PAPER_SHAPE = {"layers": 48, "experts": 128, "top_k": 8, "hidden": 2048}  # Qwen3-30B-A3B
PAPER_MARGIN = MARGIN_ANCHORS["Qwen3.6-35B-A3B (softmax)"]  # the softmax anchor stands in for the paper's router
TARGET_DRIFT = 0.05  # drift per update of the paper's order (issue 31's goal)
LOG, INDICATOR = "log", "indicator"
# Regressor name -> (column, axis label, kind): a LOG one enters the fit as its logarithm (a power law), an
# INDICATOR one (0 or 1) as itself (a factor e^b where it is 1).
REGRESSORS = {
    "layers": ("layers", "MoE layers L", LOG),
    "lr": ("lr", "learning rate", LOG),
    "experts_per_slot": ("experts_per_slot", "experts per top-k slot E/k", LOG),
    "length": ("answer_tokens", "answer tokens T (the task's, by design)", LOG),
    "hidden": ("hidden", "hidden width H", LOG),
    "margin": ("start_margin", "cold start's top-k margin median m", LOG),
    "sigmoid": ("sigmoid_family", "sigmoid + bias family (1) against softmax (0)", INDICATOR),
}


@dataclass
class Fit:
    """A law fitted to the probes' rows: its regressors, coefficients with their standard errors, and how well it
    fits."""

    regressors: list[str]  # in the order of `coef[1:]`
    coef: np.ndarray  # [c, a_1, ...]
    stderr: np.ndarray
    r2: float
    residual_std: float  # of log drift
    n: int

    def predict(self, point: dict[str, float]) -> float:
        """The drift the law gives at `point` (a value per regressor)."""
        x = np.array([1.0] + [_term(r, point[r]) for r in self.regressors])
        return float(math.exp(x @ self.coef))

    def exponent(self, name: str) -> float:
        """The coefficient of regressor `name` (an exponent, or the log factor of an indicator)."""
        return float(self.coef[1 + self.regressors.index(name)])

    def as_dict(self) -> dict[str, Any]:
        """The fit as fit.json holds it."""
        return {
            "regressors": self.regressors,
            "intercept": float(self.coef[0]),
            "exponents": {r: float(c) for r, c in zip(self.regressors, self.coef[1:])},
            "stderr": {r: float(s) for r, s in zip(["intercept", *self.regressors], self.stderr)},
            "r2": self.r2,
            "residual_std_log": self.residual_std,
            "n": self.n,
        }


def _term(name: str, value: float) -> float:
    """What regressor `name` at `value` contributes to the design: its logarithm, or the indicator itself."""
    return float(value) if REGRESSORS[name][2] == INDICATOR else math.log(value)


def fitted_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows the law is fitted on: a positive drift, not diverged, and every regressor known that any row knows
    (probes of cold starts made before margins were recorded know no margin: then no row is fitted on it)."""
    known = [column for column, *_ in REGRESSORS.values() if column in rows and rows[column].notna().any()]
    usable = rows[(rows["drift"] > 0) & rows[known].notna().all(axis=1)]
    return usable[usable["diverged"].isna()] if "diverged" in usable else usable


def fit_law(rows: pd.DataFrame) -> Fit:
    """Least squares of log drift on every regressor that varies (`_term`; rows with a positive drift only)."""
    usable = fitted_rows(rows)
    names = [name for name, (column, *_) in REGRESSORS.items() if column in usable and usable[column].nunique() > 1]
    if len(usable) <= len(names) + 1:
        raise ValueError(
            f"{len(usable)} probe rows with a positive drift cannot fit {len(names) + 1} coefficients "
            f"({', '.join(['constant', *names])}): probe more settings"
        )
    x = np.column_stack([np.ones(len(usable))] + [[_term(n, v) for v in usable[REGRESSORS[n][0]]] for n in names])
    y = np.log(usable["drift"].astype(float).to_numpy())
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    residual = y - x @ coef
    dof = len(y) - x.shape[1]
    sigma2 = float(residual @ residual) / dof
    stderr = np.sqrt(np.diag(sigma2 * np.linalg.pinv(x.T @ x)))
    r2 = 1.0 - float(residual @ residual) / float(((y - y.mean()) ** 2).sum())
    return Fit(names, coef, stderr, r2, math.sqrt(sigma2), len(y))


def held_at_median(rows: pd.DataFrame, own_width: bool) -> dict[str, float]:
    """The regressors the extrapolation does not take from Qwen3-30B-A3B, at the fitted rows' medians: the answer
    length always (the paper's answers are thousands of tokens, far beyond any probed), the width unless `own_width`
    (its 2048 is 8x beyond the widest probed model)."""
    usable = fitted_rows(rows)
    held = ["length"] + ([] if own_width else ["hidden"])
    return {name: float(usable[REGRESSORS[name][0]].median()) for name in held}


def ladder_point(rows: pd.DataFrame, lr: float) -> dict[str, float]:
    """The fitted rows' median of every regressor, the softmax family, at `lr`: a start of the probed ladder."""
    usable = fitted_rows(rows)
    point = {name: float(usable[column].median()) for name, (column, *_) in REGRESSORS.items() if column in usable}
    point.update(lr=lr, sigmoid=0.0)
    return point


def paper_point(fit: Fit, rows: pd.DataFrame, lr: float, own_width: bool = False) -> dict[str, float]:
    """Qwen3-30B-A3B's routing (and, with `own_width`, its hidden width) at `lr`, a softmax router at the softmax
    anchor's margin; the rest `held_at_median`."""
    point = ladder_point(rows, lr)
    point.update(
        held_at_median(rows, own_width),
        layers=PAPER_SHAPE["layers"],
        margin=PAPER_MARGIN,
        experts_per_slot=PAPER_SHAPE["experts"] / PAPER_SHAPE["top_k"],
    )
    if own_width:
        point["hidden"] = PAPER_SHAPE["hidden"]
    return point


def lr_for_paper_drift(fit: Fit, rows: pd.DataFrame, own_width: bool = False) -> float | None:
    """The learning rate at which the law gives the paper's drift at its routing (None without an lr exponent)."""
    if "lr" not in fit.regressors:
        return None
    exponent = fit.exponent("lr")
    if exponent <= 0:
        return None
    at_one = fit.predict(paper_point(fit, rows, 1.0, own_width))
    return float((PAPER_DRIFT / at_one) ** (1.0 / exponent))


def margin_for_drift(fit: Fit, rows: pd.DataFrame, lr: float, drift: float = TARGET_DRIFT) -> float | None:
    """The cold-start margin at which the law gives `drift` at `lr` on a start of the probed ladder (`ladder_point`):
    None without a margin exponent, or with one that is not negative (drift that does not fall as routers grow more
    decisive: no margin answers)."""
    if "margin" not in fit.regressors or fit.exponent("margin") >= 0:
        return None
    at_one = fit.predict({**ladder_point(rows, lr), "margin": 1.0})
    return float((drift / at_one) ** (1.0 / fit.exponent("margin")))


def knob_effects(fit: Fit, rows: pd.DataFrame) -> list[tuple[str, float, float, float]]:
    """(knob, smallest, largest value probed, factor) per fitted knob, largest move first: the factor by which the law
    moves drift from the knob's smallest to its largest value fitted, the others held (exponent × log of the range)."""
    effects, usable = [], fitted_rows(rows)
    for name, coef in zip(fit.regressors, fit.coef[1:]):
        values = usable[REGRESSORS[name][0]].astype(float)
        low, high = float(values.min()), float(values.max())
        effects.append((name, low, high, math.exp(coef * (_term(name, high) - _term(name, low)))))
    return sorted(effects, key=lambda effect: -abs(math.log(effect[3])))


def knob_range(rows: pd.DataFrame, column: str) -> str:
    """'low to high' of a column over the fitted rows."""
    values = fitted_rows(rows)[column].astype(float)
    return f"{values.min():.2g} to {values.max():.2g}"


def fit_record(fit: Fit, rows: pd.DataFrame) -> dict[str, Any]:
    """What fit.json holds: the fit, the learning rate the paper's drift needs and, with the margin fitted, the margin
    `TARGET_DRIFT` needs at each probed learning rate."""
    record = {**fit.as_dict(), "lr_for_paper_drift": lr_for_paper_drift(fit, rows)}
    if "margin" in fit.regressors:
        record["margin_for_target_drift"] = {
            f"{lr:g}": margin_for_drift(fit, rows, lr) for lr in sorted(rows["lr"].unique())
        }
    return record
