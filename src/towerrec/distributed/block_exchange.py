"""The all-gather through which distributed Shampoo's ranks share their blocks' updates
(``optim/shampoo.py``): each rank sends its own blocks' updates, flat, and receives
every rank's. gloo's all-gather takes equal sizes, so each rank's part is padded to the
largest and trimmed on arrival."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["GroupExchange"]


class GroupExchange:
    """A ``BlockExchange`` over a process group (the default group if none)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self._rank = dist.get_rank(group)
        self._world_size = dist.get_world_size(group)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def all_gather(self, local: torch.Tensor, counts: Sequence[int]) -> list[torch.Tensor]:
        if local.numel() != counts[self._rank]:
            raise ValueError(
                f"rank {self._rank} holds {local.numel()} elements of block updates, "
                f"its share is {counts[self._rank]}"
            )
        size = max(counts)
        padded = local.new_zeros(size)
        padded[: local.numel()] = local
        parts = [local.new_empty(size) for _ in counts]
        dist.all_gather(parts, padded, group=self.group)
        return [part[:count] for part, count in zip(parts, counts)]
