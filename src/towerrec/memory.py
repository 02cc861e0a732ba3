"""Process memory as the operating system counts it (Linux ``/proc``; rusage elsewhere).

- ``reuse_freed_memory()``: glibc's allocator keeps the step's freed buffers for the
  next step instead of handing them back to the system (below).
- ``advise_huge_pages(address, nbytes)``: ask the kernel for 2 MiB pages for memory not
  yet touched (embedding tables: a lookup's rows are scattered, and with 4 KiB pages each
  one costs a page-table walk).

- ``peak_rss_mb()``: the high-water mark of this process's resident memory
  (``reset_peak_rss()`` restarts it from the current RSS).
- ``process_memory(pid)``: current RSS, PSS and USS of a process. RSS counts
  every page the process maps, shared or not: a worker forked from a trainer
  that holds the tables shows them in its RSS although it holds no copy. PSS
  splits each shared page among its sharers and USS counts only pages no
  other process has, so "does this worker hold its own copy of the tables?"
  is a question about USS.

Forked helpers and the tables. A process forked from a trainer (a data-loader
worker) shares the trainer's pages copy-on-write. The trainer rewrites table
rows every step; each rewritten page is copied for the trainer and the old
page stays with the forked helpers alone, so over a run the helpers come to
hold a stale copy of the tables. Owners of large memory that a helper never
reads (the embedding kernels) ``register_parent_only`` themselves; a forked
helper calls ``release_parent_only()`` first thing, which drops its mappings
of those pages (``madvise(MADV_DONTNEED)``: the pages stay the trainer's; the
helper would read zeros there, and never reads them). The registry holds weak
references only: it is the list of what exists, not state that anything reads
for results.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import resource
import sys
import weakref
from collections.abc import Iterable
from typing import Protocol

__all__ = [
    "HEAP_KEEP_BYTES",
    "HEAP_SERVE_BYTES",
    "HUGE_PAGE",
    "HUGE_PAGES_FROM",
    "advise_huge_pages",
    "available_memory_bytes",
    "huge_page_range",
    "peak_rss_mb",
    "physical_memory_bytes",
    "process_memory",
    "register_parent_only",
    "release_parent_only",
    "reset_peak_rss",
    "reuse_freed_memory",
]

_MIB = 1024 * 1024


# mallopt's parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
HEAP_SERVE_BYTES = 32 * _MIB  # blocks up to this size come from the heap, not from mmap
HEAP_KEEP_BYTES = 512 * _MIB  # free memory at the heap's top that is kept, not trimmed


def reuse_freed_memory() -> bool:
    """Have glibc's malloc serve blocks up to ``HEAP_SERVE_BYTES`` from its heap and keep
    up to ``HEAP_KEEP_BYTES`` of freed memory, rather than map each large block afresh
    and hand it back when freed. A training step allocates and frees the same
    activation and gradient buffers of a few MiB every step; at glibc's defaults many
    come back as fresh pages that the kernel must fault in and zero: some 1,000 page
    faults and 2.5-3 ms of system time a step on the Criteo-Kaggle shape at batch 2,048
    on two cores, against about 10 faults and 0.2-0.4 ms with this (docs/benchmarks.md).
    The cost: up to ``HEAP_KEEP_BYTES`` of freed memory stays with the process, as
    with jemalloc or tcmalloc, the allocators PyTorch's CPU tuning guide suggests.
    Process-wide; a no-op (False) where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018  # glibc only (musl's mallopt does nothing)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(
        mallopt(_M_MMAP_THRESHOLD, HEAP_SERVE_BYTES) and mallopt(_M_TRIM_THRESHOLD, HEAP_KEEP_BYTES)
    )


_MADV_HUGEPAGE = 14
HUGE_PAGE = 2 * _MIB
HUGE_PAGES_FROM = 8 * _MIB  # smaller tensors keep the allocator's pages


