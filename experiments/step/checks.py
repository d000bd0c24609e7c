"""Every start-up check of an RL run, before anything is built: `check_run`, one place per concern.

A refusal is one line (`ConfigError`) naming the value and what is allowed. Each concern is checked once, where it
lives: the keys the schemas declare and the trainer's and routing's ranges here; an objective's, a correction's and a
routing variant's and a router switch's parameters in their own `validate` (`algos/`); what a routing variant or a
router switch can serve in its `check`;
the engine's settings and what the run needs from it in the engine's `check` (`engines/`); a rollout source's settings
in its `check` (`sources/`), and which source's they are in `check_rollout_source`; where π_old comes from and
the minibatch layout in `plan.plan_step`; the model's files and sizes in `models.policy.model_config`; a task's
parameters in the task; and here what the parts must agree on, the task's budget and the step's memory.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from algos import build_objective
from algos.corrections import Correction, build_correction
from algos.objective import Objective
from algos.routers import RouterSwitch, RunFacts, build_router_switches
from algos.routing_variants import RoutingVariant, build_routing_variant
from experiments.step.engines import ENGINES, EngineNumerics, Needs, RolloutEngine
from experiments.step.memory import GIB, StepMemory, available_bytes, step_memory
from experiments.step.plan import PiOld, Replay, StepPlan, plan_step
from experiments.step.sources import ROLLOUT_SOURCES, RolloutSource
from experiments.step.sources.base import as_written, off_default
from experiments.tasks import Example, Task, build_task
from models.policy import DTYPES, SIGMOID_FAMILIES, ModelConfig, is_moe, model_config
from models.registry import ConfigError, node_settings
from models.tokenizer import build_char_tokenizer

# The devices a run trains on, and the weight dtypes it trains in. Not float16: AdamW keeps its moments in the weights'
# dtype, and in float16 the second moment of a small gradient underflows to 0, so the next update divides by about
# eps and the weights blow up (the micro MoE's logits were non-finite after its first RL step on CPU).
TRAIN_DEVICES = ("cpu", "cuda", "cuda:<index>")
TRAINABLE_DTYPES = ("float32", "bfloat16")
# The smallest learning rate that trains: an AdamW update moves each weight by about lr, and float32 rounds away a
# change smaller than half a weight's spacing (|w| x 6e-8), so below this no weight larger than 1e-3 would move.
MIN_LR = 1e-10


@dataclass(frozen=True)
class RunParts:
    """Everything a run is made of that is cheap to build: what `check_run` builds, and RLTrainer starts from."""

    plan: StepPlan
    model_cfg: ModelConfig
    numerics: EngineNumerics
    engine: type[RolloutEngine]
    source: type[RolloutSource]
    objective: Objective
    advantage_std: bool
    correction: Correction
    variant: RoutingVariant
    switches: list[RouterSwitch]
    task: Task
    train_examples: list[Example]
    test_examples: list[Example]
    eval_split_batch: int  # test prompts per batch of the whole-split evaluation, per rank (`step_memory`)


def check_run(cfg: DictConfig, world: int = 1, memory: bool = True) -> RunParts:
    """Every start-up check of an RL run on `world` ranks, without building the model: settings, the model's files
    and sizes, the objective, the engine, the task and its splits, prompts that fit the model's positions, and
    (`memory`) whether one rank's step fits in the device's free memory. The whole-split evaluation's batch is sized
    whatever `memory` says: from the estimate, not from the machine."""
    check_cold_start(cfg)
    model_cfg = ModelConfig(**node_settings(cfg.model))
    hf_config = model_config(model_cfg)
    moe = is_moe(hf_config)
    name, advantage_std, hyperparameters = algo_hyperparameters(cfg.algo)
    objective = build_objective(name, **hyperparameters)
    correction = build_correction(**node_settings(cfg.correction))
    variant = build_routing_variant(**node_settings(cfg.routing_variant))
    switches = build_router_switches(node_settings(cfg.routers))
    check_known_keys(cfg)
    check_logger(cfg.logger)
    check_trainer(cfg.trainer, moe, world)
    source = check_rollout_source(cfg.rollout, world, cfg.trainer.steps)
    check_routing(cfg.routing, moe, cfg.model.name)
    if cfg.routing.perturb_rate and world > 1:
        raise ConfigError(
            f"routing.perturb_rate={cfg.routing.perturb_rate} sizes the router noise on one rank's "
            f"tokens and weights; run it on one rank (this run has {world})"
        )
    check_device(cfg.device)
    check_training_dtype(cfg.model.dtype, cfg.device)
    engine = ENGINES[cfg.rollout.engine]
    plan = plan_step(cfg, moe, engine, source, variant, correction.name if correction.needs_decoupled else None, world)
    engine.check(cfg, world, engine_needs(plan, objective, correction))
    check_agreement(objective, correction)
    variant.check(plan.replay, cfg.model.name, moe)
    check_predictors(plan, cfg.trainer.minibatches)
    t = cfg.trainer
    check_switches(
        switches,
        RunFacts(
            cfg.model.name,
            hf_config.model_type in SIGMOID_FAMILIES,
            plan.replay,
            variant.name,
            t.router_lr_scale,
            world,
            t.checkpoint_every,
            (t.steps - 1) * t.minibatches,
        ),
        moe,
    )
    task, train_examples, test_examples = check_task(cfg, model_cfg)
    prompt_tokens = check_positions(
        cfg, hf_config, tokenizer_of(model_cfg), task.name, {"train": train_examples, "test": test_examples}
    )
    estimate = step_memory(hf_config, cfg, prompt_tokens, DTYPES[model_cfg.dtype].itemsize, world, len(test_examples))
    if memory:
        check_memory(cfg, estimate)
    return RunParts(
        plan,
        model_cfg,
        EngineNumerics.of(cfg.rollout),
        engine,
        source,
        objective,
        advantage_std,
        correction,
        variant,
        switches,
        task,
        train_examples,
        test_examples,
        estimate.split_batch,
    )


def algo_hyperparameters(algo_cfg: Any) -> tuple[str, bool, dict[str, Any]]:
    """Split an `algo` node into (objective name, divide advantages by std, objective hyperparameters)."""
    params = dict(algo_cfg)
    return params.pop("name"), bool(params.pop("advantage_std")), params


def unknown_keys(node: Any, prefix: str = "") -> list[str]:
    """Keys of `node` that its schema does not declare: Hydra lets `+key=value` add them, and nothing would read
    them."""
    schema = OmegaConf.get_type(node)
    declared = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None
    found = []
    for key in node.keys():
        if key == "hydra" and not prefix:
            continue  # Hydra's own node, which a composed job config carries
        if declared is not None and key not in declared:
            found.append(f"{prefix}{key}")
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            found += unknown_keys(child, f"{prefix}{key}.")
    return found


def check_known_keys(cfg: Any) -> None:
    """Refuse keys no schema declares (a composed config; a plain one, built in a test, has no schema to hold)."""
    unknown = unknown_keys(cfg) if isinstance(cfg, DictConfig) else []
    if unknown:
        raise ConfigError(
            f"unknown config key(s) {', '.join(unknown)}: no schema declares them, so nothing would read them "
            "(`+key=value` adds keys; misspelt? `python -m experiments.train --cfg job` prints every key)"
        )


def check_logger(logger: Any) -> None:
    """The `logger` settings' ranges."""
    timeout = logger.wandb.init_timeout
    if not (math.isfinite(timeout) and timeout > 0):
        raise ConfigError(f"logger.wandb.init_timeout={timeout} must be a finite number of seconds > 0")


def check_rollout_source(rollout: Any, world: int, steps: int) -> type[RolloutSource]:
    """The rollout source `rollout.source` names, whose settings it checks (`RolloutSource.check`); a setting of
    another source off its schema default is refused, as nothing would read it."""
    if rollout.source not in ROLLOUT_SOURCES:
        raise ConfigError(f"rollout.source={rollout.source} is not one of {', '.join(ROLLOUT_SOURCES)}")
    source = ROLLOUT_SOURCES[rollout.source]
    for name, other in ROLLOUT_SOURCES.items():
        for key in other.settings if other is not source else ():
            if (found := off_default(rollout, key)) is not None:
                value, default = map(as_written, found)
                raise ConfigError(
                    f"rollout.{key}={value} is a setting of rollout.source={name}, and this run's source is "
                    f"{source.name}: use rollout.source={name}, or leave rollout.{key} at {default}"
                )
    source.check(rollout, world, steps)
    return source


def check_trainer(t: Any, moe: bool, world: int) -> None:
    """The ranges of the `trainer` settings, and how the batch splits over `world` ranks and into minibatches."""
    for key in ("prompts_per_step", "steps", "max_new_tokens", "max_consecutive_skips"):
        if t[key] < 1:
            raise ConfigError(f"trainer.{key}={t[key]} must be >= 1")
    for key in ("warmup_steps", "eval_every", "eval_prompts", "eval_samples", "checkpoint_every"):
        if t[key] < 0:
            raise ConfigError(f"trainer.{key}={t[key]} must be >= 0")
    for key in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= t[key] < 1.0:
            raise ConfigError(f"trainer.{key}={t[key]} must be in [0, 1)")
    if not (math.isfinite(t.weight_decay) and t.weight_decay >= 0):
        raise ConfigError(f"trainer.weight_decay={t.weight_decay} must be a finite number >= 0")
    if t.keep_checkpoints < 1:
        raise ConfigError(
            f"trainer.keep_checkpoints={t.keep_checkpoints} must be >= 1 (the newest is what resume reads)"
        )
    if 0 < t.eval_prompts < world:
        raise ConfigError(f"trainer.eval_prompts={t.eval_prompts} gives some of the {world} ranks no held-out prompt")
    if t.threads is not None and t.threads < 1:
        raise ConfigError(f"trainer.threads={t.threads} must be >= 1, or null to follow the machine's free cores")
    if t.group_size < 2:
        raise ConfigError(f"trainer.group_size={t.group_size}: group advantages need at least 2 completions per prompt")
    if t.prompts_per_step % world:
        raise ConfigError(
            f"trainer.prompts_per_step={t.prompts_per_step} does not split over the {world} ranks: each rank samples "
            "whole groups of an equal share of the prompts"
        )
    batch = t.prompts_per_step * t.group_size // world
    if t.minibatches < 1 or batch % t.minibatches:
        raise ConfigError(
            f"trainer.minibatches={t.minibatches} does not divide the batch of "
            f"{t.prompts_per_step // world} prompts x {t.group_size} completions = {batch}"
            + (f" that each of the {world} ranks holds" if world > 1 else "")
        )
    for key in ("temperature", "lr", "grad_clip"):
        if not (math.isfinite(t[key]) and t[key] > 0):
            raise ConfigError(f"trainer.{key}={t[key]} must be a finite number > 0")
    if not (math.isfinite(t.router_lr_scale) and t.router_lr_scale > 0):
        raise ConfigError(
            f"trainer.router_lr_scale={t.router_lr_scale} must be a finite number > 0 (to freeze the "
            "routers: routers=[freeze])"
        )
    if t.lr < MIN_LR:
        raise ConfigError(
            f"trainer.lr={t.lr} is below {MIN_LR:g}: an AdamW update moves each weight by about lr, "
            "less than float32 can add to any weight larger than 1e-3, so the run would train nothing"
        )


def check_predictors(plan: StepPlan, minibatches: int) -> None:
    """Where the plan has the engine route by predictors, they are trained from the second minibatch of a step on
    (PR2's Algorithm 3 skips the first mini-step, where θ = θ_old): one minibatch would never train them."""
    if not plan.engine_predicts_routes:
        return
    if minibatches < 2:
        raise ConfigError(
            f"routing_variant={plan.routing_variant} trains its predictors from the second minibatch of a step "
            f"on, and trainer.minibatches={minibatches} has none: use trainer.minibatches >= 2"
        )


def check_switches(switches: list[RouterSwitch], run: RunFacts, moe: bool) -> None:
    """The router switches that are on: a dense model has no router to switch, and each refuses what it cannot
    serve (`algos.routers`)."""
    if switches and not moe:
        raise ConfigError(
            f"routers=[{','.join(s.name for s in switches)}] act on MoE routers, and model {run.model!r} "
            "has none: use routers=[]"
        )
    for switch in switches:
        switch.check(run)


def check_cold_start(cfg: DictConfig) -> None:
    """A `model.path` that does not exist, refused with the command that makes it: an experiment names the cold start
    its runs begin from, and `python -m experiments.sft` is what writes one."""
    path = cfg.model.path
    if path is None or Path(path).expanduser().exists():
        return
    raise ConfigError(
        f"model.path={path!r} does not exist: make this cold start with `python -m experiments.sft "
        f"model={cfg.model.name} dataset={cfg.dataset.name} sft.output_dir={path}`"
    )


