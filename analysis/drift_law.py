"""`python -m analysis.drift_law PROBE_DIR... --out DIR`: the drift scaling law from drift probes.

Reads the `summary.json` of every probe run (`python -m experiments.probe`) under the given directories: one row per
(cold start, learning rate) with the model's shape (MoE layers L, experts E, top-k k, hidden width), the task and its
answer length, and what the probe measured there (drift after one update, its per-layer profile, the routing
share of Var(log π_θ/π_old), router margins, fragility, ratio variance); one row per (cold start, engine precision)
with the routing disagreement of that engine with the fp32 trainer. Fits the law to the rows and extrapolates it to
the GSPO paper's model (analysis/drift_fit.py says how).

Writes `drift_law.csv` (the rows), `precision.csv`, `fit.json`, `drift_law.png` (and, with the margin fitted,
`drift_margin.png`) and `report.md` into --out; exit code 2 and one `error:` line on bad input (no probe found, an
empty fit).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf

from algos.objective import CLIP, SEQ_RATIO_VAR, TOKEN_RATIO_VAR
from analysis.cli import Command, writable_out
from analysis.drift_figures import figure, margin_figure
from analysis.drift_fit import (
    PAPER_DRIFT,
    PAPER_MARGIN,
    PAPER_SHAPE,
    REGRESSORS,
    TARGET_DRIFT,
    Fit,
    fit_law,
    fit_record,
    held_at_median,
    knob_effects,
    knob_range,
    lr_for_paper_drift,
    margin_for_drift,
    paper_point,
)
from analysis.records import rows_as_dicts
from analysis.tables import num
from experiments.step import metrics as m
from models.policy import SIGMOID_FAMILIES
from models.routing.measures import MARGIN_ANCHORS

ROW_METRICS = {
    "drift": m.DRIFT_PER_UPDATE,
    "token_any_change": m.TOKEN_DRIFT_PER_UPDATE,
    "routing_share": m.ROUTING_SHARE,
    "margin": m.MARGIN,
    "logit_margin": m.LOGIT_MARGIN,
    "fragile": m.FRAGILE,
    "token_ratio_var": TOKEN_RATIO_VAR,
    "seq_ratio_var": SEQ_RATIO_VAR,
    "clip": CLIP,
    "response_length": m.LENGTH,
    "reward": m.REWARD,
}


def find_probes(paths: Sequence[str | Path]) -> list[Path]:
    """Every probe run directory under `paths` (a `summary.json` with probe settings), in path order."""
    found = []
    for root in map(Path, paths):
        if not root.is_dir():
            raise FileNotFoundError(f"{root} is not a directory")
        for summary in sorted(root.rglob("summary.json")):
            data = json.loads(summary.read_text(encoding="utf-8"))
            if "settings" in data and data.get("status") == "finished":
                found.append(summary.parent)
    if not found:
        raise ValueError(f"no finished probe (summary.json with settings) under {', '.join(map(str, paths))}")
    return found


def load_probes(paths: Sequence[str | Path]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(drift rows, precision rows) of every probe under `paths`."""
    rows, precision = [], []
    for run_dir in find_probes(paths):
        summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
        policy, dataset = summary["policy"], summary["dataset"]
        cold_start = summary.get("cold_start") or {}
        shape = {
            "probe": str(run_dir),
            "model": summary["model"],
            "task": dataset["name"] + "".join(f" {k}={v}" for k, v in dataset.items() if k in ("digits", "length")),
            "layers": policy["num_moe_layers"],
            "experts": policy["num_experts"],
            "top_k": policy["num_experts_per_tok"],
            "hidden": hidden_width(run_dir),
            "start_accuracy": cold_start.get("eval_greedy_accuracy"),
            "answer_tokens": summary.get("answer_tokens"),
            "start_margin": (cold_start.get("routing") or {}).get(m.TOPK_MARGIN_MEDIAN),
            "sigmoid_family": float(policy["model_type"] in SIGMOID_FAMILIES) if "model_type" in policy else None,
        }
        shape["experts_per_slot"] = shape["experts"] / shape["top_k"]
        for setting in summary["settings"]:
            if "diverged" in setting:  # no drift to fit: the update broke the model (listed in the report)
                rows.append({**shape, "lr": setting["lr"], "diverged": setting["diverged"]})
                continue
            row = {**shape, "lr": setting["lr"], **{name: setting.get(key) for name, key in ROW_METRICS.items()}}
            row["drift_per_layer"] = setting.get("drift_per_layer")
            rows.append(row)
        for entry in summary.get("precision_mismatch", []):
            precision.append(
                {
                    **shape,
                    "precision": entry["precision"],
                    "expert_mismatch": entry[m.ENGINE_EXPERTS],
                    "token_any_mismatch": entry[m.ENGINE_TOKENS],
                    "kl_k3": entry[m.MISMATCH_K3],
                }
            )
    return pd.DataFrame(rows), pd.DataFrame(precision)


