"""Cold start: supervised next-token training on task demonstrations, so RL starts with reward variance.

A random policy almost never answers correctly, so every group would have zero reward variance and zero
advantage. A short SFT phase brings held-out accuracy into the useful 20-60% band (RL needs groups with both
right and wrong answers) and trains the routers, which makes routing decisive rather than a near-tie that flips
on numerical noise. Training stops at `sft.target_accuracy` (greedy, held-out) or at the time budget, whichever
comes first, then writes `save_pretrained` + tokenizer to `sft.output_dir`, which RL runs load with `model.path`.

The loss covers the demonstration and its eos only (prompt tokens are context). Sequences are left-padded with
position ids that skip the padding, exactly as in RL scoring and generation.

Routers like real ones. Real MoEs are trained with their family's own load balancing and on varied data, so many
tokens sit near the top-k cut; two settings give a cold start both. `routers=[aux_loss]` (the softmax family: the
global-batch load-balancing loss at Qwen3's 1e-3) or `routers=[bias_update]` (the sigmoid family: DeepSeek-V3's
bias step at 1e-3 and its 1e-4 sequence-wise loss) balance every step (`algos.routers`). `sft.pretrain_steps`
first trains on every token of a mixture of the lab's tasks in their formats (`sft.pretrain_tasks` and the cold
start's own task, drawn evenly), so experts specialise by token kind; the task's SFT follows with the same optimizer.
Whatever the recipe, `summary.json` and `cold_start.json` report how the cold start routes its held-out
demonstrations (`routing_profile`): expert-load entropy, max load / mean load and the scale-free margin at the
top-k cut, held against the real checkpoints' (`models.routing.measures.MARGIN_ANCHORS`; `python -m analysis.margins`).

Run: `python -m experiments.sft` (tiny MoE, addition) or `python -m experiments.sft model=deep_moe`; balanced:
`python -m experiments.sft model=qwen30b_l16 routers=[aux_loss] sft.pretrain_steps=200`.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from algos.routers import RouterSwitch, RunFacts, build_router_switches
from experiments.config import SFTConfig, refuse_mistyped_overrides, register_configs
from experiments.run import provenance, rundir
from experiments.run.life import Job, Life, live
from experiments.run.recipe import COLD_START_FILE, recipe_of, recipe_sha256
from experiments.run.threads import ThreadBudget
from experiments.step import metrics as m
from experiments.step.batch import evaluate
from experiments.step.checks import (
    check_device,
    check_logger,
    check_training_dtype,
    check_vocabulary,
    longest_tokens,
    unknown_keys,
)
from experiments.step.engines import HFEngine
from experiments.step.metrics import TOPK_MARGIN_MEAN, TOPK_MARGIN_MEDIAN, TOPK_MARGIN_SMALL, per_layer
from experiments.step.optimizer import cold_start_optimizer
from experiments.step.scoring import margin_stats, position_ids, router_fragility
from experiments.tasks import Example, Task, build_task
from models import cpu_kernels
from models.policy import SIGMOID_FAMILIES, ModelConfig, build_policy, describe_policy, is_moe, model_config
from models.registry import ConfigError, node_settings
from models.routing.families import route
from models.routing.hooks import RouterCalls, RouterCapture, router_calls
from models.routing.measures import SMALL_MARGIN, top_gap_share
from models.routing.trace import find_routers
from models.statistics import median_interval, weighted_median

register_configs()

IGNORE = -100
MIXTURE_STREAM = 0x3A7E  # offsets the pretraining mixture's draws from the task's: those stay the same


def demonstration_batch(
    tokenizer: PreTrainedTokenizerBase, examples: list[Example], every_token: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`prompt + demonstration + eos`, left-padded: (input_ids, attention_mask, labels) each `[B, S]`.

    Labels are the input ids on demonstration and eos positions and IGNORE elsewhere (transformers shifts them);
    with `every_token` (pretraining) on the prompt's tokens too.
    """
    rows, targets = [], []
    for example in examples:
        prompt = tokenizer(example.prompt, add_special_tokens=False)["input_ids"]
        answer = tokenizer(example.demonstration, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(prompt + answer)
        targets.append((prompt if every_token else [IGNORE] * len(prompt)) + answer)
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, target) in enumerate(zip(rows, targets)):
        input_ids[i, width - len(row) :] = torch.tensor(row)
        labels[i, width - len(row) :] = torch.tensor(target)
        attention_mask[i, width - len(row) :] = 1
    return input_ids, attention_mask, labels


