"""Batched reads and writes of a store file's fixed-size records (``ssd_store.py``).

A batch's rows are moved in runs: rows that follow each other in the order given and
in the file (``r, r + 1, ...``, at most ``max_run_rows``) are one transfer into or out
of consecutive records of the caller's buffer. Callers pass sorted unique rows, so
every run of adjacent rows is one transfer. Three ways move the runs, all to the same
bytes:

- ``uring``: io_uring requests, many runs per system call and up to the ring's
  entries in flight (a cold file's reads wait on the disk together, not one by one);
  the native extension ``_rowio`` (``_rowio.c``, built by ``pip install`` where a C
  compiler is found), one ring per thread. Its writes go through the ``pread`` way's
  loop unless ``uring_writes``: a buffered write is handed to a kernel worker thread
  (one more busy core), and cost 2.4 us a row against the loop's 1.5 (ext4, kernel
  6.18, files in the page cache);
- ``pread``: the native extension's loop of one ``pread`` / ``pwrite`` per run;
- ``python``: the same loop in Python (``os.preadv`` / ``os.pwritev``), the fallback
  where the extension is not built or io_uring is refused.

The native ways release the GIL for the whole batch, so a background thread's reads
overlap the step. ``RowIO(method)`` picks one (default: the first of ``uring``,
``pread``, ``python`` that works here); ``available_methods()`` says which work.
A transfer returns ``-1`` when every record moved, else the index of the first row
the file ends before (a truncated file), which the store reports.

A native read of at least ``SPLIT_READ_ROWS`` rows a piece may be split into
``read_threads`` pieces of its rows (default 1: not split), read at once by the calling
thread and a shared pool's threads, each with its own ring. A read from the page cache
waits on memory (the page cache's tree, then the row; 1.2-1.5 us a row), so pieces overlap
those waits: on 2 cores a step's misses read 1.2x faster in 2 pieces, for 11 % more CPU
(``bench row-io``). Inside a training step on the same 2 cores it gained nothing (steps
alternating between 1 and 2 pieces: 54.6 ms each at the median, and the embedding
forward that holds the reads 16.6 against 16.7 ms), so the store reads in one piece; more pieces may pay where cores sit idle during the lookup. Writes stay in one
thread (a file's buffered writes take its inode lock, one writer at a time).
"""

from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from types import ModuleType
from typing import Protocol

import numpy as np
import torch

__all__ = [
    "MAX_RUN_ROWS",
    "METHODS",
    "SPLIT_READ_ROWS",
    "RowIO",
    "available_methods",
    "runs",
]

METHODS = ("uring", "pread", "python")
MAX_RUN_ROWS = 4096  # rows in one transfer at most (bounds one call's size)
RING_ENTRIES = 256  # io_uring requests in flight at most
SPLIT_READ_ROWS = 256  # rows per piece of a split read, at least (module doc)

_native: ModuleType | None
try:
    from towerrec.modules import _rowio as _native  # type: ignore[attr-defined,no-redef,unused-ignore]
except ImportError:  # not built here: the Python path serves
    _native = None


class _Ring(Protocol):
    """The native extension's io_uring (``_rowio.Ring``)."""

    def transfer(
        self, fd: int, rows: np.ndarray, data: np.ndarray, record: int, base: int, run: int, w: bool
    ) -> int: ...

    def close(self) -> None: ...


