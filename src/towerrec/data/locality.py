"""Locality of one table's id stream: LRU stack distances, their histogram and the
hit-rate curve of an LRU cache of any size.

The stack distance of an access is the position of its id in the LRU stack just
before the access (1 = the same id as the access before it), or cold (first
access). An LRU cache of C rows hits exactly the accesses of distance <= C, so
one pass gives the hit rate of every cache size (Mattson et al., 1970)::

    ids        a  b  c  b  a  a
    distance   -  -  -  2  3  1        (- = cold miss)
    hits(C=1)                 x        1/6
    hits(C=2)           x     x        2/6
    hits(C=3)           x  x  x        3/6

Access t whose id was last accessed at p has distance 1 + distinct ids in
(p, t). The textbook way sweeps t with a Fenwick tree over last-access times
(a 1 at each id's latest access; the distance is the tree's sum over (p, t)).
That loop costs a Python step per id; ``stack_distances`` computes the same
counts offline, vectorised: each reuse (p, t) is an interval, and

    distinct ids in (p, t) = (t - p - 1) - #{reuse intervals (a, b): p < a, b < t}

(every access inside (p, t) but the last of its id starts a reuse interval that
ends before t). The nested count is a dominance count: order the intervals by a
descending and count, for each, the earlier ones with a smaller end. A bottom-up
merge sort does that in ceil(log2 m) numpy passes over the m intervals (the
static form of the Fenwick tree's prefix sums), each a stable sort of two
sorted runs per block plus a cumulative sum: O(m log m) work.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "CACHE_FRACTIONS",
    "HIT_TARGETS",
    "TableLocality",
    "hit_curve",
    "log2_histogram",
    "rows_for_hit_rate",
    "stack_distances",
    "summarize",
]

# Cache sizes (shares of the table's rows) and hit-rate targets every profile reports.
CACHE_FRACTIONS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
HIT_TARGETS = (0.8, 0.9, 0.95, 0.99)
CURVE_POINTS = 96  # log-spaced cache sizes stored per table, for the planner


def _previous_access(ids: np.ndarray) -> np.ndarray:
    """``prev [n]``: the position of the same id's previous access, -1 if none."""
    n = len(ids)
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    same = sorted_ids[1:] == sorted_ids[:-1]
    prev = np.full(n, -1, dtype=np.int64)
    prev[order[1:][same]] = order[:-1][same]
    return prev


