"""A dense optimizer's state following its parameters through structured width changes.

When a parameter keeps some entries along a dimension (pruning) or gets entries
appended (growth), every state tensor of the parameter's shape is changed the same
way: Adam's ``exp_avg`` and ``exp_avg_sq`` (and ``max_exp_avg_sq``), Adagrad's
``sum``, SGD's ``momentum_buffer``. Kept entries keep their state bit for bit;
appended entries start from zero, as for a parameter the optimizer never saw.
Scalars (Adam's ``step``) are per tensor and stay, so Adam's bias correction is
already ~1 for the new entries: their ratio m / sqrt(v) climbs to about 6 within
ten steps (about 1 for an established entry), so they move fast while their
moments fill. Starting their squared-gradient statistic at the tensor's mean
instead (steps like a typical entry's) scored worse on the growth-and-pruning
benchmark (docs/benchmarks.md): the new units, zero at their outgoing side, are
better off catching up quickly.

Shampoo's state (Kronecker factors per block, inverse roots, grafting state) does not
slice along a unit; it is refused (``check_reshapable``).
"""

from __future__ import annotations

import torch

from towerrec.optim.shampoo import Shampoo

__all__ = ["check_reshapable", "narrow_state", "widen_state"]

_SUPPORTED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.SGD)


def check_reshapable(optimizer: torch.optim.Optimizer) -> None:
    """Raise for an optimizer whose state cannot follow a width change."""
    if isinstance(optimizer, Shampoo):
        raise ValueError(
            "optimizer.name = 'shampoo' cannot be used with train.prune_grow: its "
            "preconditioner blocks do not slice along a unit; use adam, adagrad or sgd"
        )
    if not isinstance(optimizer, _SUPPORTED):
        raise ValueError(
            f"train.prune_grow cannot reshape the state of {type(optimizer).__name__}; "
            "use optimizer.name = adam, adagrad or sgd"
        )


def _shaped_like(state: dict, param: torch.Tensor, before: torch.Size):
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == before:
            yield key, value


@torch.no_grad()
def narrow_state(
    optimizer: torch.optim.Optimizer,
    param: torch.Tensor,
    dim: int,
    index: torch.Tensor,
    before: torch.Size,
) -> None:
    """``param`` (now narrowed, of shape ``before`` until then) kept ``index`` along
    ``dim``: keep the same entries of its state."""
    state = optimizer.state.get(param)
    if not state:
        return
    for key, value in list(_shaped_like(state, param, before)):
        state[key] = value.index_select(dim, index.to(value.device)).contiguous()


@torch.no_grad()
def widen_state(
    optimizer: torch.optim.Optimizer,
    param: torch.Tensor,
    dim: int,
    added: int,
    before: torch.Size,
) -> None:
    """``param`` (now widened, of shape ``before`` until then) got ``added`` entries
    appended along ``dim``: append zeros to its state (module doc)."""
    state = optimizer.state.get(param)
    if not state:
        return
    for key, value in list(_shaped_like(state, param, before)):
        shape = list(value.shape)
        shape[dim] = added
        state[key] = torch.cat([value, value.new_zeros(shape)], dim=dim)
