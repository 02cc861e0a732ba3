"""The binary columnar cache: what preprocessing writes and the loader memory-maps.

A cache is a directory::

    DIR/manifest.json                 schema, table sizes, rows, parts, checksums, report
    DIR/parts/<part>/<split>.<column>.bin    raw little-endian arrays, one file per column

Each input file becomes one *part* (so preprocessing resumes file by file);
a part holds rows of one or more splits (``train``, ``validation``, ``test``;
caches of earlier versions name validation ``eval``). Columns of a split with n
rows::

    labels           float32 [n]
    dense            float32 [n, F]
    sparse           int32   [n, T]      single-hot ids, one column per feature
    <feature>.values int32   [sum(lengths)]   multi-hot ids, sample after sample
    <feature>.lengths int32  [n]              ids per sample

Every file's SHA-256 is in the manifest, and the manifest carries the SHA-256 of its
own other keys (``manifest_sha256``): a changed table size, row count or checksum in it
is refused at every read. ``open_cache`` checks the files' sizes always and
checksums by ``Verify``: by default (``once``) it hashes the files on the first
open and records the files' sizes and mtimes in ``DIR/verified.json``, then
hashes again only when one of them changed, so a terabyte cache is not re-read
at every start; ``always`` hashes at every open (catches corruption that keeps
size and mtime, e.g. a failing disk). A cache that does not match is refused
with a message saying to rebuild it: a corrupt cache never trains silently.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np

from towerrec.checksums import sealed, unseal
from towerrec.data.batch import DataSchema, SparseFeature
from towerrec.data.json_shape import COUNT, FINITE, FLAG, NAME, ROWS, TEXT, Map, check_shape
from towerrec.data.splits import LEGACY_NAMES, SPLITS
from towerrec.utils import parse_enum

__all__ = [
    "FORMAT",
    "MAX_CACHE_ROWS",
    "CacheError",
    "ColumnStore",
    "PartWriter",
    "SplitColumns",
    "Verify",
    "fsync_path",
    "map_column",
    "open_cache",
    "open_part",
    "read_manifest",
    "schema_from_manifest",
    "schema_to_manifest",
    "verify_part",
    "write_manifest",
]

log = logging.getLogger("towerrec")

FORMAT = "towerrec-cache"
VERSION = 1
MAX_CACHE_ROWS = 2**31 - 1  # ids are stored as int32
_DTYPES = {"labels": np.float32, "dense": np.float32, "sparse": np.int32}
_HASH_BLOCK = 1 << 22


class CacheError(ValueError):
    """A cache directory that cannot be used; the message says how to fix it."""


# ------------------------------------------------------------------ schema
def schema_to_manifest(schema: DataSchema, multi_hot: set[str]) -> dict[str, Any]:
    for f in schema.sparse:
        if f.num_embeddings > MAX_CACHE_ROWS:
            raise CacheError(
                f"feature {f.name!r}: {f.num_embeddings:,} rows do not fit a cache, which "
                f"stores ids as int32 (at most {MAX_CACHE_ROWS:,} rows); hash into fewer rows"
            )
    return {
        "num_dense": schema.num_dense,
        "sparse": [
            {
                "name": f.name,
                "num_embeddings": f.num_embeddings,
                "pooling_factor": f.pooling_factor,
                "multi_hot": f.name in multi_hot,
            }
            for f in schema.sparse
        ],
    }


def schema_from_manifest(data: dict[str, Any]) -> tuple[DataSchema, list[str], list[str]]:
    """The schema, the single-hot feature names and the multi-hot feature names."""
    features = tuple(
        SparseFeature(f["name"], int(f["num_embeddings"]), float(f["pooling_factor"]))
        for f in data["sparse"]
    )
    single = [f["name"] for f in data["sparse"] if not f["multi_hot"]]
    multi = [f["name"] for f in data["sparse"] if f["multi_hot"]]
    # Batches carry single-hot features first, then multi-hot ones.
    order = {name: i for i, name in enumerate(single + multi)}
    features = tuple(sorted(features, key=lambda f: order[f.name]))
    return DataSchema(int(data["num_dense"]), features), single, multi


# ------------------------------------------------------------------ columns
@dataclass
class SplitColumns:
    """One split of one part: arrays (memory-mapped or in memory) of ``rows`` samples."""

    rows: int
    labels: np.ndarray
    dense: np.ndarray
    sparse: np.ndarray
    multi: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    # feature -> (values [sum(lengths)], offsets [rows + 1] int64)

    @staticmethod
    def from_arrays(
        labels: np.ndarray,
        dense: np.ndarray,
        sparse: np.ndarray,
        multi: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
    ) -> SplitColumns:
        """In-memory columns; ``multi`` maps feature -> (values, lengths)."""
        offsets = {
            name: (values, _offsets(lengths)) for name, (values, lengths) in (multi or {}).items()
        }
        return SplitColumns(len(labels), labels, dense, sparse, offsets)


def _offsets(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


@dataclass
class ColumnStore:
    """All parts of every split, with the schema that describes them."""

    schema: DataSchema
    single: list[str]
    multi: list[str]
    splits: dict[str, list[SplitColumns]]
    manifest: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for old, new in LEGACY_NAMES.items():  # an earlier version's name of a split
            if old in self.splits and new not in self.splits:
                self.splits[new] = self.splits.pop(old)

    def rows(self, split: str) -> int:
        split = LEGACY_NAMES.get(split, split)
        return sum(p.rows for p in self.splits.get(split, []))


# ------------------------------------------------------------------ writing
class PartWriter:
    """Appends columns of one part, chunk by chunk, hashing as it writes.

    Files go to ``<part>.partial/``; ``finish()`` renames the directory, so a
    part directory without ``.partial`` is complete.
    """

    def __init__(self, cache_dir: Path, name: str, num_dense: int, multi: list[str]) -> None:
        self.final = Path(cache_dir) / "parts" / name
        self.path = self.final.with_name(name + ".partial")
        shutil.rmtree(self.path, ignore_errors=True)
        self.path.mkdir(parents=True)
        self.num_dense = num_dense
        self.multi = multi
        self._files: dict[str, Any] = {}
        self._hashes: dict[str, Any] = {}
        self.rows: dict[str, int] = {}
        self._multi_totals: dict[str, dict[str, int]] = {}

    def _write(self, key: str, array: np.ndarray) -> None:
        if key not in self._files:
            self._files[key] = open(self.path / f"{key}.bin", "wb")  # noqa: SIM115
            self._hashes[key] = hashlib.sha256()
        data = np.ascontiguousarray(array).tobytes()
        self._files[key].write(data)
        self._hashes[key].update(data)

    def append(
        self,
        split: str,
        labels: np.ndarray,
        dense: np.ndarray,
        sparse: np.ndarray,
        multi: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
    ) -> None:
        """``multi`` maps feature -> (values, lengths) for these rows."""
        n = len(labels)
        if n == 0:
            return
        assert dense.shape == (n, self.num_dense) and sparse.shape[0] == n
        self._write(f"{split}.labels", labels.astype(np.float32, copy=False))
        self._write(f"{split}.dense", dense.astype(np.float32, copy=False))
        self._write(f"{split}.sparse", sparse.astype(np.int32, copy=False))
        totals = self._multi_totals.setdefault(split, {})
        for name in self.multi:
            values, lengths = (multi or {})[name]
            self._write(f"{split}.{name}.values", values.astype(np.int32, copy=False))
            self._write(f"{split}.{name}.lengths", lengths.astype(np.int32, copy=False))
            totals[name] = totals.get(name, 0) + int(lengths.sum())
        self.rows[split] = self.rows.get(split, 0) + n

    def append_column(self, split: str, column: str, array: np.ndarray) -> None:
        """Rows of a column beyond the standard ones (e.g. ``example_id`` int64), written
        as ``<split>.<column>.bin`` in the array's dtype; the caller keeps it row-aligned."""
        self._write(f"{split}.{column}", array)

    def finish(self, extra: dict[str, Any] | None = None, fsync: bool = False) -> dict[str, Any]:
        """Close the files, write ``part.json`` and make the part final; returns its entry.
        ``fsync``: the files and the directory reach the disk before the rename, so a
        machine crash cannot leave a final part with missing data."""
        for f in self._files.values():
            if fsync:
                f.flush()
                os.fsync(f.fileno())
            f.close()
        entry = {
            "name": self.final.name,
            "rows": dict(self.rows),
            "multi_values": self._multi_totals,
            "files": {f"{k}.bin": h.hexdigest() for k, h in self._hashes.items()},
            **(extra or {}),
        }
        (self.path / "part.json").write_text(json.dumps(entry, indent=1))
        if fsync:
            fsync_path(self.path / "part.json")
            fsync_path(self.path)
        shutil.rmtree(self.final, ignore_errors=True)
        self.path.rename(self.final)
        if fsync:
            fsync_path(self.final.parent)
        return entry

    def abort(self) -> None:
        for f in self._files.values():
            f.close()
        shutil.rmtree(self.path, ignore_errors=True)


