"""Every output the `python -m analysis.*` commands write, from synthetic inputs: the check that a change of analysis/
changes none of them.

    python -m tests.analysis_outputs build INPUTS        # synthetic runs, probes, a cold start, reports' tables (once)
    python -m tests.analysis_outputs run INPUTS OUT      # every command on them, each in a process of its own
    python -m tests.analysis_outputs compare OLD NEW     # two OUTs: text byte for byte, PNGs pixel for pixel

Built once and read by both versions of the code, the inputs are the same bytes for each (a cold start trained twice
need not be). `run` calls each command's `main` with the arguments a user types, from a folder in which `inputs`
links to INPUTS, so every path an output names is relative and alike; it keeps each command's stdout, stderr and exit
code beside its files (`<name>.log`), so a refusal's one line and argparse's usage are compared too. PDFs are written
with SOURCE_DATE_EPOCH fixed, which makes matplotlib's bytes repeatable. What it covers: `analysis.report` (local
runs and a fake W&B project) on every path of its report (figures 0 in its three forms to 8 drawn and left out, one arm
and several, comparisons of one start and of several, seeds left out, a declared rule, references beside the
verdicts, early warning), `analysis.compare`, `panels`, `calibrate`, `regimes`, `drift_law`, `cold_starts`, `margins`
and `legacy_intervals`, each with a refusal. Not covered: nothing W&B's real client does.
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import os
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import yaml

from experiments.step.metrics import (
    CHI2_TOKEN,
    DRIFT_PER_UPDATE,
    ENGINE_EXPERTS,
    ENGINE_TOKENS,
    ENTROPY,
    ESS,
    EVAL_GREEDY,
    GRAD_NORM,
    LENGTH,
    LOGIT_MARGIN,
    MISMATCH_K3,
    ROUTING_SHARE,
    TOKENS,
    TOPK_MARGIN_MEDIAN,
    started,
)
from tests import synthetic_runs as syn

SHA_A, SHA_B, SHA_C = "a" * 64, "b" * 64, "c" * 64
PROGRESS = re.compile(r"\d+(\.\d+)?(it|step)/s")
LEGACY = ("claim1_deep", "flip_dose", "phase_diagram")  # committed reports made before per-seed values were kept


def probe(root, name, layers, experts, lrs, drift, cold_start=None, model_type=None, diverged_lr=None):
    """A drift probe's summary.json whose drift at each lr is `drift(lr)`."""
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("model:\n  name: m\n  path: null\n  hidden_size: 64\n")
    settings = [
        {
            "lr": lr,
            DRIFT_PER_UPDATE: drift(lr),
            "drift_per_layer": [drift(lr) * (1 + i / layers) for i in range(layers)],
            ROUTING_SHARE: 0.1,
            LOGIT_MARGIN: 0.2,
            "ratio/token_var": 0.01,
            LENGTH: 3.5,
        }
        for lr in lrs
    ]
    if diverged_lr:
        settings.append({"lr": diverged_lr, "diverged": "the trainer's model produced logits that are NaN or inf"})
    summary = {
        "status": "finished",
        "model": name,
        "dataset": {"name": "addition", "digits": 2},
        "answer_tokens": 3.9,
        "policy": {
            "num_moe_layers": layers,
            "num_experts": experts,
            "num_experts_per_tok": 8,
            **({"model_type": model_type} if model_type else {}),
        },
        "cold_start": cold_start,
        "settings": settings,
        "precision_mismatch": [{"precision": "bf16", ENGINE_EXPERTS: 0.01, ENGINE_TOKENS: 0.2, MISMATCH_K3: 1e-4}],
    }
    (run / "summary.json").write_text(json.dumps(summary))


