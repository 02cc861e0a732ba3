"""Placement algorithms: the pieces the planners of ``planner/search.py`` are made of.

::

    greedy        sort by a proxy (size, lookups, size x lookups, dim; random order),
                  put each shard on the device with the least proxy so far
    lpt           sort by modelled cost, put each shard where the device cost grows least
    refine        moves and swaps between the most and least loaded devices
    beam_search   beam search over column / row splits of the tables on the most loaded
                  device, each candidate scored by LPT
    place_learned a learned policy (planner/dreamshard.py, planner/autoshard.py) places
                  one shard at a time
    split_until_packed   while a table does not pack, split it (row-wise, else
                  column-wise) and place again

Every placing loop places the pinned shards first and refuses a shard that fits
nowhere (``PlanningError`` naming the table and the shortfall). Deterministic for a
given seed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from towerrec.planner.cost import CostModel
from towerrec.planner.learned_planners import learned_placer, one_thread
from towerrec.planner.placement import (
    Item,
    Loads,
    PlanningError,
    TableConstraint,
    _gib,
    build_items,
)
from towerrec.planner.stats import TableStats
from towerrec.sharding import ShardingType

__all__ = [
    "GREEDY_KEYS",
    "BeamSettings",
    "Splits",
    "beam_search",
    "greedy",
    "lpt",
    "place_each",
    "place_learned",
    "refine",
    "split_until_packed",
]

GREEDY_KEYS = {
    "greedy_size": lambda s: s.num_embeddings * s.embedding_dim,
    "greedy_lookup": lambda s: s.pooling_factor * s.embedding_dim,
    "greedy_size_lookup": lambda s: s.num_embeddings * s.embedding_dim**2 * s.pooling_factor,
    "greedy_dim": lambda s: s.embedding_dim,
    "random": None,
}
Splits = dict[str, tuple[ShardingType, int]]  # table -> (row_wise | column_wise, parts)


@dataclass(frozen=True)
class BeamSettings:
    """The beam over column / row splits (``search``, ``neuroshard``): the states kept,
    the rounds at most, and the costliest tables of the most loaded device tried per state."""

    width: int = 3
    depth: int = 6
    branch: int = 2


def _place_fixed(items: Sequence[Item], loads: Loads, order: Sequence[int]) -> list[int]:
    """Place pinned shards (all shards of a table at once); return the indices still to place."""
    fixed: dict[int, list[int]]
    rest, fixed = [], {}
    for i in order:
        if items[i].fixed_rank is None:
            rest.append(i)
        else:
            fixed.setdefault(items[i].group, []).append(i)
    for members in fixed.values():
        ranks = np.array([items[i].fixed_rank for i in members])
        memory = np.array([items[i].memory for i in members])
        free = loads.capacity - loads.memory[ranks]
        over = np.flatnonzero(memory > free)
        if len(over):
            item, room = items[members[over[0]]], free[over[0]]
            raise PlanningError(
                f"table {item.table!r}: its shard on rank {item.fixed_rank} needs "
                f"{_gib(item.memory)} but only {_gib(room)} is free there (short by "
                f"{_gib(item.memory - room)}); unpin it or add memory"
            )
        loads.add_many(ranks, members, [items[i] for i in members])
    return rest


class _NoRoom(PlanningError):
    """Shards that found no device with room (``tables``: their tables, in order)."""

    def __init__(self, message: str, tables: list[str]) -> None:
        super().__init__(message)
        self.tables = tables


class _Misfits:
    """Collects the shards that do not fit, so one pass reports all of them."""

    def __init__(self) -> None:
        self.first: str | None = None
        self.tables: list[str] = []

    def add(self, item: Item, loads: Loads) -> None:
        if self.first is None:
            free = float((loads.capacity - loads.memory).max())
            self.first = (
                f"no device has room for table {item.table!r} (shard {item.rows}x{item.cols} "
                f"needs {_gib(item.memory)}, the most free on any device is {_gib(free)}, "
                f"short by {_gib(item.memory - free)}); the tables do not pack: add ranks or "
                "memory, or allow row_wise / column_wise"
            )
        if item.table not in self.tables:
            self.tables.append(item.table)

    def check(self) -> None:
        if self.first is not None:
            raise _NoRoom(self.first, self.tables)


def place_each(
    items: Sequence[Item],
    loads: Loads,
    order: Sequence[int],
    choose: Callable[[int, Item, np.ndarray], int],
) -> None:
    """Place the fixed shards, then each other item in ``order`` on the rank ``choose``
    picks among those with room (``ok``); every item that fits nowhere is reported."""
    misfits = _Misfits()
    for i in _place_fixed(items, loads, order):
        item = items[i]
        ok = loads.feasible(item)
        if not ok.any():
            misfits.add(item, loads)
            continue
        loads.add(choose(i, item, ok), i, item)
    misfits.check()


def greedy(items: Sequence[Item], loads: Loads, key: str, seed: int) -> list[int]:
    assign = [-1] * len(items)
    rng = np.random.default_rng(seed)
    if key == "random":
        order = list(rng.permutation(len(items)))
        values = np.zeros(len(items))
    else:
        fn = GREEDY_KEYS[key]
        assert fn is not None  # only "random" has no key function
        values = np.array(
            [
                fn(it.stats)
                * (it.cols[1] - it.cols[0])
                / it.stats.embedding_dim  # type: ignore[union-attr]  # build_items sets stats
                * (it.rows[1] - it.rows[0])
                / it.stats.num_embeddings  # type: ignore[union-attr]  # build_items sets stats
                for it in items
            ]
        )
        order = sorted(range(len(items)), key=lambda i: (-values[i], i))
    proxy = np.zeros(len(loads.cost))

    def choose(i: int, item: Item, ok: np.ndarray) -> int:
        if key == "random":
            rank = int(rng.choice(np.flatnonzero(ok)))
        else:
            rank = int(np.argmin(np.where(ok, proxy, np.inf)))
        proxy[rank] += values[i]
        return rank

    place_each(items, loads, order, choose)
    for rank, members in enumerate(loads.on):
        for i in members:
            assign[i] = rank
    return assign


def lpt(items: Sequence[Item], loads: Loads) -> None:
    # Shards taking over a quarter of a device go first (largest first), so they still fit.
    big = loads.capacity / 4

    def key(i: int) -> tuple[int, float, int]:
        it = items[i]
        return (0, -it.memory, i) if it.memory > big else (1, -it.cost, i)

    order = sorted(range(len(items)), key=key)

    def choose(_i: int, item: Item, ok: np.ndarray) -> int:
        after = np.where(ok, loads.totals_with(item), np.inf)
        # Ties (e.g. empty devices): the one with the most free memory, then the lowest rank.
        ties = np.flatnonzero(after <= after.min() * (1 + 1e-12))
        return int(ties[np.argmin(loads.memory[ties])])

    place_each(items, loads, order, choose)


def refine(items: Sequence[Item], loads: Loads, max_rounds: int, candidates: int = 8) -> None:
    """Local search: the best move or swap between the most loaded device and the
    ``candidates`` least loaded ones, until none lowers the pair's maximum."""
    for _ in range(max_rounds):
        totals = loads.totals()
        top = int(np.argmax(totals))
        current = totals[top]
        others = [int(r) for r in np.argsort(totals, kind="stable") if r != top][:candidates]
        best: tuple[float, int, int, int | None] | None = None  # (max, item, rank, swap item)
        movable = [i for i in loads.on[top] if items[i].fixed_rank is None]
        for i in movable:
            a = items[i]
            for rank in others:
                if rank in loads.groups.get(a.group, ()):
                    continue
                free = loads.capacity - loads.memory[rank]
                if a.memory <= free:
                    worst = max(loads.total_at(top, remove=[a]), loads.total_at(rank, add=[a]))
                    if worst < current * (1 - 1e-9) and (best is None or worst < best[0]):
                        best = (worst, i, rank, None)
                for j in loads.on[rank]:
                    b = items[j]
                    if b.fixed_rank is not None or b.cost >= a.cost:
                        continue
                    if top in loads.groups.get(b.group, ()) and b.group != a.group:
                        continue
                    if b.group == a.group:
                        continue
                    if a.memory - b.memory > free or b.memory - a.memory > (
                        loads.capacity - loads.memory[top]
                    ):
                        continue
                    worst = max(
                        loads.total_at(top, remove=[a], add=[b]),
                        loads.total_at(rank, remove=[b], add=[a]),
                    )
                    if worst < current * (1 - 1e-9) and (best is None or worst < best[0]):
                        best = (worst, i, rank, j)
        if best is None:
            return
        _, i, rank, j = best
        loads.remove(top, i, items[i])
        if j is not None:
            loads.remove(rank, j, items[j])
            loads.add(top, j, items[j])
        loads.add(rank, i, items[i])


