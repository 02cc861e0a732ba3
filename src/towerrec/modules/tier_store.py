"""Backing stores of cached tables (``modules/cached.py``): every row of a table with its
optimizer state, in host memory, in a file of fixed-size rows on SSD, or keyed by id.

A row is one record of float32 values, the weight and then each per-row optimizer
state (its width: 1 for row-wise Adagrad's momentum, D for Adagrad's and Adam's)::

    record r   [ weight (D) | state_0 (w_0) | state_1 (w_1) | ... ]     W = D + sum(w_i)

This file holds what every store shares: the record layout (``RowLayout``), the
store interface (``BackingStore``), its error (``StoreError``), the checks of a
backing path, and the host-memory store (``HostStore``, a full-size array). The
others each have a file: ``ssd_store.py`` (``SsdStore``: one memory-mapped file of
fixed-size rows per table, for dense id ranges) and ``kv_store.py`` (``KvStore``: an
LMDB store keyed by 64-bit id, rows created on first touch).
"""

from __future__ import annotations

import os
import stat
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from towerrec.memory import register_parent_only

__all__ = [
    "BackingStore",
    "HostStore",
    "RowLayout",
    "StoreError",
    "check_writable",
    "describe_layout",
    "format_bytes",
]


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

    @property
    def record_bytes(self) -> int:
        """Bytes of one row's record (float32)."""
        return 4 * self.record_width

    @property
    def rows_bytes(self) -> int:
        """Bytes of every row's record: a store file's rows, without its header."""
        return self.num_embeddings * self.record_bytes

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

    def write_behind(self) -> None:
        """Let later ``write`` calls return before their rows land, where the store can
        (the SSD store: ``ssd_store.py``); its reads, ``records`` and ``flush`` still see
        every write. Others write at once."""
        return None

    @property
    def writes_behind(self) -> bool:
        """Whether ``write`` returns before its rows land (``write_behind``)."""
        return False

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


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest unit that keeps the number under 1024."""
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.4g} {unit}"
        n /= 1024
    return f"{n:.4g} TiB"


def describe_layout(layout: dict[str, object]) -> str:
    """A store header's layout (``RowLayout.to_json``) in words, for error messages."""
    states = layout.get("states") or []
    names = "?"  # a damaged header's states: no name and width each
    if isinstance(states, list) and all(isinstance(s, list) and len(s) == 2 for s in states):
        names = ", ".join(f"{s[0]}[{s[1]}]" for s in states)
    return (
        f"table {layout.get('table')!r} of {layout.get('rows')} rows x {layout.get('dim')} "
        f"{layout.get('dtype')} with optimizer state ({names or 'none'})"
    )


def check_writable(path: Path) -> None:
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
