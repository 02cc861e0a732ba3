import pytest

from towerrec.modules.tables import TableConfig
from towerrec.sharding import (
    Shard,
    ShardingPlan,
    ShardingType,
    TablePlan,
    even_splits,
    plan_table,
)

TABLES = [TableConfig("a", 10, 8), TableConfig("b", 7, 4), TableConfig("c", 5, 6)]


def test_even_splits():
    assert even_splits(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert even_splits(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]


def test_valid_mixed_plan_roundtrips_through_json(tmp_path):
    plan = ShardingPlan(
        4,
        hosts=2,
        tables={
            "a": plan_table(TABLES[0], "row_wise", [0, 1, 2, 3]),
            "b": plan_table(TABLES[1], "table_row_wise", [2, 3]),
            "c": plan_table(TABLES[2], "column_wise", [1, 3]),
        },
    )
    plan.validate(TABLES)
    plan.save(tmp_path / "plan.json")
    again = ShardingPlan.load(tmp_path / "plan.json")
    assert again == plan
    assert [name for name, _ in again.shards_on(3)] == ["a", "b", "c"]
    assert again.host_of(2) == 1


@pytest.mark.parametrize(
    "table_plans, match",
    [
        (
            {
                "a": plan_table(TABLES[0], "table_wise", [0]),
                "b": plan_table(TABLES[1], "table_wise", [1]),
            },
            r"no placement for tables \['c'\]",
        ),
        (
            {
                "a": TablePlan(
                    "a",
                    ShardingType.ROW_WISE,
                    (Shard(0, (0, 4), (0, 8)), Shard(1, (5, 10), (0, 8))),
                )
            },
            "gap or overlap at row 4",
        ),
        (
            {
                "a": TablePlan(
                    "a", ShardingType.ROW_WISE, (Shard(0, (0, 4), (0, 8)), Shard(1, (4, 9), (0, 8)))
                )
            },
            "shards end at 9, the table has 10",
        ),
        (
            {
                "a": TablePlan(
                    "a",
                    ShardingType.COLUMN_WISE,
                    (Shard(0, (0, 10), (0, 4)), Shard(0, (0, 10), (4, 8))),
                )
            },
            "a rank holds two shards",
        ),
        (
            {"a": plan_table(TABLES[0], "table_row_wise", [1, 2])},
            "must all be on one host, got hosts",
        ),
        ({"a": plan_table(TABLES[0], "table_wise", [4])}, "rank 4 outside world of 4"),
        (
            {"a": TablePlan("a", ShardingType.DATA_PARALLEL, (Shard(0, (0, 10), (0, 8)),))},
            "full replica on each",
        ),
        (
            {"a": TablePlan("a", ShardingType.TABLE_WISE, (Shard(0, (0, 11), (0, 8)),))},
            "outside the table's 10x8",
        ),
    ],
)
def test_invalid_plans_are_named(table_plans, match):
    full = {t.name: plan_table(t, "table_wise", [0]) for t in TABLES}
    if "no placement" not in match:
        full.update(table_plans)
        table_plans = full
    with pytest.raises(ValueError, match=match):
        ShardingPlan(4, hosts=2, tables=table_plans).validate(TABLES)


def test_malformed_json(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{"world_size": 2, "tables": {"a": {"shards": []}}}')
    with pytest.raises(ValueError, match="malformed sharding plan"):
        ShardingPlan.load(path)
    path.write_text("{nope")
    with pytest.raises(ValueError, match="not valid JSON"):
        ShardingPlan.load(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ShardingPlan.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="multiple of hosts"):
        ShardingPlan(3, hosts=2)
