"""``towerrec bench row-io``: what reading a step's missed rows from SSD store files, and
writing back its evicted ones, costs per row, by each way of moving them.

The tables of ``bench tiers`` (the Criteo cardinalities scaled to ``--gib``, dim
``--dim``, row-wise Adagrad: records of ``4 (dim + 1)`` bytes); those above
``--min-rows`` rows sit in SSD store files under ``--path``, as ``bench tiers``'s cached
tables do. The rows come from the cache itself: an LRU cache of ``--cache-fraction`` of
each table's rows (``TableCache``) looks up ``--warmup`` + ``--steps`` batches of
``--batch-size`` Zipf ids per table (``bench tiers --ids zipf``'s), and each timed step's
misses and dirty evictions are recorded. Every method then reads those misses and writes
those evictions through a store (``SsdStore.read`` / ``write``), table by table and
step by step:

- ``row``: the store's way before batching: one ``os.preadv`` per row from Python,
  writes through the file's mapping (its pages dropped every 128 rows);
- ``python``, ``pread``, ``uring``: ``towerrec.modules.row_io``'s methods (sorted rows
  in runs of adjacent rows; ``pread`` and ``uring`` native, the GIL released). The
  native ones run once for each ``--read-threads`` count ``k``: a large read split into
  that many pieces read at once (``row_io``'s module doc), reported as ``METHOD-kt``, and
  under the method's name for 1 (the store's way with ``embedding.ssd_reads = io``);
- ``mapped``: reads gathered from the files' mapping (``embedding.ssd_reads = mapped``;
  the pages a read touches stay mapped, so the first round's faults map them and the best
  round is the steady state), writes copied into the mapping (``SsdStore.mapped_writes``).

With the files in the page cache (``warm``), and with ``--cold`` also after dropping
them from it (``posix_fadvise``) before each method's pass. Per method: wall and
process CPU microseconds (every thread's) per row read and per row written, the best of
``--rounds``. ``--probe`` measures the disk under ``--path``, the bound of a cold read:
sequential read MB/s (1 MiB reads), and random 4 KiB reads per second one at a time
(``pread``) and ``RING_ENTRIES`` in flight (io_uring).
"""

from __future__ import annotations

import argparse
import math
import mmap
import os
import shutil
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from towerrec.bench.common import Benchmark, comma_list, machine_info
from towerrec.bench.tiers_data import criteo_rows, zipf_ids
from towerrec.modules.row_io import RING_ENTRIES, RowIO, available_methods
from towerrec.modules.ssd_store import HEADER_BYTES, SsdStore
from towerrec.modules.table_cache import TableCache
from towerrec.modules.tables import TableConfig
from towerrec.modules.tier_store import BackingStore, RowLayout
from towerrec.modules.tiers import CachePolicy

__all__ = ["BENCHMARK", "run_row_io_benchmark"]

METHODS = ("row", "python", "pread", "uring", "mapped")
T = TypeVar("T")
Steps = list[list[tuple[torch.Tensor, torch.Tensor]]]  # per step, per table: (read, written)


class _Recorder(BackingStore):
    """A store that records what a cache reads and writes, and holds nothing."""

    def __init__(self, layout: RowLayout) -> None:
        super().__init__(layout)
        self.reads: list[torch.Tensor] = []
        self.writes: list[torch.Tensor] = []

    @property
    def records(self) -> torch.Tensor:
        raise NotImplementedError("a recorder holds no rows")

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        self.reads.append(rows.clone())
        return torch.zeros(rows.numel(), self.layout.record_width)

    def write(self, rows: torch.Tensor, records: torch.Tensor) -> None:
        self.writes.append(rows.clone())

    def flush(self) -> None:
        pass


