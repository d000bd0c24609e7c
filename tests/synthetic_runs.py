"""Synthetic run directories with known curves, laid out exactly as the training loop writes them.

`make_sweep` builds a Hydra-multirun-like folder: two algorithms (grpo, gspo) × three seeds, 20 steps each, where
every metric is a simple closed form of (algorithm, seed, step, layer, minibatch) so tests can check aggregates by
hand. Planted defects: the gspo seed-2 run crashed after step 12 (no summary.json), and line 5 of the grpo seed-1
metrics.jsonl is not JSON. Beside it, the shapes the report's tests and tests/analysis_outputs.py build on: a run
evaluated at its start and end (`evaluated_run`), a run whose reward may collapse after its mismatch rises
(`mismatch_run`), a committed result's comparisons table (`reference_folder`) and a W&B project (`FakeApi`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import yaml

from algos.objective import CLIP as CLIP_METRIC
from algos.objective import SEQ_RATIO_VAR, TOKEN_RATIO_VAR
from experiments.step.metrics import (
    CHI2_TOKEN,
    DRIFT,
    DRIFT_OVER_MINIBATCHES,
    DRIFT_PER_UPDATE,
    ENTROPY,
    ESS,
    EVAL_ACCURACY,
    EVAL_GREEDY,
    GRAD_NORM,
    MISMATCH_K3,
    REWARD,
    ROUTING_SHARE,
    SKIPPED,
    STEP,
    STEP_TIME,
    TOKENS,
    per_layer,
    started,
)

STEPS = 20
LAYERS = 2
MINIBATCHES = 3
TOKENS_PER_STEP = 100
EVAL_EVERY = 5
SLOPE = {"grpo": 0.02, "gspo": 0.03}
CLIP = {"grpo": 0.001, "gspo": 0.15}


def reward(algo: str, seed: int, step: int) -> float:
    """Known training reward: a line per algorithm, shifted by 0.1 per seed."""
    return SLOPE[algo] * step + 0.1 * seed


def layer_drift(layer: int, minibatch: int) -> float:
    """Known drift: grows with depth and with the number of updates since θ_old (0 at minibatch 0), not linearly in
    the updates, so that the drift after one update and the mean over minibatches differ."""
    return 0.05 * (layer + 1) * minibatch**2


def config(algo: str, seed: int, replay: str = "none", **trainer: object) -> dict:
    return {
        "algo": {"name": algo, "clip_low": 0.2 if algo == "grpo" else 3e-4},
        "routing": {"replay": replay},
        "model": {"name": "tiny_moe", "num_hidden_layers": LAYERS},
        "dataset": {"name": "addition"},
        "seed": seed,
        "trainer": {"steps": STEPS, "lr": 1e-4, "minibatches": MINIBATCHES, **trainer},
        "logger": {"wandb": False, "output_dir": f"/tmp/out/{algo}/{seed}"},
    }


def step_record(algo: str, seed: int, step: int, value: float, routing: bool = True) -> dict:
    """One metrics.jsonl line; `value` is the training reward of this step."""
    drift = [[layer_drift(layer, j) for layer in range(LAYERS)] for j in range(MINIBATCHES)]
    minibatches = []
    for j in range(MINIBATCHES):
        entry = {"minibatch": j, TOKEN_RATIO_VAR: 1e-3 * j, CLIP_METRIC: CLIP[algo]}
        if routing:
            entry[DRIFT] = sum(drift[j]) / LAYERS
            entry.update({per_layer(DRIFT, i): drift[j][i] for i in range(LAYERS)})
        minibatches.append(entry)
    record = {
        STEP: step,
        TOKENS: TOKENS_PER_STEP * step,
        REWARD: value,
        CLIP_METRIC: CLIP[algo],
        TOKEN_RATIO_VAR: 1e-3,
        SEQ_RATIO_VAR: 1e-5,
        SKIPPED: 1 if step > 10 and algo == "gspo" else 0,
        STEP_TIME: 2.0,
        "minibatches": minibatches,
    }
    if routing:  # the step-level keys the trainer logs beside the per-minibatch records (analysis reads the latter)
        record[DRIFT_PER_UPDATE] = sum(drift[1]) / LAYERS
        record.update({per_layer(DRIFT_PER_UPDATE, i): drift[1][i] for i in range(LAYERS)})
        record[DRIFT_OVER_MINIBATCHES] = sum(map(sum, drift)) / LAYERS / MINIBATCHES
    if step % EVAL_EVERY == 0:
        record[EVAL_ACCURACY] = value / 2
    return record


def write_run(
    run_dir: Path,
    cfg: dict,
    records: list[dict],
    finished: bool = True,
    malformed_line: int | None = None,
    start: str | None = None,
    status: str = "finished",
) -> Path:
    """Write `.hydra/config.yaml`, `metrics.jsonl` (line `malformed_line` replaced by junk) and, unless the run did not
    finish, `summary.json` (with `status`, and the start's sha256 when `start` names it)."""
    (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
    (run_dir / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg), encoding="utf-8")
    lines = [json.dumps(r) for r in records]
    if malformed_line is not None:
        lines[malformed_line - 1] = '{"train/step": 5, "reward/mean": 0.1'
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    if finished:
        summary = {"status": status, "steps": len(records), "wall_s": 2.0 * len(records)}
        if start is not None:
            summary["start_sha256"] = start
        (run_dir / "summary.json").write_text(json.dumps(summary), encoding="utf-8")
    return run_dir


def curve_run(
    run_dir: Path,
    algo: str,
    seed: int,
    values: list[float] | Callable[[int], float],
    replay: str = "none",
    routing: bool = True,
    finished: bool = True,
) -> Path:
    """A run whose reward at step t (1-based) is `values[t-1]` or `values(t)`."""
    n = len(values) if isinstance(values, list) else STEPS
    value_at = (lambda t: values[t - 1]) if isinstance(values, list) else values
    records = [step_record(algo, seed, t, value_at(t), routing=routing) for t in range(1, n + 1)]
    return write_run(run_dir, config(algo, seed, replay=replay), records, finished=finished)


def make_sweep(root: Path) -> Path:
    """The standard fixture: grpo and gspo × seeds 0, 1, 2 as Hydra multirun jobs 0..5 plus multirun.yaml."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "multirun.yaml").write_text("hydra: {}\n", encoding="utf-8")
    job = 0
    for algo in ("grpo", "gspo"):
        for seed in range(3):
            crashed = algo == "gspo" and seed == 2
            steps = 12 if crashed else STEPS
            records = [step_record(algo, seed, t, reward(algo, seed, t)) for t in range(1, steps + 1)]
            malformed = 5 if (algo == "grpo" and seed == 1) else None
            write_run(root / str(job), config(algo, seed), records, finished=not crashed, malformed_line=malformed)
            job += 1
    return root


def evaluated_run(
    run_dir: Path,
    algo: str,
    seed: int,
    replay: str,
    start: float,
    end: float,
    *,
    sha: str | None = None,
    status: str | None = "finished",
    logged: int = 3,
    comparison: dict | None = None,
    **settings: object,
) -> Path:
    """A run of 3 planned steps evaluated at its start (logged in step 1's record) and at its last logged step (of
    `logged`), with `settings` in its config; its summary says `status` and names its start `sha` (None: no summary
    when `status` is None), and its config declares `comparison` where given."""
    records = [step_record(algo, seed, t, 0.5) for t in range(1, logged + 1)]
    records[0].update({started(EVAL_GREEDY): start})
    records[-1].update({EVAL_GREEDY: end})
    cfg = config(algo, seed, replay=replay, steps=3, eval_every=0)
    for key, value in settings.items():
        group, name = key.split(".")
        cfg.setdefault(group, {})[name] = value
    if comparison is not None:
        cfg["comparison"] = comparison
    return write_run(run_dir, cfg, records, finished=status is not None, start=sha, status=status or "")


def mismatch_run(
    run_dir: Path,
    seed: int,
    collapse_at: int | None = None,
    kl_rises_at: int | None = None,
    steps: int = 30,
    decompose: bool = True,
) -> Path:
    """A run whose reward climbs, then (from `collapse_at`) falls by 0.5 for good, and whose mismatch KL jumps ten-fold
    at `kl_rises_at`; entropy and grad norm stay flat; with `decompose`, every off-policy minibatch logs its routing
    share of the ratio's variance."""
    records = []
    for t in range(1, steps + 1):
        reward = 0.02 * t if collapse_at is None or t < collapse_at else 0.02 * collapse_at - 0.5
        record = step_record("grpo", seed, t, reward)
        record[MISMATCH_K3] = 1e-3 if kl_rises_at is None or t < kl_rises_at else 1e-2
        record[CHI2_TOKEN] = 2 * record[MISMATCH_K3]
        record[ESS] = 0.99
        record[ENTROPY], record[GRAD_NORM] = 1.0, 0.5
        if decompose:
            for entry in record["minibatches"]:
                if entry["minibatch"] > 0:
                    entry[ROUTING_SHARE] = 0.1 * entry["minibatch"]
        records.append(record)
    return write_run(run_dir, config("grpo", seed), records)


def reference_folder(folder: Path, key: str, rows: list[tuple]) -> Path:
    """A committed result's folder as analysis.report writes it: comparisons.csv with the cell's setting `key` first,
    one row per (value, measure, arm against grpo, estimate, low, high, verdict)."""
    folder.mkdir(parents=True)
    pd.DataFrame(
        [
            {
                key: value,
                "measure": measure,
                "arm": arm,
                "baseline": "grpo",
                "seeds": 10,
                "difference_estimate": estimate,
                "difference_low": low,
                "difference_high": high,
                "separates": verdict.startswith("separates"),
                "verdict": verdict,
            }
            for value, measure, arm, estimate, low, high, verdict in rows
        ]
    ).to_csv(folder / "comparisons.csv", index=False)
    return folder


class FakeRun:
    """Stands in for `wandb.apis.public.Run`: the attributes and method the loader uses; `summary`, where given, is
    the run's summary.json."""

    def __init__(self, algo: str, seed: int, state: str, steps: int, routing: bool = True, summary: dict | None = None):
        self.id, self.name, self.group, self.state = f"{algo}{seed}", f"{algo}-s{seed}", "sweepA", state
        self.config = {**config(algo, seed), "_wandb": {"cli_version": "0"}}
        if summary is not None:
            self.summary = summary
        self._rows = []
        for t in range(1, steps + 1):
            record = step_record(algo, seed, t, reward(algo, seed, t), routing=routing)
            for entry in record.pop("minibatches"):
                j = entry.pop("minibatch")
                record.update({f"minibatch/{j}/{k}": v for k, v in entry.items()})
            self._rows.append({**record, "_step": t - 1, "_runtime": 1.5 * t})

    def scan_history(self):
        return iter(self._rows)


class FakeApi:
    """Stands in for `wandb.Api`: its project holds `runs`; `calls` records every query."""

    def __init__(self, runs: list[FakeRun]):
        self._runs, self.calls = runs, []

    def runs(self, path, filters=None):
        self.calls.append((path, filters))
        return list(self._runs)
