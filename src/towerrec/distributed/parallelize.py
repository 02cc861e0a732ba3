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

import torch.distributed as dist
from torch import nn
from torch.distributed._composable import replicate
from torch.distributed.device_mesh import DeviceMesh

from towerrec.distributed.comm import Comm, CommCodecs, CommStats
from towerrec.distributed.embedding_bag import ShardedEmbeddingBagCollection
from towerrec.distributed.mesh import Topology
from towerrec.modules.embedding_bag import (
    EmbeddingBagCollection,
    dense_parameters,
    fused_embedding_modules,
)
from towerrec.modules.tables import TableConfig
from towerrec.planner.plan import ShardingPlan, ShardingType, TablePlan, plan_table

__all__ = [
    "apply_ddp",
    "apply_sharding",
    "comm_stats",
    "parallelize",
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
        elif sharding in (ShardingType.TABLE_ROW_WISE, ShardingType.TABLE_COLUMN_WISE):
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


def apply_ddp(model: nn.Module) -> nn.Module:
    """Replicate the dense parameters with DDP (gradients averaged over ranks)."""
    if dist.get_world_size() > 1 and any(True for _ in dense_parameters(model)):
        replicate(model)
    return model


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
) -> nn.Module:
    """Shard the embeddings by ``plan`` and replicate the dense layers (module doc)."""
    topology = topology_of(mesh)
    group = dist.new_group(backend=dist.get_backend()) if topology.world_size > 1 else None
    model = apply_sharding(model, topology, plan, codecs=codecs, stats=CommStats(), group=group)
    return apply_ddp(model)
