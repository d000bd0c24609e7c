"""Routing instrumentation: record which experts every token used, replay a recorded routing, measure drift.

Everything hooks the router module of each MoE block (transformers 5.x `*TopKRouter`, returning
`(router_logits, top_k_weights, top_k_indices)`), so it is independent of the experts backend.

Trace layout. A `RoutingTrace` holds `experts: [L, B, S, K]` (MoE layer, batch row, token position, top-k slot),
laid out exactly like the token ids of the batch it was recorded on (left padding included). Positions without a
recorded route carry the sentinel `NO_ROUTE = -1`, never a valid expert id: padding (attention mask 0), and in a
trace recorded across `generate` the last sampled token, which is never fed back through the model.

Families. Two router families route differently from the same logits z (`route`): the softmax family (Qwen2/3-MoE,
OLMoE, Mixtral) ranks p = softmax(z) and gates with p at the top-k, renormalised when the family does; the sigmoid
family (DeepSeek-V3, GLM-4.5: transformers 5.24 `DeepseekV3TopkRouter`, `Glm4MoeTopkRouter`) ranks s + b, s =
sigmoid(z) and b a per-expert selection bias (`e_score_correction_bias`, moved by load balancing, not by gradient),
within the best `topk_group` of `n_group` expert groups, and gates with s alone at the top-k, renormalised, times
`routed_scaling_factor`: the bias changes which experts are chosen, never their gate weights. `selection_scores` is
what the top-k ranks, `gate_scores` what the gates are taken from.

Gates. `record_routing(..., gates=True)` also records, per chosen expert, the gate weight the router gave it
(`RoutingTrace.weights`, as the family computes it: renormalised or not, in the router's dtype, stored in fp32) and
the router's log-score of it (`RoutingTrace.logprobs`: the log-softmax over all experts, or log sigmoid(z) for the
sigmoid family, whose experts are scored independently).

Margins. `topk_margin` is the scale-free distance of each token from the top-k cut on its selection scores,
(s[k−1] − s[k]) / (s[0] − s[2k−1]) over its 2k highest (colibri issue #119, measured on Qwen3.6-35B-A3B and GLM-5.2:
the two anchors, `MARGIN_ANCHORS`); `MarginSummary` its median, mean and share below `SMALL_MARGIN`; `top_gap_share`
how much of the same spread the best expert's lead takes (what makes a softmax router's margin small).

Replay (GSPO paper §5.3, "Routing Replay"; R3 paper arXiv 2510.11370). By default only the expert *indices* are
replayed (`ReplayRule`); the gate weights are gathered from the *current* router's gate scores at the replayed
experts as the model family computes them, so the router still receives gradient. Another `ReplayRule`
decides otherwise per router call (the routing variants of `algos.routing_variants`: the recorded gate weights too,
or only the replayed experts the current router still ranks high). Positions marked `NO_ROUTE` keep the router's
own choice: they are padding (masked out of attention) or the last token of a sequence, whose hidden state feeds no
scored log-probability. The router's own top-k is still computed during a replayed forward and exposed as
`Replay.router_choice`, so drift against the replayed routing costs no extra forward; with `score_replayed=True`
the current router's log-probabilities of the trace's experts come back too (`Replay.replayed_logprobs`). Replay
data is keyed by router module, not by call count, so it holds when activation checkpointing re-runs a layer in
backward — as long as backward runs inside the `replay_routing` context.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

NO_ROUTE = -1
_TRACE_DTYPE = torch.int16  # expert ids < 32768; a quarter of int64's memory for long rollouts


@dataclass
class RoutingTrace:
    """Selected experts of every MoE layer for every token: `experts [L, B, S, K]`, `NO_ROUTE` where none; when
    recorded with gates, `weights` and `logprobs [L, B, S, K]` (fp32, 0 where `NO_ROUTE`): the gate weight each chosen
    expert got and the router's log-score of it (`router_logprobs`)."""

    experts: torch.Tensor
    layer_names: tuple[str, ...]
    num_experts: int
    weights: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return tuple(self.experts.shape)

    @property
    def has_gates(self) -> bool:
        return self.weights is not None and self.logprobs is not None

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "RoutingTrace":
        """The trace with `fn` applied to its experts and, when recorded, its gates (all laid out alike)."""
        gates = {name: fn(value) for name, value in (("weights", self.weights), ("logprobs", self.logprobs))
                 if value is not None}
        return replace(self, experts=fn(self.experts), **gates)

    def rows(self, index: torch.Tensor | slice) -> "RoutingTrace":
        """The trace of a subset of batch rows (a minibatch), in the given order."""
        return self.map(lambda tensor: tensor[:, index])

    def positions(self, index: slice) -> "RoutingTrace":
        """The trace of a range of positions (e.g. those a scoring forward feeds the model)."""
        return self.map(lambda tensor: tensor[:, :, index])

    def to(self, device: torch.device | str) -> "RoutingTrace":
        return self.map(lambda tensor: tensor.to(device))

    def recorded(self) -> torch.Tensor:
        """`[L, B, S]` bool: positions that carry a route."""
        return self.experts[..., 0] != NO_ROUTE


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


