"""``towerrec bench locality``: time of the exact LRU stack distances
(``data/locality.py``) against the stream length, beside the sequential Fenwick-tree
sweep it replaces, which it must equal.

Streams: ids drawn Zipf(``--alpha``) over ``--rows`` permuted rows, the shape of a
recommendation table's lookups. For each ``--sizes`` length: median seconds of
``stack_distances`` over ``--reps`` runs and ids per second. The Fenwick sweep (a
Python loop: one tree query and two updates per id) runs on the first
``--fenwick-ids`` ids and its distances are compared with the vectorised ones.

``--validate`` (with ``--set data.source=...``) asks how well a profile predicts:
over two passes of a finite data set, the hit rate the first pass's curve gives
(what ``towerrec data profile`` reports: a cold cache) against an LRU cache's in
the second pass, warm from the first, at 1%, 10% and 50% of each table's rows.
``--real-cache`` adds the embedding layer's cache itself: for each share, a run of
``towerrec train`` over the first pass's whole batches with every table cached
(``embedding.memory = "cached"``, ``cache_fraction`` = the share, host backing) and
no evaluation before its end; its summary's training misses per table against the
curve of the same ids (measured hit rate: ``1 - misses / ids``, every lookup of an id
counted as the profile counts it). A share whose cache cannot hold a batch's distinct
rows, or that holds the whole table, leaves that table in memory and is reported.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from towerrec.bench.common import (
    Benchmark,
    add_overrides_argument,
    comma_list,
    machine_info,
    peak_rss_mb,
)
from towerrec.build.sources import build_source
from towerrec.config import load_config
from towerrec.data.locality import stack_distances
from towerrec.workflows.training import train

__all__ = [
    "BENCHMARK",
    "fenwick_stack_distances",
    "run_locality_benchmark",
    "two_epoch_streams",
    "validate_curve",
]


def fenwick_stack_distances(ids: np.ndarray) -> np.ndarray:
    """The textbook sweep: a Fenwick tree over access times holding a 1 at each id's
    latest access; distance = 1 + the tree's sum over (last access, now)."""
    n = len(ids)
    tree = [0] * (n + 1)
    last: dict[int, int] = {}
    out = np.zeros(n, dtype=np.int64)

    def add(i: int, delta: int) -> None:
        i += 1
        while i <= n:
            tree[i] += delta
            i += i & -i

    def prefix(i: int) -> int:  # sum over [0, i)
        total = 0
        while i > 0:
            total += tree[i]
            i -= i & -i
        return total

    for t, x in enumerate(ids.tolist()):
        p = last.get(x)
        if p is not None:
            out[t] = 1 + prefix(t) - prefix(p + 1)
            add(p, -1)
        add(t, 1)
        last[x] = t
    return out