def check_routing(routing: Any, moe: bool, model: str) -> None:
    """The `routing` settings: their ranges, and a dense model has nothing to replay, split or flip."""
    if not moe and routing.replay != Replay.none:
        raise ConfigError(
            f"routing.replay={routing.replay} needs an MoE model, but model {model!r} has no MoE layers; "
            "use routing.replay=none"
        )
    if not (math.isfinite(routing.margin_threshold) and routing.margin_threshold >= 0):
        raise ConfigError(f"routing.margin_threshold={routing.margin_threshold} must be a finite number >= 0")
    if routing.decompose_every < 0:
        raise ConfigError(f"routing.decompose_every={routing.decompose_every} must be >= 0 (0: never)")
    if routing.decompose_every and not moe:
        raise ConfigError(
            f"routing.decompose_every={routing.decompose_every} splits a routing part: needs an MoE model"
        )
    flip_rate = routing.flip_rate
    if not (math.isfinite(flip_rate) and 0.0 <= flip_rate <= 1.0):
        raise ConfigError(
            f"routing.flip_rate={flip_rate} must be a probability in [0, 1] (the share of experts flipped)"
        )
    if flip_rate and not moe:
        raise ConfigError(f"routing.flip_rate={flip_rate} flips experts: needs an MoE model, and {model!r} is dense")
    perturb_rate = routing.perturb_rate
    if not (math.isfinite(perturb_rate) and 0.0 <= perturb_rate < 1.0):
        raise ConfigError(
            f"routing.perturb_rate={perturb_rate} must be in [0, 1) (the share of activated experts "
            "the router noise moves after each update)"
        )
    if perturb_rate and not moe:
        raise ConfigError(
            f"routing.perturb_rate={perturb_rate} perturbs routers: needs an MoE model, and {model!r} is dense"
        )


def check_device(device: str) -> None:
    """Refuse, in one line, a `device` that is not cpu or cuda[:index] (torch's own error for a string it does not
    know lists every backend it was ever built for), or cuda on a machine without it."""
    try:
        kind = torch.device(device).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda"):
        raise ConfigError(f"device={device!r} is not one of {', '.join(TRAIN_DEVICES)}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r} but this machine has no CUDA device; use device=cpu")


def check_training_dtype(dtype: str, device: str) -> None:
    """Refuse model weights in a dtype AdamW cannot train (`TRAINABLE_DTYPES`), naming the device and what trains."""
    if dtype not in TRAINABLE_DTYPES:
        raise ConfigError(
            f"model.dtype={dtype} cannot be trained on {device}: AdamW keeps its moments in {dtype}, where the second "
            f"moment of small gradients underflows to 0 and the weights blow up within the first updates; on {device} "
            f"train in model.dtype={' or '.join(TRAINABLE_DTYPES)}"
        )


def engine_needs(plan: StepPlan, objective: Objective, correction: Correction) -> Needs:
    """What the run needs from its engine, each need named by the settings that ask for it."""
    logprobs = None
    if correction.weighs_tokens or objective.needs_rollout_logp:
        logprobs = f"correction={correction.name} / algo={objective.name} read μ_old's log-probs"
    elif plan.pi_old == PiOld.bypass:
        logprobs = "trainer.pi_old=bypass takes π_old from μ_old's log-probs"
    return Needs(
        logprobs=logprobs,
        routing="routing.replay=r3 replays the engine's experts" if plan.replay == Replay.r3 else None,
        gate_weights=(
            f"routing_variant={plan.routing_variant} with routing.replay=r3 replays the engine's gate weights"
            if plan.engine_records_gates
            else None
        ),
        predicted_routes=(
            f"routing_variant={plan.routing_variant} routes the engine by its routers' predictors"
            if plan.engine_predicts_routes
            else None
        ),
    )


def check_agreement(objective: Objective, correction: Correction) -> None:
    """What the objective and the correction must agree on."""
    if objective.needs_rollout_logp and correction.name in ("tis", "mis", "icepop"):
        raise ConfigError(
            f"algo={objective.name} already weighs each token by its truncated π_θ/μ_old; correction={correction.name} "
            "would weigh the mismatch twice: use correction=none, geo_rs or opsm with it"
        )