def runs(rows: torch.Tensor, max_run_rows: int = MAX_RUN_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """``(starts, lengths)`` of the runs of ``rows`` (int64): indices into ``rows`` where
    each run begins, and its row count (module doc)."""
    n = rows.numel()
    if n == 0:
        empty = torch.empty(0, dtype=torch.int64)
        return empty, empty
    new = torch.ones(n, dtype=torch.bool)
    new[1:] = rows[1:] != rows[:-1] + 1
    starts = torch.nonzero(new).flatten()
    lengths = torch.diff(starts, append=torch.tensor([n]))
    if int(lengths.max()) > max_run_rows:  # split the long runs at the limit
        pieces = (lengths + max_run_rows - 1) // max_run_rows
        first = torch.repeat_interleave(starts, pieces)
        run_of = torch.repeat_interleave(torch.arange(starts.numel()), pieces)
        within = torch.arange(first.numel()) - torch.repeat_interleave(
            torch.cumsum(pieces, 0) - pieces, pieces
        )
        starts = first + within * max_run_rows
        lengths = torch.minimum(lengths[run_of] - within * max_run_rows, torch.tensor(max_run_rows))
    return starts, lengths


def available_methods() -> tuple[str, ...]:
    """The methods that work in this process (module doc), best first."""
    out = []
    if _native is not None:
        if hasattr(_native, "Ring"):
            try:
                _native.Ring(8).close()
                out.append("uring")
            except OSError:  # io_uring refused (an old kernel, a seccomp filter)
                pass
        out.append("pread")
    out.append("python")
    return tuple(out)


class RowIO:
    """Reads and writes of records ``[n, W]`` float32 at ``base + row * 4W`` of a file."""

    def __init__(
        self,
        method: str | None = None,
        max_run_rows: int = MAX_RUN_ROWS,
        uring_writes: bool = False,
        read_threads: int = 1,
    ) -> None:
        usable = available_methods()
        if method is None:
            method = usable[0]
        elif method not in METHODS:
            raise ValueError(f"row io method {method!r} unknown; choose from {', '.join(METHODS)}")
        elif method not in usable:
            raise ValueError(
                f"row io method {method!r} does not work here (the native extension is "
                f"{'not built' if _native is None else 'built, io_uring refused'}); "
                f"use one of {', '.join(usable)}"
            )
        if max_run_rows < 1:
            raise ValueError(f"max_run_rows must be >= 1, got {max_run_rows}")
        if read_threads < 1:
            raise ValueError(f"read_threads must be >= 1, got {read_threads}")
        self.method = method
        self.max_run_rows = max_run_rows
        self.uring_writes = uring_writes  # uring: writes by io_uring too (module doc)
        self.read_threads = read_threads  # pieces of a large native read (module doc)
        self._rings = threading.local()

    def read(self, fd: int, rows: torch.Tensor, out: torch.Tensor, base: int) -> int:
        """Read the records of ``rows [n]`` into ``out [n, W]`` (contiguous float32); in
        up to ``read_threads`` pieces at once (module doc)."""
        pieces = min(self.read_threads, rows.numel() // SPLIT_READ_ROWS)
        if pieces <= 1 or self.method == "python":  # Python's loop holds the GIL
            return self._transfer(fd, rows, out, base, write=False)
        n = rows.numel()
        cuts = [n * k // pieces for k in range(pieces + 1)]
        spans = list(itertools.pairwise(cuts))
        pool = _read_pool(pieces - 1)
        others = [
            pool.submit(self._transfer, fd, rows[lo:hi], out[lo:hi], base, False)
            for lo, hi in spans[1:]
        ]
        try:
            first = self._transfer(fd, rows[: cuts[1]], out[: cuts[1]], base, write=False)
        finally:  # the pieces write into ``out``: none may outlive this call
            wait(others)
        shorts = [first, *(f.result() for f in others)]  # a piece's error is raised here
        for (lo, _), short in zip(spans, shorts, strict=True):
            if short >= 0:  # the first piece with a row past the end: its first such row
                return lo + short
        return -1

    def write(self, fd: int, rows: torch.Tensor, records: torch.Tensor, base: int) -> int:
        """Write ``records [n, W]`` (contiguous float32) at ``rows [n]``."""
        return self._transfer(fd, rows, records, base, write=True)

    def _transfer(
        self, fd: int, rows: torch.Tensor, data: torch.Tensor, base: int, write: bool
    ) -> int:
        if rows.numel() == 0:
            return -1
        rows = rows.contiguous().to(torch.int64)
        record = data.shape[1] * data.element_size()
        if self.method == "python":
            return self._python(fd, rows, data, record, base, write)
        row_buf: np.ndarray = rows.numpy()
        data_buf: np.ndarray = data.numpy()
        if self.method == "pread" or (write and not self.uring_writes):
            assert _native is not None  # checked in __init__
            result: int = _native.transfer(
                fd, row_buf, data_buf, record, base, self.max_run_rows, write
            )
            return result
        return int(
            self._ring().transfer(fd, row_buf, data_buf, record, base, self.max_run_rows, write)
        )

    def _ring(self) -> _Ring:
        """This thread's ring (made on first use; a forked child makes its own)."""
        held = getattr(self._rings, "ring", None)
        if held is None or held[0] != os.getpid():
            assert _native is not None  # checked in __init__
            held = (os.getpid(), _native.Ring(RING_ENTRIES))
            self._rings.ring = held
        ring: _Ring = held[1]
        return ring

    def _python(
        self, fd: int, rows: torch.Tensor, data: torch.Tensor, record: int, base: int, write: bool
    ) -> int:
        view = data.numpy().data.cast("B")
        starts, lengths = runs(rows, self.max_run_rows)
        move = os.pwritev if write else os.preadv
        offsets = (base + rows[starts] * record).tolist()
        firsts, sizes = (starts * record).tolist(), (lengths * record).tolist()
        for lo, size, offset in zip(firsts, sizes, offsets, strict=True):
            moved = move(fd, [view[lo : lo + size]], offset)
            while moved < size:  # a partial transfer: go on, or the file ended
                more = move(fd, [view[lo + moved : lo + size]], offset + moved)
                if more == 0:
                    return int((lo + moved) // record)
                moved += more
        return -1


_pool: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, workers, pool)
_pool_lock = threading.Lock()


def _read_pool(workers: int) -> ThreadPoolExecutor:
    """The process's pool of read threads, with at least ``workers`` threads (made on
    first use, grown on demand; a forked child makes its own)."""
    global _pool
    with _pool_lock:
        held = _pool
        if held is None or held[0] != os.getpid() or held[1] < workers:
            # A smaller pool is dropped, not shut down: a read holding it still submits;
            # its threads end once no read holds it.
            held = (os.getpid(), workers, ThreadPoolExecutor(workers, "towerrec-read"))
            _pool = held
        return held[2]
