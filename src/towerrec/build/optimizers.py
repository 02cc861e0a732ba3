"""The dense parameters' optimizer from ``[optimizer]``: ``DENSE_OPTIMIZERS``, one entry
per ``optimizer.name``.

The embedding rows have their own optimizer, fused into the lookup's backward
(``embedding.optimizer``); this is the one of the MLPs, interactions and towers. Where
every parameter is a CPU or CUDA float tensor, torch's fused kernel steps them all at
once (Adam's step without torch's per-step Python where it can, ``optim/adam.py``);
sharded parameters (``distributed.dense = "fsdp"``) are fused by Adam only, and a mix of
sharded and whole ones steps tensor by tensor. The distillation adapter gets a
parameter group of its own at ``distill.adapter_lr`` (``split_adapter_group``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from towerrec.config import OptimizerConfig
from towerrec.distributed.fsdp import is_sharded
from towerrec.distributed.sum_reduce import GroupReducer
from towerrec.models.distill_heads import distill_heads
from towerrec.modules.embedding_bag import dense_parameters
from towerrec.optim.adam import Adam
from towerrec.optim.dance import Dance
from towerrec.optim.pb_lbfgs import ProgressiveBatchLBFGS
from towerrec.optim.shampoo import BlockExchange, Shampoo

__all__ = [
    "DENSE_OPTIMIZERS",
    "DenseOptimizerEntry",
    "build_dense_optimizer",
    "split_adapter_group",
]


@dataclass(frozen=True)
class Kernel:
    """How torch's optimizer runs over the parameters: ``fused`` (None: torch's choice)
    and ``foreach`` (False: tensor by tensor; None: torch's choice)."""

    fused: bool | None
    foreach: bool | None


@dataclass(frozen=True)
class Placement:
    """Where the optimizer's blocks live: Shampoo deals its blocks over ``exchange``'s
    ranks, and computes those of ``local`` (parameters replicated over fewer ranks)
    itself on every rank."""

    exchange: BlockExchange | None
    local: Iterable[torch.Tensor]


# (optimizer config, the dense parameters, kernel, placement) -> the optimizer
Builder = Callable[[OptimizerConfig, list[nn.Parameter], Kernel, Placement], torch.optim.Optimizer]


@dataclass(frozen=True)
class DenseOptimizerEntry:
    """One ``optimizer.name``: its builder; ``fuses_sharded``: torch fuses it over
    sharded parameters too; ``blocks``: it preconditions whole parameter blocks, dealt
    over the ranks by a block exchange (so it needs whole parameters: no FSDP)."""

    build: Builder
    fuses_sharded: bool = False
    blocks: bool = False


def _adam(config: OptimizerConfig, params, kernel: Kernel, _: Placement):
    return Adam(  # weight decay decoupled from the gradient, as AdamW; optim/adam.py
        params,
        lr=config.lr,
        weight_decay=config.weight_decay,
        decoupled_weight_decay=True,
        fused=kernel.fused,
        foreach=kernel.foreach,
    )


def _adagrad(config: OptimizerConfig, params, kernel: Kernel, _: Placement):
    return torch.optim.Adagrad(
        params,
        lr=config.lr,
        weight_decay=config.weight_decay,
        fused=kernel.fused,
        foreach=kernel.foreach,
    )


def _sgd(config: OptimizerConfig, params, kernel: Kernel, _: Placement):
    return torch.optim.SGD(
        params,
        lr=config.lr,
        momentum=config.momentum,
        weight_decay=config.weight_decay,
        fused=kernel.fused,
        foreach=kernel.foreach,
    )


def _shampoo(config: OptimizerConfig, params, _: Kernel, placement: Placement):
    return Shampoo(
        params,
        lr=config.lr,
        settings=config.shampoo,
        weight_decay=config.weight_decay,
        exchange=placement.exchange,
        local=placement.local,
    )


def _reducer() -> GroupReducer | None:
    """The optimizers that draw their own samples sum their evaluations over the ranks
    themselves (``distributed/sum_reduce.py``)."""
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    return GroupReducer() if distributed else None


def _pb_lbfgs(config: OptimizerConfig, params, _: Kernel, __: Placement):
    return ProgressiveBatchLBFGS(params, lr=config.lr, settings=config.pb_lbfgs, reducer=_reducer())


def _dance(config: OptimizerConfig, params, _: Kernel, __: Placement):
    return Dance(params, lr=config.lr, settings=config.dance, reducer=_reducer())


DENSE_OPTIMIZERS: dict[str, DenseOptimizerEntry] = {
    "adam": DenseOptimizerEntry(_adam, fuses_sharded=True),
    "adagrad": DenseOptimizerEntry(_adagrad),
    "sgd": DenseOptimizerEntry(_sgd),
    "shampoo": DenseOptimizerEntry(_shampoo, blocks=True),
    "pb_lbfgs": DenseOptimizerEntry(_pb_lbfgs),
    "dance": DenseOptimizerEntry(_dance),
}


def build_dense_optimizer(
    config: OptimizerConfig,
    model: nn.Module,
    exchange: BlockExchange | None = None,
    local: Iterable[torch.Tensor] = (),
) -> torch.optim.Optimizer:
    """The dense parameters' optimizer. Shampoo with an ``exchange`` deals its blocks over
    the exchange's ranks (``optim/shampoo.py``); ``local``: parameters replicated over
    fewer ranks, whose blocks every rank computes itself."""
    entry = DENSE_OPTIMIZERS[config.name]
    params = [p for _, p in dense_parameters(model) if p.requires_grad]
    sharded = sum(is_sharded(p) for p in params)  # distributed.dense = "fsdp"
    # Sharded and whole parameters together (a DMT's tower on a host of one rank) cannot
    # share a multi-tensor kernel: the optimizer then steps tensor by tensor.
    mixed = 0 < sharded < len(params)
    # One fused kernel over all parameters instead of a few ops per tensor (CPU, CUDA);
    # on sharded parameters torch fuses Adam only (Adagrad, SGD: multi-tensor kernels).
    fused = (
        bool(params)
        and all(p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point for p in params)
        and (entry.fuses_sharded or not sharded)
        and not mixed
    )
    if sharded and entry.blocks:
        raise ValueError(
            f"optimizer.name = {config.name!r} preconditions whole parameter blocks, but "
            "distributed.dense = 'fsdp' leaves each rank a piece of every parameter; use "
            "distributed.dense = 'ddp' with Shampoo (its blocks are dealt over the ranks), "
            "or adam, adagrad or sgd with fsdp"
        )
    kernel = Kernel(fused=fused or None, foreach=False if mixed else None)
    optimizer = entry.build(config, params, kernel, Placement(exchange, local))
    split_adapter_group(optimizer, model)  # the distillation adapter's own learning rate
    return optimizer


def split_adapter_group(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Move the distillation adapter's parameters into a param group of their own at
    ``distill.adapter_lr`` (its ``base_lr``, which ``set_learning_rates`` scales); called
    by ``build_dense_optimizer`` before any step."""
    heads = distill_heads(model)
    if heads is None or heads.adapter is None:
        return
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.Adagrad | torch.optim.SGD):
        raise ValueError(
            f"distill.adapter trains at its own learning rate in a parameter group of its "
            f"own, which {type(optimizer).__name__} does not take; use optimizer.name = "
            "adam, adagrad or sgd"
        )
    lr = heads.adapter_lr
    mine = {id(p) for p in heads.adapter.parameters()}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) not in mine]
    optimizer.add_param_group({"params": list(heads.adapter.parameters()), "lr": lr, "base_lr": lr})
