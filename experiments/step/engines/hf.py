"""The HF engine (`rollout.engine=hf`, the default): transformers' `generate` as the sampler μ_old.

Each prompt is prefilled once and its KV cache copied to its G rows, then decoded with the cache; μ_old is the
fp32 log-softmax of each step's raw logits under `logits / temperature`, gathered for the sampled token. By default
it runs on the trainer's own model, so its weight sync is a no-op and its numbers are the trainer's own up to the
KV-cache path's rounding (~1e-6). Given `EngineNumerics` that differ, or where its rollout source samples behind θ_old
(`rollout.source=lagged`: older weights, `experiments.step.versions`), it holds its own copy of the weights, as an
inference server does, and differs from the trainer on purpose (training–inference mismatch that a run can dial):
    precision     fp32 | bf16 | fp16: the copy's dtype (its log-probs are still taken in fp32 from its logits);
    weight_quant  none | int8 | fp8: fake quantization of every linear and expert weight of the decoder layers, per
                  output channel (symmetric, scale = max |w| / 127 for int8, / 448 for FP8 e4m3, quantize then
                  dequantize), as an FP8 rollout of a bf16-trained model (arXiv 2512.01374's setup) in miniature;
                  routers, embeddings and the LM head keep their precision, as FP8 inference engines keep them;
    router_noise  σ: seeded Gaussian noise N(0, σ²) on the copy's router logits before its top-k (the family's own
                  routing of the noisy logits, `models.routing.families.route`), so that near-tied routes flip in the
                  engine and not in the trainer.
The copy takes the trainer's weights after every step's updates, or under a lag the version it is to sample with
(cast, then re-quantized): the engine never trains.
Predictive Routing Replay (`Sampling.predict_routes`, `routing_variant=predictive`): while it samples, and only then,
its routers route by their predictors (`models.routing.predictor.route_by_predictors`, after the router noise), and
the routing it records carries each router's input and logits, on which the trainer fits the predictors.
The KV cache (`rollout.kv_cache`): transformers' `DynamicCache` grows each layer's keys and values by `torch.cat` at
every decode step, copying the whole cache every step (on bench-deep, 256 rows x 16 layers x ~45 positions: 270 ms of
a 1.9 s rollout). `preallocated`, the default, keeps them in buffers with room for the rollout's new tokens, writes
each step's states into the next free positions and hands attention views of the filled part: the same values read
in place (attention's batched matmuls take the views' strides as they are), so the same tokens, log-probs and
routing, bit for bit (tests/test_rollout.py). `concat` is transformers' own cache, kept as the reference.
Logits that turn non-finite while sampling end the run as diverged (`FiniteLogits`).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, cast

import torch
import torch.distributed as dist
from transformers import (
    Cache,
    DynamicCache,
    GenerationMixin,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.cache_utils import DynamicLayer

from experiments.ranks import Ranks
from experiments.step.engines.base import (
    ENGINES,
    EngineNumerics,
    KVCache,
    Precision,
    RolloutEngine,
    Samples,
    Sampling,
    WeightQuant,
)
from experiments.step.scoring import position_ids
from models.registry import ConfigError, Diverged
from models.routing.families import RouterOutput, route
from models.routing.hooks import Recording, record_routing
from models.routing.predictor import route_by_predictors
from models.routing.trace import NO_ROUTE, OPTIONAL_PARTS, RoutingTrace, find_routers

DTYPE = {Precision.fp32: torch.float32, Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16}
QUANT_RANGE = {WeightQuant.int8: 127.0, WeightQuant.fp8: 448.0}  # largest magnitude each format holds


@ENGINES.register("hf")
class HFEngine(RolloutEngine):
    """transformers' `generate`, with one prefill per prompt shared by its G completions: on `model` itself, or, with
    `numerics`, on its own copy of the weights that differs from the trainer's as the module docstring says.

    `min_new_tokens`: ban eos before that many tokens (the benchmark's fixed-length steps); μ_old is still taken
    from the raw logits, before that sampling-time processor, the same distribution the trainer scores. `seed`:
    the router noise's generator (`reseed` sets it again, per step). `kv_cache`: how the decode's KV cache grows
    (`KVCache`). `synced`: the model is sharded over ranks
    (FSDP2), so every rank runs as many decode steps as the longest rank's (`generate`'s `synced_gpus`): a rank whose
    rows are done must still take part in the others' all-gathers.
    """

    routes_by_predictors = True

    @classmethod
    def shares_weights_with_trainer(cls, numerics: EngineNumerics) -> bool:
        return not numerics.differs

    @classmethod
    def build(
        cls,
        cfg: Any,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        numerics: EngineNumerics | None,
        ranks: Ranks,
        records_routing: bool,
    ) -> HFEngine:
        return cls(
            model,
            tokenizer,
            numerics=numerics,
            seed=cfg.seed,
            synced=ranks.active,
            kv_cache=KVCache(cfg.rollout.kv_cache),
        )

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        min_new_tokens: int = 0,
        numerics: EngineNumerics | None = None,
        seed: int = 0,
        synced: bool = False,
        kv_cache: KVCache = KVCache.preallocated,
    ) -> None:
        self.tokenizer = tokenizer
        self.min_new_tokens = min_new_tokens
        self.kv_cache = kv_cache
        rollout_cache(model, kv_cache, 0)  # refuses a model this cache cannot hold now, not at the first rollout
        self.numerics = EngineNumerics() if numerics is None else numerics
        self.synced = synced
        self.shares_trainer_weights = numerics is None
        self.noise = torch.Generator().manual_seed(seed)
        if numerics is None:
            self.model = model
            return
        # functools.wraps hides from mypy that PreTrainedModel.to is a method (typeshed's _Wrapped binds no self).
        self.model = copy.deepcopy(model).to(DTYPE[numerics.precision]).eval().requires_grad_(False)  # type: ignore[arg-type]
        self._quantize()
        if numerics.router_noise > 0:
            for router in find_routers(self.model).values():
                router.register_forward_hook(_RouterNoise(numerics.router_noise, self.noise))

    def reseed(self, seed: int) -> None:
        """Set the router noise's generator (the loop does, every step, from (seed, step, rank))."""
        self.noise.manual_seed(seed)

    def sync_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        if self.shares_trainer_weights:
            raise ValueError("this HFEngine samples with the trainer's own module; it takes no other weights")
        self.model.load_state_dict(weights)  # cast to the copy's dtype, then quantized again
        self._quantize()

    @torch.no_grad()
    def _quantize(self) -> None:
        """Fake-quantize the copy's decoder-layer linear and expert weights in place (module docstring); the routers'
        own and their predictors' keep their precision."""
        kind = self.numerics.weight_quant
        if kind == WeightQuant.none:
            return
        routers = {id(weight) for router in find_routers(self.model).values() for weight in router.parameters()}
        for name, weight in self.model.named_parameters():
            if ".layers." in name and weight.dim() >= 2 and id(weight) not in routers:
                weight.copy_(fake_quantize(weight, kind))

    @torch.no_grad()
    def sample(self, prompts: list[str], sampling: Sampling) -> Samples:
        group_size, max_new_tokens, temperature = sampling.group_size, sampling.max_new_tokens, sampling.temperature
        greedy, record_routing, record_gates = sampling.greedy, sampling.record_routing, sampling.record_gates
        predict = sampling.predict_routes
        model, tokenizer = self.model, self.tokenizer
        device = next(model.parameters()).device
        unique = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        encoded = {key: value.repeat_interleave(group_size, dim=0).to(device) for key, value in unique.items()}
        prompt_width = encoded["input_ids"].shape[1]
        logits_watch = FiniteLogits()
        options = dict(
            max_new_tokens=max_new_tokens,
            do_sample=not greedy,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            logits_processor=LogitsProcessorList([logits_watch]),
        )
        if not greedy:
            options.update(temperature=temperature, top_k=0, top_p=1.0)
        if self.min_new_tokens:
            options["min_new_tokens"] = min(self.min_new_tokens, max_new_tokens)
        if self.synced:
            options["synced_gpus"] = True
        prefix_trace = None
        options["cache"] = rollout_cache(model, self.kv_cache, reserve=max_new_tokens)
        # By the predictors only while it samples: an engine on the trainer's own module leaves its forwards alone.
        with route_by_predictors(model) if predict else contextlib.nullcontext():
            if group_size > 1 and prompt_width > 1:
                prefix_trace = _prefill_once_per_prompt(
                    model, unique, group_size, record_routing, record_gates, predict, options["cache"]
                )
            sampled = contextlib.nullcontext() if greedy else _SampledLogProbs(model, temperature)
            with sampled as logprobs, record_routing_if(model, record_routing, record_gates, predict) as recording:
                # A causal LM (transformers' *ForCausalLM) generates; PreTrainedModel alone does not say so.
                sequences = cast(GenerationMixin, model).generate(**encoded, **options)
        if logits_watch.seen(device, self.synced):
            numerics = self.numerics
            sampler = (
                "the trainer's model"
                if self.shares_trainer_weights
                else (
                    f"the engine's own copy (rollout.precision={numerics.precision}, rollout.weight_quant="
                    f"{numerics.weight_quant}, rollout.router_noise={numerics.router_noise})"
                )
            )
            raise Diverged(f"{sampler} produced logits that are NaN or inf, with nothing to sample from")
        trace = None
        if recording is not None:
            trace = recording.trace
            if prefix_trace is not None:
                trace = _joined(prefix_trace, trace)
            if self.synced:  # a rank that finished early kept feeding its last token: cut those calls off
                trace = trace.map(lambda tensor: _without_last_call(tensor[:, :, : sequences.shape[1]]))
        input_ids, response_mask, truncated = _response_layout(
            sequences, prompt_width, tokenizer.eos_token_id, tokenizer.pad_token_id
        )
        logp = None
        if logprobs is not None:
            logp = logprobs.finish(sequences[:, -1], sequences.shape[1] - prompt_width).masked_fill(~response_mask, 0.0)
        return Samples(
            input_ids=input_ids,
            attention_mask=torch.cat([encoded["attention_mask"], response_mask.long()], dim=1),
            response_mask=response_mask,
            prompt_width=prompt_width,
            completions=tokenizer.batch_decode(input_ids[:, prompt_width:], skip_special_tokens=True),
            truncated=truncated,
            logp=logp,
            routes=trace,
        )


