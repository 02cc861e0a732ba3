"""``build_run(config, ...)``: what a run is built from, in one place.

::

    config ──► source (build_source, or the caller's: a period stream, a resolved run's)
           ──► config with ``auto`` settings resolved by measurement (choices.py: the
               embedding kernel, the dense part's precision)
           ──► config with a DMT's learned partition resolved (towers.py: a pilot run)
           ──► model (models.py: MODELS, the distillation heads; full tables only when
               one process holds them)
           ──► laid out over the ranks (the caller's RunLayout: sharded tables, DDP or
               FSDP, the tower transform), when there are several
           ──► dense optimizer (optimizers.py; Shampoo's blocks dealt over the ranks)

Every place that trains starts here: the engine's session (``towerrec.train.session``),
replay, the PU prior's classifiers, the architecture search and export. The DMT pilot
(``towers.py``) builds its DLRM from the same parts without the partition step, which
is what calls it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, overload

import torch
from torch import nn

from towerrec.build.choices import resolve_choices
from towerrec.build.models import build_model
from towerrec.build.optimizers import DENSE_OPTIMIZERS, build_dense_optimizer
from towerrec.build.resolve import resolve_device
from towerrec.build.sources import build_source
from towerrec.build.towers import with_learned_partition
from towerrec.config import Config
from towerrec.data.batch import DataSchema
from towerrec.data.source import DataSource
from towerrec.optim.shampoo import BlockExchange

__all__ = ["BuiltRun", "ModelFactory", "RunLayout", "build_run"]


class HasSchema(Protocol):
    @property
    def schema(self) -> DataSchema: ...


S = TypeVar("S", bound=HasSchema)


class RunLayout(Protocol):
    """How the run's processes hold the model (``RunContext``, ``train/distributed.py``)."""

    @property
    def world_size(self) -> int: ...

    def parallelize(self, model: nn.Module, config: Config, source: Any) -> nn.Module:
        """``model`` laid out over the ranks as ``config`` says (one rank: itself)."""
        ...

    def block_exchange(self, model: nn.Module) -> tuple[BlockExchange | None, list[nn.Parameter]]:
        """For an optimizer that deals blocks over the ranks: the exchange, and the
        parameters replicated over fewer ranks (a collective: every rank calls it)."""
        ...


class ModelFactory(Protocol):
    """Builds the single-device model (``models.build_model``, or a search's supernet)."""

    def __call__(
        self,
        config: Config,
        schema: DataSchema,
        device: torch.device,
        *,
        materialize_embeddings: bool = True,
    ) -> nn.Module: ...


@dataclass
class BuiltRun(Generic[S]):
    """A run's parts: ``config`` as the model was built from it (``auto`` settings
    resolved, a DMT's learned partition filled in), its data ``source``, the ``device``,
    the ``model`` (laid out over the ranks) and its dense ``optimizer``."""

    config: Config
    source: S
    device: torch.device
    model: nn.Module
    optimizer: torch.optim.Optimizer

    @property
    def schema(self) -> DataSchema:
        return self.source.schema


@overload
def build_run(
    config: Config,
    *,
    source: None = None,
    device: torch.device | None = None,
    layout: RunLayout | None = None,
    model: ModelFactory = build_model,
) -> BuiltRun[DataSource]: ...


@overload
def build_run(
    config: Config,
    *,
    source: S,
    device: torch.device | None = None,
    layout: RunLayout | None = None,
    model: ModelFactory = build_model,
) -> BuiltRun[S]: ...


def build_run(
    config: Config,
    *,
    source: Any = None,
    device: torch.device | None = None,
    layout: RunLayout | None = None,
    model: ModelFactory = build_model,
) -> BuiltRun[Any]:
    """The parts of a run of ``config`` (module doc). ``source``: the data (default:
    ``build_source(config.data)``); ``device``: default ``train.device`` resolved;
    ``layout``: the processes of a distributed run (default: this one alone);
    ``model``: what builds the single-device model (default ``build_model``)."""
    device = device if device is not None else resolve_device(config.train.device)
    source = source if source is not None else build_source(config.data)
    world_size = layout.world_size if layout is not None else 1
    config, _ = resolve_choices(config, source.schema, device, world_size)
    config = with_learned_partition(config, source.schema)
    built = model(config, source.schema, device, materialize_embeddings=world_size == 1)
    exchange: BlockExchange | None = None
    local: list[nn.Parameter] = []
    if layout is not None:
        built = layout.parallelize(built, config, source)
        if DENSE_OPTIMIZERS[config.optimizer.name].blocks:
            exchange, local = layout.block_exchange(built)
    optimizer = build_dense_optimizer(config.optimizer, built, exchange, local)
    return BuiltRun(config, source, device, built, optimizer)
