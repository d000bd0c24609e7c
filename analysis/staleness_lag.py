"""`python -m analysis.staleness_lag`: k*, the lag at which a study asks its staleness questions, picked from a lag map
by the async study's rule (docs/results/async/preregistration.md, "The map, and the rule that picks the cells") on the
measure and the starts the learning study fixed (docs/results/learning/preregistration.md, "k*, by the old rule").

    python -m analysis.staleness_lag REPORT_OR_CSV --out DIR

An arm's **fall** at lag k is its measure at lag 0 minus at k on the same start (positive: it learns less behind),
averaged over the map's starts (one run each, every start weighted equally); **k\\*** is the smallest mapped k at which
MiniRL or the naive asynchronous arm (GRPO with π_old = μ_old) falls by at least 0.05, else the largest mapped lag
(the null at the largest lag is then the result). A run the stop rule scores as failed counts, as every comparison
counts it; a run that did not finish is left out, and a start that lacks a run the rule reads is refused in one line,
naming it, before anything is written. Writes `k_star.json` (k*, the measure, every arm's mean fall per lag, the
starts) and `k_star.md`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pandas as pd

from analysis.cli import Command, writable_out
from analysis.compare import per_seed_file, read_per_seed
from analysis.diagnostics import LAG
from analysis.gains import EXCLUDED
from analysis.tables import markdown_table

MEASURE = "split_gain"  # the learning study's primary measure (its pre-registration)
FALL = 0.05  # the fall, in the measure's units, that picks a lag
RULE_ARMS = ("minirl", "grpo (π_old = μ_old)")  # the arms whose fall picks k*, as the reports name them
K_STAR_JSON, K_STAR_MD = "k_star.json", "k_star.md"


def falls(table: pd.DataFrame, path: Path) -> tuple[dict[str, dict[int, float]], list[str]]:
    """Each rule arm's mean fall per mapped lag above 0, over the table's starts, and the starts (sha256). A
    ValueError names the first (arm, lag, start) the rule reads that has no counted run."""
    if LAG not in table:
        raise ValueError(f"{path} has no {LAG} column: not a lag map")
    counted = table[table["counted"] != EXCLUDED]
    lags = sorted(int(lag) for lag in set(table[LAG].astype(float)) if lag > 0)
    starts = sorted(set(table["start_sha256"]))
    if not lags:
        raise ValueError(f"{path} maps no lag above 0: a fall is from lag 0 to k")
    value: dict[tuple[str, int, str], float] = {}
    for arm, lag, start, measured in zip(
        counted["arm"], counted[LAG].astype(float), counted["start_sha256"], counted[MEASURE]
    ):
        if (arm, int(lag), start) in value:
            raise ValueError(f"{path} holds two counted runs of {arm} at {LAG} {int(lag)} on start {start[:12]}")
        value[arm, int(lag), start] = float(measured)
    mean_falls: dict[str, dict[int, float]] = {}
    for arm in RULE_ARMS:
        for lag in [0, *lags]:
            for start in starts:
                if (arm, lag, start) not in value:
                    raise ValueError(
                        f"{path} has no counted run of {arm!r} at {LAG} {lag} on start {start[:12]}: the rule reads "
                        f"{', '.join(map(repr, RULE_ARMS))} at every mapped lag on every start"
                    )
        mean_falls[arm] = {
            lag: sum(value[arm, 0, start] - value[arm, lag, start] for start in starts) / len(starts) for lag in lags
        }
    return mean_falls, starts


def k_star(mean_falls: dict[str, dict[int, float]]) -> tuple[int, bool]:
    """The smallest lag at which a rule arm falls by at least `FALL`, and True; else the largest mapped lag, False."""
    lags = sorted(next(iter(mean_falls.values())))
    fallen = [lag for lag in lags if any(by_lag[lag] >= FALL for by_lag in mean_falls.values())]
    return (fallen[0], True) if fallen else (lags[-1], False)


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("table", type=Path, metavar="REPORT_OR_CSV", help="the lag map's report folder or per-seed CSV")
    parser.add_argument("--out", type=Path, required=True, help="output folder")


def read(args: argparse.Namespace) -> dict[str, Any]:
    path = per_seed_file(args.table)
    table, _ = read_per_seed(path)
    mean_falls, starts = falls(table, path)
    chosen, fell = k_star(mean_falls)
    writable_out(args.out)
    return {"k_star": chosen, "fell": fell, "measure": MEASURE, "falls": mean_falls, "starts": starts}


def write(picked: dict[str, Any], args: argparse.Namespace, command: str) -> str:
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / K_STAR_JSON).write_text(json.dumps(picked, indent=2) + "\n", encoding="utf-8")
    lags = sorted(next(iter(picked["falls"].values())))
    rows = [[arm, *(f"{picked['falls'][arm][lag]:+.3f}" for lag in lags)] for arm in RULE_ARMS]
    verdict = (
        f"k* = {picked['k_star']}: the smallest lag at which {' or '.join(RULE_ARMS)} falls by at least {FALL:g}."
        if picked["fell"]
        else f"k* = {picked['k_star']}: no arm falls by {FALL:g} at any mapped lag; the null at the largest lag is the "
        "result."
    )
    lines = [
        "# k*, from the lag map",
        "",
        f"Made with `{command}`.",
        "",
        f"Each arm's fall of {MEASURE} from lag 0 (positive: it learns less behind), averaged over the "
        f"{len(picked['starts'])} starts ({', '.join(f'`{start[:12]}`' for start in picked['starts'])}):",
        "",
        markdown_table(["arm", *(f"k = {lag}" for lag in lags)], rows),
        "",
        verdict,
    ]
    (args.out / K_STAR_MD).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return f"k* = {picked['k_star']}: {args.out / K_STAR_MD}"


main = Command("analysis.staleness_lag", __doc__, arguments, read, write).main

if __name__ == "__main__":
    main()