def _smaller_before(values: np.ndarray) -> np.ndarray:
    """``out[i] = #{j < i: values[j] < values[i]}`` for distinct non-negative integers."""
    m = len(values)
    counts = np.zeros(m, dtype=np.int64)
    if m < 2:
        return counts
    keys = values.astype(np.int64)
    where = np.arange(m)  # original index of each slot
    slot = np.arange(m)
    span = int(keys.max()) + 1
    width = 1
    while width < m:
        block = slot // (2 * width)
        # Each block of 2*width slots holds two runs sorted by value: left, then right.
        right = (slot // width) & 1
        order = np.argsort(block * span + keys, kind="stable")
        left_sorted = 1 - right[order]
        before = np.cumsum(left_sorted) - left_sorted  # lefts before each merged slot
        smaller = before - before[block * (2 * width)]  # ... inside its own block
        from_right = right[order] == 1
        counts[where[order][from_right]] += smaller[from_right]
        keys, where = keys[order], where[order]
        width *= 2
    return counts


def stack_distances(ids: np.ndarray) -> np.ndarray:
    """LRU stack distance of each access of ``ids [n]`` (any integers): ``>= 1``, or 0
    for a cold (first) access. Exact; O(n log n) (module docstring)."""
    ids = np.asarray(ids)
    if ids.ndim != 1:
        raise ValueError(f"stack_distances takes a 1-d id stream, got shape {ids.shape}")
    n = len(ids)
    out = np.zeros(n, dtype=np.int64)
    if n == 0:
        return out
    prev = _previous_access(ids)
    ends = np.nonzero(prev >= 0)[0]  # t of each reuse interval (p, t)
    starts = prev[ends]
    by_start = np.argsort(-starts, kind="stable")  # starts are distinct
    nested = np.empty(len(ends), dtype=np.int64)
    nested[by_start] = _smaller_before(ends[by_start])
    out[ends] = ends - starts - nested
    return out


def log2_histogram(distances: np.ndarray) -> list[int]:
    """Counts of warm accesses by distance bucket: bucket k holds [2^k, 2^(k+1))."""
    warm = distances[distances > 0]
    if len(warm) == 0:
        return []
    buckets = np.floor(np.log2(warm.astype(np.float64))).astype(np.int64)
    return [int(c) for c in np.bincount(buckets)]


def hit_curve(distances: np.ndarray, cache_rows: np.ndarray) -> np.ndarray:
    """Hit rate of an LRU cache of each size in ``cache_rows`` on this stream."""
    n = len(distances)
    if n == 0:
        return np.zeros(len(cache_rows))
    warm = np.sort(distances[distances > 0])
    return np.searchsorted(warm, np.asarray(cache_rows), side="right") / n


def rows_for_hit_rate(distances: np.ndarray, target: float) -> int | None:
    """The smallest LRU cache (rows) with hit rate >= ``target``, or None when the cold
    misses alone exceed 1 - target."""
    n = len(distances)
    warm = np.sort(distances[distances > 0])
    need = math.ceil(target * n - 1e-9)
    if n == 0 or need > len(warm):
        return None
    return int(warm[need - 1]) if need > 0 else 0


def _percentile(values: np.ndarray, q: float) -> float:
    return float(np.quantile(values, q)) if len(values) else 0.0


@dataclass(frozen=True)
class TableLocality:
    """What the profile says of one table (one feature's id stream)."""

    name: str
    num_embeddings: int
    lookups: int  # ids profiled (the sample)
    total_lookups: int  # ids in the stream the sample came from (one epoch, or the run)
    batch_size: int
    pooling_factor: float  # mean ids per sample
    distinct_per_batch: dict[str, float]  # mean, p50, p99, max over the profiled batches
    cold_misses: int
    distinct_ids: int
    histogram: list[int]  # log2 buckets of warm distances (bucket k: [2^k, 2^(k+1)))
    hit_rate_at: dict[str, float]  # share of rows ("0.01") -> hit rate
    rows_for: dict[str, int | None]  # hit-rate target ("0.9") -> rows (None: unreachable)
    curve: list[tuple[int, float]] = field(default_factory=list)  # (cache rows, hit rate)

    @property
    def sampled(self) -> bool:
        return self.lookups < self.total_lookups

    def hit_rate(self, cache_rows: float) -> float:
        """Predicted LRU hit rate of ``cache_rows`` rows: the stored curve, linear in
        log(rows) between its points; every row (``num_embeddings``) hits all but the
        cold misses."""
        if cache_rows < 1 or not self.curve:
            return 0.0
        rows = np.array([r for r, _ in self.curve], dtype=np.float64)
        rates = np.array([h for _, h in self.curve], dtype=np.float64)
        return float(np.interp(math.log(cache_rows), np.log(rows), rates))

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["curve"] = [[int(r), float(h)] for r, h in self.curve]
        out["sampled"] = self.sampled
        return out

    @staticmethod
    def from_dict(data: dict[str, Any]) -> TableLocality:
        values = dict(data)
        values.pop("sampled", None)
        values["curve"] = [(int(r), float(h)) for r, h in values.get("curve", [])]
        return TableLocality(**values)


def summarize(
    name: str,
    num_embeddings: int,
    ids: np.ndarray,
    *,
    batch_size: int,
    pooling_factor: float,
    distinct_per_batch: np.ndarray,
    total_lookups: int,
) -> TableLocality:
    """Stack distances of ``ids`` (the profiled stream) and everything derived from them."""
    distances = stack_distances(ids)
    rows = max(int(num_embeddings), 1)
    at = {f"{f:g}": float(hit_curve(distances, np.array([max(1, round(f * rows))]))[0])
          for f in CACHE_FRACTIONS}  # fmt: skip
    need = {f"{t:g}": rows_for_hit_rate(distances, t) for t in HIT_TARGETS}
    sizes = np.unique(np.round(np.geomspace(1, rows, CURVE_POINTS)).astype(np.int64))
    curve = list(zip(sizes.tolist(), hit_curve(distances, sizes).tolist()))
    return TableLocality(
        name=name,
        num_embeddings=int(num_embeddings),
        lookups=len(ids),
        total_lookups=total_lookups,
        batch_size=batch_size,
        pooling_factor=pooling_factor,
        distinct_per_batch={
            "mean": float(np.mean(distinct_per_batch)) if len(distinct_per_batch) else 0.0,
            "p50": _percentile(distinct_per_batch, 0.5),
            "p99": _percentile(distinct_per_batch, 0.99),
            "max": float(np.max(distinct_per_batch)) if len(distinct_per_batch) else 0.0,
        },
        cold_misses=int(np.count_nonzero(distances == 0)),
        distinct_ids=len(np.unique(ids)),
        histogram=log2_histogram(distances),
        hit_rate_at=at,
        rows_for=need,
        curve=curve,
    )