def zipf_stream(n: int, rows: int, alpha: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.permutation(rows)[(rng.zipf(alpha, n) - 1) % rows]


def run_locality_benchmark(
    sizes: tuple[int, ...] = (100_000, 1_000_000, 4_000_000),
    rows: int = 10_000_000,
    alpha: float = 1.05,
    reps: int = 3,
    fenwick_ids: int = 200_000,
) -> dict[str, Any]:
    if not sizes or min(sizes) < 1 or reps < 1 or rows < 1 or fenwick_ids < 0:
        raise ValueError("--sizes, --reps and --rows must be >= 1, --fenwick-ids >= 0")
    load_start = list(os.getloadavg())
    stream = zipf_stream(max(sizes), rows, alpha)
    results = []
    for n in sizes:
        ids = stream[:n]
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            distances = stack_distances(ids)
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        results.append(
            {
                "ids": n,
                "distinct": len(np.unique(ids)),
                "cold_share": float(np.mean(distances == 0)),
                "seconds": seconds,
                "ids_per_s": n / seconds,
            }
        )
    fenwick: dict[str, Any] = {}
    if fenwick_ids:
        ids = stream[:fenwick_ids]
        start = time.perf_counter()
        reference = fenwick_stack_distances(ids)
        loop_s = time.perf_counter() - start
        start = time.perf_counter()
        vectorised = stack_distances(ids)
        fast_s = time.perf_counter() - start
        fenwick = {
            "ids": fenwick_ids,
            "python_fenwick_seconds": loop_s,
            "vectorised_seconds": fast_s,
            "speedup": loop_s / fast_s,
            "equal": bool(np.array_equal(reference, vectorised)),
        }
    return {
        "alpha": alpha,
        "rows": rows,
        "reps": reps,
        "stack_distances": results,
        "fenwick_reference": fenwick,
        "peak_rss_mb": peak_rss_mb(),
        "machine": machine_info(),
        "load_average_start": load_start,
        "load_average_end": list(os.getloadavg()),
    }


def two_epoch_streams(source: Any, batch_size: int) -> dict[str, tuple[np.ndarray, int]]:
    """Each table's ids over two passes of a finite source's training split, in
    training order, and where the second pass starts."""
    rows = source.train_rows
    if rows is None:
        raise ValueError(
            "--validate needs data with a finite training split: --set data.source=movielens, "
            "or data.source=cache with data.path=DIR"
        )
    parts: dict[str, list[np.ndarray]] = {f.name: [] for f in source.schema.sparse}
    split = dict.fromkeys(parts, 0)
    seen = 0
    batches = source.train_batches(batch_size)
    while seen < 2 * rows:
        batch = next(batches)
        take = min(len(batch.labels), 2 * rows - seen)
        first = max(0, min(take, rows - seen))  # samples of this batch in the first pass
        for name, jagged in batch.sparse.to_dict().items():
            lengths = jagged.lengths.numpy()[:take]
            parts[name].append(jagged.values.numpy()[: int(lengths.sum())])
            split[name] += int(lengths[:first].sum())
        seen += take
    return {name: (np.concatenate(p), split[name]) for name, p in parts.items()}


def validate_curve(
    source: Any, batch_size: int, fractions: tuple[float, ...] = (0.01, 0.1, 0.5)
) -> list[dict[str, Any]]:
    """Per table and cache share: the hit rate a profile of the first pass predicts
    (its LRU curve: a cold cache) against the hit rate of an LRU cache of that size in
    the second pass, warm from the first."""
    out = []
    sizes = {f.name: f.num_embeddings for f in source.schema.sparse}
    for name, (ids, split) in two_epoch_streams(source, batch_size).items():
        distances = stack_distances(ids)
        first, second = distances[:split], distances[split:]
        for share in fractions:
            rows = max(1, round(share * sizes[name]))
            out.append(
                {
                    "table": name,
                    "share": share,
                    "rows": rows,
                    "predicted": float(np.mean((first > 0) & (first <= rows))),
                    "second_pass": float(np.mean((second > 0) & (second <= rows))),
                    "cold_share_first_pass": float(np.mean(first == 0)),
                }
            )
    return out


def real_cache_rates(
    overrides: list[str],
    source: Any,
    batch_size: int,
    fractions: tuple[float, ...] = (0.01, 0.1, 0.5),
) -> list[dict[str, Any]]:
    """Per table and cache share: the hit rate the profile's curve predicts for the first
    pass's whole batches (a cold cache) against the cache's measured in training on
    them (module doc)."""
    rows = source.train_rows
    if rows is None or rows < batch_size:
        raise ValueError("--real-cache needs a finite training split of at least one batch")
    steps = rows // batch_size
    parts: dict[str, list[np.ndarray]] = {f.name: [] for f in source.schema.sparse}
    batches = source.train_batches(batch_size)
    for _ in range(steps):
        for name, jagged in next(batches).sparse.to_dict().items():
            parts[name].append(jagged.values.numpy())
    streams = {name: np.concatenate(p) for name, p in parts.items()}
    widest = {name: max(np.unique(b).size for b in p) for name, p in parts.items()}
    sizes = {f.name: f.num_embeddings for f in source.schema.sparse}
    out: list[dict[str, Any]] = []
    for share in fractions:
        slots = {name: max(1, math.ceil(share * sizes[name])) for name in streams}
        cached = [n for n in streams if widest[n] <= slots[n] < sizes[n]]
        summary: dict[str, Any] = {}
        if cached:
            tables = [
                f"embedding.tables.{n}.{key}"
                for n in cached
                for key in ("memory=cached", f"cache_fraction={share}")
            ]
            config = load_config(
                None,
                [
                    *overrides,
                    f"train.batch_size={batch_size}",
                    f"train.steps={steps}",
                    "train.eval_every=0",
                    "train.progress=false",
                    "embedding.cache_min_rows=0",
                    "embedding.backing=host",
                    *tables,
                ],
            )
            with tempfile.TemporaryDirectory(prefix="towerrec-locality-") as run:
                summary = train(config, Path(run))
        measured = summary.get("cache", {}).get("tables", {})
        for name, ids in streams.items():
            row: dict[str, Any] = {"table": name, "share": share, "rows": slots[name]}
            distances = stack_distances(ids)
            row["predicted"] = float(np.mean((distances > 0) & (distances <= slots[name])))
            if name in measured:
                misses = measured[name]["train_lookups"] - measured[name]["train_hits"]
                row["measured"] = 1.0 - misses / len(ids)
                row["gap"] = row["measured"] - row["predicted"]
            elif slots[name] >= sizes[name]:
                row["skipped"] = "the cache holds the whole table"
            else:
                row["skipped"] = f"a batch touches {widest[name]} distinct rows"
            out.append(row)
    return out


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sizes", type=comma_list, default=("100000", "1000000", "4000000"), help="stream lengths"
    )
    parser.add_argument("--rows", type=int, default=10_000_000, help="id space of the stream")
    parser.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent of the ids")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--fenwick-ids", type=int, default=200_000, help="ids for the Python Fenwick sweep"
    )
    parser.add_argument(
        "--validate",
        action="store_true",
        help="instead: a profile's predicted hit rates against a warm LRU cache's in the "
        "second pass over the config's data (finite: --set data.source=movielens)",
    )
    parser.add_argument(
        "--real-cache",
        action="store_true",
        help="with --validate: also train with memory = 'cached' at each share and compare "
        "the cache's measured hit rate with the profile's",
    )
    parser.add_argument(
        "--shares",
        type=comma_list,
        default=("0.01", "0.1", "0.5"),
        help="for --validate: cache sizes as shares of each table's rows",
    )
    parser.add_argument("--batch-size", type=int, help="for --validate (default: the config's)")
    add_overrides_argument(parser, "config override for --validate (data.source=..., ...)")


