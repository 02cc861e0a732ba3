"""``parallelize(model, mesh, plan)``: hybrid parallelism applied from outside the model.

Steps, in order:

1. ``apply_sharding``: every fused embedding collection (``EmbeddingBagCollection``)
   is replaced by its ``ShardedEmbeddingBagCollection`` under ``plan``, talking
   over its own process group (so its all-to-alls never interleave with DDP's
   all-reduces);
2. ``apply_ddp``: the dense parameters are replicated with DDP (composable
   ``replicate``: module names and state-dict keys stay as they were).

Gradients reaching the embeddings are scaled by 1/world so that, like DDP's
averaged dense gradients, the parallel model trained on a global batch split
over the ranks follows the single-process model trained on that global batch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch.distributed as dist
from torch import nn
from torch.distributed._composable import replicate
from torch.distributed.device_mesh import DeviceMesh

from towerrec.distributed.comm import Comm, CommCodecs, CommStats, ring_allreduce_hook
from towerrec.distributed.embedding_bag import ShardedEmbeddingBagCollection
from towerrec.distributed.mesh import Topology
from towerrec.modules.embedding_bag import (
    EmbeddingBagCollection,
    dense_parameters,
    fused_embedding_modules,
)
from towerrec.modules.tables import TableConfig
from towerrec.sharding import ShardingPlan, ShardingType, TablePlan, plan_table, strategy_for

__all__ = [
    "apply_ddp",
    "apply_sharding",
    "comm_stats",
    "parallelize",
    "replicate_counted",
    "topology_of",
    "uniform_plan",
]


def topology_of(mesh: DeviceMesh) -> Topology:
    """The hosts x local topology of a 2-D (host, local) mesh, for this rank."""
    if mesh.ndim != 2:
        raise ValueError(f"expected a 2-D (host, local) mesh, got {mesh.ndim} dimensions")
    return Topology(mesh.size(), mesh.size(0), dist.get_rank())


def uniform_plan(
    tables: Iterable[TableConfig], topology: Topology, sharding: ShardingType | str
) -> ShardingPlan:
    """Every table sharded as ``sharding``: table-wise tables placed largest first on the
    least-loaded rank; table-row/column-wise tables on hosts in turn."""
    sharding = ShardingType(sharding)
    tables = list(tables)
    world = topology.world_size
    placements: dict[str, TablePlan] = {}
    load = [0] * world
    for i, table in enumerate(sorted(tables, key=lambda t: -t.num_parameters)):
        if sharding is ShardingType.TABLE_WISE:
            rank = min(range(world), key=lambda r: (load[r], r))
            load[rank] += table.num_parameters
            ranks = [rank]
        elif strategy_for(sharding).one_host:
            ranks = topology.host_ranks(i % topology.hosts)
        else:
            ranks = list(range(world))
        placements[table.name] = plan_table(table, sharding, ranks)
    ordered = {t.name: placements[t.name] for t in tables}
    return ShardingPlan(world, topology.hosts, ordered)


def apply_sharding(
    model: nn.Module,
    topology: Topology,
    plan: ShardingPlan,
    *,
    codecs: CommCodecs | None = None,
    stats: CommStats | None = None,
    group: dist.ProcessGroup | None = None,
) -> nn.Module:
    """Replace every ``EmbeddingBagCollection`` of ``model`` by its sharded twin (in place)."""
    comm = Comm(topology, group, stats)
    found = [
        (n, m) for n, m in fused_embedding_modules(model) if isinstance(m, EmbeddingBagCollection)
    ]
    if not found:
        raise ValueError("the model has no EmbeddingBagCollection to shard")
    for name, module in found:
        sharded = ShardedEmbeddingBagCollection(
            module, plan, comm, codecs=codecs, grad_scale=1.0 / topology.world_size
        )
        if not name:
            return sharded
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, sharded)
    return model


def apply_ddp(
    model: nn.Module, topology: Topology, dense_stats: CommStats | None = None
) -> nn.Module:
    """Replicate the dense parameters with DDP (gradients averaged over ranks); the
    gradient all-reduces' bytes go to ``dense_stats`` when given."""
    if topology.world_size > 1 and any(True for _ in dense_parameters(model)):
        replicate_counted(model, topology, dense_stats)
    return model


def replicate_counted(
    module: nn.Module,
    topology: Topology,
    dense_stats: CommStats | None,
    group: dist.ProcessGroup | None = None,
) -> None:
    """DDP (composable ``replicate``) over ``group``, its all-reduces counted in
    ``dense_stats`` (``ring_allreduce_hook``) when given."""
    replicate(module, process_group=group) if group is not None else replicate(module)
    if dense_stats is not None:
        # replicate() gave the module DDP's register_comm_hook (applied at its first forward)
        cast(Any, module).register_comm_hook(
            None, ring_allreduce_hook(topology, dense_stats, group)
        )


def comm_stats(model: nn.Module) -> CommStats:
    """The byte counters of a parallelized model's embedding collectives."""
    for _, module in fused_embedding_modules(model):
        if isinstance(module, ShardedEmbeddingBagCollection):
            return module.comm.stats
    raise ValueError("the model is not parallelized (no sharded embedding collection)")


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    plan: ShardingPlan,
    *,
    codecs: CommCodecs | None = None,
    dense_stats: CommStats | None = None,
    replicate_dense: bool = True,
) -> nn.Module:
    """Shard the embeddings by ``plan`` and replicate the dense layers (module doc);
    ``dense_stats`` counts the dense gradient all-reduces' bytes. ``replicate_dense =
    False`` leaves the dense layers without DDP, for a dense optimizer that sums its
    ranks' gradients itself (``optim/pb_lbfgs.py``, ``optim/dance.py``)."""
    topology = topology_of(mesh)
    group = dist.new_group(backend=dist.get_backend()) if topology.world_size > 1 else None
    model = apply_sharding(model, topology, plan, codecs=codecs, stats=CommStats(), group=group)
    return apply_ddp(model, topology, dense_stats) if replicate_dense else model
