"""`python -m analysis.margins CHECKPOINT... --out DIR`: how close each checkpoint's routers sit to the top-k cut,
against the margins measured on real MoEs.

For every checkpoint directory (a cold start of `python -m experiments.sft`, or any local checkpoint of a supported
MoE family) it runs the held-out demonstrations of its task through the model once and measures, on the family's
selection scores, the scale-free margin (s[k−1] − s[k]) / (s[0] − s[2k−1]) of each token's 2k highest scores in every
MoE layer (`experiments.sft.routing_profile`): its median and mean over tokens and layers, the share of tokens below
0.01, and the expert-load entropy and max load / mean load; and what makes a margin small, the best expert's lead
(s[0] − s[1]) / (s[0] − s[2k−1]) (`models.routing.measures.top_gap_share`) and the best score, medians over tokens and
layers (the same profile). The anchor of a softmax-family checkpoint is
Qwen3.6-35B-A3B's 0.0188, of a sigmoid-family one GLM-5.2's 0.0114 (medians over tokens and layers, colibri issue
#119; `models.routing.measures.MARGIN_ANCHORS`). The verdict comes from the median's 95% interval over draws of as many
held-out sequences (`models.statistics.median_interval`): "within 2x" when the whole interval over the anchor lies in
[0.5, 2], "outside 2x" when none of it does, else "undecided" (measure more prompts). The task is the one
the cold start trained on (its `cold_start.json`), else `--dataset`. Writes `report.md` and `margins.json` into
--out. Exit code 2 and one `error:` line on bad input.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from analysis.cli import Command, writable_out
from experiments.sft import MEDIAN_INTERVAL, routing_profile
from experiments.step.metrics import TOPK_MARGIN_MEAN, TOPK_MARGIN_MEDIAN, TOPK_MARGIN_SMALL
from experiments.tasks import build_task
from models.cpu_kernels import weights_sha256
from models.policy import ModelConfig, build_policy
from models.registry import ConfigError
from models.routing.families import has_selection_bias, router_num_experts, router_top_k
from models.routing.measures import MARGIN_ANCHORS
from models.routing.trace import find_routers

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

SOFTMAX_ANCHOR, SIGMOID_ANCHOR = MARGIN_ANCHORS.items()


def measure(checkpoint: Path, dataset: str, prompts: int) -> dict[str, Any]:
    """The margin and load profile of one checkpoint on `prompts` held-out demonstrations of its task."""
    record = checkpoint / "cold_start.json"
    task_params = (json.loads(record.read_text()) if record.is_file() else {}).get("dataset", {"name": dataset})
    params = dict(task_params)
    task = build_task(params.pop("name"), **params)
    model, tokenizer = build_policy(ModelConfig(name=checkpoint.name, path=str(checkpoint)))
    routers = list(find_routers(model).values())
    if not routers:
        raise ConfigError(f"{checkpoint} is a dense model: it has no router to measure")
    sigmoid = has_selection_bias(routers[0])
    anchor_name, anchor = SIGMOID_ANCHOR if sigmoid else SOFTMAX_ANCHOR
    profile = routing_profile(model, tokenizer, task.examples("test")[:prompts])
    assert profile is not None  # None only for a dense model, refused above
    defaults = cast("DataclassInstance", task).__dataclass_fields__  # a task is a dataclass (its registry's rule)
    return {
        "checkpoint": str(checkpoint),
        "sha256": weights_sha256(model),  # the start's identity, as its cold_start.json and every RL run name it
        "family": f"{model.config.model_type} ({'sigmoid + bias' if sigmoid else 'softmax'})",
        "layers": len(routers),
        "experts": int(router_num_experts(routers[0])),
        "top_k": int(router_top_k(routers[0])),
        "task": " ".join(
            [task.name, *(f"{key}={value}" for key, value in params.items() if value != defaults[key].default)]
        ),
        "prompts": min(prompts, len(task.examples("test"))),
        "anchor": anchor_name,
        "anchor_margin": anchor,
        "median_over_anchor": profile[TOPK_MARGIN_MEDIAN] / anchor,
        "median_over_anchor_interval": [bound / anchor for bound in profile[MEDIAN_INTERVAL]],
        **profile,
    }


def within_two_fold(interval: Sequence[float]) -> str:
    """The verdict on a median / anchor interval: within 2x, outside 2x, or undecided when it straddles a bound."""
    low, high = interval
    if 0.5 <= low and high <= 2:
        return "within 2x"
    if high < 0.5 or low > 2:
        return "outside 2x"
    return "undecided"


def report(rows: list[dict[str, Any]], out: Path, command: str) -> Path:
    """report.md (a row per checkpoint against its family's anchor) and margins.json (the rows)."""
    (softmax_name, softmax), (sigmoid_name, sigmoid) = SOFTMAX_ANCHOR, SIGMOID_ANCHOR
    lines = [
        "# Top-k margins against real routers",
        "",
        f"Made with `{command}`.",
        "",
        f"The scale-free margin (s[k−1] − s[k]) / (s[0] − s[2k−1]) of each token's 2k highest selection scores "
        f"(softmax probabilities; sigmoid + bias), over tokens and layers of the held-out demonstrations. "
        f"Anchors (colibri issue #119, medians over tokens and layers): {softmax_name} {softmax}, {sigmoid_name} "
        f"{sigmoid}. Brackets: the 95% interval over draws of as many held-out sequences (a bootstrap that "
        "resamples whole sequences; models.statistics.median_interval). Within 2x of its family's anchor when the "
        "whole interval of median / anchor lies in [0.5, 2], outside when none of it does, else undecided. Best "
        "expert's lead: (s[0] − s[1]) / (s[0] − s[2k−1]), the share of the margin's denominator the best expert's "
        "lead takes (median): near 1, every gap below it is a small fraction of the spread. Gate mass, best / "
        "last: the share of a token's gate weights (renormalised over its chosen experts) on its best and on its "
        "last chosen expert (medians): what an expert change at the cut can move of what the token computes. A "
        "best share near 1 and a last near 0 make a router one-hot in all but name: its changed experts, counted "
        "as the GSPO paper counts them, change almost nothing a token computes (the RL runs' `routing/gate_tv` "
        "measures it).",
        "",
        "| checkpoint | sha256 | family | MoE layers | experts / top-k | task (prompts) | margin median [95% CI] "
        "| mean | share < 0.01 | median / anchor [95% CI] | best expert's lead | best score "
        "| gate mass, best / last | load entropy | max / mean load |",
        "|" + "---|" * 15,
    ]
    for row in rows:
        (low, high), (over_low, over_high) = row[MEDIAN_INTERVAL], row["median_over_anchor_interval"]
        lines.append(
            f"| {Path(row['checkpoint']).name} | `{row['sha256'][:12]}` | {row['family']} | "
            f"{row['layers']} | {row['experts']} / {row['top_k']} | {row['task']} ({row['prompts']}) | "
            f"{row[TOPK_MARGIN_MEDIAN]:.4f} "
            f"[{low:.4f}, {high:.4f}] | {row[TOPK_MARGIN_MEAN]:.4f} | {row[TOPK_MARGIN_SMALL]:.1%} | "
            f"{row['median_over_anchor']:.2f} [{over_low:.2f}, {over_high:.2f}] "
            f"({within_two_fold(row['median_over_anchor_interval'])}) | {row['top_gap_share_median']:.2f} | "
            f"{row['top_score_median']:.3f} | {row['gate_share_best_median']:.4f} / "
            f"{row['gate_share_last_median']:.2g} | {row['load_entropy']:.3f} | "
            f"{row['load_max_over_mean']:.2f} |"
        )
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    (out / "margins.json").write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    return path


def arguments(parser: argparse.ArgumentParser) -> None:
    """The checkpoints, where the table goes, the task of a checkpoint that names none, how many prompts."""
    parser.add_argument("checkpoints", nargs="+", type=Path, metavar="CHECKPOINT", help="local checkpoint directories")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--dataset", default="addition", help="the task of a checkpoint without a cold_start.json")
    parser.add_argument("--prompts", type=int, default=256, help="held-out demonstrations measured per checkpoint")


def read(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every checkpoint measured (`measure`), once the prompts are a count and before the output folder is made."""
    if args.prompts < 1:
        raise ConfigError(f"--prompts={args.prompts} must be >= 1")
    rows = [measure(checkpoint, args.dataset, args.prompts) for checkpoint in args.checkpoints]
    writable_out(args.out)
    return rows


def write(rows: list[dict[str, Any]], args: argparse.Namespace, command: str) -> str:
    """The table and margins.json; the line saying where."""
    return f"report: {report(rows, args.out, command)}"


main = Command("analysis.margins", __doc__, arguments, read, write).main

if __name__ == "__main__":
    main()