def check_task(cfg: DictConfig, model_cfg: ModelConfig) -> tuple[Task, list[Example], list[Example]]:
    """The task and its splits, held-out prompts enough for the evaluation, and a generation budget that holds its
    answers (a budget that cannot hold an answer and its eos makes every long answer a truncated, wrong one)."""
    t = cfg.trainer
    task = build_task(**node_settings(cfg.dataset))
    train_examples, test_examples = task.examples("train"), task.examples("test")
    if t.eval_prompts > len(test_examples):
        raise ConfigError(
            f"trainer.eval_prompts={t.eval_prompts} is more than the {len(test_examples)} held-out examples of "
            f"dataset {task.name!r}"
        )
    tokenizer = tokenizer_of(model_cfg)
    check_vocabulary(tokenizer, task, train_examples + test_examples)
    answers = longest_tokens(tokenizer, [example.answer for example in train_examples + test_examples])
    if t.max_new_tokens < answers + 1:
        raise ConfigError(
            f"trainer.max_new_tokens={t.max_new_tokens} cannot hold the answers of dataset {task.name!r}: up to "
            f"{answers} tokens, plus eos; use trainer.max_new_tokens >= {answers + 1}"
        )
    return task, train_examples, test_examples


def check_positions(
    cfg: DictConfig, hf_config: Any, tokenizer: Any, dataset: str, splits: dict[str, list[Example]]
) -> int:
    """The tokens of the longest prompt of the task's `splits`; refuse a prompt that, with the generation budget,
    needs more positions than the model has (transformers only warns, and computes past them)."""
    longest, where = 0, ""
    for split, examples in splits.items():
        tokens, index = longest_text(tokenizer, [example.prompt for example in examples])
        if tokens > longest:
            longest, where = tokens, f"{split} prompt {index}"
    limit = getattr(hf_config, "max_position_embeddings", None)
    new_tokens = cfg.trainer.max_new_tokens
    if limit is not None and longest + new_tokens > limit:
        raise ConfigError(
            f"the longest prompt of dataset {dataset!r} ({where}, {longest} tokens) and trainer.max_new_tokens="
            f"{new_tokens} need {longest + new_tokens} positions, and model {cfg.model.name!r} has "
            f"max_position_embeddings={limit}: use a model with more positions, shorter prompts or fewer new tokens"
        )
    return longest


def check_memory(cfg: DictConfig, memory: StepMemory) -> None:
    """Refuse a step that would not fit in the device's free memory, with the estimate's parts."""
    t = cfg.trainer
    available = available_bytes(cfg.device)
    if memory.peak > available:
        raise ConfigError(
            f"one RL step of trainer.prompts_per_step={t.prompts_per_step} x trainer.group_size={t.group_size} "
            f"(trainer.minibatches={t.minibatches}) needs about {memory.peak / GIB:.1f} GiB ({memory.describe()}), "
            f"and {cfg.device} has {available / GIB:.1f} GiB available: lower the batch or raise trainer.minibatches"
        )


def tokenizer_of(model_cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """The run's tokenizer, without building the model: the character tokenizer, or the checkpoint's own."""
    if model_cfg.path is None:
        return build_char_tokenizer()
    return AutoTokenizer.from_pretrained(model_cfg.path, local_files_only=True)


def check_vocabulary(tokenizer: PreTrainedTokenizerBase, task: Task, examples: list[Example]) -> None:
    """Refuse a task whose text holds characters the tokenizer turns into its unknown token (the character tokenizer
    knows a fixed alphabet, `models.tokenizer.ALPHABET`): a prompt the model cannot read, an answer it cannot write."""
    if tokenizer.unk_token_id is None:
        return
    characters = sorted(set().union(*(example.prompt + example.demonstration for example in examples)))
    ids = tokenizer(characters, add_special_tokens=False)["input_ids"]
    unknown = "".join(char for char, char_ids in zip(characters, ids) if tokenizer.unk_token_id in char_ids)
    if unknown:
        raise ConfigError(
            f"dataset {task.name!r} writes characters the model's tokenizer does not know: {unknown!r} "
            f"(it reads them as {tokenizer.unk_token}); choose a task or settings whose text it knows, "
            "or a checkpoint with its own tokenizer (model=checkpoint model.path=...)"
        )


def longest_tokens(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> int:
    """Tokens of the longest text (measured on the 32 longest in characters)."""
    return longest_text(tokenizer, texts)[0]


def longest_text(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> tuple[int, int]:
    """Tokens of the longest text and its index in `texts` (measured on the 32 longest in characters)."""
    longest = sorted(range(len(texts)), key=lambda i: len(texts[i]))[-32:]
    counts = [len(ids) for ids in tokenizer([texts[i] for i in longest], add_special_tokens=False)["input_ids"]]
    most = max(range(len(longest)), key=lambda j: (counts[j], -longest[j]))
    return counts[most], longest[most]
