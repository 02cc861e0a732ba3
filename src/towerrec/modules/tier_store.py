"""Backing stores of cached tables (``modules/cached.py``): every row of a table with its
optimizer state, in host memory or in a file of fixed-size rows on SSD.

A row is one record of float32 values, the weight and then each per-row optimizer
state (its width: 1 for row-wise Adagrad's momentum, D for Adagrad's and Adam's)::

    record r   [ weight (D) | state_0 (w_0) | state_1 (w_1) | ... ]     W = D + sum(w_i)

The SSD store is one file per table, memory-mapped; row r starts at a fixed offset,
so a batch's misses are a gather of records and its write-backs a scatter, with no
index to keep::

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
them, not the process's mapping), and the pages a training run's reads and
write-backs map are dropped from the mapping (``madvise(MADV_DONTNEED)``: a shared
file mapping keeps its data in the page cache, dirty pages included) once about
``mapped_limit`` bytes of them may be resident, counting ``ROW_MAP_BYTES`` a row: a
fault maps the page-cache folio around the row, and with transparent huge pages the
page cache holds large folios (about 512 KiB a row was measured on a file written
with ``pwrite``; ``MADV_RANDOM``, set on the mapping, stops read-ahead from disk but
not this). Reads and writes go in chunks within the limit. The process's resident
memory thus holds the cache's slots and about ``mapped_limit`` of the file at most,
whatever the table's size; the page cache, which the kernel reclaims, holds what it can of the rest.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import shutil
import stat
import struct
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from towerrec.memory import register_parent_only
from towerrec.modules.cached_config import Backing, TierConfig
from towerrec.modules.tables import INIT_BLOCK_ROWS

__all__ = [
    "HEADER_BYTES",
    "BackingStore",
    "HostStore",
    "RowLayout",
    "SsdStore",
    "StoreError",
    "build_store",
]

MAGIC = b"TWRSTORE"
VERSION = 1
HEADER_BYTES = 4096
SUFFIX = ".tstore"
INIT_CHUNK_BYTES = 64 << 20  # initialize's write size (whole init blocks of rows)
MAPPED_LIMIT_BYTES = 256 << 20  # store pages a process may hold mapped (module doc)
ROW_MAP_BYTES = 2 << 20  # what one row's page fault may map (module doc)


class StoreError(ValueError):
    """A backing store that cannot be used; the message names the file and the fix."""


@dataclass(frozen=True)
class RowLayout:
    """What a store's records hold: ``states`` are ``(name, width)`` per row, in order."""

    table: str
    num_embeddings: int
    embedding_dim: int
    states: tuple[tuple[str, int], ...] = ()
    dtype: str = "float32"

    @property
    def record_width(self) -> int:
        return self.embedding_dim + sum(w for _, w in self.states)

    def state_columns(self) -> dict[str, tuple[int, int]]:
        """``{name: (first column, width)}`` of each state inside a record."""
        out, col = {}, self.embedding_dim
        for name, width in self.states:
            out[name] = (col, width)
            col += width
        return out

    def to_json(self) -> dict[str, object]:
        return {
            "table": self.table,
            "rows": self.num_embeddings,
            "dim": self.embedding_dim,
            "dtype": self.dtype,
            "states": [[name, width] for name, width in self.states],
        }


class BackingStore(ABC):
    """All rows of one table: ``records [rows, W]`` (module doc)."""

    def __init__(self, layout: RowLayout) -> None:
        self.layout = layout

    @property
    @abstractmethod
    def records(self) -> torch.Tensor:
        """``[rows, W]`` float32 on the CPU; in-place writes reach the store."""

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        """Records ``[n, W]`` of ``rows [n]`` (int64, CPU)."""
        return self.records.index_select(0, rows)

    def write(self, rows: torch.Tensor, records: torch.Tensor) -> None:
        """Store ``records [n, W]`` at ``rows [n]``."""
        self.records.index_copy_(0, rows, records)

    def weight(self) -> torch.Tensor:
        """The table's weights ``[rows, D]`` (a view)."""
        return self.records[:, : self.layout.embedding_dim]

    def states(self) -> dict[str, torch.Tensor]:
        """Views of the optimizer states: ``[rows]`` for width 1, else ``[rows, w]``."""
        out = {}
        for name, (col, width) in self.layout.state_columns().items():
            out[name] = self.records[:, col] if width == 1 else self.records[:, col : col + width]
        return out

    @torch.no_grad()
    def initialize(self, fill_weights: Callable[[torch.Tensor, int, int], None]) -> None:
        """Write every row: ``fill_weights(out [n, D], lo, hi)`` gives rows ``lo:hi``'s
        initial weights, states start at zero; one block in memory at a time."""
        block, rows, dim = 16384, self.layout.num_embeddings, self.layout.embedding_dim
        records = self.records
        for lo in range(0, rows, block):
            hi = min(rows, lo + block)
            chunk = torch.zeros(hi - lo, self.layout.record_width)
            fill_weights(chunk[:, :dim], lo, hi)
            records[lo:hi] = chunk

    @abstractmethod
    def flush(self) -> None:
        """Make written rows durable."""


