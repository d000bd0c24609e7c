"""Contrasts that are not one arm against a baseline in one cell: arms at two lags and one arm on two models, as the
staleness study declared them (docs/results/async/preregistration.md, "Measure, family, verdict").

Every value is of one measure of the per-seed tables (`gains.GAIN_MEASURES`; by default gain_area, the staleness
study's), the family's. A **fall** of an arm at a (start, seed) unit is its measure at lag 0 minus at the lag
(positive: it learns less behind). A contrast is one of four kinds:

- `difference`: `arm` − `other` at the lag, paired per (start, seed) unit; the one kind that may be declared at lag 0
  (`lag: 0`, two arms of a synchronous sweep), whatever k* is;
- `fall`: the fall of `arm`, paired per unit: arm@0 − arm@k;
- `fall_difference`: the fall of `arm` minus the fall of `other`, paired per unit:
  (arm@0 − arm@k) − (other@0 − other@k);
- `interaction`: the fall of `arm` on one model minus its fall on another; the two models' starts share nothing, so it
  is unpaired between them: each start's fall with its seeds averaged (`unpaired.between_starts`).

A paired contrast reads one named table (`table`, by default `moe`: the MoE rung's cells); an interaction reads `moe`
and `dense` (the dense control's).

A paired contrast's per-unit values, grouped by start, go to `statistics.across_starts` (two-level bootstrap
interval, start-level sign-flip test); an interaction's two models' to `unpaired.between_starts` (each model's
two-level bootstrap, the permutation test of the starts' falls between the models). A unit of a table that lacks a
run the value needs (none, or one that did not finish) is left out and named with why; a run scored as failed counts,
as every comparison counts it (`gains.SCORED_FAILED`: the stop rule the pre-registration fixed). Over the family the
start-level p-values are adjusted by Holm's correction (`statistics.holm`), and a comparison **separates** when its
95% interval excludes 0 and its Holm-adjusted p < 0.05.

A **family** (`Family`, `load_family`) is a set of contrasts judged together under Holm's correction on one measure,
declared in a yaml file beside the document that fixed it before its runs were read: a new family is a new file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import pandas as pd
import yaml

from analysis.arms import seed_order
from analysis.diagnostics import LAG  # also the per-seed tables' column of the engine's lag
from analysis.gains import EXCLUDED, GAIN_MEASURES
from analysis.statistics import ALPHA, AcrossStarts, across_starts, holm
from analysis.unpaired import BetweenStarts, between_starts
from experiments.config import PROJECT_ROOT

MEASURE = "gain_area"  # a family's measure unless it declares one: the staleness study's, the mean gain over the run
MOE, DENSE = "moe", "dense"  # the tables a contrast reads unless it names one, and the two an interaction reads
DIFFERENCE, FALL, FALL_DIFFERENCE, INTERACTION = "difference", "fall", "fall_difference", "interaction"
KINDS = (DIFFERENCE, FALL, FALL_DIFFERENCE, INTERACTION)
_AGAINST_OTHER = (DIFFERENCE, FALL_DIFFERENCE)  # the kinds that set `arm` against another arm
WHY_COLUMNS = ["start_sha256", "seed", "why"]  # a unit left out, and why

# A unit's values per start: {start sha256: {seed: value}}.
Values = dict[str, dict[str, float]]


@dataclass(frozen=True)
class Contrast:
    """One declared comparison (the kinds: the module's docstring). `other` is the arm `arm` is set against (None for
    a fall, which sets one arm at two lags against itself, and for an interaction, one arm on two models); `lag` is
    the lag k compared with 0 (a fall) or at which two arms meet (a difference), None while the family is declared
    before k* is known (`at`), 0 for a difference declared at lag 0; `table` the table it reads (an interaction's:
    `tables`)."""

    name: str
    kind: str
    arm: str
    other: str | None = None
    lag: int | None = None
    table: str = MOE

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"contrast {self.name!r}: kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if (self.other is None) == (self.kind in _AGAINST_OTHER):
            raise ValueError(
                f"contrast {self.name!r}: a {self.kind} {'takes no' if self.other else 'needs an'} other arm"
            )
        if self.lag == 0 and self.kind != DIFFERENCE:
            raise ValueError(
                f"contrast {self.name!r} ({self.kind}) compares lag 0 with k*: only a difference is at lag 0"
            )
        if self.kind == INTERACTION and self.table != MOE:
            raise ValueError(
                f"contrast {self.name!r}: an interaction reads the {MOE} and {DENSE} tables, and names no table"
            )

    def at(self, lag: int) -> Contrast:
        """The contrast at k* = `lag`; one declared at lag 0 stays there."""
        return self if self.lag == 0 else replace(self, lag=lag)

    @property
    def tables(self) -> tuple[str, ...]:
        """The tables it reads: its own, or an interaction's two models'."""
        return (MOE, DENSE) if self.kind == INTERACTION else (self.table,)

    @property
    def lags(self) -> tuple[int, ...]:
        """The lags its runs come from."""
        return (self._lag,) if self.kind == DIFFERENCE else (0, self._lag)

    @property
    def _lag(self) -> int:
        if self.lag is None:
            raise ValueError(f"contrast {self.name!r} has no lag yet: give it one with `at`")
        return self.lag

    def terms(self) -> list[tuple[str, int, int]]:
        """The runs one unit's value is made of, as (arm, lag, sign): the value is the signed sum of their measure
        (for an interaction, the fall on one model)."""
        k = self._lag
        if self.kind == DIFFERENCE:
            return [(self.arm, k, 1), (str(self.other), k, -1)]
        falls = [(self.arm, 1)] + ([(str(self.other), -1)] if self.kind == FALL_DIFFERENCE else [])
        return [term for arm, sign in falls for term in ((arm, 0, sign), (arm, k, -sign))]

    @property
    def text(self) -> str:
        """The contrast as a report's table writes it."""
        k = "k*" if self.lag is None else f"k = {self.lag}"
        if self.kind == DIFFERENCE:
            return f"`{self.arm}` − `{self.other}` at {k}"
        if self.kind == FALL:
            return f"fall of `{self.arm}` from 0 to {k}"
        if self.kind == FALL_DIFFERENCE:
            return f"fall of `{self.arm}` from 0 to {k} − fall of `{self.other}`"
        return f"fall of `{self.arm}` from 0 to {k}: MoE − dense"


