"""Scoring: per-token log-probs of the responses of a rollout batch in fp32, with their routing, row by row or packed.

Log-probs are taken from `logits / temperature`, the distribution the tokens were sampled from, in fp32. Position
ids follow the attention mask (left padding does not shift positions), exactly as `generate` builds them, so
scoring a rollout reproduces the rollout's own computation up to the KV-cache path.

A scoring forward feeds positions `FED` of each row (all but the last: its logits would predict nothing) and keeps
the logits of the last T, which score the T response tokens. Routing can be recorded, or replayed from a trace
laid out like the fed positions (`RoutingTrace [L, n, P+T-1, K]`); either way `Scores.routes` comes back in that
layout.

With `group_size = G > 1` the rows come in groups of G completions of one prompt, and each group is fed as one
packed sequence (`SharedPrefix`, below). A group's rows agree on their first S0 positions (the prompt but its last
token) and differ after them. Fed row by row, every token-wise operation (norms, projections, routers, experts)
computes those S0 positions G times. Packed, one sequence per group carries them once, followed by each
completion's T positions:

    rows   [n, S0 + T]:  (prefix | tail_1), (prefix | tail_2), ..., (prefix | tail_G)     n = g·G
    packed [g, S0 + G·T]: prefix | tail_1 | tail_2 | ... | tail_G

Only attention sees the structure: prefix positions attend causally among themselves, and each tail attends the
prefix and causally its own positions, never another tail, exactly the attention of its own row. `SharedPrefix`
holds that layout (and its masks); the `grouped_eager` attention follows it when the forward is given
`shared_prefix=layout` (`models.grouped_attention.packed_attention`). Position ids are the rows' own, so rotary
embeddings are those of the row layout, and the numbers equal the row-by-row forward's to float rounding (log-probs,
entropy, the load-balancing loss, gradients, routing), feeding P-1+G·T tokens per group instead of G·(P+T-1).
Gradients reaching the prefix from the G tails are summed by autograd, as the G copies' would be.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Iterator

import torch
from transformers import PreTrainedModel

from experiments.step.metrics import FRAGILE, LOGIT_MARGIN, MARGIN, TOPK_MASS, per_layer
from models.grouped_attention import NAME as PACKED_ATTENTION
from models.routing import ReplayRule, RoutingTrace, find_routers, record_routing, replay_routing

# The positions a scoring forward feeds the model: all but the last, whose logits would predict nothing (as in
# generation, where the last sampled token never goes through the model). Routing traces of scoring forwards
# cover these positions; a rollout's trace is cut to them with `trace.positions(FED)`.
FED = slice(None, -1)


@dataclass
class Scores:
    logp: torch.Tensor  # [N, T] fp32 log-probs of the response tokens (0 at padding)
    entropy: torch.Tensor  # [N, T] fp32 entropy of the policy at each response position (no grad)
    # The load-balancing loss of this forward, when requested: `aux_loss` to add to the loss (this rank's share of
    # the gradient when the counts are summed over ranks), `aux_loss_value` its value over the whole batch.
    aux_loss: torch.Tensor | None
    routes: RoutingTrace | None = None  # recorded routing; under replay, the router's own top-k (`[L, N, P+T-1, K]`)
    router_stats: dict[str, float] | None = None  # routing fragility of this forward, when requested
    aux_loss_value: float | None = None
    # With `score_replayed`: the current router's log-probability of each replayed expert (`[L, N, P+T-1, K]`).
    replayed_logprobs: torch.Tensor | None = None


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as `generate` computes them: cumsum of the mask minus one."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


def can_pack(model: PreTrainedModel) -> bool:
    """Whether `model`'s attention follows a shared-prefix layout (packed scoring is exact only then)."""
    return model.config._attn_implementation == PACKED_ATTENTION


