"""The sharding types' own logic, without a process group (``towerrec.sharding``)."""

import pytest
import torch

from towerrec.modules.tables import Pooling, TableConfig
from towerrec.sharding import STRATEGIES, TOWER_SHARDINGS, ShardingType, TablePlan, strategy_for
from towerrec.sharding.column_wise import row_statistic, row_statistic_part
from towerrec.sharding.data_parallel import local_rows
from towerrec.sharding.row_wise import bucketize, mean_divisor
from towerrec.sharding.table_row_wise import add_host_partials

TABLE = TableConfig("a", 10, 8)


def test_every_type_has_one_strategy_and_splits_as_it_says():
    assert set(STRATEGIES) == set(ShardingType)
    for kind, strategy in STRATEGIES.items():
        ranks = [0] if kind is ShardingType.TABLE_WISE else [0, 1]
        shards = strategy.split(TABLE, ranks)
        assert [s.rank for s in shards] == ranks
        assert len({s.rows for s in shards}) == (2 if strategy.splits_rows else 1)
        assert len({s.cols for s in shards}) == (2 if strategy.splits_cols else 1)
        assert strategy.problems(TABLE, TablePlan("a", kind, shards), 2, 2) == []
    assert set(TOWER_SHARDINGS) == {k for k, s in STRATEGIES.items() if not s.one_host}


def test_row_split_routes_each_id_to_its_range_keeping_bag_order():
    ids = torch.tensor([7, 1, 5, 9, 0])
    lengths = torch.tensor([3, 0, 2])  # bags [7, 1, 5], [], [9, 0]
    weights = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5])
    starts = torch.tensor([0, 5])
    buckets = strategy_for(ShardingType.ROW_WISE).route(
        ids, lengths, weights, starts, starts[1:], 3
    )
    again = bucketize(ids, lengths, weights, starts, starts[1:], 3)
    assert all(torch.equal(a, b) for x, y in zip(buckets, again) for a, b in zip(x, y))
    (n0, v0, w0), (n1, v1, w1) = buckets
    assert n0.tolist() == [1, 0, 1] and v0.tolist() == [1, 0]
    assert n1.tolist() == [2, 0, 1] and v1.tolist() == [2, 0, 4]  # 7, 5, 9 less 5
    assert w0.tolist() == pytest.approx([0.2, 0.5]) and w1.tolist() == pytest.approx(
        [0.1, 0.3, 0.4]
    )
    whole = strategy_for(ShardingType.COLUMN_WISE).route(
        ids, lengths, None, starts[:1], starts[1:1], 3
    )
    assert len(whole) == 1 and whole[0][1] is ids


def test_partial_outputs_combine():
    divisor = mean_divisor([(torch.tensor([0, 2, 4]), 1, 2)], 3, 4, torch.device("cpu"))
    assert divisor.tolist() == [[1, 1, 1, 1], [1, 2, 2, 1], [1, 4, 4, 1]]
    gathered = torch.arange(12.0)  # 2 ranks x 3 rows x 2 columns
    assert add_host_partials(gathered, 2, 3, 2).tolist() == [[6, 8], [10, 12], [14, 16]]
    grad = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
    parts = [row_statistic_part(grad), row_statistic_part(grad * 2)]
    assert row_statistic(parts, 4).tolist() == [25 / 4, 45 / 4]
    assert local_rows(torch.arange(6.0).view(3, 2), 1, 2).tolist() == [[2, 3], [4, 5]]
    row_wise = strategy_for(ShardingType.ROW_WISE)
    assert row_wise.shard_pooling(Pooling.MEAN, partial=True) is Pooling.SUM
    assert row_wise.shard_pooling(Pooling.MEAN, partial=False) is Pooling.MEAN


def test_table_row_wise_is_hierarchical_only_over_a_whole_host_of_several():
    kind = ShardingType.TABLE_ROW_WISE
    strategy = strategy_for(kind)
    whole_host = TablePlan("a", kind, strategy.split(TABLE, [2, 3]))
    assert strategy.hierarchical(whole_host, hosts=2, ranks_per_host=2)
    assert not strategy.hierarchical(whole_host, hosts=1, ranks_per_host=4)
    part = TablePlan("a", kind, strategy.split(TABLE, [2]))
    assert not strategy.hierarchical(part, hosts=2, ranks_per_host=2)
    across = TablePlan("a", kind, strategy.split(TABLE, [1, 2]))
    assert "one host" in strategy.problems(TABLE, across, 4, 2)[0]
