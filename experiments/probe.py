"""`python -m experiments.probe`: how far one RL update moves a cold start's routing, and what share of the ratio
noise that is — measured in about a minute, without training to the end.

For the cold start at `model.path` and each learning rate of `probe.lrs`, the probe runs a short RL run from a fresh
AdamW with the configured objective on the model's own samples (`experiments.step.trainer.RLTrainer`, the same step as
every run): `probe.warm_steps` steps first, so that Adam's moments reach their steady state (a fresh optimizer's
first update moves routing 2-3x more than a warm one's), then `probe.measure_steps` steps whose statistics it
averages:

- drift after one update, the GSPO paper's statistic: the share of activated experts of minibatch 1's tokens that
  differ between θ_old and θ after minibatch 0's update (`routing/expert_change_per_update`), per layer, and the
  share of tokens with a changed expert in any layer;
- the routing share of Var(log π_θ/π_old) over the off-policy minibatches (`decompose/routing_share`, one extra
  forward each: the routing part log π_θ(θ's experts) − log π_θ(θ_old's experts) against the whole log-ratio);
- the routers' margins and fragility on the family's selection scores (`routing/margin`: gap between the k-th and
  (k+1)-th; `routing/logit_margin`: between their logits, comparable across expert counts; `routing/fragile_frac`:
  share of tokens with a gap below `routing.margin_threshold`; `routing/topk_mass`), and the scale-free margin
  (s[k−1] − s[k]) / (s[0] − s[2k−1]) of colibri issue #119 over tokens and layers (`routing/topk_margin_median`,
  `_mean`, `_small_frac` below 0.01, each per layer too), the number real checkpoints were measured by
  (`models.routing.measures.MARGIN_ANCHORS`);
- the token- and sequence-level ratio variance, the clipped share, the response length.

Then, for each engine precision of `probe.precisions`, one step with the rollout engine computing in it: the share
of activated experts on which that engine and the fp32 trainer disagree at the same weights
(`mismatch/expert_frac`, training–inference mismatch of routing, which R3 removes and drift is set against).

The run directory gets `metrics.jsonl` (every step, tagged `probe/lr`, `probe/phase` and `probe/setting_step`) and
`summary.json` (one entry per setting: what `analysis.drift_law` fits), and the table is printed. A learning rate whose
run diverges (non-finite loss, weights or logits: `models.registry`) is an entry that says so, and the next one is
probed.

    python -m experiments.probe model=qwen30b_l16                       # the cold start of qwen30b_l16 on addition
    python -m experiments.probe -m model=qwen30b_l16,qwen30b_l32 dataset=addition,scratchpad
"""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from algos.objective import CLIP, KL_OLD, SEQ_RATIO_VAR, TOKEN_RATIO_VAR
from experiments.config import ProbeConfig, refuse_mistyped_overrides, register_configs
from experiments.run import provenance
from experiments.run.life import Job, Life, live
from experiments.run.threads import ThreadBudget
from experiments.step import metrics
from experiments.step.checks import check_cold_start, check_run
from experiments.step.engines import Precision
from experiments.step.trainer import RLTrainer
from models import cpu_kernels
from models.policy import ModelConfig, describe_policy, is_moe, model_config
from models.registry import ConfigError, Diverged, node_settings

