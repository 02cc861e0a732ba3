"""Embedding table configuration and deterministic table init.

Initial weights are a pure function of (seed, table name, row, column): rows are
drawn in fixed blocks, each from its own generator, so any shard of a table
(a row range, a column range) can be initialised on its own rank without
materialising the whole table, and every layout starts from the same weights.

Tables too large to initialise up front (``backing = "kv"``: rows keyed by 64-bit id,
created on first touch) use ``init_rows`` instead: each value is a counter-based hash
of (seed, table name, row id, column), so any process creates the same row from its id
alone, in any order and any batch.

What a table starts from is named by an init rule (``INIT_RULES``; the config's
``embedding.init``), resolved once into a table's distribution and scale
(``resolve_init``)::

    uniform_rows    uniform in [-sqrt(1/rows), sqrt(1/rows))   TorchRec's and dlrm's rule
    normal_rows     normal, std sqrt(1/rows)
    uniform_scale   uniform in [-init_scale, init_scale)       Keras ("uniform": 0.05)
    normal_scale    normal, std init_scale                     FuxiCTR, DeepCTR (1e-4)

``uniform`` and ``normal``, the names before ``init_scale`` existed, stay aliases of
the two ``_rows`` rules: a config that said them means what it meant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import torch

from towerrec.utils import at_least, parse_enum, stable_seed

__all__ = [
    "INIT_ALIASES",
    "INIT_RULES",
    "InitRule",
    "Pooling",
    "TableConfig",
    "canonical_init",
    "check_init_scale",
    "fill_table_block",
    "init_rows",
    "init_table_block",
    "resolve_init",
]

INIT_BLOCK_ROWS = 16384


class Pooling(StrEnum):
    SUM = "sum"
    MEAN = "mean"


@dataclass(frozen=True)
class InitRule:
    """How an init rule starts a table: its ``distribution`` (``uniform``: the bound is
    the scale; ``normal``: the std is) and where its scale comes from (``by_rows``:
    sqrt(1 / rows) of each table; else ``init_scale``)."""

    distribution: str
    by_rows: bool
    help: str


INIT_RULES: dict[str, InitRule] = {
    "uniform_rows": InitRule("uniform", True, "uniform in +-sqrt(1/rows) (TorchRec, dlrm)"),
    "normal_rows": InitRule("normal", True, "normal with std sqrt(1/rows)"),
    "uniform_scale": InitRule("uniform", False, "uniform in +-init_scale"),
    "normal_scale": InitRule("normal", False, "normal with std init_scale (FuxiCTR: 1e-4)"),
}
# The names before init_scale existed, kept: they mean what they meant.
INIT_ALIASES = {"uniform": "uniform_rows", "normal": "normal_rows"}


def canonical_init(name: str, key: str) -> str:
    """The rule ``name`` names (an alias resolved), or a ``ValueError`` naming ``key``."""
    if name in INIT_RULES:
        return name
    if name in INIT_ALIASES:
        return INIT_ALIASES[name]
    rules = ", ".join(f"{n!r} ({r.help})" for n, r in INIT_RULES.items())
    raise ValueError(f"{key} = {name!r} is not an init rule; choose one of {rules}")


def check_init_scale(value: float | None, key: str) -> None:
    """Refuse a scale that is not a finite number > 0 (None: unset, passes)."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"{key} = {value} must be a finite number > 0: the bound of init = "
            "'uniform_scale' or the std of 'normal_scale' (e.g. 0.01)"
        )


def resolve_init(rule: str, init_scale: float) -> tuple[str, float | None]:
    """A table's ``(init, init_scale)`` (``TableConfig``'s fields) under ``rule`` (a
    canonical name or an alias): the distribution, and the scale (None: sqrt(1/rows))."""
    resolved = INIT_RULES[canonical_init(rule, "init")]
    return resolved.distribution, None if resolved.by_rows else init_scale


@dataclass(frozen=True)
class TableConfig:
    """One embedding table.

    ``feature_names`` are the input keys looked up in this table (several
    features may share one table); empty means the single feature ``name``.
    ``init`` is the distribution, ``uniform`` (bound ``init_scale``) or ``normal``
    (std ``init_scale``); ``init_scale=None`` uses ``sqrt(1 / num_embeddings)``
    (``resolve_init`` makes the pair from a config's init rule).
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
        at_least(f"table {self.name!r}: num_embeddings", self.num_embeddings, 1)
        at_least(f"table {self.name!r}: embedding_dim", self.embedding_dim, 1)
        if self.init not in ("uniform", "normal"):
            raise ValueError(
                f"table {self.name!r}: init must be 'uniform' or 'normal', got {self.init!r}"
            )
        check_init_scale(self.init_scale, f"table {self.name!r}: init_scale")
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


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 values (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    out: np.ndarray = x ^ (x >> np.uint64(31))
    return out


def _uniform01(key: int, ids: np.ndarray, dim: int, stream: int) -> np.ndarray:
    """``[n, dim]`` float64 in (0, 1): 53-bit hashes of (key, id, column, stream)."""
    cols = np.arange(dim, dtype=np.uint64) * np.uint64(2) + np.uint64(stream)
    with np.errstate(over="ignore"):
        base = _splitmix64(ids.astype(np.uint64) * _GOLDEN + np.uint64(key))
        bits = _splitmix64(base[:, None] + (cols[None, :] + np.uint64(1)) * _GOLDEN)
    out: np.ndarray = ((bits >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53
    return out


def init_rows(table: TableConfig, seed: int, ids: torch.Tensor) -> torch.Tensor:
    """Initial weights ``[n, D]`` (float32, CPU) of rows ``ids`` ``[n]`` (int64), each a
    pure function of (seed, table name, id, column): the same row in every process,
    whichever other rows are created with it (module doc). ``uniform`` draws from
    ``[-scale, scale)``, ``normal`` by Box-Muller with std ``scale``, as
    ``fill_table_block`` does (but not the same values: that one draws by blocks)."""
    key = stable_seed("row-init", seed, table.name)
    flat = ids.reshape(-1).cpu().numpy()
    dim = table.embedding_dim
    if table.init == "uniform":
        values = (2.0 * _uniform01(key, flat, dim, 0) - 1.0) * table.scale
    else:
        radius = np.sqrt(-2.0 * np.log(_uniform01(key, flat, dim, 0)))
        values = radius * np.cos(2.0 * np.pi * _uniform01(key, flat, dim, 1)) * table.scale
    return torch.from_numpy(values.astype(np.float32))
