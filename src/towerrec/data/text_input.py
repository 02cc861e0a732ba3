"""Streaming text input: line-aligned chunks of plain or gzip files, bad-row bookkeeping.

``read_chunks`` cuts a file into chunks of whole lines (bounded memory: one
chunk at a time, read ahead by a thread so decompression overlaps parsing) and
knows the file line where each chunk starts, so every malformed row is
reported as ``file:line``. ``Problems`` counts malformed rows by reason and
keeps the first few positions; in strict mode the first one stops the run.
"""

from __future__ import annotations

import gzip
import queue
import threading
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["Chunk", "MalformedInputError", "Problems", "decode_hex", "read_chunks"]

GZIP_MAGIC = b"\x1f\x8b"


class MalformedInputError(ValueError):
    """A malformed input row in strict mode, named by file and line."""


@dataclass
class Problems:
    """Malformed rows seen so far: counts by reason and the first ``keep`` positions."""

    strict: bool = False
    keep: int = 5
    counts: Counter = field(default_factory=Counter)
    first: list[str] = field(default_factory=list)

    def add(self, path: str | Path, line: int | None, reason: str) -> None:
        where = f"{path}:{line}" if line is not None else str(path)
        if self.strict:
            raise MalformedInputError(
                f"{where}: {reason} (--strict stops at the first malformed row; without it such "
                "rows are skipped and counted)"
            )
        self.counts[reason.split(" (")[0].split(":")[0]] += 1
        if len(self.first) < self.keep:
            self.first.append(f"{where}: {reason}")

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def as_dict(self) -> dict:
        return {"malformed": self.total, "by_reason": dict(self.counts), "first": self.first}

    def one_line(self) -> str:
        if not self.total:
            return "no malformed rows"
        return (
            f"{self.total} malformed rows skipped {dict(self.counts)}, the first at {self.first[0]}"
        )

    def summary(self) -> str:
        if not self.total:
            return "no malformed rows"
        lines = [f"skipped {self.total} malformed rows ({dict(self.counts)}); first ones:"]
        return "\n".join(lines + [f"  {p}" for p in self.first])


@dataclass
class Chunk:
    data: bytes  # whole lines; the last may lack its newline at the end of the file
    first_line: int  # 1-based line number of the chunk's first line
    num_lines: int
    on_disk: int  # bytes of the file (compressed, for gzip) consumed so far


def _open(path: Path):
    with open(path, "rb") as f:
        magic = f.read(2)
    raw = open(path, "rb")  # noqa: SIM115
    if magic == GZIP_MAGIC:
        return raw, gzip.GzipFile(fileobj=raw, mode="rb")
    return raw, raw


def _read_up_to(stream, size: int) -> tuple[bytes, BaseException | None]:
    """Up to ``size`` bytes; a decompression error is returned with the bytes before it
    (``read1`` decompresses step by step, so nothing before the error is lost)."""
    pieces, total = [], 0
    try:
        while total < size:
            piece = stream.read1(size - total)
            if not piece:
                break
            pieces.append(piece)
            total += len(piece)
    except (EOFError, gzip.BadGzipFile, zlib.error, OSError) as e:
        return b"".join(pieces), e
    return b"".join(pieces), None


def _chunks(path: Path, chunk_bytes: int, problems: Problems) -> Iterator[Chunk]:
    raw, stream = _open(path)
    line, rest = 1, b""
    try:
        while True:
            data, error = _read_up_to(stream, chunk_bytes)
            if error is not None:
                cut = (rest + data).rfind(b"\n") + 1
                if cut:
                    body = (rest + data)[:cut]
                    lines = body.count(b"\n")
                    yield Chunk(body, line, lines, raw.tell())
                    line += lines
                kind = "ends early" if isinstance(error, EOFError) else "is corrupt"
                problems.add(
                    path,
                    line,
                    f"gzip stream {kind} ({error}); the rows from this line on are missing "
                    "(re-download or re-compress the file)",
                )
                return  # the partial line after the last newline is dropped
            if not data:
                if rest:
                    yield Chunk(rest, line, 1, raw.tell())
                return
            data = rest + data
            cut = data.rfind(b"\n") + 1
            if cut == 0:
                rest = data
                continue
            body, rest = data[:cut], data[cut:]
            lines = body.count(b"\n")
            yield Chunk(body, line, lines, raw.tell())
            line += lines
    finally:
        stream.close()
        raw.close()