# What a setting reports: the mean over its measured steps of each of these metrics (and every per-layer drift), with
# its standard error, where the step logged it.
REPORTED = (
    metrics.DRIFT_PER_UPDATE,
    metrics.TOKEN_DRIFT_PER_UPDATE,
    metrics.GATE_DRIFT_PER_UPDATE,
    metrics.ROUTING_SHARE,
    metrics.ROUTING_VAR,
    metrics.WEIGHTS_VAR,
    metrics.TOTAL_VAR,
    metrics.MARGIN,
    metrics.LOGIT_MARGIN,
    metrics.FRAGILE,
    metrics.TOPK_MASS,
    metrics.TOPK_MARGIN_MEDIAN,
    metrics.TOPK_MARGIN_MEAN,
    metrics.TOPK_MARGIN_SMALL,
    TOKEN_RATIO_VAR,
    SEQ_RATIO_VAR,
    CLIP,
    KL_OLD,
    metrics.LENGTH,
    metrics.REWARD,
    metrics.ENTROPY,
)
PER_LAYER_DRIFT = metrics.per_layer(metrics.DRIFT_PER_UPDATE, "")
PER_LAYER_MARGIN = metrics.per_layer(metrics.TOPK_MARGIN_MEDIAN, "")
# logged per off-policy minibatch: pooled over the measured steps' minibatches
PER_MINIBATCH = (metrics.ROUTING_VAR, metrics.WEIGHTS_VAR, metrics.TOTAL_VAR, metrics.ROUTING_SHARE)
MISMATCH = (metrics.ENGINE_EXPERTS, metrics.ENGINE_TOKENS, metrics.MISMATCH_K3)
LR = "probe/lr"  # the setting a logged step belongs to
PHASE = "probe/phase"  # warm, measure, or precision_<p>
SETTING_STEP = "probe/setting_step"  # the step within its setting (each setting's trainer counts from 1); `step`
# counts every logged step of the probe, so the log and W&B see one increasing step


def probe_record(record: dict[str, Any], logged: int, lr: float, phase: str) -> dict[str, Any]:
    """A setting's step as the probe logs it: tagged with its setting, numbered after the `logged` steps before it."""
    return {**record, metrics.STEP: logged + 1, SETTING_STEP: record[metrics.STEP], LR: lr, PHASE: phase}


def check_probe(cfg: DictConfig) -> None:
    """The probe's own settings and what it measures, refused in its own terms; then every check of the RL runs it
    makes. All before the run directory is claimed."""
    p = cfg.probe
    if not p.lrs or any(not lr > 0 for lr in p.lrs):
        raise ConfigError(f"probe.lrs={list(p.lrs)} must be a non-empty list of learning rates > 0")
    if p.warm_steps < 0 or p.measure_steps < 1:
        raise ConfigError(
            f"probe.warm_steps={p.warm_steps} must be >= 0 and probe.measure_steps={p.measure_steps} >= 1"
        )
    if cfg.trainer.minibatches < 2:
        raise ConfigError(
            f"trainer.minibatches={cfg.trainer.minibatches}: the drift after one update is measured on minibatch 1, "
            "so the probe needs at least 2"
        )
    if cfg.routing.replay != "none":
        raise ConfigError(
            f"routing.replay={cfg.routing.replay}: the probe measures the drift and routing share that "
            "replay would remove; run it with routing.replay=none"
        )
    if cfg.rollout.precision != Precision.fp32:
        raise ConfigError(
            f"rollout.precision={cfg.rollout.precision}: the probe's RL runs sample with the fp32 "
            "trainer; engine precisions are probe.precisions"
        )
    check_cold_start(cfg)
    if not is_moe(model_config(ModelConfig(**node_settings(cfg.model)))):
        raise ConfigError(
            f"model {cfg.model.name!r} is dense: the probe measures how far an update moves the routing "
            "of an MoE model's experts, and it has none; probe an MoE cold start"
        )
    check_run(setting_config(cfg, p.lrs[0], p.warm_steps + p.measure_steps))


def setting_config(cfg: DictConfig, lr: float, steps: int, precision: Precision = Precision.fp32) -> DictConfig:
    """The configuration of one of the probe's short RL runs."""
    run = copy.deepcopy(cfg)
    run.trainer.lr = lr
    run.trainer.steps = steps
    run.rollout.precision = precision
    run.routing.metrics = True
    run.routing.decompose_every = 1
    return run


