"""Typed Hydra configs: every config group has a dataclass schema in Hydra's ConfigStore, and every default lives
in one of these dataclasses (or, for `algo` and `dataset`, in the objective and task dataclasses themselves).

A misspelt key, a value of the wrong type or a value outside an enum fails at composition, with Hydra naming the
key and the allowed values; the yaml files hold only what differs from the schema. What no single field can check
(values that must agree with each other or with the model) is checked once, in `plan_step`, before any work.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from experiments.step.engines.hf import EngineNumerics, Precision, WeightQuant
from models.registry import ConfigError, Registry
from models.grouped_attention import NAME as PACKED_ATTENTION
from models.policy import ModelConfig

PROJECT_ROOT = Path(__file__).resolve().parent.parent


class Replay(StrEnum):
    """Routing Replay (GSPO paper §5.3; Ma et al., arXiv 2510.11370)."""

    none = "none"
    r2 = "r2"  # replay θ_old's routing, recorded by the trainer in its π_old pass
    r3 = "r3"  # replay the rollout engine's routing, recorded while it sampled


class PiOld(StrEnum):
    """Where π_old, the denominator of the importance ratios, comes from (verl's names)."""

    auto = "auto"  # bypass when the engine is the trainer's own model and no replay needs the trainer's pass
    bypass = "bypass"  # π_old := μ_old, the rollout engine's own log-probs: no extra forward
    decoupled = "decoupled"  # the trainer recomputes π_old at θ_old, without gradient, in the training shapes


class Layout(StrEnum):
    """How the rollout batch splits into minibatches and how they are fed to the model."""

    auto = "auto"  # groups where possible (prompts divide into the minibatches, packed attention), else rows
    groups = "groups"  # whole groups per minibatch, each fed as one packed sequence (its prompt once)
    rows = "rows"  # completions shuffled across groups, every row fed in full (TRL's layout)


class LRSchedule(StrEnum):
    constant = "constant"
    linear = "linear"  # linear decay to 0 after the warm-up
    cosine = "cosine"  # cosine decay to 0 after the warm-up


class Engine(StrEnum):
    """The rollout engine that samples (μ_old), behind `experiments.step.engines.hf.RolloutEngine`."""

    hf = "hf"  # transformers' `generate` on the trainer's own model (prefill once per prompt, KV cache)
    vllm = "vllm"  # vLLM in this process, on its own copy of the weights, synced in place after every step


class WandbMode(StrEnum):
    offline = "offline"  # the default: run files next to metrics.jsonl, no network
    online = "online"
    disabled = "disabled"


@dataclass
class RoutingConfig:
    """Routing Replay, orthogonal to the objective, and routing measurements."""

    replay: Replay = Replay.none
    metrics: bool = True  # drift of the current routing against θ_old's, per minibatch (no extra forward)
    margin_threshold: float = 0.05  # a token whose k-th and (k+1)-th expert probabilities differ by less is fragile
    # Every this many steps, split each off-policy token's log π_θ/π_old into its routing and weights parts with one
    # extra no-grad forward per off-policy minibatch (0: never).
    decompose_every: int = 0
    # SYNTHETIC drift (models.routing.flip_routing): in π_θ's update forwards only, each activated expert is swapped,
    # with this probability, for the one its router ranks next. Not in the rollout, π_old or evaluation; replay
    # (r2, r3) overrides it. 0: off, and the step is exactly the unflipped one.
    flip_rate: float = 0.0


@dataclass
class VLLMConfig:
    """vLLM's own settings (`rollout.engine=vllm`; `experiments.step.engines.vllm`)."""

    kv_cache_gb: float = 1.0  # KV cache space: VLLM_CPU_KVCACHE_SPACE on CPU; on CUDA the share of the GPU below
    gpu_memory_utilization: float = 0.5  # CUDA only: the share of the GPU's memory vLLM may take
    max_model_len: int | None = None  # null: prompt width + generation budget of the task, rounded up


@dataclass
class RolloutConfig:
    """The rollout engine: what samples the completions and reports their log-probs μ_old (and routing). With every
    numerics setting off it samples with the trainer's own model; any one on gives it its own copy of the weights,
    synced after every step, that differs from the trainer on purpose (`experiments.step.engines.hf`)."""

    engine: Engine = Engine.hf
    precision: Precision = Precision.fp32  # the engine copy's dtype
    weight_quant: WeightQuant = WeightQuant.none  # fake quantization of the copy's linear and expert weights
    router_noise: float = 0.0  # σ of the Gaussian noise on the copy's router logits, before its top-k
    vllm: VLLMConfig = field(default_factory=VLLMConfig)

    def numerics(self) -> EngineNumerics:
        return EngineNumerics(Precision(self.precision), WeightQuant(self.weight_quant), float(self.router_noise))

    def engine_class(self) -> type:
        """The engine class this config asks for (vLLM imported only when asked, and refused when missing)."""
        if self.engine == Engine.vllm:
            from experiments.step.engines.vllm import VLLMEngine

            VLLMEngine.require()
            return VLLMEngine
        from experiments.step.engines.hf import HFEngine

        return HFEngine


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
    minibatch_layout: Layout = Layout.auto
    lr: float = 3e-4  # AdamW learning rate (peak, after warm-up)
    # The routers' learning rate as a multiple of `lr`: a knob that moves routing faster than every other weight
    # (drift per update grows with it), for studying what routing changes alone do to the ratios.
    router_lr_scale: float = 1.0
    lr_schedule: LRSchedule = LRSchedule.constant
    warmup_steps: int = 0  # linear warm-up, in optimizer updates
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    grad_clip: float = 1.0  # max global gradient norm
    router_aux_loss_coef: float = 0.0  # load-balancing loss added to the policy loss (0: only logged, as in R3)
    max_consecutive_skips: int = 3  # updates in a row with a non-finite loss or gradient before the run stops
    eval_every: int = 10  # RL steps between held-out evaluations (0: only at the end)
    eval_start: bool = True  # also evaluate the starting policy (logged as eval_start/* in step 1's record)
    eval_prompts: int = 128  # held-out prompts per evaluation (the same prefix of the test split every time)
    eval_samples: int = 4  # k of mean pass@1 (0: greedy accuracy only)
    save_checkpoint: bool = False  # save_pretrained + tokenizer into the run directory at the end
    checkpoint_every: int = 0  # steps between resumable checkpoints (experiments.run.checkpoint; 0: none)
    keep_checkpoints: int = 2  # the newest this many checkpoints stay on disk
    threads: int | None = None  # torch CPU threads; null: the cores other processes leave free (experiments/threads.py)


@dataclass
class LaunchConfig:
    """How the job starts its ranks: with `nproc_per_node` > 1 the job runs itself again under
    `torchrun --standalone --nproc_per_node=N` (one rank per GPU of its node), as every job of `cluster=slurm` does;
    1: this process is the only rank (or torchrun already started it)."""

    nproc_per_node: int = 1


@dataclass
class WandbConfig:
    mode: WandbMode = WandbMode.offline
    project: str = "moe-rl-lab"
    entity: str | None = None  # W&B user or team; null: the key's default
    group: str | None = None  # null: the sweep directory's name for multiruns
    job_type: str = "train"
    tags: list[str] = field(default_factory=list)  # added to the run's algo / replay / routing_variant / model tags


@dataclass
class LoggerConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class TrainConfig:
    algo: Any = MISSING  # an objective's schema (`schema/algo/<name>`, generated from its dataclass)
    correction: Any = MISSING  # a rollout correction's schema (`schema/correction/<name>`, from its dataclass)
    routing_variant: Any = MISSING  # a routing variant's schema (`schema/routing_variant/<name>`, from its dataclass)
    model: ModelConfig = field(default_factory=ModelConfig)
    dataset: Any = MISSING  # a task's schema (`schema/dataset/<name>`, generated from its dataclass)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    seed: int = 0  # sampling, shuffling and every other random choice of the run (not the built model's weights)
    device: str = "cpu"  # cpu, cuda, cuda:1, ...
    # Continue a run from a checkpoint: `auto`, the newest one in the run directory (a fresh start when there is
    # none), or the path of one (`<run dir>/checkpoints/step_<k>`); null: a new run in a new directory.
    resume: str | None = None


@dataclass
class SFTSettings:
    """Cold start: next-token training on task demonstrations until the held-out accuracy is useful."""

    max_steps: int = 600  # the budget that decides the checkpoint: the same on a loaded or an idle machine
    # Safety stop only: a cold start it cuts short is not the documented checkpoint, and its summary says so.
    max_seconds: float = 3600.0
    batch_size: int = 128
    lr: float = 1e-3  # AdamW, peak (after the warm-up)
    warmup_steps: int = 0  # linear warm-up from lr / warmup_steps: deep narrow models diverge without one at lr 1e-3
    lr_schedule: LRSchedule = LRSchedule.constant  # after the warm-up; linear / cosine decay reach 0 at max_steps
    weight_decay: float = 0.0
    target_accuracy: float = 0.45  # stop once greedy held-out accuracy reaches this (RL needs reward variance)
    eval_every: int = 20  # SFT steps between held-out evaluations
    eval_prompts: int = 256
    output_dir: str = MISSING  # where save_pretrained writes the checkpoint and tokenizer
    # torch CPU threads. Pinned, not following the free cores as RL runs do: reductions split over another number of
    # threads round differently, and over hundreds of steps that is another checkpoint. null: the free cores.
    threads: int | None = 1


@dataclass
class SFTConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    dataset: Any = MISSING
    sft: SFTSettings = field(default_factory=SFTSettings)
    logger: LoggerConfig = field(default_factory=lambda: LoggerConfig(WandbConfig(job_type="sft")))
    seed: int = 0
    device: str = "cpu"


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


@dataclass(frozen=True)
class StepPlan:
    """How every RL step of a run gets its numbers, decided once at start-up and recorded in `summary.json`."""

    replay: Replay
    pi_old: PiOld  # bypass or decoupled (auto resolved)
    layout: Layout  # groups or rows (auto resolved)
    track_routing: bool  # measure θ's routing against θ_old's in every update
    engine_is_trainer: bool  # the engine samples with the trainer's own module: μ_old is π_old's own numbers
    why: str  # one sentence on where π_old comes from
    flip_rate: float = 0.0  # synthetic routing drift in the update forwards (routing.flip_rate)
    routing_variant: str = "none"  # `algos.routing_variants`: what replayed forwards or the ratios do beyond ID replay
    replays_gates: bool = False  # replayed forwards take the recorded gate weights too (full replay)
    reads_old_router: bool = False  # the variant reads θ_old's router log-probabilities (router shift)

    @property
    def first_minibatch_on_policy(self) -> bool:
        """π_old of the first minibatch is its own update forward: θ = θ_old there, and the same forward is what a
        recompute would run (or, engine = trainer, what μ_old computed). Not with synthetic flips: the update's
        forward is then not θ_old's. Nor when r2 replays gate weights: the update's forward must take θ_old's gates
        as constants, recorded by the π_old pass."""
        gates_to_record = self.replays_gates and self.replay == Replay.r2
        own_forward_is_old = self.pi_old == PiOld.decoupled or self.engine_is_trainer
        return own_forward_is_old and self.flip_rate == 0 and not gates_to_record

    @property
    def engine_records_routing(self) -> bool:
        """Ask the engine for its routing: r3 replays it; with bypass it is θ_old's routing for the drift metric; an
        engine that differs from the trainer has it compared with the trainer's (`mismatch/expert_frac`)."""
        tracked = self.track_routing and (self.pi_old == PiOld.bypass or not self.engine_is_trainer)
        return self.replay == Replay.r3 or tracked

    @property
    def engine_records_gates(self) -> bool:
        """Ask the engine for the gates of its routing: r3 replays them (`routing_variant=full_replay`)."""
        return self.replays_gates and self.replay == Replay.r3

    @property
    def pi_old_records_gates(self) -> bool:
        """The trainer's π_old pass records θ_old's routing with its gates: r2 replays them (`full_replay`), or the
        variant reads them (`router_shift`)."""
        return (self.replays_gates and self.replay == Replay.r2) or self.reads_old_router

    def describe(self) -> dict[str, Any]:
        described = {"pi_old": self.pi_old, "pi_old_why": self.why, "minibatch_layout": self.layout,
                     "replay": self.replay, "routing_variant": self.routing_variant,
                     "first_minibatch_on_policy": self.first_minibatch_on_policy}
        if self.flip_rate:
            described["synthetic_flip_rate"] = self.flip_rate
        return described


def unknown_keys(node: Any, prefix: str = "") -> list[str]:
    """Keys of `node` that its schema does not declare: Hydra lets `+key=value` add them, and nothing would read them."""
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


def plan_step(cfg: Any, is_moe: bool, reads_pi_old: str | None = None, world: int = 1, variant: Any = None) -> StepPlan:
    """Check what single fields cannot (ranges, values that must agree) and decide the step; `ConfigError` naming
    the values and what is allowed otherwise. Runs before anything is built. `reads_pi_old`: what, besides replay,
    needs the trainer's own π_old (a rollout correction's name), or None. `world`: the data-parallel ranks the
    step's prompts are split over. `variant`: the run's routing variant (`algos.routing_variants`), None for none."""
    unknown = unknown_keys(cfg) if isinstance(cfg, DictConfig) else []
    if unknown:
        raise ConfigError(
            f"unknown config key(s) {', '.join(unknown)}: no schema declares them, so nothing would read them "
            "(`+key=value` adds keys; misspelt? `python -m experiments.train --cfg job` prints every key)"
        )
    t = cfg.trainer
    for key in ("prompts_per_step", "steps", "max_new_tokens", "max_consecutive_skips"):
        if t[key] < 1:
            raise ConfigError(f"trainer.{key}={t[key]} must be >= 1")
    for key in ("warmup_steps", "eval_every", "eval_prompts", "eval_samples", "checkpoint_every"):
        if t[key] < 0:
            raise ConfigError(f"trainer.{key}={t[key]} must be >= 0")
    for key in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= t[key] < 1.0:
            raise ConfigError(f"trainer.{key}={t[key]} must be in [0, 1)")
    for key in ("weight_decay", "router_aux_loss_coef"):
        if not (math.isfinite(t[key]) and t[key] >= 0):
            raise ConfigError(f"trainer.{key}={t[key]} must be a finite number >= 0")
    if t.keep_checkpoints < 1:
        raise ConfigError(f"trainer.keep_checkpoints={t.keep_checkpoints} must be >= 1 (the newest is what resume reads)")
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
    for key in ("temperature", "lr", "grad_clip", "router_lr_scale"):
        if not (math.isfinite(t[key]) and t[key] > 0):
            raise ConfigError(f"trainer.{key}={t[key]} must be a finite number > 0")
    if not is_moe and cfg.routing.replay != Replay.none:
        raise ConfigError(
            f"routing.replay={cfg.routing.replay} needs an MoE model, but model {cfg.model.name!r} has no MoE layers; "
            "use routing.replay=none"
        )
    if not is_moe and t.router_aux_loss_coef > 0:
        raise ConfigError(f"trainer.router_aux_loss_coef={t.router_aux_loss_coef} needs an MoE model")
    sigma = cfg.rollout.router_noise
    if not (math.isfinite(sigma) and sigma >= 0):
        raise ConfigError(f"rollout.router_noise={sigma} must be a finite number >= 0 (the noise's σ)")
    if cfg.rollout.weight_quant != WeightQuant.none and cfg.model.moe_backend != "hf":
        raise ConfigError(
            f"rollout.weight_quant={cfg.rollout.weight_quant} quantizes transformers' expert layout; "
            f"model.moe_backend={cfg.model.moe_backend} holds another: use model.moe_backend=hf"
        )
    if not (math.isfinite(cfg.routing.margin_threshold) and cfg.routing.margin_threshold >= 0):
        raise ConfigError(f"routing.margin_threshold={cfg.routing.margin_threshold} must be a finite number >= 0")
    if cfg.routing.decompose_every < 0:
        raise ConfigError(f"routing.decompose_every={cfg.routing.decompose_every} must be >= 0 (0: never)")
    if cfg.routing.decompose_every and not is_moe:
        raise ConfigError(f"routing.decompose_every={cfg.routing.decompose_every} splits a routing part: needs an MoE model")
    flip_rate = cfg.routing.flip_rate
    if not (math.isfinite(flip_rate) and 0.0 <= flip_rate <= 1.0):
        raise ConfigError(f"routing.flip_rate={flip_rate} must be a probability in [0, 1] (the share of experts flipped)")
    if flip_rate and not is_moe:
        raise ConfigError(f"routing.flip_rate={flip_rate} flips experts: needs an MoE model, and {cfg.model.name!r} is dense")
    engine_is_trainer = cfg.rollout.engine == Engine.hf and not RolloutConfig(**cfg.rollout).numerics().differs
    check_device(cfg.device)
    check_training_dtype(cfg.model.dtype, cfg.device)
    replay = Replay(cfg.routing.replay)
    reads_old_router = variant.name if variant is not None and variant.reads_old_router else None
    pi_old, why = _pi_old(PiOld(t.pi_old), replay, engine_is_trainer, reads_pi_old, reads_old_router)
    return StepPlan(
        replay=replay,
        pi_old=pi_old,
        layout=_layout(cfg, world),
        track_routing=is_moe and (cfg.routing.metrics or replay != Replay.none or cfg.routing.decompose_every > 0),
        engine_is_trainer=engine_is_trainer,
        why=why,
        flip_rate=float(flip_rate),
        routing_variant=variant.name if variant is not None else "none",
        replays_gates=variant is not None and variant.replays_gates,
        reads_old_router=variant is not None and variant.reads_old_router,
    )


# The devices a run trains on, and the weight dtypes it trains in. Not float16: AdamW keeps its moments in the weights'
# dtype, and in float16 the second moment of a small gradient underflows to 0, so the next update divides by about
# eps and the weights blow up (the micro MoE's logits were non-finite after its first RL step on CPU).
TRAIN_DEVICES = ("cpu", "cuda", "cuda:<index>")
TRAINABLE_DTYPES = ("float32", "bfloat16")


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


def _pi_old(asked: PiOld, replay: Replay, engine_is_trainer: bool, reads_pi_old: str | None,
            reads_old_router: str | None = None) -> tuple[PiOld, str]:
    if asked == PiOld.bypass and replay == Replay.r2:
        raise ConfigError(
            "trainer.pi_old=bypass with routing.replay=r2: R2 replays θ_old's routing, which only the trainer's own "
            "π_old pass records; use trainer.pi_old=decoupled or auto"
        )
    if asked == PiOld.bypass and reads_pi_old:
        raise ConfigError(
            f"correction={reads_pi_old} weighs tokens by π_old/μ_old, which trainer.pi_old=bypass makes 1 (π_old := "
            "μ_old): use trainer.pi_old=decoupled or auto, or correction=opsm / none"
        )
    if asked == PiOld.bypass and reads_old_router:
        raise ConfigError(
            f"trainer.pi_old=bypass with routing_variant={reads_old_router}: it compares the router with θ_old's, whose "
            "log-probabilities only the trainer's own π_old pass records; use trainer.pi_old=decoupled or auto"
        )
    if asked == PiOld.decoupled:
        return asked, "asked: the trainer recomputes π_old at θ_old"
    if asked == PiOld.bypass:
        return asked, "asked: π_old := μ_old, the engine's log-probs"
    if replay == Replay.r2:
        return PiOld.decoupled, "r2 records θ_old's routing in the trainer's π_old pass"
    if replay == Replay.r3:
        return PiOld.decoupled, "r3 replays the engine's routing in the trainer's π_old pass"
    if reads_old_router:
        return PiOld.decoupled, f"routing_variant={reads_old_router} reads θ_old's router in the trainer's π_old pass"
    if not engine_is_trainer:
        return PiOld.decoupled, "the engine is not the trainer's model: its numbers are not π_old's"
    if reads_pi_old:
        return PiOld.decoupled, f"correction={reads_pi_old} weighs tokens by π_old/μ_old"
    return PiOld.bypass, "the engine is the trainer's own model: μ_old is π_old's own numbers, no recompute"


def _layout(cfg: Any, world: int) -> Layout:
    t = cfg.trainer
    packable = cfg.model.attn_implementation == PACKED_ATTENTION
    prompts = t.prompts_per_step // world
    divides = prompts % t.minibatches == 0
    if t.minibatch_layout == Layout.auto:
        return Layout.groups if divides and packable else Layout.rows
    if t.minibatch_layout == Layout.groups and not divides:
        raise ConfigError(
            f"trainer.minibatch_layout=groups puts whole groups in each minibatch, but trainer.minibatches="
            f"{t.minibatches} does not divide trainer.prompts_per_step={t.prompts_per_step}"
            + (f" / {world} ranks" if world > 1 else "") + "; use rows or auto"
        )
    if t.minibatch_layout == Layout.groups and not packable:
        raise ConfigError(
            f"trainer.minibatch_layout=groups feeds packed groups, which needs model.attn_implementation="
            f"{PACKED_ATTENTION} (this model uses {cfg.model.attn_implementation!r}); use rows or auto"
        )
    return Layout(t.minibatch_layout)


def _schema_from(cls: type, name: str, extra: list[tuple[str, type, Any]]) -> type:
    """A Hydra schema dataclass: `name` and `extra` fields, then the fields of `cls` with their defaults."""
    hints = typing.get_type_hints(cls)
    fields = [("name", str, field(default=name))]
    fields += [(key, typ, field(default=default)) for key, typ, default in extra]
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else MISSING
        fields.append((f.name, hints[f.name], field(default=default)))
    return dataclasses.make_dataclass(f"{cls.__name__}Schema", fields)


def algo_hyperparameters(algo_cfg: Any) -> tuple[str, bool, dict[str, Any]]:
    """Split an `algo` node into (objective name, divide advantages by std, objective hyperparameters)."""
    params = dict(algo_cfg)
    return params.pop("name"), bool(params.pop("advantage_std")), params


def _store_group(cs: ConfigStore, group: str, registry: Registry, extra) -> None:
    for name, cls in registry.items():
        cs.store(group=f"schema/{group}", name=name, node=_schema_from(cls, name, extra(cls)))


def register_configs() -> None:
    """Store every schema; idempotent (Hydra's ConfigStore overwrites entries of the same name)."""
    from algos import OBJECTIVES
    from algos.corrections import CORRECTIONS
    from algos.routing_variants import ROUTING_VARIANTS
    from experiments.tasks import TASKS

    # `${project_root:}` in yaml: checkpoints and reports resolve against the project, not the working directory.
    OmegaConf.register_new_resolver("project_root", lambda: str(PROJECT_ROOT), replace=True)
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(name="sft_schema", node=SFTConfig)
    cs.store(name="probe_schema", node=ProbeConfig)
    _store_group(cs, "algo", OBJECTIVES, lambda cls: [("advantage_std", bool, cls.advantage_std)])
    _store_group(cs, "dataset", TASKS, lambda cls: [])
    _store_group(cs, "correction", CORRECTIONS, lambda cls: [])
    _store_group(cs, "routing_variant", ROUTING_VARIANTS, lambda cls: [])
