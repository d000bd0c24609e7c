"""The router hooks (the package docstring): one object installed on every router, shared by record and replay, and
the capture of a forward's router calls that balancing losses and margins read."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch

from models.routing.families import (
    RouterOutput,
    chosen,
    replayed_gate_weights,
    router_logprobs,
    router_top_k,
    selection_scores,
)
from models.routing.trace import NO_ROUTE, TRACE_DTYPE, RoutingTrace, expert_count, find_routers


class CallShape:
    """The `[B, S]` shape and attention mask of the current forward call.

    Routers see tokens flattened to `[B*S, H]`; a pre-hook on the top-level model captures the shape (from
    `input_ids` or `inputs_embeds`) and the attention mask, so the router hooks can lay routes out like tokens.
    """

    def __init__(self) -> None:
        self.batch = 0
        self.seq = 0
        self.valid: torch.Tensor | None = None  # [B, S] bool, True where the token is attended

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        # A forward is fed `input_ids` or `inputs_embeds`.
        shape = ids.shape if ids is not None else cast(torch.Tensor, embeds).shape[:2]
        self.batch, self.seq = int(shape[0]), int(shape[1])
        mask = kwargs.get("attention_mask")
        self.valid = mask[:, -self.seq :].bool() if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None


def _layout(
    flat: torch.Tensor, call: CallShape, fill: float = NO_ROUTE, dtype: torch.dtype = TRACE_DTYPE
) -> torch.Tensor:
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
    gate weights from the current router's gate scores (`replayed_gate_weights`), the router's own choice where the
    trace
    has no route. Subclasses (the routing variants, `algos.routing_variants`) decide otherwise.

    Called with the MoE `layer` index, the router and its outputs (`logits [T, E]`, its own `weights` and `indices
    [T, K]`), the trace's `replayed` routes and `first`: whether this is the layer's first call in the context
    (activation checkpointing re-runs layers in backward; a rule counts statistics on first calls only). Returns the
    `(weights, indices)` the experts compute with. `needs_gates`: the trace must carry its gates.
    """

    needs_gates = False

    def __call__(
        self,
        layer: int,
        router: torch.nn.Module,
        logits: torch.Tensor,
        weights: torch.Tensor,
        indices: torch.Tensor,
        replayed: ReplayedRoutes,
        first: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        forced = torch.where(replayed.recorded[:, None], replayed.experts, indices)
        return replayed_gate_weights(router, logits, forced, weights), forced


@dataclass(frozen=True)
class RoutingRequest:
    """What one forward's routers do besides routing, resolved once by the caller and handed whole to the hooks
    (`routing`): `replay` a trace laid out like the ids fed (`[L, B, S, K]`), as `rule` decides at each router call
    (None: ID replay, `ReplayRule`); the router's own choice is recorded whenever the request is not idle (under replay
    it is what the router would have chosen); `gates` with each chosen expert's gate weight and log-probability,
    `states` with each router's inputs and logits; `score_replayed` the current router's log-probabilities of the
    replayed experts; `generate`: the forwards are one `generate` call, a prefill and its decode steps. `record`
    alone asks for the recording; a request that asks nothing is idle and installs no hook."""

    record: bool = False
    gates: bool = False
    states: bool = False
    replay: RoutingTrace | None = None
    rule: ReplayRule | None = None
    score_replayed: bool = False
    generate: bool = False

    def __post_init__(self) -> None:
        if self.replay is None:
            if self.score_replayed:
                raise ValueError("score_replayed scores the experts of a replayed trace: pass replay=")
            return
        if self.generate:
            raise ValueError("a replayed trace is laid out like one forward's ids: replay cannot span a generate call")
        rule = self.rule if self.rule is not None else ReplayRule()
        if rule.needs_gates and not self.replay.has_gates:
            raise ValueError(
                f"{type(rule).__name__} replays gate weights, and this routing trace was recorded without them "
                "(record_routing(..., gates=True))"
            )

    @property
    def idle(self) -> bool:
        """Nothing asked: the forward routes as the model does and nothing is kept."""
        return not self.record and self.replay is None


class _RouterHook:
    """Forward hook on one router: records its own choice (and gates), and when replay data is set, hands the call to
    the replay rule."""

    def __init__(self, name: str, layer: int, call: CallShape, request: RoutingRequest) -> None:
        self.name = name
        self.layer = layer
        self.call = call
        self.recording: list[torch.Tensor] = []  # one [B, S, K] block per forward call
        # (weights, logprobs) and (inputs, logits) blocks, when `request` asks for them
        self.gates: list[tuple[torch.Tensor, torch.Tensor]] | None = [] if request.gates else None
        self.states: list[tuple[torch.Tensor, torch.Tensor]] | None = [] if request.states else None
        # this layer's [B, S, K] share of the replayed trace
        self.replay = None if request.replay is None else request.replay.map(lambda tensor: tensor[layer])
        self.rule = request.rule if request.rule is not None else ReplayRule()
        self.scored: list[torch.Tensor] | None = [] if request.score_replayed else None  # log-probs of replayed experts

    def __call__(self, router: torch.nn.Module, args: tuple[Any, ...], output: RouterOutput) -> RouterOutput | None:
        logits, weights, indices = output
        first = not self.recording
        self.recording.append(_layout(indices, self.call))
        if self.gates is not None:
            logprobs = router_logprobs(router, logits).gather(-1, indices)
            self.gates.append(
                (_layout(weights, self.call, 0.0, torch.float32), _layout(logprobs, self.call, 0.0, torch.float32))
            )
        if self.states is not None:
            inputs = args[0].reshape(-1, args[0].shape[-1])
            self.states.append(
                (_layout(inputs, self.call, 0.0, inputs.dtype), _layout(logits, self.call, 0.0, logits.dtype))
            )
        if self.replay is None:
            return None
        replayed = self._flat(self.replay, indices.device)
        if self.scored is not None:
            logprobs = router_logprobs(router, logits).gather(-1, replayed.experts.clamp_min(0))
            self.scored.append(
                _layout(logprobs.masked_fill(~replayed.recorded[:, None], 0.0), self.call, 0.0, torch.float32)
            )
        new_weights, new_indices = self.rule(self.layer, router, logits, weights, indices, replayed, first)
        return logits, new_weights, new_indices

    @staticmethod
    def _flat(replay: RoutingTrace, device: torch.device) -> ReplayedRoutes:
        trace = replay.to(device)
        K = trace.shape[-1]
        flat = lambda tensor: tensor.reshape(-1, K) if tensor is not None else None  # noqa: E731
        return ReplayedRoutes(trace.experts.reshape(-1, K).long(), flat(trace.weights), flat(trace.logprobs))


@contextmanager
def _hooks(model: torch.nn.Module, request: RoutingRequest) -> Iterator[list[_RouterHook]]:
    """One `_RouterHook` per MoE router of `model`, each armed from `request`, removed when the context ends."""
    routers = find_routers(model)
    if not routers:
        raise ValueError(f"{type(model).__name__} has no MoE router modules: nothing to record or replay")
    if request.replay is not None and request.replay.shape[0] != len(routers):
        raise ValueError(f"routing trace has {request.replay.shape[0]} MoE layers but the model has {len(routers)}")
    call = CallShape()
    handles = [model.register_forward_pre_hook(call, with_kwargs=True)]
    hooks = []
    for layer, (name, router) in enumerate(routers.items()):
        hook = _RouterHook(name, layer, call, request)
        handles.append(router.register_forward_hook(hook))
        hooks.append(hook)
    try:
        yield hooks
    finally:
        for handle in handles:
            handle.remove()


def _assemble(hooks: list[_RouterHook], num_experts: int) -> RoutingTrace:
    """Concatenate each layer's per-call blocks along positions (prefill, then one block per decode step)."""
    if not hooks[0].recording:
        raise RuntimeError("no forward pass ran inside record_routing/replay_routing: the trace is empty")
    layers = [torch.cat(hook.recording, dim=1) for hook in hooks]
    trace = RoutingTrace(torch.stack(layers), tuple(hook.name for hook in hooks), num_experts)
    recorded: dict[str, Any] = {}  # Any: tensors, which `replace` takes by name beside fields of other types
    for kept, names in (("gates", ("weights", "logprobs")), ("states", ("inputs", "logits"))):
        if getattr(hooks[0], kept) is None:
            continue
        for part, name in enumerate(names):
            recorded[name] = torch.stack(
                [torch.cat([pair[part] for pair in getattr(hook, kept)], dim=1) for hook in hooks]
            )
    return replace(trace, **recorded)


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

    @property
    def routes(self) -> RoutingTrace:
        """The router's own choice in the forwards run (`trace`): what `Replaying.routes` is under replay."""
        return self.trace


@contextmanager
def record_routing(
    model: torch.nn.Module, generate: bool = False, gates: bool = False, states: bool = False
) -> Iterator[Recording]:
    """Record every MoE layer's selected experts for the forward passes run inside the context.

    For a plain forward the trace has the shape of the input ids. With `generate=True` the prefill and every
    decode step are assembled into one trace with the width of the returned sequences (prompt + new tokens); the
    last column is `NO_ROUTE` because the last sampled token never goes through the model. `gates`: also record each
    chosen expert's gate weight and router log-probability (`RoutingTrace.weights`, `.logprobs`); `states`: each
    router's input and logits (`RoutingTrace.inputs`, `.logits`). Run one forward (or one `generate`) per context.
    """
    with routing(model, RoutingRequest(record=True, gates=gates, states=states, generate=generate)) as recording:
        yield cast(Recording, recording)  # a request that records, without replay


class Replaying:
    """Handle yielded by `replay_routing`; `.router_choice` is the router's own top-k during the replayed forward."""

    def __init__(self, hooks: list[_RouterHook], num_experts: int) -> None:
        self._hooks = hooks
        self._num_experts = num_experts

    @property
    def router_choice(self) -> RoutingTrace:
        """The experts the current router would have chosen (own top-k), laid out like the replayed trace, with the
        gate weights and log-scores it gave them when `replay_routing(..., gates=True)`.

        Only the first forward in the context is reported: activation checkpointing re-runs the routers in
        backward, and those repeats carry no new information.
        """
        if not self._hooks[0].recording:
            raise RuntimeError("no forward pass ran inside replay_routing: there is no router choice to report")
        experts = torch.stack([hook.recording[0] for hook in self._hooks])
        trace = RoutingTrace(experts, tuple(hook.name for hook in self._hooks), self._num_experts)
        if self._hooks[0].gates is None:
            return trace
        # The hooks of one context are armed alike: what holds of the first holds of every one.
        gates = [cast(list[tuple[torch.Tensor, torch.Tensor]], hook.gates)[0] for hook in self._hooks]
        weights, logprobs = (torch.stack([first[part] for first in gates]) for part in (0, 1))
        return replace(trace, weights=weights, logprobs=logprobs)

    @property
    def routes(self) -> RoutingTrace:
        """The router's own choice under replay (`router_choice`): what `Recording.routes` is without it."""
        return self.router_choice

    @property
    def replayed_logprobs(self) -> torch.Tensor:
        """`[L, B, S, K]` fp32: the current router's log-score of each of the trace's experts (`router_logprobs`; 0
        where the trace has no route), in the first forward of the context (`score_replayed=True`)."""
        if self._hooks[0].scored is None:
            raise RuntimeError("replay_routing(..., score_replayed=False) does not score the replayed experts")
        if not self._hooks[0].scored:
            raise RuntimeError("no forward pass ran inside replay_routing: no replayed expert was scored")
        # The hooks of one context are armed alike: what holds of the first holds of every one.
        return torch.stack([cast(list[torch.Tensor], hook.scored)[0] for hook in self._hooks])


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
        raise ValueError(
            f"routing trace layers {trace.layer_names[:2]}... do not match the model's {tuple(routers)[:2]}..."
        )
    if (B, S) != tuple(input_shape):
        raise ValueError(f"routing trace covers batch x positions {(B, S)} but the batch is {tuple(input_shape)}")
    top_k = next(iter(routers.values())).top_k
    if K != top_k:
        raise ValueError(f"routing trace has top-k {K} but the model routes each token to {top_k} experts")
    for name, gates in (("weights", trace.weights), ("logprobs", trace.logprobs)):
        if gates is not None and tuple(gates.shape) != trace.shape:
            raise ValueError(f"routing trace {name} have shape {tuple(gates.shape)}, its experts {trace.shape}")
    num_experts = expert_count(model)
    if trace.num_experts != num_experts:
        raise ValueError(
            f"routing trace was recorded with num_experts={trace.num_experts}, and this model routes over "
            f"num_experts={num_experts}: a trace replays only on a model of its own expert count"
        )
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
    model: torch.nn.Module,
    trace: RoutingTrace,
    rule: ReplayRule | None = None,
    score_replayed: bool = False,
    gates: bool = False,
) -> Iterator[Replaying]:
    """Force the forward passes inside the context (and their backward) to use the experts of `trace`, as `rule`
    decides at each router call (default: ID replay, `ReplayRule`); `score_replayed`: also keep the current
    router's log-probabilities of the trace's experts (`Replaying.replayed_logprobs`); `gates`: the router's own choice
    comes with its gate weights (`Replaying.router_choice`).

    The trace must match the batch fed to the model: `[L, B, S, K]` with `[B, S]` the input ids' shape; a
    mismatch raises `ValueError` at the forward that does not fit. Keep backward inside the context when activation
    checkpointing is on, so that recomputed layers replay too.
    """
    request = RoutingRequest(record=True, gates=gates, replay=trace, rule=rule, score_replayed=score_replayed)
    with routing(model, request) as replaying:
        yield cast(Replaying, replaying)  # a request that replays


