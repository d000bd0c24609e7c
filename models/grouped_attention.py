"""`grouped_eager`: transformers' eager attention, without copying keys and values for grouped-query heads.

Eager attention repeats each key/value head for the G query heads that share it (`repeat_kv`), then runs two
batched matmuls. At the tiny models' sizes those copies of the KV cache cost more than the matmuls (in a decode
step, 2.9 ms of copying against well under 1 ms of arithmetic per layer). Here the G query heads of one KV head
are stacked along the query axis instead, so the same two matmuls read keys and values in place:

    q [B, H, S, D] -> [B, KV, G·S, D];  scores = q kᵀ · scale -> [B, KV, G, S, L] (+ eager's float mask)
    softmax in fp32 over L, then probs [B, KV, G·S, L] v -> [B, H, S, D] -> [B, S, H, D]

Same arithmetic as eager (the output matches it to float rounding); masks are eager's, registered under this name
in transformers' `AttentionMaskInterface` so that `create_causal_mask` builds them.

A forward given `shared_prefix=layout` is a packed one, one sequence per group of completions (the layout is built
by the scoring that packs it, `models.shared_prefix.SharedPrefix`: its `prefix`, `group` and `tail` lengths and
two additive masks): attention then follows the layout's structure and masks (`packed_attention`), and the causal
mask transformers built for the packed sequence is not used.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import eager_mask

from models.shared_prefix import SharedPrefix

NAME = "grouped_eager"


def grouped_eager_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    shared_prefix: SharedPrefix | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`query [B, H, S, D]`, `key`/`value [B, KV, L, D]`, float mask `[B, 1, S, ≥L]` -> (`[B, S, H, D]`, probs).

    Packed (`shared_prefix` given): `[g, S0+G·T]` sequences, masks from the layout; no probabilities returned.
    """
    H, kv_heads = query.shape[1], key.shape[1]
    if H % kv_heads:
        raise ValueError(f"attention {NAME!r}: {H} query heads do not split into {kv_heads} key/value groups")
    dropout = dropout if module.training else 0.0
    if shared_prefix is not None:

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return _attend(q, k, v, mask, scaling, dropout)[0]

        return packed_attention(shared_prefix, query, key, value, attend).contiguous(), None
    out, probs = _attend(query, key, value, attention_mask, scaling, dropout)
    return out.contiguous(), probs


def _attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    dropout: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two matmuls with grouped heads stacked on the query axis -> (`[B, S, H, D]` non-contiguous, probs)."""
    B, H, S, D = query.shape
    kv_heads, L = key.shape[1], key.shape[2]
    G = H // kv_heads
    scores = torch.matmul(query.reshape(B, kv_heads, G * S, D), key.transpose(-1, -2)) * scaling
    scores = scores.view(B, kv_heads, G, S, L)
    if mask is not None:
        scores = scores + mask[:, :, None, :, :L]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if dropout:
        probs = F.dropout(probs, p=dropout)
    out = torch.matmul(probs.view(B, kv_heads, G * S, L), value)  # [B, KV, G·S, D]
    return out.view(B, H, S, D).transpose(1, 2), probs.view(B, H, S, L)


def packed_attention(
    layout: SharedPrefix,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Packed `query [g, H, S, D]`, `key`/`value [g, KV, S, D]` -> `[g, S, H, D]`: attention of each tail as in its
    own row, the prefix once (`layout`: the forward's `SharedPrefix`, its lengths and masks).

    `attend(q [B, H, s, D], k [B, KV, l, D], v, mask [B, 1, s, l]) -> [B, s, H, D]` does the arithmetic.
    """
    S0, G, T = layout.prefix, layout.group, layout.tail
    g, heads, _, dim = query.shape
    kv_heads = key.shape[1]

    def per_row(packed: torch.Tensor, h: int) -> torch.Tensor:  # [g, h, S0+G·T, D] -> [n, h, T, D]
        return packed[:, :, S0:].reshape(g, h, G, T, dim).transpose(1, 2).reshape(g * G, h, T, dim)

    head_out = attend(query[:, :, :S0], key[:, :, :S0], value[:, :, :S0], layout.prefix_mask)
    keys = torch.cat([key[:, :, :S0].repeat_interleave(G, dim=0), per_row(key, kv_heads)], dim=2)
    values = torch.cat([value[:, :, :S0].repeat_interleave(G, dim=0), per_row(value, kv_heads)], dim=2)
    tail_out = attend(per_row(query, heads), keys, values, layout.tail_mask)  # [n, T, H, D]
    return torch.cat([head_out, tail_out.reshape(g, G * T, heads, dim)], dim=1)


def register() -> None:
    """Make `grouped_eager` a valid `attn_implementation` (idempotent)."""
    AttentionInterface.register(NAME, grouped_eager_attention)
    AttentionMaskInterface.register(NAME, eager_mask)
