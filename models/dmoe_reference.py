"""MegaBlocks' dropless MoE (dMoE) GLU experts in plain PyTorch: the weight layout and the computation.

Layout. MegaBlocks' dMoE stores the experts of a GLU MLP (`mlp_type='glu'`) as three 2-D matrices with the
experts stacked along the rows, each `[E*F, H]` (E experts, expert width F, hidden size H):

    y_e(x) = (act(x @ w1[e].T) * (x @ v1[e].T)) @ w2[e],      w[e] = w.view(E, F, H)[e]   ([F, H])

transformers 5.x fuses the same experts as `gate_up_proj [E, 2F, H]` (the gate rows, then the up rows) and
`down_proj [E, H, F]`, so `w1[e] = gate_up_proj[e, :F]`, `v1[e] = gate_up_proj[e, F:]`, `w2[e] = down_proj[e].T`
(MegaBlocks `layers/glu.py`; transformers `integrations/moe.py`). The conversion is a pure re-indexing, hence
lossless both ways.

Computation (MegaBlocks `layers/dmoe.py`, grouped path). Every token sends one copy of itself to each of its
top-k experts. The T*k token-slots are sorted by expert, each expert runs its MLP once over its contiguous
segment (a grouped matmul), and the results are weighted by their routing weight, returned to slot order
and summed over the k slots of each token. No token is dropped: there is no capacity limit.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch


class FusedExperts(Protocol):
    """transformers 5.x fused experts module (`*Experts`) as this project reads it. Its attributes are plain ones and
    parameters, which torch's `Module.__getattr__` types alike as `Tensor | Module`: a module found to hold this
    layout (`models.moe_backend.find_moe_experts`) is read through this type."""

    num_experts: int
    gate_up_proj: torch.nn.Parameter  # [E, 2F, H]: the gate rows, then the up rows
    down_proj: torch.nn.Parameter  # [E, H, F]
    act_fn: Callable[[torch.Tensor], torch.Tensor]
    has_gate: bool
    has_bias: bool
    is_transposed: bool

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor: ...


def hf_to_megablocks(
    gate_up_proj: torch.Tensor, down_proj: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' fused experts (`gate_up_proj [E, 2F, H]`, `down_proj [E, H, F]`) -> dMoE `(w1, v1, w2)`.

    Each of w1, v1, w2 is `[E*F, H]`.
    """
    if gate_up_proj.dim() != 3 or down_proj.dim() != 3:
        raise ValueError(
            f"expected gate_up_proj [E, 2F, H] and down_proj [E, H, F], got shapes "
            f"{tuple(gate_up_proj.shape)} and {tuple(down_proj.shape)}"
        )
    num_experts, two_width, hidden = gate_up_proj.shape
    width = two_width // 2
    if two_width % 2 or tuple(down_proj.shape) != (num_experts, hidden, width):
        raise ValueError(
            f"gate_up_proj {tuple(gate_up_proj.shape)} and down_proj {tuple(down_proj.shape)} do not describe "
            f"the same experts: expected down_proj of shape ({num_experts}, {hidden}, {width}) and an even 2F"
        )
    w1 = gate_up_proj[:, :width].reshape(num_experts * width, hidden)
    v1 = gate_up_proj[:, width:].reshape(num_experts * width, hidden)
    w2 = down_proj.transpose(1, 2).reshape(num_experts * width, hidden)
    return w1, v1, w2


def megablocks_to_hf(
    w1: torch.Tensor, v1: torch.Tensor, w2: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """dMoE `(w1, v1, w2)`, each `[E*F, H]` -> transformers' `(gate_up_proj [E, 2F, H], down_proj [E, H, F])`.

    `num_experts` is needed because the stacked `[E*F, H]` matrices do not say where one expert ends.
    """
    if not (w1.shape == v1.shape == w2.shape) or w1.dim() != 2:
        raise ValueError(
            f"expected w1, v1, w2 of one shape [E*F, H], got {tuple(w1.shape)}, {tuple(v1.shape)}, {tuple(w2.shape)}"
        )
    rows, hidden = w1.shape
    if num_experts < 1 or rows % num_experts:
        raise ValueError(f"num_experts={num_experts} does not divide the {rows} stacked expert rows of w1")
    width = rows // num_experts
    gate = w1.reshape(num_experts, width, hidden)
    up = v1.reshape(num_experts, width, hidden)
    gate_up_proj = torch.cat([gate, up], dim=1)
    down_proj = w2.reshape(num_experts, width, hidden).transpose(1, 2).contiguous()
    return gate_up_proj, down_proj


@dataclass(frozen=True)
class RoutedGLU:
    """One call of dropless GLU experts on routing decisions already made: what every implementation of the
    computation takes (`dmoe_glu_reference`, `models.megablocks_experts.megablocks_glu_forward`).

    hidden_states [T, H], top_k_index [T, k] (expert ids in [0, E)), top_k_weights [T, k]; w1, v1, w2 [E*F, H]
    (`num_experts` E: the stacked matrices do not say where one expert ends); `act_fn` the gate's activation.
    """

    hidden_states: torch.Tensor
    top_k_index: torch.Tensor
    top_k_weights: torch.Tensor
    w1: torch.Tensor
    v1: torch.Tensor
    w2: torch.Tensor
    num_experts: int
    act_fn: Callable[[torch.Tensor], torch.Tensor]


def dmoe_glu_reference(call: RoutedGLU) -> torch.Tensor:
    """Dropless GLU experts on given routing decisions, differentiable in every floating input. Returns [T, H] in the
    dtype of `hidden_states`."""
    hidden_states, top_k_index, num_experts = call.hidden_states, call.top_k_index, call.num_experts
    num_tokens, top_k = top_k_index.shape
    hidden = hidden_states.shape[-1]
    if num_tokens == 0:
        return torch.zeros_like(hidden_states)
    slot_experts = top_k_index.reshape(-1)
    # A stable sort keeps each expert's slots in token order, like MegaBlocks' radix sort.
    _, slot_order = torch.sort(slot_experts, stable=True)
    tokens_per_expert = torch.bincount(slot_experts, minlength=num_experts).tolist()
    routed = hidden_states.index_select(0, slot_order // top_k)  # [T*k, H], grouped by expert

    gate, up, down = (w.view(num_experts, -1, hidden) for w in (call.w1, call.v1, call.w2))
    segments = []
    for expert, rows in enumerate(routed.split(tokens_per_expert)):
        if rows.shape[0] == 0:
            continue
        glu = call.act_fn(rows @ gate[expert].T) * (rows @ up[expert].T)
        segments.append(glu @ down[expert])
    expert_out = torch.cat(segments)  # [T*k, H], still grouped by expert

    inverse = torch.empty_like(slot_order)
    inverse[slot_order] = torch.arange(slot_order.numel(), device=slot_order.device)
    per_slot = expert_out[inverse].view(num_tokens, top_k, hidden)
    # The weights join at the scatter (as in MegaBlocks), so the router's gradient flows through them only.
    weighted = per_slot * call.top_k_weights.unsqueeze(-1)
    return weighted.sum(dim=1).to(hidden_states.dtype)