def needed_runs(contrasts: Sequence[Contrast]) -> list[tuple[str, int]]:
    """The (arm, lag) pairs the contrasts read on a table (in order of first need)."""
    return list(dict.fromkeys((arm, lag) for contrast in contrasts for arm, lag, _ in contrast.terms()))


def unit_values(rows: pd.DataFrame, contrast: Contrast, measure: str = MEASURE) -> tuple[Values, pd.DataFrame]:
    """One table's per-(start, seed) values of `contrast` on `measure` (for an interaction, its arm's fall on that
    table's model), and the units left out: every (start, seed) the table holds a run of, whatever its arm or lag,
    that lacks a counted run a value needs (`why` names each missing run: none, or one that did not finish). `rows`: a
    per-seed table as `compare.pool` returns it, with `rollout.lag`."""
    lags = rows[LAG].astype(float)
    counted = rows["counted"] != EXCLUDED
    area = {
        (arm, lag, start, str(seed)): value
        for arm, lag, start, seed, value in zip(
            rows.loc[counted, "arm"],
            lags[counted],
            rows.loc[counted, "start_sha256"],
            rows.loc[counted, "seed"],
            rows.loc[counted, measure],
        )
    }
    units = sorted(
        {(start, str(seed)) for start, seed in zip(rows["start_sha256"], rows["seed"])},
        key=lambda unit: (unit[0], seed_order(unit[1])),
    )
    values: Values = {}
    left = []
    for start, seed in units:
        missing = [
            _missing(rows, lags, arm, lag, start, seed)
            for arm, lag, _ in contrast.terms()
            if (arm, float(lag), start, seed) not in area
        ]
        if missing:
            left.append({"start_sha256": start, "seed": seed, "why": "; ".join(missing)})
        else:
            values.setdefault(start, {})[seed] = float(
                sum(sign * area[arm, float(lag), start, seed] for arm, lag, sign in contrast.terms())
            )
    return values, pd.DataFrame(left, columns=WHY_COLUMNS)


