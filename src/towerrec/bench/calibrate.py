"""Measure this machine for the planner's cost model (``towerrec plan --calibrate``).

Two measurements, fitted to the analytic model of planner/cost.py::

    kernel       the real EmbeddingBagCollection (one fused kernel per width) forward +
                 backward with the fused optimizer, on groups of 1..8 tables of varied
                 rows, dims and pooling factors; non-negative least squares of
                 seconds ~ kernels*k0 + tables*k1 + lookup bytes/bw_l + update bytes/bw_u
    all-to-all   2 gloo processes exchanging 4 KiB .. 8 MiB: seconds ~ latency + bytes/bw

The result is a JSON with the fitted ``constants`` (what ``CostConstants.load``
reads), the raw samples and the fit's relative error. ``measure_device`` (one
device's shards, timed) also serves the learned cost model and the measured
planner benchmark.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from towerrec.bench.common import machine_info
from towerrec.modules.embedding_bag import EmbeddingBagCollection
from towerrec.modules.tables import TableConfig
from towerrec.optim.sparse import EmbeddingOptimizerConfig
from towerrec.planner.cost import CostConstants, CostModel
from towerrec.planner.stats import TableStats
from towerrec.planner.topology import PRESETS
from towerrec.sharding import ShardingType
from towerrec.sparse import KeyedJaggedTensor

__all__ = [
    "analytic_device_seconds",
    "calibrate",
    "device_step",
    "kernel_features",
    "make_ids",
    "measure_all_to_all",
    "measure_device",
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


def device_step(
    shards: Sequence[tuple[TableStats, int, int]],
    batch: int,
    backend: str = "auto",
    seed: int = 0,
    device: str = "cpu",
):
    """A function running one forward + backward + fused update of a device holding
    ``shards`` = (stats, rows, cols), on a fixed batch of ``batch`` samples."""
    rng = np.random.default_rng(seed)
    tables, values, lengths = [], [], []
    for i, (stats, rows, cols) in enumerate(shards):
        tables.append(TableConfig(f"s{i}", rows, cols))
        lens, ids = make_ids(stats, batch, rows, rng)
        lengths.append(lens)
        values.append(ids)
    ebc = EmbeddingBagCollection(
        tables, EmbeddingOptimizerConfig(lr=0.01), backend=backend, device=device
    )
    features = KeyedJaggedTensor(
        [t.name for t in tables],
        torch.from_numpy(np.concatenate(values)),
        torch.from_numpy(np.concatenate(lengths)),
    )
    features = features.select(ebc.feature_names).to(device)
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
    from towerrec.planner.suites import zipf_hot_shares

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


def _fit_kernel(features: np.ndarray, seconds: np.ndarray) -> np.ndarray:
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


def _all_to_all_worker(rank: int, world: int, port: int, sizes, reps: int, queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    out = []
    for nbytes in sizes:
        numel = max(world, nbytes // 4 // world * world)
        send, recv = torch.ones(numel), torch.empty(numel)
        times = []
        for r in range(reps + 2):
            dist.barrier()
            start = time.perf_counter()
            dist.all_to_all_single(recv, send)
            if r >= 2:
                times.append(time.perf_counter() - start)
        # Bytes each rank sends to the others: (world-1)/world of its buffer.
        out.append((numel * 4 * (world - 1) / world, statistics.median(times)))
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def measure_all_to_all(
    sizes: Sequence[int] = (4096, 65536, 1 << 20, 8 << 20), reps: int = 5
) -> list[tuple[float, float]]:
    """(bytes sent per rank, seconds) of gloo all_to_all between 2 local processes."""
    import torch.multiprocessing as mp

    from towerrec.bench.torchrec_ref import _free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_all_to_all_worker, args=(r, 2, port, list(sizes), reps, queue))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    import queue as queue_module

    deadline = time.monotonic() + 300
    while True:
        try:
            samples = queue.get(timeout=1)
            break
        except queue_module.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(
                    f"all-to-all measurement failed (worker exit codes {dead or 'timeout'})"
                ) from None
    for p in procs:
        p.join(timeout=60)
    return samples


def random_device(rng: np.random.Generator, tag: str, max_tables: int = 8):
    """A random group of 1..max_tables whole tables (stats, rows, cols)."""
    size = int(rng.integers(1, max_tables + 1))
    tables = [random_table(rng, f"{tag}t{i}") for i in range(size)]
    return [(s, s.num_embeddings, s.embedding_dim) for s in tables]


def _kernel_samples(rng, num_groups: int, batch: int, reps: int, backend="auto", device="cpu"):
    samples = []
    for g in range(num_groups):
        # A third single tables (they pin the per-table terms), the rest groups of up to 8.
        shards = random_device(rng, f"g{g}", 1 if g < num_groups // 3 else 8)
        seconds = measure_device(shards, batch, reps, backend, seed=g, device=device)
        samples.append((kernel_features(shards, batch), seconds))
    return samples


def calibrate(
    num_groups: int = 24,
    batch: int = 2048,
    reps: int = 5,
    seed: int = 0,
    collectives: bool = True,
    backend: str = "auto",
    device: str = "cpu",
) -> dict:
    """Measure and fit; returns the calibration JSON (``constants`` + samples + fit error).

    ``device = "cuda"`` times the kernels on the GPU (collectives need 2 processes
    on one machine: gloo on CPU; pass ``collectives=False`` to keep the topology's links)."""
    rng = np.random.default_rng(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one rank, one core: and no spinning threads on a shared CPU
    try:
        samples = _kernel_samples(rng, num_groups, batch, reps, backend, device)
    finally:
        torch.set_num_threads(threads)
    x = np.stack([f for f, _ in samples])
    y = np.array([s for _, s in samples])
    coef = _fit_kernel(x, y)
    k0, k1, per_id, per_lookup_byte, per_row, per_update_byte = coef
    predicted = x @ coef
    kernel_error = float(np.mean(np.abs(predicted - y) / y))
    cpu = PRESETS["cpu"]
    constants = {
        "kernel_overhead_s": float(k0),
        "table_overhead_s": float(k1),
        "lookup_s_per_id": float(per_id),
        "update_s_per_row": float(per_row),
        "lookup_bandwidth": float(1 / per_lookup_byte) if per_lookup_byte > 0 else 1e15,
        "update_bandwidth": float(1 / per_update_byte) if per_update_byte > 0 else 1e15,
        "source": f"calibrated {machine_info()['date']} on {machine_info()['cpu']}",
    }
    if torch.device(device).type == "cuda":
        constants["source"] = (
            f"calibrated {machine_info()['date']} on {torch.cuda.get_device_name()} "
            f"({backend} kernel)"
        )
    result: dict = {"machine": machine_info(), "batch": batch, "device": device}
    if collectives:
        a2a = measure_all_to_all(reps=reps)
        sent = np.array([b for b, _ in a2a])
        secs = np.array([s for _, s in a2a])
        # Latency: the smallest message; bandwidth: what the largest adds on top of it.
        latency = float(secs[np.argmin(sent)])
        extra = float(secs[np.argmax(sent)]) - latency
        bandwidth = (
            float((sent.max() - sent.min()) / extra) if extra > 0 else cpu.intra_host_bandwidth
        )
        constants.update(
            collective_latency_s=float(max(latency, 0.0)),
            intra_host_bandwidth=bandwidth,
            # One machine has no second host: loopback stands for both links.
            cross_host_bandwidth=bandwidth,
        )
        result["all_to_all"] = [{"bytes": b, "seconds": s} for b, s in a2a]
    result["constants"] = {**vars(CostConstants()), **constants}
    CostConstants(**result["constants"])  # validate
    result["kernel_samples"] = [
        {
            **{name: float(value) for name, value in zip(FEATURES, f)},
            "seconds": s,
        }
        for f, s in samples
    ]
    result["kernel_fit_mean_rel_error"] = kernel_error
    return result


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