def samples_of(records: list[dict[str, Any]], key: str) -> list[float]:
    """The measured values of `key`: one per off-policy minibatch for a minibatch quantity (the decomposition), one
    per step otherwise (the drift after one update is itself minibatch 1's)."""
    if key.startswith(PER_MINIBATCH):
        return [m[key] for r in records for m in r[metrics.MINIBATCHES] if m.get(key) is not None]
    return [r[key] for r in records if r.get(key) is not None]


def mean_and_sem(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and its standard error (sample std / sqrt(n); None with fewer than two values)."""
    if not values:
        return None, None
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    variance = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(variance / len(values))


def measure(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The reported means over the measured steps, each with its standard error (`<key>_sem`) and sample count
    (`<key>_n`); `drift_per_layer` and `topk_margin_median_per_layer` in layer order."""
    result: dict[str, Any] = {}
    for key in REPORTED:
        values = samples_of(records, key)
        result[key], result[f"{key}_sem"] = mean_and_sem(values)
        result[f"{key}_n"] = len(values)
    for name, prefix in (("drift_per_layer", PER_LAYER_DRIFT), ("topk_margin_median_per_layer", PER_LAYER_MARGIN)):
        layers = sorted(int(k.removeprefix(prefix)) for k in records[0] if k.startswith(prefix))
        result[name] = [mean_and_sem(samples_of(records, f"{prefix}{i}"))[0] for i in layers]
    return result


def run_probe(cfg: DictConfig, run_dir: Path, hydra_cfg: Any = None) -> dict[str, Any]:
    """Every setting of the probe, logged into `run_dir`; returns the summary. It lives and ends as every run does
    (`experiments.run.life`): a stop keeps its log whole and says so in `summary.json` and one line. Its settings'
    trainers are built as it goes, each after the last one's records."""
    return live(
        Job("the probe", lambda life, _: probe(life, cfg), prepare=lambda: check_probe(cfg)), run_dir, cfg, hydra_cfg
    )


def probe(life: Life, cfg: DictConfig) -> dict[str, Any]:
    """The probe's settings, each a short RL run from the cold start, then the engine's precisions (`run_probe`)."""
    p = cfg.probe
    name = f"probe-{cfg.model.name}-{cfg.dataset.name}"
    settings: list[dict[str, Any]] = []
    mismatches: list[dict[str, Any]] = []
    policy, answer_tokens = None, None
    steps = p.warm_steps + p.measure_steps
    threads = ThreadBudget(cfg.trainer.threads)
    total = len(p.lrs) * steps + len(p.precisions)

    def summary(status: str) -> dict[str, Any]:
        return {
            "status": status,
            "run": name,
            "run_dir": str(life.run_dir),
            "wall_s": life.elapsed()[0],
            "cpu_s": life.elapsed()[1],  # this process's CPU time over the job: what the result cost
            "model": cfg.model.name,
            "model_path": cfg.model.path,
            "cold_start": cold_start_record(cfg.model.path),
            "kernels": cpu_kernels.describe(cfg.cpu_kernels),
            "versions": provenance.versions(),
            "dataset": OmegaConf.to_container(cfg.dataset, resolve=True),  # nested settings too (a dict of them)
            "answer_tokens": answer_tokens,  # the task's designed answer length, eos included: the length axis
            "algo": cfg.algo.name,
            "policy": policy,
            "warm_steps": p.warm_steps,
            "measure_steps": p.measure_steps,
            "minibatches": cfg.trainer.minibatches,
            "settings": settings,
            "precision_mismatch": mismatches,
        }

    with life.running(summary, total, cfg, name, ["probe", f"model:{cfg.model.name}"]):
        bar = life.progress()
        for lr in p.lrs:
            trainer = RLTrainer(setting_config(cfg, lr, steps))
            policy = policy or describe_policy(trainer.model)
            answer_tokens = answer_tokens or reference_answer_tokens(trainer)
            records = []
            try:
                for step in range(steps):
                    threads.begin()
                    record = trainer.step()
                    threads.end()
                    phase = "warm" if step < p.warm_steps else "measure"
                    life.commit(probe_record(record, len(life.records), lr, phase))
                    records.append(record)
                    bar.update(1)
            except Diverged as error:  # a learning rate too large for this model: said, and the next one probed
                print(f"\nmoe-rl-lab: lr {lr:g} diverged at step {len(records) + 1}: {error}", file=sys.stderr)
                settings.append({"lr": lr, "diverged": str(error)})
                bar.update(steps - len(records))
                continue
            settings.append({"lr": lr, **measure(records[p.warm_steps :])})
        for precision in p.precisions:
            trainer = RLTrainer(setting_config(cfg, p.lrs[0], 1, Precision(precision)))
            record = trainer.step()
            life.commit(probe_record(record, len(life.records), p.lrs[0], f"precision_{precision}"))
            mismatches.append({"precision": str(precision), **{key: record.get(key) for key in MISMATCH}})
            bar.update(1)
    result = summary("finished")
    life.finish(result)
    print(table(result))
    return result


def reference_answer_tokens(trainer: RLTrainer) -> float:
    """Mean tokens of the held-out reference answers, plus their eos: how long a correct answer is, by design (the
    sampled length is an outcome, which a breaking update changes)."""
    answers = [example.answer for example in trainer.test_examples]
    lengths = [len(ids) + 1 for ids in trainer.tokenizer(answers, add_special_tokens=False)["input_ids"]]
    return sum(lengths) / len(lengths)


def cold_start_record(path: str | None) -> dict[str, Any] | None:
    """What the cold start's own summary says (steps, held-out accuracy), when the checkpoint has one."""
    record = Path(path) / "cold_start.json" if path else None
    return json.loads(record.read_text()) if record is not None and record.is_file() else None


def table(summary: dict[str, Any]) -> str:
    """The probe's findings as a few plain lines."""
    lines = [
        f"{summary['run']} ({summary['policy']['num_moe_layers']} MoE layers, {summary['policy']['num_experts']} "
        f"experts, top-{summary['policy']['num_experts_per_tok']}): {summary['wall_s']:.0f} s"
    ]
    lines.append(
        f"{'lr':>8}  {'drift/update':>12}  {'gate TV/update':>14}  {'routing share (± s.e.)':>22}  "
        f"{'logit margin':>12}  {'top-k margin':>12}  {'token ratio var':>15}  {'length':>6}"
    )
    for s in summary["settings"]:
        if "diverged" in s:
            lines.append(f"{s['lr']:>8.0e}  diverged: {s['diverged']}")
            continue
        lines.append(
            f"{s['lr']:>8.0e}  {_pct(s[metrics.DRIFT_PER_UPDATE]):>12}  "
            f"{_pct(s.get(metrics.GATE_DRIFT_PER_UPDATE)):>14}"
            f"  {_pct(s[metrics.ROUTING_SHARE], s[metrics.ROUTING_SHARE + '_sem']):>22}"
            f"  {_num(s[metrics.LOGIT_MARGIN]):>12}  {_num(s[metrics.TOPK_MARGIN_MEDIAN]):>12}"
            f"  {_num(s[TOKEN_RATIO_VAR]):>15}"
            f"  {_num(s[metrics.LENGTH]):>6}"
        )
    for m in summary["precision_mismatch"]:
        lines.append(
            f"engine in {m['precision']}: {_pct(m[metrics.ENGINE_EXPERTS])} of activated experts differ from "
            "the fp32 trainer's at the same weights"
        )
    return "\n".join(lines)


def _pct(value: float | None, sem: float | None = None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2%}" + ("" if sem is None else f" ± {sem:.2%}")


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}"


@hydra.main(version_base="1.3", config_path="../conf", config_name="probe")
def main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    run_probe(cfg, Path(hydra_cfg.runtime.output_dir), hydra_cfg)


register_configs()
if __name__ == "__main__":
    refuse_mistyped_overrides(sys.argv[1:], ProbeConfig)
    main()
