"""`python -m benchmarks.rl_step`: our RL step on a benchmark workload, against TRL, older commits and the machine's
limit.

    python -m benchmarks.rl_step                        # grpo, gspo, grpo+r2: step time, breakdown, roofline
    python -m benchmarks.rl_step --vs-trl               # + TRL's GRPOTrainer stepped alternately (bench extra)
    python -m benchmarks.rl_step --workload deep --variants grpo --vs-trl --baseline main --threads 1
                                                        # bench-deep: + the same loop at another commit
    python -m benchmarks.rl_step --overheads --scaling  # + overhead ratios and the scaling table
    python -m benchmarks.rl_step --profile              # + where grpo's step time goes inside the model
    python -m benchmarks.rl_step --compare algo=gspo "" # only: gspo / grpo, stepped alternately
    python -m benchmarks.rl_step --all --json-out bench.json

The workload (`--workload`, `benchmarks.workload`) is bench-tiny, the TRL peer benchmark's step, or bench-deep, the
deep_long cell's. Every configuration runs in its own worker process (`benchmarks.worker`) and all workers of a
section take their steps round robin (A B C, then C B A, ...), so that the load of a shared machine hits every
configuration alike and ratios of neighbouring steps stay meaningful when absolute times do not. Each worker takes
`--warmup` steps that are not timed, then `--steps` timed ones; tables give medians over the timed steps.

Sections:
  main         grpo, gspo and grpo+r2 (workload in `benchmarks.workload`): median step seconds (min-max), the
               trainer's breakdown into rollout / old-policy scoring / training, completion tokens per second,
               peak RSS, model GFLOP per step (`benchmarks.roofline`) and the share of the machine's fp32 matmul
               rate that the step achieves: against the rate measured in each round, between the steps (what the
               step shared the machine with), and against the best rate measured in the run (the machine's limit).
  --vs-trl     TRL's GRPOTrainer (`benchmarks.trl_worker`) on the same work next to each variant (grpo+r2 next to
               TRL's grpo: TRL has no replay): ours / TRL per round, median and min-max.
  --baseline   the same loops at another commit of this clone (`git archive` of it, its own worker run from there),
               next to each variant: ours / ours at that commit per round, median and min-max. What a change bought,
               measured side by side rather than against a number from another day.
  --overheads  ratios of grpo variants stepped alternately: routing metrics on / off, r2 / none (both recomputing
               θ_old), π_old recomputed / μ_old reused, each engine precision, weight quantization and router
               noise against the trainer's own engine, the ratio decomposition, the routing variants (full and
               soft replay against ID replay, router shift against no replay), W&B offline / disabled, packed
               groups / rows.
  --scaling    step time against group size, completion length and number of experts; per-token cost relative
               to the workload shows where cost is not linear in tokens.
  --compare    two sets of Hydra overrides A and B on top of grpo on the workload (your objective, another expert
               backend, ...), stepped alternately: A / B per round for the step, the rollout and scoring +
               training. The same set twice shows how far the machine's noise alone moves the ratio. Given
               alone (no --variants, --vs-trl or --all), it is the only section.
  --profile    grpo's step with module timers (`benchmarks.module_time`): self time of the experts, router,
               attention, norms, LM head, embeddings and the rest of the model's forwards, of backward, gradient
               clipping and the optimizer step, and everything else, in the rollout and in scoring + training.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from analysis.report import markdown_table
from benchmarks.module_time import PARTS
from benchmarks.roofline import ModelShape, matmul_gflops, matmul_peak, rl_step_flops
from benchmarks.worker import Worker
from benchmarks.workload import VARIANTS, WORKLOADS, compose_workload
from experiments.config import PROJECT_ROOT
from models.policy import ModelConfig, config_in_code
from models.registry import node_settings
from models.tokenizer import build_char_tokenizer

TRL_ALGO = {"grpo": "grpo", "gspo": "gspo", "grpo+r2": "grpo"}

OVERHEADS = {
    # name: (overrides with the feature, overrides without it); [] is the workload's own setting
    "routing metrics on / off": ([], ["routing.metrics=false"]),
    # r2's definition needs the recompute pass (it records θ_old's routing there): compare it with a recomputing
    # `none` for the cost of replay itself; the next line is what the recompute pass costs.
    "r2 replay / none, both recomputing θ_old": (["routing.replay=r2"], ["trainer.pi_old=decoupled"]),
    "π_old recomputed (decoupled) / μ_old reused (bypass)": (["trainer.pi_old=decoupled"], []),
    # An engine with its own numbers needs π_old recomputed: compare with the trainer's own engine, decoupled too,
    # for the cost of the engine alone (its copy's kernels, the weight sync, the quantization).
    "engine bf16 / the trainer's fp32, both decoupled": (["rollout.precision=bf16"], ["trainer.pi_old=decoupled"]),
    "engine fp16 / the trainer's fp32, both decoupled": (["rollout.precision=fp16"], ["trainer.pi_old=decoupled"]),
    "engine int8 weights / the trainer's, both decoupled": (
        ["rollout.weight_quant=int8"],
        ["trainer.pi_old=decoupled"],
    ),
    "engine fp8 weights / the trainer's, both decoupled": (["rollout.weight_quant=fp8"], ["trainer.pi_old=decoupled"]),
    "engine router noise / the trainer's, both decoupled": (["rollout.router_noise=0.1"], ["trainer.pi_old=decoupled"]),
    "ratio decomposition every step / never": (["routing.decompose_every=1"], []),
    # Routing variants (algos/routing_variants), each against what it changes: full replay also replays the first
    # minibatch (one more π_old pass); router shift recomputes θ_old's routing, as `none` does here.
    "full replay / ID replay (r2)": (["routing.replay=r2", "routing_variant=full_replay"], ["routing.replay=r2"]),
    "soft replay / ID replay (r2)": (["routing.replay=r2", "routing_variant=soft_replay"], ["routing.replay=r2"]),
    "router shift / none, both recomputing θ_old": (["routing_variant=router_shift"], ["trainer.pi_old=decoupled"]),
    "W&B offline / disabled": (["logger.wandb.mode=offline"], []),
    "packed groups / rows fed in full": ([], ["trainer.minibatch_layout=rows"]),
}

SCALING = {
    "the workload": [],
    "group size 4": ["trainer.group_size=4"],
    "group size 16": ["trainer.group_size=16"],
    "completion length 8": ["trainer.max_new_tokens=8"],
    "completion length 32": ["trainer.max_new_tokens=32"],
    "experts 8": ["model.num_experts=8"],
    "experts 32": ["model.num_experts=32"],
}

# A step and the parts of the trainer's breakdown that the A / B and profile tables show, as sums of a worker's
# per-step fields.
PHASES = {"step": ["seconds"], "rollout": ["rollout_s"], "scoring + training": ["score_s", "train_s"]}


@dataclass(frozen=True)
class Spec:
    """One worker of a section: its module, overrides on top of the workload, extra arguments, and the checkout of
    another commit it runs from (None: this one)."""

    module: str
    overrides: list[str]
    extra: list[str] = field(default_factory=list)
    checkout: Path | None = None


@dataclass
class Series:
    """The timed step reports of one worker."""

    label: str
    overrides: list[str]
    info: dict[str, Any] = field(default_factory=dict)
    steps: list[dict[str, Any]] = field(default_factory=list)

    def median(self, key: str) -> float:
        return statistics.median(step[key] for step in self.steps)

    @property
    def seconds(self) -> list[float]:
        return [step["seconds"] for step in self.steps]

    @property
    def tokens_per_s(self) -> float:
        return statistics.median(step["tokens"] / step["seconds"] for step in self.steps)

    @property
    def peak_rss_mib(self) -> float:
        return max(step["rss_mib"] for step in self.steps)


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    model = platform.processor() or "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    import transformers

    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "load_1min": os.getloadavg()[0],
    }


def export_revision(revision: str, into: Path) -> Path:
    """This clone's tree at `revision` (a commit, branch or tag), written to `into` by `git archive`: a worker started
    there imports that commit's code."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(PROJECT_ROOT), "archive", revision], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def start_worker(label: str, spec: Spec, args: argparse.Namespace, log_path: Path) -> Worker:
    """The worker of `spec` on the run's workload, threads and extra overrides."""
    overrides = [*args.override, *spec.overrides]
    workload = ["--workload", args.workload]
    if spec.checkout is not None:
        # An older commit's worker may know bench-tiny only: it gets the whole workload as overrides, which compose
        # the same run on top of its bench-tiny (later overrides win).
        overrides, workload = [*WORKLOADS[args.workload], *overrides], []
    worker_args = ["--overrides", json.dumps(overrides), "--threads", str(args.threads), *workload, *spec.extra]
    return Worker(label, spec.module, worker_args, log_path, cwd=spec.checkout)


