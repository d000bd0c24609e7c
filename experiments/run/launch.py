"""Data-parallel RL on several ranks: `torchrun --nproc_per_node=N python -m experiments.train ...`.

Each rank samples its share of the step's prompts (whole groups stay on one rank, so group advantages need no
communication), scores and trains on its share; the policy is sharded with FSDP2 (`fully_shard` per decoder layer,
then the root), whose reduce-scatter averages the gradients over ranks. The loss aggregation uses the step's global
token and sequence counts (`algos.common.Totals`), so the averaged gradient is the gradient of one process with the
whole batch (verl's `agg_loss` with `dp_size`). Metrics are computed on the gathered batch, so every logged number is
the global value, not rank 0's share; only rank 0 writes the run directory, W&B and the summary.

Backend: gloo on CPU (this machine: 2 ranks x 1 thread), nccl on CUDA. Sampling on each rank is seeded from (seed,
step, rank), so a multi-rank run is deterministic, and a resumed run samples what the uninterrupted one sampled.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from models.registry import ConfigError


@dataclass(frozen=True)
class Ranks:
    """This process's place among the run's ranks (rank 0 of 1 without torchrun)."""

    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1


def start(device: str) -> Ranks:
    """Join the process group torchrun set up (its env vars), or run alone; refuse a backend the machine lacks."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Ranks()
    cuda = device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r} under torchrun needs CUDA (nccl), and this machine has none: device=cpu")
    die_with_parent(signal.SIGKILL)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return Ranks(dist.get_rank(), dist.get_world_size())


def exit_once(message: str) -> NoReturn:
    """End this process with `message` as its one line (exit code 1), printed by rank 0 alone: under torchrun every
    rank meets the same refusal, and N copies of one line would bury it. The other ranks end with the same code,
    silently (torchrun's `RANK`; a process without torchrun is rank 0)."""
    raise SystemExit(message if int(os.environ.get("RANK", "0")) == 0 else 1) from None


def die_with_parent(sig: signal.Signals = signal.SIGKILL) -> None:
    """End this process with `sig` when its parent dies (Linux's PR_SET_PDEATHSIG). A rank whose torchrun agent was
    killed (kill -9, a lost SLURM step) gets SIGKILL instead of waiting forever on a store nobody serves (SIGKILL: a
    rank blocked inside a collective runs no Python handler); `resume=auto` goes on from its last checkpoint. A joblib
    sweep worker whose Hydra process was killed gets SIGTERM, so its job ends as interrupted (summary written)
    instead of running on, orphaned."""
    if not sys.platform.startswith("linux"):
        return
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() == 1:  # the parent died before the call: nobody is left to send the signal
        os.kill(os.getpid(), sig)


def step_seed(seed: int, step: int, rank: int) -> int:
    """A 63-bit seed for (run seed, step, rank), different for every triple a run meets."""
    return (seed * 1_000_003 + step * 10_007 + rank * 101 + 7) % (2**63 - 1)


def shard(model: torch.nn.Module) -> None:
    """FSDP2: each decoder layer its own unit, then the root (embeddings, final norm, LM head)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


_CARRIERS = {torch.bool: torch.uint8, torch.int16: torch.int32}


def gather(tensor: torch.Tensor, ranks: Ranks, dim: int = 0, fill: float = 0) -> torch.Tensor:
    """Every rank's `tensor` concatenated along `dim`, the other dimensions padded to the largest rank's with `fill`
    (padding on the right, where every batch layout here puts it). Identity on one rank."""
    if not ranks.active:
        return tensor
    if tensor.dtype in _CARRIERS:  # gloo sends neither bool nor int16: carry them in a type it does send
        return gather(tensor.to(_CARRIERS[tensor.dtype]), ranks, dim, fill).to(tensor.dtype)
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
    equal = [*target[:dim], longest, *target[dim + 1:]]
    mine = padded.new_full(equal, fill)
    mine.narrow(dim, 0, padded.shape[dim]).copy_(padded)
    pieces = [padded.new_empty(equal) for _ in range(ranks.world)]
    dist.all_gather(pieces, mine)
    return torch.cat([piece.narrow(dim, 0, int(size)) for piece, size in zip(pieces, sizes)], dim=dim)


def reduce(value: float, ranks: Ranks, op: str = "sum") -> float:
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


def broadcast(obj: Any, ranks: Ranks) -> Any:
    """Rank 0's `obj` on every rank."""
    if not ranks.active:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(ranks: Ranks) -> None:
    if ranks.active:
        dist.barrier()
