"""Typed Hydra configs: every config group has a dataclass schema in Hydra's ConfigStore, and every default is
declared once, in one of these dataclasses or in the dataclass of the part it configures (an objective, a rollout
correction, a routing variant, a task, the model, the engine's numerics).

A misspelt key, a value of the wrong type or a value outside an enum fails at composition, with Hydra naming the
key and the allowed values; the yaml files hold only what differs from the schema. What no single field can check
(values that must agree with each other, with the model or with the engine) is checked once, before any work, by
`experiments.step.checks.check_run`. This module describes every part, so it imports them; no part imports it.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf, ValidationError

from algos import OBJECTIVES
from algos.corrections import CORRECTIONS
from algos.routers import ROUTER_SWITCHES
from algos.routing_variants import ROUTING_VARIANTS
from experiments.conf_files import PROJECT_ROOT, help_text
from experiments.step.engines import EngineNumerics, KVCache, Precision
from experiments.step.optimizer import LRSchedule
from experiments.step.plan import Layout, PiOld, Replay
from experiments.tasks import TASKS
from models.cpu_kernels import CpuKernels
from models.policy import ModelConfig
from models.registry import Registry


class WandbMode(StrEnum):
    offline = "offline"  # the default: run files next to metrics.jsonl, no network
    online = "online"
    disabled = "disabled"


class AccuracySummary(StrEnum):
    """The summaries of a run's held-out greedy accuracy that `analysis.report` compares (each from the run's own
    start; `analysis.aggregate.GAIN_MEASURES` defines them)."""

    gain = "gain"  # final gain: accuracy at the last evaluation − at the start, on the eval_prompts
    gain_area = "gain_area"  # mean gain over the run: the area under the held-out curve above its start, per step
    split_gain = "split_gain"  # final gain on the whole test split (eval_split)


class EarlyStopped(StrEnum):
    """How a run that ended itself before its last step (`status: diverged` in its summary: non-finite for good, or
    too many skipped updates in a row) counts in its report's comparisons. A run stopped from outside (crashed,
    killed, interrupted, a full disk) never counts: it says nothing of its arm. Either way the report names it."""

    exclude = "exclude"  # left out of every comparison; its seed's pair with each other arm is lost
    failed = "failed"  # scored as failed: held-out accuracy 0 at every evaluation it did not reach


@dataclass
class ComparisonConfig:
    """What an experiment's report decides by, declared in its experiment file before its runs: every run records it
    in `.hydra/config.yaml`, and `analysis.report` reads it there (all runs of a report must declare the same; a
    command-line flag may override a field, and the report says so). It changes nothing a run computes."""

    # The arm every other is compared with, as reports name arms ("grpo", "grpo + r2", "grpo + r3 (bf16 engine)");
    # null: grpo when the runs have it, else the first arm by name.
    baseline: str | None = None
    # the one summary whose comparisons decide; the others are secondary
    primary: AccuracySummary = AccuracySummary.gain_area
    # The arms whose comparison with the baseline on the primary summary, in every cell of the sweep, forms the family
    # Holm's correction runs over; empty: every arm the sweep ran.
    family: list[str] = field(default_factory=list)
    early_stopped: EarlyStopped = EarlyStopped.exclude  # how a run that ended itself early counts: exclude or failed
    # The committed results this sweep is a miniature of: folders holding a report's comparisons.csv, relative to the
    # project ("docs/results/flip_dose_seeds"). The report sets each of its comparisons beside the reference's row of
    # the same arm, baseline, measure and cell, and says whether the two estimates have the same sign; empty: none.
    references: list[str] = field(default_factory=list)


@dataclass
class RoutingConfig:
    """Routing Replay, orthogonal to the objective, and routing measurements."""

    # Routing Replay: none, r2 (θ_old's experts, recorded by the trainer's π_old pass) or r3 (the rollout engine's,
    # recorded while it sampled), in every update forward of the step.
    replay: Replay = Replay.none
    metrics: bool = True  # drift of the current routing against θ_old's, per minibatch (no extra forward)
    margin_threshold: float = 0.05  # a token whose k-th and (k+1)-th expert probabilities differ by less is fragile
    # Every this many steps, split each off-policy token's log π_θ/π_old into its routing and weights parts with one
    # extra no-grad forward per off-policy minibatch (0: never).
    decompose_every: int = 0
    # SYNTHETIC drift (models.routing.flips.flip_routing): in π_θ's update forwards only, each activated expert is
    # swapped, with this probability, for the one its router ranks next. Not in the rollout, π_old or evaluation; replay
    # (r2, r3) overrides it. 0: off, and the step is exactly the unflipped one.
    flip_rate: float = 0.0
    # SYNTHETIC drift the policy carries (models.routing.perturbation): after each optimizer update, Gaussian noise on
    # every router's weights, sized to move this share of the update's activated experts in each layer. θ keeps it:
    # the next rollout, π_old and the evaluations route with it; replay removes it within a step as it removes
    # natural drift. 0: off. Below 1.
    perturb_rate: float = 0.0


@dataclass
class VLLMConfig:
    """vLLM's own settings (`rollout.engine=vllm`; `experiments.step.engines.vllm`)."""

    kv_cache_gb: float = 1.0  # KV cache space: VLLM_CPU_KVCACHE_SPACE on CPU; on CUDA the share of the GPU below
    gpu_memory_utilization: float = 0.5  # CUDA only: the share of the GPU's memory vLLM may take
    max_model_len: int | None = None  # null: prompt width + generation budget of the task, rounded up