def run_round_robin(
    specs: dict[str, Spec], args: argparse.Namespace, log_dir: Path, peak_size: int
) -> tuple[dict[str, Series], list[float]]:
    """Start one worker per spec (label -> `Spec`), step them round robin; return every worker's timed steps and the
    matmul GFLOP/s measured after each timed round."""
    series = {label: Series(label, spec.overrides) for label, spec in specs.items()}
    workers: dict[str, Worker] = {}
    peaks: list[float] = []
    try:
        for index, (label, spec) in enumerate(specs.items()):
            workers[label] = start_worker(label, spec, args, log_dir / f"{index:02d}_{spec.module}.log")
            series[label].info = workers[label].info
        order = list(specs)
        for round_index in range(args.warmup + args.steps):
            for label in order if round_index % 2 == 0 else order[::-1]:
                report = workers[label].step()
                if round_index >= args.warmup:
                    series[label].steps.append(report)
            if round_index >= args.warmup:
                peaks.append(matmul_gflops(peak_size, seconds=0.2, trials=2))
            print(
                f"  round {round_index + 1}/{args.warmup + args.steps} done (load {os.getloadavg()[0]:.1f})",
                file=sys.stderr,
                flush=True,
            )
    finally:
        for worker in workers.values():
            worker.close()
    return series, peaks