def read_part_entry(cache_dir: Path, name: str) -> dict[str, Any] | None:
    """The entry of a complete part, or None when it is missing or unfinished."""
    path = Path(cache_dir) / "parts" / name / "part.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's entries to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# The manifest's digest of its own other keys (``checksums.sealed``): the files' checksums
# are in the manifest, and this covers the manifest itself (sizes, rows, the checksums).
SELF_DIGEST = "manifest_sha256"


def write_manifest(cache_dir: Path, manifest: dict[str, Any], fsync: bool = False) -> Path:
    """Replace ``manifest.json`` atomically (temp file + rename; ``fsync``: durably)."""
    path = Path(cache_dir) / "manifest.json"
    tmp = path.with_suffix(".json.tmp")
    body = sealed({"format": FORMAT, "version": VERSION, **manifest}, SELF_DIGEST)
    tmp.write_text(json.dumps(body, indent=1))
    if fsync:
        fsync_path(tmp)
    os.replace(tmp, path)
    if fsync:
        fsync_path(path.parent)
    return path


# ------------------------------------------------------------------ reading
_SPLIT_NAMES = (*SPLITS, *LEGACY_NAMES)
# What the readers use of a manifest (data/json_shape.py); a manifest has more keys.
MANIFEST_SHAPE = {
    "schema": {
        "num_dense": COUNT,
        "sparse": [
            {"name": TEXT, "num_embeddings": ROWS, "pooling_factor": FINITE, "multi_hot": FLAG}
        ],
    },
    "parts": [
        {
            "name": NAME,
            "rows": Map(COUNT, keys=_SPLIT_NAMES),
            "files": Map(TEXT),
            "multi_values": Map(Map(COUNT), keys=_SPLIT_NAMES),
        }
    ],
}


