"""The key-value store of cached tables (``backing = "kv"``): the rows of a table of
sparse 64-bit ids in an LMDB environment.

``KvStore`` keeps them in ``<backing_path>/<table>.kvstore/``: key the row id (8 bytes
big-endian, so keys sort as ids), value its record (``tier_store.RowLayout``). A row that
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
import os
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path

import lmdb
import numpy as np
import torch

from towerrec.modules.tables import TableConfig, init_rows
from towerrec.modules.tier_store import (
    BackingStore,
    RowLayout,
    StoreError,
    check_writable,
    describe_layout,
    format_bytes,
)

__all__ = ["KV_SUFFIX", "KvStore"]

KV_SUFFIX = ".kvstore"
KV_VERSION = 1
KV_MAP_BYTES = 1 << 40  # address space an LMDB store may grow to (its file grows as used)
KV_LOW_DISK_BYTES = 16 << 20  # a failed write with less free counts as a full disk
KV_COPY_META = "store.json"  # beside a checkpoint's copy: header, rows, CRC32


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
        check_writable(self.path)  # the backing directory, and the store's if it exists
        check_writable(self.path / "data.mdb")
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
            self._check_size()
            self._rows = self._env.open_db(b"rows")
            self._meta = self._env.open_db(b"meta")
        except lmdb.Error as e:
            raise self._error("cannot be opened", e) from None

    def _check_size(self) -> None:
        """Refuse a ``data.mdb`` shorter than its pages: reading past its end through
        the map kills the process with SIGBUS. Runs before any page past the two meta
        pages (which ``lmdb.open`` has read) is touched."""
        need = (self._env.info()["last_pgno"] + 1) * self._env.stat()["psize"]
        data = self.path / "data.mdb"
        size = data.stat().st_size
        if size < need:
            self._env.close()
            raise StoreError(
                f"kv store {self.path} of table {self.layout.table!r} is truncated ({data} "
                f"has {size} bytes, needs {need}); delete it (a run rewrites it from its init "
                "or checkpoint)"
            )

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
                f"map size of {format_bytes(self.map_bytes)} ({text}); resume from the last "
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
        f"{describe_layout(header)}, init {header.get('init')} scale {header.get('init_scale')} "
        f"seed {header.get('seed')}"
    )