def place_learned(items: Sequence[Item], loads: Loads, planner: str, weights: str | None) -> None:
    """Place with the learned policy of ``planner`` (its ``weights`` file; None: shipped)."""
    with one_thread():
        session = learned_placer(planner, weights).start(items, len(loads.cost))

        def choose(i: int, item: Item, ok: np.ndarray) -> int:
            return session.choose(i, item, ok, loads)

        place_each(items, loads, session.order(items), choose)


def _split_options(
    s: TableStats,
    current: tuple[ShardingType, int] | None,
    world: int,
    allowed: Sequence[ShardingType],
) -> list[tuple[ShardingType, int]]:
    out = []
    parts = current[1] if current and current[0] is ShardingType.COLUMN_WISE else 1
    if ShardingType.COLUMN_WISE in allowed and parts * 2 <= min(world, s.embedding_dim // 4):
        out.append((ShardingType.COLUMN_WISE, parts * 2))
    if ShardingType.ROW_WISE in allowed and current is None and world > 1:
        out.append((ShardingType.ROW_WISE, world))
    return out


def beam_search(
    stats: Sequence[TableStats],
    model: CostModel,
    constraints: Mapping[str, TableConstraint],
    start_splits: Splits,
    settings: BeamSettings,
    cache: dict[Any, Any],
) -> Splits:
    """Splits chosen by beam search; each candidate is scored by LPT's max device cost.
    ``cache``: ``build_items``'s, shared with the planner's own placing."""
    world = model.topology.world_size
    by_name = {s.name: s for s in stats}

    def score(splits: Splits) -> tuple[float, list[Item], Loads]:
        items, widths = build_items(stats, model, constraints, splits, cache)
        loads = Loads(model, len(widths))
        lpt(items, loads)
        return float(loads.totals().max()), items, loads

    start = score(start_splits)
    beam = [(dict(start_splits), *start)]
    seen: set[tuple[tuple[str, str, int], ...]] = {()}
    best = beam[0]
    for _ in range(settings.depth):
        children = []
        for splits, _, items, loads in beam:
            top = int(np.argmax(loads.totals()))
            hot = sorted(loads.on[top], key=lambda i: -items[i].cost)
            tried = 0
            for i in hot:
                name = items[i].table
                constraint = constraints.get(name, TableConstraint())
                if constraint.rank is not None:
                    continue  # pinned: stays whole where it is pinned
                if items[i].sharding not in (ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE):
                    continue  # row-wise or data-parallel already
                allowed = constraint.sharding_types
                for option in _split_options(by_name[name], splits.get(name), world, allowed):
                    child = {**splits, name: option}
                    key = tuple(sorted((k, v[0].value, v[1]) for k, v in child.items()))
                    if key in seen:
                        continue
                    seen.add(key)
                    try:
                        children.append((child, *score(child)))
                    except PlanningError:
                        continue
                tried += 1
                if tried >= settings.branch:
                    break
        if not children:
            break
        beam = sorted(beam + children, key=lambda b: b[1])[: settings.width]
        if beam[0][1] < best[1] * (1 - 1e-6):
            best = beam[0]
        else:
            break
    return best[0]


def split_until_packed(
    stats: Sequence[TableStats],
    model: CostModel,
    constraints: Mapping[str, TableConstraint],
    place: Callable[[Splits], tuple[list[Item], Loads]],
) -> tuple[Splits, tuple[list[Item], Loads]]:
    """``place({})``; while a table does not pack, split it (row-wise, else column-wise)
    and try again. Returns the splits and the placement."""
    by_name = {s.name: s for s in stats}
    world = model.topology.world_size
    splits: Splits = {}
    while True:
        try:
            return splits, place(splits)
        except _NoRoom as e:
            changed = False
            for name in e.tables:
                table = by_name[name]
                allowed = constraints.get(name, TableConstraint()).sharding_types
                current = splits.get(name)
                parts = current[1] if current and current[0] is ShardingType.COLUMN_WISE else 1
                if ShardingType.ROW_WISE in allowed and current is None and world > 1:
                    splits[name] = (ShardingType.ROW_WISE, world)
                    changed = True
                elif ShardingType.COLUMN_WISE in allowed and parts < min(
                    world, table.embedding_dim
                ):
                    splits[name] = (ShardingType.COLUMN_WISE, min(world, table.embedding_dim))
                    changed = True
            if not changed:
                raise
