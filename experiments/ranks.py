"""Which rank this process is among the run's ranks (`Ranks`), and the object collectives every room above passes
between them (`broadcast_object`, `scatter_objects`, `gather_objects`, `barrier`). On one rank (no torchrun) each is
the identity and no process group exists; `experiments.run.launch` starts the group. The tensor collectives and
FSDP2 sharding the step uses are `experiments.step.data_parallel`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class Ranks:
    """This process's place among the run's ranks (rank 0 of 1 without torchrun; `experiments.run.launch.start`)."""

    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1


def broadcast_object(obj: Any, ranks: Ranks) -> Any:
    """Rank 0's `obj` on every rank."""
    if not ranks.active:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def scatter_objects(objs: list[Any] | None, ranks: Ranks) -> Any:
    """Rank 0's `objs[r]` on rank r (`objs`, one object per rank, is read on rank 0 alone)."""
    if not ranks.active:
        assert objs is not None  # rank 0's
        return objs[0]
    box: list[Any] = [None]
    dist.scatter_object_list(box, objs if ranks.main else None, src=0)
    return box[0]


def gather_objects(obj: Any, ranks: Ranks) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank."""
    if not ranks.active:
        return [obj]
    found: list[Any] = [None] * ranks.world
    dist.all_gather_object(found, obj)
    return found


def barrier(ranks: Ranks) -> None:
    if ranks.active:
        dist.barrier()
