"""The MoE policy: a transformers MoE causal LM, built from a config in code or loaded from a local checkpoint.

Two sources, one result (`model`, `tokenizer`):
- `path: null`: a Qwen3-MoE (`Qwen3MoeForCausalLM`) of the configured size, or a DeepSeek-V3 or GLM-4.5 MoE
  (`deepseek_v3`, `glm4_moe`: the sigmoid family, `models.routing`), with random weights and the character tokenizer
  of `models.tokenizer`. Routers are initialised with a larger std than transformers'
  0.02 so that routing is decisive from the start (near-tied routers flip on numerical noise, which would
  read as routing drift that no update caused).
- `path: /dir`: a local Hugging Face checkpoint of a supported MoE family, with its own tokenizer. The hub is
  never contacted.

The experts implementation (`sorted_mm`, ours: `models.sorted_experts`; or transformers' `grouped_mm`, `eager`,
`batched_mm`) and the attention implementation (`grouped_eager`, ours: `models.grouped_attention`; or
transformers' `sdpa`, `eager`, ...) are always set explicitly and reported by `describe_policy`, since they change
speed and, at float rounding, the exact numbers.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    DeepseekV3Config,
    Glm4MoeConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen3Config,
    Qwen3MoeConfig,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from models import grouped_attention, sorted_experts
from models.moe_backend import MoEBackend, apply_moe_backend, describe_experts_backend
from models.registry import ConfigError, check_fields
from models.routing.families import router_weight
from models.routing.trace import find_routers
from models.tokenizer import build_char_tokenizer

# MoE families whose routers `models.routing` can record and replay: the softmax family (softmax -> top-k ->
# optional renorm) and the sigmoid family (sigmoid + selection bias -> group-limited top-k -> renorm x scale), and
# dense families accepted as controls (no routing: replay is refused, routing metrics are absent).
SOFTMAX_FAMILIES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral")
SIGMOID_FAMILIES = ("deepseek_v3", "glm4_moe")
MOE_FAMILIES = SOFTMAX_FAMILIES + SIGMOID_FAMILIES
DENSE_FAMILIES = ("qwen3", "qwen2", "llama")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Architecture(StrEnum):
    """What `path: null` builds in code, or `from_checkpoint` (`model=checkpoint`: the checkpoint at `path` decides)."""

    qwen3_moe = "qwen3_moe"
    deepseek_v3 = "deepseek_v3"  # the sigmoid family with multi-head latent attention (DeepSeek-V3, Kimi K2)
    glm4_moe = "glm4_moe"  # the sigmoid family with grouped-query attention (GLM-4.5)
    qwen3 = "qwen3"  # a dense control of the same width and depth
    from_checkpoint = "from_checkpoint"


class ExpertsImplementation(StrEnum):
    """How a transformers experts module computes: ours (`models.sorted_experts`) or transformers' own."""

    sorted_mm = sorted_experts.NAME
    grouped_mm = "grouped_mm"
    eager = "eager"
    batched_mm = "batched_mm"


# DTYPES' names, each member's value its name (StrEnum's own values: the name, lowercased).
DType = StrEnum("DType", "float32 bfloat16 float16")


@dataclass
class ModelConfig:
    """The `model` config group. Its defaults are the tiny_moe model ("bench-tiny", 7.1 M parameters: the TRL peer
    benchmark's sizes); size fields apply to models built in code (`path: null`) only."""

    name: str = "tiny_moe"  # the label of runs and checkpoints
    path: str | None = None  # local HF checkpoint directory; null builds `architecture` below in code
    # What `path: null` builds: qwen3_moe (softmax routing), the sigmoid family deepseek_v3 or glm4_moe, the dense
    # control qwen3; from_checkpoint (`model=checkpoint`): the checkpoint at `path` decides.
    architecture: Architecture = Architecture.qwen3_moe
    hidden_size: int = 256  # width of the residual stream
    num_hidden_layers: int = 4  # every layer is an MoE layer in the MoE models built here
    num_attention_heads: int = 4  # query heads
    num_key_value_heads: int = 2  # key/value heads, each shared by num_attention_heads / num_key_value_heads queries
    head_dim: int = 64  # width of each attention head
    intermediate_size: int = 512  # MLP width of the dense control (qwen3)
    num_experts: int = 16  # routed experts per MoE layer
    num_experts_per_tok: int = 2  # top-k
    moe_intermediate_size: int = 128  # expert width
    norm_topk_prob: bool = True  # renormalise the top-k gate weights, as Qwen3-30B-A3B and DeepSeek-V3
    # The sigmoid family (architecture deepseek_v3 or glm4_moe) only: group-limited routing, shared experts, the
    # gates' scale; and deepseek_v3's multi-head latent attention, whose query and key heads are head_dim wide.
    n_group: int = 1  # expert groups (1: none); each token's top-k is taken within its best `topk_group` groups
    topk_group: int = 1  # the best groups, of n_group, that a token's top-k is taken within
    n_shared_experts: int = 1  # experts every token also passes through, each moe_intermediate_size wide
    routed_scaling_factor: float = 2.5  # the routed experts' gates are multiplied by this (DeepSeek-V3, GLM-4.5)
    kv_lora_rank: int = 32  # deepseek_v3: width of the compressed keys and values
    q_lora_rank: int | None = None  # deepseek_v3: width of the compressed queries; null: queries not compressed
    qk_rope_head_dim: int = 16  # deepseek_v3: rotary part of each query and key head (the rest carries no position)
    max_position_embeddings: int = 256  # the longest sequence (prompt and completion) the positions are made for
    router_init_std: float = 0.3  # std of the router weights at init: decisive routing from step 0
    # Scale the init std of every residual branch's output projection (attention's o_proj, the experts', the shared
    # experts' and the dense MLP's down_proj) by 1/sqrt(2 x layers), as GPT-2 (Radford et al. 2019, §2.3): the
    # residual stream's variance at init then stays flat with depth instead of growing with it, which deep narrow
    # models need to train.
    depth_scaled_init: bool = False
    init_seed: int = 0  # weights of a model built in code depend on this seed only, not on the run's seed
    experts_implementation: ExpertsImplementation = (
        ExpertsImplementation.sorted_mm
    )  # grouped_mm's arithmetic, cheaper on CPU
    moe_backend: MoEBackend = MoEBackend.hf  # hf | torch_dmoe | megablocks (models.moe_backend)
    dtype: DType = DType.float32  # the weights: float32 or bfloat16 (training refuses float16: AdamW underflows in it)
    # Any attention transformers knows, or ours: grouped_eager (`models.grouped_attention`: eager without per-head
    # KV copies; beats sdpa at 6-22 tokens on CPU, and it follows the packed groups of `experiments.step.scoring`).
    attn_implementation: str = grouped_attention.NAME

    def __post_init__(self) -> None:
        # Hydra checks these types at composition; Python callers get the same check (and enum members).
        check_fields(self, "model")


def register_kernels() -> None:
    """Our kernels join transformers' registries (idempotent): before a policy is built or its config checked."""
    sorted_experts.register()
    grouped_attention.register()


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def model_config(cfg: ModelConfig) -> PretrainedConfig:
    """Check the model settings and return the transformers config the run will train: read from a checkpoint's
    files (no weights loaded) or built in code. A bad value raises `ConfigError` naming it."""
    register_kernels()
    attention = ("eager", *ALL_ATTENTION_FUNCTIONS.keys())
    if cfg.attn_implementation not in attention:
        raise ConfigError(f"model.attn_implementation={cfg.attn_implementation!r} is not one of {list(attention)}")
    if cfg.path is not None:
        return _checkpoint_config(cfg.path)
    if cfg.architecture == Architecture.from_checkpoint:
        raise ConfigError("model.architecture='from_checkpoint' (model=checkpoint) needs model.path=/local/checkpoint")
    if cfg.num_experts_per_tok < 1 or cfg.num_experts_per_tok > cfg.num_experts:
        raise ConfigError(
            f"model.num_experts_per_tok={cfg.num_experts_per_tok} must be between 1 and "
            f"model.num_experts={cfg.num_experts}"
        )
    if cfg.router_init_std <= 0:
        raise ConfigError(f"model.router_init_std={cfg.router_init_std} must be > 0")
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "num_experts",
        "moe_intermediate_size",
        "max_position_embeddings",
    ):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"model.{key}={getattr(cfg, key)} must be >= 1")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ConfigError(
            f"model.num_key_value_heads={cfg.num_key_value_heads} must divide model.num_attention_heads="
            f"{cfg.num_attention_heads}"
        )
    if cfg.architecture == Architecture.qwen3 and cfg.moe_backend != MoEBackend.hf:
        raise ConfigError(f"model.moe_backend={cfg.moe_backend!r} needs an MoE model; {cfg.name!r} is dense")
    check_sigmoid_family(cfg)
    return config_in_code(cfg, build_char_tokenizer())


