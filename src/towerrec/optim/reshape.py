"""A dense optimizer's state following its parameters through structured width changes.

When a parameter keeps some entries along a dimension (pruning) or gets entries
appended (growth), every state tensor of the parameter's shape is changed the same
way: Adam's ``exp_avg`` and ``exp_avg_sq`` (and ``max_exp_avg_sq``), Adagrad's
``sum``, SGD's ``momentum_buffer``. Kept entries keep their state bit for bit.
Appended entries start with a zero first moment (``exp_avg``, ``momentum_buffer``)
and with the mean of the tensor's existing entries as their squared-gradient
statistic (``exp_avg_sq``, ``max_exp_avg_sq``, ``sum``): scalars such as Adam's
``step`` are per tensor, so with zeros there the new entries would take steps far
larger than the others' (Adam's bias correction is already ~1 at a late step: its
ratio m / sqrt(v) reaches about 6 after ten steps from zero at the default betas,
against about 1 for an established entry; Adagrad's first step from a zero sum is a
full ``lr`` sign step). Starting from the mean, they step like a typical entry of
their tensor.

Shampoo's state (Kronecker factors per block, inverse roots, grafting state) does not
slice along a unit; it is refused (``check_reshapable``).
"""

from __future__ import annotations

import torch

from towerrec.optim.shampoo import Shampoo

__all__ = ["SQUARED_STATE", "check_reshapable", "narrow_state", "widen_state"]

# State keys holding running squared-gradient statistics (Adam, Adagrad).
SQUARED_STATE = ("exp_avg_sq", "max_exp_avg_sq", "sum")

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
    appended along ``dim``: append zeros to its state, or the mean of the existing
    entries to a squared-gradient statistic (module doc)."""
    state = optimizer.state.get(param)
    if not state:
        return
    for key, value in list(_shaped_like(state, param, before)):
        shape = list(value.shape)
        shape[dim] = added
        fill = value.mean() if key in SQUARED_STATE else 0.0
        state[key] = torch.cat([value, value.new_zeros(shape) + fill], dim=dim)