def check_settings(cfg: DictConfig) -> None:
    """The cold start's start-up checks, as training's: unknown keys, ranges, an output directory it can write."""
    unknown = unknown_keys(cfg)
    if unknown:
        raise ConfigError(f"unknown config key(s) {', '.join(unknown)}: no schema declares them")
    s = cfg.sft
    for key in ("max_steps", "batch_size", "eval_every", "eval_prompts"):
        if s[key] < 1:
            raise ConfigError(f"sft.{key}={s[key]} must be >= 1")
    if not 0 <= s.warmup_steps < s.max_steps:
        raise ConfigError(f"sft.warmup_steps={s.warmup_steps} must be >= 0 and below sft.max_steps={s.max_steps}")
    if s.pretrain_steps < 0:
        raise ConfigError(f"sft.pretrain_steps={s.pretrain_steps} must be >= 0 (0: no pretraining phase)")
    for key in ("lr", "max_seconds"):
        if not (math.isfinite(s[key]) and s[key] > 0):
            raise ConfigError(f"sft.{key}={s[key]} must be a finite number > 0")
    if not (math.isfinite(s.weight_decay) and s.weight_decay >= 0):
        raise ConfigError(f"sft.weight_decay={s.weight_decay} must be a finite number >= 0")
    if not 0 < s.target_accuracy <= 1:
        raise ConfigError(f"sft.target_accuracy={s.target_accuracy} must be in (0, 1]")
    if s.threads is not None and s.threads < 1:
        raise ConfigError(f"sft.threads={s.threads} must be >= 1, or null to follow the machine's free cores")
    check_device(cfg.device)
    check_training_dtype(cfg.model.dtype, cfg.device)
    check_logger(cfg.logger)
    try:
        rundir.make_writable_dir(s.output_dir)
    except OSError as error:
        raise ConfigError(f"sft.output_dir={s.output_dir!r} cannot be written: {error.strerror}") from None


def router_switches(cfg: DictConfig, model_cfg: ModelConfig) -> list[RouterSwitch]:
    """The router switches the cold start trains with, each checked against the model (`algos.routers`)."""
    switches = build_router_switches(node_settings(cfg.routers))
    family = model_config(model_cfg).model_type
    if switches and not is_moe(model_config(model_cfg)):
        raise ConfigError(
            f"routers=[{','.join(s.name for s in switches)}] act on MoE routers, and model "
            f"{cfg.model.name!r} has none: use routers=[]"
        )
    for switch in switches:
        switch.check(RunFacts(cfg.model.name, family in SIGMOID_FAMILIES))
    return switches


def pretraining_mixture(cfg: DictConfig, own: list[Example]) -> list[list[Example]]:
    """The train examples of each task of the pretraining mixture: `sft.pretrain_tasks` at their defaults, then the
    cold start's own task (`own`); empty without a pretraining phase."""
    tasks = [build_task(name) for name in cfg.sft.pretrain_tasks]  # each name checked, with or without the phase
    return [task.examples("train") for task in tasks] + [own] if cfg.sft.pretrain_steps else []


def mixture_batch(mixture: list[list[Example]], size: int, generator: torch.Generator) -> list[Example]:
    """`size` examples, each from a task of the mixture drawn evenly, then an example of it drawn evenly."""
    tasks = torch.randint(len(mixture), (size,), generator=generator).tolist()
    return [mixture[t][int(torch.randint(len(mixture[t]), (1,), generator=generator))] for t in tasks]


PROFILE = ("load_entropy", "load_max_over_mean", TOPK_MARGIN_MEDIAN, TOPK_MARGIN_MEAN, TOPK_MARGIN_SMALL)
# The pooled median margin's 95% interval: how far another draw of as many held-out sequences could move it
# (`models.statistics.median_interval`, resampling sequences).
MEDIAN_INTERVAL = "topk_margin_median_interval"