def read_manifest(cache_dir: str | Path) -> dict[str, Any]:
    cache_dir = Path(cache_dir)
    path = cache_dir / "manifest.json"
    if not cache_dir.is_dir():
        raise FileNotFoundError(
            f"data.path {str(cache_dir)!r} is not a directory; point it at a cache written by "
            "`towerrec data criteo ... --out DIR`"
        )
    if not path.is_file():
        raise CacheError(
            f"{cache_dir} has no manifest.json: it is not a finished cache (an interrupted "
            "preprocessing run?); run `towerrec data ...` again with --out pointing there"
        )
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CacheError(f"{path} is not valid JSON ({e}); rebuild the cache") from None
    except UnicodeDecodeError:
        raise CacheError(f"{path} is not UTF-8 text; rebuild the cache") from None
    if not unseal(manifest, SELF_DIGEST):  # caches written before the digest have none
        raise CacheError(
            f"{path} does not match its own {SELF_DIGEST}: the manifest is damaged (its "
            "table sizes, rows or checksums cannot be trusted); rebuild the cache"
        )
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != FORMAT
        or manifest.get("version") != VERSION
    ):
        raise CacheError(
            f"{path} is not a {FORMAT} version {VERSION} manifest; rebuild the cache with this "
            "version of towerrec"
        )
    try:
        check_shape(manifest, MANIFEST_SHAPE)
        names = [f["name"] for f in manifest["schema"]["sparse"]]
        if len(set(names)) != len(names):
            raise ValueError(f"schema.sparse names a feature twice: {names}")
    except ValueError as e:
        raise CacheError(f"{path} is damaged ({e}); rebuild the cache") from None
    return manifest


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _map(path: Path, dtype: Any, shape: tuple[int, ...], cache_dir: Path) -> np.ndarray:
    expected = int(np.prod(shape)) * np.dtype(dtype).itemsize
    size = path.stat().st_size if path.is_file() else -1
    if size != expected:
        what = "is missing" if size < 0 else f"has {size} bytes, the manifest says {expected}"
        raise CacheError(
            f"cache file {path} {what}; the cache in {cache_dir} is corrupt or incomplete: "
            "rebuild it (run the same `towerrec data ...` command into a fresh --out directory)"
        )
    if expected == 0:
        return np.zeros(shape, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=shape)


class Verify(StrEnum):
    """When ``open_cache`` hashes the cache's files against the manifest's SHA-256s."""

    ONCE = "once"  # hash on the first open, then only when a file's size or mtime changed
    ALWAYS = "always"  # hash every file on every open
    NEVER = "never"  # file sizes only


VERIFIED_STAMP = "verified.json"


def _file_stamps(cache_dir: Path, manifest: dict[str, Any]) -> dict[str, list[int]]:
    """Size and mtime of the manifest and of every file it lists."""
    st = (cache_dir / "manifest.json").stat()
    stamps = {"manifest.json": [st.st_size, st.st_mtime_ns]}
    for part in manifest["parts"]:
        for name in part["files"]:
            path = cache_dir / "parts" / part["name"] / name
            if path.is_file():
                st = path.stat()
                stamps[f"{part['name']}/{name}"] = [st.st_size, st.st_mtime_ns]
    return stamps


