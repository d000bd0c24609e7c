"""Data-parallel ranks in the step: FSDP2 sharding of the policy (`shard`, `reshard`) and the tensor collectives
(`gather_rows`, `reduce_value`, `summed`). On one rank (no torchrun) every collective is the identity; which rank this
process is, and the object collectives, are `experiments.ranks`'.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist

from experiments.ranks import Ranks
from models.routing.predictor import PREDICTOR, predictors
from models.routing.trace import find_routers


def shard(model: torch.nn.Module) -> None:
    """FSDP2: each decoder layer its own unit, then the root (embeddings, final norm, LM head). A router with a
    predictor (Predictive Routing Replay) is a unit of its own, and so is the predictor: the step calls both outside
    the layer's forward, to fit the predictor to the router."""
    from torch.distributed.fsdp import fully_shard

    for predictor in predictors(model):
        fully_shard(predictor)
    for router in find_routers(model).values():
        if hasattr(router, PREDICTOR):
            fully_shard(router)
    decoder = cast(torch.nn.Module, model.model)  # a transformers causal LM: its decoder, whose layers are the units
    for layer in cast(torch.nn.ModuleList, decoder.layers):
        fully_shard(layer)
    fully_shard(model)


def reshard(model: torch.nn.Module) -> None:
    """Put a sharded model's parameters back into their shards after a forward that no backward follows (FSDP2
    keeps the root's gathered after its forward, for the backward it expects): the optimizer step and the weights'
    norms read shards. Nothing on an unsharded model."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


# -- tensor collectives ----------------------------------------------------------------------------------------------

_CARRIERS = {torch.bool: torch.uint8, torch.int16: torch.int32}


def gather_rows(tensor: torch.Tensor, ranks: Ranks, dim: int = 0, fill: float = 0) -> torch.Tensor:
    """Every rank's `tensor` concatenated along `dim`, the other dimensions padded to the largest rank's with `fill`
    (padding on the right, where every batch layout here puts it). Identity on one rank."""
    if not ranks.active:
        return tensor
    if tensor.dtype in _CARRIERS:  # gloo sends neither bool nor int16: carry them in a type it does send
        return gather_rows(tensor.to(_CARRIERS[tensor.dtype]), ranks, dim, fill).to(tensor.dtype)
    shape = torch.tensor(tensor.shape)
    largest = shape.clone()
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    target = [int(n) if i != dim else int(shape[i]) for i, n in enumerate(largest)]
    padded = tensor.new_full(target, fill)
    padded[tuple(slice(0, n) for n in tensor.shape)] = tensor
    sizes = [torch.zeros((), dtype=torch.long) for _ in range(ranks.world)]
    dist.all_gather(sizes, torch.tensor(tensor.shape[dim]))
    # all_gather needs equal shapes: pad the gathered dimension too, then cut each piece back to its size.
    longest = max(int(size) for size in sizes)
    equal = [*target[:dim], longest, *target[dim + 1 :]]
    mine = padded.new_full(equal, fill)
    mine.narrow(dim, 0, padded.shape[dim]).copy_(padded)
    pieces = [padded.new_empty(equal) for _ in range(ranks.world)]
    dist.all_gather(pieces, mine)
    return torch.cat([piece.narrow(dim, 0, int(size)) for piece, size in zip(pieces, sizes)], dim=dim)


def reduce_value(value: float, ranks: Ranks, op: str = "sum") -> float:
    """`value` summed (or its max) over ranks."""
    if not ranks.active:
        return value
    tensor = torch.tensor(float(value), dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return float(tensor)


def summed(tensor: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """`tensor` summed over ranks (a copy; no gradient flows through it)."""
    if not ranks.active:
        return tensor
    total = tensor.detach().clone()
    dist.all_reduce(total)
    return total


# -- object collectives ----------------------------------------------------------------------------------------------
