"""Tier-aware planning: each table on the device, or cached on the device over host
memory or SSD, with the cache fraction that minimises the predicted step time.

Inputs: each table's locality (data/locality.py: the LRU hit rate of any cache
size, lookups and distinct ids per batch, from ``towerrec data profile``), its
row bytes, and per-host ``TierSpec`` (planner/tier_spec.py: capacities and
bandwidths, a preset or measured by ``towerrec plan --calibrate``). Per table and step (one global batch)::

    device           whole table in device memory; no misses
    cached over X    C rows in device memory (C >= 2 x p99 distinct ids per batch:
                     this batch and the prefetched next one), the table in X;
                     misses = lookups x (1 - hit(C)), each one fetching a row
                     and writing back the dirty row it evicts:
      host           2 x row bytes / host bandwidth
      ssd            latency / io depth + max(row, 4 KiB) / read bw + row / write bw

    row bytes = dim x (value + element-wise optimizer state) + row-wise state

The search minimises the sum of miss seconds over the hosts (tables spread
evenly) under device, host and SSD capacities:

1. everything fits in device memory: all ``device``;
2. else alternate (a) device memory to caches by a greedy over each table's
   upper concave hull of (device bytes, seconds saved), the steepest step first,
   a table taking all its rows becoming ``device``, then what is left to the
   best steps that still fit; (b) host memory to the backed tables that save
   the most seconds per byte against SSD, the rest on SSD; until the choice
   repeats.

``hosts_needed`` counts hosts as MTrainS does: the fewest hosts whose memory
holds the model (capacity) and whose links move its misses within a step-time
budget (bandwidth), with and without the SSD tier.

The plan names the cache's config keys (``embedding.tables.<t>.memory``,
``cache_fraction``, ``cache_policy``, ``backing``, ``backing_path``): ``to_toml``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from towerrec.data.locality import TableLocality
from towerrec.planner.tier_spec import TierSpec
from towerrec.planner.topology import GiB

__all__ = [
    "TableTiering",
    "TierPlan",
    "TieringError",
    "hosts_needed",
    "plan_tiers",
]

MAX_ROUNDS = 6


class TieringError(ValueError):
    """A model that no choice of tiers fits; the message names the shortfall."""


@dataclass(frozen=True)
class TableTiering:
    """One table's tier, cache size and predicted cost per step."""

    name: str
    memory: str  # device | cached
    backing: str  # "" (device) | host | ssd
    num_embeddings: int
    row_bytes: int
    cache_rows: int
    hit_rate: float
    misses_per_step: float
    seconds_per_step: float

    @property
    def cache_fraction(self) -> float:
        return 1.0 if self.memory == "device" else self.cache_rows / self.num_embeddings

    @property
    def table_bytes(self) -> float:
        return float(self.num_embeddings * self.row_bytes)

    @property
    def device_bytes(self) -> float:
        return float(self.cache_rows * self.row_bytes)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "memory": self.memory,
            "backing": self.backing or None,
            "cache_fraction": self.cache_fraction,
            "cache_rows": self.cache_rows,
            "num_embeddings": self.num_embeddings,
            "row_bytes": self.row_bytes,
            "table_bytes": self.table_bytes,
            "device_bytes": self.device_bytes,
            "hit_rate": self.hit_rate,
            "misses_per_step": self.misses_per_step,
            "seconds_per_step": self.seconds_per_step,
        }


