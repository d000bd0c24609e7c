"""`python -m analysis.cold_starts SFT_RUN_DIR... --out DIR`: what each cold start cost and reached.

Reads every finished cold start (`python -m experiments.sft`: a run directory whose `summary.json` names an `sft-`
run) under the given directories, and writes into --out `report.md` (one row per cold start: the model's shape,
its parameters, the task, the router switches it trained with, the steps (pretraining + task), wall and CPU time,
the held-out greedy accuracy it stopped at and what stopped it, and how it routes its held-out demonstrations:
expert-load entropy over log E, max load / mean load, the median scale-free top-k margin; `–` for cold starts from
before these were measured) and `cold_starts.png` (held-out greedy accuracy and loss against SFT step, one line per
cold start). When a checkpoint was written more than once, the newest run counts. Exit code 2 and one `error:` line
on bad input.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from safetensors import safe_open

from analysis.cli import Command, writable_out
from analysis.plotting import in_style, new_figure, save_png
from analysis.statistics import accuracy_interval
from analysis.style import TEXT_WIDTH_IN, shade
from experiments.step import metrics as m
from experiments.step.metrics import TOPK_MARGIN_MEDIAN


def find_cold_starts(paths: Sequence[str | Path]) -> list[Path]:
    """Run directories of finished cold starts under `paths`: per checkpoint directory, the newest run that wrote it."""
    newest: dict[str, Path] = {}
    for root in map(Path, paths):
        if not root.is_dir():
            raise FileNotFoundError(f"{root} is not a directory")
        for summary in sorted(root.rglob("summary.json"), key=lambda p: p.stat().st_mtime):
            data = json.loads(summary.read_text(encoding="utf-8"))
            if str(data.get("run", "")).startswith("sft-") and data.get("status") == "finished":
                newest[data["checkpoint"]] = summary.parent
    if not newest:
        raise ValueError(f"no finished cold start (summary.json of an sft- run) under {', '.join(map(str, paths))}")
    return list(newest.values())


def describe(run_dir: Path) -> dict[str, Any]:
    """One cold start: its summary, the shape of its model (from the checkpoint's config) and its curve."""
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    checkpoint = Path(summary["checkpoint"])
    shape = json.loads((checkpoint / "config.json").read_text()) if (checkpoint / "config.json").is_file() else {}
    params = parameter_count(checkpoint) if checkpoint.is_dir() else None
    curve = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    task = cfg.dataset.name + "".join(f" {k}={cfg.dataset[k]}" for k in ("digits", "length") if k in cfg.dataset)
    return {
        "model": cfg.model.name,
        "task": task,
        "layers": shape.get("num_hidden_layers"),
        "experts": shape.get("num_experts", shape.get("num_local_experts")),
        "top_k": shape.get("num_experts_per_tok"),
        "hidden": shape.get("hidden_size"),
        "params": params,
        "summary": summary,
        "batch": cfg.sft.batch_size,
        "lr": cfg.sft.lr,
        "curve": curve,
        "eval_prompts": cfg.sft.eval_prompts,
    }


def parameter_count(checkpoint: Path) -> int:
    """Parameters in the checkpoint's safetensors files, read from their headers (no tensor is loaded)."""
    total = 0
    for file in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(file, framework="pt") as weights:
            total += sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())
    return total


@in_style
def figure(rows: list[dict[str, Any]], out: Path, dpi: int = 150) -> Path:
    """`cold_starts.png`: held-out greedy accuracy and training loss against SFT step, a line per cold start."""
    fig = new_figure(TEXT_WIDTH_IN, 2.4)
    accuracy, loss = fig.subplots(1, 2)
    ranks: dict[str, int] = {}
    for row in rows:
        family = row["model"].split("_")[0]  # a hue per model family, a shade per member
        ranks[family] = ranks.get(family, -1) + 1
        color = shade({"qwen30b": "#1f5fb4", "granite1b": "#2ca02c"}.get(family, "#d62728"), ranks[family])
        evaluated = [r for r in row["curve"] if m.EVAL_GREEDY in r]
        label = f"{row['model']}, {row['task']}"
        accuracy.plot(
            [r[m.STEP] for r in evaluated],
            [r[m.EVAL_GREEDY] for r in evaluated],
            color=color,
            marker="o",
            ms=2,
            label=label,
        )
        loss.plot([r[m.STEP] for r in row["curve"]], [r[m.SFT_LOSS] for r in row["curve"]], color=color, lw=0.7)
    accuracy.set(xlabel="SFT step", ylabel="held-out greedy accuracy", title="held-out accuracy")
    loss.set(xlabel="SFT step", ylabel="loss (demonstration tokens)", yscale="log", title="training loss")
    accuracy.legend(fontsize=5)
    path = out / "cold_starts.png"
    return save_png(fig, path, dpi)


