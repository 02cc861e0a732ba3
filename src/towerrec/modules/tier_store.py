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

The key-value store (``backing = "kv"``, ``KvStore``) holds the rows of a table of
sparse 64-bit ids in an LMDB environment, ``<backing_path>/<table>.kvstore/``: key the
row id (8 bytes big-endian, so keys sort as ids), value its record as above. A row that
is not stored is created when read, from its id (``tables.init_rows``, states zero), and
stored when first written back: the store holds the rows training touched, never the
table. A sub-database ``meta`` holds the header (format version, table, rows, dim,
dtype, states, init and seed); an environment written for another table, shape,
optimizer or init is refused. Write-backs commit one LMDB transaction each (no
``fsync``; ``flush`` syncs), so a killed process leaves the last committed write-back,
never a half-written one. Checkpoints hold a compacted copy of the environment with a
CRC32 of its file (``save_copy`` / ``load_copy``), checked before it is trusted.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import shutil
import stat
import struct
import weakref
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lmdb
import numpy as np
import torch

from towerrec.memory import register_parent_only
from towerrec.modules.cached_config import Backing, TierConfig
from towerrec.modules.tables import INIT_BLOCK_ROWS, TableConfig, init_rows

__all__ = [
    "HEADER_BYTES",
    "BackingStore",
    "HostStore",
    "KvStore",
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
KV_SUFFIX = ".kvstore"
KV_VERSION = 1
KV_MAP_BYTES = 1 << 40  # address space an LMDB store may grow to (its file grows as used)
KV_LOW_DISK_BYTES = 16 << 20  # a failed write with less free counts as a full disk
KV_COPY_META = "store.json"  # beside a checkpoint's copy: header, rows, CRC32


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


def _describe(layout: dict[str, object]) -> str:
    states = layout.get("states") or []
    names = "?"  # a damaged header's states: no name and width each
    if isinstance(states, list) and all(isinstance(s, list) and len(s) == 2 for s in states):
        names = ", ".join(f"{s[0]}[{s[1]}]" for s in states)
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


def build_store(
    layout: RowLayout,
    tier: TierConfig,
    name: str | None = None,
    table: TableConfig | None = None,
    seed: int = 0,
) -> BackingStore:
    """The backing store ``tier`` asks for (one file per table: ``<path>/<name>.tstore``,
    ``name`` defaulting to the table's; a shard's store names its shard). A kv store
    needs ``table`` and ``seed``: it initialises rows from them on first touch."""
    if tier.backing is Backing.HOST:
        return HostStore(layout)
    if tier.backing is Backing.KV:
        if table is None:
            raise ValueError(f"table {layout.table!r}: a kv store needs its TableConfig")
        return KvStore(
            layout, Path(tier.backing_path) / f"{name or layout.table}{KV_SUFFIX}", table, seed
        )
    return SsdStore(layout, Path(tier.backing_path) / f"{name or layout.table}{SUFFIX}")


class KvStore(BackingStore):
    """Rows keyed by 64-bit id in an LMDB environment, created on first touch (module doc)."""

    def __init__(
        self,
        layout: RowLayout,
        path: Path,
        table: TableConfig,
        seed: int,
        map_bytes: int = KV_MAP_BYTES,
    ) -> None:
        super().__init__(layout)
        self.path = Path(path)
        self.table, self.seed, self.map_bytes = table, seed, map_bytes
        self.header = {
            "format": "towerrec-kv",
            "version": KV_VERSION,
            **layout.to_json(),
            "init": table.init,
            "init_scale": table.scale,
            "seed": seed,
        }
        _check_writable(self.path)  # the backing directory, and the store's if it exists
        _check_writable(self.path / "data.mdb")
        self._open()
        found = self._read_header()
        if found is None:
            self._write_header()
        elif found != self.header:
            raise StoreError(
                f"kv store {self.path} was written for {_describe_kv(found)}, not "
                f"{_describe_kv(self.header)}; delete it, or point embedding.backing_path "
                "at another directory"
            )

    # ------------------------------------------------------------ environment
    def _open(self) -> None:
        try:
            self._env = lmdb.open(
                str(self.path),
                map_size=self.map_bytes,
                max_dbs=2,
                sync=False,  # a commit is safe from a killed process; flush() syncs
                metasync=False,
                readahead=False,
            )
            self._rows = self._env.open_db(b"rows")
            self._meta = self._env.open_db(b"meta")
        except lmdb.Error as e:
            raise self._error("cannot be opened", e) from None

    def close(self) -> None:
        self._env.close()

    def _error(self, what: str, error: BaseException, writing: bool = False) -> StoreError:
        """A ``StoreError`` naming the table, the store and the fix for ``error``. LMDB
        reports a commit to a full disk as an I/O error: a failed write with under
        ``KV_LOW_DISK_BYTES`` free on the store's disk counts as a full disk."""
        text = str(error)
        low = writing and shutil.disk_usage(self.path.parent).free < KV_LOW_DISK_BYTES
        if _no_space(error) or low:
            return StoreError(
                f"kv store {self.path} of table {self.layout.table!r} {what}: the disk is "
                f"full ({text}); free space or set embedding.backing_path to a disk with room, "
                "then resume from the last checkpoint (it is not touched)"
            )
        if isinstance(error, lmdb.MapFullError):
            return StoreError(
                f"kv store {self.path} of table {self.layout.table!r} {what}: it reached its "
                f"map size of {_bytes(self.map_bytes)} ({text}); resume from the last "
                "checkpoint on a larger disk, or use fewer distinct ids"
            )
        if isinstance(error, lmdb.ReadonlyError) or "read-only" in text.lower():
            return StoreError(
                f"kv store {self.path} of table {self.layout.table!r} {what}: it is read-only "
                f"({text}); make it writable or set embedding.backing_path to a writable "
                "directory"
            )
        if writing:
            return StoreError(
                f"kv store {self.path} of table {self.layout.table!r} {what} ({text}); check "
                "the disk under embedding.backing_path, then resume from the last checkpoint "
                "(it is not touched)"
            )
        return StoreError(
            f"kv store {self.path} of table {self.layout.table!r} {what} ({text}): it is "
            "damaged or not an LMDB store; delete it (a run rewrites it from its init or "
            "checkpoint)"
        )

    def _read_header(self) -> dict[str, object] | None:
        try:
            with self._env.begin(db=self._meta) as txn:
                raw = txn.get(b"header")
        except lmdb.Error as e:
            raise self._error("cannot be read", e) from None
        if raw is None:
            return None
        try:
            found = json.loads(raw)
        except ValueError:
            found = None
        if not isinstance(found, dict):
            raise StoreError(
                f"kv store {self.path} of table {self.layout.table!r} has a damaged header; "
                "delete it (a run rewrites it from its init or checkpoint)"
            )
        return found

    def _write_header(self) -> None:
        body = json.dumps(self.header, sort_keys=True).encode()
        try:
            with self._env.begin(write=True, db=self._meta) as txn:
                txn.put(b"header", body)
        except lmdb.Error as e:
            raise self._error("cannot be written", e, writing=True) from None

    # ------------------------------------------------------------------ rows
    @property
    def records(self) -> torch.Tensor:
        raise StoreError(
            f"table {self.layout.table!r} is a kv table ({self.layout.num_embeddings} rows "
            "keyed by id, created on first touch): its rows are never a dense array; this "
            "feature needs embedding.backing = 'host' or 'ssd' for it"
        )

    def __len__(self) -> int:
        """The rows stored (those written back at least once)."""
        with self._env.begin(db=self._rows) as txn:
            return int(txn.stat(self._rows)["entries"])

    def ids(self) -> torch.Tensor:
        """The stored rows' ids, ascending (int64)."""
        with self._env.begin(db=self._rows) as txn:
            keys = b"".join(txn.cursor().iternext(keys=True, values=False))
        return torch.from_numpy(np.frombuffer(keys, dtype=">u8").astype(np.int64))

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        """Records of ``rows``: stored ones from the store (looked up in key order), the
        others made from their ids (``tables.init_rows``, states zero)."""
        ids, inverse = torch.unique(rows.reshape(-1).cpu(), return_inverse=True)
        width = self.layout.record_width
        try:
            with self._env.begin(db=self._rows) as txn:
                stored = txn.cursor().getmulti(_keys(ids))
        except lmdb.Error as e:
            raise self._error("cannot be read", e) from None
        out = torch.zeros(ids.numel(), width)
        found = torch.zeros(ids.numel(), dtype=torch.bool)
        if stored:
            keys = np.frombuffer(b"".join(k for k, _ in stored), dtype=">u8").astype(np.int64)
            values = np.frombuffer(b"".join(v for _, v in stored), dtype=np.float32)
            if values.size != len(stored) * width:
                raise StoreError(
                    f"kv store {self.path} of table {self.layout.table!r} holds records of "
                    f"another width than {width}; it is damaged: delete it and resume from "
                    "the last checkpoint"
                )
            at = torch.searchsorted(ids, torch.from_numpy(keys))  # ids are sorted, unique
            found[at] = True
            out[at] = torch.from_numpy(values.reshape(len(stored), width).copy())
        new = ~found
        if bool(new.any()):
            out[new, : self.layout.embedding_dim] = init_rows(self.table, self.seed, ids[new])
        return out[inverse]

    def write(self, rows: torch.Tensor, records: torch.Tensor) -> None:
        order = torch.argsort(rows.reshape(-1).cpu())  # key order: B-tree pages in sequence
        data = records.detach().to(torch.float32).cpu()[order].contiguous().numpy()
        size = data.shape[1] * 4
        raw = data.tobytes()
        keys = _keys(rows.reshape(-1).cpu()[order])
        items = [(k, raw[i * size : (i + 1) * size]) for i, k in enumerate(keys)]
        try:
            with self._env.begin(write=True, db=self._rows) as txn:
                txn.cursor().putmulti(items)
        except lmdb.Error as e:
            raise self._error("cannot take the rows written back", e, writing=True) from None

    @torch.no_grad()
    def initialize(self, fill_weights: Callable[[torch.Tensor, int, int], None]) -> None:
        """Empty the store: every row starts again from its id (``tables.init_rows``, not
        ``fill_weights``: a kv table has no row ranges to fill)."""
        try:
            with self._env.begin(write=True) as txn:
                txn.drop(self._rows, delete=False)
        except lmdb.Error as e:
            raise self._error("cannot be emptied", e, writing=True) from None
        self._write_header()

    def flush(self) -> None:
        try:
            self._env.sync(True)
        except lmdb.Error as e:
            raise self._error("cannot be synced to disk", e, writing=True) from None

    # ------------------------------------------------------------ checkpoints
    def save_copy(self, directory: Path) -> None:
        """A consistent, compacted copy of the store in ``directory`` (created; it must not
        exist) with ``store.json``: the header, the rows held and a CRC32 of the copy."""
        directory = Path(directory)
        try:
            directory.mkdir(parents=True)
            self._env.copy(str(directory), compact=True)
            crc, size = _crc32(directory / "data.mdb")
            meta = {"header": self.header, "rows": len(self), "crc32": crc, "bytes": size}
            (directory / KV_COPY_META).write_text(json.dumps(meta, sort_keys=True) + "\n")
        except (OSError, lmdb.Error) as e:
            if _no_space(e):
                raise StoreError(
                    f"no room to save kv table {self.layout.table!r} in the checkpoint at "
                    f"{directory} ({e}); free space on the run directory's disk and resume "
                    "(the previous checkpoint is intact)"
                ) from None
            raise StoreError(
                f"cannot save kv table {self.layout.table!r} in the checkpoint at "
                f"{directory} ({e}); the previous checkpoint is intact"
            ) from None

    def load_copy(self, directory: Path) -> None:
        """Replace the store's rows by a checkpoint's copy (``save_copy``), refusing a copy
        of another table, shape or optimizer, and a damaged one."""
        directory = Path(directory)
        meta_file, data = directory / KV_COPY_META, directory / "data.mdb"
        table = self.layout.table
        if not meta_file.is_file() or not data.is_file():
            raise StoreError(
                f"checkpoint {directory.parent.parent} has no store of kv table {table!r} "
                f"({directory} is missing or incomplete); it was saved from a model where "
                f"{table!r} is not a kv table: resume with the config the run was started with"
            )
        try:
            meta = json.loads(meta_file.read_text())
            header, crc, size = meta["header"], int(meta["crc32"]), int(meta["bytes"])
            if not isinstance(header, dict):
                raise TypeError("the header is not an object")
        except (ValueError, KeyError, TypeError):
            raise StoreError(
                f"checkpoint store {directory} of table {table!r} has a damaged "
                f"{KV_COPY_META}; it is refused: resume from an earlier checkpoint"
            ) from None
        if header != self.header:
            raise StoreError(
                f"checkpoint store {directory} was written for {_describe_kv(header)}, not "
                f"{_describe_kv(self.header)}; resume with the config the run was started "
                "with (its config.toml), or start a fresh run"
            )
        if _crc32(data) != (crc, size):
            raise StoreError(
                f"checkpoint store {directory} of table {table!r} is damaged (its CRC32 or "
                "size does not match store.json); it is refused: resume from an earlier "
                "checkpoint"
            )
        live = self.path / "data.mdb"
        staged = self.path / "data.mdb.loading"
        self.close()
        try:
            shutil.copyfile(data, staged)
            os.replace(staged, live)
        except OSError as e:
            staged.unlink(missing_ok=True)
            self._open()
            raise self._error("cannot take the checkpoint's rows", e, writing=True) from None
        self._open()
        if self._read_header() != self.header:
            raise StoreError(f"checkpoint store {directory} of table {table!r} lost its header")


def _keys(ids: torch.Tensor) -> list[bytes]:
    """LMDB keys of ``ids``: 8 bytes big-endian each (they sort as the ids)."""
    raw = ids.reshape(-1).cpu().numpy().astype(">u8").tobytes()
    return [raw[i : i + 8] for i in range(0, len(raw), 8)]


def _crc32(path: Path) -> tuple[int, int]:
    """CRC32 and size of the file at ``path``, read in 16 MiB chunks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return crc, size


def _no_space(error: BaseException) -> bool:
    return getattr(error, "errno", None) == errno.ENOSPC or os.strerror(errno.ENOSPC) in str(error)


def _describe_kv(header: dict[str, object]) -> str:
    return (
        f"{_describe(header)}, init {header.get('init')} scale {header.get('init_scale')} "
        f"seed {header.get('seed')}"
    )