@torch.no_grad()
def routing_profile(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, examples: list[Example]
) -> dict[str, Any] | None:
    """How `model` routes the demonstrations of `examples` (prompt, answer and eos, one forward in eval mode): per
    MoE layer the expert loads of the routers' own top-k, their entropy over log E (`load_entropy`: 1 when every
    expert carries the same load) and the largest load over the mean (`load_max_over_mean`: 1 when balanced),
    each the mean over layers; and the scale-free margin at the top-k cut (`models.routing.measures.topk_margin` on the
    family's selection scores: median, mean and share below 0.01 over tokens and layers, the median's 95% interval
    over draws of the sequences (`MEDIAN_INTERVAL`), and the median per layer), what the anchors of real checkpoints
    measure (`models.routing.measures.MARGIN_ANCHORS`), with what makes it small: the medians over tokens and layers of
    the best expert's lead over the margin's spread (`models.routing.measures.top_gap_share`) and of the best score;
    and the medians of the best and the last chosen expert's share of the token's gate mass (`gate_shares`). None for
    a dense model."""
    if not find_routers(model):
        return None
    model.eval()
    input_ids, attention_mask, _ = demonstration_batch(tokenizer, examples)
    device = next(model.parameters()).device
    with router_calls(model) as calls:
        model(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            position_ids=position_ids(attention_mask).to(device),
            use_cache=False,
        )
    routers = RouterCalls.of(calls, attention_mask.to(device))
    w = routers.flat_weights
    layers = len(routers.calls)
    loads = torch.stack([(routers.chosen(layer) * w.unsqueeze(-1)).sum(dim=0) for layer in range(layers)])
    share = loads / loads.sum(dim=-1, keepdim=True)
    experts = share.shape[-1]
    entropy = -(share * share.clamp_min(1e-30).log()).sum(dim=-1) / math.log(experts)
    stats, margins = router_fragility(routers, SMALL_MARGIN)
    stats.update(margin_stats(margins, w))
    sequence = torch.arange(attention_mask.shape[0]).repeat_interleave(attention_mask.shape[1]).to(w.device)
    ranked = [routers.ranked(layer).values for layer in range(layers)]  # the ranking the margins were read from
    gates = [gate_shares(*call) for call in routers.calls]  # [T, k] per layer: each chosen expert's share of the mass
    every_layer = w.repeat(layers)  # a weight per (layer, token), laid out as the margins and rankings are
    return {
        "load_entropy": float(entropy.mean()),
        "load_max_over_mean": float((share.max(dim=-1).values * experts).mean()),
        **{name: stats[name] for name in PROFILE[2:]},
        MEDIAN_INTERVAL: list(median_interval(margins.reshape(-1), every_layer, sequence.repeat(layers))),
        "topk_margin_median_per_layer": [stats[per_layer(TOPK_MARGIN_MEDIAN, i)] for i in range(layers)],
        "top_gap_share_median": weighted_median(torch.cat([top_gap_share(top) for top in ranked]), every_layer),
        "top_score_median": weighted_median(torch.cat([top[:, 0] for top in ranked]), every_layer),
        # the token's gate mass on its best chosen expert, and on its last: what a change of experts at the cut
        # moves at most (`models.routing.measures.gate_shift`); near 1 and 0, the router is one-hot in all but name
        "gate_share_best_median": weighted_median(
            torch.cat([share.max(dim=-1).values for share in gates]), every_layer
        ),
        "gate_share_last_median": weighted_median(
            torch.cat([share.min(dim=-1).values for share in gates]), every_layer
        ),
    }


def gate_shares(router: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """`[T, k]`: each chosen expert's share of its token's gate mass, the family's own gate weights (`route`)
    normalised to sum 1 (the sigmoid family scales them by `routed_scaling_factor`)."""
    weights, _ = route(router, logits.detach())
    return weights / weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)


