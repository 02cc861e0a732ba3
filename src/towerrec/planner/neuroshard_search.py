"""NeuroShard's search: beam search over column splits x greedy grid over placement.

::

    start   the splits that let every table fit (algorithms.py packs first), no column splits
    greedy  sort the shards by a key (predicted cost alone | output dims | memory, large
            shards first), put each on the device that keeps the predicted max device
            cost (compute + comm) lowest, ties to the device whose own cost stays lowest
            (a device's predicted cost never drops when it takes a shard: the networks are
            not monotone, the clamp keeps the greedy from piling shards on one device);
            with a dims cap c, devices past c x the mean output dims are skipped while
            another has room.  grid: key x cap (none, 1.1, 1.3)
    beam    every state's best placement names its most loaded device; its ``branch``
            costliest splittable tables are split in twice as many column shards (at
            most the world size, at least 4 columns each), each child scored by the
            greedy grid (a child of over FULL_GRID_ITEMS shards: at its parent's best
            grid point only, and the winner gets the full grid); the best ``width``
            states go on for up to ``depth`` rounds while the best improves

Costs come from a NeuroShardPolicy (planner/neuroshard.py): its compute networks
run in numpy on per-device pooled encodings kept up to date as shards are added
(sum pooling), so one greedy pass costs a few small matrix products per shard.
Memory is a hard constraint, as in every planner. Deterministic.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from towerrec.planner.cost import CostModel
from towerrec.planner.neuroshard import NeuroShardPolicy
from towerrec.planner.placement import Item, PlanningError, TableConstraint, build_items
from towerrec.planner.stats import TableStats
from towerrec.sharding import ShardingType

__all__ = ["GRID", "NeuroShardResult", "search_neuroshard"]

GRID_KEYS = ("cost", "dims", "memory")
DIMS_CAPS = (0.0, 1.1, 1.3)  # 0: no cap
GRID = tuple((key, cap) for key in GRID_KEYS for cap in DIMS_CAPS)
# Candidates with at most this many shards get the whole grid; larger ones (856 tables:
# ~900 shards) their parent's best grid point, and the winner the whole grid at the end.
FULL_GRID_ITEMS = 256
Splits = dict[str, tuple[ShardingType, int]]


@dataclass
class NeuroShardResult:
    items: list[Item]
    ranks: list[int]
    num_widths: int
    predicted_max_s: float  # under the policy's models
    start_predicted_max_s: float  # the greedy grid on the start splits (no column splits)
    column_parts: dict[str, int] = field(default_factory=dict)  # splits the beam added
    grid_point: tuple[str, float] = ("cost", 0.0)


class _FusedHead:
    """The forward and backward networks' heads side by side ([.., 2H] hidden units), so
    one set of matrix products prices every candidate device for both."""

    def __init__(self, policy: NeuroShardPolicy) -> None:
        f, b = policy.fast
        hidden = f.hidden
        self.hidden = hidden
        self.pooled = np.zeros((2 * hidden, 2 * hidden))
        self.pooled[:hidden, :hidden], self.pooled[hidden:, hidden:] = f.head_pooled, b.head_pooled
        self.device = np.concatenate([f.head_device, b.head_device], axis=1)  # [2, 2H]
        self.bias = np.concatenate([f.head_b1, b.head_b1])
        self.out = np.zeros((2 * hidden, 2))
        self.out[:hidden, 0], self.out[hidden:, 1] = f.head_w2, b.head_w2
        self.out_bias = np.array([f.head_b2, b.head_b2])

    def seconds(self, projected: np.ndarray, device: np.ndarray) -> np.ndarray:
        """Forward + backward seconds from pooled encodings already through the first
        layer (``projected`` [N, 2H], bias included) and device features [N, 2]."""
        h = projected + device @ self.device
        np.maximum(h, 0, out=h)
        return cast(np.ndarray, np.exp(h @ self.out + self.out_bias).sum(axis=1))


class _Task:
    """One split state's shards with their encodings, solo costs, dims and memory."""

    def __init__(
        self,
        items: list[Item],
        num_widths: int,
        policy: NeuroShardPolicy,
        model: CostModel,
        cache: dict[Any, Any],
    ) -> None:
        self.items, self.num_widths = items, num_widths
        world = model.topology.world_size
        self.world = world
        self.capacity = model.topology.device_memory
        self.scale = model.batch_size * world / policy.batch
        if "head" not in cache:
            cache["head"] = _FusedHead(policy)
        self.head: _FusedHead = cache["head"]
        projected = []
        for it in items:
            stats = it.stats
            assert stats is not None  # build_items sets it
            key = ("neuroshard", it.table, it.rows[1] - it.rows[0], it.cols[1] - it.cols[0])
            if key not in cache:
                feats = policy.features([(stats, key[2], key[3])])
                both = np.concatenate([net.encode(feats)[0] for net in policy.fast])
                cache[key] = both @ self.head.pooled
            projected.append(cache[key])
        # Each shard's encoding through the heads' first layer: a device's is their sum.
        self.projected = np.array(projected).reshape(len(items), 2 * self.head.hidden)
        self.dims = np.array([it.cols[1] - it.cols[0] for it in items], dtype=np.float64)
        self.memory = np.array([it.memory for it in items])
        lone = np.full((len(items), 2), 1 / 8)
        self.solo: np.ndarray = self.scale * self.head.seconds(
            self.projected + self.head.bias, lone
        )
        self.total_dims = float(self.dims.sum())
        self.width_index = np.array([it.width for it in items], dtype=np.int64)
        pinned = [(i, it.fixed_rank) for i, it in enumerate(items) if it.fixed_rank is not None]
        self.pinned = np.array([i for i, _ in pinned], dtype=np.int64)
        self.pinned_ranks = np.array([r for _, r in pinned], dtype=np.int64)
        # All-to-all seconds of a device = base + per_dim * its dims (the total is fixed).
        comm, batch = policy.comm, model.batch_size
        if world < 2:
            self.comm_base, self.comm_per_dim = 0.0, 0.0
        else:
            self.comm_base = comm.latency_s + comm.s_per_byte * 4.0 * batch * self.total_dims
            self.comm_per_dim = comm.s_per_byte * 4.0 * batch * (world - 2)

    def order(self, key: str) -> list[int]:
        free = [i for i, it in enumerate(self.items) if it.fixed_rank is None]
        if key == "cost":
            return sorted(free, key=lambda i: (-self.solo[i], i))
        if key == "dims":
            return sorted(free, key=lambda i: (-self.dims[i], -self.solo[i], i))
        big = self.capacity / 4  # as LPT: shards over a quarter of a device go first

        def by_memory(i: int) -> tuple[int, float, int]:
            m = self.memory[i]
            return (0, -m, i) if m > big else (1, -self.solo[i], i)

        return sorted(free, key=by_memory)

    def greedy(self, key: str, cap: float) -> tuple[float, list[int], np.ndarray] | None:
        """(predicted max, rank per item, per-device predicted cost), or None if some
        shard finds no device with room."""
        world, head = self.world, self.head
        pooled = np.tile(head.bias, (world, 1))  # [W, 2H]: first layer of the heads
        widths = np.zeros((world, max(self.num_widths, 1)), dtype=np.int64)
        num_widths = np.zeros(world)
        count = np.zeros(world)
        dims = np.zeros(world)
        memory = np.zeros(world)
        compute = np.zeros(world)
        total = np.full(world, self.comm_base)  # compute + comm of each device
        device = np.zeros((world, 2))
        on: dict[int, set[int]] = {}
        ranks = [-1] * len(self.items)
        limit = self.capacity * (1 + 1e-12)
        dims_cap = cap * self.total_dims / world if cap else np.inf

        def device_compute(i: int) -> np.ndarray:
            device[:, 0] = (num_widths + (widths[:, self.items[i].width] == 0)) / 8
            device[:, 1] = (count + 1) / 8
            seconds = self.scale * head.seconds(pooled + self.projected[i], device)
            # A device never gets faster by taking a shard (the networks are not monotone).
            return np.maximum(seconds, compute)

        def place(i: int, rank: int, cost: float) -> None:
            it = self.items[i]
            pooled[rank] += self.projected[i]
            num_widths[rank] += widths[rank, it.width] == 0
            widths[rank, it.width] += 1
            count[rank] += 1
            dims[rank] += self.dims[i]
            memory[rank] += self.memory[i]
            compute[rank] = cost
            total[rank] = cost + self.comm_base + self.comm_per_dim * dims[rank]
            on.setdefault(it.group, set()).add(rank)
            ranks[i] = rank

        pinned, at = self.pinned, self.pinned_ranks
        if len(pinned):  # row-wise, data-parallel and pinned shards, all at once
            np.add.at(memory, at, self.memory[pinned])
            if (memory > limit).any():
                return None
            np.add.at(pooled, at, self.projected[pinned])
            np.add.at(widths, (at, self.width_index[pinned]), 1)
            np.add.at(count, at, 1)
            np.add.at(dims, at, self.dims[pinned])
            num_widths[:] = (widths > 0).sum(axis=1)
            for i, rank in zip(pinned.tolist(), at.tolist()):
                ranks[i] = rank  # their tables' shards are all pinned: no group to record
            device[:, 0], device[:, 1] = num_widths / 8, count / 8
            compute[:] = np.where(count > 0, self.scale * head.seconds(pooled, device), 0)
            total[:] = compute + self.comm_base + self.comm_per_dim * dims
        for i in self.order(key):
            ok = memory + self.memory[i] <= limit
            for rank in on.get(self.items[i].group, ()):
                ok[rank] = False
            if not ok.any():
                return None
            if cap:
                capped = ok & (dims + self.dims[i] <= dims_cap)
                if capped.any():
                    ok = capped
            new_compute = device_compute(i)
            after = new_compute + (total - compute) + self.comm_per_dim * self.dims[i]
            # The max over the other devices: the top one's, except for the top device itself.
            top = int(np.argmax(total))
            highest = total[top]
            total[top] = -np.inf
            others = np.full(world, highest)
            others[top] = total.max() if world > 1 else 0.0
            total[top] = highest
            score = np.where(ok, np.maximum(others, after), np.inf)
            ties = np.flatnonzero(score <= score.min() * (1 + 1e-12))
            rank = int(ties[np.argmin(after[ties])])
            place(i, rank, float(new_compute[rank]))
        return float(total.max()), ranks, total.copy()


