"""`sorted_mm`: transformers' `grouped_mm` experts computation, with gathers that are cheap to differentiate.

The arithmetic is transformers' `grouped_mm` experts forward: sort the (token, slot) pairs by expert, one grouped
matmul for gate/up and one for down over contiguous rows, weight each row by its gate, sum each token's k rows.
Three steps differ, and they are where the CPU time of the tiny MoE's update went:

- the gather of token rows is `index_select` (its backward is `index_add_`) instead of advanced indexing, whose
  backward is `index_put_(accumulate=True)`, a slow serial kernel on CPU;
- the gate weight scales each row's activations before the down projection, not its output after it (the
  projection is linear): half the data on the tiny MoE (expert width F = H/2), still in cache when it is scaled;
- the combine adds each sorted row straight into its token with `index_add` (its backward is `index_select`)
  instead of un-permuting all rows then summing over k.

Outputs and gradients equal `grouped_mm`'s up to float rounding (the gate weight enters the product in another
order). Registered in transformers' `ExpertsInterface`, so `model.experts_implementation=sorted_mm`
selects it like any built-in implementation, and the routers — and routing record / replay — are untouched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from models.dmoe_reference import FusedExperts

NAME = "sorted_mm"


def sorted_mm_experts_forward(
    self: FusedExperts, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """`hidden_states [T, H]`, `top_k_index [T, k]`, `top_k_weights [T, k]` -> `[T, H]` (experts' weighted sum).

    Needs transformers' fused GLU layout: `gate_up_proj [E, 2F, H]`, `down_proj [E, H, F]`, no bias.
    """
    if not self.has_gate or self.has_bias or self.is_transposed:
        raise ValueError(
            f"experts_implementation={NAME!r} supports gated experts without bias in transformers' [E, out, in] "
            f"layout; {type(self).__name__} has has_gate={self.has_gate}, has_bias={self.has_bias}, "
            f"is_transposed={self.is_transposed}: use experts_implementation='grouped_mm'"
        )
    num_tokens, k = top_k_index.shape
    expert_ids, order = torch.sort(top_k_index.reshape(-1), stable=True)  # [T*k] slots grouped by expert
    token_of_slot = order // k
    rows = hidden_states.index_select(0, token_of_slot)  # [T*k, H]
    offsets = torch.cumsum(torch.bincount(expert_ids, minlength=self.num_experts), 0, dtype=torch.int32)
    gate_up = F.grouped_mm(rows.to(self.gate_up_proj.dtype), self.gate_up_proj.transpose(-2, -1), offs=offsets)
    gated = self._apply_gate(gate_up)  # [T*k, F]
    # The gate weight scales the F-wide activations rather than the H-wide output (down is linear): half the data
    # on the tiny MoE, and the activations are still in cache where the output of the matmul is not.
    gated = gated * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(gated.dtype)
    weighted = F.grouped_mm(gated, self.down_proj.transpose(-2, -1), offs=offsets)  # [T*k, H]
    combined = torch.zeros(num_tokens, weighted.shape[-1], dtype=weighted.dtype, device=weighted.device)
    return combined.index_add(0, token_of_slot, weighted).to(hidden_states.dtype)


def register() -> None:
    """Make `sorted_mm` a valid `experts_implementation` (idempotent)."""
    ALL_EXPERTS_FUNCTIONS.register(NAME, sorted_mm_experts_forward)