def cold_start(cfg: DictConfig, run_dir: str | Path, hydra_cfg: Any = None) -> tuple[PreTrainedModel, dict[str, Any]]:
    """Pretrain on the mixture (`sft.pretrain_steps`), then train on the task until the target accuracy or the
    budget; save the checkpoint; return the model and a summary. It lives and ends as every run does
    (`experiments.run.life`): a stop or divergence keeps its log whole, says so in `summary.json` and one line, and
    saves no checkpoint."""
    done = live(
        Job(
            "the cold start",
            lambda life, parts: train_cold_start(life, cfg, parts),
            lambda life: ColdStartParts.build(cfg),
            prepare=lambda: check_settings(cfg),
        ),
        run_dir,
        cfg,
        hydra_cfg,
    )
    # A job that does not resume returns its own result (`live`), never a finished run's summary.
    return cast(tuple[PreTrainedModel, dict[str, Any]], done)


@dataclass(frozen=True)
class ColdStartParts:
    """What a cold start trains (the policy, its tokenizer, the task) and with what: the pretraining mixture
    (`pretraining_mixture`) and the router switches that balance it."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    task: Task
    mixture: list[list[Example]]
    switches: list[RouterSwitch]

    @classmethod
    def build(cls, cfg: DictConfig) -> ColdStartParts:
        """The parts the settings name, each refused in one line when it cannot serve (before the first step)."""
        model_cfg = ModelConfig(**node_settings(cfg.model))
        switches = router_switches(cfg, model_cfg)
        model, tokenizer = build_policy(model_cfg)
        dataset = dict(node_settings(cfg.dataset))
        task = build_task(dataset.pop("name"), **dataset)
        check_vocabulary(tokenizer, task, task.examples("train") + task.examples("test"))
        if cfg.sft.eval_prompts > len(task.examples("test")):
            raise ConfigError(
                f"sft.eval_prompts={cfg.sft.eval_prompts} is more than the "
                f"{len(task.examples('test'))} held-out examples of dataset {task.name!r}"
            )
        return cls(model, tokenizer, task, pretraining_mixture(cfg, task.examples("train")), switches)


@dataclass
class Progress:
    """Where a cold start stands: steps taken, the last step's loss, the last held-out greedy accuracy, whether
    `sft.max_seconds` ran out."""

    step: int = 0
    loss: float = float("nan")
    accuracy: float = 0.0
    out_of_time: bool = False


def train_cold_start(life: Life, cfg: DictConfig, parts: ColdStartParts) -> tuple[PreTrainedModel, dict[str, Any]]:
    """The cold start's steps, its checkpoint and its summary (`cold_start`)."""
    s, model = cfg.sft, parts.model
    threads = ThreadBudget(s.threads)
    torch.manual_seed(cfg.seed)
    device = torch.device(cfg.device)
    # functools.wraps hides from mypy that PreTrainedModel.to is a method (typeshed's _Wrapped binds no self).
    model.to(device)  # type: ignore[arg-type]
    for switch in parts.switches:
        switch.start(model)
    test = parts.task.examples("test")[: s.eval_prompts]
    # Room for the longest held-out demonstration and its eos: a longer completion is wrong whatever it says.
    eval_tokens = longest_tokens(parts.tokenizer, [example.demonstration for example in test]) + 1
    total = s.pretrain_steps + s.max_steps
    optimizer, scheduler = cold_start_optimizer(model, s, total)
    batches = DemonstrationBatches(cfg, parts)
    name = f"sft-{cfg.model.name}-{cfg.dataset.name}"
    progress = Progress()

    def summary(status: str) -> dict[str, Any]:
        return cold_start_summary(cfg, name, parts.switches, life.records, life.elapsed(), status)

    with life.running(summary, total, cfg, name, ["sft", f"model:{cfg.model.name}"]):
        bar = life.progress()
        while progress.step < total:
            progress.step += 1
            threads.begin()
            model.train()
            record = {m.STEP: progress.step, **update(parts, batches.next(progress.step), optimizer, scheduler, device)}
            progress.loss = record[m.SFT_LOSS]
            threads.end()
            elapsed = life.elapsed()[0]
            progress.out_of_time = elapsed >= s.max_seconds
            record[m.ELAPSED] = elapsed
            if s.pretrain_steps:
                record[m.SFT_PRETRAINING] = float(progress.step <= s.pretrain_steps)
            task_step = progress.step - s.pretrain_steps
            if task_step > 0 and (task_step % s.eval_every == 0 or progress.out_of_time or progress.step == total):
                model.eval()
                metrics = evaluate(
                    HFEngine(model, parts.tokenizer),
                    parts.task,
                    test,
                    samples=0,
                    max_new_tokens=eval_tokens,
                    temperature=1.0,
                )
                progress.accuracy = metrics[m.EVAL_GREEDY]
                record.update(metrics)
            life.commit(record)
            bar.update(1)
            bar.set_postfix(loss=f"{progress.loss:.3f}", greedy_acc=f"{progress.accuracy:.2f}")
            if progress.accuracy >= s.target_accuracy or progress.out_of_time:
                break
        bar.close()  # before the checkpoint's lines
        model.eval()
        output_dir = Path(s.output_dir)
        model.save_pretrained(output_dir)
        parts.tokenizer.save_pretrained(output_dir)
    result = finished_summary(summary("finished"), progress, parts, output_dir, test)
    life.finish(result)
    say_how_it_ended(cfg, progress, result)
    return model, result