def _run_grid(
    task: _Task, points: Sequence[tuple[str, float]]
) -> tuple[float, list[int], np.ndarray, tuple[str, float]] | None:
    best = None
    for point in points:
        found = task.greedy(*point)
        if found is not None and (best is None or found[0] < best[0] * (1 - 1e-12)):
            best = (*found, point)
    return best


def search_neuroshard(
    stats: Sequence[TableStats],
    model: CostModel,
    policy: NeuroShardPolicy,
    constraints: Mapping[str, TableConstraint],
    start_splits: Splits,
    beam_width: int = 3,
    beam_depth: int = 6,
    beam_branch: int = 2,
) -> NeuroShardResult | None:
    """The best plan found; None if no grid point packs the start (the caller falls back)."""
    world = model.topology.world_size
    by_name = {s.name: s for s in stats}
    item_cache: dict[Any, Any] = {}
    enc_cache: dict[Any, Any] = {}

    def build(parts: dict[str, int]) -> _Task:
        splits = {**start_splits, **{n: (ShardingType.COLUMN_WISE, p) for n, p in parts.items()}}
        items, widths = build_items(stats, model, constraints, splits, item_cache)
        return _Task(items, len(widths), policy, model, enc_cache)

    def splittable(name: str, parts: dict[str, int]) -> int:
        """The next column split of table ``name`` (0: none allowed)."""
        allowed = constraints.get(name, TableConstraint()).sharding_types
        if ShardingType.COLUMN_WISE not in allowed:
            return 0
        start = start_splits.get(name)
        if start is not None and start[0] is not ShardingType.COLUMN_WISE:
            return 0
        current = parts.get(name) or (start[1] if start else 1)
        nxt = current * 2
        return nxt if nxt <= world and by_name[name].embedding_dim // nxt >= 4 else 0

    start_task = build({})
    start = _run_grid(start_task, GRID)
    if start is None:
        return None
    # (max, column parts, task, ranks, device costs, grid point)
    beam: list[tuple[float, dict[str, int], _Task, list[int], np.ndarray, tuple[str, float]]]
    beam = [(start[0], {}, start_task, start[1], start[2], start[3])]
    best = beam[0]
    seen: set[tuple[tuple[str, int], ...]] = {()}
    for _ in range(beam_depth):
        children = []
        for _cost, parts, task, ranks, costs, point in beam:
            top = int(np.argmax(costs))
            hot = sorted((i for i, r in enumerate(ranks) if r == top), key=lambda i: -task.solo[i])
            tried = 0
            for i in hot:
                if task.items[i].fixed_rank is not None:
                    continue  # pinned (a constraint), row-wise or data-parallel: stays
                name = task.items[i].table
                nxt = splittable(name, parts)
                if not nxt:
                    continue
                child = {**parts, name: nxt}
                key = tuple(sorted(child.items()))
                if key in seen:
                    continue
                seen.add(key)
                tried += 1
                try:
                    child_task = build(child)
                except PlanningError:
                    continue
                points = GRID if len(child_task.items) <= FULL_GRID_ITEMS else [point]
                found = _run_grid(child_task, points)
                if found is not None:
                    children.append((found[0], child, child_task, *found[1:]))
                if tried >= beam_branch:
                    break
        if not children:
            break
        beam = sorted(beam + children, key=lambda b: (b[0], len(b[1])))[:beam_width]
        if beam[0][0] < best[0] * (1 - 1e-6):
            best = beam[0]
        else:
            break
    cost, parts, task, ranks, _, point = best
    if parts and len(task.items) > FULL_GRID_ITEMS:
        again = _run_grid(task, GRID)
        if again is not None and again[0] < cost:
            cost, ranks, _, point = again
    return NeuroShardResult(task.items, ranks, task.num_widths, cost, start[0], dict(parts), point)