def spread(values: list[float]) -> str:
    """Median (min-max) of a list of seconds or ratios."""
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def step_flops(overrides: list[str], workload: str, prompt_width: int) -> dict[str, float]:
    """Model FLOPs of one RL step of `workload` with `overrides` (see `benchmarks.roofline`)."""
    cfg = compose_workload(overrides, workload)
    model_cfg = ModelConfig(**node_settings(cfg.model))
    if model_cfg.path is not None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_cfg.path, local_files_only=True)
    else:
        config = config_in_code(model_cfg, build_char_tokenizer())
    t = cfg.trainer
    return rl_step_flops(
        ModelShape.from_config(config), t.prompts_per_step * t.group_size, prompt_width, t.max_new_tokens
    )


def baseline_label(variant: str, args: argparse.Namespace) -> str:
    return f"ours {variant} at {args.baseline}"


def paired_ratios(title: str, pairs: dict[str, tuple[Series, Series]]) -> dict[str, list[float]]:
    """Print numerator / denominator of each pair (name -> (numerator, denominator)) per round, median and min-max;
    return the ratios by name."""
    rows, ratios = [], {}
    for name, (top, bottom) in pairs.items():
        ratios[name] = [a / b for a, b in zip(top.seconds, bottom.seconds)]
        rows.append(
            [
                name,
                f"{statistics.median(top.seconds):.3f}",
                f"{statistics.median(bottom.seconds):.3f}",
                spread(ratios[name]),
                " ".join(f"{r:.2f}" for r in ratios[name]),
            ]
        )
    print(f"\n## {title}\n")
    print(markdown_table(["pair", "numerator s", "denominator s", "ratio median (min-max)", "ratio per round"], rows))
    return ratios