@dataclass
class RayConfig:
    """The concurrent source's Ray transport (`rollout.transport=ray`; `experiments.step.sources.ray_transport`)."""

    # The Ray cluster's address as `ray start --head` prints it (host:port, on this machine or another host); null: a
    # Ray instance of the run's own on this machine, started with the run and stopped at its end.
    address: str | None = None
    workers: int = 1  # rollout actors, each an engine of its own sampling batches of its own (disjoint rows)
    worker_cpus: float = 1.0  # the CPUs Ray reserves for each actor (its torch ops run on one thread)
    # How each weight version reaches the actors: object_store (put once into Ray's object store; an actor's node
    # pulls it when the actor first samples with it) or broadcast (a torch.distributed gloo group of the trainer and
    # the actors: each version sent to every actor as it is published; experiments.step.sources.broadcast).
    weights: str = "object_store"


@dataclass
class RolloutConfig(EngineNumerics):
    """The rollout engine: what samples the completions and reports their log-probs μ_old (and routing). With every
    numerics setting (`EngineNumerics`: precision, weight_quant, router_noise) off the HF engine samples with the
    trainer's own model; any one on gives it its own copy of the weights, synced after every step, that differs from
    the trainer on purpose."""

    engine: str = "hf"  # a name in `experiments.step.engines.ENGINES`: hf (transformers' generate), vllm
    # The hf engine's KV cache: preallocated (written in place, the same numbers; cheaper) or concat (transformers'
    # own, grown by concatenation every step: the reference). vLLM pages its own cache and takes only the default.
    kv_cache: KVCache = KVCache.preallocated
    # Where each step's rollouts come from, a name in `experiments.step.sources.ROLLOUT_SOURCES` (docs/async.md):
    # synchronous (the engine samples each step in the step, with the weights the step before made), lagged (the
    # same, exactly `lag` versions behind θ_old: the science mode, reproducible and resumable) or concurrent (a worker
    # process with its own copy of the weights samples the next steps' rollouts while the trainer updates, at most
    # `max_staleness` behind: the throughput mode, not bit-reproducible; on one rank or several, local or on Ray).
    source: str = "synchronous"
    # The lagged source's k (experiments.step.versions): step t's rollouts are sampled with the weights of this many
    # versions before θ_old (a version: the weights after one RL step; the first steps sample with the start), so
    # μ_old is that stale engine and π_old stays the trainer at θ_old. 0: the synchronous loop, bit for bit.
    lag: int = 0
    # The concurrent source's bound, in weight versions: a sample trained this many versions after the one that
    # sampled it (staleness = θ_old's version − the sample's) is at the bound; past it `overflow` says what happens.
    max_staleness: int = 1
    # What the concurrent source does past its bound (experiments.step.sources.overflow): wait (the worker waits for
    # newer weights before sampling, so nothing is sampled past it; 0: sampling and training take turns), drop (the
    # worker holds a queue of max_staleness + 1 batches; a batch past the bound is dropped, counted, never trained) or
    # count (the same queue; a batch past the bound is trained and its rows counted).
    overflow: str = "wait"
    # How the concurrent source's worker and the trainer exchange weights and batches: local (one worker process on
    # this machine, through shared memory and a pipe) or ray (`ray.workers` Ray actors, on this machine or a
    # cluster's, the weights published once per version into Ray's object store: docs/async.md).
    transport: str = "local"
    ray: RayConfig = field(default_factory=RayConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)


