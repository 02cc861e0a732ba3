"""The SSD store of cached tables (``backing = "ssd"``): one file of fixed-size rows per
table, memory-mapped (the record layout: ``tier_store.py``).

Row r starts at a fixed offset, so a batch's misses are a gather of records and its
write-backs a scatter, with no index to keep::

    bytes 0 .. 4096      header: magic  b"TWRSTORE"  (8)
                                 version             u32 little-endian
                                 length n            u32
                                 JSON (n bytes)      table, rows, dim, dtype, states
                                 crc32 of the JSON   u32
    4096 + r * 4W        record r

Opening an existing file checks the header: a file written for another table, shape
or optimizer, or a damaged header, is refused rather than read as rows. A store is
(re)filled by ``initialize`` (a new run) or a checkpoint load, so a file's rows are
never trusted across runs; the check guards against two runs sharing a path.

Memory: the SSD store's rows are never all in the process. ``initialize`` fills the
rows in chunks of ``INIT_CHUNK_BYTES`` and writes them one 4 KiB page a call (the
kernel's page cache takes them, not the process's mapping). One page a call keeps the
page cache's folios small: a large write makes large folios (up to 2 MiB), and ext4
walks every block of a folio on each later write into it, so a write-back of one 260-byte
row into the file cost 5-12 us instead of 1.4 us (measured on ext4, kernel 6.18;
``docs/benchmarks.md``). ``write`` moves a batch's records with ``pwrite`` or io_uring
(``row_io.py``: sorted rows coalesced into runs of adjacent rows, one transfer a run, the
GIL released for the whole batch), ``read`` in one of two ways (``mapped_reads``):

- by io (the default of a bare store): ``pread`` or io_uring as ``write``, which map
  nothing. The read descriptor is advised ``POSIX_FADV_RANDOM`` (no read-ahead from disk
  around a missed row). A read of a row in the page cache costs a system call's walk of
  the file's page tree and a copy, 1.3-1.5 us a row; a cold file's reads wait on the
  disk together (io_uring keeps up to 256 in flight).
- mapped: a gather (``index_select``, the GIL released) from the file's mapping. A row
  whose page the process has mapped costs a memory read: 0.4 us against 2.3 for a
  ``pread`` in ``bench row-io``, 1.3-1.8 us inside a training step, where the rows a
  cache misses are cold in the CPU's caches and TLB (docs/benchmarks.md). The first touch
  of a page faults it in (the kernel maps its cached neighbours with it), and a page not
  in the page cache is read from the disk one fault at a time. The pages stay mapped, so
  the process's resident set grows by the file pages it touched (``RssFile``): page
  cache, which the kernel reclaims under pressure, the same pages an io read copies
  from. ``initialize`` maps every page of the new file at once (``map_pages``), so
  the steps take no faults; a checkpoint's load writes the rows through the mapping,
  which maps them too. Where the files fit in memory this is the faster way
  (``tiers.mapped_reads_on`` decides ``embedding.ssd_reads = auto``).

A store that reads through the mapping writes through it too (``index_copy_`` into the
mapped records, the GIL released): the pages a step writes back are already mapped,
and the copy into them marks them dirty for the kernel's write-back, as a ``pwrite``
into the page cache does: 0.6-0.8 us a row against 1.5-1.7 for the ``pwrite`` loop in
the 8 GiB ``bench tiers`` step (docs/benchmarks.md). The same bytes land in
the same page cache, so ``flush`` (``msync`` and ``fdatasync``) makes them durable
either way. A write through a mapping cannot report a full disk (the process gets
SIGBUS instead), so it is used only where every block of the file is reserved
(``_create``'s ``fallocate``) on a file system that rewrites a block in place
(``IN_PLACE_FILE_SYSTEMS``: a copy-on-write one, btrfs or ZFS, needs new blocks for every
rewrite, reserved or not); other stores write by io.

The mapping also serves the full-table views of ``records`` (checkpoints); ``release``
drops the pages mapped so far. The process's anonymous memory thus holds the cache's
slots and a batch's records, whatever the table's size; the page cache, which the kernel
reclaims, holds what it can of the file.

A file cut shorter while a store has it open (another process truncating it) makes a
mapped read end the process with SIGBUS, as a checkpoint's read of ``records`` would;
an io read reports it as a ``StoreError``. Opening a store checks the file's size.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import shutil
import struct
import threading
import weakref
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from towerrec.modules.row_io import RowIO
from towerrec.modules.tables import INIT_BLOCK_ROWS
from towerrec.modules.tier_store import (
    BackingStore,
    RowLayout,
    StoreError,
    check_writable,
    describe_layout,
    format_bytes,
)

__all__ = [
    "HEADER_BYTES",
    "IN_PLACE_FILE_SYSTEMS",
    "SUFFIX",
    "SsdStore",
    "encode_header",
    "file_system_type",
    "read_header",
]

MAGIC = b"TWRSTORE"
VERSION = 1
HEADER_BYTES = 4096
SUFFIX = ".tstore"
INIT_CHUNK_BYTES = 64 << 20  # initialize's fill size (whole init blocks of rows)
PAGE_BYTES = 4096  # initialize writes the rows one page a call (module doc)
PAGE_FLOATS = PAGE_BYTES // 4
_MADV_POPULATE_READ = 22  # Linux's, where Python's mmap module does not name it
# File systems whose rewrite of a reserved block needs no new block (module doc).
IN_PLACE_FILE_SYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "tmpfs"})


class SsdStore(BackingStore):
    """A file of fixed-size rows (module doc), created if missing. ``io``: how a batch's
    records move (``row_io.METHODS``; default the best that works here); ``mapped_reads``:
    ``read`` gathers from the file's mapping instead (module doc)."""

    def __init__(
        self, layout: RowLayout, path: Path, io: str | None = None, mapped_reads: bool = False
    ) -> None:
        super().__init__(layout)
        self.path = Path(path)
        self.io = RowIO(io)
        self.mapped_reads = mapped_reads
        check_writable(self.path)
        size = HEADER_BYTES + layout.rows_bytes
        if self.path.exists():
            found = read_header(self.path)
            if found != layout.to_json():
                raise StoreError(
                    f"backing store {self.path} was written for {describe_layout(found)}, not "
                    f"{describe_layout(layout.to_json())}; delete it, or point "
                    "embedding.backing_path at another directory"
                )
            if self.path.stat().st_size != size:
                raise StoreError(
                    f"backing store {self.path} holds {self.path.stat().st_size} bytes, not the "
                    f"{size} its header describes (a truncated file?); delete it to start over"
                )
        else:
            _create(self.path, encode_header(layout), size)
        self._map = np.memmap(
            self.path,
            dtype=np.float32,
            mode="r+",
            offset=HEADER_BYTES,
            shape=(layout.num_embeddings, layout.record_width),
        )
        # Random access: no read-ahead from disk for a page of ``records``.
        self._map._mmap.madvise(mmap.MADV_RANDOM)  # type: ignore[attr-defined]  # numpy's memmap keeps its mmap here
        self._records = torch.from_numpy(self._map)
        # Writes through the mapping (module doc): only where the disk holds every block
        # and rewrites it in place.
        self._writes_in_place = (
            os.stat(self.path).st_blocks * 512 >= size
            and file_system_type(self.path) in IN_PLACE_FILE_SYSTEMS
        )
        # ``read``'s and ``write``'s descriptor; one page cache with the mapping.
        self._fd = os.open(self.path, os.O_RDWR)
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)
        weakref.finalize(self, os.close, self._fd)
        self._writer: ThreadPoolExecutor | None = None  # ``write_behind``'s thread
        self._writes_sent = self._writes_landed = 0
        self._write_error: BaseException | None = None
        # The rows of each write sent and not yet landed, by its number (``_in_flight``).
        self._flying: dict[int, torch.Tensor] = {}
        self._flying_lock = threading.Lock()

    @property
    def mapped_writes(self) -> bool:
        """Whether ``write`` copies into the file's mapping (module doc): with the mapped
        reads, where the file's blocks are all reserved on a file system that rewrites
        them in place."""
        return self.mapped_reads and self._writes_in_place

    @property
    def records(self) -> torch.Tensor:
        self._landed()
        return self._records

    def write_behind(self) -> None:
        """Later ``write`` calls return at once; their rows land in a thread of this
        store's own, in order. ``read`` waits for them when it asks for a row still in
        flight, ``records``, ``flush`` and ``initialize`` always (a failed write raises
        there, or at the next read)."""
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="towerrec-write")

    @property
    def writes_behind(self) -> bool:
        """Whether ``write`` returns before its rows land (``write_behind``)."""
        return self._writer is not None

    def _landed(self) -> None:
        """Wait until every write sent to the writer thread has landed."""
        if self._writer is not None and self._writes_landed != self._writes_sent:
            self._writer.submit(_nothing).result()  # one thread, in order: the rest are done
        if self._write_error is not None:
            error, self._write_error = self._write_error, None
            raise error

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        """Records ``[n, W]`` of ``rows`` (any order, repeats allowed), read through the
        mapping or in runs of adjacent rows (module doc); after the writes in flight of any
        of them."""
        rows = self._checked(rows)
        unique, inverse = _sorted_unique(rows)
        if self._in_flight(unique):
            self._landed()
        elif self._write_error is not None:
            self._landed()  # raises it
        out = torch.empty(unique.numel(), self.layout.record_width)
        if self.mapped_reads:  # rows checked against the table, the file's size at open
            torch.index_select(self._records, 0, unique, out=out)
            return out if inverse is None else out.index_select(0, inverse)
        short = self.io.read(self._fd, unique, out, HEADER_BYTES)
        if short >= 0:
            raise StoreError(
                f"backing store {self.path} ends before row {int(unique[short])} of table "
                f"{self.layout.table!r} (a truncated file?); delete it and resume from the "
                "last checkpoint"
            )
        return out if inverse is None else out.index_select(0, inverse)

    def write(self, rows: torch.Tensor, records: torch.Tensor) -> None:
        """Store ``records [n, W]`` at ``rows [n]`` (distinct), copied into the mapping
        (``mapped_writes``) or written in runs of adjacent rows (module doc); in the writer
        thread after ``write_behind``."""
        rows, records = self._checked(rows), records.to(torch.float32)
        if self.mapped_writes and self._writer is None:
            self._write_now(rows, records)  # rows distinct: any order
            return
        if rows.numel() > 1:
            order = torch.argsort(rows)
            rows, records = rows[order], records.index_select(0, order)  # copies
        elif self._writer is not None:
            rows, records = rows.clone(), records.clone()  # the caller may change its own
        records = records.contiguous()
        if self._writer is None:
            self._write_now(rows, records)
            return
        number = self._writes_sent
        with self._flying_lock:
            self._flying[number] = rows
        self._writes_sent += 1
        self._writer.submit(self._write_in_thread, number, rows, records)

    def _write_in_thread(self, number: int, rows: torch.Tensor, records: torch.Tensor) -> None:
        try:
            self._write_now(rows, records)
        except BaseException as e:  # raised where the next read or flush waits
            self._write_error = self._write_error or e
        finally:
            with self._flying_lock:
                del self._flying[number]
            self._writes_landed += 1

    def _in_flight(self, rows: torch.Tensor) -> bool:
        """Whether a write sent and not landed holds any of ``rows`` (sorted)."""
        with self._flying_lock:
            flying = list(self._flying.values())
        if not flying or not rows.numel():
            return False
        return bool(torch.isin(torch.cat(flying), rows).any())

    def _write_now(self, rows: torch.Tensor, records: torch.Tensor) -> None:
        if self.mapped_writes:
            self._records.index_copy_(0, rows, records)
            return
        short = self.io.write(self._fd, rows, records, HEADER_BYTES)
        if short >= 0:  # a write that moved nothing (not seen on a regular file)
            raise StoreError(
                f"backing store {self.path} took no bytes of row {int(rows[short])} of table "
                f"{self.layout.table!r}; check its disk, then resume from the last checkpoint"
            )

    def _checked(self, rows: torch.Tensor) -> torch.Tensor:
        rows = rows.reshape(-1).to(torch.int64)
        n = self.layout.num_embeddings
        if rows.numel() and not 0 <= int(rows.min()) <= int(rows.max()) < n:
            raise IndexError(
                f"rows {int(rows.min())}..{int(rows.max())} outside table "
                f"{self.layout.table!r} of {self.layout.num_embeddings} rows"
            )
        return rows

    def release(self) -> None:
        """Unmap the file's resident pages from this process (those ``records`` touched);
        the data stays in the page cache (dirty pages are written back by the kernel, or by
        ``flush``)."""
        self._map._mmap.madvise(mmap.MADV_DONTNEED)  # type: ignore[attr-defined]  # numpy's memmap keeps its mmap here

    @torch.no_grad()
    def initialize(self, fill_weights: Callable[[torch.Tensor, int, int], None]) -> None:
        """As ``BackingStore.initialize``, written with ``pwrite`` in large chunks (module
        doc): the file's pages go to the page cache, not into this process."""
        self._landed()
        self.release()
        rows, dim = self.layout.num_embeddings, self.layout.embedding_dim
        width = self.layout.record_width
        block = max(1, INIT_CHUNK_BYTES // (4 * width * INIT_BLOCK_ROWS)) * INIT_BLOCK_ROWS
        chunk = torch.zeros(min(block, rows) * width + PAGE_FLOATS)  # room for the last page
        pages = RowIO(self.io.method, max_run_rows=1)  # one page a call (module doc)
        fd = os.open(self.path, os.O_WRONLY)
        try:
            for lo in range(0, rows, block):
                hi = min(rows, lo + block)
                part = chunk[: (hi - lo) * width].view(hi - lo, width)
                chunk.zero_()
                fill_weights(part[:, :dim], lo, hi)
                # a chunk starts at a page (``block`` is whole init blocks); the last one's
                # tail page is padded with zeros past the file's end, which it is cut back to
                count = -(-(hi - lo) * width // PAGE_FLOATS)
                first = (HEADER_BYTES + lo * width * 4) // PAGE_BYTES
                data = chunk[: count * PAGE_FLOATS].view(count, PAGE_FLOATS)
                short = pages.write(fd, torch.arange(first, first + count), data, 0)
                if short >= 0:
                    raise StoreError(f"backing store {self.path}: a page of rows was not written")
            os.ftruncate(fd, HEADER_BYTES + rows * width * 4)
        finally:
            os.close(fd)
        if self.mapped_reads:
            self.map_pages()

    def map_pages(self) -> None:
        """Map every page of the file into this process now (``MADV_POPULATE_READ``, Linux
        5.14 and later; elsewhere the pages map on first touch), so that the mapped reads of
        the steps take no page faults (2 in 500,000 mapped reads of the 8 GiB ``bench
        tiers`` run; a batch's first touches cost 0.2-0.4 us a row without it). A
        file in the page cache maps in about 0.05 s a GiB; a page not in it is read
        from the disk, in sequential read-ahead for the time of the call."""
        mapping = self._map._mmap  # type: ignore[attr-defined]  # numpy's memmap keeps its mmap here
        try:
            mapping.madvise(mmap.MADV_SEQUENTIAL)
            try:
                mapping.madvise(getattr(mmap, "MADV_POPULATE_READ", _MADV_POPULATE_READ))
            finally:
                mapping.madvise(mmap.MADV_RANDOM)
        except (OSError, AttributeError):  # an older kernel, or no madvise here
            pass

    def flush(self) -> None:
        self._landed()
        self._map.flush()  # ``records``' writes
        os.fdatasync(self._fd)  # ``write``'s


def _nothing() -> None:
    """The writer thread's marker: done once every earlier write is."""


def file_system_type(path: Path, mountinfo: str | None = None) -> str | None:
    """The type of the file system that holds ``path`` (``ext4``, ``btrfs``, ...), from
    Linux's ``/proc/self/mountinfo`` (or ``mountinfo``, its text): the deepest mount
    point above the path, the last mounted where two share one. ``None`` where unknown."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:  # not Linux
            return None
    target = os.path.realpath(path)
    found, depth = None, -1
    for line in mountinfo.splitlines():
        left, dash, right = line.partition(" - ")
        fields = left.split()
        if not dash or len(fields) < 5 or not right.split():
            continue
        point = _unescape(fields[4])
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= depth:
            found, depth = right.split()[0], len(point)
    return found


def _unescape(field: str) -> str:
    """A mountinfo path field: spaces, tabs, newlines and backslashes are octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def _sorted_unique(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``rows`` sorted without repeats, and the index of each row in them (``None`` when
    ``rows`` already were: a cache's misses are)."""
    if rows.numel() < 2 or bool((rows[1:] > rows[:-1]).all()):
        return rows, None
    unique, inverse = torch.unique(rows, sorted=True, return_inverse=True)
    return unique, inverse


def _create(path: Path, header: bytes, size: int) -> None:
    """A new store file of ``size`` bytes, its blocks reserved on disk now: a memory-mapped
    write to a block the disk cannot provide would kill the process (SIGBUS) mid-step, so a
    disk without room for the whole table is refused here, before training starts."""
    free = shutil.disk_usage(path.parent).free
    short = (
        f"backing store {path} needs {format_bytes(size)} but its disk has {format_bytes(free)} free; "
        "free space, or set embedding.backing_path to a disk "
        "with room (the run's checkpoints are not touched)"
    )
    if size > free:
        raise StoreError(short)
    try:
        with open(path, "wb") as f:
            f.write(header)
            try:
                os.posix_fallocate(f.fileno(), 0, size)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise
                f.truncate(size)  # a file system without fallocate: sparse, as before
    except OSError as e:
        path.unlink(missing_ok=True)
        if e.errno == errno.ENOSPC:
            raise StoreError(short) from None
        raise StoreError(
            f"cannot create backing store {path}: {e.strerror}; set "
            "embedding.backing_path to a writable directory"
        ) from None


def encode_header(layout: RowLayout) -> bytes:
    body = json.dumps(layout.to_json(), sort_keys=True).encode()
    header = MAGIC + struct.pack("<II", VERSION, len(body)) + body
    header += struct.pack("<I", zlib.crc32(body))
    if len(header) > HEADER_BYTES:
        raise StoreError(
            f"table name {layout.table[:40]!r}... is too long for a store header; shorten it"
        )
    return header.ljust(HEADER_BYTES, b"\0")


def read_header(path: Path) -> dict[str, object]:
    """The layout a store file was written for; ``StoreError`` if its header is damaged."""
    with open(path, "rb") as f:
        raw = f.read(HEADER_BYTES)
    damaged = f"backing store {path} has a damaged header"
    fix = "; delete the file (its rows are rewritten from the run's init or checkpoint)"
    if len(raw) < len(MAGIC) + 8 or raw[: len(MAGIC)] != MAGIC:
        raise StoreError(f"{path} is not a towerrec backing store (no magic){fix}")
    version, length = struct.unpack_from("<II", raw, len(MAGIC))
    if version != VERSION:
        raise StoreError(f"backing store {path} has format version {version}, not {VERSION}{fix}")
    start = len(MAGIC) + 8
    if start + length + 4 > min(HEADER_BYTES, len(raw)):
        raise StoreError(f"{damaged} (length {length}){fix}")
    body = raw[start : start + length]
    (crc,) = struct.unpack_from("<I", raw, start + length)
    if zlib.crc32(body) != crc:
        raise StoreError(f"{damaged} (checksum mismatch){fix}")
    try:
        found = json.loads(body)
    except ValueError:
        raise StoreError(f"{damaged} (unreadable JSON){fix}") from None
    if not isinstance(found, dict):
        raise StoreError(f"{damaged} (not a JSON object){fix}")
    return found