def main_section(
    args: argparse.Namespace, log_dir: Path, peak_size: int, results: dict[str, Any], baseline: Path | None
) -> None:
    if not args.variants:
        return
    specs: dict[str, Spec] = {}
    for variant in args.variants:
        specs[f"ours {variant}"] = Spec("benchmarks.lab_worker", VARIANTS[variant])
        if baseline is not None:
            specs[baseline_label(variant, args)] = Spec("benchmarks.lab_worker", VARIANTS[variant], checkout=baseline)
        algo = TRL_ALGO[variant]
        if args.vs_trl and f"TRL {algo}" not in specs:
            specs[f"TRL {algo}"] = Spec("benchmarks.trl_worker", VARIANTS[algo])
    print(f"main: {', '.join(specs)}", file=sys.stderr, flush=True)
    series, peaks = run_round_robin(specs, args, log_dir, peak_size)
    peak = statistics.median(peaks)
    # The machine's limit is the best rate it reached; the median round is what a step shared the machine with.
    best = max([results["matmul_gflops"][peak_size], *peaks])
    rows = []
    for label, s in series.items():
        # TRL does not report its prompt width; its prompts come from the same task, so take ours.
        width = round(series[f"ours {args.variants[0]}"].median("prompt_width"))
        flops = step_flops([*args.override, *s.overrides], args.workload, width)
        achieved = [flops["total"] / step["seconds"] / 1e9 / p for step, p in zip(s.steps, peaks)]
        rows.append(
            [
                label,
                spread(s.seconds),
                f"{s.median('rollout_s'):.3f}",
                f"{s.median('score_s'):.3f}",
                f"{s.median('train_s'):.3f}",
                f"{s.tokens_per_s:.0f}",
                f"{s.peak_rss_mib:.0f}",
                f"{flops['total'] / 1e9:.1f}",
                f"{flops['total'] / s.median('seconds') / 1e9:.1f}",
                f"{statistics.median(achieved):.1%}",
                f"{flops['total'] / s.median('seconds') / 1e9 / best:.1%}",
            ]
        )
        results["main"][label] = {
            "overrides": s.overrides,
            "info": s.info,
            "steps": s.steps,
            "flops": flops,
            "peak_fraction": achieved,
        }
    results["matmul_gflops_per_round"] = peaks
    results["matmul_gflops_best"] = best
    print("\n## RL step (median of timed steps; s)\n")
    print(
        markdown_table(
            [
                "loop",
                "step s (min-max)",
                "rollout",
                "old-policy scoring",
                "training",
                "completion tok/s",
                "peak RSS MiB",
                "model GFLOP/step",
                "GFLOP/s",
                f"of each round's matmul (median {peak:.0f} GFLOP/s)",
                f"of the best matmul measured ({best:.0f} GFLOP/s)",
            ],
            rows,
        )
    )
    if args.vs_trl:
        pairs = {variant: (series[f"ours {variant}"], series[f"TRL {TRL_ALGO[variant]}"]) for variant in args.variants}
        ratios = paired_ratios("Ours / TRL GRPOTrainer, same work, stepped alternately", pairs)
        results["vs_trl"].update(ratios)
    if baseline is not None:
        pairs = {
            variant: (series[f"ours {variant}"], series[baseline_label(variant, args)]) for variant in args.variants
        }
        ratios = paired_ratios(f"Ours / ours at {args.baseline}, same work, stepped alternately", pairs)
        results["vs_baseline"].update(ratios)


def _overhead_label(overrides: list[str]) -> str:
    return "grpo " + (" ".join(overrides) or "(workload)")