@contextmanager
def routing(model: torch.nn.Module, request: RoutingRequest) -> Iterator[Recording | Replaying | None]:
    """The forwards run inside the context route as `request` asks, through one hook per router armed from it (the
    one place a request reaches the routers): yields the handle whose `routes` is the router's own choice
    (`Replaying` under replay, `Recording` otherwise), or None for an idle request, which installs nothing."""
    if request.idle:
        yield None
        return
    trace = request.replay
    with _hooks(model, request) as hooks:
        if trace is None:
            yield Recording(hooks, expert_count(model), request.generate)
            return
        checked = {"done": False}

        def check(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
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
        try:
            yield Replaying(hooks, trace.num_experts)
        finally:
            handle.remove()


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
    def of(cls, capture: RouterCapture, weights: torch.Tensor, replayed: torch.Tensor | None = None) -> RouterCalls:
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
            self._ranked[layer] = scores.topk(min(2 * router_top_k(router), scores.shape[-1]), dim=-1)
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

    def take(module: torch.nn.Module, args: tuple[Any, ...], out: RouterOutput) -> None:
        capture.calls.append((module, out[0]))
        capture.own_experts.append(out[2])

    handles = [router.register_forward_hook(take, prepend=True) for router in find_routers(model).values()]
    try:
        yield capture
    finally:
        for handle in handles:
            handle.remove()
