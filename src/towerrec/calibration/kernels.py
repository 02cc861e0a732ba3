"""Timing the real embedding kernel on synthetic devices, and the features the
planner's analytic compute cost is linear in.

A *device* is a list of shards ``(stats, rows, cols)``: what one rank holds.
``device_step`` builds the real EmbeddingBagCollection for it (one fused kernel
per width) and a batch drawn with each table's pooling factor and hot-row
shares; ``measure_device`` times forward + backward + the fused update.
``kernel_features`` are the terms of planner/cost.py's compute cost, which
``fit_kernel`` fits to measured seconds; ``analytic_device_seconds`` is the
analytic model's prediction for the same device.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from towerrec.modules.embedding_bag import EmbeddingBagCollection
from towerrec.modules.tables import TableConfig
from towerrec.optim.sparse import EmbeddingOptimizerConfig
from towerrec.planner.cost import CostModel
from towerrec.planner.stats import TableStats
from towerrec.planner.suites import zipf_hot_shares
from towerrec.sharding import ShardingType
from towerrec.sparse import KeyedJaggedTensor

# Every weight of a measured device: a step's time does not depend on the values.
INIT_VALUE = 0.01

__all__ = [
    "FEATURES",
    "analytic_device_seconds",
    "build_device",
    "device_step",
    "fit_kernel",
    "kernel_features",
    "kernel_samples",
    "make_ids",
    "measure_device",
    "random_device",
    "random_table",
]


def make_ids(stats: TableStats, batch: int, rows: int, rng: np.random.Generator):
    """Lengths [B] and ids drawn with the table's pooling factor and hot shares
    (three buckets: hottest 1%, next 9%, the rest; uniform inside each), over ``rows`` rows."""
    pf = stats.pooling_factor
    lengths = rng.poisson(max(pf - 1, 0), size=batch) + 1 if pf >= 1 else rng.binomial(1, pf, batch)
    n = int(lengths.sum())
    k1, k10 = max(1, math.ceil(0.01 * rows)), max(1, math.ceil(0.10 * rows))
    bucket = rng.choice(
        3, size=n, p=[stats.hot1_share, stats.hot10_share - stats.hot1_share, 1 - stats.hot10_share]
    )
    lo = np.array([0, k1, k10])[bucket]
    hi = np.array([k1, k10, rows])[bucket]
    ids = lo + (rng.random(n) * np.maximum(hi - lo, 1)).astype(np.int64)
    ids = np.minimum(ids, rows - 1)
    perm = rng.permutation(rows)
    return lengths.astype(np.int64), perm[ids]


def build_device(
    shards: Sequence[tuple[TableStats, int, int]],
    batch: int,
    backend: str = "auto",
    seed: int = 0,
    device: str = "cpu",
) -> tuple[EmbeddingBagCollection, KeyedJaggedTensor]:
    """The real EmbeddingBagCollection of a device holding ``shards`` = (stats, rows,
    cols) (one fused kernel per width) and a fixed batch of ``batch`` samples for it."""
    rng = np.random.default_rng(seed)
    tables, values, lengths = [], [], []
    for i, (stats, rows, cols) in enumerate(shards):
        tables.append(TableConfig(f"s{i}", rows, cols))
        lens, ids = make_ids(stats, batch, rows, rng)
        lengths.append(lens)
        values.append(ids)
    ebc = EmbeddingBagCollection(
        tables, EmbeddingOptimizerConfig(lr=0.01), backend=backend, device=device, materialize=False
    ).materialize(init=False)
    # One constant, not the seeded random init (most of a device's build time).
    for weight in ebc.table_weights().values():
        weight.fill_(INIT_VALUE)
    ebc.zero_optimizer_states()
    features = KeyedJaggedTensor(
        [t.name for t in tables],
        torch.from_numpy(np.concatenate(values)),
        torch.from_numpy(np.concatenate(lengths)),
    )
    return ebc, features.select(ebc.feature_names).to(device)


def device_step(
    shards: Sequence[tuple[TableStats, int, int]],
    batch: int,
    backend: str = "auto",
    seed: int = 0,
    device: str = "cpu",
):
    """A function running one forward + backward + fused update of a device holding
    ``shards`` = (stats, rows, cols), on a fixed batch of ``batch`` samples."""
    ebc, features = build_device(shards, batch, backend, seed, device)
    cuda = torch.device(device).type == "cuda"

    def step(_: int = 0) -> None:
        out = ebc(features).values()
        out.backward(torch.ones_like(out))
        if cuda:
            torch.cuda.synchronize()

    return step


def measure_device(
    shards: Sequence[tuple[TableStats, int, int]],
    batch: int,
    reps: int = 5,
    backend: str = "auto",
    seed: int = 0,
    device: str = "cpu",
) -> float:
    """Median seconds of ``device_step`` over ``reps`` runs (after 2 untimed)."""
    step = device_step(shards, batch, backend, seed, device)
    times = []
    for r in range(reps + 2):
        start = time.perf_counter()
        step()
        if r >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def random_table(rng: np.random.Generator, name: str, max_rows: int = 200_000) -> TableStats:
    rows = int(10 ** rng.uniform(2, math.log10(max_rows)))
    pf = float(1 if rng.random() < 0.3 else round(1 + rng.lognormal(math.log(4), 0.9), 2))
    pf = min(pf, 60.0)
    alpha = rng.uniform(0.6, 1.2)
    hot1, hot10 = zipf_hot_shares(rows, alpha)
    return TableStats(
        name,
        rows,
        int(rng.choice([4, 8, 16, 32, 64, 128])),
        pooling_factor=pf,
        pooling_p50=pf,
        pooling_p99=pf,
        pooling_max=pf,
        hot1_share=hot1,
        hot10_share=hot10,
    )


FEATURES = ("kernels", "shards", "ids", "lookup_bytes", "rows", "update_bytes")


def kernel_features(shards: Sequence[tuple[TableStats, int, int]], batch: int) -> np.ndarray:
    """``FEATURES`` of one device's shards, the terms of planner/cost.py's compute cost."""
    v, state = 4, 4
    ids = lookup = rows_touched = update = 0.0
    for s, rows, cols in shards:
        fraction = rows / s.num_embeddings
        n = s.lookups(batch) * fraction
        touched = s.distinct(batch, fraction)
        ids += n
        lookup += n * cols * v
        rows_touched += touched
        update += batch * cols * v + touched * (2 * cols * v + state)
    return np.array(
        [len({c for _, _, c in shards}), len(shards), ids, lookup, rows_touched, update]
    )


def fit_kernel(features: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Non-negative least squares of relative error (each sample weighted by 1 / its
    time), exact: the best least-squares fit over every subset of the coefficients."""
    a, b = features / seconds[:, None], np.ones_like(seconds)
    best, best_loss = np.zeros(a.shape[1]), float(b @ b)
    for mask in range(1, 1 << a.shape[1]):
        cols = [i for i in range(a.shape[1]) if mask >> i & 1]
        coef, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
        if (coef < 0).any():
            continue
        loss = float(np.sum((a[:, cols] @ coef - b) ** 2))
        if loss < best_loss:
            best = np.zeros(a.shape[1])
            best[cols] = coef
            best_loss = loss
    return best


