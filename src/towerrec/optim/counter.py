"""Counter-based frequency-aware SGD (CF-SGD, Li et al.) for embedding rows.

FBGEMM calls its variant "row-wise Adagrad with counter"; its CPU kernels lack
it, so it runs on the pure-PyTorch kernel path. Every row keeps a decayed count
of the steps that touched it; frequent rows take smaller steps::

    at step t, for each row r touched in this step (gradient g[r] summed over the batch):
        c[r] = c[r] * 2^(-(t - last[r]) / halflife) + 1       (halflife = 0: no decay)
        last[r] = t
        w[r] -= lr * g[r] / sqrt(c[r])

State per row: ``counter`` c and ``last_step``. The step t is one more than the
latest ``last_step`` of the kernel's rows (every step touches some row), so
the state alone determines the next update: a checkpoint needs nothing else.
"""

from __future__ import annotations

import torch

__all__ = ["counter_sgd_update"]


def counter_sgd_update(
    weight: torch.Tensor,
    state: dict[str, torch.Tensor],
    rows: torch.Tensor,
    grad: torch.Tensor,
    lr: float,
    halflife: float,
) -> None:
    """One CF-SGD step on ``weight[rows]`` for unique ``rows[U]`` and ``grad[U, D]``."""
    counter, last = state["counter"], state["last_step"]
    if rows.numel() == 0:
        return
    step = last.max() + 1
    c = counter.index_select(0, rows)
    if halflife > 0:
        c.mul_(torch.exp2((last.index_select(0, rows) - step) / halflife))
    c.add_(1.0)
    counter.index_copy_(0, rows, c)
    last.index_fill_(0, rows, step)
    update = grad * (lr / c.sqrt_()).unsqueeze(1)
    weight.index_copy_(0, rows, weight.index_select(0, rows).sub_(update))
