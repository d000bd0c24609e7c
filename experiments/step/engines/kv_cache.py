"""The HF engine's KV cache (`rollout.kv_cache`): transformers' concatenating cache, or one written in place.

transformers' `DynamicCache` grows each layer's keys and values by `torch.cat` at every decode step, so a rollout
of T new tokens copies the whole cache T times: on bench-deep (256 rows, 16 layers, ~45 positions) those copies were
270 ms of a 1.9 s rollout, the largest single operator after the experts' matmuls. `preallocated` keeps each
layer's keys and values in buffers with room for the rollout's new tokens, writes each step's states into the next
free positions and hands attention views of the filled part: the same tensors' values, read in place (attention's
batched matmuls take the views' strides as they are), so the sampled tokens and their log-probs are the same bits
(`tests/test_engines.py`). `concat` is transformers' own cache, kept as the reference.
"""

from __future__ import annotations

from enum import StrEnum

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from models.registry import ConfigError


class KVCache(StrEnum):
    preallocated = "preallocated"  # buffers with room for the rollout, written in place (the default)
    concat = "concat"  # transformers' DynamicCache: grown by concatenation at every step (the reference)


class PreallocatedLayer(DynamicLayer):
    """A `DynamicLayer` whose `keys` and `values` are views of buffers with room for `reserve` more positions than
    the layer holds after the update that (re)allocated them. Where one of transformers' own methods replaced `keys` or `values`
    by another tensor (its row repeats and selections assign new tensors), the next `update` copies them into new
    buffers first: correct whichever of them ran, at one copy."""

    def __init__(self, reserve: int) -> None:
        super().__init__()
        self.reserve = reserve
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def _holds_the_cache(self, adding: int) -> bool:
        """Whether `keys` and `values` are still the buffers' views and the buffers have room for `adding` more."""
        if self._key_buffer is None:
            return False
        views = self.keys._base is self._key_buffer and self.values._base is self._value_buffer
        return views and self.keys.shape[-2] + adding <= self._key_buffer.shape[-2]

    def _allocate(self, keys: torch.Tensor, values: torch.Tensor, positions: int) -> None:
        """New buffers for `positions` positions, holding `keys` and `values` in their first ones."""
        length = keys.shape[-2]

        def buffer(states: torch.Tensor) -> torch.Tensor:
            shape = (*states.shape[:-2], positions, states.shape[-1])
            new = states.new_empty(shape)
            new[..., :length, :].copy_(states)
            return new

        self._key_buffer, self._value_buffer = buffer(keys), buffer(values)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states[..., :0, :], value_states[..., :0, :]
        length, adding = self.keys.shape[-2], key_states.shape[-2]
        end = length + adding
        if not self._holds_the_cache(adding):
            self._allocate(self.keys, self.values, end + self.reserve)
        self._key_buffer[..., length:end, :].copy_(key_states)
        self._value_buffer[..., length:end, :].copy_(value_states)
        self.keys, self.values = self._key_buffer[..., :end, :], self._value_buffer[..., :end, :]
        return self.keys, self.values


def rollout_cache(model: PreTrainedModel, kind: KVCache, reserve: int) -> DynamicCache:
    """An empty cache of `kind` for `model`: each layer with room for `reserve` positions more than its first
    update brings (`preallocated`; a rollout's is its `max_new_tokens`), or transformers' own. `ConfigError` where `model` has layers a concatenating full-attention
    cache does not describe (sliding windows, chunked attention): those keep transformers' cache."""
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
