"""Fully sharded dense parameters (FSDP2, ``distributed.dense = "fsdp"``).

DDP keeps a whole copy of every dense weight, its gradient and its optimizer
state on every rank. ``apply_fsdp`` shards them instead: each parameter is cut
along its first dimension into one piece per rank (a ``DTensor`` with a
``Shard(0)`` placement), and the dense optimizer steps on the pieces::

    model                                    units, each all-gathered for its own
    ├── sparse          (sharded by plan,    forward and backward, then freed;
    │                    not touched here)   gradients reduce-scattered (averaged)
    ├── bottom  MLP       ── unit
    ├── layers  Sequential
    │   ├── 0  WukongLayer ── unit
    │   └── 1  WukongLayer ── unit
    ├── interaction / cross ── unit (when it has parameters)
    ├── top     MLP       ── unit
    └── (root: whatever dense parameters remain)

The units are the model's dense children; a plain container (exactly
``nn.Sequential`` or ``nn.ModuleList``: Wukong's stacked layers, DMT's towers)
gives its children instead. The embedding collections' parameters are passed
to every ``fully_shard`` as ignored: the sharding plan owns them, and their
fused optimizers update them inside backward.

Gradients are averaged over the ranks by the reduce-scatter, as DDP's
all-reduce averages them, so the two layouts train the same weights (to the
rounding of a different summation order). State-dict keys are those of the
unsharded model, so a ``torch.distributed.checkpoint`` saved under one layout
loads under the other.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from towerrec.distributed.mesh import new_group
from towerrec.modules.embedding_bag import dense_parameters, fused_embedding_modules

__all__ = [
    "DENSE_LAYOUTS",
    "DenseMemory",
    "apply_fsdp",
    "check_shardable",
    "dense_memory",
    "dense_mesh",
    "dense_units",
    "is_sharded",
]

DENSE_LAYOUTS = ("ddp", "fsdp")  # distributed.dense


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a piece of a sharded whole (a ``DTensor``)."""
    return isinstance(tensor, DTensor)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _has_dense_parameters(module: nn.Module, embedding: set[nn.Parameter]) -> bool:
    return any(p not in embedding for p in module.parameters())


def _embedding_parameters(model: nn.Module) -> set[nn.Parameter]:
    return {p for _, m in fused_embedding_modules(model) for p in m.parameters()}


def dense_units(model: nn.Module) -> list[nn.Module]:
    """The modules sharded one by one before ``model`` itself (module doc), in order."""
    embedding = _embedding_parameters(model)
    fused = {id(m) for _, m in fused_embedding_modules(model)}
    units: list[nn.Module] = []
    for child in model.children():
        if id(child) in fused:
            continue
        if type(child) in (nn.Sequential, nn.ModuleList):
            units.extend(c for c in child.children() if _has_dense_parameters(c, embedding))
        elif _has_dense_parameters(child, embedding):
            units.append(child)
    return units


def check_shardable(model: nn.Module) -> None:
    """Raise a ``ValueError`` when ``model`` has no dense parameters for FSDP to shard."""
    if not any(True for _ in dense_parameters(model)):
        raise ValueError(
            f"distributed.dense = 'fsdp' shards the dense parameters, but "
            f"{type(model).__name__} has none (only embedding tables, which the sharding plan "
            "shards); use distributed.dense = 'ddp'"
        )


def dense_mesh(mesh: DeviceMesh, group: dist.ProcessGroup | None = None) -> DeviceMesh:
    """A 1-D mesh over ``group`` (default: a new group of all ranks, so FSDP's
    collectives never interleave with the embeddings' or the trainer's), on ``mesh``'s
    device type."""
    if group is None:
        group = new_group(backend=dist.get_backend())
    return DeviceMesh.from_group(group, mesh.device_type)


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    per_layer: bool = True,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard ``model``'s dense parameters over the 1-D ``mesh``: every unit of
    ``dense_units`` (``per_layer``), then the model itself; embedding tables are left
    out. In place; returns ``model``. One rank: nothing to shard, the model is returned.

    ``per_layer=False`` makes ``model`` one unit: for a module whose forward reaches
    its children's weights without calling the children (``MLP`` does).
    ``reshard_after_forward=False`` keeps each unit's gathered weights from its forward
    to its backward (one all-gather per step instead of two, more memory in between)."""
    check_shardable(model)
    if mesh.ndim != 1:
        raise ValueError(f"apply_fsdp shards over a 1-D mesh, got {mesh.ndim} dimensions")
    if mesh.size() == 1:
        return model
    ignored = _embedding_parameters(model)
    for unit in dense_units(model) if per_layer else []:
        fully_shard(
            unit,
            mesh=mesh,
            ignored_params=ignored & set(unit.parameters()) or None,
            reshard_after_forward=reshard_after_forward,
        )
    fully_shard(model, mesh=mesh, ignored_params=ignored or None)
    return model


@dataclass(frozen=True)
class DenseMemory:
    """Bytes of the dense part that this rank holds between steps, counted from its
    tensors (the local pieces of sharded ones): weights, gradients, optimizer state."""

    parameters: int
    gradients: int
    optimizer_state: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(_local(t).numel() * t.element_size() for t in tensors)


def dense_memory(model: nn.Module, optimizer: torch.optim.Optimizer) -> DenseMemory:
    """``DenseMemory`` of ``model``'s dense parameters and ``optimizer``'s state on this
    rank (gradients as they are now: call after a backward, before ``zero_grad``)."""
    params = [p for _, p in dense_parameters(model)]
    grads = [p.grad for p in params if p.grad is not None]
    state = [
        v
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    ]
    return DenseMemory(_nbytes(params), _nbytes(grads), _nbytes(state))