@dataclass
class TrainerConfig:
    """One RL step: `prompts_per_step` prompts x `group_size` completions, split into `minibatches` updates."""

    steps: int = 40  # RL steps (one rollout batch each)
    prompts_per_step: int = 32  # prompts sampled per step from the task's train split
    group_size: int = 8  # completions per prompt (G): the group of the group-relative advantage
    minibatches: int = 4  # optimizer updates per rollout batch: the GSPO paper's 4, all but the first off-policy
    max_new_tokens: int = 16  # generation budget per completion
    temperature: float = 1.0  # sampling temperature; log-probs are scored under logits / temperature
    # Where π_old comes from: bypass (π_old := μ_old, the engine's log-probs), decoupled (the trainer recomputes it,
    # which r2 needs to record θ_old's routing), or auto (bypass when the engine is the trainer and nothing needs
    # the recompute). Either way the first minibatch is on-policy when the engine is the trainer's own model.
    pi_old: PiOld = PiOld.auto
    # How the rollout batch splits into minibatches: groups (whole groups, each fed as one packed sequence), rows
    # (completions shuffled across groups, TRL's layout), or auto (groups when the prompts divide into the minibatches).
    minibatch_layout: Layout = Layout.auto
    lr: float = 3e-4  # AdamW learning rate (peak, after warm-up)
    # The routers' learning rate as a multiple of `lr`: a knob that moves routing faster than every other weight
    # (drift per update grows with it), for studying what routing changes alone do to the ratios.
    router_lr_scale: float = 1.0
    lr_schedule: LRSchedule = LRSchedule.constant  # after the warm-up; linear / cosine decay reach 0 at the last update
    warmup_steps: int = 0  # linear warm-up, in optimizer updates
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    adam_beta1: float = 0.9  # AdamW's decay of the gradient's running mean
    adam_beta2: float = 0.999  # AdamW's decay of the squared gradient's running mean
    grad_clip: float = 1.0  # max global gradient norm
    max_consecutive_skips: int = 3  # updates in a row with a non-finite loss or gradient before the run stops
    # RL steps between held-out evaluations (0: only at the end). Every 5 steps the curve has enough points for its
    # area (the run's mean gain, `metrics.gain_area`) to be a steadier summary than the last evaluation alone.
    eval_every: int = 5
    eval_start: bool = True  # also evaluate the starting policy (logged as eval_start/* in step 1's record)
    eval_prompts: int = 128  # held-out prompts per evaluation (the same prefix of the test split every time)
    # Also at the start and at the last step: greedy accuracy on every prompt of the test split (eval_split/*; the
    # synthetic tasks hold test_size=500 by default, a GSM8K test file 1,319), the endpoint with a quarter of a
    # 128-prompt evaluation's variance at 500. In batches as large as the step's own memory allows
    # (experiments.step.memory): a split of any size fits where the step does.
    eval_split: bool = True
    eval_samples: int = 4  # k of mean pass@1 (0: greedy accuracy only); from 8 on, pass@8 too (the headroom)
    eval_train: bool = False  # also greedy accuracy on the first eval_prompts train prompts (against overfitting)
    # Also, per update, its size against the weights and the KL from the start (one more forward per minibatch, of a
    # frozen copy of the start): how far a run moves, for telling a step too small to learn from one that forgets.
    measure_learning: bool = False
    save_checkpoint: bool = False  # save_pretrained + tokenizer into the run directory at the end
    checkpoint_every: int = 0  # steps between resumable checkpoints (experiments.run.checkpoint; 0: none)
    keep_checkpoints: int = 2  # the newest this many checkpoints stay on disk
    # torch CPU threads: one, so that a run and its resume compute the same bits on any machine whatever its load
    # (another count rounds reductions differently). null: the cores other processes leave free, measured after every
    # step, faster on a loaded machine and not bitwise repeatable (run/threads.py).
    threads: int | None = 1