def overheads_section(args: argparse.Namespace, log_dir: Path, peak_size: int, results: dict[str, Any]) -> None:
    base = VARIANTS["grpo"]
    # The workload's own worker also times a plain `model.generate` on each of its batches (outside its step).
    specs = {_overhead_label([]): Spec("benchmarks.lab_worker", base, ["--probe-generate"])}
    for sides in OVERHEADS.values():
        for side in sides:
            specs.setdefault(_overhead_label(side), Spec("benchmarks.lab_worker", [*base, *side]))
    print(f"overheads: {', '.join(specs)}", file=sys.stderr, flush=True)
    series, _ = run_round_robin(specs, args, log_dir, peak_size)
    rows = []
    for name, (numerator, denominator) in OVERHEADS.items():
        top, bottom = series[_overhead_label(numerator)], series[_overhead_label(denominator)]
        ratios = [a / b for a, b in zip(top.seconds, bottom.seconds)]
        results["overheads"][name] = {"ratios": ratios, "numerator": top.steps, "denominator": bottom.steps}
        rows.append(
            [
                name,
                f"{statistics.median(top.seconds):.3f}",
                f"{statistics.median(bottom.seconds):.3f}",
                spread(ratios),
                f"{statistics.median(ratios) - 1:+.1%}",
            ]
        )
    probed = series[_overhead_label([])]
    ratios = [step["rollout_s"] / step["generate_s"] for step in probed.steps]
    results["overheads"]["rollout / model.generate"] = {"ratios": ratios, "steps": probed.steps}
    rows.append(
        [
            "rollout / plain model.generate, same batch",
            f"{probed.median('rollout_s'):.3f}",
            f"{probed.median('generate_s'):.3f}",
            spread(ratios),
            f"{statistics.median(ratios) - 1:+.1%}",
        ]
    )
    print("\n## Overheads (grpo; ratio of neighbouring steps)\n")
    print(markdown_table(["switch", "with s", "without s", "ratio median (min-max)", "cost"], rows))


def phase_seconds(steps: list[dict[str, Any]], phase: str) -> list[float]:
    """Seconds of `phase` (a key of `PHASES`) in each of a worker's steps."""
    return [sum(step[key] for key in PHASES[phase]) for step in steps]


def compare_sides(args: argparse.Namespace) -> dict[str, list[str]]:
    """`--compare A B` as override lists on top of grpo, labelled so that two equal sides stay two workers."""
    return {
        f"{name}: {' '.join(side.split()) or 'grpo (workload)'}": [*VARIANTS["grpo"], *side.split()]
        for name, side in zip("AB", args.compare)
    }


def compare_section(args: argparse.Namespace, log_dir: Path, peak_size: int, results: dict[str, Any]) -> None:
    sides = compare_sides(args)
    specs = {label: Spec("benchmarks.lab_worker", overrides) for label, overrides in sides.items()}
    print(f"compare: {' against '.join(specs)}", file=sys.stderr, flush=True)
    series, _ = run_round_robin(specs, args, log_dir, peak_size)
    a, b = series.values()
    rows, ratios = [], {}
    for phase in PHASES:
        a_s, b_s = (phase_seconds(s.steps, phase) for s in (a, b))
        ratios[phase] = [x / y for x, y in zip(a_s, b_s)]
        rows.append([phase, f"{statistics.median(a_s):.3f}", f"{statistics.median(b_s):.3f}", spread(ratios[phase])])
    results["compare"] = {
        "A": {"label": a.label, "overrides": a.overrides, "steps": a.steps},
        "B": {"label": b.label, "overrides": b.overrides, "steps": b.steps},
        "ratios": ratios,
    }
    print(f"\n## A / B, stepped alternately (A = {a.label.removeprefix('A: ')}; B = {b.label.removeprefix('B: ')})\n")
    print(markdown_table(["phase", "A s", "B s", "A / B median (min-max)"], rows))
    print("\nstep ratio per round: " + " ".join(f"{r:.2f}" for r in ratios["step"]))