def _missing(rows: pd.DataFrame, lags: pd.Series, arm: str, lag: int, start: str, seed: str) -> str:
    """Why a unit has no counted run of `arm` at `lag`: the run that did not finish, or none."""
    runs = rows[
        (rows["arm"] == arm)
        & (lags == float(lag))
        & (rows["start_sha256"] == start)
        & (rows["seed"].astype(str) == seed)
    ]
    if runs.empty:
        return f"no run of {arm} at {LAG} {lag}"
    status = runs["status"].iloc[0] if "status" in runs else "incomplete"
    return f"{arm} at {LAG} {lag}: {runs['run'].iloc[0]} did not finish ({status})"


@dataclass(frozen=True)
class Judged:
    """A contrast's statistics over starts and its verdict under Holm's correction over its family."""

    contrast: Contrast
    statistics: AcrossStarts | BetweenStarts
    holm_p: float
    family: int  # the number of comparisons Holm's correction ran over

    @property
    def separates(self) -> bool:
        """The pre-registered verdict: the 95% interval excludes 0 and the Holm-adjusted p < `ALPHA`."""
        return self.statistics.difference.excludes(0.0) and self.holm_p < ALPHA

    @property
    def verdict(self) -> str:
        if not self.separates:
            return "not separated"
        return f"separates {'above' if self.statistics.difference.estimate > 0 else 'below'} 0"

    def row(self) -> dict[str, float | int | str | bool | None]:
        """A flat record for a CSV: every number of the comparison; each start's value as `sha256=value (seeds)`, an
        interaction's second model's in `per_start_second`."""
        stats, contrast = self.statistics, self.contrast
        sides = (
            [(stats.per_start, stats.seeds)]
            if isinstance(stats, AcrossStarts)
            else list(zip(stats.per_start, stats.seeds))
        )
        texts = [
            "; ".join(f"{start}={value!r} ({seeds[start]})" for start, value in values.items())
            for values, seeds in sides
        ]
        return {
            "comparison": contrast.name,
            "kind": contrast.kind,
            "arm": contrast.arm,
            "other": contrast.other,
            "lag": contrast.lag,
            "starts": stats.starts if isinstance(stats, AcrossStarts) else "+".join(map(str, stats.starts)),
            "estimate": stats.difference.estimate,
            "low": stats.difference.low,
            "high": stats.difference.high,
            "p_value": stats.p_value,
            "holm_p": self.holm_p,
            "family": self.family,
            "signs_agree": stats.signs_agree,
            "separates": self.separates,
            "verdict": self.verdict,
            "per_start": texts[0],
            "per_start_second": texts[1] if len(texts) > 1 else "",
        }


def judge(contrasts: Sequence[Contrast], sides: Sequence[Sequence[Values]]) -> list[Judged]:
    """Each contrast over starts, from its per-unit values (`sides`, in the same order: one `Values` for a paired
    contrast, two for an interaction, its first model's first), with Holm's correction over all of them."""
    if len(contrasts) != len(sides):
        raise ValueError(f"{len(contrasts)} contrasts but values for {len(sides)}")
    found: list[AcrossStarts | BetweenStarts] = []
    for contrast, values in zip(contrasts, sides):
        seeds = [{start: list(by_seed.values()) for start, by_seed in side.items()} for side in values]
        if len(seeds) != (2 if contrast.kind == INTERACTION else 1):
            raise ValueError(f"contrast {contrast.name!r} ({contrast.kind}) got values of {len(seeds)} models")
        found.append(between_starts(*seeds) if contrast.kind == INTERACTION else across_starts(seeds[0]))
    adjusted = holm([stats.p_value for stats in found])
    return [Judged(contrast, stats, float(p), len(contrasts)) for contrast, stats, p in zip(contrasts, found, adjusted)]


DEFAULT_FAMILY = PROJECT_ROOT / "docs" / "results" / "async" / "family.yaml"  # the pre-registration's five


