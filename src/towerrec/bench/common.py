"""Benchmark helpers: the declaration every benchmark makes, machine description,
matmul peak, timing."""

from __future__ import annotations

import argparse
import functools
import os
import resource
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import torch

from towerrec.bench.roofline import matmul_peak
from towerrec.calibration.machine import machine_info
from towerrec.config.files import UNSET_PREFIX
from towerrec.memory import reuse_freed_memory
from towerrec.train.numerics import flush_subnormals

P = ParamSpec("P")
R = TypeVar("R")

__all__ = [
    "Benchmark",
    "add_overrides_argument",
    "comma_list",
    "machine_info",
    "matmul_peak_flops",
    "peak_rss_mb",
    "set_threads",
    "time_interleaved",
]


@dataclass(frozen=True)
class Benchmark:
    """What one ``towerrec bench NAME`` is: a help line, the arguments it declares on its
    parser, and a run from the parsed arguments to its result (printed as JSON).

    Benchmark modules declare theirs next to the code they time; the command line's
    table (``towerrec.cli.bench.BENCHMARKS``) gives each its name."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], dict]


def add_overrides_argument(
    parser: argparse.ArgumentParser, help: str = "config override for every variant"
) -> None:
    """``--set SECTION.KEY=VALUE`` and ``--unset SECTION.KEY`` (repeatable, in order),
    into ``overrides``."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help=help,
    )
    parser.add_argument(
        "--unset",
        dest="overrides",
        action="append",
        type=lambda key: f"{UNSET_PREFIX}{key}",
        metavar="SECTION.KEY",
        help="put a key back to its default, whatever the config file set (repeatable)",
    )


def comma_list(text: str) -> tuple[str, ...]:
    """``a,b,,c`` -> ``("a", "b", "c")``."""
    return tuple(v for v in text.split(",") if v)


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mb(anonymous: bool = False) -> float:
    """Resident memory of this process now, in MiB (``/proc/self/statm``); ``anonymous``:
    without the pages of mapped files and shared memory (statm's ``shared``)."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    resident = int(fields[1]) - (int(fields[2]) if anonymous else 0)
    return resident * os.sysconf("SC_PAGE_SIZE") / 2**20


def matmul_peak_flops(
    dtype: torch.dtype = torch.float32,
    seconds: float = 1.0,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Best measured FLOP/s of a dense matmul on this CPU (``roofline.matmul_peak``).

    ``clock=time.process_time``: per CPU second of this process (with one
    intra-op thread, the peak of one core however busy the machine is)."""
    return matmul_peak("cpu", dtype, seconds, clock)


def time_interleaved(
    steps: Mapping[str, Callable[[int], object]],
    rounds: int,
    steps_per_round: int,
    warmup: int,
    cpu_seconds: dict[str, float] | None = None,
    sync: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Median seconds per step of each system, timed round-robin.

    Every system runs ``warmup`` steps, then ``rounds`` rounds in which each
    runs ``steps_per_round`` steps in turn: drift in the machine's speed (other
    tenants, clocks) hits all systems alike instead of whichever ran last.
    ``cpu_seconds``, when given, receives the median CPU seconds of this process
    per step: with one intra-op thread, the compute itself, less sensitive than
    wall time to other tenants taking the cores away. ``sync`` (an accelerator's
    ``synchronize``) ends each system's round: its steps are timed to their end on
    the device, not to their launch.
    """
    sync = sync or (lambda: None)
    for step in steps.values():
        for i in range(warmup):
            step(i)
    sync()
    samples: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    counter = warmup
    for _ in range(rounds):
        for name, step in steps.items():
            start, cpu_start = time.perf_counter(), time.process_time()
            for i in range(steps_per_round):
                step(counter + i)
            sync()
            samples[name].append((time.perf_counter() - start) / steps_per_round)
            cpu[name].append((time.process_time() - cpu_start) / steps_per_round)
        counter += steps_per_round
    if cpu_seconds is not None:
        cpu_seconds.update({name: statistics.median(values) for name, values in cpu.items()})
    return {name: statistics.median(values) for name, values in samples.items()}


def keeps_process_settings(fn: Callable[P, R]) -> Callable[P, R]:
    """A benchmark entry that may set its own thread count (``--threads``, or one thread
    for a measurement), and runs with subnormals flushed and freed memory reused as
    ``towerrec train`` runs (``train/numerics.py``, ``memory.reuse_freed_memory``). The
    caller's thread count and subnormal mode come back when it returns, so that a
    benchmark run from Python (a test, a notebook) leaves the process as it found them;
    the allocator's setting stays (process-wide, it changes where freed memory goes,
    never a result). Without it a step's buffers of a few MiB are faulted in afresh
    every step, which slowed the torch kernel's update in ``bench embedding`` 2x."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        reuse_freed_memory()
        before = torch.get_num_threads()
        try:
            with flush_subnormals():
                return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(before)

    return wrapper


def set_threads(threads: int | None) -> None:
    """``--threads N``: the benchmark's intra-op threads (None leaves torch's default)."""
    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
