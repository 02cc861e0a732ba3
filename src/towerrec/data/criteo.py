"""Criteo Kaggle / Terabyte TSV to the binary cache (``towerrec data criteo``).

Each line: ``label \\t I1..I13 \\t C1..C26``; integers in decimal, categoricals
as hexadecimal hashes, empty fields for missing values; plain or gzip.

    dense        log(1 + max(x, 0)), missing -> 0                float32 [n, 13]
    categorical  hashing:    id = 1 + (value mod (rows - 1))      int32   [n, 26]
                 vocabulary: values seen >= min_count times in the training
                             files get ids 1..V (sorted by value); rows = V + 1
                 id 0 is reserved for missing (and, with a vocabulary, rare or unseen)
                 values; the manifest's report counts the unseen ones per split

Splits (``data/splits.py``): whole input files go to validation (``eval_files``,
e.g. the last day) or test (``test_files``); the other files' lines are drawn into
validation and test by seeded fractions (``eval_fraction``, ``test_fraction``, a
function of the seed and the file line, independent of chunking). Files are parsed in line-aligned chunks by pyarrow's
multi-threaded CSV reader, so memory stays bounded whatever the file size. A
malformed row (wrong field count, a label other than 0/1, a non-numeric
integer, a bad hex value) is skipped, counted and reported as ``file:line``
(``strict``: the first one stops the run); a row's fields never shift into
other columns. Every input file becomes one cache part, written under a
temporary name and renamed when complete, so an interrupted run resumes at
the first unfinished file.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
from tqdm import tqdm

from towerrec.data.batch import DataSchema, SparseFeature
from towerrec.data.cache import (
    MAX_CACHE_ROWS,
    PartWriter,
    read_part_entry,
    schema_to_manifest,
    write_manifest,
)
from towerrec.data.splits import SPLITS, check_fractions, file_splits, split_rows
from towerrec.data.text_input import Chunk, Problems, decode_hex, read_chunks

__all__ = ["NUM_CATEGORICAL", "NUM_INTEGER", "CriteoOptions", "parse_chunk", "preprocess_criteo"]

log = logging.getLogger("towerrec")

NUM_INTEGER = 13
NUM_CATEGORICAL = 26
COLUMNS = ["label", *(f"I{i}" for i in range(1, 14)), *(f"C{i}" for i in range(1, 27))]
# An integer field as pyarrow's int64 reader takes it: spaces around, an optional minus.
_INT_PATTERN = r"^ *-?[0-9]+ *$"
_NOT_TEXT = "\ufffd".encode()  # the replacement character: no digit, no hex digit


@dataclass(frozen=True)
class CriteoOptions:
    """How ``preprocess_criteo`` maps raw values and splits rows."""

    num_embeddings: tuple[int, ...] = (100_000,)  # one size for all 26 tables, or 26 sizes
    min_count: int = 0  # > 0: frequency-thresholded vocabulary instead of hashing
    eval_fraction: float = 0.0  # of the lines drawn into the validation split
    eval_files: tuple[str, ...] = ()  # input files (by name or path) that form validation
    test_fraction: float = 0.0
    test_files: tuple[str, ...] = ()
    seed: int = 0
    strict: bool = False
    chunk_bytes: int = 16 << 20
    threads: int = 2  # chunks parsed at once
    feature_prefix: str = "cat_"

    def __post_init__(self) -> None:
        sizes = tuple(int(n) for n in self.num_embeddings)
        if len(sizes) not in (1, NUM_CATEGORICAL):
            raise ValueError(
                f"--num-embeddings takes 1 or {NUM_CATEGORICAL} table sizes, got {len(sizes)}"
            )
        if self.min_count == 0 and any(n < 2 for n in sizes):
            raise ValueError(
                f"--num-embeddings must be >= 2 (id 0 is reserved for missing), got {list(sizes)}"
            )
        if any(n > MAX_CACHE_ROWS for n in sizes):
            raise ValueError(
                f"--num-embeddings must be at most {MAX_CACHE_ROWS:,} (2^31 - 1): a cache "
                f"stores ids as int32, so larger sizes would wrap; got {list(sizes)}"
            )
        if self.min_count < 0:
            raise ValueError(f"--min-count must be >= 0 (0: hashing), got {self.min_count}")
        check_fractions(self.eval_fraction, self.test_fraction)
        if self.chunk_bytes < 1024:
            raise ValueError("chunk_bytes must be >= 1024")
        if self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        object.__setattr__(self, "num_embeddings", sizes * (NUM_CATEGORICAL // len(sizes)))
        object.__setattr__(self, "eval_files", tuple(self.eval_files))
        object.__setattr__(self, "test_files", tuple(self.test_files))

    def fingerprint(self, extra: str = "") -> str:
        keep = asdict(self)
        for key in ("strict", "chunk_bytes", "eval_files", "test_files", "threads"):
            keep.pop(key)
        text = json.dumps(keep, sort_keys=True) + extra
        return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


@dataclass
class ParsedChunk:
    lines: np.ndarray  # [n] file line of each kept row
    labels: np.ndarray  # [n] float32
    dense: np.ndarray  # [n, 13] float32, already log(1 + max(x, 0))
    values: np.ndarray  # [n, 26] uint64 raw categorical values
    missing: np.ndarray  # [n, 26] bool
    problems: list[tuple[int, str]]  # (file line, reason) of each skipped row, in line order


def _locate_lines(data: bytes, texts: list[str]) -> list[int]:
    """0-based line indices (within ``data``) of whole lines equal to one of ``texts``."""
    found: set[int] = set()
    padded = b"\n" + data + (b"" if data.endswith(b"\n") else b"\n")
    for text in set(texts):
        needle = b"\n" + text.encode() + b"\n"
        at = padded.find(needle)
        while at >= 0:
            found.add(padded.count(b"\n", 0, at + 1) - 1)
            at = padded.find(needle, at + 1)
    return sorted(found)


def _read(data: bytes, types: dict[str, pa.DataType], invalid: list[str]) -> pa.Table:
    def on_invalid(row) -> str:
        invalid.append(row.text)
        return "skip"

    return pa_csv.read_csv(
        pa.py_buffer(data),
        read_options=pa_csv.ReadOptions(
            column_names=COLUMNS, block_size=1 << 22, use_threads=False
        ),
        parse_options=pa_csv.ParseOptions(
            delimiter="\t",
            quote_char=False,
            double_quote=False,
            escape_char=False,
            ignore_empty_lines=False,
            invalid_row_handler=on_invalid,
        ),
        convert_options=pa_csv.ConvertOptions(
            column_types=types, strings_can_be_null=True, null_values=[""]
        ),
    )


# The label stays text: "01" or "+1" is no label, whichever path reads the chunk.
_TYPED = {name: pa.int64() if name[0] == "I" else pa.string() for name in COLUMNS}
_STRINGS = {name: pa.string() for name in COLUMNS}


def _integers(column: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """A text column's int64 values (null where missing or wrong) and where it is wrong:
    what pyarrow's int64 reader would take (``_INT_PATTERN``, within int64's range)."""
    ok = pc.fill_null(pc.match_substring_regex(column, _INT_PATTERN), True)
    text = pc.utf8_trim(pc.if_else(ok, column, pa.scalar(None, pa.string())), " ")
    try:
        values = pc.cast(text, pa.int64())
    except pa.ArrowInvalid:  # a value beyond int64: the rare slow path
        numbers = [None if v is None else int(v) for v in text.to_pylist()]
        fits = [v is None or -(2**63) <= v < 2**63 for v in numbers]
        ok = pc.and_(ok, pa.array(fits))
        values = pa.array([v if f else None for v, f in zip(numbers, fits)], pa.int64())
    return values, ~ok.to_numpy(zero_copy_only=False)


def parse_chunk(chunk_data: bytes, first_line: int, num_lines: int) -> ParsedChunk:
    """Parse whole TSV lines into a ``ParsedChunk`` that lists the malformed rows it skipped.

    Fast path: pyarrow converts the label and integer columns itself. When a
    value does not convert, the chunk is parsed again as strings and checked
    column by column, so each bad row is found and named.
    """
    if not chunk_data.isascii():  # bytes that are not UTF-8 fail the field they are in
        chunk_data = chunk_data.decode("utf-8", "replace").encode()
    if b"\r" in chunk_data:  # CRLF ends a line as LF does; a lone CR fails its field
        chunk_data = chunk_data.replace(b"\r\n", b"\n").replace(b"\r", _NOT_TEXT)
    invalid: list[str] = []
    try:
        table = _read(chunk_data, _TYPED, invalid)
        typed = True
    except pa.ArrowInvalid:
        invalid = []
        table = _read(chunk_data, _STRINGS, invalid)
        typed = False
    bad_lines = _locate_lines(chunk_data, invalid) if invalid else []
    if table.num_rows + len(bad_lines) != num_lines:
        raise AssertionError(f"parsed {table.num_rows} + {len(bad_lines)} of {num_lines} lines")
    found = [(first_line + i, f"wrong field count (expected {len(COLUMNS)})") for i in bad_lines]
    if bad_lines:
        lines = np.setdiff1d(np.arange(num_lines), bad_lines) + first_line
    else:
        lines = np.arange(first_line, first_line + num_lines)

    n = table.num_rows
    bad = np.zeros(n, dtype=bool)
    reasons: list[tuple[np.ndarray, str]] = []

    label = table.column("label").combine_chunks()
    is_one = pc.fill_null(pc.equal(label, "1"), False).to_numpy(zero_copy_only=False)
    is_zero = pc.fill_null(pc.equal(label, "0"), False).to_numpy(zero_copy_only=False)
    if label.null_count:  # pyarrow reads an empty line as a row of nulls
        empty = label.is_null().to_numpy(zero_copy_only=False)
        for name in COLUMNS[1:]:
            empty &= table.column(name).is_null().to_numpy(zero_copy_only=False)
        reasons.append((empty, "empty line"))
    reasons.append((~(is_one | is_zero), "label is not 0 or 1"))
    labels = is_one.astype(np.float32)

    dense = np.zeros((n, NUM_INTEGER), dtype=np.float32)
    for j in range(NUM_INTEGER):
        column = table.column(f"I{j + 1}").combine_chunks()
        if not typed:
            column, wrong = _integers(column)
            reasons.append((wrong, f"I{j + 1} is not an integer"))
        x = pc.fill_null(column, 0).to_numpy()
        dense[:, j] = np.log1p(np.maximum(x, 0).astype(np.float32))

    values = np.zeros((n, NUM_CATEGORICAL), dtype=np.uint64)
    missing = np.zeros((n, NUM_CATEGORICAL), dtype=bool)
    for j in range(NUM_CATEGORICAL):
        column = table.column(f"C{j + 1}").combine_chunks()
        valid = column.is_valid().to_numpy(zero_copy_only=False)
        _, offsets_buf, data_buf = column.buffers()
        offsets = np.frombuffer(offsets_buf, dtype=np.int32)[column.offset : column.offset + n + 1]
        data = (
            np.frombuffer(data_buf, dtype=np.uint8)
            if data_buf is not None
            else np.empty(0, np.uint8)
        )
        values[:, j], wrong = decode_hex(offsets.astype(np.int64), data, valid)
        missing[:, j] = ~valid
        reasons.append((wrong, f"C{j + 1} is not hexadecimal"))

    for wrong, reason in reasons:
        if wrong.any():
            found.extend((int(lines[row]), reason) for row in np.nonzero(wrong & ~bad)[0])
            bad |= wrong
    keep = ~bad
    found.sort()
    return ParsedChunk(lines[keep], labels[keep], dense[keep], values[keep], missing[keep], found)


def parsed_chunks(
    path: Path, problems: Problems, chunk_bytes: int, threads: int = 2
) -> Iterator[tuple[Chunk, ParsedChunk]]:
    """Parse ``path``'s chunks on ``threads`` threads (pyarrow and numpy release the GIL),
    yielding them in file order with their malformed rows reported to ``problems``."""
    with ThreadPoolExecutor(max_workers=threads) as pool:
        pending: deque = deque()
        chunks = read_chunks(path, problems, chunk_bytes)
        for chunk in chunks:
            pending.append(
                (chunk, pool.submit(parse_chunk, chunk.data, chunk.first_line, chunk.num_lines))
            )
            if len(pending) > threads:
                yield _report(path, problems, *pending.popleft())
        while pending:
            yield _report(path, problems, *pending.popleft())


def _report(path, problems: Problems, chunk: Chunk, future) -> tuple[Chunk, ParsedChunk]:
    parsed = future.result()
    for line, reason in parsed.problems:
        problems.add(path, line, reason)
    return chunk, parsed


class _Vocabulary:
    """Per-feature sorted values seen >= min_count times: value -> 1 + its index."""

    def __init__(self, keys: list[np.ndarray]) -> None:
        self.keys = keys

    @property
    def sizes(self) -> list[int]:
        return [len(k) + 1 for k in self.keys]

    def digest(self) -> str:
        h = hashlib.blake2b(digest_size=12)
        for k in self.keys:
            h.update(k.tobytes())
        return h.hexdigest()

    def ids(self, values: np.ndarray, missing: np.ndarray) -> np.ndarray:
        out = np.zeros(values.shape, dtype=np.int32)
        for j, keys in enumerate(self.keys):
            if not len(keys):
                continue
            at = np.minimum(np.searchsorted(keys, values[:, j]), len(keys) - 1)
            hit = (keys[at] == values[:, j]) & ~missing[:, j]
            out[:, j] = np.where(hit, at + 1, 0)
        return out


def _hash_ids(values: np.ndarray, missing: np.ndarray, sizes: tuple[int, ...]) -> np.ndarray:
    modulus = np.array([s - 1 for s in sizes], dtype=np.uint64)
    ids = (values % modulus[None, :]).astype(np.int64) + 1
    return np.where(missing, 0, ids).astype(np.int32)


class _Counter:
    """Counts of uint64 values: per-chunk (unique, count) pairs merged lazily, when they
    outgrow the merged table, so a chunk costs O(chunk) and not O(vocabulary)."""

    def __init__(self) -> None:
        self.values, self.counts = np.empty(0, np.uint64), np.empty(0, np.int64)
        self.pending: list[tuple[np.ndarray, np.ndarray]] = []
        self.pending_size = 0

    def add(self, seen: np.ndarray) -> None:
        values, counts = np.unique(seen, return_counts=True)
        self.pending.append((values, counts))
        self.pending_size += len(values)
        if self.pending_size > max(len(self.values), 1 << 20):
            self.merge()

    def merge(self) -> None:
        values = np.concatenate([self.values, *(v for v, _ in self.pending)])
        counts = np.concatenate([self.counts, *(c for _, c in self.pending)])
        self.values, inverse = np.unique(values, return_inverse=True)
        self.counts = np.bincount(inverse, weights=counts, minlength=len(self.values)).astype(
            np.int64
        )
        self.pending, self.pending_size = [], 0


def _count_values(paths, options: CriteoOptions, problems: Problems, bar) -> _Vocabulary:
    """First pass over the training files: values seen >= min_count times per feature."""
    counters = [_Counter() for _ in range(NUM_CATEGORICAL)]
    for path in paths:
        done = 0
        for chunk, parsed in parsed_chunks(path, problems, options.chunk_bytes, options.threads):
            for j, counter in enumerate(counters):
                counter.add(parsed.values[~parsed.missing[:, j], j])
            bar.update(chunk.on_disk - done)  # bytes of the file on disk (compressed for .gz)
            done = chunk.on_disk
        bar.update(path.stat().st_size - done)
    keys = []
    for counter in counters:
        counter.merge()
        keys.append(counter.values[counter.counts >= options.min_count])
    return _Vocabulary(keys)


def preprocess_criteo(
    inputs: Sequence[str | Path],
    out_dir: str | Path,
    options: CriteoOptions | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Write the cache of ``inputs`` to ``out_dir``; returns the manifest written."""
    options = options or CriteoOptions()
    out_dir = Path(out_dir)
    paths = [Path(p) for p in inputs]
    if not paths:
        raise ValueError("no input files given")
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"input file {str(path)!r} does not exist")
    whole = file_splits(paths, options.eval_files, options.test_files)
    out_dir.mkdir(parents=True, exist_ok=True)
    problems = Problems(strict=options.strict)
    total_bytes = sum(p.stat().st_size for p in paths)
    bar = tqdm(
        total=total_bytes,
        unit="B",
        unit_scale=True,
        disable=None if progress else True,
        desc="criteo",
    )

    sizes = options.num_embeddings
    vocab = None
    if options.min_count:
        train_paths = [p for p, split in zip(paths, whole) if split is None]
        bar.total = total_bytes + sum(p.stat().st_size for p in train_paths)
        # Malformed rows are reported by the writing pass; the counting pass skips them quietly.
        counting = Problems(strict=options.strict)
        vocab = _count_values(train_paths, options, counting, bar)
        sizes = tuple(vocab.sizes)
    fingerprint = options.fingerprint(vocab.digest() if vocab else "")

    parts, reused = [], 0
    for index, (path, file_split) in enumerate(zip(paths, whole)):
        name = f"{index:05d}-{path.name}"
        stat = path.stat()
        source = {
            "source": str(path.resolve()),
            "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
            "file_split": file_split,
            "fingerprint": fingerprint,
        }
        entry = read_part_entry(out_dir, name)
        if entry and all(entry.get(k) == v for k, v in source.items()):
            parts.append(entry)
            reused += 1
            bar.update(stat.st_size)
            continue
        writer = PartWriter(out_dir, name, NUM_INTEGER, multi=[])
        file_problems = problems.total
        unseen = dict.fromkeys(SPLITS, 0)  # present values outside the vocabulary (id 0)
        try:
            lines_read, done = 0, 0
            for chunk, parsed in parsed_chunks(
                path, problems, options.chunk_bytes, options.threads
            ):
                lines_read += chunk.num_lines
                ids = (
                    vocab.ids(parsed.values, parsed.missing)
                    if vocab
                    else _hash_ids(parsed.values, parsed.missing, sizes)
                )
                masks = split_rows(
                    parsed.lines,
                    options.eval_fraction,
                    options.test_fraction,
                    options.seed,
                    index,
                    file_split,
                )
                oov = ((ids == 0) & ~parsed.missing).sum(axis=1) if vocab else None
                for split, mask in masks.items():
                    if mask.any():
                        writer.append(split, parsed.labels[mask], parsed.dense[mask], ids[mask])
                        if oov is not None:
                            unseen[split] += int(oov[mask].sum())
                bar.update(chunk.on_disk - done)
                done = chunk.on_disk
            if lines_read == 0:
                problems.add(path, None, "empty file (no rows)")
            bar.update(stat.st_size - done)
        except BaseException:
            writer.abort()
            raise
        entry = writer.finish(
            {
                **source,
                "lines": lines_read,
                "malformed": problems.total - file_problems,
                "out_of_vocabulary": unseen,
            }
        )
        parts.append(entry)
    bar.close()
    if reused:
        log.info("reused %d finished part(s) of an earlier run in %s", reused, out_dir)

    rows = dict.fromkeys(SPLITS, 0)
    for entry in parts:
        for split, n in entry["rows"].items():
            rows[split] += n
    if sum(rows.values()) == 0:
        raise ValueError(f"no valid rows in {len(paths)} input file(s): {problems.one_line()}")
    schema = DataSchema(
        NUM_INTEGER,
        tuple(
            SparseFeature(f"{options.feature_prefix}{j}", sizes[j]) for j in range(NUM_CATEGORICAL)
        ),
    )
    manifest = {
        "source": "criteo",
        "schema": schema_to_manifest(schema, set()),
        "dense_names": COLUMNS[1 : 1 + NUM_INTEGER],
        "rows": rows,
        "options": {
            k: v for k, v in asdict(options).items() if k not in ("chunk_bytes", "threads")
        },
        "report": {
            **problems.as_dict(),
            "malformed_all_parts": sum(entry.get("malformed", 0) for entry in parts),
            # --min-count: values absent from the training files' vocabulary (or rarer than
            # min_count there) that became the reserved id 0, per split
            "out_of_vocabulary": {
                split: sum(e.get("out_of_vocabulary", {}).get(split, 0) for e in parts)
                for split in SPLITS
            },
        },
        "parts": parts,
    }
    write_manifest(out_dir, manifest)
    if problems.total:
        log.warning("%s", problems.summary())
    return manifest
