"""Embedding table configuration and deterministic table init.

Initial weights are a pure function of (seed, table name, row, column): rows are
drawn in fixed blocks, each from its own generator, so any shard of a table
(a row range, a column range) can be initialised on its own rank without
materialising the whole table, and every layout starts from the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch

from towerrec.utils import parse_enum, stable_seed

__all__ = [
    "Pooling",
    "TableConfig",
    "fill_table_block",
    "init_table_block",
]

INIT_BLOCK_ROWS = 16384


class Pooling(StrEnum):
    SUM = "sum"
    MEAN = "mean"


@dataclass(frozen=True)
class TableConfig:
    """One embedding table.

    ``feature_names`` are the input keys looked up in this table (several
    features may share one table); empty means the single feature ``name``.
    ``init`` is ``uniform`` (bound ``init_scale``) or ``normal`` (std
    ``init_scale``); ``init_scale=None`` uses ``sqrt(1 / num_embeddings)``.
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple[str, ...] = ()
    pooling: Pooling = Pooling.SUM
    init: str = "uniform"
    init_scale: float | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a table needs a non-empty name")
        if self.num_embeddings < 1:
            raise ValueError(
                f"table {self.name!r}: num_embeddings must be >= 1, got {self.num_embeddings}"
            )
        if self.embedding_dim < 1:
            raise ValueError(
                f"table {self.name!r}: embedding_dim must be >= 1, got {self.embedding_dim}"
            )
        if self.init not in ("uniform", "normal"):
            raise ValueError(
                f"table {self.name!r}: init must be 'uniform' or 'normal', got {self.init!r}"
            )
        if self.init_scale is not None and not self.init_scale > 0:
            raise ValueError(f"table {self.name!r}: init_scale must be > 0")
        object.__setattr__(self, "feature_names", tuple(self.feature_names) or (self.name,))
        object.__setattr__(
            self, "pooling", parse_enum(Pooling, self.pooling, f"table {self.name!r} pooling")
        )

    @property
    def scale(self) -> float:
        return self.init_scale if self.init_scale is not None else self.num_embeddings**-0.5

    @property
    def num_parameters(self) -> int:
        return self.num_embeddings * self.embedding_dim


def init_table_block(
    table: TableConfig,
    seed: int,
    rows: tuple[int, int] | None = None,
    cols: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Initial weights of ``table[rows[0]:rows[1], cols[0]:cols[1]]`` (float32, CPU)."""
    row_start, row_end = rows if rows is not None else (0, table.num_embeddings)
    col_start, col_end = cols if cols is not None else (0, table.embedding_dim)
    out = torch.empty(max(row_end - row_start, 0), max(col_end - col_start, 0))
    return fill_table_block(out, table, seed, rows, cols)


@torch.no_grad()
def fill_table_block(
    out: torch.Tensor,
    table: TableConfig,
    seed: int,
    rows: tuple[int, int] | None = None,
    cols: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Write the initial weights of ``table[rows, cols]`` into ``out`` ``[rows, cols]``.

    ``out`` may live on any device and be a view (a shard inside a fused kernel's
    weights): values are drawn one ``INIT_BLOCK_ROWS`` block at a time on the CPU,
    so the extra memory is one block, never the table. Bit-identical to the same
    slice of ``init_table_block(table, seed)``.
    """
    row_start, row_end = rows if rows is not None else (0, table.num_embeddings)
    col_start, col_end = cols if cols is not None else (0, table.embedding_dim)
    if not 0 <= row_start <= row_end <= table.num_embeddings:
        raise ValueError(f"row range {rows} outside table {table.name!r}")
    if not 0 <= col_start <= col_end <= table.embedding_dim:
        raise ValueError(f"column range {cols} outside table {table.name!r}")
    if tuple(out.shape) != (row_end - row_start, col_end - col_start):
        raise ValueError(
            f"table {table.name!r}: block rows {rows} x cols {cols} need an output of shape "
            f"{(row_end - row_start, col_end - col_start)}, got {tuple(out.shape)}"
        )
    first, last = row_start // INIT_BLOCK_ROWS, (row_end - 1) // INIT_BLOCK_ROWS
    for block in range(first, last + 1) if row_end > row_start else ():
        block_lo = block * INIT_BLOCK_ROWS
        block_rows = min(INIT_BLOCK_ROWS, table.num_embeddings - block_lo)
        gen = torch.Generator().manual_seed(stable_seed("init", seed, table.name, block))
        if table.init == "uniform":
            values = torch.rand(block_rows, table.embedding_dim, generator=gen)
            values.mul_(2 * table.scale).sub_(table.scale)
        else:
            values = torch.randn(block_rows, table.embedding_dim, generator=gen).mul_(table.scale)
        lo, hi = max(row_start, block_lo), min(row_end, block_lo + block_rows)
        out[lo - row_start : hi - row_start] = values[
            lo - block_lo : hi - block_lo, col_start:col_end
        ]
    return out
