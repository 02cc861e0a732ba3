"""The all-reduce through which the sample-choosing dense optimizers (``optim/pb_lbfgs.py``,
``optim/dance.py``) add up their ranks' shares of every evaluation: loss, gradient and
Hessian-vector sums, one collective per evaluation."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["GroupReducer"]


class GroupReducer:
    """A ``Reducer`` over a process group (the default group if none)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor
