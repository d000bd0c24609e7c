"""The experts backend switch: transformers' experts, or MegaBlocks' dropless MoE (dMoE) layout and kernels.

A transformers 5.x MoE block calls two modules: the router `mlp.gate` (it picks the top-k experts of each token,
`(logits, top_k_weights, top_k_index)`) and the experts `mlp.experts`, called as
`experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`. The switch replaces only
the experts module, keeping that call, so the router, and the routing record / replay / drift hooked on it
(`models.routing`), work unchanged on every backend.

Backends (`model.moe_backend`):
  hf          transformers' own experts (`gate_up_proj [E, 2F, H]`, `down_proj [E, H, F]`; its
              `experts_implementation` decides eager / grouped_mm / batched_mm).
  torch_dmoe  `DroplessGLUExperts` holding MegaBlocks' GLU layout `w1`, `v1`, `w2` (each `[E*F, H]`) and
              running MegaBlocks' dropless computation in PyTorch (`models.dmoe_reference`); any device.
  megablocks  the same module, calling MegaBlocks' grouped dMoE kernels (`models.megablocks_experts`); CUDA,
              bfloat16. Install recipe and the kernels' limits are in that module's docstring.

Checkpoints stay in transformers' layout whatever the backend: the module's `state_dict()` converts
`w1, v1, w2` back to `gate_up_proj` / `down_proj` (losslessly), and `load_state_dict` accepts that layout, so
`save_pretrained` writes what an untouched model writes and a checkpoint trained on one backend loads on the
other. Apply the switch before building the optimizer: it replaces the experts' parameters.
"""

from collections.abc import Callable
from enum import StrEnum
from typing import Any, cast

import torch
from torch import nn

from models.dmoe_reference import FusedExperts, RoutedGLU, dmoe_glu_reference, hf_to_megablocks, megablocks_to_hf
from models.megablocks_experts import load_megablocks_kernels, megablocks_glu_forward, require_megablocks

__all__ = [
    "MOE_BACKENDS",
    "DroplessGLUExperts",
    "MoEBackend",
    "apply_moe_backend",
    "describe_experts_backend",
    "find_moe_experts",
    "hf_to_megablocks",
    "megablocks_to_hf",
]


class MoEBackend(StrEnum):
    hf = "hf"  # transformers' own experts
    torch_dmoe = "torch_dmoe"  # MegaBlocks' dropless GLU layout and computation in PyTorch, any device
    megablocks = "megablocks"  # the same layout with MegaBlocks' grouped kernels (CUDA, bfloat16)


MOE_BACKENDS = tuple(MoEBackend)
SUPPORTED_LAYOUT = (
    "fused experts with gate_up_proj [E, 2F, H] (gate rows, then up rows) and down_proj [E, H, F], "
    "no bias (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral)"
)


class DroplessGLUExperts(nn.Module):
    """MoE experts in MegaBlocks' dMoE GLU layout, a drop-in for a transformers `*Experts` module.

    Parameters `w1`, `v1`, `w2`, each `[E*F, H]`: expert e computes
    `(act(x @ w1[e].T) * (x @ v1[e].T)) @ w2[e]` with `w[e] = w.view(E, F, H)[e]`.
    """

    act_fn: Callable[[torch.Tensor], torch.Tensor]  # the gate's activation (a function or a module): a callable

    def __init__(self, experts: nn.Module, backend: str) -> None:
        """Take over the weights of transformers' `experts` (converted, not shared) and compute with `backend`."""
        super().__init__()
        if backend not in ("torch_dmoe", "megablocks"):
            raise ValueError(f"DroplessGLUExperts backend={backend!r} is not one of ['torch_dmoe', 'megablocks']")
        fused = cast(
            FusedExperts, experts
        )  # transformers' fused experts: the only modules given (`_check_convertible`)
        num_experts, two_width, hidden = fused.gate_up_proj.shape
        self.num_experts = num_experts
        self.expert_width = two_width // 2
        self.hidden_size = hidden
        self.backend = backend
        self.act_fn = fused.act_fn
        requires_grad = fused.gate_up_proj.requires_grad
        with torch.no_grad():
            w1, v1, w2 = hf_to_megablocks(fused.gate_up_proj, fused.down_proj)
        self.w1 = nn.Parameter(w1, requires_grad=requires_grad)
        self.v1 = nn.Parameter(v1, requires_grad=requires_grad)
        self.w2 = nn.Parameter(w2, requires_grad=requires_grad)
        # What `to_hf` rebuilds: the original class, with the model's config.
        self.hf_class = type(experts)
        self.hf_config = getattr(experts, "config", None)
        self.register_state_dict_post_hook(_state_dict_in_hf_layout)
        self.register_load_state_dict_pre_hook(_load_hf_layout)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k] -> [T, H], as transformers' experts."""
        call = RoutedGLU(
            hidden_states, top_k_index, top_k_weights, self.w1, self.v1, self.w2, self.num_experts, self.act_fn
        )
        if self.backend == "megablocks":
            return megablocks_glu_forward(load_megablocks_kernels(), call)
        return dmoe_glu_reference(call)

    def to_hf(self) -> nn.Module:
        """A transformers experts module of the original class holding these weights (converted back)."""
        with torch.no_grad():
            gate_up_proj, down_proj = megablocks_to_hf(self.w1, self.v1, self.w2, self.num_experts)
        # Build on the meta device: the real tensors are the converted ones assigned below.
        with torch.device("meta"):
            experts = self.hf_class(self.hf_config)
        experts.gate_up_proj = nn.Parameter(gate_up_proj, requires_grad=self.w1.requires_grad)
        experts.down_proj = nn.Parameter(down_proj, requires_grad=self.w1.requires_grad)
        return experts

    def describe(self) -> str:
        """The label `describe_experts_backend` reports for this module."""
        return "megablocks:grouped" if self.backend == "megablocks" else "torch_dmoe"

    def extra_repr(self) -> str:
        return (
            f"backend={self.backend}, num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"expert_width={self.expert_width}"
        )


def _state_dict_in_hf_layout(
    module: DroplessGLUExperts, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any]
) -> None:
    """state_dict post-hook: write `gate_up_proj` / `down_proj` in place of `w1, v1, w2` (checkpoints stay HF)."""
    w1, v1, w2 = (state_dict.pop(prefix + name) for name in ("w1", "v1", "w2"))
    with torch.no_grad():
        gate_up_proj, down_proj = megablocks_to_hf(w1, v1, w2, module.num_experts)
    state_dict[prefix + "gate_up_proj"] = gate_up_proj
    state_dict[prefix + "down_proj"] = down_proj


def _load_hf_layout(
    module: DroplessGLUExperts,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict[str, Any],
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """load_state_dict pre-hook: accept transformers' layout (converted); a dMoE-layout state dict passes as is."""
    keys = (prefix + "gate_up_proj", prefix + "down_proj")
    if all(key in state_dict for key in keys):
        w1, v1, w2 = hf_to_megablocks(*(state_dict.pop(key) for key in keys))
        state_dict.update({prefix + "w1": w1, prefix + "v1": v1, prefix + "w2": w2})


def _is_fused_experts(module: nn.Module) -> bool:
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == down.dim() == 3


def find_moe_experts(model: nn.Module) -> dict[str, nn.Module]:
    """Every MoE experts module of `model` (transformers' fused experts or `DroplessGLUExperts`), by name."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, DroplessGLUExperts) or _is_fused_experts(module)
    }


def _check_convertible(name: str, experts: nn.Module) -> None:
    """Refuse experts whose layout the dMoE GLU cannot hold (GPT-OSS: transposed, interleaved, biased)."""
    layout_ok = (
        getattr(experts, "is_concatenated", True)
        and not getattr(experts, "is_transposed", False)
        and not getattr(experts, "has_bias", False)
        and getattr(experts, "has_gate", True)
        and not getattr(experts, "has_post_expert_norm", False)
        and hasattr(experts, "act_fn")
    )
    fused = cast(FusedExperts, experts)  # `find_moe_experts` found its fused parameters; the rest is checked here
    num_experts, two_width, hidden = fused.gate_up_proj.shape
    shapes_ok = two_width % 2 == 0 and tuple(fused.down_proj.shape) == (num_experts, hidden, two_width // 2)
    if not (layout_ok and shapes_ok):
        raise ValueError(
            f"{name} ({type(experts).__name__}, gate_up_proj {tuple(fused.gate_up_proj.shape)}, down_proj "
            f"{tuple(fused.down_proj.shape)}) cannot use a dMoE backend; supported: {SUPPORTED_LAYOUT}"
        )


def _hf_implementation(experts: nn.Module) -> str:
    config = getattr(experts, "config", None)
    # transformers runs the class's own (eager) forward when no implementation is set.
    return getattr(config, "_experts_implementation", None) or "eager"


def apply_moe_backend(model: nn.Module, backend: str) -> None:
    """Swap, in place, every MoE block's experts module of `model` for `backend` (one of `MOE_BACKENDS`).

    `hf` keeps transformers' experts (and turns swapped ones back); `torch_dmoe` and `megablocks` install
    `DroplessGLUExperts`. Routers are not touched. Every check runs before anything is swapped.
    """
    if backend not in MOE_BACKENDS:
        raise ValueError(f"moe_backend={backend!r} is not one of {list(MOE_BACKENDS)}")
    experts_by_name = find_moe_experts(model)
    if not experts_by_name:
        raise ValueError(
            f"{type(model).__name__} has no MoE experts module, so moe_backend={backend!r} has nothing to swap; "
            f"expected {SUPPORTED_LAYOUT}"
        )
    to_convert = {n: m for n, m in experts_by_name.items() if not isinstance(m, DroplessGLUExperts)}
    if backend != "hf":
        for name, experts in to_convert.items():
            _check_convertible(name, experts)
    if backend == "megablocks":
        for experts in experts_by_name.values():
            if isinstance(experts, DroplessGLUExperts):
                require_megablocks(experts.hidden_size, experts.expert_width, experts.w1.dtype)
            else:
                gate_up_proj = cast(FusedExperts, experts).gate_up_proj  # `find_moe_experts`: fused experts
                _, two_width, hidden = gate_up_proj.shape
                require_megablocks(hidden, two_width // 2, gate_up_proj.dtype)

    for name, experts in experts_by_name.items():
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        if isinstance(experts, DroplessGLUExperts):
            if backend == "hf":
                setattr(parent, attribute, experts.to_hf())
            else:
                experts.backend = backend
        elif backend != "hf":
            setattr(parent, attribute, DroplessGLUExperts(experts, backend))


def describe_experts_backend(model: nn.Module) -> str:
    """Which experts implementation `model` runs: "hf:<experts_implementation>", "torch_dmoe", "megablocks:grouped".

    Several labels, joined by "+", would mean the MoE blocks disagree.
    """
    experts_by_name = find_moe_experts(model)
    if not experts_by_name:
        raise ValueError(f"{type(model).__name__} has no MoE experts module; expected {SUPPORTED_LAYOUT}")
    labels = {
        experts.describe() if isinstance(experts, DroplessGLUExperts) else f"hf:{_hf_implementation(experts)}"
        for experts in experts_by_name.values()
    }
    return "+".join(sorted(labels))