def _traffic(args: argparse.Namespace, rows: list[int]) -> Steps:
    """Each timed step's ``(missed rows, written-back rows)`` of every cached table."""
    gen = torch.Generator().manual_seed(args.seed)
    per_table = []
    for t, n in enumerate(rows):
        layout = RowLayout(f"cat_{t}", n, args.dim, (("momentum1", 1),))
        recorder = _Recorder(layout)
        slots = math.ceil(args.cache_fraction * n)
        weight, state = torch.zeros(slots, args.dim), {"momentum1": torch.zeros(slots)}
        cache = TableCache(
            TableConfig(layout.table, n, args.dim),
            slots,
            CachePolicy.LRU,
            recorder,
            weight=partial(_same, weight),
            states=partial(_same, state),
        )
        steps = []
        for step in range(args.warmup + args.steps):
            recorder.reads.clear()
            recorder.writes.clear()
            cache.slots(zipf_ids(n, args.batch_size, args.zipf_alpha, gen), training=True)
            if step >= args.warmup:
                read = torch.cat(recorder.reads) if recorder.reads else torch.empty(0).long()
                written = torch.cat(recorder.writes) if recorder.writes else torch.empty(0).long()
                steps.append((read, written))
        per_table.append(steps)
    return [list(step) for step in zip(*per_table, strict=True)]


def _same(value: T) -> T:
    return value


def _fill(out: torch.Tensor, lo: int, hi: int) -> None:
    out.fill_(float(lo))  # any bytes: what the reads cost does not depend on them


def _legacy_read(store: SsdStore, fd: int, rows: torch.Tensor) -> torch.Tensor:
    """The store's read before batching: one ``preadv`` per row from Python."""
    size = 4 * store.layout.record_width
    out = torch.empty(rows.numel(), store.layout.record_width)
    view = out.numpy().data.cast("B")
    for i, row in enumerate(rows.tolist()):
        os.preadv(fd, [view[i * size : (i + 1) * size]], HEADER_BYTES + row * size)
    return out


def _legacy_write(store: SsdStore, rows: torch.Tensor, records: torch.Tensor) -> None:
    """The store's write before batching: through the mapping, 64 rows at a time, its
    pages dropped past 256 MiB counted at 2 MiB a row."""
    mapped = 0
    for lo in range(0, rows.numel(), 64):
        store.records.index_copy_(0, rows[lo : lo + 64], records[lo : lo + 64])
        mapped += min(64, rows.numel() - lo) * (2 << 20)
        if mapped > 256 << 20:
            store.release()
            mapped = 0