@dataclass
class LaunchConfig:
    """How the job starts its ranks: with `nproc_per_node` > 1 the job runs itself again under
    `torchrun --standalone --nproc_per_node=N` (one rank per GPU of its node), as every job of `cluster=slurm` does;
    1: this process is the only rank (or torchrun already started it)."""

    nproc_per_node: int = 1  # ranks of the job on its node (one per GPU); 1: this process is the only rank


@dataclass
class WandbConfig:
    """Weights & Biases, beside the run's metrics.jsonl (the record analysis/ reads)."""

    mode: WandbMode = WandbMode.offline  # offline: run files next to metrics.jsonl (`wandb sync` uploads them later)
    # Seconds W&B's start-up may wait for its server (online) before the run goes on without it, saying so in its
    # summary; W&B's own default, 90, was spent in silence by every job on a machine without a network.
    init_timeout: float = 30.0
    project: str = "moe-rl-lab"  # the W&B project the run is filed under
    entity: str | None = None  # W&B user or team; null: the key's default
    group: str | None = None  # null: the sweep directory's name for multiruns
    job_type: str = "train"  # W&B's job type: train, sft or probe
    tags: list[str] = field(default_factory=list)  # added to the run's algo / replay / routing_variant / model tags


@dataclass
class LoggerConfig:
    """Where a run's records go besides its metrics.jsonl."""

    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class TrainConfig:
    algo: Any = MISSING  # an objective's schema (`schema/algo/<name>`, generated from its dataclass)
    correction: Any = MISSING  # a rollout correction's schema (`schema/correction/<name>`, from its dataclass)
    routing_variant: Any = MISSING  # a routing variant's schema (`schema/routing_variant/<name>`, from its dataclass)
    # The router switches that are on, by name (`routers=[aux_loss,freeze]`; each `schema/routers/<name>`, from its
    # dataclass in `algos.routers`); none by default: the routers learn from the policy gradient alone.
    routers: dict[str, Any] = field(default_factory=dict)
    model: ModelConfig = field(default_factory=ModelConfig)
    dataset: Any = MISSING  # a task's schema (`schema/dataset/<name>`, generated from its dataclass)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    comparison: ComparisonConfig = field(default_factory=ComparisonConfig)  # what the experiment's report decides by
    seed: int = 0  # sampling, shuffling and every other random choice of the run (not the built model's weights)
    device: str = "cpu"  # cpu, cuda, cuda:1, ...
    # The CPU kernels (models.cpu_kernels): native, the machine's own (fast; a run is the same bits on the same
    # machine, other bits on another CPU); portable, one kernel path on every x86-64 CPU with AVX2 (not yet the same
    # bits on every one: docs/reproduce.md), MKL ~1.7x slower.
    cpu_kernels: CpuKernels = CpuKernels.native
    # Continue a run from a checkpoint: `auto`, the newest one in the run directory (a fresh start when there is
    # none), or the path of one (`<run dir>/checkpoints/step_<k>`); null: a new run in a new directory.
    resume: str | None = None


