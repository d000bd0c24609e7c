"""What a rollout engine is: everything the loop, the checkpoint and the benchmarks call on the sampler μ_old.

The loop asks an engine for `Samples` and hands it new weights after the step's updates; it never assumes the
engine is its own `nn.Module`. Samples carry what the loss needs from the sampler: the tokens and masks, the
engine's own log-probs of the tokens it sampled (μ_old, fp32, under `logits / temperature`, the distribution the
tokens were drawn from) and, when asked, the engine's routing per token.

Layout of a rollout batch (what every later stage indexes into):
    input_ids      [N, P + T]  left-padded prompt (width P), then the response, right-padded after eos
    attention_mask [N, P + T]  1 on prompt tokens and on response tokens up to and including eos
    response_mask  [N, T]      1 on response tokens (eos included): the tokens the objective scores
    logp           [N, T]      μ_old's log-probs of the response tokens, 0 after eos
    routes         [L, N, P + T, K] the engine's experts per token (`models.routing.trace.RoutingTrace`), or None
N = prompts x group size, rows of one prompt contiguous (prompt j owns rows j*G .. j*G+G-1).

Engines are registered by name (`ENGINES`, `rollout.engine=<name>`) and build themselves from the run's config; what
an engine returns (`returns_*`) is what the start-up checks hold a run's needs against (`check`).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar, cast

import torch
from omegaconf import OmegaConf
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from experiments.ranks import Ranks
from models.registry import ConfigError, Registry
from models.routing.trace import RoutingTrace


class Precision(StrEnum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class KVCache(StrEnum):
    """The HF engine's KV cache (`rollout.kv_cache`, `engines.hf.PreallocatedLayer`)."""

    preallocated = "preallocated"  # buffers with room for the rollout, written in place (the default)
    concat = "concat"  # transformers' DynamicCache: grown by concatenation at every step (the reference)


class WeightQuant(StrEnum):
    none = "none"
    int8 = "int8"
    fp8 = "fp8"  # e4m3 with a per-channel scale


@dataclass
class EngineNumerics:
    """How the engine's numbers differ from the trainer's on purpose (training–inference mismatch a run can dial);
    all off: they do not, and the engine may sample with the trainer's own model. The `rollout` config group extends
    these fields (`experiments.config.RolloutConfig`), so each default is written here once."""

    precision: Precision = Precision.fp32  # the engine copy's dtype (log-probs are still taken in fp32)
    weight_quant: WeightQuant = WeightQuant.none  # fake quantization of the copy's linear and expert weights
    router_noise: float = 0.0  # σ of the Gaussian noise on the copy's router logits, before its top-k

    @classmethod
    def of(cls, rollout: Any) -> EngineNumerics:
        """The numerics of a `rollout` config node."""
        return cls(Precision(rollout.precision), WeightQuant(rollout.weight_quant), float(rollout.router_noise))

    @property
    def differs(self) -> bool:
        return EngineNumerics.of(self) != EngineNumerics()


@dataclass(kw_only=True)
class Samples:
    """What an engine returns for a batch of prompts (see the module docstring for the layout)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    prompt_width: int
    completions: list[str]  # decoded responses, without eos and padding
    truncated: torch.Tensor  # [N] bool: no eos within the generation budget
    logp: torch.Tensor | None  # [N, T] μ_old, fp32; None for greedy decoding or an engine without log-probs
    routes: RoutingTrace | None = None  # when asked: the engine's experts per token, NO_ROUTE where none

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]


@dataclass(frozen=True)
class Sampling:
    """How the loop asks an engine to sample a batch of prompts: `group_size` completions of each, at most
    `max_new_tokens` each, at `temperature` (or decoded greedily), with the engine's routing when asked."""

    group_size: int
    max_new_tokens: int
    temperature: float
    greedy: bool = False  # greedy decoding (no log-probs); the held-out evaluation's
    record_routing: bool = False  # also the engine's experts per token (`Samples.routes`)
    record_gates: bool = False  # and their gate weights and router log-probabilities (`RoutingTrace.weights`...)
    # route by the routers' predictors (PR2, `models.routing.predictor`), and record the routers' inputs and logits
    # with the routes (`RoutingTrace.inputs`, `.logits`)
    predict_routes: bool = False


@dataclass(frozen=True)
class Needs:
    """What a run needs from its engine beyond tokens, each as the clause that says which setting asks for it (None:
    not needed); `RolloutEngine.check` refuses a need the engine does not serve, with that clause."""

    logprobs: str | None = None  # μ_old's log-probs: bypass, a rollout correction, MiniRL's IS weight
    routing: str | None = None  # the engine's experts per token: r3 replays them
    gate_weights: str | None = None  # and the gate weights it gave them: r3 with full replay
    predicted_routes: str | None = None  # routing by the routers' predictors, with their states: PR2


