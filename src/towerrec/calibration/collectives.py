"""Timing gloo's all-to-all between two local processes, for the planner's link constants."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from towerrec.distributed.launch import spawn_world
from towerrec.distributed.mesh import Topology

__all__ = ["measure_all_to_all"]


def _time_all_to_all(topology: Topology, sizes: Sequence[int], reps: int) -> list:
    """On every rank: (bytes this rank sends to the others, median seconds) per size."""
    world = topology.world_size
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
    return out


def measure_all_to_all(
    sizes: Sequence[int] = (4096, 65536, 1 << 20, 8 << 20), reps: int = 5
) -> list[tuple[float, float]]:
    """(bytes sent per rank, seconds) of gloo all_to_all between 2 local processes
    (rank 0's timings; one thread each)."""
    results = spawn_world(_time_all_to_all, 2, 1, list(sizes), reps, timeout_s=300.0)
    return results[0]