class Family(NamedTuple):
    """A family of comparisons, judged together under Holm's correction on one measure, and where it was declared: a
    data file beside the document that fixed it (`load_family`)."""

    title: str  # the report's heading
    declared: str  # where, and so before which runs, it was written down
    contrasts: tuple[Contrast, ...]
    dense_arms: tuple[str, ...] = ()  # the only arms the dense control's table may hold (a family that compares models)
    measure: str = MEASURE  # the per-seed tables' column every value is of

    @property
    def compares_models(self) -> bool:
        """Whether it reads the dense control's table (an interaction) beside the MoE rung's."""
        return any(contrast.kind == INTERACTION for contrast in self.contrasts)

    @property
    def tables(self) -> tuple[str, ...]:
        """The tables its contrasts read, in order of first need."""
        return tuple(dict.fromkeys(table for contrast in self.contrasts for table in contrast.tables))

    @property
    def at_k_star(self) -> tuple[Contrast, ...]:
        """Its contrasts compared at k* (every one not declared at lag 0)."""
        return tuple(contrast for contrast in self.contrasts if contrast.lag is None)


_FAMILY_KEYS = {"title", "declared", "contrasts", "dense_arms", "measure"}
_CONTRAST_KEYS = {"name", "kind", "arm", "other", "table", "lag"}


def load_family(path: Path) -> Family:
    """The family a yaml file declares (`title`, `declared`, `contrasts`: each a `name`, `kind`, `arm` and, for the
    kinds that set two arms against each other, `other`; where it reads a table other than `moe`, `table`; `lag: 0`
    for a difference at lag 0; `dense_arms` where a contrast compares models; `measure`, a column of the per-seed
    tables, where it is not gain_area). A ValueError names the file and what in it cannot be a family."""
    try:
        declared = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ValueError(f"--family {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"--family {path} is not yaml: {str(error).splitlines()[0]}") from None
    if not isinstance(declared, dict) or not {"title", "declared", "contrasts"} <= set(declared):
        raise ValueError(f"--family {path} must be a mapping with title, declared and contrasts")
    if set(declared) - _FAMILY_KEYS:
        raise ValueError(
            f"--family {path} has {', '.join(sorted(set(declared) - _FAMILY_KEYS))}: a family holds only "
            f"{', '.join(sorted(_FAMILY_KEYS))}"
        )
    measure = str(declared.get("measure", MEASURE))
    if measure not in GAIN_MEASURES:
        raise ValueError(
            f"--family {path}: measure {measure!r} is not a measure of the per-seed tables ({', '.join(GAIN_MEASURES)})"
        )
    contrasts = []
    for number, entry in enumerate(declared["contrasts"] or [], start=1):
        if not isinstance(entry, dict) or not {"name", "kind", "arm"} <= set(entry) or set(entry) - _CONTRAST_KEYS:
            raise ValueError(
                f"--family {path}: contrast {number} ({entry!r}) must have name, kind and arm, and may have other, "
                "table and lag"
            )
        if entry.get("lag", 0) != 0:
            raise ValueError(
                f"--family {path}: contrast {number} declares lag {entry['lag']!r}: a contrast is at k* (the command's "
                "--lag), or at lag 0 where it says `lag: 0`"
            )
        try:
            # Any: the declared keys are Contrast's text fields, which `**` cannot tell from its `lag`.
            declared_fields: dict[str, Any] = {key: str(value) for key, value in entry.items() if key != "lag"}
            contrasts.append(Contrast(**declared_fields, lag=0 if "lag" in entry else None))
        except ValueError as error:
            raise ValueError(f"--family {path}: {error}") from None
    if not contrasts:
        raise ValueError(f"--family {path} declares no contrast")
    family = Family(
        str(declared["title"]),
        str(declared["declared"]),
        tuple(contrasts),
        tuple(str(arm) for arm in declared.get("dense_arms") or ()),
        measure,
    )
    if family.compares_models and not family.dense_arms:
        raise ValueError(
            f"--family {path} compares the MoE rung with the dense control: it must name dense_arms, the "
            "arms the dense control runs"
        )
    return family
