"""Scoring: per-token log-probs of the responses of a rollout batch in fp32, with their routing, row by row or packed.

Log-probs are taken from `logits / temperature`, the distribution the tokens were sampled from, in fp32. Position
ids follow the attention mask (left padding does not shift positions), exactly as `generate` builds them, so
scoring a rollout reproduces the rollout's own computation up to the KV-cache path.

A scoring forward feeds positions `FED` of each row (all but the last: its logits would predict nothing) and keeps
the logits of the last T, which score the T response tokens. Routing can be recorded, or replayed from a trace
laid out like the fed positions (`RoutingTrace [L, n, P+T-1, K]`); either way `Scores.routes` comes back in that
layout.

With `group_size = G > 1` the rows come in groups of G completions of one prompt, and each group is fed as one
packed sequence, its prompt once (`models.shared_prefix.SharedPrefix`; the `grouped_eager` attention follows it when the
forward is given `shared_prefix=layout`). Position ids are the rows' own, so rotary embeddings are those of the row
layout, and the numbers equal the row-by-row forward's to float rounding (log-probs, entropy, the load-balancing loss,
gradients, routing), feeding P-1+G·T tokens per group instead of G·(P+T-1). Gradients reaching the prefix from the G
tails are summed by autograd, as the G copies' would be.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

import torch
from transformers import PreTrainedModel

from algos.routers.balancing import global_balance_loss
from experiments.step.metrics import (
    FRAGILE,
    LOGIT_MARGIN,
    MARGIN,
    TOPK_MARGIN_MEAN,
    TOPK_MARGIN_MEDIAN,
    TOPK_MARGIN_SMALL,
    TOPK_MASS,
    per_layer,
)
from models.grouped_attention import NAME as PACKED_ATTENTION
from models.routing.families import normalised_scores, router_top_k
from models.routing.hooks import (
    Replaying,
    ReplayRule,
    RouterCalls,
    RouterCapture,
    RoutingRequest,
    router_calls,
    routing,
)
from models.routing.measures import MarginSummary, margin_of_ranked
from models.routing.trace import RoutingTrace
from models.shared_prefix import SharedPrefix

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
    router_stats: dict[str, float] | None = None  # this forward's per-token means of routing fragility, when requested
    # With `router_stats`: each layer's `topk_margin` of every fed token and the tokens' weights (`[L, T]`, `[T]`),
    # whose median no mean over ranks gives: the trainer gathers them before `margin_stats`.
    router_margins: tuple[torch.Tensor, torch.Tensor] | None = None
    routers: RouterCalls | None = None  # the forward's router calls (logits with their graph), when asked
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


class ResponseBatch(Protocol):
    """What scoring reads of a batch of responses (a rollout's `Samples`, a `Minibatch`): `input_ids` and
    `attention_mask [N, P+T]`, left-padded prompts of width `prompt_width`, then the responses. Read only: a frozen
    dataclass (`Minibatch`) is one."""

    @property
    def input_ids(self) -> torch.Tensor: ...

    @property
    def attention_mask(self) -> torch.Tensor: ...

    @property
    def prompt_width(self) -> int: ...


@dataclass(frozen=True)
class Responses:
    """A `ResponseBatch` of plain tensors."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_width: int


@dataclass(frozen=True)
class ScoreOptions:
    """What a scoring forward computes besides the log-probs and the entropy, and how it is fed."""

    group_size: int = 1  # > 1: rows j·G .. j·G+G-1 share their prompt and are fed packed (module docstring)
    record: bool = False  # return the routing of the fed positions (`Scores.routes`)
    # with `record` (or `replay`: the router's own choice): the chosen experts' gate weights and router
    # log-probabilities
    record_gates: bool = False
    # Force this routing (`[L, N, P+T-1, K]`), as `rule` decides (None: ID replay); `Scores.routes` is then the
    # router's own choice.
    replay: RoutingTrace | None = None
    rule: ReplayRule | None = None
    score_replayed: bool = False  # with `replay`: the current router's log-scores of its experts (`replayed_logprobs`)
    # The global-batch load-balancing loss over the fed tokens (`algos.routers.balancing.global_balance_loss`),
    # differentiable unless `aux_loss_grad` is False (a metric only); `over_ranks` sums its counts over ranks.
    aux_loss: bool = False
    aux_loss_grad: bool = True
    over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None
    fragile_margin: float | None = None  # the fed tokens' routing fragility and margins (`router_fragility`)
    routers: bool = False  # return the forward's router calls (`Scores.routers`: what `algos.routers` read)


def score_responses(
    model: PreTrainedModel, batch: ResponseBatch, temperature: float, options: ScoreOptions = ScoreOptions()
) -> Scores:
    """Per-token log-probs of `batch`'s response tokens under `model`, in fp32 under `logits / temperature`,
    differentiable when grad is enabled, with what `options` asks for besides.

    The response tokens `[P, P+T)` are scored by the logits at `[P-1, P+T-1)`.
    """
    input_ids, attention_mask, prompt_width = batch.input_ids, batch.attention_mask, batch.prompt_width
    fed_mask = attention_mask[:, FED]
    positions = position_ids(fed_mask)
    ids = input_ids[:, FED]
    tail = input_ids.shape[1] - prompt_width
    layout = None
    if options.group_size > 1 and prompt_width > 1:
        if not can_pack(model):
            raise ValueError(
                f"packed scoring (group_size={options.group_size}) needs attn_implementation={PACKED_ATTENTION!r}; "
                f"this model uses {model.config._attn_implementation!r}"
            )
        layout = SharedPrefix.from_rows(fed_mask, prompt_width - 1, options.group_size, model.dtype)
        if not layout.prefix_agrees(ids):
            raise ValueError(f"packed scoring: rows of one group of {options.group_size} do not share their prompt")
    capture = options.aux_loss or options.fragile_margin is not None or options.routers
    request = routing_request(options, layout, ids)
    unpacked = (lambda tensor: tensor) if layout is None else (lambda tensor: layout.unpack(tensor, dim=1))
    with (
        routing(model, request) as routed,
        router_calls(model) if capture else contextlib.nullcontext(RouterCapture()) as calls,
    ):
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
    replayed = None if request.replay is None else request.replay.recorded()[0]  # as fed: packed with the batch
    forward = RouterCalls.of(calls, weights, replayed) if capture else None
    captured = cast(RouterCalls, forward)  # read below only where asked for, and so `capture`d
    if options.aux_loss:
        with contextlib.nullcontext() if options.aux_loss_grad else torch.no_grad():
            balance, value = global_balance_loss(captured, options.over_ranks)
    margin = options.fragile_margin
    stats, margins = (None, None) if margin is None else router_fragility(captured, margin)
    routes = None if routed is None else routed.routes.map(unpacked)
    # score_replayed asks for a replay: the handle is `Replaying`'s
    replayed_logprobs = unpacked(cast(Replaying, routed).replayed_logprobs) if options.score_replayed else None
    return Scores(
        logp=logp,
        entropy=entropy,
        aux_loss=balance,
        routes=routes,
        router_stats=stats,
        aux_loss_value=value,
        replayed_logprobs=replayed_logprobs,
        routers=forward if options.routers else None,
        router_margins=None if margins is None else (margins, captured.flat_weights),
    )


@torch.no_grad()
def router_fragility(routers: RouterCalls, margin: float) -> tuple[dict[str, float], torch.Tensor]:
    """How decisive each MoE layer's routing is on the fed tokens (each weighted by `routers.weights`, 0 on padding),
    on the family's selection scores s (`models.routing.families.selection_scores`: softmax probabilities, or sigmoid
    + bias):
    `TOPK_MASS` the router's normalised score mass on its chosen experts (prime-rl's routing confidence), `MARGIN` the
    gap s[k−1] − s[k] between the k-th and (k+1)-th selection scores (what a small update must overcome to flip a
    route), `FRAGILE` the share of tokens whose gap is below `margin`; `LOGIT_MARGIN`, the gap between the router
    logits of those two experts (softmax family: log(p_k / p_(k+1)), comparable across expert counts where a
    probability gap shrinks with 1/E); and the scale-free `topk_margin` (s[k−1] − s[k]) / (s[0] − s[2k−1]) of colibri
    issue #119 per token. Each mean per layer and over layers (the layers' mean; `metrics.per_layer`).
    Returns the means and the scale-free margins `[L, T]` of every fed token: their statistics are a median, which no
    mean over ranks gives, so the caller takes them (`margin_stats`) once it holds every token it reports on."""
    w = routers.flat_weights
    total = w.sum().clamp(min=1e-12)
    by_layer: dict[str, list[torch.Tensor]] = {TOPK_MASS: [], MARGIN: [], FRAGILE: [], LOGIT_MARGIN: []}
    margins = []
    for layer, (router, logits) in enumerate(routers.calls):
        k = router_top_k(router)
        ranked = routers.ranked(layer)
        top, experts = ranked.values[:, : k + 1], ranked.indices[:, : k + 1]
        gap = top[:, k - 1] - top[:, k] if top.shape[-1] > k else top[:, k - 1]
        z = logits.float().gather(-1, experts)
        logit_gap = z[:, k - 1] - z[:, k] if z.shape[-1] > k else torch.zeros_like(gap)
        mass = normalised_scores(router, logits).gather(-1, experts[:, :k]).sum(-1)
        by_layer[TOPK_MASS].append((mass * w).sum() / total)
        by_layer[MARGIN].append((gap * w).sum() / total)
        by_layer[LOGIT_MARGIN].append((logit_gap * w).sum() / total)
        by_layer[FRAGILE].append(((gap < margin).float() * w).sum() / total)
        margins.append(margin_of_ranked(ranked.values, k))
    stats: dict[str, float] = {}
    for name, values in by_layer.items():
        means = torch.stack(values).tolist()
        stats[name] = sum(means) / len(means)
        stats.update({per_layer(name, i): v for i, v in enumerate(means)})
    return stats, torch.stack(margins)


def margin_stats(margins: torch.Tensor, weights: torch.Tensor) -> dict[str, float]:
    """The scale-free margin's weighted median (`TOPK_MARGIN_MEDIAN`), mean and share below `SMALL_MARGIN`
    (`TOPK_MARGIN_SMALL`; `models.routing.measures.MarginSummary`) of `margins [L, T]` under the tokens' `weights
    [T]` (0 on padding): per layer, and pooled over every (token, layer) pair, as the anchors were measured. A median
    is no mean of medians, so under data parallelism it is taken of every rank's tokens gathered, never averaged over
    ranks."""
    counted = weights > 0
    summaries = [MarginSummary.of(layer[counted], weights[counted]) for layer in margins]
    pooled = MarginSummary.of(margins[:, counted].reshape(-1), weights[counted].repeat(len(margins)))
    stats = {}
    for name, part in ((TOPK_MARGIN_MEDIAN, "median"), (TOPK_MARGIN_MEAN, "mean"), (TOPK_MARGIN_SMALL, "small")):
        stats[name] = getattr(pooled, part)
        stats.update({per_layer(name, i): getattr(summary, part) for i, summary in enumerate(summaries)})
    return stats


def routing_request(options: ScoreOptions, layout: SharedPrefix | None, ids: torch.Tensor) -> RoutingRequest:
    """`options`' routing, resolved once for the forward (the one object the model's hooks are handed): a replayed
    trace packed like the batch when the batch is packed, the router's own choice recorded where asked."""
    replay = options.replay
    if replay is not None and layout is not None:
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
    return RoutingRequest(
        record=options.record,
        gates=options.record_gates,
        replay=replay,
        rule=options.rule,
        score_replayed=options.score_replayed,
    )