@dataclass(frozen=True)
class TierPlan:
    tables: tuple[TableTiering, ...]
    spec: TierSpec  # the pool planned for (all hosts)
    hosts: int
    batch_size: int

    @property
    def step_seconds(self) -> float:
        """Predicted seconds per step moving missed rows, the hosts working in parallel."""
        return sum(t.seconds_per_step for t in self.tables) / self.hosts

    def used(self, tier: str) -> float:
        if tier == "device":
            return sum(t.device_bytes for t in self.tables)
        return sum(t.table_bytes for t in self.tables if t.backing == tier)

    def as_dict(self) -> dict[str, Any]:
        s = self.spec
        return {
            "hosts": self.hosts,
            "batch_size": self.batch_size,
            "step_seconds": self.step_seconds,
            "capacity_bytes": {
                "device": s.device_memory,
                "host": s.host_memory,
                "ssd": s.ssd_capacity,
            },
            "used_bytes": {k: self.used(k) for k in ("device", "host", "ssd")},
            "spec_source": s.source,
            "tables": [t.as_dict() for t in self.tables],
        }

    def to_toml(self, backing_path: str = "", policy: str = "lru") -> str:
        """The cache's config keys per table, to paste into a run config."""
        lines = [
            f"# towerrec plan --profile: tiers for {self.hosts} host(s), batch {self.batch_size}, "
            f"predicted {self.step_seconds * 1e3:.3f} ms/step moving missed rows"
        ]
        for t in self.tables:
            lines += ["", f"[embedding.tables.{_toml_key(t.name)}]", f'memory = "{t.memory}"']
            if t.memory == "cached":
                lines += [
                    f"cache_fraction = {_round_up(t.cache_fraction)}",
                    f'cache_policy = "{policy}"',
                    f'backing = "{t.backing}"',
                ]
                if t.backing == "ssd":
                    path = backing_path or "/path/to/ssd/towerrec"
                    lines.append(f'backing_path = "{path}"')
                lines.append(
                    f"# predicted hit rate {t.hit_rate:.1%}, {t.misses_per_step:,.0f} misses/step"
                )
        return "\n".join(lines) + "\n"


def _toml_key(name: str) -> str:
    bare = name.replace("_", "").replace("-", "").isalnum() and name.isascii()
    return name if bare else '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _round_up(fraction: float) -> float:
    """A short decimal >= ``fraction`` (4 significant digits), so the cache is never
    smaller than planned."""
    if fraction <= 0:
        return 0.0
    scale = 10.0 ** (3 - math.floor(math.log10(fraction)))
    return min(1.0, math.ceil(fraction * scale - 1e-9) / scale)


# ------------------------------------------------------------------ search
@dataclass(frozen=True)
class _Table:
    loc: TableLocality
    row_bytes: int
    lookups: float  # per step
    min_rows: int
    sizes: np.ndarray  # candidate cache rows, ascending, from min_rows; last = all rows
    miss_rate: np.ndarray  # 1 - hit rate at each size (0 at all rows: a device table)

    @property
    def table_bytes(self) -> float:
        return float(self.loc.num_embeddings * self.row_bytes)


def _prepare(loc: TableLocality, row_bytes: int, batch_size: int) -> _Table:
    rows = loc.num_embeddings
    lookups = loc.pooling_factor * batch_size
    # Distinct rows of one batch (p99): as profiled; a larger batch than profiled touches
    # at most proportionally more, a smaller one at most as many.
    distinct = loc.distinct_per_batch.get("p99", 0.0) * max(batch_size / loc.batch_size, 1.0)
    min_rows = min(rows, max(1, math.ceil(2 * min(distinct, lookups))))
    if min_rows >= rows:  # the cache would be the table: a device table
        return _Table(loc, row_bytes, lookups, rows, np.array([rows]), np.zeros(1))
    grid = [r for r, _ in loc.curve if min_rows < r < rows]
    sizes = np.array([min_rows, *grid, rows], dtype=np.int64)
    miss = np.array([1.0 - loc.hit_rate(float(r)) for r in sizes])
    miss[-1] = 0.0  # every row resident: a device table, no misses
    miss = np.minimum.accumulate(miss)  # a bigger cache never misses more
    return _Table(loc, row_bytes, lookups, min_rows, sizes, miss)


def _hull(xs: np.ndarray, ys: np.ndarray) -> list[int]:
    """Indices of the upper concave hull of points (x ascending, y = saving)."""
    hull: list[int] = []
    for i in range(len(xs)):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # drop b when it lies on or below the segment a -> i
            if (ys[b] - ys[a]) * (xs[i] - xs[a]) <= (ys[i] - ys[a]) * (xs[b] - xs[a]):
                hull.pop()
            else:
                break
        hull.append(i)
    return hull


def _miss_cost(t: _Table, backing: str, spec: TierSpec) -> float:
    per = spec.ssd_miss_seconds if backing == "ssd" else spec.host_miss_seconds
    return per(float(t.row_bytes))


