"""What one rank of a distributed run computes for all: ``on_first_rank``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

__all__ = ["on_first_rank"]

T = TypeVar("T")


def on_first_rank(compute: Callable[[], T]) -> T:
    """``compute()`` on rank 0 of a distributed run, its result broadcast to every rank
    (one pilot run or measurement instead of one per rank, and every rank gets the same
    result); in one process, ``compute()``."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return compute()
    box = [compute() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[return-value]  # rank 0's T, broadcast
