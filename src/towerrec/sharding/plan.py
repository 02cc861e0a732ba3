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
    def from_dict(data: Any) -> ShardingPlan:
        """The plan of ``to_dict``'s JSON; ``ValueError`` naming the first field that is
        missing or of the wrong type."""
        if not isinstance(data, dict) or not isinstance(data.get("tables"), dict):
            raise _malformed("the top level must be an object with a 'tables' object")
        tables = {}
        for name, entry in data["tables"].items():
            where = f"tables.{name}"
            if not isinstance(entry, dict) or not isinstance(entry.get("shards"), list):
                raise _malformed(f"{where} must be an object with a 'shards' list")
            try:
                sharding = parse_enum(ShardingType, entry.get("sharding"), f"{where}.sharding")
            except ValueError as e:
                raise _malformed(str(e)) from None
            shards = []
            for i, shard in enumerate(entry["shards"]):
                at = f"{where}.shards[{i}]"
                if not isinstance(shard, dict):
                    raise _malformed(f"{at} must be an object")
                rank = _whole(shard.get("rank"), f"{at}.rank")
                rows, cols = (_pair(shard.get(k), f"{at}.{k}") for k in ("rows", "cols"))
                shards.append(Shard(rank, rows, cols))
            tables[name] = TablePlan(name, sharding, tuple(shards))
        world_size = _whole(data.get("world_size"), "world_size")
        return ShardingPlan(world_size, _whole(data.get("hosts", 1), "hosts"), tables)

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
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"plan file {str(path)!r} is not valid JSON: {e}") from None
        try:
            return ShardingPlan.from_dict(data)
        except ValueError as e:
            raise ValueError(f"plan file {str(path)!r}: {e}") from None


_PLAN_FORMAT = (
    '{"world_size": N, "hosts": H, "tables": {name: {"sharding": ..., "shards": '
    '[{"rank": r, "rows": [r0, r1], "cols": [c0, c1]}]}}}'
)


def _malformed(what: str) -> ValueError:
    return ValueError(f"malformed sharding plan: {what}; expected {_PLAN_FORMAT}")


def _whole(value: object, where: str) -> int:
    if type(value) is not int:  # not a bool, a float or a string of digits
        raise _malformed(f"{where} must be a whole number, got {value!r}")
    return value


def _pair(value: object, where: str) -> tuple[int, int]:
    if not isinstance(value, list) or len(value) != 2:
        raise _malformed(f"{where} must be [start, end], got {value!r}")
    return _whole(value[0], where), _whole(value[1], where)