def random_device(rng: np.random.Generator, tag: str, max_tables: int = 8):
    """A random group of 1..max_tables whole tables (stats, rows, cols)."""
    size = int(rng.integers(1, max_tables + 1))
    tables = [random_table(rng, f"{tag}t{i}") for i in range(size)]
    return [(s, s.num_embeddings, s.embedding_dim) for s in tables]


def kernel_samples(rng, num_groups: int, batch: int, reps: int, backend="auto", device="cpu"):
    samples = []
    for g in range(num_groups):
        # A third single tables (they pin the per-table terms), the rest groups of up to 8.
        shards = random_device(rng, f"g{g}", 1 if g < num_groups // 3 else 8)
        seconds = measure_device(shards, batch, reps, backend, seed=g, device=device)
        samples.append((kernel_features(shards, batch), seconds))
    return samples


def analytic_device_seconds(
    model: CostModel, shards: Sequence[tuple[TableStats, int, int]], batch: int
) -> float:
    """The analytic model's kernel time (no communication) for one device's shards
    processing ``batch`` samples."""
    model = CostModel(replace(model.topology, hosts=1, ranks_per_host=1), model.constants, batch)
    total = 0.0
    for s, rows, cols in shards:
        kind = ShardingType.TABLE_WISE if rows == s.num_embeddings else ShardingType.ROW_WISE
        total += model.shard_cost(s, kind, rows, cols).compute
    return total + model.device_overhead(len({c for _, _, c in shards}), len(shards))
