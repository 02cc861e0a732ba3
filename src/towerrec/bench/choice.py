"""``towerrec bench choice``: ``embedding.backend = "auto"`` against the best forced kernel.

For each shape (the Criteo-Kaggle one of ``bench train``: 26 tables of 100,000 rows at
dim 16, one id per table; the planted data's nine small tables), the measurement that
``auto`` runs (``build/choices.py``'s ``time_backend_steps`` with its defaults: whole
training steps of the shape's DLRM on each kernel at ``--precision``, as a run times them
at its resolved precision, the first use's choice, and how long it took) and then a longer round-robin timing of the same steps on every
kernel that can run the shape, forced (``--steps`` rounds of ``PRECISION_BLOCK`` steps,
the fastest kept, no time budget). The target: the auto choice's step at most 1.05x the
best forced one's (``auto_over_best``). With ``--threads 1`` (default) steps are timed
in CPU seconds of this process, so other tenants of a busy machine count less.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from towerrec.bench.common import Benchmark
from towerrec.bench.train import CRITEO_SHAPE, PLANTED_SHAPE, shape_inputs
from towerrec.build.choices import TimingRounds, kernel_workload, time_backend_steps
from towerrec.hardware import VECTOR_FLAG_PREFIXES, cpu_flags, cpu_model
from towerrec.modules.kernel_timing import supported_backends
from towerrec.train.step import autocast_dtype

__all__ = ["BENCHMARK", "SHAPES", "choice_benchmark"]

SHAPES: dict[str, dict] = {"criteo_kaggle": CRITEO_SHAPE, "planted": PLANTED_SHAPE}


def choice_benchmark(
    shapes: dict[str, dict], batch_size: int, steps: int, precision: str = "fp32"
) -> dict:
    """Per shape: the auto measurement's times, choice and duration, the forced kernels'
    longer timing, and the auto choice's time over the best forced one's, the steps at
    ``precision`` (``fp32`` or ``bf16``)."""
    result: dict = {}
    device = torch.device("cpu")
    dtype = autocast_dtype(precision)
    for name, shape in shapes.items():
        config, schema = shape_inputs(shape, batch_size)
        workload = kernel_workload(config, schema, device, batch_size)
        backends = supported_backends(workload)
        start = time.perf_counter()
        quick = time_backend_steps(workload, backends, config=config, schema=schema, dtype=dtype)
        took = time.perf_counter() - start
        auto = min(quick, key=quick.__getitem__)
        longer = TimingRounds(steps=steps, timed_s=0.0, max_steps=steps, budget_s=math.inf)
        forced = time_backend_steps(
            workload, backends, config=config, schema=schema, rounds=longer, dtype=dtype
        )
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
    parser.add_argument(
        "--steps", type=int, default=30, help="forced rounds per kernel (4 steps a round)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: default)")
    parser.add_argument(
        "--precision", choices=("fp32", "bf16"), default="fp32",
        help="the steps' precision (a run times its kernels at its resolved precision)",
    )  # fmt: skip


def _run(args: argparse.Namespace) -> dict:
    previous = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        shapes = choice_benchmark(SHAPES, args.batch_size, args.steps, args.precision)
    finally:
        torch.set_num_threads(previous)
    return {
        "cpu": cpu_model(),
        "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(VECTOR_FLAG_PREFIXES)),
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": args.threads or previous,
        "batch_size": args.batch_size,
        "precision": args.precision,
        "shapes": shapes,
    }


BENCHMARK = Benchmark(
    "embedding.backend = auto against the best forced kernel", _add_arguments, _run
)
