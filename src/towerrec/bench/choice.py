"""``towerrec bench choice``: ``embedding.backend = "auto"`` against the best forced kernel.

For each shape (the Criteo-Kaggle one of ``bench train``: 26 tables of 100,000 rows at
dim 16, one id per table; the planted data's nine small tables), the measurement that
``auto`` runs (``modules/kernel_timing.py``'s ``time_backends`` with its defaults: the
first use's choice, and how long it took) and then a longer round-robin timing of every
kernel that can run the shape, forced (``--steps`` steps each, the fastest kept). The
target: the auto choice's step at most 1.05x the best forced one's (``auto_over_best``).
With ``--threads 1`` (default) steps are timed in CPU seconds of this process, so other
tenants of a busy machine count less.
"""

from __future__ import annotations

import argparse
import time

import torch

from towerrec.bench.common import Benchmark
from towerrec.bench.train import CRITEO_SHAPE, PLANTED_SHAPE
from towerrec.hardware import cpu_flags, cpu_model
from towerrec.modules.kernel_timing import KernelWorkload, supported_backends, time_backends
from towerrec.modules.tables import Pooling
from towerrec.optim.sparse import EmbeddingOptimizerConfig

__all__ = ["BENCHMARK", "SHAPES", "choice_benchmark"]

SHAPES: dict[str, tuple[tuple[int, ...], tuple[float, ...]]] = {
    "criteo_kaggle": (
        (CRITEO_SHAPE["num_embeddings"],) * CRITEO_SHAPE["num_tables"],
        (1.0,) * CRITEO_SHAPE["num_tables"],
    ),
    "planted": (
        tuple(PLANTED_SHAPE["num_embeddings"]),
        tuple(float(p) for p in PLANTED_SHAPE["pooling_factors"]),
    ),
}


def choice_benchmark(
    shapes: dict[str, tuple[tuple[int, ...], tuple[float, ...]]],
    batch_size: int,
    steps: int,
    dim: int = 16,
) -> dict:
    """Per shape: the auto measurement's times, choice and duration, the forced kernels'
    longer timing, and the auto choice's time over the best forced one's."""
    result: dict = {}
    for name, (rows, factors) in shapes.items():
        workload = KernelWorkload(
            rows, (dim,) * len(rows), factors, batch_size, Pooling.SUM, EmbeddingOptimizerConfig()
        )
        backends = supported_backends(workload)
        start = time.perf_counter()
        quick = time_backends(workload, backends)
        took = time.perf_counter() - start
        auto = min(quick, key=quick.__getitem__)
        forced = time_backends(workload, backends, steps=steps, seed=1, budget_s=float("inf"))
        best = min(forced, key=forced.__getitem__)
        result[name] = {
            "auto": auto.value,
            "auto_measure_s": round(took, 3),
            "auto_ms": {b.value: round(s * 1e3, 3) for b, s in quick.items()},
            "best_forced": best.value,
            "forced_ms": {b.value: round(s * 1e3, 3) for b, s in forced.items()},
            "auto_over_best": round(forced[auto] / forced[best], 3),
        }
    return result


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=30, help="forced-kernel steps per kernel")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: default)")


def _run(args: argparse.Namespace) -> dict:
    previous = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        shapes = choice_benchmark(SHAPES, args.batch_size, args.steps)
    finally:
        torch.set_num_threads(previous)
    return {
        "cpu": cpu_model(),
        "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("avx", "amx"))),
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": args.threads or previous,
        "batch_size": args.batch_size,
        "shapes": shapes,
    }


BENCHMARK = Benchmark(
    "embedding.backend = auto against the best forced kernel", _add_arguments, _run
)