@dataclass
class SFTSettings:
    """Cold start: next-token training on task demonstrations until the held-out accuracy is useful."""

    max_steps: int = 600  # the budget that decides the checkpoint: the same on a loaded or an idle machine
    # Safety stop only: a cold start it cuts short is not the documented checkpoint, and its summary says so.
    max_seconds: float = 3600.0
    batch_size: int = 128  # demonstrations per SFT step
    lr: float = 1e-3  # AdamW, peak (after the warm-up)
    warmup_steps: int = 0  # linear warm-up from lr / warmup_steps: deep narrow models diverge without one at lr 1e-3
    lr_schedule: LRSchedule = LRSchedule.constant  # after the warm-up; linear / cosine decay reach 0 at max_steps
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    target_accuracy: float = 0.45  # stop once greedy held-out accuracy reaches this (RL needs reward variance)
    # Pretraining before the task's SFT: next-token training on every token (prompt, answer, eos) of examples drawn
    # evenly from a mixture of the lab's tasks in their formats, so that experts specialise by token kind as those of
    # real MoEs trained on varied data do. Its steps come before max_steps (same optimizer, the schedule over both);
    # 0: none, the cold start trains on its task alone.
    pretrain_steps: int = 0
    # The mixture's tasks, at their default settings, beside the cold start's own task (which is always in it). Not
    # scratchpad by default: its 33-token prompts pad every mixed batch to them, ~5x a step's cost on one thread.
    pretrain_tasks: list[str] = field(default_factory=lambda: ["addition", "sorting"])
    eval_every: int = 20  # SFT steps between held-out evaluations
    eval_prompts: int = 256  # held-out prompts of each evaluation (greedy accuracy)
    output_dir: str = MISSING  # where save_pretrained writes the checkpoint and tokenizer
    # torch CPU threads. Pinned, not following the free cores as RL runs do: reductions split over another number of
    # threads round differently, and over hundreds of steps that is another checkpoint. null: the free cores.
    threads: int | None = 1


@dataclass
class SFTConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    dataset: Any = MISSING  # the task whose demonstrations the cold start learns (`schema/dataset/<name>`)
    sft: SFTSettings = field(default_factory=SFTSettings)
    # The family's own balancing while the cold start trains (`routers=[aux_loss]`, `routers=[bias_update]`): the
    # router switches that serve a cold start (`algos.routers`); none by default.
    routers: dict[str, Any] = field(default_factory=dict)
    logger: LoggerConfig = field(default_factory=lambda: LoggerConfig(WandbConfig(job_type="sft")))
    seed: int = 0  # the batches' order and every other random choice (not the built model's weights: model.init_seed)
    device: str = "cpu"  # cpu, cuda, cuda:1, ...
    # The CPU kernels (models.cpu_kernels): portable, so that a cold start is the same checkpoint on every x86-64 CPU
    # with AVX2 (its summary records the kernels and the weights' sha256); native: this machine's own, faster.
    cpu_kernels: CpuKernels = CpuKernels.portable


@dataclass
class ProbeSettings:
    """What the probe varies and how long it runs each setting."""

    lrs: list[float] = field(default_factory=lambda: [1e-5, 1e-4, 1e-3])  # one short RL run from a fresh AdamW each
    warm_steps: int = 4  # RL steps before measuring (x trainer.minibatches updates): Adam's moments settle
    measure_steps: int = 4  # RL steps whose statistics are averaged (with their standard errors)
    # Engine precisions whose routing disagreement with the fp32 trainer is measured at the cold start's weights.
    precisions: list[Precision] = field(default_factory=lambda: [Precision.bf16])


@dataclass
class ProbeConfig(TrainConfig):
    """`python -m experiments.probe`: an RL run's settings, and what the probe varies over them."""

    probe: ProbeSettings = field(default_factory=ProbeSettings)


