"""``parallelize(model, mesh, plan)``: hybrid parallelism applied from outside the model.

Steps, in order:

1. ``apply_sharding``: every fused embedding collection (``EmbeddingBagCollection``)
   is replaced by its ``ShardedEmbeddingBagCollection`` under ``plan``, talking
   over its own process group (so its all-to-alls never interleave with DDP's
   all-reduces);
2. ``apply_ddp``: the dense parameters are replicated with DDP (composable
   ``replicate``: module names and state-dict keys stay as they were); or, with
   ``dense="fsdp"``, ``apply_fsdp`` shards them per layer (FSDP2, ``fsdp.py``).

Gradients reaching the embeddings are scaled by 1/world so that, like DDP's
averaged dense gradients, the parallel model trained on a global batch split
over the ranks follows the single-process model trained on that global batch.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from typing import Any, cast

import torch.distributed as dist
from torch import nn
from torch.distributed._composable import replicate
from torch.distributed._composable.replicate import DDP
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from towerrec.distributed.comm import Comm, CommCodecs, CommStats
from towerrec.distributed.dense_allreduce import (
    HierarchicalGroups,
    dense_allreduce_hook,
    uses_hierarchical,
)
from towerrec.distributed.embedding_bag import ShardedEmbeddingBagCollection
from towerrec.distributed.fsdp import DENSE_LAYOUTS, apply_fsdp, dense_mesh
from towerrec.distributed.id_wire import IdWire
from towerrec.distributed.mesh import Topology, new_group
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
    "check_dense_allreduce",
    "comm_stats",
    "dense_groups",
    "parallelize",
    "rebuild_ddp",
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
    id_wire: IdWire | None = None,
) -> nn.Module:
    """Replace every ``EmbeddingBagCollection`` of ``model`` by its sharded twin (in place);
    ``id_wire``: how its ids travel (``id_wire.py``)."""
    comm = Comm(topology, group, stats)
    found = [
        (n, m) for n, m in fused_embedding_modules(model) if isinstance(m, EmbeddingBagCollection)
    ]
    if not found:
        raise ValueError("the model has no EmbeddingBagCollection to shard")
    for name, module in found:
        sharded = ShardedEmbeddingBagCollection(
            module,
            plan,
            comm,
            codecs=codecs,
            grad_scale=1.0 / topology.world_size,
            id_wire=id_wire,
        )
        if not name:
            return sharded
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, sharded)
    return model


def apply_ddp(
    model: nn.Module,
    topology: Topology,
    dense_stats: CommStats | None = None,
    dense_allreduce: str = "ring",
) -> nn.Module:
    """Replicate the dense parameters with DDP (gradients averaged over ranks, by
    ``dense_allreduce``: ``dense_allreduce.py``); the gradient all-reduces' bytes go to
    ``dense_stats`` when given."""
    if topology.world_size > 1 and any(True for _ in dense_parameters(model)):
        groups = dense_groups(topology, dense_allreduce)
        replicate_counted(
            model, topology, dense_stats, dense_allreduce=dense_allreduce, groups=groups
        )
    return model


def dense_groups(topology: Topology, dense_allreduce: str) -> HierarchicalGroups | None:
    """The process groups of a hierarchical dense all-reduce on ``topology`` (a
    collective: every rank calls it), or None where it runs as the ring."""
    if uses_hierarchical(dense_allreduce, topology):
        return HierarchicalGroups.build(topology)
    return None


def replicate_counted(
    module: nn.Module,
    topology: Topology,
    dense_stats: CommStats | None,
    group: dist.ProcessGroup | None = None,
    *,
    dense_allreduce: str = "ring",
    groups: HierarchicalGroups | None = None,
    ignored_modules: list[nn.Module] | None = None,
) -> None:
    """DDP (composable ``replicate``) over ``group``, its all-reduces counted in
    ``dense_stats`` when given; ``dense_allreduce`` (``dense_allreduce.py``) applies over
    the world (``group`` None) with ``groups`` from ``dense_groups``. The parameters of
    ``ignored_modules`` are left out (e.g. layers replicated over a group of their own)."""
    kwargs: dict[str, Any] = {"ignored_modules": ignored_modules} if ignored_modules else {}
    if group is not None:
        kwargs["process_group"] = group
    replicate(module, **kwargs)
    hierarchical = group is None and groups is not None
    if dense_stats is not None or hierarchical:
        stats = dense_stats if dense_stats is not None else CommStats()
        kind = dense_allreduce if hierarchical else "ring"
        # replicate() gave the module DDP's register_comm_hook (applied at its first forward)
        cast(Any, module).register_comm_hook(
            None, dense_allreduce_hook(kind, topology, stats, group, groups)
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
    dense: str = "ddp",
    reshard_after_forward: bool = True,
    id_wire: IdWire | None = None,
    replicate_dense: bool = True,
    dense_allreduce: str = "ring",
) -> nn.Module:
    """Shard the embeddings by ``plan`` and replicate (``dense="ddp"``) or shard
    (``"fsdp"``, ``apply_fsdp`` with ``reshard_after_forward``) the dense layers (module
    doc); ``dense_stats`` counts the DDP gradient all-reduces' bytes. ``replicate_dense =
    False`` leaves the dense layers as they are, for a dense optimizer that sums its
    ranks' gradients itself (``optim/pb_lbfgs.py``, ``optim/dance.py``).
    ``dense_allreduce``: DDP's gradient all-reduce, ``ring`` or ``hierarchical``
    (``dense_allreduce.py``; FSDP ignores it)."""
    check_dense_allreduce(dense, dense_allreduce)
    if dense not in DENSE_LAYOUTS:
        raise ValueError(f"dense = {dense!r} is not one of {', '.join(map(repr, DENSE_LAYOUTS))}")
    topology = topology_of(mesh)
    group = new_group(backend=dist.get_backend()) if topology.world_size > 1 else None
    model = apply_sharding(
        model, topology, plan, codecs=codecs, stats=CommStats(), group=group, id_wire=id_wire
    )
    if not replicate_dense:
        return model
    if dense == "fsdp" and topology.world_size > 1:
        return apply_fsdp(model, dense_mesh(mesh), reshard_after_forward=reshard_after_forward)
    return apply_ddp(model, topology, dense_stats, dense_allreduce)


def check_dense_allreduce(dense: str, dense_allreduce: str) -> None:
    """Raise ``ValueError`` for an unknown dense all-reduce (``dense = "fsdp"`` reduce-
    scatters the gradients itself and ignores it)."""
    uses_hierarchical(dense_allreduce, Topology(1))  # names the choices when unknown


def rebuild_ddp(model: nn.Module) -> None:
    """A new DDP for every replicated module of ``model`` after dense parameters changed
    shape in place (``param.data`` swapped, as growth and pruning do): DDP sizes its
    gradient buckets when it is built. Same parameters, process group and communication
    hook; the old reducer's autograd hooks are removed. A collective: every rank calls
    it at the same step. A module whose DDP is not built yet (``replicate`` builds it at
    the first forward) is left as it is. Composable ``replicate`` has no public way to
    rebuild, so this reaches into its state (``_ddp``, ``_param_list``) and DDP's
    ``_comm_hooks``; tests/test_prune_grow.py checks two ranks against one process."""
    for module in model.modules():
        if not isinstance(module, DDP):
            continue
        state = replicate.state(module)
        if not state.has_initialized:
            continue
        old = state._ddp
        group, hooks = old.process_group, list(old._comm_hooks)
        old._remove_autograd_hooks()
        # The old reducer holds the parameters' gradient accumulators, which remember the
        # old shapes; it must be gone before the new DDP looks them up afresh.
        del state._ddp, old
        gc.collect()
        ddp = DistributedDataParallel(state._param_list, process_group=group)
        for hook, hook_state in hooks:
            ddp.register_comm_hook(hook_state, hook)
        state._ddp = ddp