def _verify_checksums(cache_dir: Path, manifest: dict[str, Any], mode: Verify) -> None:
    """Hash the files against the manifest (see ``Verify``); ``once`` remembers a clean
    check in ``verified.json`` (file sizes and mtimes) and skips hashing while they match."""
    if mode is Verify.NEVER:
        return
    stamp_path = cache_dir / VERIFIED_STAMP
    stamps = _file_stamps(cache_dir, manifest)
    if mode is Verify.ONCE and stamp_path.is_file():
        try:
            if json.loads(stamp_path.read_text()) == stamps:
                return
        except json.JSONDecodeError:
            pass
    for part in manifest["parts"]:
        folder = cache_dir / "parts" / part["name"]
        for name, digest in part["files"].items():
            path = folder / name
            if not path.is_file() or sha256_file(path) != digest:
                stamp_path.unlink(missing_ok=True)
                raise CacheError(
                    f"cache file {path} does not match the checksum in {cache_dir}/"
                    "manifest.json: the cache is corrupt; rebuild it (run the same "
                    "`towerrec data ...` command into a fresh --out directory)"
                )
    if mode is Verify.ONCE:
        try:
            stamp_path.write_text(json.dumps(stamps, sort_keys=True))
        except OSError as e:  # a read-only cache is checked again at the next open
            log.info("could not record the checksum check in %s (%s)", stamp_path, e)


def open_cache(cache_dir: str | Path, verify: Verify | str | bool = Verify.ONCE) -> ColumnStore:
    """Memory-map a cache; ``verify`` says when its files are hashed (``Verify``; the
    booleans of earlier versions mean ``always`` and ``never``)."""
    cache_dir = Path(cache_dir)
    if isinstance(verify, bool):
        verify = Verify.ALWAYS if verify else Verify.NEVER
    verify = parse_enum(Verify, verify, "data.loader.verify")
    manifest = read_manifest(cache_dir)
    schema, single, multi = schema_from_manifest(manifest["schema"])
    _verify_checksums(cache_dir, manifest, verify)
    splits: dict[str, list[SplitColumns]] = {}
    for part in manifest["parts"]:
        for split, columns in open_part(cache_dir, part, schema.num_dense, single, multi).items():
            splits.setdefault(split, []).append(columns)
    return ColumnStore(schema, single, multi, splits, manifest)


def open_part(
    cache_dir: Path, part: dict[str, Any], num_dense: int, single: list[str], multi: list[str]
) -> dict[str, SplitColumns]:
    """Memory-map one part of a cache (its manifest ``entry``): split -> columns."""
    folder = Path(cache_dir) / "parts" / part["name"]
    splits = {}
    for split, n in part["rows"].items():
        prefix = folder / split
        columns = SplitColumns(
            rows=n,
            labels=_map(Path(f"{prefix}.labels.bin"), np.float32, (n,), cache_dir),
            dense=_map(Path(f"{prefix}.dense.bin"), np.float32, (n, num_dense), cache_dir),
            sparse=_map(Path(f"{prefix}.sparse.bin"), np.int32, (n, len(single)), cache_dir),
        )
        totals = part.get("multi_values", {}).get(split, {})
        for name in multi:
            if name not in totals:
                raise ValueError(
                    f"part {part['name']} of {cache_dir}: its manifest entry has no value count "
                    f"for the multi-hot feature {name!r} of split {split!r}; the manifest is "
                    "damaged: build the directory again"
                )
            total = totals[name]
            lengths = _map(Path(f"{prefix}.{name}.lengths.bin"), np.int32, (n,), cache_dir)
            values = _map(Path(f"{prefix}.{name}.values.bin"), np.int32, (total,), cache_dir)
            columns.multi[name] = (values, _offsets(lengths))
        splits[split] = columns
    return splits


def map_column(
    cache_dir: Path, part: str, split: str, column: str, dtype: Any, rows: int
) -> np.ndarray:
    """Memory-map an extra per-row column of a part (``PartWriter.append_column``)."""
    path = Path(cache_dir) / "parts" / part / f"{split}.{column}.bin"
    return _map(path, dtype, (rows,), Path(cache_dir))


def verify_part(cache_dir: Path, part: dict[str, Any]) -> None:
    """Hash one part's files against its manifest entry; a ``CacheError`` on a mismatch."""
    folder = Path(cache_dir) / "parts" / part["name"]
    for name, digest in part["files"].items():
        path = folder / name
        if not path.is_file() or sha256_file(path) != digest:
            raise CacheError(
                f"file {path} does not match its checksum in {cache_dir}/manifest.json: the "
                "data is corrupt; write it again"
            )