class RolloutEngine(ABC):
    """The sampler μ_old. A subclass sets what it returns and implements `build`, `sample`, `sync_weights` and
    `reseed`; `check` and `shares_weights_with_trainer` have defaults a subclass may extend."""

    name: ClassVar[str] = "engine"  # the registry key, set by `ENGINES.register`
    returns_logprobs: ClassVar[bool] = True  # samples carry μ_old's log-probs (bypass, corrections, MiniRL read them)
    returns_routing: ClassVar[bool] = True  # it can report its experts per token (what r3 replays)
    returns_gate_weights: ClassVar[bool] = True  # and the gate weights it gave them (r3 with full replay)
    routes_by_predictors: ClassVar[bool] = False  # it can route by the routers' predictors and record their states

    # Set by every engine when it is built:
    shares_trainer_weights: bool  # it computes with the trainer's own module: nothing to sync
    numerics: EngineNumerics  # how its numbers differ from the trainer's (summary.json records it)
    noise: torch.Generator  # its own random stream (router noise), saved in checkpoints and set by `reseed`
    min_new_tokens: int  # ban eos before this many tokens (the benchmark's fixed-length steps); 0: off

    @classmethod
    def shares_weights_with_trainer(cls, numerics: EngineNumerics) -> bool:
        """Whether the engine built for `numerics` can sample with the trainer's own model, so that its numbers are
        π_old's. The rollout source decides whether it does (an engine behind θ_old holds older weights:
        `RolloutSource.engine_is_trainer`), once, for the plan (`StepPlan.engine_is_trainer`)."""
        return False

    @classmethod
    def check(cls, cfg: Any, world: int, needs: Needs) -> None:
        """Refuse, in one line and before anything is built, a run this engine cannot serve: a need it does not
        return, or settings it cannot run. A subclass extends this with its own settings (calling it first)."""
        sigma = cfg.rollout.router_noise
        if not (math.isfinite(sigma) and sigma >= 0):
            raise ConfigError(f"rollout.router_noise={sigma} must be a finite number >= 0 (the noise's σ)")
        if cfg.rollout.weight_quant != WeightQuant.none and cfg.model.moe_backend != "hf":
            raise ConfigError(
                f"rollout.weight_quant={cfg.rollout.weight_quant} quantizes transformers' expert layout; "
                f"model.moe_backend={cfg.model.moe_backend} holds another: use model.moe_backend=hf"
            )
        if needs.logprobs and not cls.returns_logprobs:
            raise ConfigError(f"{needs.logprobs}, which rollout.engine={cls.name} does not return")
        if needs.routing and not cls.returns_routing:
            raise ConfigError(f"{needs.routing}, which rollout.engine={cls.name} does not report")
        if needs.gate_weights and not cls.returns_gate_weights:
            raise ConfigError(
                f"{needs.gate_weights}, and rollout.engine={cls.name} reports the experts' ids only: use "
                "rollout.engine=hf or routing.replay=r2"
            )
        if needs.predicted_routes and not cls.routes_by_predictors:
            raise ConfigError(
                f"{needs.predicted_routes}, and rollout.engine={cls.name} routes inside its own kernels: "
                "use rollout.engine=hf"
            )

    @classmethod
    @abstractmethod
    def build(
        cls,
        cfg: Any,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        numerics: EngineNumerics | None,
        ranks: Ranks,
        records_routing: bool,
    ) -> RolloutEngine:
        """The engine of a run: `model` is the policy it samples (the trainer's, not yet sharded, or a worker's),
        `numerics` how the engine's numbers should differ from it, or None where it samples with `model` itself (only
        where `shares_weights_with_trainer` allows it: `EngineFactory`), `records_routing` whether the loop will ask
        for its routing (`StepPlan.engine_records_routing`)."""

    @abstractmethod
    def sample(self, prompts: list[str], sampling: Sampling) -> Samples:
        """The completions of `prompts` that `sampling` asks for, laid out as the module docstring says."""

    @abstractmethod
    def sync_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Take `weights`, a full (unsharded) state dict of the trainer's model (`full_weights`): the trainer's after
        the step's updates, or an older version's under a lag. Never called on an engine that shares the trainer's
        module (`shares_trainer_weights`)."""

    @abstractmethod
    def reseed(self, seed: int) -> None:
        """Seed the engine's random streams for the next samples (the loop does, every step, from (seed, step,
        rank): a resumed run samples what the uninterrupted one sampled)."""

    def describe(self) -> dict[str, Any]:
        """What `summary.json` records about this engine beyond its name and numerics (`engine_details`): for an
        external engine its build, the routing path that ran and its costs."""
        return {}


@dataclass(frozen=True)
class EngineFactory:
    """How the run's engine is built, in whichever process samples: the trainer's, or a worker's that builds its own
    model (picklable: a spawned worker receives it). `min_new_tokens`: ban eos before that many tokens (the
    benchmarks' fixed-length steps; 0: off)."""

    engine: type[RolloutEngine]
    cfg: Any  # the run's config, which an engine builds itself from
    numerics: EngineNumerics  # how its numbers differ from the trainer's (`rollout.precision`, ...)
    records_routing: bool  # the loop will ask for its routing (`StepPlan.engine_records_routing`)
    min_new_tokens: int = 0

    def __call__(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, ranks: Ranks, on_model: bool
    ) -> RolloutEngine:
        """The engine, sampling with `model` itself (`on_model`: whoever calls decided it may) or with a copy of its
        own that differs from it by `numerics`."""
        engine = self.engine.build(
            self.cfg, model, tokenizer, None if on_model else self.numerics, ranks, self.records_routing
        )
        engine.min_new_tokens = self.min_new_tokens
        return engine

    def __getstate__(self) -> dict[str, Any]:
        """Pickled with the config's values only: a composed config's schema classes are made at run time, and a
        worker's interpreter could not find them."""
        return {**vars(self), "cfg": OmegaConf.create(OmegaConf.to_container(self.cfg, resolve=True))}

    def can_sample_on(self) -> bool:
        """Whether the engine can sample with the model it is given itself: its numbers do not differ from it."""
        return self.engine.shares_weights_with_trainer(self.numerics)


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's full state dict, gathered from every rank when it is sharded (FSDP2): what `sync_weights` takes.
    Of an unsharded model, its own tensors (no copy)."""
    # a full state dict (full_state_dict=True): plain tensors
    return cast(dict[str, torch.Tensor], get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))


ENGINES: Registry[RolloutEngine] = Registry("rollout engine", RolloutEngine, fields_are_parameters=False)