def scaling_section(args: argparse.Namespace, log_dir: Path, peak_size: int, results: dict[str, Any]) -> None:
    specs = {name: Spec("benchmarks.lab_worker", [*VARIANTS["grpo"], *extra]) for name, extra in SCALING.items()}
    print(f"scaling: {', '.join(specs)}", file=sys.stderr, flush=True)
    series, _ = run_round_robin(specs, args, log_dir, peak_size)
    base = series[next(iter(SCALING))]
    base_completion = base.median("seconds") / base.median("tokens")
    base_sequence = base.median("seconds") / base.median("sequence_tokens")
    rows = []
    for name, s in series.items():
        completion = s.median("seconds") / s.median("tokens")
        sequence = s.median("seconds") / s.median("sequence_tokens")
        results["scaling"][name] = {"overrides": s.overrides, "steps": s.steps}
        rows.append(
            [
                name,
                f"{s.median('tokens'):.0f}",
                f"{s.median('sequence_tokens'):.0f}",
                spread(s.seconds),
                f"{s.median('rollout_s'):.3f}",
                f"{s.median('score_s'):.3f}",
                f"{s.median('train_s'):.3f}",
                f"{completion * 1e6:.0f}",
                f"{completion / base_completion:.2f}",
                f"{sequence / base_sequence:.2f}",
            ]
        )
    print("\n## Scaling (grpo): cost per token relative to the workload (1.00 = linear in tokens)\n")
    print(
        markdown_table(
            [
                "configuration",
                "completion tokens/step",
                "sequence tokens/step (prompt + completion)",
                "step s (min-max)",
                "rollout",
                "scoring",
                "training",
                "µs / completion token",
                "relative per completion token",
                "relative per sequence token",
            ],
            rows,
        )
    )