class HostStore(BackingStore):
    """A full-size array in host memory (forked loader workers drop its pages)."""

    def __init__(self, layout: RowLayout) -> None:
        super().__init__(layout)
        self._records = torch.zeros(layout.num_embeddings, layout.record_width)
        register_parent_only(self)

    def memory_ranges(self) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of the rows (``towerrec.memory``)."""
        return [(self._records.data_ptr(), self._records.nbytes)]

    @property
    def records(self) -> torch.Tensor:
        return self._records

    def flush(self) -> None:
        pass  # host memory has nothing to make durable


class SsdStore(BackingStore):
    """A memory-mapped file of fixed-size rows (module doc), created if missing."""

    def __init__(
        self, layout: RowLayout, path: Path, mapped_limit: int = MAPPED_LIMIT_BYTES
    ) -> None:
        super().__init__(layout)
        self.path = Path(path)
        self.mapped_limit = mapped_limit
        self._mapped = 0  # bytes of pages touched through the mapping since the last drop
        _check_writable(self.path)
        size = HEADER_BYTES + layout.num_embeddings * layout.record_width * 4
        if self.path.exists():
            found = read_header(self.path)
            if found != layout.to_json():
                raise StoreError(
                    f"backing store {self.path} was written for {_describe(found)}, not "
                    f"{_describe(layout.to_json())}; delete it, or point "
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

    @property
    def records(self) -> torch.Tensor:
        return self._records

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        step = self._chunk_rows()
        if rows.numel() <= step:
            out = super().read(rows)
            self._touched(rows.numel())
            return out
        parts = []
        for lo in range(0, rows.numel(), step):
            parts.append(super().read(rows[lo : lo + step]))
            self._touched(parts[-1].shape[0])
        return torch.cat(parts)

    def write(self, rows: torch.Tensor, records: torch.Tensor) -> None:
        step = self._chunk_rows()
        for lo in range(0, rows.numel(), step):
            super().write(rows[lo : lo + step], records[lo : lo + step])
            self._touched(min(step, rows.numel() - lo))

    def _chunk_rows(self) -> int:
        """Rows one read or write maps at most between two checks of the limit."""
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
        f"backing store {path} needs {_bytes(size)} but its disk has {_bytes(free)} free; "
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


def _bytes(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.4g} {unit}"
        n /= 1024
    return f"{n:.4g} TiB"


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
    if start + length + 4 > HEADER_BYTES:
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


def _describe(layout: dict[str, object]) -> str:
    states = layout.get("states") or []
    names = ", ".join(f"{s[0]}[{s[1]}]" for s in states) if isinstance(states, list) else "?"
    return (
        f"table {layout.get('table')!r} of {layout.get('rows')} rows x {layout.get('dim')} "
        f"{layout.get('dtype')} with optimizer state ({names or 'none'})"
    )


def _check_writable(path: Path) -> None:
    """Refuse a directory or file without write permission, even to root: a path made
    read-only is not to be written."""
    directory = path.parent
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StoreError(
            f"cannot create the backing directory {directory}: {e.strerror}; set "
            "embedding.backing_path to a writable directory"
        ) from None
    for target in (directory, path):
        if not target.exists():
            continue
        mode = target.stat().st_mode
        read_only_fs = bool(os.statvfs(target).f_flag & os.ST_RDONLY)
        if read_only_fs or not mode & stat.S_IWUSR or not os.access(target, os.W_OK):
            raise StoreError(
                f"backing path {target} is read-only; the cache writes evicted rows back to "
                "it: make it writable or set embedding.backing_path to a writable directory"
            )


def build_store(layout: RowLayout, tier: TierConfig, name: str | None = None) -> BackingStore:
    """The backing store ``tier`` asks for (one file per table: ``<path>/<name>.tstore``,
    ``name`` defaulting to the table's; a shard's store names its shard)."""
    if tier.backing is Backing.HOST:
        return HostStore(layout)
    return SsdStore(layout, Path(tier.backing_path) / f"{name or layout.table}{SUFFIX}")