def _allocate_device(tables: list[_Table], backings: list[str], spec: TierSpec) -> list[int]:
    """Index into each table's sizes: device memory to the steepest hull steps first."""
    chosen = [0] * len(tables)
    budget = spec.device_memory - sum(float(t.sizes[0]) * t.row_bytes for t in tables)
    if budget < 0:
        need = sum(float(t.sizes[0]) * t.row_bytes for t in tables)
        raise TieringError(
            f"device memory {spec.device_memory / GiB:.3g} GiB cannot hold even the caches' "
            f"minimum ({need / GiB:.3g} GiB: two batches' distinct rows per table); give more "
            "device memory (--device-memory, more hosts) or a smaller batch"
        )
    segments: list[tuple[float, int, int, int, float]] = []  # -slope, table, from, to, bytes
    for i, (t, backing) in enumerate(zip(tables, backings)):
        xs = t.sizes.astype(np.float64) * t.row_bytes
        saving = (t.miss_rate[0] - t.miss_rate) * t.lookups * _miss_cost(t, backing, spec)
        hull = _hull(xs, saving)
        for a, b in itertools.pairwise(hull):
            extra = float(xs[b] - xs[a])
            slope = float(saving[b] - saving[a]) / extra if extra > 0 else 0.0
            if slope > 0:
                segments.append((-slope, i, a, b, extra))
    segments.sort()
    stuck: set[int] = set()
    for _, i, a, b, extra in segments:
        if i in stuck or chosen[i] != a:
            stuck.add(i)
            continue
        if extra > budget:
            stuck.add(i)
            continue
        chosen[i] = b
        budget -= extra
    # The hull may jump past points that would still fit (to the whole table, which also
    # ends its cold misses); spend what is left on the best such step, while one fits.
    while True:
        best: tuple[float, int, int, float] | None = None
        for i, (t, backing) in enumerate(zip(tables, backings)):
            cost = t.lookups * _miss_cost(t, backing, spec)
            for j in range(chosen[i] + 1, len(t.sizes)):
                extra = float(t.sizes[j] - t.sizes[chosen[i]]) * t.row_bytes
                gain = float(t.miss_rate[chosen[i]] - t.miss_rate[j]) * cost
                if extra <= budget and gain > 0 and (best is None or gain / extra > best[0]):
                    best = (gain / extra, i, j, extra)
        if best is None:
            return chosen
        _, i, j, extra = best
        chosen[i] = j
        budget -= extra


def _assign_backing(
    tables: list[_Table], chosen: list[int], spec: TierSpec, allow_ssd: bool
) -> list[str]:
    """Host memory to the cached tables that save the most per byte against SSD."""
    backings = ["device"] * len(tables)
    cached = [i for i, t in enumerate(tables) if chosen[i] < len(t.sizes) - 1]
    if not allow_ssd:
        for i in cached:
            backings[i] = "host"
        return backings

    def saving_per_byte(i: int) -> float:
        t = tables[i]
        misses = t.miss_rate[chosen[i]] * t.lookups
        gain = misses * (_miss_cost(t, "ssd", spec) - _miss_cost(t, "host", spec))
        return float(gain) / t.table_bytes

    room = spec.host_memory
    for i in sorted(cached, key=saving_per_byte, reverse=True):
        if tables[i].table_bytes <= room:
            backings[i] = "host"
            room -= tables[i].table_bytes
        else:
            backings[i] = "ssd"
    return backings


def _check_capacity(tables: list[_Table], backings: list[str], spec: TierSpec) -> None:
    for tier, capacity in (("host", spec.host_memory), ("ssd", spec.ssd_capacity)):
        used = sum(t.table_bytes for t, b in zip(tables, backings) if b == tier)
        if used > capacity * (1 + 1e-9):
            what = "host memory" if tier == "host" else "SSD"
            fix = (
                "give an SSD tier (--ssd-capacity) or more host memory (--host-memory) or hosts"
                if tier == "host"
                else "give more SSD (--ssd-capacity), host memory or hosts"
            )
            raise TieringError(
                f"the tables backed by {what} need {used / GiB:.3g} GiB but it holds "
                f"{capacity / GiB:.3g} GiB; {fix}"
            )


