"""What a run asks of the fused kernels (``modules/kernels/``), for choosing one by
measurement (``towerrec.build.choices``, which times whole training steps on each).

A ``KernelWorkload`` is what one training step asks of the embedding tables: per
table its rows, dim and mean ids per sample, the batch (per rank), the pooling, the
fused optimizer and the device; ``timed_rows`` caps the tables at ``MAX_ROWS`` rows
in all, shared in proportion to their rows (the timed tables still lie far beyond the
CPU caches, as the run's do). ``supported_backends``: the kernels that can run the
workload at all. ``TimingStats``: what a timing saw besides its result, and whether
it was too noisy to keep.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

import torch

from towerrec.modules.kernels.backend import fbgemm_available, fbgemm_has_kernel
from towerrec.modules.kernels.base import Backend
from towerrec.modules.tables import Pooling
from towerrec.optim.sparse import EmbeddingOptimizerConfig

__all__ = [
    "BUDGET_S",
    "MAX_ROWS",
    "KernelWorkload",
    "TimingStats",
    "supported_backends",
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
