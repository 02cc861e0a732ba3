"""Structured width changes of an MLP's hidden layers: pruning and growth.

Hidden layer ``i`` of an ``MLP`` is the output of its linear layer ``i``, for every
linear layer but the last (whose width is the MLP's output). Its unit ``j`` is::

    linears[i].weight[j, :], linears[i].bias[j]     incoming  [width, in]
    norm.weight[j], norm.bias[j], running stats     when the MLP has batch norm
    linears[i + 1].weight[:, j]                     outgoing  [out, width]

``narrow_hidden`` keeps the given units (in ascending order, so a narrowed layer is
the full one with the other units removed); ``widen_hidden`` appends fresh units
whose outgoing weights are zero, so the MLP computes the same function right after
growing, and whose incoming weights are drawn as ``nn.Linear`` draws its own
(uniform in +-1 / sqrt(fan_in)) from the given generator. Both change parameters in
place (``param.data`` swapped: the ``nn.Parameter`` objects, and so an optimizer's
references to them, stay) and return what they changed, ``Narrowed`` or ``Widened``
records, in order, for the optimizer state (``optim/reshape.py``).

``unit_scores`` ranks the units of a hidden layer: ``||incoming|| * ||outgoing||``
(2-norms; incoming with the bias, or ``|norm.weight[j]|`` under batch norm, which
normalises the incoming scale away). ReLU is positively homogeneous, so moving a
factor between a unit's incoming and outgoing weights changes neither the function
nor this product, while the outgoing norm alone would change.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from towerrec.modules.mlp import MLP

__all__ = [
    "Narrowed",
    "Widened",
    "hidden_widths",
    "keep_by_score",
    "narrow_hidden",
    "unit_scores",
    "widen_hidden",
]


@dataclass(frozen=True)
class Narrowed:
    """``param`` (of shape ``before`` until then) kept the entries ``index`` (ascending)
    along ``dim``."""

    param: torch.Tensor
    dim: int
    index: torch.Tensor
    before: torch.Size


@dataclass(frozen=True)
class Widened:
    """``param`` (of shape ``before`` until then) got ``added`` entries appended along
    ``dim``."""

    param: torch.Tensor
    dim: int
    added: int
    before: torch.Size


@dataclass(frozen=True)
class _Hidden:
    incoming: nn.Linear
    norm: nn.BatchNorm1d | None
    outgoing: nn.Linear


def _hidden_layers(mlp: MLP) -> list[_Hidden]:
    modules = list(mlp)
    linears = [i for i, m in enumerate(modules) if isinstance(m, nn.Linear)]
    layers = []
    for a, b in itertools.pairwise(linears):
        norms = [m for m in modules[a:b] if isinstance(m, nn.BatchNorm1d)]
        incoming, outgoing = cast(nn.Linear, modules[a]), cast(nn.Linear, modules[b])
        norm = norms[0] if norms else None
        layers.append(_Hidden(incoming, norm, outgoing))
    return layers


def _layer(mlp: MLP, i: int) -> _Hidden:
    layers = _hidden_layers(mlp)
    if not 0 <= i < len(layers):
        raise ValueError(f"the MLP has {len(layers)} hidden layers; there is no hidden layer {i}")
    return layers[i]


def hidden_widths(mlp: MLP) -> list[int]:
    """Widths of the MLP's hidden layers (every linear output but the last)."""
    return [h.incoming.out_features for h in _hidden_layers(mlp)]


@torch.no_grad()
def unit_scores(mlp: MLP, i: int) -> torch.Tensor:
    """``[width]`` importance of hidden layer ``i``'s units (module doc)."""
    h = _layer(mlp, i)
    if h.norm is not None and h.norm.weight is not None:
        incoming = h.norm.weight.abs()
    else:
        parts = [h.incoming.weight]
        if h.incoming.bias is not None:
            parts.append(h.incoming.bias.unsqueeze(1))
        incoming = torch.cat(parts, dim=1).norm(dim=1)
    scores: torch.Tensor = incoming * h.outgoing.weight.norm(dim=0)
    return scores


