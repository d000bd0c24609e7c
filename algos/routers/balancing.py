"""Load balance: the losses that push routers towards balance, on one forward's router calls (`RouterCalls`), for
either family (`aux_loss` and `bias_update` add them to a loss; every RL update logs the global one as
`moe/aux_loss`).

With p_t the router's normalised scores of token t over the E experts (the softmax family's probabilities; the
sigmoid family's s_t / Σ_e s_t,e, s = sigmoid(z): DeepSeek-V3 report eq. 19) and c_t,e = 1 when the router's own
top-k (its selection, bias included) holds expert e:

- `global_balance_loss`, the Switch Transformer loss (Fedus et al. 2021, eqs. 4-6) as transformers' MoE families
  compute it (Qwen2/3-MoE, OLMoE, Mixtral `load_balancing_loss_func`, transformers 5.24), over every layer's tokens of
  the whole batch at once, as Qwen3's global-batch balancing:
      E · Σ_e f_e · P_e,  f_e = Σ_{t,ℓ} w_t c_t,e / Σ_{t,ℓ} w_t,  P_e = Σ_{t,ℓ} w_t p_t,e / Σ_{t,ℓ} w_t
  (k at perfect balance: Σ_e f_e = k);
- `sequence_balance_loss`, DeepSeek-V3's complementary sequence-wise loss (report §2.1.2, eqs. 17-20), per layer
  and per sequence, then the mean over both:
      Σ_e f_e · P_e,  f_e = E / (k·T) Σ_t w_t c_t,e,  P_e = (1/T) Σ_t w_t p_t,e,  T = Σ_t w_t
  (1 at perfect balance). A sequence is a row of the forward: a completion fed alone, or under the packed layout a
  group (its prompt once, its G completions).

Each token weighs `RouterCalls.weights` (0 on padding; a packed prompt token G). The gradient reaches the routers
through P only (the top-k count is discrete). With `over_ranks` (a sum over data-parallel ranks) the counts, sums
and sequence counts are the whole batch's; each function returns the loss to add on this rank (this rank's share of
the whole batch's gradient, times the ranks the data-parallel reduction averages over) and the whole batch's value.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from models.routing.families import normalised_scores, router_top_k
from models.routing.hooks import RouterCalls

OverRanks = Callable[[torch.Tensor], torch.Tensor] | None


def global_balance_loss(routers: RouterCalls, over_ranks: OverRanks = None) -> tuple[torch.Tensor, float]:
    """The Switch / Qwen3 global-batch loss (module docstring): `(loss on this rank, the whole batch's value)`."""
    w = routers.flat_weights
    first, logits0 = routers.calls[0]
    E = logits0.shape[-1]
    counts = torch.zeros(E, dtype=torch.float32, device=logits0.device)
    probs = torch.zeros_like(counts)
    for layer, (router, logits) in enumerate(routers.calls):
        counts = counts + (routers.chosen(layer) * w.unsqueeze(-1)).sum(dim=0)
        probs = probs + (normalised_scores(router, logits) * w.unsqueeze(-1)).sum(dim=0)
    rows = w.sum() * len(routers.calls)
    if over_ranks is None:
        loss = torch.sum((counts / rows) * (probs / rows)) * E
        return loss, float(loss.detach())
    with torch.no_grad():
        all_counts, all_probs, all_rows = over_ranks(counts), over_ranks(probs.detach()), over_ranks(rows)
        ranks = over_ranks(torch.ones(()))
    value = float(torch.sum((all_counts / all_rows) * (all_probs / all_rows)) * E)
    return torch.sum((all_counts / all_rows) * (probs / all_rows)) * E * ranks, value


def sequence_balance_loss(routers: RouterCalls, over_ranks: OverRanks = None) -> tuple[torch.Tensor, float]:
    """DeepSeek-V3's sequence-wise loss (module docstring), the mean over layers and sequences with at least one
    token: `(loss on this rank, the whole batch's value)`."""
    w = routers.weights.float()  # [B, S]
    B, S = w.shape
    tokens = w.sum(dim=1)  # T of each sequence
    present = tokens > 0
    total = torch.zeros((), dtype=torch.float32, device=w.device)
    for layer, (router, logits) in enumerate(routers.calls):
        E = logits.shape[-1]
        f = (routers.chosen(layer).view(B, S, E) * w.unsqueeze(-1)).sum(dim=1) * E / router_top_k(router)  # [B, E]
        P = (normalised_scores(router, logits).view(B, S, E) * w.unsqueeze(-1)).sum(dim=1)
        per_sequence = (f * P).sum(dim=-1) / tokens.clamp_min(1.0) ** 2
        total = total + per_sequence[present].sum()
    sequences = present.sum().float() * len(routers.calls)
    if over_ranks is None:
        loss = total / sequences
        return loss, float(loss.detach())
    with torch.no_grad():
        all_sequences, ranks = over_ranks(sequences), over_ranks(torch.ones(()))
        value = float(over_ranks(total.detach()) / all_sequences)
    return total / all_sequences * ranks, value