class FiniteLogits(LogitsProcessor):
    """A `generate` logits processor that watches every decode step for a row whose logits hold NaN or +inf (or only
    -inf): there is no distribution to sample from. Such a row is recorded and given uniform logits, so that
    `generate` finishes on every rank (a rank that stopped inside it would leave the others waiting in its
    collectives); the caller asks `seen` after `generate` and raises `Diverged`, on every rank at once."""

    def __init__(self) -> None:
        self.met = False

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        broken = ~torch.isfinite(scores.amax(dim=-1))  # amax is NaN with a NaN, inf with +inf, -inf when all are
        if not bool(broken.any()):
            return scores
        self.met = True
        return torch.where(broken[:, None], torch.zeros_like(scores), scores)

    def seen(self, device: torch.device, synced: bool) -> bool:
        """Whether any decode step met such logits: on this rank, or on any rank when `synced` (FSDP2 ranks)."""
        if not synced:
            return self.met
        met = torch.tensor(float(self.met), device=device)
        dist.all_reduce(met, op=dist.ReduceOp.MAX)
        return bool(met)


def fake_quantize(weight: torch.Tensor, kind: WeightQuant) -> torch.Tensor:
    """Quantize then dequantize `weight` (`[out, in]`, or experts' `[E, out, in]`) per output channel: a symmetric
    scale max |w| / range per row, values rounded to int8 or cast to FP8 e4m3, times the scale again."""
    w = weight.float()
    scale = w.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / QUANT_RANGE[kind]
    if kind == WeightQuant.int8:
        q = torch.round(w / scale).clamp(-127, 127)
    else:
        q = (w / scale).to(torch.float8_e4m3fn).float()
    return (q * scale).to(weight.dtype)