def _drop(stores: list[SsdStore]) -> None:
    for store in stores:
        store.flush()
        store.release()
        fd = os.open(store.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _pass(method: str, stores: list[SsdStore], steps: Steps) -> dict[str, float]:
    """One method over every step: seconds and process CPU seconds (a split read's
    threads too) of the reads and of the writes."""
    fds = [os.open(s.path, os.O_RDONLY) for s in stores]
    out = dict.fromkeys(("read_s", "read_cpu_s", "write_s", "write_cpu_s"), 0.0)
    try:
        for step in steps:
            for store, fd, (read, written) in zip(stores, fds, step, strict=True):
                t, c = time.perf_counter(), time.process_time()
                if method == "row":
                    records = _legacy_read(store, fd, read)
                else:
                    records = store.read(read)
                out["read_s"] += time.perf_counter() - t
                out["read_cpu_s"] += time.process_time() - c
                back = records[: written.numel()]
                if back.shape[0] < written.numel():
                    back = torch.zeros(written.numel(), store.layout.record_width)
                t, c = time.perf_counter(), time.process_time()
                if method == "row":
                    _legacy_write(store, written, back)
                else:
                    store.write(written, back)
                out["write_s"] += time.perf_counter() - t
                out["write_cpu_s"] += time.process_time() - c
    finally:
        for fd in fds:
            os.close(fd)
    return out


def _probe(path: Path, stores: list[SsdStore], count: int) -> dict[str, float]:
    """The disk's sequential read MB/s and random 4 KiB reads/s at depth 1 and deep."""
    biggest = max(stores, key=lambda s: s.path.stat().st_size)
    _drop([biggest])
    size = min(biggest.path.stat().st_size, 1 << 30) // (1 << 20) * (1 << 20)
    fd = os.open(biggest.path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        buf = bytearray(1 << 20)
        start = time.perf_counter()
        for offset in range(0, size, 1 << 20):
            os.preadv(fd, [buf], offset)
        seq = size / (time.perf_counter() - start) / 1e6
        pages = biggest.path.stat().st_size // 4096
        gen = torch.Generator().manual_seed(1)
        picks = torch.randperm(pages // 2, generator=gen)[: 2 * count] * 2  # never adjacent
        out: dict[str, float] = {"sequential_read_mb_s": round(seq, 1)}
        usable = available_methods()
        # one read at a time: the native loop's pread where it is built, else Python's
        methods = [("pread" if "pread" in usable else "python", "random_4k_reads_per_s_depth1")]
        if "uring" in usable:
            methods.append(("uring", f"random_4k_reads_per_s_depth{RING_ENTRIES}"))
        for i, (method, key) in enumerate(methods):
            _drop([biggest])
            rows = picks[i * count : (i + 1) * count].sort().values
            pages_out = torch.empty(count, 1024)
            io = RowIO(method)
            start = time.perf_counter()
            if method != "uring":  # one read at a time: the disk's latency
                for k in range(count):
                    io.read(fd, rows[k : k + 1], pages_out[k : k + 1], 0)
            else:
                io.read(fd, rows, pages_out, 0)
            out[key] = round(count / (time.perf_counter() - start))
        return out
    finally:
        os.close(fd)


def _read_threads(text: str) -> list[int]:
    """``--read-threads``: counts of at least 1."""
    out: list[int] = []
    for item in comma_list(text):
        if not (item.isdigit() and int(item) >= 1):
            raise ValueError(f"--read-threads takes counts >= 1, got {item!r}")
        out.append(int(item))
    return out or [1]


def _labelled_runs(methods: list[str], threads: list[int]) -> list[tuple[str, str, int]]:
    """``(label, method, read_threads)`` of each pass: the native methods once per
    ``threads`` count, the others once (their reads are not split)."""
    out: list[tuple[str, str, int]] = []
    for method in methods:
        if method in ("pread", "uring"):
            out += [(method if t == 1 else f"{method}-{t}t", method, t) for t in threads]
        else:
            out.append((method, method, 1))
    return out


def run_row_io_benchmark(args: argparse.Namespace) -> dict:
    methods = list(comma_list(args.methods))
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise ValueError(f"--methods {unknown} unknown; choose from {', '.join(METHODS)}")
    usable = ("row", *available_methods(), "mapped")
    # the mapped stores' io (their reads and writes go through the mapping)
    writer = "pread" if "pread" in usable else "python"
    skipped = [m for m in methods if m not in usable]
    methods = [m for m in methods if m in usable]
    runs = _labelled_runs(methods, _read_threads(args.read_threads))
    all_rows = criteo_rows(args.gib, args.dim)
    rows = [n for n in all_rows if n > args.min_rows]
    loadavg_start = os.getloadavg()
    steps = _traffic(args, rows)
    path = Path(args.path) if args.path else Path(tempfile.mkdtemp(prefix="towerrec-rowio-"))
    path.mkdir(parents=True, exist_ok=True)
    stores: list[SsdStore] = []
    try:
        start = time.perf_counter()
        for t, n in enumerate(rows):
            layout = RowLayout(f"cat_{t}", n, args.dim, (("momentum1", 1),))
            (path / f"cat_{t}.tstore").unlink(missing_ok=True)
            store = SsdStore(layout, path / f"cat_{t}.tstore")
            store.initialize(_fill)
            stores.append(store)
        write_s = time.perf_counter() - start
        modes = ["warm", "cold"] if args.cold else ["warm"]
        results: dict[str, dict[str, dict[str, float]]] = {m: {} for m in modes}
        n_read = sum(r.numel() for step in steps for r, _ in step)
        n_written = sum(w.numel() for step in steps for _, w in step)
        for mode in modes:
            if mode == "warm":
                _pass("pread" if "pread" in usable else "python", stores, steps)  # pages in
            best: dict[str, dict[str, float]] = {}
            for _ in range(args.rounds):
                for label, method, threads in runs:
                    for store in stores:
                        store.mapped_reads = method == "mapped"
                        store.io = RowIO(
                            {"row": "python", "mapped": writer}.get(method, method),
                            uring_writes=True,
                            read_threads=threads,
                        )
                    if mode == "cold":
                        _drop(stores)
                    got = _pass(method, stores, steps)
                    prev = best.get(label)
                    best[label] = (
                        got if prev is None else {k: min(v, prev[k]) for k, v in got.items()}
                    )
            for method, got in best.items():
                results[mode][method] = {
                    "read_us_per_row": round(1e6 * got["read_s"] / max(n_read, 1), 3),
                    "read_cpu_us_per_row": round(1e6 * got["read_cpu_s"] / max(n_read, 1), 3),
                    "write_us_per_row": round(1e6 * got["write_s"] / max(n_written, 1), 3),
                    "write_cpu_us_per_row": round(1e6 * got["write_cpu_s"] / max(n_written, 1), 3),
                    "read_ms_per_step": round(1e3 * got["read_s"] / len(steps), 3),
                    "write_ms_per_step": round(1e3 * got["write_s"] / len(steps), 3),
                }
        probe = _probe(path, stores, args.probe) if args.probe else None
    finally:
        stores.clear()
        if not args.path:
            shutil.rmtree(path, ignore_errors=True)
    runs_per_step = sum(
        int((np.diff(r.numpy()) != 1).sum()) + 1 for step in steps for r, _ in step if r.numel()
    ) / len(steps)
    return {
        "benchmark": "row-io",
        "machine": machine_info(),
        "loadavg_start": loadavg_start,
        "loadavg": os.getloadavg(),
        "table_gib": round(sum(all_rows) * 4 * (args.dim + 1) / 2**30, 3),
        "file_gib": round(sum(rows) * 4 * (args.dim + 1) / 2**30, 3),
        "cached_tables": len(rows),
        "record_bytes": 4 * (args.dim + 1),
        "cache_fraction": args.cache_fraction,
        "batch_size": args.batch_size,
        "zipf_alpha": args.zipf_alpha,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "rows_read_per_step": round(n_read / len(steps), 1),
        "rows_written_per_step": round(n_written / len(steps), 1),
        "read_runs_per_step": round(runs_per_step, 1),
        "write_files_s": round(write_s, 1),
        "methods_skipped": skipped,
        "results": results,
        "disk": probe,
        "mmap_page_bytes": mmap.PAGESIZE,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gib", type=float, default=8.0, help="tables' weights + state, GiB")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--cache-fraction", type=float, default=0.05)
    parser.add_argument("--min-rows", type=int, default=100_000, help="larger tables: files")
    parser.add_argument("--zipf-alpha", type=float, default=1.1)
    parser.add_argument("--steps", type=int, default=40, help="steps whose rows are timed")
    parser.add_argument("--warmup", type=int, default=20, help="steps that fill the cache first")
    parser.add_argument("--methods", default=",".join(METHODS), help=", ".join(METHODS))
    parser.add_argument("--rounds", type=int, default=3, help="passes per method (the best)")
    parser.add_argument(
        "--read-threads",
        default="1,2",
        help="pieces of a large native read, each count in turn (1: the store's way)",
    )
    parser.add_argument(
        "--cold", action="store_true", help="also with the files out of the page cache"
    )
    parser.add_argument(
        "--probe", type=int, default=0, help="measure the disk with this many random 4 KiB reads"
    )
    parser.add_argument("--path", default="", help="directory of the store files (temp)")
    parser.add_argument("--seed", type=int, default=0)


BENCHMARK = Benchmark(
    help="the SSD store's reads and writes of missed rows, per row, by method (JSON)",
    add_arguments=add_arguments,
    run=run_row_io_benchmark,
)
