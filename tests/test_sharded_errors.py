"""Plans that cannot run are refused with an error naming the fix (no process group needed:
building a sharded collection does no communication)."""

import pytest
import torch
from dist_cases import TABLES, local_slice, make_batch, plan_all

from towerrec.distributed.comm import Comm
from towerrec.distributed.embedding_bag import ShardedEmbeddingBagCollection
from towerrec.distributed.mesh import Topology
from towerrec.distributed.parallelize import uniform_plan
from towerrec.modules.embedding_bag import EmbeddingBagCollection
from towerrec.modules.tables import TableConfig
from towerrec.sharding import Shard, ShardingPlan, ShardingType, TablePlan, plan_table


def ebc(tables=TABLES, backend="torch"):
    return EmbeddingBagCollection(tables, backend=backend)


def test_plan_for_another_world_is_refused():
    plan = plan_all(ShardingType.ROW_WISE, Topology(4, 2))
    with pytest.raises(ValueError, match=r"plan is for 4 ranks on 2 hosts .* 2 ranks on 1 hosts"):
        ShardedEmbeddingBagCollection(ebc(), plan, Comm(Topology(2, 1)))


def test_table_row_wise_across_hosts_is_refused():
    topology = Topology(4, 2)
    plan = plan_all(ShardingType.TABLE_WISE, topology)
    t0 = TABLES[0]
    bad = dict(plan.tables)
    bad["t0"] = TablePlan(
        "t0",
        ShardingType.TABLE_ROW_WISE,
        (Shard(1, (0, 20), (0, t0.embedding_dim)), Shard(2, (20, 40), (0, t0.embedding_dim))),
    )
    with pytest.raises(ValueError, match="one host"):
        ShardedEmbeddingBagCollection(ebc(), ShardingPlan(4, 2, bad), Comm(topology))


def test_fbgemm_column_shard_width_must_be_a_multiple_of_4():
    tables = [TableConfig("a", 10, 8)]
    plan = ShardingPlan(4, 1, {"a": plan_table(tables[0], "column_wise", [0, 1, 2, 3])})
    with pytest.raises(ValueError, match=r"multiple of 4.*backend = 'torch'"):
        ShardedEmbeddingBagCollection(ebc(tables, "fbgemm"), plan, Comm(Topology(4, 1, 0)))


def test_ids_out_of_range_are_reported_before_sending():
    sharded = ShardedEmbeddingBagCollection(
        ebc(), uniform_plan(TABLES, Topology(1), "row_wise"), Comm(Topology(1))
    )
    batch = make_batch(0, 4)
    bad = type(batch)(batch.keys(), batch.values().clone(), batch.lengths())
    bad.values()[0] = 10_000
    with pytest.raises(ValueError, match=r"out of range.*id_policy"):
        sharded(bad)


@pytest.mark.parametrize("kind", list(ShardingType))
def test_one_rank_world_equals_unsharded(kind):
    reference = ebc()
    sharded = ShardedEmbeddingBagCollection(
        ebc(), uniform_plan(TABLES, Topology(1), kind), Comm(Topology(1))
    )
    batch = local_slice(make_batch(3, 5), 0, 1)
    torch.testing.assert_close(sharded(batch).values(), reference(batch).values())