def build(inputs: Path) -> None:
    """Every input the commands read, under `inputs`."""
    evaluated = syn.evaluated_run  # a run evaluated at its start and at its end: what the comparisons read
    rng = np.random.default_rng(0)
    syn.make_sweep(inputs / "sweep")
    for seed, (collapse, rise) in enumerate([(20, 12), (None, None), (24, None)]):
        syn.mismatch_run(inputs / "mismatch" / f"run{seed}", seed, collapse_at=collapse, kl_rises_at=rise)
    syn.curve_run(inputs / "replay" / "plain", "grpo", 0, syn.STEPS * [0.2])
    syn.curve_run(inputs / "replay" / "r2", "grpo", 0, lambda t: 0.02 * t, replay="r2")
    syn.curve_run(inputs / "replay" / "r3", "grpo", 1, lambda t: 0.01 * t, replay="r3", routing=False)
    for i, (algo, replay, flip, seed, end) in enumerate(
        [
            ("grpo", "none", 0.0, 0, 0.6),
            ("grpo", "none", 0.0, 1, 0.7),
            ("grpo", "none", 0.3, 0, 0.1),
            ("grpo", "r2", 0.0, 0, 0.6),
            ("grpo", "r2", 0.3, 0, 0.55),
            ("gspo", "none", 0.3, 0, 0.5),
        ]
    ):
        evaluated(inputs / "flips" / str(i), algo, seed, replay, 0.5, end, **{"routing.flip_rate": flip})
    for i, (lr, layers) in enumerate([(1e-4, 2), (1e-4, 4), (1e-3, 2), (1e-3, 4)]):
        for algo in ("grpo", "gspo"):
            for seed in (0, 1):
                evaluated(
                    inputs / "grid" / f"{algo}{i}s{seed}",
                    algo,
                    seed,
                    "none",
                    0.5,
                    0.5 - lr * layers * 50 + 0.01 * seed,
                    **{"trainer.lr": lr, "model.num_hidden_layers": layers},
                )
    separated = "separates (95% CI of the difference excludes 0)"
    references = [
        syn.reference_folder(
            inputs / "references" / "flips",
            "routing.flip_rate",
            [
                (0.0, "gain_area", "grpo + r2", -0.001, -0.010, 0.006, "not distinguishable"),
                (0.2, "gain_area", "grpo + r2", 0.133, 0.110, 0.157, separated),
                (0.2, "gain", "grpo + r2", 0.109, 0.080, 0.140, separated),
            ],
        ),
        syn.reference_folder(
            inputs / "references" / "noise",
            "routing.perturb_rate",
            [(0.1, "gain_area", "grpo + r2", 0.011, -0.005, 0.026, "not distinguishable")],
        ),
        syn.reference_folder(
            inputs / "references" / "elsewhere",
            "routing.flip_rate",
            [(0.5, "gain_area", "grpo + r2", 0.2, 0.1, 0.3, separated)],
        ),
    ]
    comparison = {"baseline": "grpo", "family": ["grpo + r2"], "references": [str(path) for path in references]}
    doses = [(0.2, 0.0, (0.10, 0.12, 0.14)), (0.0, 0.1, (-0.02, -0.04, -0.06))]  # (flip, noise, R2's effect per seed)
    for cell, (flip, perturb, effects) in enumerate(doses):
        for seed, effect in enumerate(effects):
            grpo = 0.5 + 0.01 * seed - 0.2 * cell
            for replay, end in (("none", grpo), ("r2", grpo + effect)):
                evaluated(
                    inputs / "contrast" / f"{cell}_{replay}_{seed}",
                    "grpo",
                    seed,
                    replay,
                    0.5,
                    end,
                    sha=SHA_A,
                    comparison=comparison,
                    **{"routing.flip_rate": flip, "routing.perturb_rate": perturb},
                )
    for start, effect in ((SHA_A, 0.1), (SHA_B, 0.1), (SHA_C, -0.05)):
        for seed in (0, 1):
            evaluated(
                inputs / "starts" / f"g_{start[0]}{seed}", "grpo", seed, "none", 0.5, 0.6 + 0.01 * seed, sha=start
            )
            evaluated(
                inputs / "starts" / f"s_{start[0]}{seed}",
                "gspo",
                seed,
                "none",
                0.5,
                0.6 + 0.01 * seed + effect,
                sha=start,
            )
    crashed = inputs / "crashed"
    crashed.mkdir(parents=True)
    (crashed / "multirun.yaml").write_text("hydra: {}\n")
    for seed in range(5):
        evaluated(crashed / f"grpo_s{seed}", "grpo", seed, "none", 0.5, 0.5 + 0.01 * seed, sha=SHA_A)
    for seed in (0, 2):
        evaluated(crashed / f"gspo_s{seed}", "gspo", seed, "none", 0.5, 0.52 + 0.01 * seed, sha=SHA_A)
    evaluated(crashed / "gspo_s1", "gspo", 1, "none", 0.5, 0.95, status=None, logged=2)
    (crashed / "gspo_s3" / ".hydra").mkdir(parents=True)
    (crashed / "gspo_s3" / ".hydra" / "config.yaml").write_text(yaml.safe_dump(syn.config("gspo", 3)))
    (crashed / "gspo_s3" / ".lock").touch()
    for seed in range(3):
        evaluated(
            inputs / "diverged" / f"g{seed}",
            "grpo",
            seed,
            "none",
            0.5,
            0.7,
            sha=SHA_A,
            comparison={"early_stopped": "failed"},
        )
        evaluated(
            inputs / "diverged" / f"s{seed}",
            "gspo",
            seed,
            "none",
            0.5,
            0.8 if seed < 2 else 0.6,
            sha=SHA_A,
            status="diverged" if seed == 2 else "finished",
            logged=2 if seed == 2 else 3,
            comparison={"early_stopped": "failed"},
        )
    for seed in range(10):
        base = 0.5 + rng.normal(0.0, 0.3)
        evaluated(inputs / "ten" / f"g{seed}", "grpo", seed, "none", 0.5, base, sha=SHA_A)
        evaluated(inputs / "ten" / f"r{seed}", "grpo", seed, "r2", 0.5, base + rng.normal(0.2, 0.1), sha=SHA_A)
        evaluated(inputs / "ten" / f"s{seed}", "gspo", seed, "none", 0.5, base + rng.normal(0.0, 0.1), sha=SHA_A)
        evaluated(
            inputs / "other" / f"s{seed}",
            "gspo",
            seed,
            "none",
            0.5,
            base + rng.normal(0.1, 0.1),
            sha=SHA_A,
            **{"algo.clip_high": 0.01},
        )
    for seed in (0, 1):  # a dense model, no token count, an engine that is the trainer's own model, no collapse
        records = []
        for t in range(1, syn.STEPS + 1):
            record = syn.step_record("gspo", seed, t, 0.3 + 0.01 * t * (seed + 1), routing=False)
            del record[TOKENS]
            record[MISMATCH_K3], record[CHI2_TOKEN], record[ESS] = 1e-8, 2e-8, 1.0
            record[ENTROPY], record[GRAD_NORM] = 1.0 - 0.01 * t, 0.5
            if t % 5 == 0:
                record[EVAL_GREEDY] = 0.02 * t
            records.append(record)
        syn.write_run(inputs / "dense" / f"s{seed}", syn.config("gspo", seed), records)
    for seed in (10, 2, 1):
        evaluated(inputs / "onearm" / f"g{seed}", "grpo", seed, "none", 0.5, 0.6 + 0.01 * seed)
    job = 0
    for n in (2, 4):
        for algo in ("grpo", "gspo"):
            for seed in (0, 1):
                records = [syn.step_record(algo, seed, t, syn.reward(algo, seed, t) * n) for t in range(1, 9)]
                syn.write_run(inputs / "panels" / str(job), syn.config(algo, seed, minibatches=n), records)
                job += 1
    for seed in (100, 101):
        for lr in (1e-4, 2e-4, 4e-4):
            calibration_run(inputs / "calibrate" / f"grpo{lr}-{seed}", "grpo", lr, seed, (lr / 1e-4) ** 2)
        calibration_run(inputs / "calibrate" / f"gspo-{seed}", "gspo", 3e-4, seed, 5.0)
    search = inputs / "search"
    for seed in (0, 1):
        for lr, slope in ((1e-4, 0.01), (1e-3, None)):
            values = [0.5 + slope * s for s in range(1, 21)] if slope else [0.9] * 10 + [0.1] * 10
            records = [syn.step_record("grpo", seed, s, v) for s, v in enumerate(values, 1)]
            records[0][started(EVAL_GREEDY)] = 0.5
            records[-1][EVAL_GREEDY] = 0.6 if slope else 0.0
            syn.write_run(search / f"lr{lr}_s{seed}", syn.config("grpo", seed, lr=lr), records)
    for layers in (8, 16):
        for experts in (32, 64):
            probe(
                inputs / "probes",
                f"l{layers}_e{experts}",
                layers,
                experts,
                [1e-5, 1e-4, 1e-3],
                lambda lr, layers=layers, experts=experts: 50 * layers**-0.5 * lr * (experts / 8) ** 0.3,
                diverged_lr=1e-2 if layers == 8 else None,
            )
    for i, (family, margin) in enumerate(
        [("qwen3_moe", 0.002), ("qwen3_moe", 0.01), ("glm4_moe", 0.01), ("glm4_moe", 0.05)]
    ):
        probe(
            inputs / "routers",
            f"s{i}",
            16,
            128,
            [3e-5, 1e-4, 3e-4],
            lambda lr, m=margin, s=float(family == "glm4_moe"): (
                0.02 * (lr / 1e-4) ** 0.9 * (m / 0.01) ** -0.5 * np.exp(0.7 * s)
            ),
            cold_start={"eval_greedy_accuracy": 0.5, "routing": {TOPK_MARGIN_MEDIAN: margin}},
            model_type=family,
        )
    cold_start(inputs)
    (inputs / "empty").mkdir()


