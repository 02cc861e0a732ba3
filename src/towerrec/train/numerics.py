"""What a run's numbers depend on besides its config and seed, pinned for the run.

A float sum depends on its order, and the order of a matrix product's reduction
depends on how many threads share it: oneMKL's sgemm on Intel CPUs splits the
reduction dimension across threads (the weight gradient of a linear layer, whose
reduction runs over the batch, differs between 1 and 2 threads; on AVX2 the forward
too), while its code path on AMD CPUs does not. So a run with the same config and
seed gives the same weights bit for bit only at the same intra-op thread count.

A run therefore never inherits the count from whatever ran before it in the
process: ``train.threads = 0`` resolves to one thread per core the process may run
on (``OMP_NUM_THREADS`` when set, else its CPU affinity), divided among the host's
local ranks; a checkpoint records the count and ``--resume`` keeps it. The fp32
matmul precision is pinned to IEEE fp32 for the run (``train.precision = "bf16"``
asks for bf16 explicitly, by autocast), so a process-wide
``torch.set_float32_matmul_precision("medium")`` cannot turn a run's fp32 matmuls
into bf16 ones.

Subnormal floats (below 1.2e-38 in fp32) are flushed to zero for the run
(``flush_subnormals``; ``torch.set_flush_denormal``, the CPU's FTZ and DAZ modes), as
TensorFlow does on CPUs by default. A model whose gradients fade towards zero makes
subnormal operands, and on Intel CPUs every matrix product that reads them runs on a
microcode path: measured on a Xeon with AMX, a Criteo-shaped fp32 step went from 53 ms
to 250-310 ms within 40 steps of training on random labels, and a [2048, 512] x
[512, 512] product of subnormals took 594 ms against 3.5 ms. Flushed, they are zeros,
which no fp32 result above 1e-38 can tell apart.

``pinned`` restores the process's own settings when the run ends.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from towerrec.modules import native

__all__ = [
    "available_cores",
    "flush_subnormals",
    "flushing_subnormals",
    "local_processes",
    "pinned",
    "resolve_threads",
    "set_flush_subnormals",
]

log = logging.getLogger("towerrec")


def available_cores() -> int:
    """The threads a process here may use: ``OMP_NUM_THREADS`` when it is set to a
    positive integer (the user's declared count), else the CPUs of its affinity mask."""
    declared = os.environ.get("OMP_NUM_THREADS", "").strip()
    if declared.isdigit() and int(declared) > 0:
        return int(declared)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def resolve_threads(configured: int, local_ranks: int = 1) -> int:
    """The intra-op threads of one rank: ``configured`` (``train.threads``) when set,
    else this host's cores shared among its ``local_ranks`` (at least one)."""
    if configured:
        return configured
    return max(1, available_cores() // max(1, local_ranks))


def _matmul_backends() -> list[Any]:
    """The fp32-precision settings a run pins: the CPU's (oneDNN) and, where CUDA is
    present, cuBLAS's (``torch.backends.*.matmul.fp32_precision``, torch >= 2.9)."""
    found: list[Any] = [torch.backends.mkldnn.matmul]  # type: ignore[attr-defined]
    if torch.cuda.is_available():
        found.append(torch.backends.cuda.matmul)
    return found


def local_processes(world_size: int) -> int:
    """How many of the run's processes share this machine (``LOCAL_WORLD_SIZE``, set by
    torchrun and ``--nproc``; every process of the world when it is unset)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))


def flushing_subnormals() -> bool:
    """Whether this thread's float operations flush subnormals to zero: a product whose
    exact result is subnormal in fp32 (1e-30 x 1e-10) comes out as 0."""
    tiny = torch.tensor([1e-30], dtype=torch.float32)
    return bool((tiny * 1e-10).item() == 0.0)


def set_flush_subnormals(on: bool) -> None:
    """The mode on this thread and on the intra-op threads: the native extension reaches
    OpenMP's threads (``_fused.c``); without it, ``torch.set_flush_denormal`` sets this
    thread's alone (then a product split among threads flushes in this thread's part)."""
    torch.set_flush_denormal(on)
    if native.fused is not None:
        native.fused.flush_subnormals(on)


@contextmanager
def flush_subnormals() -> Iterator[None]:
    """Subnormal floats flushed to zero in the body (module doc), on this thread and on
    the intra-op threads; the process's own mode afterwards, on error too. Where the CPU
    has no such mode the body runs as it would have."""
    before = flushing_subnormals()
    set_flush_subnormals(True)
    try:
        yield
    finally:
        set_flush_subnormals(before)


@contextmanager
def pinned() -> Iterator[None]:
    """IEEE fp32 matmuls with subnormals flushed for the body, and the process's thread
    count, matmul precision and subnormal mode as they were before it afterwards, on
    error too (the run sets its own thread count with
    ``torch.set_num_threads(resolve_threads(...))``)."""
    before_threads = torch.get_num_threads()
    backends = _matmul_backends()
    before_precision = [b.fp32_precision for b in backends]
    for backend, precision in zip(backends, before_precision):
        if precision not in ("none", "ieee"):  # "none": the default, IEEE fp32
            log.info("fp32 matmuls run as IEEE fp32 in this run (the process had %r)", precision)
            backend.fp32_precision = "ieee"
    try:
        with flush_subnormals():
            yield
    finally:
        torch.set_num_threads(before_threads)
        for backend, precision in zip(backends, before_precision):
            if backend.fp32_precision != precision:
                backend.fp32_precision = precision