def _run(args: argparse.Namespace) -> dict:
    if args.real_cache and not args.validate:
        raise ValueError("--real-cache goes with --validate")
    if args.validate:
        loadavg_start = list(os.getloadavg())
        config = load_config(None, args.overrides)
        source = build_source(config.data)
        batch_size = args.batch_size or config.train.batch_size
        try:
            shares = tuple(float(x) for x in args.shares)
        except ValueError:
            raise ValueError(f"--shares takes numbers, got {','.join(args.shares)}") from None
        if not all(0 < x <= 1 for x in shares):
            raise ValueError(f"--shares must lie in (0, 1], got {','.join(args.shares)}")
        return {
            "data": config.data.source,
            "path": config.data.path,
            "batch_size": batch_size,
            "train_rows": source.train_rows,
            "tables": validate_curve(source, batch_size, shares),
            **(
                {"real_cache": real_cache_rates(args.overrides, source, batch_size, shares)}
                if args.real_cache
                else {}
            ),
            "machine": machine_info(),
            "load_average_start": loadavg_start,
            "load_average": list(os.getloadavg()),
        }
    try:
        sizes = tuple(int(s) for s in args.sizes)
    except ValueError:
        raise ValueError(f"--sizes takes integers, got {','.join(args.sizes)}") from None
    return run_locality_benchmark(sizes, args.rows, args.alpha, args.reps, args.fenwick_ids)


BENCHMARK = Benchmark(
    "exact LRU stack distances: seconds against stream length, vs the Python Fenwick sweep",
    _add_arguments,
    _run,
)