class _RouterNoise:
    """Forward hook on an engine router: add N(0, σ²) to its logits and route by them (the family's top-k and gate
    weights, `models.routing.families.route`), before any recording hook sees the choice."""

    def __init__(self, sigma: float, generator: torch.Generator) -> None:
        self.sigma = sigma
        self.generator = generator

    def __call__(self, router: torch.nn.Module, args: tuple[Any, ...], output: RouterOutput) -> RouterOutput:
        logits, weights, indices = output
        noise = torch.randn(logits.shape, generator=self.generator, dtype=torch.float32).to(logits.device)
        noisy = logits + (self.sigma * noise).to(logits.dtype)
        gates, chosen = route(router, noisy)
        return noisy, gates.to(weights.dtype), chosen.to(indices.dtype)


def record_routing_if(
    model: PreTrainedModel, record: bool, gates: bool = False, states: bool = False
) -> contextlib.AbstractContextManager[Recording | None]:
    """`record_routing(model, generate=True, gates=gates, states=states)` when `record`, else a context that yields
    None."""
    return record_routing(model, generate=True, gates=gates, states=states) if record else contextlib.nullcontext()


def _without_last_call(block: torch.Tensor) -> torch.Tensor:
    """A trace tensor whose last column is no route (`NO_ROUTE` experts, 0 gates): the last sampled token never
    went through the model."""
    block = block.clone()
    block[:, :, -1] = 0.0 if block.is_floating_point() else NO_ROUTE
    return block