def calibration_run(run_dir, algo, lr, seed, kl):
    """A run whose off-policy minibatches log KL `kl` in steps 1-10 (and far more after)."""
    records = []
    for step in range(1, 13):
        record = syn.step_record(algo, seed, step, 0.5)
        for entry in record["minibatches"]:
            entry["kl/old_k3"] = (kl if step <= 10 else 1e3) if entry["minibatch"] >= 1 else 0.0
        records.append(record)
    syn.write_run(run_dir, syn.config(algo, seed, lr=lr), records)


def cold_start(inputs: Path) -> None:
    """A cold start of the micro model (a few SFT steps): what cold_starts tabulates and margins measures."""
    import warnings

    from hydra import compose, initialize_config_dir

    from experiments.config import PROJECT_ROOT
    from experiments.sft import cold_start as train
    from tests.conftest import MICRO_MODEL

    overrides = [f"model.{key}={value}" for key, value in MICRO_MODEL.items()] + [
        "sft.max_steps=4",
        "sft.batch_size=16",
        "sft.eval_every=2",
        "sft.eval_prompts=8",
        "sft.lr=3e-3",
        f"sft.output_dir={inputs / 'ckpt'}",
        "dataset.train_size=200",
        "dataset.test_size=20",
        "logger.wandb.mode=disabled",
        "cpu_kernels=native",
    ]
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose("sft", overrides=overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(cfg, inputs / "sft")


def wandb_project() -> syn.FakeApi:
    """A W&B project of four runs: finished, still running, diverged (its summary names its start), and one that
    logged nothing."""
    return syn.FakeApi(
        [
            syn.FakeRun("grpo", 0, "finished", 6),
            syn.FakeRun("gspo", 0, "running", 4),
            syn.FakeRun("grpo", 1, "crashed", 5, summary={"status": "diverged", "start_sha256": SHA_A, "wall_s": 8.0}),
            syn.FakeRun("gspo", 1, "failed", 0),
        ]
    )


# (name, module, arguments): each a command as typed, from the folder where `inputs` is the built inputs
REPORT = ("--dpi", "40")
COMMANDS = [
    ("sweep", "report", ["inputs/sweep", "--out", "out/sweep", "--last-n", "5", "--pdf", *REPORT]),
    ("wandb", "report", ["--wandb", "ent/proj", "--group", "sweepA", "--out", "out/wandb", *REPORT]),
    (
        "mismatch",
        "report",
        ["inputs/mismatch", "--out", "out/mismatch", "--collapse-drop", "0.3", "--ema-alpha", "0.5", *REPORT],
    ),
    ("replay", "report", ["inputs/replay", "--out", "out/replay", *REPORT]),
    ("flips", "report", ["inputs/flips", "--out", "out/flips", *REPORT]),
    ("grid", "report", ["inputs/grid", "--out", "out/grid", *REPORT]),
    ("contrast", "report", ["inputs/contrast", "--out", "out/contrast", *REPORT]),
    ("starts", "report", ["inputs/starts", "--out", "out/starts", *REPORT]),
    ("crashed", "report", ["inputs/crashed", "--out", "out/crashed", *REPORT]),
    ("diverged", "report", ["inputs/diverged", "--out", "out/diverged", *REPORT]),
    ("ten", "report", ["inputs/ten", "--out", "out/ten", "--family", "gspo", "--primary", "gain", *REPORT]),
    ("other", "report", ["inputs/other", "--out", "out/other", *REPORT]),
    ("dense", "report", ["inputs/dense", "--out", "out/dense", *REPORT]),
    ("onearm", "report", ["inputs/onearm", "--out", "out/onearm", *REPORT]),
    ("report_missing", "report", ["inputs/nowhere", "--out", "out/report_missing"]),
    ("report_usage", "report", ["inputs/sweep", "--last-n", "0", "--out", "out/report_usage"]),
    ("report_baseline", "report", ["inputs/ten", "--baseline", "ppo", "--out", "out/report_baseline"]),
    (
        "compare",
        "compare",
        ["out/ten", "out/other:gspo=gspo-wide", "--baseline", "grpo", "--family", "gspo-wide", "--out", "out/compare"],
    ),
    ("compare_starts", "compare", ["out/starts", "--primary", "gain", "--out", "out/compare_starts"]),
    ("compare_refused", "compare", ["out/ten:ppo", "--out", "out/compare_refused"]),
    ("panels", "panels", ["inputs/panels", "--by", "trainer.minibatches", "--out", "out/panels", "--dpi", "40"]),
    ("panels_refused", "panels", ["inputs/panels", "--by", "trainer.minibatchez", "--out", "out/panels_refused"]),
    (
        "calibrate",
        "calibrate",
        [
            "inputs/calibrate",
            "--knob",
            "trainer.lr",
            "--measure",
            "kl/old_k3",
            "--target",
            "algo.name=gspo",
            "--grid",
            "algo.name=grpo",
            "--out",
            "out/calibrate",
        ],
    ),
    (
        "calibrate_refused",
        "calibrate",
        [
            "inputs/calibrate",
            "--knob",
            "trainer.lr",
            "--measure",
            "kl/old_k3",
            "--target",
            "gspo",
            "--grid",
            "algo.name=grpo",
            "--out",
            "out/calibrate_no",
        ],
    ),
    ("regimes", "regimes", ["inputs/search", "--out", "out/regimes/regimes.md", "--title", "Searched"]),
    ("regimes_stdout", "regimes", ["inputs/search"]),
    ("regimes_refused", "regimes", ["inputs/nowhere"]),
    ("drift_law", "drift_law", ["inputs/probes", "--out", "out/drift_law"]),
    ("drift_law_routers", "drift_law", ["inputs/routers", "--out", "out/drift_law_routers"]),
    ("drift_law_refused", "drift_law", ["inputs/empty", "--out", "out/drift_law_refused"]),
    ("cold_starts", "cold_starts", ["inputs/sft", "--out", "out/cold_starts"]),
    ("cold_starts_refused", "cold_starts", ["inputs/empty", "--out", "out/cold_starts_refused"]),
    ("margins", "margins", ["inputs/ckpt", "--out", "out/margins", "--prompts", "8"]),
    ("margins_refused", "margins", ["inputs/ckpt", "--out", "out/margins_refused", "--prompts", "0"]),
    ("legacy_intervals", "legacy_intervals", [f"out/legacy/{name}" for name in LEGACY]),
    ("legacy_refused", "legacy_intervals", ["inputs/empty"]),
]


def command(work: Path, name: str, module: str, argv: list[str]) -> None:
    """One command in this process (a fresh fork): its outputs under `out/`, what it said in `out/<name>.log`."""
    import importlib

    os.chdir(work)
    said = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
        try:
            main = importlib.import_module(f"analysis.{module}").main
            result = main(argv, wandb_api_factory=wandb_project) if name == "wandb" else main(argv)
            code = result or 0
        except SystemExit as stop:
            code = stop.code
    # progress bars (loading weights) carry their own timing: not the command's output
    lines = [line for line in said.getvalue().splitlines(keepends=True) if not PROGRESS.search(line)]
    (work / "out" / f"{name}.log").write_text(f"exit {code}\n{''.join(lines)}", encoding="utf-8")


def run(inputs: Path, out: Path) -> None:
    """Every command of `COMMANDS` on `inputs`, its outputs into `out` (emptied first), each in a process of its own
    (a command's global state, matplotlib's say, never reaches the next), in order (compare reads reports)."""
    os.environ["SOURCE_DATE_EPOCH"] = "0"
    work = out.resolve().parent / f".{out.name}-work"
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    (work / "out").mkdir(parents=True)
    (work / "inputs").symlink_to(inputs.resolve())
    for name in LEGACY:
        (work / "out" / "legacy" / name).mkdir(parents=True)
        shutil.copy(
            Path(__file__).resolve().parents[1] / "docs" / "results" / name / "report.md",
            work / "out" / "legacy" / name,
        )
    import analysis.report  # noqa: F401  (the libraries, loaded once: each fork starts with them)

    context = multiprocessing.get_context("fork")
    for name, module, argv in COMMANDS:
        child = context.Process(target=command, args=(work, name, module, argv))
        child.start()
        child.join()
    shutil.move(work / "out", out)
    shutil.rmtree(work)


def compare(old: Path, new: Path) -> list[str]:
    """What differs between two outputs of `run`: a file only one holds, text that is not the same bytes, a PNG whose
    decoded pixels differ (a PDF compared as bytes)."""
    from PIL import Image

    def files(root: Path) -> set[Path]:
        return {path.relative_to(root) for path in root.rglob("*") if path.is_file() and ".cache" not in path.parts}

    mine, theirs = files(old), files(new)
    said = [f"only in {old}: {path}" for path in sorted(mine - theirs)]
    said += [f"only in {new}: {path}" for path in sorted(theirs - mine)]
    for path in sorted(mine & theirs):
        a, b = old / path, new / path
        if path.suffix == ".png":
            first, second = (np.asarray(Image.open(f).convert("RGBA")) for f in (a, b))
            if first.shape != second.shape or not np.array_equal(first, second):
                said.append(f"pixels differ: {path}")
        elif a.read_bytes() != b.read_bytes():
            said.append(f"bytes differ: {path}")
    return said


def main(argv: list[str]) -> None:
    what, *paths = argv
    if what == "build":
        build(Path(paths[0]))
    elif what == "run":
        run(Path(paths[0]), Path(paths[1]))
    elif what == "compare":
        differences = compare(Path(paths[0]), Path(paths[1]))
        print("\n".join(differences) or f"the same: {len(list(Path(paths[0]).rglob('*')))} files and folders")
        raise SystemExit(1 if differences else 0)
    else:
        raise SystemExit("usage: python -m tests.analysis_outputs build INPUTS | run INPUTS OUT | compare OLD NEW")


if __name__ == "__main__":
    main(sys.argv[1:])