def _schema_from(cls: type, name: str, extra: list[tuple[str, type, Any]]) -> type:
    """A Hydra schema dataclass: `name` and `extra` fields, then the fields of `cls` with their defaults."""
    hints = typing.get_type_hints(cls)
    fields: list[tuple[str, Any, Any]] = [("name", str, field(default=name))]  # (name, type, its field)
    fields += [(key, typ, field(default=default)) for key, typ, default in extra]
    # The constructor's order: `fields` resolves every field's kw_only to a bool (never MISSING).
    for f in sorted(dataclasses.fields(cls), key=lambda f: f.kw_only is True):
        if f.default_factory is not dataclasses.MISSING:  # a mutable default (a task's dict of settings)
            fields.append((f.name, hints[f.name], field(default_factory=f.default_factory)))
            continue
        default = f.default if f.default is not dataclasses.MISSING else MISSING
        fields.append((f.name, hints[f.name], field(default=default)))
    return dataclasses.make_dataclass(f"{cls.__name__}Schema", fields)


def _store_group(
    cs: ConfigStore, group: str, registry: Registry[Any], extra: Callable[[type[Any]], list[tuple[str, type, Any]]]
) -> None:
    for name, cls in registry.items():
        cs.store(group=f"schema/{group}", name=name, node=_schema_from(cls, name, extra(cls)))


def register_configs() -> None:
    """Store every schema; idempotent (Hydra's ConfigStore overwrites entries of the same name)."""
    # `${project_root:}` in yaml: checkpoints and reports resolve against the project, not the working directory.
    OmegaConf.register_new_resolver("project_root", lambda: str(PROJECT_ROOT), replace=True)
    # `${lab_help:train}` in conf/hydra/help/lab.yaml: the entry point's --help, the groups a user picks.
    OmegaConf.register_new_resolver("lab_help", help_text, replace=True)
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(name="sft_schema", node=SFTConfig)
    cs.store(name="probe_schema", node=ProbeConfig)
    _store_group(cs, "algo", OBJECTIVES, lambda cls: [("advantage_std", bool, cls.advantage_std)])
    _store_group(cs, "dataset", TASKS, lambda cls: [])
    _store_group(cs, "correction", CORRECTIONS, lambda cls: [])
    _store_group(cs, "routing_variant", ROUTING_VARIANTS, lambda cls: [])
    _store_group(cs, "routers", ROUTER_SWITCHES, lambda cls: [])


def refuse_mistyped_overrides(arguments: list[str], schema: type) -> None:
    """Refuse, in one line before Hydra composes anything, a command-line value that `schema`'s type for its key
    cannot hold (`rollout.lag=1.5`, `rollout.max_staleness=abc`, a value of a sweep among them): Hydra itself would
    refuse it in seven lines. Keys the root schema does not type (a group's choice, an objective's own field, which
    its group's schema types once chosen) and anything Hydra's grammar refuses are left to Hydra."""
    try:
        overrides = OverridesParser.create().parse_overrides(
            [argument for argument in arguments if "=" in argument and not argument.startswith("-")]
        )
    except HydraException:
        return
    typed = OmegaConf.structured(schema)
    for override in overrides:
        if override.is_delete() or override.is_add() or not _is_typed_leaf(typed, override.key_or_group):
            continue
        values = list(override.sweep_iterator()) if override.is_sweep_override() else [override.value()]
        for value in values:
            if isinstance(value, str) and "${" in value:  # an interpolation: resolved after composition
                continue
            try:
                OmegaConf.update(OmegaConf.structured(schema), override.key_or_group, value, merge=True)
            except ValidationError as error:
                shown = str(value).lower() if isinstance(value, bool) else value  # as the command line spells it
                why = str(error).splitlines()[0]
                raise SystemExit(f"moe-rl-lab: {override.key_or_group}={shown} is refused: {why}") from None


def _is_typed_leaf(typed: Any, key: str) -> bool:
    """Whether `key` names a value (not a section) of the structured config `typed`."""
    parent, _, leaf = key.rpartition(".")
    section = OmegaConf.select(typed, parent) if parent else typed
    return (
        isinstance(section, DictConfig)
        and leaf in section
        and not isinstance(section._get_node(leaf), (DictConfig, ListConfig))
    )