def profile_section(args: argparse.Namespace, log_dir: Path, peak_size: int, results: dict[str, Any]) -> None:
    specs = {"grpo, module timers": Spec("benchmarks.lab_worker", VARIANTS["grpo"], ["--profile"])}
    print("profile: grpo with module timers", file=sys.stderr, flush=True)
    series, _ = run_round_robin(specs, args, log_dir, peak_size)
    steps = series["grpo, module timers"].steps
    columns: dict[str, tuple[float, dict[str, float]]] = {}
    for phase in ("rollout", "scoring + training"):
        phase_s = phase_seconds(steps, phase)
        parts = {part: [step["profile"].get(phase, {}).get(part, 0.0) for step in steps] for part in PARTS}
        parts["everything else"] = [total - sum(step_parts) for total, step_parts in zip(phase_s, zip(*parts.values()))]
        columns[phase] = (statistics.median(phase_s), {part: statistics.median(v) for part, v in parts.items()})
    results["profile"] = {"steps": steps, "medians": {phase: parts for phase, (_, parts) in columns.items()}}
    rows = []
    for part in [*PARTS, "everything else"]:
        row = [part]
        for median_s, medians in columns.values():
            row += [f"{medians[part]:.3f}", f"{medians[part] / median_s:.0%}"]
        rows.append(row)
    print("\n## Where grpo's step goes (self time per part, median of timed steps; s)\n")
    print(markdown_table(["part", "rollout", "share", "scoring + training", "share"], rows))
    print(
        "\nEverything else: in the rollout, the sampling loop (generate's per-token bookkeeping, logits processors "
        "and sampling, the engine's hooks); in scoring + training, the objective, metrics and minibatch assembly."
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--workload",
        choices=list(WORKLOADS),
        default="tiny",
        help="tiny: the TRL peer benchmark's step; deep: the deep_long cell's (benchmarks.workload)",
    )
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per configuration before those")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch intra-op threads everywhere (0: torch's default; our loop follows the free cores)",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        help="loops of the main section (default: all; none when --compare is given alone)",
    )
    parser.add_argument("--vs-trl", action="store_true", help="step TRL's GRPOTrainer alternately (bench extra)")
    parser.add_argument("--overheads", action="store_true", help="routing metrics, r2 and W&B overhead ratios")
    parser.add_argument("--scaling", action="store_true", help="group size, completion length, experts")
    parser.add_argument("--profile", action="store_true", help="self time per part of the model, grpo")
    parser.add_argument(
        "--compare",
        nargs=2,
        metavar=("A", "B"),
        help='A / B: two sets of space-separated overrides on top of grpo ("" = grpo itself)',
    )
    parser.add_argument(
        "--baseline",
        metavar="REVISION",
        help="also step the main section's loops at this commit of the clone (e.g. main), side by side",
    )
    parser.add_argument("--all", action="store_true", help="every section")
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra Hydra override for every configuration (repeatable), e.g. model.num_experts=8",
    )
    parser.add_argument("--json-out", type=Path, help="write every measured number here")
    parser.add_argument("--log-dir", type=Path, help="worker logs (default: a temporary directory)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.threads < 0:
        parser.error(f"--steps={args.steps} must be >= 1, --warmup={args.warmup} and --threads={args.threads} >= 0")
    if args.all:
        args.vs_trl = args.overheads = args.scaling = args.profile = True
    if args.variants is None:
        args.variants = [] if args.compare and not args.vs_trl else list(VARIANTS)
    if args.vs_trl:
        try:
            import trl  # noqa: F401
        except ImportError:
            parser.error("--vs-trl needs TRL: pip install -e '.[bench]' (trl, datasets, accelerate)")
    if args.baseline is not None:
        known = subprocess.run(
            ["git", "-C", str(PROJECT_ROOT), "rev-parse", "--verify", "--quiet", f"{args.baseline}^{{commit}}"],
            capture_output=True,
        )
        if known.returncode != 0:
            parser.error(f"--baseline {args.baseline!r} is not a commit of the clone at {PROJECT_ROOT} (git rev-parse)")
    # A bad override fails here, before any worker starts.
    for overrides in [[], *(compare_sides(args).values() if args.compare else [])]:
        try:
            compose_workload([*args.override, *overrides], args.workload)
        except (HydraException, OmegaConfBaseException) as error:
            parser.error(f"bad override in {' '.join([*args.override, *overrides])!r}: {error}")
    if args.threads:
        torch.set_num_threads(args.threads)
    info = machine()
    print(
        f"# benchmarks.rl_step on {info['cpu']} ({info['cores']} cores), torch {info['torch']}, transformers "
        f"{info['transformers']}, {info['torch_threads']} torch threads, load {info['load_1min']:.1f}"
    )
    print(
        f"workload bench-{args.workload}: {' '.join(WORKLOADS[args.workload] + args.override)}; {args.warmup} warm-up "
        "+ "
        f"{args.steps} timed steps each"
    )
    peak_size, peak, rates = matmul_peak()
    print("fp32 matmul: " + ", ".join(f"{n}: {r:.0f}" for n, r in rates.items()) + f" GFLOP/s (peak at {peak_size})")
    results: dict[str, Any] = {
        "machine": info,
        "matmul_gflops": rates,
        "argv": sys.argv[1:] if argv is None else argv,
        "workload": args.workload,
        "main": {},
        "vs_trl": {},
        "vs_baseline": {},
        "overheads": {},
        "scaling": {},
        "profile": {},
        "compare": {},
    }
    with tempfile.TemporaryDirectory(prefix="bench_logs_") as scratch:
        log_dir = args.log_dir or Path(scratch)
        log_dir.mkdir(parents=True, exist_ok=True)
        baseline = export_revision(args.baseline, Path(scratch) / "baseline") if args.baseline else None
        main_section(args, log_dir, peak_size, results, baseline)
        if args.compare:
            compare_section(args, log_dir, peak_size, results)
        if args.overheads:
            overheads_section(args, log_dir, peak_size, results)
        if args.scaling:
            scaling_section(args, log_dir, peak_size, results)
        if args.profile:
            profile_section(args, log_dir, peak_size, results)
    finish(results, args.json_out)
    return results


def finish(results: dict[str, Any], json_out: Path | None) -> None:
    """The load at the end beside the one at the start (what the numbers shared the machine with), and the JSON."""
    results["load_1min_end"] = os.getloadavg()[0]
    info = results["machine"]
    print(
        f"\nload average (1 min) at start {info['load_1min']:.1f}, at end {results['load_1min_end']:.1f} "
        f"on {info['cores']} cores"
    )
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {json_out}")


if __name__ == "__main__":
    main()
