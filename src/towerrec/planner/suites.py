"""Synthetic table suites shaped like Meta's public DLRM sharding data set.

The data set behind AutoShard, DreamShard and NeuroShard holds 856 embedding
tables of a production model; the papers publish its ranges, not its rows:
hash sizes from thousands to tens of millions of rows, pooling factors from 1
(single-hot) to over 100, dims from 4 to 128, and strongly skewed accesses.
``dlrm_like_suite`` draws tables with those ranges::

    rows     10 ** U(3, 7.5), log-uniform, 3/4 of them below 1M
    pooling  1 for 30% of tables; else 1 + lognormal (median ~6, tail > 100), capped at 200
    dim      4, 8, 16, 32, 64 or 128 (weights 10, 15, 25, 25, 15, 10 %)
    skew     Zipf exponent U(0.6, 1.3): hot-row shares follow from it

``planning_tasks`` samples tasks (subsets of a suite) as the papers do, e.g.
100 tasks of 10 to 60 tables.
"""

from __future__ import annotations

import math

import numpy as np

from towerrec.planner.stats import TableStats

__all__ = ["dlrm_like_suite", "planning_tasks", "zipf_hot_shares"]

DIMS = (4, 8, 16, 32, 64, 128)
DIM_WEIGHTS = (0.10, 0.15, 0.25, 0.25, 0.15, 0.10)


def _harmonic(n: float, alpha: float) -> float:
    """sum_{i=1..n} i^-alpha: exact to 1,000, then the integral (Euler-Maclaurin)."""
    head = min(int(n), 1000)
    total = float(np.sum(np.arange(1, head + 1, dtype=np.float64) ** -alpha))
    if n > head:
        a, b = head + 0.5, n + 0.5
        total += (
            math.log(b / a)
            if abs(alpha - 1) < 1e-9
            else (b ** (1 - alpha) - a ** (1 - alpha)) / (1 - alpha)
        )
    return total


def zipf_hot_shares(rows: int, alpha: float) -> tuple[float, float]:
    """Share of Zipf(alpha) lookups over ``rows`` rows that hit the hottest 1% and 10%."""
    whole = _harmonic(rows, alpha)
    top1 = _harmonic(max(1, math.ceil(0.01 * rows)), alpha)
    top10 = _harmonic(max(1, math.ceil(0.10 * rows)), alpha)
    return min(top1 / whole, 1.0), min(top10 / whole, 1.0)


def dlrm_like_suite(
    num_tables: int = 856, seed: int = 0, batch_size: int = 1024, prefix: str = "t"
) -> list[TableStats]:
    rng = np.random.default_rng(seed)
    out = []
    for t in range(num_tables):
        rows = int(10 ** rng.uniform(3, 7.5))
        if rng.random() < 0.3:
            pooling = 1.0
        else:
            pooling = float(min(1 + rng.lognormal(math.log(5), 1.1), 200))
        dim = int(rng.choice(DIMS, p=DIM_WEIGHTS))
        alpha = float(rng.uniform(0.6, 1.3))
        hot1, hot10 = zipf_hot_shares(rows, alpha)
        p99 = pooling if pooling == 1 else min(pooling * 3.5, 1000.0)
        out.append(
            TableStats(
                name=f"{prefix}{t}",
                num_embeddings=rows,
                embedding_dim=dim,
                pooling_factor=round(pooling, 3),
                pooling_p50=round(pooling * (1 if pooling == 1 else 0.8), 3),
                pooling_p99=round(p99, 3),
                pooling_max=round(p99 * (1 if pooling == 1 else 2), 3),
                hot1_share=hot1,
                hot10_share=hot10,
                batch_size=batch_size,
            )
        )
    return out


def planning_tasks(
    suite: list[TableStats], num_tasks: int, min_tables: int, max_tables: int, seed: int = 0
) -> list[list[TableStats]]:
    """``num_tasks`` random subsets of ``suite`` with ``min..max`` tables each."""
    if not 1 <= min_tables <= max_tables <= len(suite):
        raise ValueError(
            f"need 1 <= min_tables {min_tables} <= max_tables {max_tables} <= suite size "
            f"{len(suite)}"
        )
    rng = np.random.default_rng([seed, 1])
    tasks = []
    for _ in range(num_tasks):
        size = int(rng.integers(min_tables, max_tables + 1))
        tasks.append([suite[i] for i in sorted(rng.choice(len(suite), size, replace=False))])
    return tasks