def _joined(head: RoutingTrace, tail: RoutingTrace) -> RoutingTrace:
    """The trace of `head`'s positions followed by `tail`'s (the prefill's, then `generate`'s), all it recorded."""
    # Any: tensors, which `replace` takes by name beside fields of other types.
    joined: dict[str, Any] = {
        part: torch.cat([getattr(head, part), getattr(tail, part)], dim=2)
        for part in ("experts", *OPTIONAL_PARTS)
        if getattr(tail, part) is not None
    }
    return replace(tail, **joined)


class _SampledLogProbs:
    """Log-probs of the sampled tokens under `logits / temperature`, gathered one decode step at a time.

    A forward hook keeps the log-softmax of the last position's raw logits (before any sampling-time processor);
    the next forward's input is the token sampled from them, so a pre-hook gathers its log-prob then. The last
    sampled token is never fed back: `finish` gathers it from the returned sequences. Memory: one `[N, V]` step,
    not the `[N, T, V]` that `output_logits` would keep.
    """

    def __init__(self, model: PreTrainedModel, temperature: float) -> None:
        self.model = model
        self.temperature = temperature
        self.pending: torch.Tensor | None = None  # [N, V] fp32 log-probs of the next token
        self.taken: list[torch.Tensor] = []  # [N] per generated token

    def _after(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        self.pending = torch.log_softmax(output.logits[:, -1].float() / self.temperature, dim=-1)

    def _before(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.pending is not None:
            self._take(kwargs["input_ids"][:, -1])

    def _take(self, tokens: torch.Tensor) -> None:
        pending = cast(torch.Tensor, self.pending)  # kept by the forward that produced `tokens`
        self.taken.append(pending.gather(-1, tokens[:, None].to(pending.device)).squeeze(-1))
        self.pending = None

    def finish(self, last_tokens: torch.Tensor, generated: int) -> torch.Tensor:
        """`[N, T]` (T = `generated`): the log-prob of every generated token, the last one gathered from
        `last_tokens` unless a later forward already did (synced ranks keep feeding it after they are done; what
        those calls gather is past the end and dropped)."""
        if len(self.taken) < generated:
            self._take(last_tokens)
        return torch.stack(self.taken[:generated], dim=1).cpu()

    def __enter__(self) -> _SampledLogProbs:
        self._handles = [
            self.model.register_forward_pre_hook(self._before, with_kwargs=True),
            self.model.register_forward_hook(self._after, with_kwargs=True),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()


def _response_layout(
    sequences: torch.Tensor, prompt_width: int, eos_id: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cut each response after its first eos; return (input_ids, response_mask [N, T], truncated [N])."""
    response = sequences[:, prompt_width:]
    is_eos = response == eos_id
    seen_eos_before = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    response_mask = ~seen_eos_before
    truncated = ~is_eos.any(-1)
    response = response.masked_fill(~response_mask, pad_id)
    return torch.cat([sequences[:, :prompt_width], response], dim=1).cpu(), response_mask.cpu(), truncated.cpu()


def _prefill_once_per_prompt(
    model: PreTrainedModel,
    unique: dict[str, torch.Tensor],
    group_size: int,
    record: bool,
    gates: bool,
    states: bool,
    cache: Cache,
) -> RoutingTrace | None:
    """Fill the empty `cache` with every prompt but its last token, computed once per prompt and copied to its G
    rows.

    The G completions of a prompt share it, so the prefill over B·G rows would compute each prompt G times.
    `generate` continues from this cache: its first forward feeds only the last prompt token (and yields the
    first sampled token's logits), then decodes as usual. With `record`, the prefix's routing comes back laid
    out like the B·G rows (with `gates`, its gate weights and log-probabilities too), to be put in front of the
    routing recorded during `generate` (with `states`, the routers' inputs and logits too).
    """
    device = next(model.parameters()).device
    ids = unique["input_ids"][:, :-1].to(device)
    mask = unique["attention_mask"][:, :-1].to(device)
    with record_routing(model, gates=gates, states=states) if record else contextlib.nullcontext() as recording:
        model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=position_ids(mask),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
    cache.batch_repeat_interleave(group_size)
    if not record:
        return None
    return cast(Recording, recording).trace.rows(torch.arange(ids.shape[0]).repeat_interleave(group_size))


class PreallocatedLayer(DynamicLayer):
    """A `DynamicLayer` whose `keys` and `values` are views of buffers with room for `reserve` more positions than
    the layer holds after the update that (re)allocated them. Where one of transformers' own methods replaced `keys`
    or `values` by another tensor (its row repeats and selections assign new tensors), the next `update` copies them
    into new buffers first: correct whichever of them ran, at one copy."""

    def __init__(self, reserve: int) -> None:
        super().__init__()
        self.reserve = reserve
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def _holds_the_cache(self, adding: int) -> bool:
        """Whether `keys` and `values` are still the buffers' views and the buffers have room for `adding` more."""
        if self._key_buffer is None:
            return False
        keys, values = cast(torch.Tensor, self.keys), cast(torch.Tensor, self.values)  # a layer with buffers holds them
        views = keys._base is self._key_buffer and values._base is self._value_buffer
        return views and keys.shape[-2] + adding <= self._key_buffer.shape[-2]

    def _allocate(self, keys: torch.Tensor, values: torch.Tensor, positions: int) -> None:
        """New buffers for `positions` positions, holding `keys` and `values` in their first ones."""
        length = keys.shape[-2]

        def buffer(states: torch.Tensor) -> torch.Tensor:
            shape = (*states.shape[:-2], positions, states.shape[-1])
            new = states.new_empty(shape)
            new[..., :length, :].copy_(states)
            return new

        self._key_buffer, self._value_buffer = buffer(keys), buffer(values)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states[..., :0, :], value_states[..., :0, :]
        keys, values = cast(torch.Tensor, self.keys), cast(torch.Tensor, self.values)  # set above, if not before
        length, adding = keys.shape[-2], key_states.shape[-2]
        end = length + adding
        if not self._holds_the_cache(adding):
            self._allocate(keys, values, end + self.reserve)
        # the buffers held, or just allocated
        key_buffer, value_buffer = cast(torch.Tensor, self._key_buffer), cast(torch.Tensor, self._value_buffer)
        key_buffer[..., length:end, :].copy_(key_states)
        value_buffer[..., length:end, :].copy_(value_states)
        self.keys, self.values = key_buffer[..., :end, :], value_buffer[..., :end, :]
        return self.keys, self.values


def rollout_cache(model: PreTrainedModel, kind: KVCache, reserve: int) -> DynamicCache:
    """An empty cache of `kind` for `model`: each layer with room for `reserve` positions more than its first
    update brings (`preallocated`; a rollout's is its `max_new_tokens`), or transformers' own. `ConfigError` where
    `model` has layers a concatenating full-attention cache does not describe (sliding windows, chunked attention):
    those keep transformers' cache."""
    cache = DynamicCache(config=model.config)
    if kind == KVCache.concat:
        return cache
    others = sorted({type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer})
    if others:
        raise ConfigError(
            f"rollout.kv_cache={kind.value!r} writes full-attention layers in place; {type(model).__name__} has "
            f"{', '.join(others)} layers: use rollout.kv_cache=concat"
        )
    cache.layers = [PreallocatedLayer(reserve) for _ in cache.layers]
    return cache