def hidden_width(run_dir: Path) -> int | None:
    """The hidden width of the probed model, from the config the probe composed (`.hydra/config.yaml`)."""
    config = run_dir / ".hydra" / "config.yaml"
    if not config.is_file():
        return None
    cfg = OmegaConf.load(config)
    path = cfg.model.get("path")
    if path and (Path(path) / "config.json").is_file():
        return json.loads((Path(path) / "config.json").read_text())["hidden_size"]
    return cfg.model.get("hidden_size")


def report(rows: pd.DataFrame, precision: pd.DataFrame, fit: Fit, out: Path, command: str, figure_path: Path) -> Path:
    """report.md: the probed settings, the fit, which knob moves drift most, the law at the paper's routing, the margin
    a start would need (with the margin fitted) and the engines' disagreement with the trainer."""
    lines = [
        "# Routing drift: the scaling law",
        "",
        f"Made with `{command}`.",
        "",
        f"![drift law]({figure_path.name})",
        "",
        "## Probed settings",
        "",
        "| probe | model | task | L | E / k | start margin | lr | answer tokens | drift after one update | tokens "
        "with a change | routing share | logit margin | token-ratio var | sequence-ratio var |",
        "|" + "---|" * 14,
    ]
    for r in rows.sort_values(["task", "experts_per_slot", "layers", "model", "probe", "lr"]).to_dict("records"):
        shape = (
            f"| {Path(r['probe']).name} | {r['model']} | {r['task']} | {r['layers']} | "
            f"{r['experts']}/{r['top_k']} | {num(r.get('start_margin'))} | {r['lr']:.0e} | "
        )
        if isinstance(r.get("diverged"), str):
            lines.append(shape + f"{r['answer_tokens']:.1f} | diverged: {r['diverged']} | | | | | |")
            continue
        lines.append(
            shape + f"{r['answer_tokens']:.1f} | {num(r['drift'], '.2%')} | "
            f"{num(r['token_any_change'], '.2%')} | {num(r['routing_share'], '.2%')} | "
            f"{r['logit_margin']:.3f} | {num(r['token_ratio_var'])} | {num(r['seq_ratio_var'])} |"
        )
    lines += [
        "",
        "## The fit",
        "",
        f"log drift = c + Σ a_x log x (an indicator enters as itself) over "
        f"{', '.join(fit.regressors)}; n = {fit.n} rows, "
        f"R² = {fit.r2:.3f}, residual std of log drift {fit.residual_std:.2f} (a factor of "
        f"{math.exp(fit.residual_std):.2f}).",
        "",
        "| term | exponent | std. error |",
        "|---|---|---|",
    ]
    lines.append(f"| c | {fit.coef[0]:.3f} | {fit.stderr[0]:.3f} |")
    for name, coef, se in zip(fit.regressors, fit.coef[1:], fit.stderr[1:]):
        lines.append(f"| {REGRESSORS[name][1]} | {coef:.3f} | {se:.3f} |")
    lines += [
        "",
        "## Which knob moves drift most",
        "",
        "The factor by which the fitted law moves drift from a knob's "
        "smallest to its largest probed value, the others held; largest first.",
        "",
        "| knob | probed | drift moves by |",
        "|---|---|---|",
    ]
    for name, low, high, factor in knob_effects(fit, rows):
        lines.append(f"| {REGRESSORS[name][1]} | {low:.3g} to {high:.3g} | ×{factor:.2f} |")
    medians = held_at_median(rows, own_width=False)
    held = (
        f"answer length T = {medians['length']:.3g} tokens and width H = {medians['hidden']:.3g}, the fitted rows' "
        "medians"
    )
    anchored = (
        f" for a softmax router at the softmax anchor's margin m = {PAPER_MARGIN}" if "margin" in fit.regressors else ""
    )
    unfitted = [REGRESSORS[name][1] for name in ("layers", "experts_per_slot") if name not in fit.regressors]
    shape = "" if unfitted else " at the paper's depth and experts per slot"
    shape_note = (
        ""
        if not unfitted
        else f" The fit has no term for {' or '.join(unfitted)} (every probed row has the same), so the "
        "paper's routing does not enter it: the lines below are the probed models' law at these settings, "
        "not Qwen3-30B-A3B's."
    )
    lines += [
        "",
        "## At Qwen3-30B-A3B's routing (48 layers, 128 experts, top-8)",
        "",
        f"The law{shape}{anchored}, with {held} (the paper's own answers and "
        f"width lie far outside the probed ranges: an extrapolation, not a measurement).{shape_note}",
        "",
    ]
    for lr in sorted(rows["lr"].unique()):
        lines.append(
            f"- lr {lr:.0e}: the law gives {num(fit.predict(paper_point(fit, rows, lr)), '.2%')} "
            f"(paper: ~{PAPER_DRIFT:.0%})."
        )
    needed = lr_for_paper_drift(fit, rows)
    if needed is not None:
        lines.append(f"- the paper's ~{PAPER_DRIFT:.0%} needs lr ≈ {needed:.1e} there.")
    if "hidden" in fit.regressors and (wide := lr_for_paper_drift(fit, rows, own_width=True)) is not None:
        lines.append(
            f"- with Qwen3-30B-A3B's own width H = {PAPER_SHAPE['hidden']} (the H term carried "
            f"{PAPER_SHAPE['hidden'] / medians['hidden']:.0f}x beyond the median), it needs lr ≈ {wide:.1e}."
        )
    if "margin" in fit.regressors:
        lines += [
            "",
            f"## The margin a start of this ladder would need for {TARGET_DRIFT:.0%} drift per update",
            "",
            f"![drift against margin]({margin_figure(rows, fit, out).name})",
            "",
            "At the fitted rows' median shape, softmax family, solved from the margin's exponent "
            f"({fit.exponent('margin'):.2f} ± {fit.stderr[1 + fit.regressors.index('margin')]:.2f}); the probed "
            f"starts' margins run {knob_range(rows, 'start_margin')}, the anchors' are "
            + ", ".join(f"{name} {value}" for name, value in MARGIN_ANCHORS.items())
            + ".",
            "",
        ]
        for lr in sorted(rows["lr"].unique()):
            needed_margin = margin_for_drift(fit, rows, lr)
            lines.append(
                f"- lr {lr:.0e}: "
                + (
                    "no margin: the law's drift does not fall with the margin"
                    if needed_margin is None
                    else f"m ≈ {needed_margin:.2g}"
                )
            )
    if not precision.empty:
        lines += [
            "",
            "## Engine precision against the fp32 trainer, at the cold start's weights",
            "",
            "| model | task | precision | experts that differ | tokens with a difference | k3 |",
            "|---|---|---|---|---|---|",
        ]
        for engine in rows_as_dicts(precision):
            lines.append(
                f"| {engine['model']} | {engine['task']} | {engine['precision']} | "
                f"{num(engine['expert_mismatch'], '.2%')} | {num(engine['token_any_mismatch'], '.2%')} | "
                f"{engine['kl_k3']:.2g} |"
            )
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def arguments(parser: argparse.ArgumentParser) -> None:
    """The probes' directories and where the law goes."""
    parser.add_argument(
        "paths", nargs="+", metavar="PROBE_DIR", help="probe run or sweep directories, searched recursively"
    )
    parser.add_argument("--out", type=Path, required=True, help="output folder")


def read(args: argparse.Namespace) -> tuple[pd.DataFrame, pd.DataFrame, Fit]:
    """The probes' rows and the law fitted to them; the output folder proved writable."""
    rows, precision = load_probes(args.paths)
    fit = fit_law(rows)
    writable_out(args.out)
    return rows, precision, fit


def write(law: tuple[pd.DataFrame, pd.DataFrame, Fit], args: argparse.Namespace, command: str) -> str:
    """The rows, the fit, the figures and the report; the line saying where."""
    rows, precision, fit = law
    rows.to_csv(args.out / "drift_law.csv", index=False)
    precision.to_csv(args.out / "precision.csv", index=False)
    (args.out / "fit.json").write_text(json.dumps(fit_record(fit, rows), indent=2) + "\n")
    return f"report: {report(rows, precision, fit, args.out, command, figure(rows, fit, args.out))}"


main = Command("analysis.drift_law", __doc__, arguments, read, write).main

if __name__ == "__main__":
    main()