def score_responses(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_width: int,
    temperature: float,
    aux_loss: bool = False,
    group_size: int = 1,
    record: bool = False,
    replay: RoutingTrace | None = None,
    aux_loss_grad: bool = True,
    fragile_margin: float | None = None,
    over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None,
    record_gates: bool = False,
    rule: ReplayRule | None = None,
    score_replayed: bool = False,
) -> Scores:
    """Per-token log-probs of the response tokens under `model`, in fp32, differentiable when grad is enabled.

    `input_ids`/`attention_mask [N, P+T]` (left-padded prompts of width P, responses). The response tokens
    `[P, P+T)` are scored by the logits at `[P-1, P+T-1)`. `group_size > 1`: rows `j·G .. j·G+G-1` share their
    prompt and are fed packed (see the module docstring). `record`: return the routing of the fed positions (with
    `record_gates`, its gate weights and log-probabilities too); `replay`: force that routing (`[L, N, P+T-1, K]`) as
    `rule` decides (default: ID replay) and return the router's own choice, and with `score_replayed` the current
    router's log-probabilities of the replayed experts (`Scores.replayed_logprobs`). `aux_loss`: the
    Switch load-balancing loss over the fed tokens (`load_balancing_loss`), differentiable unless `aux_loss_grad=False`
    (a metric only); `over_ranks` sums its counts over data-parallel ranks. `fragile_margin`: also the routing
    fragility of the fed tokens (`router_fragility`).
    """
    fed_mask = attention_mask[:, FED]
    positions = position_ids(fed_mask)
    ids = input_ids[:, FED]
    tail = input_ids.shape[1] - prompt_width
    layout = None
    if group_size > 1 and prompt_width > 1:
        if not can_pack(model):
            raise ValueError(
                f"packed scoring (group_size={group_size}) needs attn_implementation={PACKED_ATTENTION!r}; this "
                f"model uses {model.config._attn_implementation!r}"
            )
        layout = SharedPrefix.from_rows(fed_mask, prompt_width - 1, group_size, model.dtype)
        if not layout.prefix_agrees(ids):
            raise ValueError(f"packed scoring: rows of one group of {group_size} do not share their prompt")
    capture = aux_loss or fragile_margin is not None
    routing = _routing(model, layout, ids, record, replay, record_gates, rule, score_replayed)
    with routing as handle, _router_logits(model, capture) as router_logits:
        if layout is None:
            logits = model(
                input_ids=ids, attention_mask=fed_mask, position_ids=positions, use_cache=False, logits_to_keep=tail
            ).logits
        else:
            out = model(
                input_ids=layout.pack(ids),
                attention_mask=layout.pack(fed_mask),
                position_ids=layout.pack(positions),
                use_cache=False,
                logits_to_keep=torch.arange(layout.prefix, layout.length, device=ids.device),  # the tails
                shared_prefix=layout,
            )
            logits = layout.tails(out.logits)
    logits = logits.float() / temperature  # [N, T, V], positions P-1 .. P+T-2
    log_probs = torch.log_softmax(logits, dim=-1)
    logp = log_probs.gather(-1, input_ids[:, prompt_width:].unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(log_probs.exp() * log_probs).sum(-1)
    balance = value = None
    weights = fed_mask if layout is None else layout.token_weights
    if aux_loss:
        with contextlib.nullcontext() if aux_loss_grad else torch.no_grad():
            balance, value = load_balancing_loss(router_logits, weights, model.num_experts, model.num_experts_per_tok,
                                                 over_ranks)
    stats = router_fragility(router_logits, weights, model.num_experts_per_tok, fragile_margin) if (
        fragile_margin is not None
    ) else None
    routes = replayed_logprobs = None
    if replay is not None or record:
        routes = handle.router_choice if replay is not None else handle.trace
        if layout is not None:
            routes = routes.map(lambda tensor: layout.unpack(tensor, dim=1))
    if score_replayed:
        replayed_logprobs = handle.replayed_logprobs
        if layout is not None:
            replayed_logprobs = layout.unpack(replayed_logprobs, dim=1)
    return Scores(logp=logp, entropy=entropy, aux_loss=balance, routes=routes, router_stats=stats, aux_loss_value=value,
                  replayed_logprobs=replayed_logprobs)


@torch.no_grad()
def router_fragility(
    router_logits: list[torch.Tensor], weights: torch.Tensor, top_k: int, margin: float
) -> dict[str, float]:
    """How decisive each MoE layer's routing is on the fed tokens (each weighted by `weights`, 0 on padding):
    `TOPK_MASS` the router's probability mass on its chosen experts (prime-rl's routing confidence), `MARGIN` the
    gap between the k-th and (k+1)-th expert probability (what a small update must overcome to flip a route),
    `FRAGILE` the share of tokens whose margin is below `margin`; and `LOGIT_MARGIN`, the gap between the k-th and
    (k+1)-th router logits, log(p_k / p_(k+1)): what an update must move the two logits' difference by to swap them,
    comparable across expert counts (a probability gap shrinks with 1/E, this does not); per layer and their mean
    over layers (`metrics.per_layer`)."""
    w = weights.reshape(-1).float()
    total = w.sum().clamp(min=1e-12)
    by_layer = {TOPK_MASS: [], MARGIN: [], FRAGILE: [], LOGIT_MARGIN: []}
    for logits in router_logits:
        ranked = logits.float().topk(min(top_k + 1, logits.shape[-1]), dim=-1).values
        top = torch.softmax(logits.float(), dim=-1).topk(ranked.shape[-1], dim=-1).values
        gap = top[:, top_k - 1] - top[:, top_k] if top.shape[-1] > top_k else top[:, top_k - 1]
        logit_gap = ranked[:, top_k - 1] - ranked[:, top_k] if ranked.shape[-1] > top_k else torch.zeros_like(gap)
        by_layer[TOPK_MASS].append((top[:, :top_k].sum(-1) * w).sum() / total)
        by_layer[MARGIN].append((gap * w).sum() / total)
        by_layer[LOGIT_MARGIN].append((logit_gap * w).sum() / total)
        by_layer[FRAGILE].append(((gap < margin).float() * w).sum() / total)
    stats = {}
    for name, values in by_layer.items():
        values = torch.stack(values).tolist()
        stats[name] = sum(values) / len(values)
        stats.update({per_layer(name, i): v for i, v in enumerate(values)})
    return stats


def _routing(
    model: PreTrainedModel, layout: SharedPrefix | None, ids: torch.Tensor, record: bool, replay: RoutingTrace | None,
    record_gates: bool, rule: ReplayRule | None, score_replayed: bool,
) -> contextlib.AbstractContextManager:
    """The record or replay context of the forward; a replayed trace is packed like the batch when it is."""
    if replay is not None:
        if layout is not None:
            if replay.shape[1:3] != tuple(ids.shape):
                raise ValueError(
                    f"routing trace covers batch x positions {replay.shape[1:3]} but the batch is {tuple(ids.shape)}"
                )
            if not layout.prefix_agrees(replay.experts, dim=1):
                raise ValueError(
                    "packed scoring cannot replay this trace: rows of one group route their shared prompt "
                    "differently; score it with group_size=1"
                )
            replay = replay.map(lambda tensor: layout.pack(tensor, dim=1))
        return replay_routing(model, replay, rule, score_replayed)
    if score_replayed:
        raise ValueError("score_replayed scores the experts of a replayed trace: pass replay=")
    return record_routing(model, gates=record_gates) if record else contextlib.nullcontext()


@contextlib.contextmanager
def _router_logits(model: PreTrainedModel, capture: bool) -> Iterator[list[torch.Tensor]]:
    """The router logits `[tokens, E]` of every MoE layer, in layer order, for the forward run in the context."""
    logits: list[torch.Tensor] = []
    routers = find_routers(model).values() if capture else ()
    handles = [router.register_forward_hook(lambda module, args, out: logits.append(out[0])) for router in routers]
    try:
        yield logits
    finally:
        for handle in handles:
            handle.remove()


def load_balancing_loss(
    router_logits: list[torch.Tensor], weights: torch.Tensor, num_experts: int, top_k: int,
    over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, float]:
    """The Switch Transformer load-balancing loss (Fedus et al. 2021, eqs. 4-6) as transformers' MoE families compute
    it (Qwen2/3-MoE, OLMoE, Mixtral `load_balancing_loss_func`): E · Σ_e f_e · P_e, with f_e the share of top-k
    assignments to expert e and P_e its mean router probability, both over every layer's tokens, each token weighted
    by `weights` (0 on padding; the rows a packed token stands for).

    With `over_ranks` (a sum over data-parallel ranks) the counts and the probability sums are the whole batch's.
    Returns the loss to add to this rank's (for its share of the whole batch's gradient, times the ranks the
    data-parallel reduction averages over) and the whole batch's value.
    """
    flat = weights.reshape(-1).float()
    counts = torch.zeros(num_experts, dtype=torch.float32, device=router_logits[0].device)
    probs = torch.zeros_like(counts)
    for logits in router_logits:
        routing = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(routing, top_k, dim=-1).indices
        counts = counts + torch.zeros_like(counts).scatter_add_(0, chosen.reshape(-1), flat.repeat_interleave(top_k))
        probs = probs + (routing * flat.unsqueeze(-1)).sum(dim=0)
    rows = flat.sum() * len(router_logits)
    if over_ranks is None:
        loss = torch.sum((counts / rows) * (probs / rows)) * num_experts
        return loss, float(loss.detach())
    with torch.no_grad():
        all_counts, all_probs, all_rows = over_ranks(counts), over_ranks(probs.detach()), over_ranks(rows)
        ranks = over_ranks(torch.ones(()))
    value = float(torch.sum((all_counts / all_rows) * (all_probs / all_rows)) * num_experts)
    return torch.sum((all_counts / all_rows) * (probs / all_rows)) * num_experts * ranks, value


@dataclass
class SharedPrefix:
    """The packed layout of `groups` groups of `group` rows: `prefix` shared positions, `tail` positions per row.

    `prefix_mask [g, 1, S0, S0]` and `tail_mask [n, 1, T, S0+T]` are additive float masks (0 or the dtype's min,
    as eager attention's), built from the rows' attention mask: padding keys are never attended.
    `token_weights [g, S0+G·T]`: how many rows each packed position stands for (G on the prefix, 1 on a tail),
    0 on padding.
    """

    prefix: int
    tail: int
    group: int
    prefix_mask: torch.Tensor
    tail_mask: torch.Tensor
    token_weights: torch.Tensor

    @property
    def groups(self) -> int:
        return self.prefix_mask.shape[0]

    @property
    def length(self) -> int:
        """Positions of one packed sequence."""
        return self.prefix + self.group * self.tail

    @classmethod
    def from_rows(cls, attention_mask: torch.Tensor, prefix: int, group: int, dtype: torch.dtype) -> "SharedPrefix":
        """The layout of rows with `attention_mask [n, S0+T]` (1 = token), groups of `group` consecutive rows."""
        n, width = attention_mask.shape
        if group < 2 or n % group:
            raise ValueError(f"shared prefix: {n} rows do not split into groups of {group} (need group >= 2)")
        if not 0 < prefix < width:
            raise ValueError(f"shared prefix of {prefix} positions does not fit rows of {width} positions")
        valid = attention_mask.bool()
        head = valid[::group, :prefix]  # [g, S0]
        if not torch.equal(valid[:, :prefix], head.repeat_interleave(group, dim=0)):
            raise ValueError("shared prefix: rows of one group differ in their prompt's padding")
        tail = width - prefix
        lowest = torch.finfo(dtype).min
        causal = torch.ones(width, width, dtype=torch.bool, device=valid.device).tril()
        prefix_allowed = causal[:prefix, :prefix] & head[:, None, :]  # [g, S0, S0]
        tail_allowed = causal[prefix:, :] & valid[:, None, :]  # [n, T, S0+T]
        tail_valid = valid[:, prefix:].reshape(head.shape[0], group * tail)
        return cls(
            prefix=prefix,
            tail=tail,
            group=group,
            prefix_mask=_additive(prefix_allowed, dtype, lowest),
            tail_mask=_additive(tail_allowed, dtype, lowest),
            token_weights=torch.cat([head.float() * group, tail_valid.float()], dim=1),
        )

    def pack(self, rows: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """`[..., n, S0+T, ...]` (rows at `dim`, positions at `dim + 1`) -> `[..., g, S0+G·T, ...]`.

        The prefix is taken from each group's first row; `prefix_agrees` says whether the others match it.
        """
        head = rows.narrow(dim + 1, 0, self.prefix).unflatten(dim, (self.groups, self.group)).select(dim + 1, 0)
        tails = rows.narrow(dim + 1, self.prefix, self.tail)
        tails = tails.unflatten(dim, (self.groups, self.group)).flatten(dim + 1, dim + 2)  # [.., g, G·T, ..]
        return torch.cat([head, tails], dim=dim + 1)

    def unpack(self, packed: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """`[..., g, S0+G·T, ...]` -> `[..., n, S0+T, ...]`: every row gets its group's prefix."""
        head = packed.narrow(dim + 1, 0, self.prefix).repeat_interleave(self.group, dim=dim)
        tails = packed.narrow(dim + 1, self.prefix, self.group * self.tail)
        tails = tails.unflatten(dim + 1, (self.group, self.tail)).flatten(dim, dim + 1)  # [.., n, T, ..]
        return torch.cat([head, tails], dim=dim + 1)

    def prefix_agrees(self, rows: torch.Tensor, dim: int = 0) -> bool:
        """Whether every row of a group carries the same first S0 positions (so that `pack` loses nothing)."""
        head = rows.narrow(dim + 1, 0, self.prefix)
        first = head.unflatten(dim, (self.groups, self.group)).narrow(dim + 1, 0, 1)
        return bool((head.unflatten(dim, (self.groups, self.group)) == first).all())

    def tails(self, packed: torch.Tensor) -> torch.Tensor:
        """`[g, G·T, ...]` outputs of the tail positions -> `[n, T, ...]`."""
        return packed.reshape(self.groups * self.group, self.tail, *packed.shape[2:])


def _additive(allowed: torch.Tensor, dtype: torch.dtype, lowest: float) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, lowest).unsqueeze(1)