def report(rows: list[dict[str, Any]], out: Path, command: str) -> Path:
    """report.md: a row per cold start, what it cost and reached and how it routes."""
    lines = [
        "# Cold starts",
        "",
        f"Made with `{command}`.",
        "",
        "![cold starts](cold_starts.png)",
        "",
        "| model | task | MoE layers | experts / top-k | hidden | parameters | routers | batch, lr | steps | "
        "wall | CPU | held-out greedy [95% CI] | stopped by | load entropy | max / mean load | top-k margin | "
        "weights sha256 | CPU kernels |",
        "|" + "---|" * 18,
    ]
    for row in rows:
        s = row["summary"]
        experts = f"{row['experts']} / {row['top_k']}" if row["experts"] else "dense"
        params = f"{row['params'] / 1e6:.1f} M" if row["params"] else "–"
        cpu = f"{s['cpu_s'] / 60:.1f} min" if s.get("cpu_s") else "–"
        steps = f"{s['pretrain_steps']} + {s['steps'] - s['pretrain_steps']}" if s.get("pretrain_steps") else s["steps"]
        routing = s.get("routing") or {}
        low, high = accuracy_interval(s["eval_greedy_accuracy"], row["eval_prompts"])
        accuracy = f"{s['eval_greedy_accuracy']:.1%} [{low:.1%}, {high:.1%}]"
        profile = [
            f"{routing[key]:{form}}" if key in routing else "–"
            for key, form in (("load_entropy", ".3f"), ("load_max_over_mean", ".2f"), (TOPK_MARGIN_MEDIAN, ".4f"))
        ]
        lines.append(
            f"| {row['model']} | {row['task']} | {row['layers']} | {experts} | {row['hidden']} | {params} | "
            f"{', '.join(s.get('routers') or []) or '–'} | {row['batch']}, {row['lr']:g} | {steps} | "
            f"{s['wall_s'] / 60:.1f} min | {cpu} | {accuracy} | "
            f"{s.get('stopped_by', '–')} | {' | '.join(profile)} | {_start(s)} |"
        )
    lines += [
        "",
        "Wall time depends on what else shared the cores; CPU time is what the cold start cost. Every cold "
        "start runs on one thread (`sft.threads=1`) with the portable CPU kernels (`cpu_kernels=portable`: "
        "ATen's AVX2 kernels, MKL's COMPATIBLE branch; models/cpu_kernels.py), so its checkpoint is the same "
        "bits on any x86-64 machine with AVX2 and the same torch build, however many cores it has or how busy "
        "they are: the weights' sha256 (its first 12 digits here) is what a run's `start_sha256` names. The "
        "accuracy's interval is Wilson's over the SFT's held-out prompts (`sft.eval_prompts`): how far another "
        "draw of as many prompts could move it.",
    ]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _start(summary: dict[str, Any]) -> str:
    """The weights' sha256 (12 digits) and the CPU kernels that computed them (mode, ATen's capability, MKL's
    branch): two cells; a cold start made before they were recorded says so."""
    if "weights_sha256" not in summary:
        return "– | not recorded"
    kernels = summary["kernels"]
    return (
        f"`{summary['weights_sha256'][:12]}` | {kernels['mode']} ({kernels['aten_capability']}, "
        f"MKL {kernels['mkl_branch']})"
    )


def arguments(parser: argparse.ArgumentParser) -> None:
    """The cold starts' run directories and where the table goes."""
    parser.add_argument(
        "paths", nargs="+", metavar="SFT_RUN_DIR", help="cold-start run directories, searched recursively"
    )
    parser.add_argument("--out", type=Path, required=True, help="output folder")


def read(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every finished cold start described (`describe`), in table order; the output folder proved writable."""
    rows = [describe(run_dir) for run_dir in find_cold_starts(args.paths)]
    writable_out(args.out)
    return sorted(rows, key=lambda r: (r["task"], r["experts"] or 0, r["layers"] or 0, r["model"]))


def write(rows: list[dict[str, Any]], args: argparse.Namespace, command: str) -> str:
    """The figure and the table; the line saying where."""
    figure(rows, args.out)
    return f"report: {report(rows, args.out, command)}"


main = Command("analysis.cold_starts", __doc__, arguments, read, write).main

if __name__ == "__main__":
    main()
