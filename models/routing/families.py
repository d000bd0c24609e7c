"""How each router family ranks and gates (the package docstring): softmax, or sigmoid plus a selection bias within
expert groups. Pure functions of a router module and its logits."""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F

# What a router call returns, and its forward hooks receive and may replace: `(logits [T, E], weights [T, K], indices
# [T, K])`.
RouterOutput = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

# A router module's settings are plain attributes and its weight a parameter, which torch's `Module.__getattr__` types
# alike as `Tensor | Module`: the readers below give each the type transformers' routers (`*TopKRouter`) hold.


def router_top_k(router: torch.nn.Module) -> int:
    """The experts `router` chooses for each token."""
    return cast(int, router.top_k)


def router_num_experts(router: torch.nn.Module) -> int:
    """The experts `router` chooses among."""
    return cast(int, router.num_experts)


def router_weight(router: torch.nn.Module) -> torch.Tensor:
    """`[E, H]`: the linear map of a token's hidden state to the router's logits."""
    return cast(torch.Tensor, router.weight)


def selection_bias(router: torch.nn.Module) -> torch.Tensor:
    """`[E]`: the sigmoid family's per-expert selection bias (`e_score_correction_bias`; `has_selection_bias`)."""
    return cast(torch.Tensor, router.e_score_correction_bias)


def has_selection_bias(router: torch.nn.Module) -> bool:
    """Whether `router` is of the sigmoid family: it ranks sigmoid scores plus a per-expert selection bias."""
    return getattr(router, "e_score_correction_bias", None) is not None


def gate_scores(router: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """`[T, E]` fp32: what the gate weights are taken from, softmax(z) over all experts or, for the sigmoid family,
    sigmoid(z) of each expert on its own."""
    return torch.sigmoid(logits.float()) if has_selection_bias(router) else torch.softmax(logits.float(), dim=-1)


def selection_scores(router: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """`[T, E]` fp32: what the family's top-k ranks. Softmax family: the probabilities. Sigmoid family (DeepSeek-V3
    report §2.1.2, group-limited routing §2.1.2 / V2 §2.1.3; transformers 5.24 `DeepseekV3TopkRouter.forward`):
    s + b, and with `n_group` groups of experts, −inf outside the `topk_group` groups whose two best s + b sum
    highest."""
    scores = gate_scores(router, logits)
    if not has_selection_bias(router):
        return scores
    scores = scores + selection_bias(router).float()
    groups = getattr(router, "num_group", 1) or 1
    kept = getattr(router, "topk_group", groups) or groups
    if groups == 1 or kept >= groups:
        return scores
    grouped = scores.view(scores.shape[0], groups, -1)
    best = grouped.topk(2, dim=-1).values.sum(-1).topk(kept, dim=-1).indices  # [T, topk_group]
    allowed = torch.zeros(scores.shape[0], groups, dtype=torch.bool, device=scores.device).scatter_(1, best, True)
    return grouped.masked_fill(~allowed.unsqueeze(-1), float("-inf")).view_as(scores)


def replayed_gate_weights(
    router: torch.nn.Module, router_logits: torch.Tensor, indices: torch.Tensor, like: torch.Tensor
) -> torch.Tensor:
    """Gate weights of `indices [T, K]` from the current router logits `[T, E]`, as the model family computes them.

    The family's gate scores over *all* experts first (never the post-top-k, zero-filled scores: a drifted index
    would read an exact zero and its gradient would silently die), gathered at the replayed experts, then
    renormalised when the family does (Qwen2/3-MoE and OLMoE when `norm_topk_prob`; Mixtral always; the sigmoid
    family when `norm_topk_prob`, with transformers' 1e-20 in the denominator, then times its
    `routed_scaling_factor`). The selection bias never enters. Cast like the router's own weights.

    Replay exists for drift, and under large drift the softmax family's quotient fails: a router that moved far
    enough gives every replayed expert a probability that underflows in fp32 (a logit gap past ~100 to the best
    expert), and p_e / Σ p is 0/0. `_renormalised_softmax` takes those tokens in log space (the same quotient, finite
    with finite gradients whatever the gap) and keeps transformers' own arithmetic, bit for bit, everywhere else.
    The sigmoid family's quotient is finite as it stands: its denominator is at least 1e-20.
    """
    weights = gate_scores(router, router_logits).gather(-1, indices)
    if getattr(router, "norm_topk_prob", True):
        if has_selection_bias(router):
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            weights = _renormalised_softmax(weights, router_logits, indices)
    if has_selection_bias(router):
        weights = weights * cast(float, router.routed_scaling_factor)  # a plain attribute (`router_top_k`)
    return weights.to(like.dtype)


# Below this sum of the replayed experts' probabilities the quotient p_e / Σ p is taken in log space. Above it the
# quotient and its gradient (whose division term is (p_e / Σ p) / Σ p, at most 1e20) are finite and exact to fp32.
_SMALLEST_DIRECT_TOTAL = 1e-20


def _renormalised_softmax(probs: torch.Tensor, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """`probs [T, K]` (the softmax over all experts, gathered at `indices`) divided by their sum; where that sum is
    below `_SMALLEST_DIRECT_TOTAL`, the softmax over the gathered logits instead, which is the same quotient (the
    normaliser over all experts cancels) computed in log space. Both branches are finite everywhere, so `where`
    passes finite gradients to each."""
    total = probs.sum(dim=-1, keepdim=True)
    direct = total >= _SMALLEST_DIRECT_TOTAL
    quotient = probs / torch.where(direct, total, torch.ones_like(total))
    in_log_space = torch.softmax(logits.float().gather(-1, indices), dim=-1)
    return torch.where(direct, quotient, in_log_space)


def route(router: torch.nn.Module, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The family's own routing of `logits [T, E]`: `(weights, indices) [T, K]`, the top-k of `selection_scores`
    (best first) and their `replayed_gate_weights`, in fp32. What the router itself returns, up to the order of the
    sigmoid family's slots (its top-k is unsorted)."""
    indices = selection_scores(router, logits).topk(router_top_k(router), dim=-1).indices
    return replayed_gate_weights(router, logits, indices, logits.float()), indices


def router_logprobs(router: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """`[T, E]` fp32: the router's log-score of every expert, log-softmax(z) or, for the sigmoid family, log
    sigmoid(z)."""
    return F.logsigmoid(logits.float()) if has_selection_bias(router) else torch.log_softmax(logits.float(), dim=-1)


def normalised_scores(router: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """`[T, E]` fp32 scores that sum to 1 over the experts: the softmax family's probabilities, the sigmoid family's
    s / Σ s (DeepSeek-V3 report eq. 19)."""
    scores = gate_scores(router, logits)
    return scores / scores.sum(dim=-1, keepdim=True) if has_selection_bias(router) else scores


def chosen(router: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """`[T, E]` fp32 one-hot sum of the router's own top-k (its selection scores, bias included)."""
    top = selection_scores(router, logits.detach()).topk(router_top_k(router), dim=-1).indices
    return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, top, 1.0)