class DemonstrationBatches:
    """The cold start's batches, step by step: during pretraining (`sft.pretrain_steps`) every token of draws from the
    mixture, then the task's demonstrations, each from its own generator so that the task's draws do not depend on
    whether the cold start pretrained."""

    def __init__(self, cfg: DictConfig, parts: ColdStartParts) -> None:
        self.s, self.parts = cfg.sft, parts
        self.train = parts.task.examples("train")
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.mixer = torch.Generator().manual_seed(cfg.seed + MIXTURE_STREAM)

    def next(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if step <= self.s.pretrain_steps:
            examples = mixture_batch(self.parts.mixture, self.s.batch_size, self.mixer)
            return demonstration_batch(self.parts.tokenizer, examples, every_token=True)
        picks = torch.randint(len(self.train), (self.s.batch_size,), generator=self.generator).tolist()
        return demonstration_batch(self.parts.tokenizer, [self.train[i] for i in picks])


def update(
    parts: ColdStartParts,
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    device: torch.device,
) -> dict[str, Any]:
    """One optimizer update on `batch`: the next-token loss plus the router switches' own, then the balancing the
    switches do between updates (the sigmoid family's selection bias); the step's record."""
    model, switches = parts.model, parts.switches
    input_ids, attention_mask, labels = batch
    with router_calls(model) if switches else contextlib.nullcontext(RouterCapture()) as calls:
        out = model(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            position_ids=position_ids(attention_mask).to(device),
            labels=labels.to(device),
            use_cache=False,
        )
    routers = RouterCalls.of(calls, attention_mask.to(device))
    loss = out.loss + sum(switch.loss(routers, None) for switch in switches)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    lr = scheduler.get_last_lr()[0]  # the rate this step's update used
    optimizer.step()
    scheduler.step()
    record = {m.SFT_LOSS: float(out.loss.detach()), m.LR: lr}
    for switch in switches:
        record.update(switch.after_update(model, routers, lambda tensor: tensor))
    return record


def cold_start_summary(
    cfg: DictConfig,
    name: str,
    switches: list[RouterSwitch],
    done: list[dict[str, Any]],
    elapsed: tuple[float, float],
    status: str,
) -> dict[str, Any]:
    """What the cold start is so far: how it ended and its numbers (the finished one adds the checkpoint's), read
    from its committed steps (`done`, the life's records): a stop or divergence never counts the step it cut, whose
    loss and evaluation the cold start's `Progress` may already hold; `elapsed`: its wall and CPU seconds so far."""
    s = cfg.sft
    evaluated = [record[m.EVAL_GREEDY] for record in done if m.EVAL_GREEDY in record]
    accuracy = evaluated[-1] if evaluated else 0.0
    return {
        "status": status,
        "run": name,
        "dataset": OmegaConf.to_container(cfg.dataset, resolve=True),  # nested settings too (a dict of them)
        "steps": len(done),
        "pretrain_steps": min(len(done), s.pretrain_steps),
        "routers": [switch.name for switch in switches],
        "wall_s": elapsed[0],
        "cpu_s": elapsed[1],  # this process's CPU time over the job: what it cost
        "final_loss": done[-1][m.SFT_LOSS] if done else float("nan"),
        "eval_greedy_accuracy": accuracy,
        "target_accuracy": s.target_accuracy,
        "reached_target": accuracy >= s.target_accuracy,
        "threads": s.threads,
        "kernels": cpu_kernels.describe(cfg.cpu_kernels),
        "versions": provenance.versions(),
        # what this start is a draw of: a report pools starts of one recipe only (experiments.run.recipe)
        "recipe": recipe_of(cfg),
        "recipe_sha256": recipe_sha256(recipe_of(cfg)),
    }


def finished_summary(
    summary: dict[str, Any], progress: Progress, parts: ColdStartParts, output_dir: Path, test: list[Example]
) -> dict[str, Any]:
    """The finished cold start's summary: what ended it, its checkpoint and how it routes; written beside the
    checkpoint too (`cold_start.json`), where RL runs and the analysis read it."""
    reached = progress.accuracy >= summary["target_accuracy"]
    result = {
        **summary,
        # what ended it: the target (or max_steps) are the recipe; the time limit is not, and the summary says so
        "stopped_by": "max_seconds" if progress.out_of_time else "target_accuracy" if reached else "max_steps",
        "checkpoint": str(output_dir),
        "weights_sha256": cpu_kernels.weights_sha256(parts.model),  # the start's identity, also in every RL run's
        "routing": routing_profile(parts.model, parts.tokenizer, test),  # on the held-out demonstrations, trained
        "policy": describe_policy(parts.model),  # the experts and attention implementations computed with, and more
    }
    (output_dir / COLD_START_FILE).write_text(json.dumps(result, indent=2) + "\n")
    return result


def say_how_it_ended(cfg: DictConfig, progress: Progress, result: dict[str, Any]) -> None:
    """A warning for a checkpoint the command alone does not make (the time limit ended it) or that RL will learn
    little from (below the target accuracy); then the cold start in one line."""
    s = cfg.sft
    if progress.out_of_time:
        warnings.warn(
            f"cold start stopped by sft.max_seconds={s.max_seconds:g} after {progress.step} steps: this checkpoint "
            "depends on the machine's speed, not only on the command; raise sft.max_seconds to get the documented one",
            stacklevel=2,
        )
    if not result["reached_target"]:
        warnings.warn(
            f"cold start stopped at {progress.accuracy:.1%} held-out accuracy, below sft.target_accuracy="
            f"{s.target_accuracy}: RL from this checkpoint will see little reward variance; raise sft.max_steps",
            stacklevel=2,
        )
    profile = result["routing"]
    routing = (
        ""
        if profile is None
        else (
            f"; load entropy {profile['load_entropy']:.3f}, max / mean load {profile['load_max_over_mean']:.2f}, top-k "
            f"margin median {profile[TOPK_MARGIN_MEDIAN]:.4f}"
        )
    )
    print(
        f"{result['run']}: {progress.step} steps in {result['wall_s']:.0f} s, loss {progress.loss:.3f}, held-out "
        f"greedy accuracy {progress.accuracy:.1%} (target {s.target_accuracy:.0%}){routing}. Checkpoint: "
        f"{result['checkpoint']} (weights sha256 {result['weights_sha256'][:12]}, {cfg.cpu_kernels} CPU kernels)"
    )


@hydra.main(version_base="1.3", config_path="../conf", config_name="sft")
def main(cfg: DictConfig) -> float:
    hydra_cfg = HydraConfig.get()
    return cold_start(cfg, hydra_cfg.runtime.output_dir, hydra_cfg)[1]["eval_greedy_accuracy"]


if __name__ == "__main__":
    refuse_mistyped_overrides(sys.argv[1:], SFTConfig)
    main()
