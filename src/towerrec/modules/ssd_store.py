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

Memory: the SSD store's rows are never all in the process. ``initialize`` writes the
file with ``pwrite`` in chunks of ``INIT_CHUNK_BYTES`` (the kernel's page cache takes
them, not the process's mapping); ``read`` takes each row's record with ``preadv``,
which maps nothing (a fault through the mapping would map the large folio around the
row, below, only for the next drop to unmap it again); and the pages
a training run's write-backs map are dropped from the mapping (``madvise(MADV_DONTNEED)``: a shared
file mapping keeps its data in the page cache, dirty pages included) once about
``mapped_limit`` bytes of them may be resident, counting ``ROW_MAP_BYTES`` a row: a
fault maps the page-cache folio around the row, and with transparent huge pages the
page cache holds large folios (about 512 KiB a row was measured on a file written
with ``pwrite``; ``MADV_RANDOM``, set on the mapping, stops read-ahead from disk but
not this). Writes go in chunks within the limit. The process's resident
memory thus holds the cache's slots and about ``mapped_limit`` of the file at most,
whatever the table's size; the page cache, which the kernel reclaims, holds what it can of the rest.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import shutil
import struct
import weakref
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from towerrec.modules.tables import INIT_BLOCK_ROWS
from towerrec.modules.tier_store import (
    BackingStore,
    RowLayout,
    StoreError,
    check_writable,
    describe_layout,
    format_bytes,
)

__all__ = ["HEADER_BYTES", "SUFFIX", "SsdStore", "encode_header", "read_header"]

MAGIC = b"TWRSTORE"
VERSION = 1
HEADER_BYTES = 4096
SUFFIX = ".tstore"
INIT_CHUNK_BYTES = 64 << 20  # initialize's write size (whole init blocks of rows)
MAPPED_LIMIT_BYTES = 256 << 20  # store pages a process may hold mapped (module doc)
ROW_MAP_BYTES = 2 << 20  # what one row's page fault may map (module doc)


class SsdStore(BackingStore):
    """A memory-mapped file of fixed-size rows (module doc), created if missing."""

    def __init__(
        self, layout: RowLayout, path: Path, mapped_limit: int = MAPPED_LIMIT_BYTES
    ) -> None:
        super().__init__(layout)
        self.path = Path(path)
        self.mapped_limit = mapped_limit
        self._mapped = 0  # bytes of pages touched through the mapping since the last drop
        check_writable(self.path)
        size = HEADER_BYTES + layout.num_embeddings * layout.record_width * 4
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
        # Random access: no read-ahead from disk for a missed row.
        self._map._mmap.madvise(mmap.MADV_RANDOM)  # type: ignore[attr-defined]  # numpy's memmap keeps its mmap here
        self._records = torch.from_numpy(self._map)
        self._fd = os.open(self.path, os.O_RDONLY)  # ``read``'s; the page cache is shared
        weakref.finalize(self, os.close, self._fd)

    @property
    def records(self) -> torch.Tensor:
        return self._records

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        """Records ``[n, W]`` of ``rows``, each read from the file with ``preadv`` (module
        doc): it sees the mapping's writes (one page cache) and maps nothing."""
        width = self.layout.record_width
        size = 4 * width
        out = torch.empty(rows.numel(), width)
        view = out.numpy().data.cast("B")
        for i, row in enumerate(rows.tolist()):
            offset = HEADER_BYTES + row * size
            if os.preadv(self._fd, [view[i * size : (i + 1) * size]], offset) != size:
                raise StoreError(
                    f"backing store {self.path} ends before row {row} of table "
                    f"{self.layout.table!r} (a truncated file?); delete it and resume from the "
                    "last checkpoint"
                )
        return out

    def write(self, rows: torch.Tensor, records: torch.Tensor) -> None:
        step = self._chunk_rows()
        for lo in range(0, rows.numel(), step):
            super().write(rows[lo : lo + step], records[lo : lo + step])
            self._touched(min(step, rows.numel() - lo))

    def _chunk_rows(self) -> int:
        """Rows one write maps at most between two checks of the limit."""
        return max(1, self.mapped_limit // (2 * ROW_MAP_BYTES))

    def _touched(self, rows: int) -> None:
        """Count the bytes ``rows`` random rows may have mapped (``ROW_MAP_BYTES`` each);
        past ``mapped_limit``, drop the mapping's pages (module doc)."""
        self._mapped += rows * ROW_MAP_BYTES
        if self._mapped > self.mapped_limit:
            self.release()

    def release(self) -> None:
        """Unmap the file's resident pages from this process; the data stays in the page
        cache (dirty pages are written back by the kernel, or by ``flush``)."""
        self._map._mmap.madvise(mmap.MADV_DONTNEED)  # type: ignore[attr-defined]  # numpy's memmap keeps its mmap here
        self._mapped = 0

    @torch.no_grad()
    def initialize(self, fill_weights: Callable[[torch.Tensor, int, int], None]) -> None:
        """As ``BackingStore.initialize``, written with ``pwrite`` in large chunks (module
        doc): the file's pages go to the page cache, not into this process."""
        self.release()
        rows, dim = self.layout.num_embeddings, self.layout.embedding_dim
        width = self.layout.record_width
        block = max(1, INIT_CHUNK_BYTES // (4 * width * INIT_BLOCK_ROWS)) * INIT_BLOCK_ROWS
        chunk = torch.zeros(min(block, rows), width)
        fd = os.open(self.path, os.O_WRONLY)
        try:
            for lo in range(0, rows, block):
                hi = min(rows, lo + block)
                part = chunk[: hi - lo]
                part.zero_()
                fill_weights(part[:, :dim], lo, hi)
                data = part.numpy().data.cast("B")
                offset, done = HEADER_BYTES + lo * width * 4, 0
                while done < len(data):
                    done += os.pwrite(fd, data[done:], offset + done)
        finally:
            os.close(fd)

    def flush(self) -> None:
        self._map.flush()


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
