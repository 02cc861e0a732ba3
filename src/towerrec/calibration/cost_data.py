"""Collecting measured cost data (planner/costdata.py) on this machine.

Two kinds of samples, both drawn at random from ``seed``::

    compute   a device of 1..12 random tables (random_table), each table either whole
              or one column shard of it split in 2 / 4 (NeuroShard's augmentation: random
              table combinations and column splits); the real EmbeddingBagCollection
              (one fused kernel per width) times forward and backward + fused update
              separately, the fastest of ``reps`` runs after one untimed run (on a shared
              CPU the fastest run is the least disturbed: repeated collections of the same
              device differ by ~10% this way, by ~30% with the median)
    comm      2 gloo processes on loopback: rank r holds tables of ``dims[r]`` total
              output dims and sends each rank its share of the pooled outputs
              (all_to_all_single with uneven splits), then the gradients come back the
              same way; seconds = both exchanges, the slower rank's fastest run

``towerrec plan collect-costs`` writes the file; a few minutes on 2 cores by default.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from towerrec import hardware
from towerrec.calibration.kernels import build_device, random_table
from towerrec.calibration.machine import machine_info
from towerrec.distributed.launch import spawn_world
from towerrec.distributed.mesh import Topology
from towerrec.modules.kernels.backend import resolve_backend
from towerrec.planner.costdata import CommSample, ComputeSample, CostData, Shard

__all__ = ["collect_cost_data", "cpu_flags", "random_dims", "random_split_device"]

log = logging.getLogger("towerrec")

# x86's, then AArch64's (NEON, SVE, its bf16 and int8 dots)
_SIMD_FLAGS = (
    "sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
    "asimd", "sve", "bf16", "i8mm",
)  # fmt: skip


def cpu_flags() -> list[str]:
    """The SIMD flags of /proc/cpuinfo that matter to embedding kernels."""
    have = hardware.cpu_flags()
    return [flag for flag in _SIMD_FLAGS if flag in have]


def random_split_device(
    rng: np.random.Generator, tag: str, max_tables: int = 12, max_rows: int = 100_000
) -> list[Shard]:
    """1..max_tables random tables, each whole or one column shard of a 2- or 4-way split."""
    shards = []
    for i in range(int(rng.integers(1, max_tables + 1))):
        table = random_table(rng, f"{tag}t{i}", max_rows)
        parts = [p for p in (1, 2, 4) if table.embedding_dim // p >= 4]
        split = int(rng.choice(parts, p=_split_weights(len(parts))))
        shards.append((table, table.num_embeddings, table.embedding_dim // split))
    return shards


def _split_weights(n: int) -> list[float]:
    weights = [2.0, 1.0, 1.0][:n]
    return [w / sum(weights) for w in weights]


def _time_compute(
    shards: Sequence[Shard], batch: int, reps: int, backend: str, seed: int
) -> tuple[float, float]:
    ebc, features = build_device(shards, batch, backend, seed)
    forward, backward = [], []
    for r in range(reps + 1):
        start = time.perf_counter()
        out = ebc(features).values()
        middle = time.perf_counter()
        out.backward(torch.ones_like(out))
        end = time.perf_counter()
        if r >= 1:
            forward.append(middle - start)
            backward.append(end - middle)
    return min(forward), min(backward)


def _time_comm(topology: Topology, samples: Sequence[Sequence[int]], batch: int, reps: int):
    """On every rank: the fastest of ``reps`` forward + backward exchanges, per sample."""
    torch.set_num_threads(1)
    rank, world = topology.rank, topology.world_size
    out = []
    for dims in samples:
        send_splits = [batch * dims[rank]] * world  # my pooled outputs, a slice to each rank
        recv_splits = [batch * d for d in dims]  # every rank's outputs for my samples
        send, recv = torch.ones(sum(send_splits)), torch.empty(sum(recv_splits))
        times = []
        for r in range(reps + 1):
            dist.barrier()
            start = time.perf_counter()
            dist.all_to_all_single(recv, send, recv_splits, send_splits)
            dist.all_to_all_single(send, recv, send_splits, recv_splits)  # gradients back
            if r >= 1:
                times.append(time.perf_counter() - start)
        out.append(min(times))
    return out


def random_dims(rng: np.random.Generator, world: int) -> list[int]:
    """Per-rank total output dims: log-uniform 4..2048 in multiples of 4, now and then 0."""
    return [
        0 if rng.random() < 0.05 else 4 * max(1, int(10 ** rng.uniform(0, math.log10(512))))
        for _ in range(world)
    ]


def collect_cost_data(
    num_devices: int = 400,
    num_comm: int = 60,
    batch: int = 2048,
    reps: int = 5,
    seed: int = 0,
    backend: str = "auto",
    max_tables: int = 12,
    max_rows: int = 100_000,
    progress: Callable[[str], None] | None = None,
) -> CostData:
    """Measure ``num_devices`` compute samples and ``num_comm`` all-to-all samples."""
    if num_devices < 0 or num_comm < 0 or num_devices + num_comm == 0:
        raise ValueError(
            f"collect at least one sample (got {num_devices} devices, {num_comm} all-to-alls)"
        )
    if batch < 1 or reps < 1:
        raise ValueError(f"batch ({batch}) and reps ({reps}) must be >= 1")
    say = progress or log.info
    kernel = resolve_backend(backend, torch.device("cpu"), embedding_dims=(4, 8)).value
    rng = np.random.default_rng(seed)
    machine = {
        **machine_info(),
        "flags": cpu_flags(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "kernel_backend": kernel,
        "timing_threads": 1,  # every compute sample runs on one thread (one rank, one core)
    }
    data = CostData(machine, kernel, batch)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one rank, one core
    start = time.perf_counter()
    try:
        for d in range(num_devices):
            shards = random_split_device(rng, f"d{d}", max_tables, max_rows)
            forward, backward = _time_compute(shards, batch, reps, kernel, seed=d)
            data.compute.append(ComputeSample(tuple(shards), forward, backward))
            if (d + 1) % 10 == 0 or d + 1 == num_devices:
                say(
                    f"compute {d + 1}/{num_devices} devices measured "
                    f"({time.perf_counter() - start:.0f} s)"
                )
    finally:
        torch.set_num_threads(threads)
    if num_comm:
        dims = [random_dims(rng, 2) for _ in range(num_comm)]
        say(f"all-to-all: {num_comm} samples on 2 gloo processes")
        per_rank = spawn_world(_time_comm, 2, 1, dims, batch, reps, timeout_s=300.0)
        for i, sample in enumerate(dims):
            seconds = max(times[i] for times in per_rank)
            data.comm.append(CommSample(2, tuple(sample), batch, seconds))
        say(f"all-to-all measured ({time.perf_counter() - start:.0f} s)")
    return data
