"""Time the fused kernels (``modules/kernels/``) on a run's lookups, to choose one by
measurement (``towerrec.build.choices``).

A ``KernelWorkload`` is what one training step asks of the embedding tables: per
table its rows, dim and mean ids per sample, the batch (per rank), the pooling, the
fused optimizer and the device. ``time_backends`` builds a collection of those tables
for each backend (zero-filled, nothing to initialise; ``MAX_ROWS`` rows in all at most,
shared in proportion to the tables' rows: the timed tables still lie far beyond the
CPU caches, as the run's do) and times training lookups (forward, then backward with
the optimizer fused into it) round-robin, so that a slow moment of a shared machine
hits every backend alike; a backend's time is its fastest step. With one intra-op
thread on a CPU the clock is the process's CPU time (other tenants of the machine do
not count), else the wall clock. ``supported_backends``: the kernels that can run the
workload at all.

The ids are uniform over each table's rows (no cache locality to help either kernel),
drawn afresh for every step; a table with pooling factor p gets floor((i+1) p) -
floor(i p) ids in bag i (mean p).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from towerrec.modules.embedding_bag import EmbeddingBagCollection
from towerrec.modules.kernels.backend import fbgemm_available, fbgemm_has_kernel
from towerrec.modules.kernels.base import Backend
from towerrec.modules.tables import Pooling, TableConfig
from towerrec.optim.sparse import EmbeddingOptimizerConfig
from towerrec.sparse import KeyedJaggedTensor

__all__ = [
    "BUDGET_S",
    "MAX_ROWS",
    "KernelWorkload",
    "TimingStats",
    "supported_backends",
    "time_backends",
]

# Rows of all timed tables together (at dim 16, 64 MiB: beyond the CPU caches), shared
# among the tables in proportion to their rows; a table keeps at least MIN_ROWS.
MAX_ROWS, MIN_ROWS = 1 << 20, 1 << 12
BUDGET_S = 1.0  # wall seconds of timed rounds after which no new round starts
# A timing is too noisy to keep when the process had less than STARVED CPU seconds per
# wall second while it ran (other processes held the cores), or when a candidate's median
# step took more than SPREAD times its fastest (the rounds disagree).
STARVED, SPREAD = 0.7, 1.5


@dataclasses.dataclass
class TimingStats:
    """What a timing saw besides its result: the wall and CPU seconds of this process
    over its timed rounds, and every timed step of each candidate; ``noise`` says
    whether its choice can be trusted beyond this run."""

    wall_s: float = 0.0
    cpu_s: float = 0.0
    steps: dict[str, list[float]] = dataclasses.field(default_factory=dict)

    def add_step(self, candidate: str, seconds: float) -> None:
        self.steps.setdefault(candidate, []).append(seconds)

    def noise(self) -> str | None:
        """Why the timing is too noisy to keep (``STARVED``, ``SPREAD``), or None."""
        if self.wall_s > 0 and self.cpu_s < STARVED * self.wall_s:
            return (
                f"the process ran {self.cpu_s:.2f} CPU s in {self.wall_s:.2f} wall s of timing "
                "(other processes held the cores)"
            )
        for candidate, times in self.steps.items():
            fastest = min(times)
            if len(times) >= 2 and fastest > 0 and statistics.median(times) > SPREAD * fastest:
                spread = statistics.median(times) / fastest
                return f"{candidate}'s timed steps spread {spread:.2f}x (median over fastest)"
        return None


@dataclass(frozen=True)
class KernelWorkload:
    """One training step's lookups: table t has ``num_embeddings[t]`` rows of
    ``dims[t]`` floats and ``pooling_factors[t]`` ids per sample; ``batch_size``
    samples per rank."""

    num_embeddings: tuple[int, ...]
    dims: tuple[int, ...]
    pooling_factors: tuple[float, ...]
    batch_size: int
    pooling: Pooling
    optimizer: EmbeddingOptimizerConfig
    device: str = "cpu"

    def __post_init__(self) -> None:
        sizes = {len(self.num_embeddings), len(self.dims), len(self.pooling_factors)}
        if len(sizes) != 1 or not self.dims:
            raise ValueError("a kernel workload needs rows, a dim and a pooling factor per table")

    def timed_rows(self) -> list[int]:
        """Rows of each table as timed: all of them up to ``MAX_ROWS`` in all, beyond
        that a proportional share (at least ``MIN_ROWS``, never more than the table)."""
        total = sum(self.num_embeddings)
        scale = min(1.0, MAX_ROWS / total)
        return [min(rows, max(MIN_ROWS, int(rows * scale))) for rows in self.num_embeddings]

    def describe(self) -> dict[str, object]:
        """The workload as plain JSON values (a key of the choice cache)."""
        return {
            "num_embeddings": list(self.num_embeddings),
            "dims": list(self.dims),
            "pooling_factors": [round(p, 3) for p in self.pooling_factors],
            "batch_size": self.batch_size,
            "pooling": self.pooling.value,
            "optimizer": self.optimizer.kind.value,
            "weight_decay": self.optimizer.weight_decay,
            "weight_decay_mode": self.optimizer.weight_decay_mode.value,
            "device": self.device,
        }


def supported_backends(workload: KernelWorkload) -> list[Backend]:
    """The kernels that run ``workload``: the torch kernel always; FBGEMM where it is
    installed, has a kernel for the optimizer on the device, and every dim is a
    multiple of 4."""
    found = [Backend.TORCH]
    opt = workload.optimizer
    device_type = torch.device(workload.device).type
    if (
        fbgemm_available()
        and fbgemm_has_kernel(opt.kind, device_type, opt.weight_decay)
        and all(dim % 4 == 0 for dim in workload.dims)
    ):
        found.append(Backend.FBGEMM)
    return found


def _batch(workload: KernelWorkload, gen: torch.Generator) -> KeyedJaggedTensor:
    device = torch.device(workload.device)
    lengths, values = [], []
    for rows, factor in zip(workload.timed_rows(), workload.pooling_factors):
        index = torch.arange(workload.batch_size + 1, dtype=torch.float64)
        ends = torch.floor(index * factor).long()  # mean ``factor`` ids per bag
        per_bag = ends.diff()
        lengths.append(per_bag)
        count = int(per_bag.sum())
        values.append(torch.randint(0, rows, (count,), generator=gen))
    return KeyedJaggedTensor(
        [f"f{t}" for t in range(len(lengths))],
        torch.cat(values).to(device),
        torch.cat(lengths).to(device),
    )


def _collection(workload: KernelWorkload, backend: Backend) -> EmbeddingBagCollection:
    tables = [
        TableConfig(f"t{t}", rows, dim, (f"f{t}",), pooling=workload.pooling)
        for t, (rows, dim) in enumerate(zip(workload.timed_rows(), workload.dims))
    ]
    ebc = EmbeddingBagCollection(
        tables, workload.optimizer, backend=backend, device=workload.device, materialize=False
    )
    return ebc.materialize(init=False)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_backends(
    workload: KernelWorkload,
    backends: Sequence[Backend],
    steps: int = 8,
    warmup: int = 2,
    seed: int = 0,
    budget_s: float = BUDGET_S,
    stats: TimingStats | None = None,
) -> dict[Backend, float]:
    """Seconds of one training lookup of ``workload`` on each of ``backends``: the
    fastest of ``steps`` steps, taken round-robin after ``warmup`` steps each; no new
    round starts once the rounds took ``budget_s`` of wall time (a busy machine).
    ``stats``, when given, receives the timed rounds' wall and CPU seconds and steps."""
    device = torch.device(workload.device)
    gen = torch.Generator().manual_seed(seed)
    # a batch of fresh ids every step, as in training: a repeated batch finds its rows in
    # the caches, which hid a native lookup's read-ahead (the Criteo tables, two threads:
    # the torch kernel over FBGEMM 0.78-1.00 over two repeated batches, 0.72-0.98 fresh
    # and over 8 steps, in 16 timings)
    batches = [_batch(workload, gen) for _ in range(warmup + steps)]
    collections = {b: _collection(workload, b) for b in backends}
    width = sum(d for d in workload.dims)
    grad = torch.randn(workload.batch_size, width, generator=gen).to(device)

    clock = (
        time.process_time
        if torch.get_num_threads() == 1 and device.type == "cpu"
        else time.perf_counter
    )

    def step(ebc: EmbeddingBagCollection, i: int) -> float:
        start = clock()
        ebc(batches[i % len(batches)]).values().backward(grad)
        _sync(device)
        return clock() - start

    best = {b: math.inf for b in backends}
    with torch.enable_grad():
        for ebc in collections.values():
            for i in range(warmup):
                step(ebc, i)
        start, cpu_start = time.perf_counter(), time.process_time()
        for i in range(steps):
            for b, ebc in collections.items():
                seconds = step(ebc, i)
                best[b] = min(best[b], seconds)
                if stats is not None:
                    stats.add_step(b.value, seconds)
            if time.perf_counter() - start > budget_s:
                break
        if stats is not None:
            stats.wall_s += time.perf_counter() - start
            stats.cpu_s += time.process_time() - cpu_start
    return best