def check_sigmoid_family(cfg: ModelConfig) -> None:
    """The sigmoid family's sizes: groups that split the experts and leave the top-k enough to choose from, and
    deepseek_v3's latent attention; a softmax family given expert groups is refused (it would ignore them)."""
    if cfg.architecture.value not in SIGMOID_FAMILIES:
        if cfg.n_group != 1:
            raise ConfigError(
                f"model.n_group={cfg.n_group} groups experts for the sigmoid family (architecture "
                f"{' or '.join(SIGMOID_FAMILIES)}); architecture={cfg.architecture} has none: use 1"
            )
        return
    if cfg.n_group < 1 or cfg.num_experts % cfg.n_group or cfg.num_experts // cfg.n_group < 2:
        raise ConfigError(
            f"model.n_group={cfg.n_group} must split model.num_experts={cfg.num_experts} into groups of "
            "at least 2 experts (a group scores the sum of its two best)"
        )
    if not 1 <= cfg.topk_group <= cfg.n_group:
        raise ConfigError(f"model.topk_group={cfg.topk_group} must be between 1 and model.n_group={cfg.n_group}")
    if cfg.topk_group * cfg.num_experts // cfg.n_group <= cfg.num_experts_per_tok:
        raise ConfigError(
            f"model.topk_group={cfg.topk_group} groups of {cfg.num_experts // cfg.n_group} experts must "
            f"hold more than model.num_experts_per_tok={cfg.num_experts_per_tok} (a choice to make)"
        )
    if cfg.n_shared_experts < 1:
        raise ConfigError(f"model.n_shared_experts={cfg.n_shared_experts} must be >= 1 (the family's shared expert)")
    if not (math.isfinite(cfg.routed_scaling_factor) and cfg.routed_scaling_factor > 0):
        raise ConfigError(f"model.routed_scaling_factor={cfg.routed_scaling_factor} must be a finite number > 0")
    if cfg.architecture != Architecture.deepseek_v3:
        return
    if not 2 <= cfg.qk_rope_head_dim < cfg.head_dim or cfg.qk_rope_head_dim % 2:
        raise ConfigError(
            f"model.qk_rope_head_dim={cfg.qk_rope_head_dim} must be even, >= 2 and below model.head_dim="
            f"{cfg.head_dim} (the rest of a query and key head carries no position)"
        )
    if cfg.kv_lora_rank < 1 or (cfg.q_lora_rank is not None and cfg.q_lora_rank < 1):
        raise ConfigError(
            f"model.kv_lora_rank={cfg.kv_lora_rank} and model.q_lora_rank={cfg.q_lora_rank} must be >= 1 "
            "(q_lora_rank may be null)"
        )


def _checkpoint_config(given: str) -> PretrainedConfig:
    """The config of the checkpoint at `given`, after checking that its files are there and readable."""
    path = Path(os.path.expanduser(given))
    if not path.is_dir():
        raise ConfigError(f"model.path={given!r} does not exist or is not a directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"model.path={given!r} has no config.json: not a Hugging Face checkpoint")
    try:
        model_type = json.loads(config_file.read_text(encoding="utf-8")).get("model_type")
    except (ValueError, UnicodeDecodeError, AttributeError) as error:
        raise ConfigError(f"model.path={given!r}: config.json is not a JSON object ({error})") from None
    if model_type not in MOE_FAMILIES + DENSE_FAMILIES:
        raise ConfigError(
            f"model.path={given!r} is a {model_type!r} model; supported: MoE families {list(MOE_FAMILIES)} and, "
            f"as dense controls, {list(DENSE_FAMILIES)}"
        )
    if not any(next(path.glob(pattern), None) for pattern in WEIGHT_FILES):
        raise ConfigError(f"model.path={given!r} holds no weights (none of {', '.join(WEIGHT_FILES)})")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"model.path={given!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, TypeError, KeyError) as error:
        raise ConfigError(
            f"model.path={given!r}: config.json does not describe a {model_type} model ({error})"
        ) from None


def is_moe(config: PretrainedConfig) -> bool:
    return config.model_type in MOE_FAMILIES


def config_in_code(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    """The transformers config of a model built in code: a Qwen3-MoE, DeepSeek-V3 or GLM-4.5 MoE whose every layer
    is an MoE layer, or the dense Qwen3 of the same width and depth (its MLP width is `intermediate_size`).

    DeepSeek-V3's latent attention gives every head its own keys and values (num_key_value_heads is the head count
    there), query and key heads of head_dim = qk_rope_head_dim + a position-free rest, value heads of head_dim (its
    config's own `head_dim` is the rotary width, as transformers' DeepseekV3Config sets it). No
    multi-token-prediction layers."""
    shared = dict(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    if cfg.architecture == "qwen3":
        return Qwen3Config(**shared)
    if cfg.architecture.value in SIGMOID_FAMILIES:
        sigmoid: dict[str, Any] = dict(
            n_routed_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            norm_topk_prob=cfg.norm_topk_prob,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            n_shared_experts=cfg.n_shared_experts,
            routed_scaling_factor=cfg.routed_scaling_factor,
            first_k_dense_replace=0,  # every layer is an MoE layer
            num_mtp_layers=0,
        )
        if cfg.architecture == Architecture.glm4_moe:
            return Glm4MoeConfig(**shared, **sigmoid)
        return DeepseekV3Config(
            **{**shared, "num_key_value_heads": cfg.num_attention_heads, "head_dim": cfg.qk_rope_head_dim},
            **sigmoid,
            kv_lora_rank=cfg.kv_lora_rank,
            q_lora_rank=cfg.q_lora_rank,
            qk_rope_head_dim=cfg.qk_rope_head_dim,
            qk_nope_head_dim=cfg.head_dim - cfg.qk_rope_head_dim,
            v_head_dim=cfg.head_dim,
            # What DeepSeek-V3's own config.json says of its routing; transformers always routes so, vLLM reads them.
            # transformers keeps a key its signature does not list as an attribute; its typed signature refuses it.
            topk_method="noaux_tc",  # type: ignore[call-arg]
            scoring_func="sigmoid",
        )
    return Qwen3MoeConfig(
        **shared,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size,
        norm_topk_prob=cfg.norm_topk_prob,
        decoder_sparse_step=1,  # every layer is an MoE layer
        mlp_only_layers=[],
    )


RESIDUAL_OUTPUTS = (
    "self_attn.o_proj.weight",
    "mlp.experts.down_proj",
    "mlp.down_proj.weight",
    "mlp.shared_experts.down_proj.weight",
)


def scale_residual_outputs(model: PreTrainedModel, std: float) -> None:
    """Re-draw the weights that write into the residual stream (`RESIDUAL_OUTPUTS` of every layer) with `std`."""
    for name, weight in model.named_parameters():
        if name.endswith(RESIDUAL_OUTPUTS):
            torch.nn.init.normal_(weight, mean=0.0, std=std)


def build_policy(cfg: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Build (or load) the policy and its tokenizer on CPU, in `cfg.dtype`; the caller moves it to a device."""
    model_config(cfg)
    dtype = DTYPES[cfg.dtype]
    tokenizer: PreTrainedTokenizerBase
    if cfg.path is None:
        tokenizer = build_char_tokenizer()
        config = config_in_code(cfg, tokenizer)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.init_seed)
            model = AutoModelForCausalLM.from_config(config, attn_implementation=cfg.attn_implementation)
            for router in find_routers(model).values():
                torch.nn.init.normal_(router_weight(router), mean=0.0, std=cfg.router_init_std)
            if cfg.depth_scaled_init:
                scale_residual_outputs(model, config.initializer_range / math.sqrt(2 * cfg.num_hidden_layers))
        model = model.to(dtype)
    else:
        model, tokenizer = _load_checkpoint(cfg, cfg.path, dtype)
    if find_routers(model):
        model.set_experts_implementation(cfg.experts_implementation)
        apply_moe_backend(model, cfg.moe_backend)
    elif cfg.moe_backend != MoEBackend.hf:
        raise ConfigError(f"model.moe_backend={cfg.moe_backend!r} needs an MoE model; {cfg.name!r} is dense")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer


def _load_checkpoint(
    cfg: ModelConfig, checkpoint: str, dtype: torch.dtype
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model and tokenizer of the `checkpoint` directory (`cfg.path`); files that do not load (truncated weights,
    tensors of another shape, a broken tokenizer) raise `ConfigError` with the loader's own first line."""
    path = os.path.expanduser(checkpoint)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as error:
        raise ConfigError(f"model.path={cfg.path!r}: the tokenizer does not load ({_first_line(error)})") from None
    if len(tokenizer) < 2:
        raise ConfigError(
            f"model.path={cfg.path!r}: the tokenizer has {len(tokenizer)} token(s); its files are incomplete"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=dtype, attn_implementation=cfg.attn_implementation
        )
    except (OSError, ValueError, RuntimeError, SafetensorError) as error:
        raise ConfigError(f"model.path={cfg.path!r}: the weights do not load ({_first_line(error)})") from None
    return model, tokenizer


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def describe_policy(model: PreTrainedModel) -> dict[str, object]:
    """What a run should record about its policy: family, size, experts implementation and backend, attention."""
    config = model.config
    total = sum(p.numel() for p in model.parameters())
    if not find_routers(model):
        return {
            "model_type": config.model_type,
            "num_hidden_layers": config.num_hidden_layers,
            "num_moe_layers": 0,
            "parameters": total,
            "attention": config._attn_implementation,
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        }
    return {
        "model_type": config.model_type,
        "num_hidden_layers": config.num_hidden_layers,
        "num_moe_layers": len(find_routers(model)),
        "num_experts": getattr(config, "num_experts", getattr(config, "num_local_experts", None)),
        "num_experts_per_tok": config.num_experts_per_tok,
        "parameters": total,
        "experts_backend": describe_experts_backend(model),
        "attention": config._attn_implementation,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
    }