def keep_by_score(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """The ``keep`` highest-scoring units, ascending; ties go to the lower index, so the
    choice is a function of the scores alone (equal on every replica)."""
    if not 1 <= keep <= scores.numel():
        raise ValueError(f"keep must lie in [1, {scores.numel()}], got {keep}")
    order = torch.sort(-scores.float().cpu(), stable=True).indices
    return torch.sort(order[:keep]).values


def _set(param: torch.Tensor, value: torch.Tensor) -> None:
    """``param.data = value``, and a fresh gradient accumulator for ``param``: autograd
    keeps the one it made (holding the old shape) as long as some graph or DDP's reducer
    refers to it, and forgets it on ``set_data`` only when the dtype changes, so the data
    passes through an empty tensor of another dtype first."""
    other = torch.float64 if value.dtype != torch.float64 else torch.float32
    param.data = value.new_empty(0, dtype=other)
    param.data = value.contiguous()
    param.grad = None


@torch.no_grad()
def narrow_hidden(mlp: MLP, i: int, index: torch.Tensor) -> list[Narrowed | Widened]:
    """Keep units ``index`` (ascending, without repeats) of hidden layer ``i``."""
    h = _layer(mlp, i)
    width = h.incoming.out_features
    index = index.to(torch.long).cpu()
    if index.numel() == 0 or not bool((index[1:] > index[:-1]).all()):
        raise ValueError("narrow_hidden needs a non-empty ascending index without repeats")
    if index[0] < 0 or index[-1] >= width:
        raise ValueError(f"unit index out of range for a hidden layer of width {width}")
    changes: list[Narrowed | Widened] = []

    def keep(param: torch.Tensor, dim: int) -> None:
        before = param.shape
        _set(param, param.index_select(dim, index.to(param.device)))
        changes.append(Narrowed(param, dim, index, before))

    keep(h.incoming.weight, 0)
    if h.incoming.bias is not None:
        keep(h.incoming.bias, 0)
    if h.norm is not None:
        _narrow_norm(h.norm, index, keep)
    keep(h.outgoing.weight, 1)
    h.incoming.out_features = h.outgoing.in_features = index.numel()
    return changes


def _narrow_norm(
    norm: nn.BatchNorm1d, index: torch.Tensor, keep: Callable[[torch.Tensor, int], None]
) -> None:
    if norm.weight is not None and norm.bias is not None:
        keep(norm.weight, 0)
        keep(norm.bias, 0)
    for name in ("running_mean", "running_var"):
        buffer = getattr(norm, name)
        if buffer is not None:
            setattr(norm, name, buffer.index_select(0, index.to(buffer.device)))
    norm.num_features = index.numel()


@torch.no_grad()
def widen_hidden(
    mlp: MLP, i: int, width: int, generator: torch.Generator
) -> list[Narrowed | Widened]:
    """Append fresh units to hidden layer ``i`` up to ``width`` (module doc)."""
    h = _layer(mlp, i)
    added = width - h.incoming.out_features
    if added < 0:
        raise ValueError(f"hidden layer {i} has {h.incoming.out_features} units, more than {width}")
    changes: list[Narrowed | Widened] = []

    def append(param: torch.Tensor, dim: int, new: torch.Tensor) -> None:
        before = param.shape
        _set(param, torch.cat([param, new.to(param.device, param.dtype)], dim=dim))
        changes.append(Widened(param, dim, added, before))

    if added == 0:
        return changes
    fan_in = h.incoming.in_features
    bound = 1 / math.sqrt(fan_in) if fan_in else 0.0

    def uniform(*shape: int) -> torch.Tensor:
        return (torch.rand(*shape, generator=generator) * 2 - 1) * bound

    append(h.incoming.weight, 0, uniform(added, fan_in))
    if h.incoming.bias is not None:
        append(h.incoming.bias, 0, uniform(added))
    if h.norm is not None:
        if h.norm.weight is not None and h.norm.bias is not None:
            append(h.norm.weight, 0, torch.ones(added))
            append(h.norm.bias, 0, torch.zeros(added))
        for name, fill in (("running_mean", 0.0), ("running_var", 1.0)):
            buffer = getattr(h.norm, name)
            if buffer is not None:
                setattr(h.norm, name, torch.cat([buffer, buffer.new_full((added,), fill)]))
        h.norm.num_features = width
    append(h.outgoing.weight, 1, torch.zeros(h.outgoing.out_features, added))
    h.incoming.out_features = h.outgoing.in_features = width
    return changes