def huge_page_range(address: int, nbytes: int) -> tuple[int, int]:
    """The whole 2 MiB pages inside ``[address, address + nbytes)``: ``(start, length)``,
    length 0 where there is none."""
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    return start, max(end - start, 0)


def advise_huge_pages(address: int, nbytes: int) -> int:
    """Advise the whole 2 MiB pages inside ``[address, address + nbytes)``
    ``MADV_HUGEPAGE`` (Linux), so that pages not yet touched are faulted in as 2 MiB
    pages where the kernel's transparent huge pages allow it (``enabled`` = ``madvise``
    or ``always``); returns the bytes advised (0 below ``HUGE_PAGES_FROM``, elsewhere,
    or where the call fails: the memory keeps 4 KiB pages). For embedding tables, before
    their zeros are written: a lookup's rows lie scattered, and with 4 KiB pages nearly
    every row read misses the TLB and walks the page table (the torch kernel's lookup
    over the Criteo-Kaggle tables took 20-45 % less time, docs/benchmarks.md)."""
    if nbytes < HUGE_PAGES_FROM or not sys.platform.startswith("linux"):
        return 0
    start, length = huge_page_range(address, nbytes)
    if not length:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return length if libc.madvise(start, length, _MADV_HUGEPAGE) == 0 else 0


def physical_memory_bytes() -> int | None:
    """This machine's physical memory; None where the system does not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def available_memory_bytes() -> int | None:
    """Memory available now for new allocations and the page cache without swapping
    (``MemAvailable`` of ``/proc/meminfo``); the physical memory where the system does not
    say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return physical_memory_bytes()


def peak_rss_mb() -> float:
    """Peak resident memory of this process (since ``reset_peak_rss``), in MiB."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except FileNotFoundError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak_rss() -> bool:
    """Restart the peak count of ``peak_rss_mb`` from the current RSS (Linux); False
    where that is not possible (the peak then stays the lifetime peak)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def process_memory(pid: int | None = None) -> dict[str, float]:
    """``{"rss_mb", "pss_mb", "uss_mb"}`` of process ``pid`` (default: this one), in MiB.

    Read from ``/proc/<pid>/smaps_rollup``; where that does not exist (not Linux,
    old kernels) only ``rss_mb`` of this process is known, from rusage.
    """
    path = f"/proc/{pid if pid is not None else os.getpid()}/smaps_rollup"
    try:
        with open(path) as f:
            fields = {}
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if len(parts) == 2 and parts[1] == "kB":
                    fields[name] = int(parts[0]) * 1024
    except FileNotFoundError:
        if pid not in (None, os.getpid()):
            raise
        return {"rss_mb": peak_rss_mb()}
    private = fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)
    return {
        "rss_mb": fields.get("Rss", 0) / _MIB,
        "pss_mb": fields.get("Pss", 0) / _MIB,
        "uss_mb": private / _MIB,
    }


class HoldsRanges(Protocol):
    def memory_ranges(self) -> Iterable[tuple[int, int]]:
        """``(address, nbytes)`` of the memory a forked helper need not keep."""
        ...


_parent_only: weakref.WeakSet = weakref.WeakSet()
_MADV_DONTNEED = 4


def register_parent_only(owner: HoldsRanges) -> None:
    """Let forked helpers drop ``owner.memory_ranges()`` (see the module doc)."""
    _parent_only.add(owner)


def release_parent_only() -> int:
    """In a forked helper: drop the registered owners' pages; returns the bytes dropped.

    Only whole pages inside each range are dropped (an allocator's bookkeeping
    next to a range stays intact). Linux only; elsewhere nothing happens.
    """
    if not sys.platform.startswith("linux"):
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    dropped = 0
    for owner in list(_parent_only):
        for address, nbytes in owner.memory_ranges():
            start = -(-address // page) * page
            end = (address + nbytes) // page * page
            if end > start and libc.madvise(start, end - start, _MADV_DONTNEED) == 0:
                dropped += end - start
    return dropped
