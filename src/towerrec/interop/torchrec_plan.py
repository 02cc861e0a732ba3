"""Sharding plans to and from TorchRec (``torchrec`` is optional).

::

    towerrec ShardingPlan ──to_torchrec_plan──►  torchrec ShardingPlan
      tables[name]                                 plan[module_path][name] = ParameterSharding(
        sharding, shards[(rank, rows, cols)]         sharding_type, compute_kernel, ranks,
                     ◄──from_torchrec_plan──         EnumerableShardingSpec[ShardMetadata(
                                                       offsets, sizes, "rank:r/device")])

The geometry is the same on both sides (row and column offsets and sizes per
shard); TorchRec wants shards in table order (row-wise by row offset,
column-wise by column offset), which is the order towerrec keeps them in.
"""

from __future__ import annotations

from collections.abc import Sequence

from towerrec.modules.tables import TableConfig
from towerrec.sharding import Shard, ShardingPlan, ShardingType, TablePlan

__all__ = ["from_torchrec_plan", "to_torchrec_plan"]


def _order(tp: TablePlan) -> list[Shard]:
    return sorted(tp.shards, key=lambda s: (s.rows[0], s.cols[0], s.rank))


def to_torchrec_plan(
    plan: ShardingPlan,
    tables: Sequence[TableConfig],
    module_path: str = "",
    device: str = "cpu",
    compute_kernel: str = "fused",
):
    """TorchRec's ``ShardingPlan`` for an ``EmbeddingBagCollection`` at ``module_path``
    holding ``tables`` (validated against ``plan`` first)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
    from torchrec.distributed.types import (
        EmbeddingModuleShardingPlan,
        ParameterSharding,
    )
    from torchrec.distributed.types import ShardingPlan as TorchrecPlan

    plan.validate(tables)
    module_plan = EmbeddingModuleShardingPlan()
    for name, tp in plan.tables.items():
        shards = _order(tp)
        if tp.sharding is ShardingType.DATA_PARALLEL:
            module_plan[name] = ParameterSharding(
                sharding_type=tp.sharding.value,
                compute_kernel="dense",
                ranks=[s.rank for s in shards],
            )
            continue
        spec = EnumerableShardingSpec(
            [
                ShardMetadata(
                    shard_offsets=[s.rows[0], s.cols[0]],
                    shard_sizes=[s.num_rows, s.num_cols],
                    placement=f"rank:{s.rank}/{device}",
                )
                for s in shards
            ]
        )
        module_plan[name] = ParameterSharding(
            sharding_type=tp.sharding.value,
            compute_kernel=compute_kernel,
            ranks=[s.rank for s in shards],
            sharding_spec=spec,
        )
    return TorchrecPlan({module_path: module_plan})


def from_torchrec_plan(torchrec_plan, module_path: str, world_size: int, hosts: int = 1):
    """towerrec's plan of the tables of the module at ``module_path``."""
    if module_path not in torchrec_plan.plan:
        raise ValueError(
            f"TorchRec plan has no module {module_path!r}; it plans {sorted(torchrec_plan.plan)}"
        )
    tables = {}
    for name, ps in torchrec_plan.plan[module_path].items():
        kind = ShardingType(ps.sharding_type)
        if kind is ShardingType.DATA_PARALLEL or ps.sharding_spec is None:
            raise ValueError(
                f"table {name!r}: TorchRec {ps.sharding_type} sharding has no shard geometry; "
                "convert plans with explicit shards only"
            )
        shards = []
        for meta in ps.sharding_spec.shards:
            (r0, c0), (nr, nc) = meta.shard_offsets, meta.shard_sizes
            shards.append(Shard(meta.placement.rank(), (r0, r0 + nr), (c0, c0 + nc)))
        tables[name] = TablePlan(name, kind, tuple(shards))
    return ShardingPlan(world_size, hosts, tables)
