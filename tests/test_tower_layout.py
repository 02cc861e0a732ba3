"""The planner's in-host layout of a DMT tower's tables (``planner/tower_layout.py``)."""

import pytest

from towerrec.build.planning import plan_tower_layouts
from towerrec.build.sources import build_source
from towerrec.config import load_config
from towerrec.modules.tables import TableConfig
from towerrec.planner.cost import CostModel
from towerrec.planner.stats import TableStats
from towerrec.planner.topology import topology_preset
from towerrec.planner.tower_layout import choose_tower_layout
from towerrec.sharding import ShardingType


def _model(ranks: int = 2, hosts: int = 1) -> CostModel:
    return CostModel(topology_preset("cpu", hosts, ranks), batch_size=2048)


def _table(name: str, rows: int, pooling: float = 2.0) -> TableStats:
    return TableStats(name, rows, 16, pooling, pooling, pooling, pooling)


def test_even_tables_go_table_wise_and_balance():
    layout = choose_tower_layout([_table(n, 1000) for n in "abcd"], _model())
    assert layout.sharding is ShardingType.TABLE_WISE
    ranks = sorted(r for (r,) in layout.ranks.values())
    assert ranks == [0, 0, 1, 1]  # two tables per rank
    assert layout.imbalance == pytest.approx(1.0)
    assert layout.seconds["table_wise"] < layout.seconds["row_wise"]
    assert layout.as_dict()["sharding"] == "table_wise"


def test_one_dominant_table_goes_row_wise():
    """A table with 40x the lookups of the others: whole on one rank it is the step;
    split over the ranks, each pays half of it (and every table's partial sums)."""
    tables = [_table("big", 100_000, pooling=80.0), _table("a", 100), _table("b", 100)]
    layout = choose_tower_layout(tables, _model())
    assert layout.sharding is ShardingType.ROW_WISE
    assert layout.ranks == {"big": [0, 1], "a": [0, 1], "b": [0, 1]}
    assert layout.seconds["row_wise"] < layout.seconds["table_wise"]


def test_layout_inputs_are_checked():
    with pytest.raises(ValueError, match=r"at least one table"):
        choose_tower_layout([], _model())
    with pytest.raises(ValueError, match=r"inside one host; give a cost model of one host"):
        choose_tower_layout([_table("a", 10)], _model(hosts=2))


def test_plan_tower_layouts_on_the_default_data():
    """Every tower of the default synthetic data laid out from its measured statistics;
    a table of two features counts the lookups of both."""
    config = load_config(None, ["plan.stats_batches=1", "plan.stats_batch_size=256"])
    source = build_source(config.data)
    names = source.schema.sparse_names
    dim = config.model.embedding_dim
    rows = {f.name: f.num_embeddings for f in source.schema.sparse}
    towers = [
        [TableConfig(n, rows[n], dim) for n in names[:4]],
        [TableConfig("shared", max(rows[n] for n in names[4:6]), dim, tuple(names[4:6]))],
    ]
    layouts = plan_tower_layouts(config, source, towers, 2)
    assert [sorted(x.ranks) for x in layouts] == [sorted(names[:4]), ["shared"]]
    for layout in layouts:
        assert layout.seconds[layout.sharding.value] == min(layout.seconds.values())
    # one table alone: table-wise leaves a rank idle, row-wise splits it
    assert layouts[1].sharding is ShardingType.ROW_WISE