# ---------------------------------------------------------------------------------------------------------------
# Router families: what the top-k ranks, what the gates are, and the margin at the cut.
# ---------------------------------------------------------------------------------------------------------------

# The scale-free margin of real routers at the top-8 cut, medians over tokens and layers (colibri issue #119, on
# 4-bit checkpoints): Qwen3.6-35B-A3B (softmax, 256 experts) and GLM-5.2 (sigmoid + bias, 256 experts).
MARGIN_ANCHORS = {"Qwen3.6-35B-A3B (softmax)": 0.0188, "GLM-5.2 (sigmoid + bias)": 0.0114}
SMALL_MARGIN = 0.01  # a token whose margin is below this sits at the top-k cut, at the anchors' scale


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
    scores = scores + router.e_score_correction_bias.float()
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
    """
    weights = gate_scores(router, router_logits).gather(-1, indices)
    sigmoid = has_selection_bias(router)
    if getattr(router, "norm_topk_prob", True):
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if sigmoid else 0.0))
    if sigmoid:
        weights = weights * router.routed_scaling_factor
    return weights.to(like.dtype)


def route(router: torch.nn.Module, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The family's own routing of `logits [T, E]`: `(weights, indices) [T, K]`, the top-k of `selection_scores`
    (best first) and their `replayed_gate_weights`, in fp32. What the router itself returns, up to the order of the
    sigmoid family's slots (its top-k is unsorted)."""
    indices = selection_scores(router, logits).topk(router.top_k, dim=-1).indices
    return replayed_gate_weights(router, logits, indices, logits.float()), indices


def router_logprobs(router: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """`[T, E]` fp32: the router's log-score of every expert, log-softmax(z) or, for the sigmoid family, log
    sigmoid(z)."""
    return F.logsigmoid(logits.float()) if has_selection_bias(router) else torch.log_softmax(logits.float(), dim=-1)


def topk_margin(scores: torch.Tensor, k: int) -> torch.Tensor:
    """`[T]`: (s[k−1] − s[k]) / (s[0] − s[2k−1]) over each row's 2k highest `scores [T, E]` (0-based ranks, so
    s[k−1] is the last chosen and s[k] the first left out), the scale-free distance from the top-k cut of colibri
    issue #119. Scores outside the row's allowed groups (−inf) do not count: with fewer than 2k allowed, s[2k−1] is
    the lowest allowed one (at least k + 1 must be). A row whose 2k highest scores tie has margin 0 (at the cut)."""
    return margin_of_ranked(scores.float().topk(min(2 * k, scores.shape[-1]), dim=-1).values, k)


def margin_of_ranked(top: torch.Tensor, k: int) -> torch.Tensor:
    """`topk_margin` from each row's highest scores already ranked, `top [T, min(2k, E)]` fp32 in descending order."""
    if top.shape[-1] <= k:
        raise ValueError(f"the margin at the top-{k} cut needs more than {k} experts; the scores have {top.shape[-1]}")
    if (top[:, k] == float("-inf")).any():  # (NaN scores pass through: a diverged model is told apart elsewhere)
        raise ValueError(f"the margin at the top-{k} cut needs {k + 1} allowed experts per token; a token's groups "
                         f"leave it {k}")
    return _over_spread(top[:, k - 1] - top[:, k], top)


def _over_spread(gap: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """`gap [T]` over each ranked row's spread s[0] − s[2k−1] (its lowest allowed score: −inf outside the allowed
    groups does not count); 0 where the spread is 0."""
    spread = top[:, 0] - torch.where(top == float("-inf"), torch.inf, top).min(dim=-1).values
    return torch.where(spread > 0, gap / spread.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(gap))


def top_gap_share(top: torch.Tensor) -> torch.Tensor:
    """`[T]`: (s[0] − s[1]) / (s[0] − s[2k−1]) of ranked rows `top [T, min(2k, E)]` (as `margin_of_ranked` reads
    them): the share of the margin's denominator that the best expert's lead takes. Where one expert dominates a
    softmax router's probabilities that share is near 1 and every gap further down, the cut's among them, is a small
    fraction of the spread, however far apart the logits at the cut are: what a small `topk_margin` means. Rows whose
    scores tie have share 0."""
    return _over_spread(top[:, 0] - top[:, 1], top)


def weighted_median(values: torch.Tensor, weights: torch.Tensor) -> float:
    """The lower weighted median of `values [N]` under `weights [N]` (>= 0): the smallest value whose cumulative
    weight reaches half the total (padding has weight 0; a packed prompt token counts once per row it stands for)."""
    order = values.argsort()
    cumulative = weights.float()[order].cumsum(0)
    position = int(torch.searchsorted(cumulative, cumulative[-1] / 2))
    return float(values[order][min(position, len(values) - 1)])


RESAMPLED_VALUES = 20_000_000  # values one step of `median_interval` holds (80 MB in fp32)


def median_interval(values: torch.Tensor, weights: torch.Tensor, groups: torch.Tensor, level: float = 0.95,
                    resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The percentile bootstrap interval at `level` of `weighted_median(values, weights)` (`values`, `weights`,
    `groups [N]`), resampling whole groups with replacement: the tokens of one sequence, and its layers, are not
    independent draws, so a sequence is the unit a held-out set samples (a cluster bootstrap). Its own seeded stream:
    the same data give the same interval. Groups are 0..G−1; padding has weight 0. Computed on the CPU."""
    if not 0 < level < 1:
        raise ValueError(f"level={level} must lie in (0, 1)")
    values, weights, groups = values.detach().cpu(), weights.detach().cpu().float(), groups.cpu().long()
    order = values.argsort()
    values, weights, groups = values[order], weights[order], groups[order]
    n_groups = int(groups.max()) + 1
    generator = torch.Generator().manual_seed(seed)
    chunk = max(1, min(100, RESAMPLED_VALUES // len(values)))  # resamples at a time: [chunk, N] weights in memory
    medians = []
    for start in range(0, resamples, chunk):
        draws = torch.randint(n_groups, (min(chunk, resamples - start), n_groups), generator=generator)
        counts = torch.zeros(len(draws), n_groups).scatter_add_(1, draws, torch.ones(draws.shape))
        cumulative = (counts[:, groups] * weights).cumsum(1)
        position = torch.searchsorted(cumulative, cumulative[:, -1:] / 2).squeeze(1)
        medians.append(values[position.clamp(max=len(values) - 1)])
    low, high = torch.quantile(torch.cat(medians).double(), torch.tensor([(1 - level) / 2, (1 + level) / 2],
                                                                          dtype=torch.double)).tolist()
    return low, high


@dataclass(frozen=True)
class MarginSummary:
    """`topk_margin` over tokens: the weighted `median`, `mean` and share `small` below `SMALL_MARGIN`."""

    median: float
    mean: float
    small: float

    @classmethod
    def of(cls, margins: torch.Tensor, weights: torch.Tensor) -> "MarginSummary":
        """Of `margins [N]` with token `weights [N]` (at least one positive)."""
        weights = weights.float()
        total = weights.sum()
        return cls(weighted_median(margins, weights), float((margins * weights).sum() / total),
                   float(((margins < SMALL_MARGIN).float() * weights).sum() / total))


# ---------------------------------------------------------------------------------------------------------------
# Hooks: one object installed on every router, shared by record and replay.
# ---------------------------------------------------------------------------------------------------------------


class _CallShape:
    """The `[B, S]` shape and attention mask of the current forward call.

    Routers see tokens flattened to `[B*S, H]`; a pre-hook on the top-level model captures the shape (from
    `input_ids` or `inputs_embeds`) and the attention mask, so the router hooks can lay routes out like tokens.
    """

    def __init__(self) -> None:
        self.batch = 0
        self.seq = 0
        self.valid: torch.Tensor | None = None  # [B, S] bool, True where the token is attended

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        shape = ids.shape if ids is not None else embeds.shape[:2]
        self.batch, self.seq = int(shape[0]), int(shape[1])
        mask = kwargs.get("attention_mask")
        self.valid = mask[:, -self.seq :].bool() if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None


def _layout(flat: torch.Tensor, call: _CallShape, fill: float = NO_ROUTE,
            dtype: torch.dtype = _TRACE_DTYPE) -> torch.Tensor:
    """`[B*S, K]` per-token router outputs -> `[B, S, K]` in `dtype`, with `fill` at unattended positions."""
    block = flat.detach().reshape(call.batch, call.seq, -1).to(dtype)
    if call.valid is not None:
        block = block.masked_fill(~call.valid.to(block.device).unsqueeze(-1), fill)
    return block


@dataclass(frozen=True)
class ReplayedRoutes:
    """One router call's share of a replayed trace, flattened like the router's tokens: `experts [T, K]` (long;
    `NO_ROUTE` rows where the trace has no route) and, when the trace was recorded with them, its gates."""

    experts: torch.Tensor
    weights: torch.Tensor | None
    logprobs: torch.Tensor | None

    @property
    def recorded(self) -> torch.Tensor:
        """`[T]` bool: tokens that carry a route."""
        return self.experts[:, 0] != NO_ROUTE


class ReplayRule:
    """What a replayed forward computes with at one router call. This base class is ID replay: the trace's experts,
    gate weights from the current router's gate scores (`replayed_gate_weights`), the router's own choice where the trace
    has no route. Subclasses (the routing variants, `algos.routing_variants`) decide otherwise.

    Called with the MoE `layer` index, the router and its outputs (`logits [T, E]`, its own `weights` and `indices
    [T, K]`), the trace's `replayed` routes and `first`: whether this is the layer's first call in the context
    (activation checkpointing re-runs layers in backward; a rule counts statistics on first calls only). Returns the
    `(weights, indices)` the experts compute with. `needs_gates`: the trace must carry its gates.
    """

    needs_gates = False

    def __call__(self, layer: int, router: torch.nn.Module, logits: torch.Tensor, weights: torch.Tensor,
                 indices: torch.Tensor, replayed: ReplayedRoutes, first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        forced = torch.where(replayed.recorded[:, None], replayed.experts, indices)
        return replayed_gate_weights(router, logits, forced, weights), forced


class _RouterHook:
    """Forward hook on one router: records its own choice (and gates), and when replay data is set, hands the call to
    the replay rule."""

    def __init__(self, name: str, layer: int, call: _CallShape) -> None:
        self.name = name
        self.layer = layer
        self.call = call
        self.recording: list[torch.Tensor] | None = None  # one [B, S, K] block per forward call
        self.gates: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # (weights, logprobs) blocks, when asked
        self.replay: RoutingTrace | None = None  # this layer's [B, S, K] share of the replayed trace
        self.rule = ReplayRule()
        self.scored: list[torch.Tensor] | None = None  # current log-probs of the replayed experts, when asked

    def __call__(self, router: torch.nn.Module, args: tuple, output: tuple) -> tuple | None:
        logits, weights, indices = output
        first = not self.recording
        if self.recording is not None:
            self.recording.append(_layout(indices, self.call))
        if self.gates is not None:
            logprobs = router_logprobs(router, logits).gather(-1, indices)
            self.gates.append((_layout(weights, self.call, 0.0, torch.float32),
                               _layout(logprobs, self.call, 0.0, torch.float32)))
        if self.replay is None:
            return None
        replayed = self._flat(indices.device)
        if self.scored is not None:
            logprobs = router_logprobs(router, logits).gather(-1, replayed.experts.clamp_min(0))
            self.scored.append(_layout(logprobs.masked_fill(~replayed.recorded[:, None], 0.0), self.call, 0.0,
                                       torch.float32))
        new_weights, new_indices = self.rule(self.layer, router, logits, weights, indices, replayed, first)
        return logits, new_weights, new_indices

    def _flat(self, device: torch.device) -> ReplayedRoutes:
        trace = self.replay.to(device)
        K = trace.shape[-1]
        flat = lambda tensor: tensor.reshape(-1, K) if tensor is not None else None  # noqa: E731
        return ReplayedRoutes(flat(trace.experts).long(), flat(trace.weights), flat(trace.logprobs))


@contextmanager
def _hooks(model: torch.nn.Module) -> Iterator[list[_RouterHook]]:
    routers = find_routers(model)
    if not routers:
        raise ValueError(f"{type(model).__name__} has no MoE router modules: nothing to record or replay")
    call = _CallShape()
    handles = [model.register_forward_pre_hook(call, with_kwargs=True)]
    hooks = []
    for layer, (name, router) in enumerate(routers.items()):
        hook = _RouterHook(name, layer, call)
        handles.append(router.register_forward_hook(hook))
        hooks.append(hook)
    try:
        yield hooks
    finally:
        for handle in handles:
            handle.remove()


def _num_experts(model: torch.nn.Module) -> int:
    router = next(iter(find_routers(model).values()))
    return int(router.num_experts)


def _assemble(hooks: list[_RouterHook], num_experts: int) -> RoutingTrace:
    """Concatenate each layer's per-call blocks along positions (prefill, then one block per decode step)."""
    if not hooks[0].recording:
        raise RuntimeError("no forward pass ran inside record_routing/replay_routing: the trace is empty")
    layers = [torch.cat(hook.recording, dim=1) for hook in hooks]
    trace = RoutingTrace(torch.stack(layers), tuple(hook.name for hook in hooks), num_experts)
    if hooks[0].gates is None:
        return trace
    weights, logprobs = (torch.stack([torch.cat([gates[part] for gates in hook.gates], dim=1) for hook in hooks])
                         for part in (0, 1))
    return replace(trace, weights=weights, logprobs=logprobs)


# ---------------------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------------------


class Recording:
    """Handle yielded by `record_routing`; `.trace` is available once the forward (or `generate`) has run."""

    def __init__(self, hooks: list[_RouterHook], num_experts: int, generated: bool) -> None:
        self._hooks = hooks
        self._num_experts = num_experts
        self._generated = generated
        self._trace: RoutingTrace | None = None

    @property
    def trace(self) -> RoutingTrace:
        if self._trace is None:
            trace = _assemble(self._hooks, self._num_experts)
            if self._generated:
                # The last sampled token was never fed back: give it a NO_ROUTE column so the trace has exactly
                # the width of the returned sequences.
                def with_tail(tensor: torch.Tensor) -> torch.Tensor:
                    L, B, _, K = tensor.shape
                    fill = 0.0 if tensor.is_floating_point() else NO_ROUTE
                    tail = torch.full((L, B, 1, K), fill, dtype=tensor.dtype, device=tensor.device)
                    return torch.cat([tensor, tail], dim=2)

                trace = trace.map(with_tail)
            self._trace = trace
        return self._trace


@contextmanager
def record_routing(model: torch.nn.Module, generate: bool = False, gates: bool = False) -> Iterator[Recording]:
    """Record every MoE layer's selected experts for the forward passes run inside the context.

    For a plain forward the trace has the shape of the input ids. With `generate=True` the prefill and every
    decode step are assembled into one trace with the width of the returned sequences (prompt + new tokens); the
    last column is `NO_ROUTE` because the last sampled token never goes through the model. `gates`: also record each
    chosen expert's gate weight and router log-probability (`RoutingTrace.weights`, `.logprobs`). Run one forward
    (or one `generate`) per context.
    """
    with _hooks(model) as hooks:
        for hook in hooks:
            hook.recording = []
            hook.gates = [] if gates else None
        yield Recording(hooks, _num_experts(model), generate)


class Replay:
    """Handle yielded by `replay_routing`; `.router_choice` is the router's own top-k during the replayed forward."""

    def __init__(self, hooks: list[_RouterHook], num_experts: int) -> None:
        self._hooks = hooks
        self._num_experts = num_experts

    @property
    def router_choice(self) -> RoutingTrace:
        """The experts the current router would have chosen (own top-k), laid out like the replayed trace.

        Only the first forward in the context is reported: activation checkpointing re-runs the routers in
        backward, and those repeats carry no new information.
        """
        if not self._hooks[0].recording:
            raise RuntimeError("no forward pass ran inside replay_routing: there is no router choice to report")
        experts = torch.stack([hook.recording[0] for hook in self._hooks])
        return RoutingTrace(experts, tuple(hook.name for hook in self._hooks), self._num_experts)

    @property
    def replayed_logprobs(self) -> torch.Tensor:
        """`[L, B, S, K]` fp32: the current router's log-score of each of the trace's experts (`router_logprobs`; 0
        where the trace has no route), in the first forward of the context (`score_replayed=True`)."""
        if self._hooks[0].scored is None:
            raise RuntimeError("replay_routing(..., score_replayed=False) does not score the replayed experts")
        if not self._hooks[0].scored:
            raise RuntimeError("no forward pass ran inside replay_routing: no replayed expert was scored")
        return torch.stack([hook.scored[0] for hook in self._hooks])


def validate_trace(trace: RoutingTrace, model: torch.nn.Module, input_shape: tuple[int, int]) -> None:
    """Refuse a trace that does not fit the model and batch, saying what differs.

    Checks: one layer per MoE router (same names), `[B, S]` equal to the batch's, top-k width equal to the
    model's, the expert count it was recorded with equal to the model's (a trace of fewer experts would replay
    silently, its ids all in range), ids in `[0, E)` or the `NO_ROUTE` sentinel for whole rows, no expert twice in
    one token's top-k, and gates (when recorded) laid out like the experts.
    """
    routers = find_routers(model)
    L, B, S, K = trace.shape
    if L != len(routers):
        raise ValueError(f"routing trace has {L} MoE layers but the model has {len(routers)}")
    if tuple(trace.layer_names) != tuple(routers):
        raise ValueError(f"routing trace layers {trace.layer_names[:2]}... do not match the model's {tuple(routers)[:2]}...")
    if (B, S) != tuple(input_shape):
        raise ValueError(f"routing trace covers batch x positions {(B, S)} but the batch is {tuple(input_shape)}")
    top_k = next(iter(routers.values())).top_k
    if K != top_k:
        raise ValueError(f"routing trace has top-k {K} but the model routes each token to {top_k} experts")
    for name, gates in (("weights", trace.weights), ("logprobs", trace.logprobs)):
        if gates is not None and tuple(gates.shape) != trace.shape:
            raise ValueError(f"routing trace {name} have shape {tuple(gates.shape)}, its experts {trace.shape}")
    num_experts = _num_experts(model)
    if trace.num_experts != num_experts:
        raise ValueError(f"routing trace was recorded with num_experts={trace.num_experts}, and this model routes over "
                         f"num_experts={num_experts}: a trace replays only on a model of its own expert count")
    experts = trace.experts
    sentinel = experts == NO_ROUTE
    partial = sentinel.any(-1) & ~sentinel.all(-1)
    if partial.any():
        raise ValueError("routing trace mixes NO_ROUTE and expert ids within one token's top-k")
    out_of_range = ~sentinel & ((experts < 0) | (experts >= num_experts))
    if out_of_range.any():
        bad = int(experts[out_of_range][0])
        raise ValueError(f"routing trace has expert id {bad}, outside [0, {num_experts}) and not NO_ROUTE ({NO_ROUTE})")
    if K > 1:
        ordered = experts.sort(dim=-1).values
        duplicated = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] != NO_ROUTE)
        if duplicated.any():
            raise ValueError("routing trace selects the same expert twice in one token's top-k")


@contextmanager
def replay_routing(
    model: torch.nn.Module, trace: RoutingTrace, rule: ReplayRule | None = None, score_replayed: bool = False
) -> Iterator[Replay]:
    """Force the forward passes inside the context (and their backward) to use the experts of `trace`, as `rule`
    decides at each router call (default: ID replay, `ReplayRule`); `score_replayed`: also keep the current
    router's log-probabilities of the trace's experts (`Replay.replayed_logprobs`).

    The trace must match the batch fed to the model: `[L, B, S, K]` with `[B, S]` the input ids' shape; a
    mismatch raises `ValueError` at the forward that does not fit. Keep backward inside the context when activation
    checkpointing is on, so that recomputed layers replay too.
    """
    rule = rule if rule is not None else ReplayRule()
    if rule.needs_gates and not trace.has_gates:
        raise ValueError(f"{type(rule).__name__} replays gate weights, and this routing trace was recorded without them "
                         "(record_routing(..., gates=True))")
    with _hooks(model) as hooks:
        if len(hooks) != trace.shape[0]:
            raise ValueError(f"routing trace has {trace.shape[0]} MoE layers but the model has {len(hooks)}")
        checked = {"done": False}

        def check(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            # Every forward in the context must have the trace's layout; the ids are checked once (they do not
            # change), the shape at every call, so that a second forward of another layout is refused too.
            ids = kwargs.get("input_ids", args[0] if args else None)
            shape = tuple(ids.shape if ids is not None else kwargs["inputs_embeds"].shape[:2])
            if not checked["done"]:
                validate_trace(trace, model, shape)
                checked["done"] = True
            elif shape != tuple(trace.shape[1:3]):
                raise ValueError(
                    f"routing trace covers batch x positions {tuple(trace.shape[1:3])} but this forward in the same "
                    f"replay context feeds {shape}"
                )

        handle = model.register_forward_pre_hook(check, with_kwargs=True, prepend=True)
        for layer, hook in enumerate(hooks):
            hook.replay = trace.map(lambda tensor: tensor[layer])
            hook.rule = rule
            hook.recording = []
            hook.scored = [] if score_replayed else None
        try:
            yield Replay(hooks, trace.num_experts)
        finally:
            handle.remove()
            for hook in hooks:
                hook.replay = None


@dataclass
class RouterCapture:
    """What `router_calls` captured: `calls`, `(router, logits [T, E])` per MoE router call in call order (the logits
    with their graph), and `own_experts`, each call's top-k `[T, k]` as its router returned it, before any hook
    that replays or flips experts."""

    calls: list[tuple[torch.nn.Module, torch.Tensor]] = field(default_factory=list)
    own_experts: list[torch.Tensor] = field(default_factory=list)


@dataclass(frozen=True)
class RouterCalls:
    """One forward's MoE router calls: `calls`, `(router, logits [T, E])` per MoE layer in layer order (the logits
    with their graph); `weights [B, S]`, what each of the T = B·S fed tokens counts for (0 at padding; a packed
    prompt token once per row it stands for); `replayed [B, S]` bool, the tokens whose experts a replayed trace
    forced (None: the forward was not replayed); `own_experts`, each call's own top-k `[T, k]` as its router
    returned it (`RouterCapture`; None: not captured, `chosen` then ranks the scores again)."""

    calls: list[tuple[torch.nn.Module, torch.Tensor]]
    weights: torch.Tensor
    replayed: torch.Tensor | None = None
    own_experts: list[torch.Tensor] | None = None
    # Each call's `ranked` selection scores, taken once: the fragility and the margin both read them, and on CPU a
    # top-k over 128 experts costs more than the rest of those metrics together.
    _ranked: dict[int, torch.return_types.topk] = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def of(cls, capture: RouterCapture, weights: torch.Tensor, replayed: torch.Tensor | None = None) -> "RouterCalls":
        """The calls `router_calls` captured, with the tokens' `weights` and what was `replayed`."""
        return cls(capture.calls, weights, replayed, capture.own_experts)

    @property
    def flat_weights(self) -> torch.Tensor:
        """`[T]` fp32 token weights, laid out like the logits' rows."""
        return self.weights.reshape(-1).float()

    def ranked(self, layer: int) -> torch.return_types.topk:
        """The `min(2k, E)` highest selection scores of call `layer` (`selection_scores`, fp32, no graph) and their
        experts, best first: the first k + 1 are what the fragility reads, all of them the margin
        (`margin_of_ranked`). Not what the balancing counts read (`chosen`): where scores tie exactly at the cut
        (sign-stepped biases make sigmoid + bias scores tie in fp32) a top-2k's first k can break the tie otherwise
        than the forward's own top-k."""
        if layer not in self._ranked:
            router, logits = self.calls[layer]
            scores = selection_scores(router, logits.detach())
            self._ranked[layer] = scores.topk(min(2 * router.top_k, scores.shape[-1]), dim=-1)
        return self._ranked[layer]

    def chosen(self, layer: int) -> torch.Tensor:
        """`[T, E]` fp32 one-hot sum of call `layer`'s own top-k: the experts its router returned where they were
        captured (the forward's own choice, ties and all, without a second top-k), else ranked again (`chosen`)."""
        router, logits = self.calls[layer]
        if self.own_experts is None:
            return chosen(router, logits)
        return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, self.own_experts[layer], 1.0)


@contextmanager
def router_calls(model: torch.nn.Module) -> Iterator[RouterCapture]:
    """Every MoE router call of the forwards run inside the context, in call order (`RouterCapture`): the logits
    with their graph (a load-balancing loss differentiates through them) and the router's own top-k. The hook runs
    before any other on the router, so the top-k is the router's even where a replay or flip hook replaces it."""
    capture = RouterCapture()

    def take(module: torch.nn.Module, args: tuple, out: tuple) -> None:
        capture.calls.append((module, out[0]))
        capture.own_experts.append(out[2])

    handles = [router.register_forward_hook(take, prepend=True) for router in find_routers(model).values()]
    try:
        yield capture
    finally:
        for handle in handles:
            handle.remove()


def next_ranked(scores: torch.Tensor, indices: torch.Tensor, flip: torch.Tensor) -> torch.Tensor:
    """`indices [T, K]` with the slots in `flip [T, K]` (bool) replaced by the experts ranked next after the top-k by
    the selection `scores [T, E]`: a token's first flipped slot takes the (K+1)-th ranked expert, its second the
    (K+2)-th, and so on. Slots past the E − K experts outside the top-k stay as they are."""
    k = indices.shape[-1]
    spare_count = min(k, scores.shape[-1] - k)
    if spare_count < 1:
        return indices
    spare = scores.topk(k + spare_count, dim=-1).indices[:, k:]  # [T, spare_count], best first
    rank = flip.long().cumsum(-1) - 1  # which spare a flipped slot takes
    flip = flip & (rank < spare_count)
    replacement = spare.gather(-1, rank.clamp(0, spare_count - 1))
    return torch.where(flip, replacement, indices)


class _FlipHook:
    """Forward hook on one router: the synthetic drift of `flip_routing`."""

    def __init__(self, rate: float, generator: torch.Generator) -> None:
        self.rate = rate
        self.generator = generator
        self.flipped = 0
        self.activated = 0

    def __call__(self, router: torch.nn.Module, args: tuple, output: tuple) -> tuple:
        logits, weights, indices = output
        draw = torch.rand(indices.shape, generator=self.generator, device=self.generator.device)
        flip = (draw < self.rate).to(indices.device)
        flipped = next_ranked(selection_scores(router, logits.detach()), indices, flip)
        changed = flipped != indices
        self.flipped += int(changed.sum())
        self.activated += indices.numel()
        rows = changed.any(-1, keepdim=True)
        weights = torch.where(rows, replayed_gate_weights(router, logits, flipped, weights), weights)
        return logits, weights, flipped


class Flips:
    """Handle yielded by `flip_routing`: `.share` is the realised share of activated experts that were flipped."""

    def __init__(self, hooks: list[_FlipHook]) -> None:
        self._hooks = hooks

    @property
    def share(self) -> float:
        activated = sum(hook.activated for hook in self._hooks)
        return sum(hook.flipped for hook in self._hooks) / activated if activated else 0.0


@contextmanager
def flip_routing(model: torch.nn.Module, rate: float, generator: torch.Generator) -> Iterator[Flips]:
    """SYNTHETIC routing drift: in the forwards run inside the context, each activated (token, layer, slot) expert is
    replaced, independently with probability `rate`, by the expert its router ranks next after the top-k
    (`next_ranked` on the family's selection scores). The gate weights of a token with a flipped slot come from the
    current router's gate scores at its new experts, as the family computes them (as under replay), so the router keeps
    its gradient.

    It imitates what an update does to routing (experts near the top-k cut swap in) at a dose that does not depend
    on the learning rate, to test whether routing changes alone make token-level ratios fail. The flip is part of
    the router's own choice: `record_routing` inside the context records the flipped experts, and
    `replay_routing` inside it overrides them, as replay overrides any drift. Enter it before record or replay
    (its hooks must run first). `rate` must be in [0, 1]; at 0 nothing is installed and the forward is untouched.
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"flip rate {rate} is not a probability in [0, 1]")
    routers = find_routers(model)
    if not routers:
        raise ValueError(f"{type(model).__name__} has no MoE router modules: nothing to flip")
    hooks = [_FlipHook(rate, generator) for _ in routers] if rate > 0 else []
    handles = [router.register_forward_hook(hook) for router, hook in zip(routers.values(), hooks)]
    try:
        yield Flips(hooks)
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class RoutingDrift:
    """Share of activated experts that changed between two routings of the same tokens.

    `per_layer [L]`: for each MoE layer, the share of activated (token, slot) experts in `new` that are not in
    `old`'s top-k set for that token (the GSPO paper's "~10% of activated experts differ"). `expert_change_frac`:
    its mean over layers. `token_any_change_frac`: share of tokens whose expert set changed in at least one layer.
    Only positions inside `mask` that carry a route in both traces count.
    """

    per_layer: torch.Tensor
    expert_change_frac: float
    token_any_change_frac: float
    tokens: int


def routing_drift(old: RoutingTrace, new: RoutingTrace, mask: torch.Tensor) -> RoutingDrift:
    """Compare two traces of the same tokens (`[L, B, S, K]` each) on the positions in `mask [B, S]`."""
    if old.shape != new.shape:
        raise ValueError(f"cannot compare routing traces of shapes {old.shape} and {new.shape}")
    L, B, S, K = new.shape
    if tuple(mask.shape) != (B, S):
        raise ValueError(f"drift mask has shape {tuple(mask.shape)}, the traces cover {(B, S)}")
    valid = mask.to(new.experts.device).bool().unsqueeze(0) & old.recorded() & new.recorded()  # [L, B, S]
    valid = valid.all(dim=0)  # [B, S]: a token counts when every layer has both routes
    tokens = int(valid.sum())
    if tokens == 0:
        per_layer = torch.zeros(L)
        any_change = 0.0
    else:
        # [L, B, S, K]: slot k of `new` is an expert that `old` also activated for this token and layer
        kept = (new.experts.unsqueeze(-1) == old.experts.unsqueeze(-2)).any(-1)
        changed = (~kept).float() * valid.unsqueeze(0).unsqueeze(-1)
        per_layer = changed.sum(dim=(1, 2, 3)) / (tokens * K)
        any_change = float((changed.sum(dim=(0, 3)) > 0).sum()) / tokens
    return RoutingDrift(per_layer, float(per_layer.mean()), any_change, tokens)


def expert_load(trace: RoutingTrace, mask: torch.Tensor) -> torch.Tensor:
    """`[L, E]` share of (token, slot) assignments each expert received on the positions in `mask [B, S]`."""
    L, B, S, K = trace.shape
    valid = (mask.to(trace.experts.device).bool().unsqueeze(0) & trace.recorded()).unsqueeze(-1).expand(L, B, S, K)
    ids = trace.experts.long().clamp_min(0)
    counts = torch.zeros(L, trace.num_experts, device=ids.device)
    counts.scatter_add_(1, ids.reshape(L, -1), valid.reshape(L, -1).float())
    return counts / counts.sum(dim=1, keepdim=True).clamp_min(1.0)


def load_max_violation(trace: RoutingTrace, mask: torch.Tensor) -> float:
    """MaxVio (DeepSeek's loss-free balancing): mean over layers of max_e load_e / mean load − 1 (0 = balanced)."""
    load = expert_load(trace, mask)
    return float((load.max(dim=1).values * trace.num_experts - 1.0).mean())


# ---------------------------------------------------------------------------------------------------------------
# Load balance: the losses that push routers towards balance, on one forward's router calls (`RouterCalls`), for
# either family (`algos.routers` adds them to a loss; every RL update logs the global one as `moe/aux_loss`).
# ---------------------------------------------------------------------------------------------------------------
# With p_t the router's normalised scores of token t over the E experts (the softmax family's probabilities; the
# sigmoid family's s_t / Σ_e s_t,e, s = sigmoid(z): DeepSeek-V3 report eq. 19) and c_t,e = 1 when the router's own
# top-k (its selection, bias included) holds expert e:
#
# - `global_balance_loss`, the Switch Transformer loss (Fedus et al. 2021, eqs. 4-6) as transformers' MoE families
#   compute it (Qwen2/3-MoE, OLMoE, Mixtral `load_balancing_loss_func`, transformers 5.24), over every layer's tokens of
#   the whole batch at once, as Qwen3's global-batch balancing:
#       E · Σ_e f_e · P_e,  f_e = Σ_{t,ℓ} w_t c_t,e / Σ_{t,ℓ} w_t,  P_e = Σ_{t,ℓ} w_t p_t,e / Σ_{t,ℓ} w_t
#   (k at perfect balance: Σ_e f_e = k);
# - `sequence_balance_loss`, DeepSeek-V3's complementary sequence-wise loss (report §2.1.2, eqs. 17-20), per layer
#   and per sequence, then the mean over both:
#       Σ_e f_e · P_e,  f_e = E / (k·T) Σ_t w_t c_t,e,  P_e = (1/T) Σ_t w_t p_t,e,  T = Σ_t w_t
#   (1 at perfect balance). A sequence is a row of the forward: a completion fed alone, or under the packed layout a
#   group (its prompt once, its G completions).
#
# Each token weighs `RouterCalls.weights` (0 on padding; a packed prompt token G). The gradient reaches the routers
# through P only (the top-k count is discrete). With `over_ranks` (a sum over data-parallel ranks) the counts, sums
# and sequence counts are the whole batch's; each function returns the loss to add on this rank (this rank's share of
# the whole batch's gradient, times the ranks the data-parallel reduction averages over) and the whole batch's value.

OverRanks = Callable[[torch.Tensor], torch.Tensor] | None



def normalised_scores(router: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """`[T, E]` fp32 scores that sum to 1 over the experts: the softmax family's probabilities, the sigmoid family's
    s / Σ s (DeepSeek-V3 report eq. 19)."""
    scores = gate_scores(router, logits)
    return scores / scores.sum(dim=-1, keepdim=True) if has_selection_bias(router) else scores


def chosen(router: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """`[T, E]` fp32 one-hot sum of the router's own top-k (its selection scores, bias included)."""
    top = selection_scores(router, logits.detach()).topk(router.top_k, dim=-1).indices
    return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, top, 1.0)


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
        f = (routers.chosen(layer).view(B, S, E) * w.unsqueeze(-1)).sum(dim=1) * E / router.top_k  # [B, E]
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