def read_chunks(
    path: str | Path, problems: Problems, chunk_bytes: int = 16 << 20
) -> Iterator[Chunk]:
    """Line-aligned chunks of ``path`` (plain or gzip, by its magic bytes), read ahead
    by one thread."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"input file {str(path)!r} does not exist")
    ahead: queue.Queue = queue.Queue(maxsize=2)
    done = object()

    def produce() -> None:
        try:
            for chunk in _chunks(path, chunk_bytes, problems):
                ahead.put(chunk)
        except BaseException as e:  # handed to the consumer
            ahead.put(e)
        ahead.put(done)

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    while True:
        item = ahead.get()
        if item is done:
            break
        if isinstance(item, BaseException):
            raise item
        yield item
    thread.join()


# Hex digit value of each byte; 255 marks a byte that is not a hex digit.
_HEX = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX[_c] = 10 + _i


def decode_hex(
    offsets: np.ndarray, data: np.ndarray, valid: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Values of hex strings given Arrow's layout (``offsets [n+1]``, ``data`` bytes,
    ``valid [n]``); returns ``(values uint64 [n], bad [n] bool)``. Nulls give 0 and are
    not bad; strings longer than 16 digits or with a non-hex byte are bad."""
    n = len(valid)
    values = np.zeros(n, dtype=np.uint64)
    bad = np.zeros(n, dtype=bool)
    lengths = np.diff(offsets)
    present = valid & (lengths > 0)
    widths_present = lengths[present]
    if not len(widths_present):
        return values, bad
    low, high = int(widths_present.min()), int(widths_present.max())
    widths = [low] if low == high else np.unique(widths_present).tolist()
    every_row = len(widths_present) == n
    for width in widths:
        rows = (
            slice(None)
            if every_row and low == high
            else np.nonzero(present & (lengths == width))[0]
        )
        count = n if isinstance(rows, slice) else len(rows)
        if width > 16:
            bad[rows] = True
            continue
        if low == high and int(offsets[-1] - offsets[0]) == width * count:
            text = data[offsets[0] : offsets[-1]].reshape(count, width)  # no nulls in between
        else:
            starts = offsets[:-1][rows]
            text = data[starts[:, None] + np.arange(width)[None, :]]
        digits = np.take(_HEX, text)
        if int(digits.max()) > 15:
            wrong = (digits > 15).any(axis=1)
            bad[np.arange(n)[rows][wrong]] = True
            digits[wrong] = 0
        # Left-pad to 8 or 16 digits, pack digit pairs into bytes, read them big-endian.
        full = 8 if width <= 8 else 16
        if width < full:
            digits = np.concatenate([np.zeros((count, full - width), np.uint8), digits], axis=1)
        packed = (digits[:, 0::2] << 4) | digits[:, 1::2]
        big_endian = ">u4" if full == 8 else ">u8"
        values[rows] = np.ascontiguousarray(packed).view(big_endian)[:, 0]
    return values, bad
    widths = np.unique(lengths[present])
    for width in widths.tolist():
        rows = np.nonzero(present & (lengths == width))[0]
        if width > 16:
            bad[rows] = True
            continue
        if len(widths) == 1 and int(offsets[-1] - offsets[0]) == width * len(rows):
            text = data[offsets[0] : offsets[-1]].reshape(len(rows), width)
        else:
            text = data[offsets[rows][:, None] + np.arange(width)[None, :]]
        digits = _HEX[text]
        if int(digits.max()) > 15:
            wrong = (digits > 15).any(axis=1)
            bad[rows[wrong]] = True
            digits[wrong] = 0
        # Left-pad to 8 or 16 digits, pack digit pairs into bytes, read them big-endian.
        full = 8 if width <= 8 else 16
        if width < full:
            digits = np.concatenate([np.zeros((len(rows), full - width), np.uint8), digits], axis=1)
        packed = (digits[:, 0::2] << 4) | digits[:, 1::2]
        big_endian = ">u4" if full == 8 else ">u8"
        values[rows] = np.ascontiguousarray(packed).view(big_endian)[:, 0]
    return values, bad
