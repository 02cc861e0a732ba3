"""The sharding plan: where every piece of every embedding table lives.

A plan is pure data (JSON in, JSON out): planners produce it, the sharded
embedding collection consumes it. For a world of ``world_size`` ranks on
``hosts`` hosts (ranks ``h*L .. h*L+L-1`` on host h, L = world_size / hosts)::

    table_wise          one shard = the whole table, on one rank
    row_wise            row ranges [r0, r1) x all columns, one per rank, over all ranks
    column_wise         all rows x column ranges [c0, c1), one per rank
    table_row_wise      row ranges over the ranks of ONE host (reduce inside the host)
    table_column_wise   column ranges over the ranks of ONE host
    data_parallel       a full replica on every rank (gradients all-reduced)

Shards of one table must tile it exactly (no gap, no overlap), except
data_parallel, whose shards are identical full replicas on every rank. Each
type's split and rules are in its own file (``row_wise.py``, ...).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from towerrec.modules.tables import TableConfig
from towerrec.sharding.strategies import strategy_for
from towerrec.sharding.types import Shard, ShardingType, TablePlan
from towerrec.utils import parse_enum

__all__ = ["ShardingPlan", "plan_table"]


def plan_table(table: TableConfig, sharding: ShardingType | str, ranks: Sequence[int]) -> TablePlan:
    """The usual geometry for ``sharding`` over ``ranks`` (even row or column splits)."""
    sharding = parse_enum(ShardingType, sharding, "sharding type")
    ranks = list(ranks)
    if not ranks:
        raise ValueError(f"table {table.name!r}: a plan needs at least one rank")
    return TablePlan(table.name, sharding, strategy_for(sharding).split(table, ranks))


@dataclass(frozen=True)
class ShardingPlan:
    world_size: int
    hosts: int = 1
    tables: dict[str, TablePlan] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.hosts < 1 or self.world_size % self.hosts:
            raise ValueError(
                f"world_size {self.world_size} must be a positive multiple of hosts {self.hosts}"
            )

    @property
    def ranks_per_host(self) -> int:
        return self.world_size // self.hosts

    def host_of(self, rank: int) -> int:
        return rank // self.ranks_per_host

    def shards_on(self, rank: int) -> list[tuple[str, Shard]]:
        """``(table, shard)`` pairs stored on ``rank``, in plan order."""
        return [(name, s) for name, tp in self.tables.items() for s in tp.shards if s.rank == rank]

    # ------------------------------------------------------------ checking
    def validate(self, tables: Iterable[TableConfig]) -> None:
        """Raise ``ValueError`` naming every problem of this plan for ``tables``."""
        by_name = {t.name: t for t in tables}
        problems = []
        missing = sorted(set(by_name) - set(self.tables))
        extra = sorted(set(self.tables) - set(by_name))
        if missing:
            problems.append(f"no placement for tables {missing}")
        if extra:
            problems.append(f"placements for unknown tables {extra}")
        for name, tp in self.tables.items():
            if name in by_name:
                problems.extend(
                    strategy_for(tp.sharding).problems(
                        by_name[name], tp, self.world_size, self.ranks_per_host
                    )
                )
        if problems:
            raise ValueError("invalid sharding plan: " + "; ".join(problems))

    # -------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "hosts": self.hosts,
            "tables": {
                name: {
                    "sharding": tp.sharding.value,
                    "shards": [
                        {"rank": s.rank, "rows": list(s.rows), "cols": list(s.cols)}
                        for s in tp.shards
                    ],
                }
                for name, tp in self.tables.items()
            },
        }

    @staticmethod
    def from_dict(data: dict[str, Any]) -> ShardingPlan:
        try:
            tables = {
                name: TablePlan(
                    name,
                    parse_enum(ShardingType, entry["sharding"], f"sharding type of table {name!r}"),
                    tuple(
                        Shard(int(s["rank"]), tuple(s["rows"]), tuple(s["cols"]))
                        for s in entry["shards"]
                    ),
                )
                for name, entry in data["tables"].items()
            }
            return ShardingPlan(int(data["world_size"]), int(data.get("hosts", 1)), tables)
        except (KeyError, TypeError) as e:
            raise ValueError(
                f"malformed sharding plan: missing or wrong field {e}; expected "
                '{"world_size": N, "hosts": H, "tables": {name: {"sharding": ..., "shards": '
                '[{"rank": r, "rows": [r0, r1], "cols": [c0, c1]}]}}}'
            ) from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @staticmethod
    def load(path: str | Path) -> ShardingPlan:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"plan file {str(path)!r} does not exist; write one with `towerrec plan`"
            )
        try:
            return ShardingPlan.from_dict(json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            raise ValueError(f"plan file {str(path)!r} is not valid JSON: {e}") from None