def plan_tiers(
    tables: list[TableLocality],
    row_bytes: dict[str, int],
    spec: TierSpec,
    batch_size: int,
    hosts: int = 1,
) -> TierPlan:
    """Each table's tier and cache size on ``hosts`` hosts of ``spec`` (module docstring);
    ``row_bytes`` per table, ``batch_size`` the global batch of one step."""
    if hosts < 1 or batch_size < 1:
        raise ValueError(f"plan_tiers needs hosts >= 1 and batch_size >= 1 ({hosts}, {batch_size})")
    if not tables:
        raise ValueError("plan_tiers got no tables (an empty profile?)")
    pool = spec.scaled(hosts)
    prepared = [_prepare(t, row_bytes[t.name], batch_size) for t in tables]
    last = [len(t.sizes) - 1 for t in prepared]
    if sum(t.table_bytes for t in prepared) <= pool.device_memory:
        chosen, backings = last, ["device"] * len(prepared)
    else:
        allow_ssd = pool.ssd_capacity > 0
        # Start with host behind every table (SSD if it must), then alternate.
        backings = _assign_backing(prepared, [0] * len(prepared), pool, allow_ssd)
        seen: set[tuple[tuple[int, ...], tuple[str, ...]]] = set()
        for _ in range(MAX_ROUNDS):
            chosen = _allocate_device(prepared, backings, pool)
            backings = _assign_backing(prepared, chosen, pool, allow_ssd)
            key = (tuple(chosen), tuple(backings))
            if key in seen:
                break
            seen.add(key)
        _check_capacity(prepared, backings, pool)
    out = []
    for t, k, backing in zip(prepared, chosen, backings):
        device = k == len(t.sizes) - 1
        misses = 0.0 if device else float(t.miss_rate[k]) * t.lookups
        out.append(
            TableTiering(
                name=t.loc.name,
                memory="device" if device else "cached",
                backing="" if device else backing,
                num_embeddings=t.loc.num_embeddings,
                row_bytes=t.row_bytes,
                cache_rows=int(t.sizes[k]),
                hit_rate=1.0 if device else 1.0 - float(t.miss_rate[k]),
                misses_per_step=misses,
                seconds_per_step=0.0 if device else misses * _miss_cost(t, backing, pool),
            )
        )
    return TierPlan(tuple(out), pool, hosts, batch_size)


def hosts_needed(
    tables: list[TableLocality],
    row_bytes: dict[str, int],
    spec: TierSpec,
    batch_size: int,
    step_budget_s: float,
    max_hosts: int = 1 << 16,
) -> dict[str, dict[str, int | str | None]]:
    """Hosts a model needs, with and without the SSD tier (MTrainS): ``capacity`` the
    fewest whose memory holds it, ``hosts`` the fewest that also move its misses within
    ``step_budget_s`` per step (None: more than ``max_hosts``), ``bound`` which of the
    two set ``hosts``."""
    if step_budget_s <= 0:
        raise ValueError(f"the step-time budget must be > 0 s, got {step_budget_s}")
    out: dict[str, dict[str, int | str | None]] = {}
    for label, host_spec in (
        ("without_ssd", replace(spec, ssd_capacity=0.0)),
        ("with_ssd", spec),
    ):

        def fits(h: int, host_spec: TierSpec = host_spec) -> TierPlan | None:
            try:
                return plan_tiers(tables, row_bytes, host_spec, batch_size, h)
            except TieringError:
                return None

        capacity = _first(lambda h: fits(h) is not None, max_hosts)
        enough: int | None = None
        if capacity is not None:
            enough = _first(
                lambda h: (p := fits(h)) is not None and p.step_seconds <= step_budget_s,
                max_hosts,
                start=capacity,
            )
        bound = None if enough is None else "capacity" if enough == capacity else "bandwidth"
        out[label] = {"capacity": capacity, "hosts": enough, "bound": bound}
    return out


def _first(ok: Callable[[int], bool], limit: int, start: int = 1) -> int | None:
    """The smallest h in [start, limit] with ok(h), assuming ok stays true once true."""
    hi = start
    while not ok(hi):
        if hi >= limit:
            return None
        hi = min(limit, hi * 2)
    lo = max(start, hi // 2)
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi
