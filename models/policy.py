"""The MoE policy: a transformers MoE causal LM, built from a config in code or loaded from a local checkpoint.

Two sources, one result (`model`, `tokenizer`):
- `path: null`: a Qwen3-MoE (`Qwen3MoeForCausalLM`) of the configured size with random weights and the
  character tokenizer of `models.tokenizer`. Routers are initialised with a larger std than transformers'
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

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers import PretrainedConfig, Qwen3Config, Qwen3MoeConfig
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from models import grouped_attention, sorted_experts
from models.moe_backend import apply_moe_backend, describe_experts_backend
from models.tokenizer import build_char_tokenizer

# MoE families whose routers `models.routing` can record and replay (softmax -> top-k -> optional renorm), and
# dense families accepted as controls (no routing: replay is refused, routing metrics are absent).
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral")
DENSE_FAMILIES = ("qwen3", "qwen2", "llama")
ARCHITECTURES = ("qwen3_moe", "qwen3")  # what `path: null` can build in code
FROM_CHECKPOINT = "from_checkpoint"  # `model=checkpoint`: the checkpoint at `path` decides; nothing is built in code
EXPERTS_IMPLEMENTATIONS = (sorted_experts.NAME, "grouped_mm", "eager", "batched_mm")
# Our kernels join transformers' registries once, at import, so that validation and `from_pretrained` see them.
sorted_experts.register()
grouped_attention.register()
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelConfig:
    """The `model` config group. Size fields apply to models built in code (`path: null`) only."""

    name: str = "tiny_moe"
    path: str | None = None  # local HF checkpoint directory; null builds `architecture` below in code
    architecture: str = "qwen3_moe"  # qwen3_moe, or qwen3: a dense control of the same width and depth
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    num_experts: int = 16
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    norm_topk_prob: bool = True  # Qwen3-30B-A3B renormalises the top-k gate weights
    max_position_embeddings: int = 256
    router_aux_loss_coef: float = 0.001  # Qwen3-30B-A3B's load-balancing coefficient
    router_init_std: float = 0.3  # std of the router weights at init: decisive routing from step 0
    init_seed: int = 0  # weights of a model built in code depend on this seed only, not on the run's seed
    experts_implementation: str = "sorted_mm"  # grouped_mm's arithmetic on any device, cheaper on CPU
    moe_backend: str = "hf"  # hf | torch_dmoe | megablocks (see models.moe_backend)
    dtype: str = "float32"
    attn_implementation: str = "sdpa"  # the tiny models' yaml picks grouped_eager (short sequences on CPU)


def validate_model_config(cfg: ModelConfig) -> None:
    """Refuse a bad model config at start-up with one line that names the bad value."""
    if cfg.experts_implementation not in EXPERTS_IMPLEMENTATIONS:
        raise ValueError(
            f"model.experts_implementation={cfg.experts_implementation!r} is not one of {list(EXPERTS_IMPLEMENTATIONS)}"
        )
    attention = ("eager", *ALL_ATTENTION_FUNCTIONS.keys())
    if cfg.attn_implementation not in attention:
        raise ValueError(f"model.attn_implementation={cfg.attn_implementation!r} is not one of {list(attention)}")
    if cfg.dtype not in DTYPES:
        raise ValueError(f"model.dtype={cfg.dtype!r} is not one of {list(DTYPES)}")
    if cfg.path is not None:
        path = Path(os.path.expanduser(cfg.path))
        if not path.is_dir():
            raise FileNotFoundError(f"model.path={cfg.path!r} does not exist or is not a directory")
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.path={cfg.path!r} has no config.json: not a Hugging Face checkpoint")
        return
    if cfg.architecture == FROM_CHECKPOINT:
        raise ValueError(f"model.architecture={FROM_CHECKPOINT!r} (model=checkpoint) needs model.path=/local/checkpoint")
    if cfg.architecture not in ARCHITECTURES:
        raise ValueError(f"model.architecture={cfg.architecture!r} is not one of {list(ARCHITECTURES)}")
    if cfg.num_experts_per_tok < 1 or cfg.num_experts_per_tok > cfg.num_experts:
        raise ValueError(
            f"model.num_experts_per_tok={cfg.num_experts_per_tok} must be between 1 and model.num_experts={cfg.num_experts}"
        )
    if cfg.router_init_std <= 0:
        raise ValueError(f"model.router_init_std={cfg.router_init_std} must be > 0")


def config_in_code(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    """The transformers config of a model built in code: a Qwen3-MoE whose every layer is an MoE layer, or the
    dense Qwen3 of the same width and depth (its MLP width is `intermediate_size`)."""
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
    return Qwen3MoeConfig(
        **shared,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size,
        norm_topk_prob=cfg.norm_topk_prob,
        router_aux_loss_coef=cfg.router_aux_loss_coef,
        decoder_sparse_step=1,  # every layer is an MoE layer
        mlp_only_layers=[],
    )


def build_policy(cfg: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Build (or load) the policy and its tokenizer on CPU, in `cfg.dtype`; the caller moves it to a device."""
    validate_model_config(cfg)
    dtype = DTYPES[cfg.dtype]
    if cfg.path is None:
        tokenizer = build_char_tokenizer()
        config = config_in_code(cfg, tokenizer)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.init_seed)
            model = AutoModelForCausalLM.from_config(config, attn_implementation=cfg.attn_implementation)
            for router in find_routers(model).values():
                torch.nn.init.normal_(router.weight, mean=0.0, std=cfg.router_init_std)
        model = model.to(dtype)
    else:
        path = os.path.expanduser(cfg.path)
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        if config.model_type not in MOE_FAMILIES + DENSE_FAMILIES:
            raise ValueError(
                f"model.path={cfg.path!r} is a {config.model_type!r} model; supported: MoE families "
                f"{list(MOE_FAMILIES)} and, as dense controls, {list(DENSE_FAMILIES)}"
            )
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=dtype, attn_implementation=cfg.attn_implementation
        )
    if find_routers(model):
        model.set_experts_implementation(cfg.experts_implementation)
        apply_moe_backend(model, cfg.moe_backend)
    elif cfg.moe_backend != "hf":
        raise ValueError(f"model.moe_backend={cfg.moe_backend!r} needs an MoE model; {cfg.name!r} is dense")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer


def find_routers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Every MoE router of `model`, keyed by module name, in layer order.

    transformers 5.x gives each MoE block a router module (`*TopKRouter`) that returns
    `(router_logits, top_k_weights, top_k_indices)`; that is the one place where experts are chosen.
    """
    return {
        name: module
        for name, module in model.named_modules()
        if type(module).__name__.endswith(("TopKRouter", "TopkRouter"))
    }


def describe_policy(model: PreTrainedModel) -> dict[str, object]:
    """What a run should record about its policy: family, size, experts implementation and backend, attention."""
    config = model.config
    total = sum(p.numel() for p in model.parameters())
    if not find_routers(model):
        return {"model_type": config.model_type, "num_hidden_layers": config.num_hidden_layers, "num_moe_layers": 0,
                "parameters": total, "attention": config._attn_implementation,
                "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}
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
