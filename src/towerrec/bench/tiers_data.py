"""The tables and batches of ``towerrec bench tiers``: Criteo-shaped table sizes for a
given size in GiB, the run's batches (the synthetic source's ids, or Zipf ids drawn
without per-row arrays for tables larger than memory), and the page-cache baseline's
tables over memory-mapped files.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
from dataclasses import replace
from pathlib import Path

import torch

from towerrec.data.batch import Batch, DataSchema
from towerrec.data.criteo_gen import CARDINALITIES
from towerrec.data.synthetic import SyntheticConfig, SyntheticSource
from towerrec.modules.embedding_bag import EmbeddingBagCollection, fused_embedding_modules
from towerrec.modules.tables import INIT_BLOCK_ROWS, TableConfig, fill_table_block
from towerrec.sparse import KeyedJaggedTensor

__all__ = ["criteo_rows", "mmap_tables", "tier_batches", "zipf_ids"]


def criteo_rows(gib: float, dim: int, scale_above: int = 100_000) -> list[int]:
    """The Criteo Kaggle cardinalities with the tables above ``scale_above`` rows scaled so
    that all tables' weights and row-wise state (``4 (dim + 1)`` bytes a row) are ``gib``."""
    row_bytes = 4 * (dim + 1)
    small = sum(c for c in CARDINALITIES if c <= scale_above)
    large = sum(c for c in CARDINALITIES if c > scale_above)
    scale = (gib * 2**30 / row_bytes - small) / large
    if scale <= 0:
        raise ValueError(f"--gib {gib} is smaller than the small tables alone; raise it")
    return [c if c <= scale_above else max(1, round(c * scale)) for c in CARDINALITIES]


def mmap_tables(model: torch.nn.Module, path: Path) -> None:
    """Materialise the model's (unallocated) tables over memory-mapped files in ``path``:
    the weights written with ``pwrite`` from the tables' init, the states zero."""
    (_, ebc), *more = fused_embedding_modules(model)
    if more or not isinstance(ebc, EmbeddingBagCollection):
        raise ValueError("--variants mmap needs one EmbeddingBagCollection of the tables")
    path.mkdir(parents=True, exist_ok=True)
    made: set[str] = set()

    def storage(what: str, shape: tuple[int, ...]) -> torch.Tensor:
        if what in made:
            raise ValueError("--variants mmap needs the tables in one kernel (one dim)")
        made.add(what)
        file, count = path / f"{what}.f32", math.prod(shape)
        with open(file, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, count * 4)  # zeros: the states' init
        if what == "weight":
            _write_init(file, ebc.tables, ebc.seed, shape[1])
        return torch.from_file(str(file), shared=True, size=count).view(shape)

    ebc.materialize(init=False, storage=storage)


def _write_init(file: Path, tables: list[TableConfig], seed: int, dim: int) -> None:
    """The tables' initial weights, one after another, into ``file`` (chunked pwrite)."""
    block = max(1, (64 << 20) // (4 * dim * INIT_BLOCK_ROWS)) * INIT_BLOCK_ROWS
    fd, offset = os.open(file, os.O_WRONLY), 0
    try:
        for table in tables:
            for lo in range(0, table.num_embeddings, block):
                hi = min(table.num_embeddings, lo + block)
                chunk = fill_table_block(torch.empty(hi - lo, dim), table, seed, (lo, hi))
                data, done = chunk.numpy().data.cast("B"), 0
                while done < len(data):
                    done += os.pwrite(fd, data[done:], offset + done)
                offset += len(data)
    finally:
        os.close(fd)


def tier_batches(args: argparse.Namespace, rows: list[int]) -> tuple[list[Batch], DataSchema]:
    """The run's batches (warm-up and timed) and their schema.

    ``--ids synthetic``: the synthetic data set's, whose generator holds about 90 bytes
    for every row of every table while it draws them. ``--ids zipf`` (tables larger
    than memory): the same source with the large tables cut to ``--min-rows`` rows
    labels the batches, and the large tables' ids are drawn anew over all their rows:
    Zipf(``--zipf-alpha``) ranks by the inverse of the continuous power law's CDF,
    scattered over the table by ``rank * A mod rows`` (A prime to rows); no per-row
    array is built."""
    cut = rows if args.ids == "synthetic" else [min(r, args.min_rows) for r in rows]
    source = SyntheticSource(
        SyntheticConfig(num_embeddings=tuple(cut), pooling_factors=(), zipf_alpha=args.zipf_alpha)
    )
    total = args.warmup + args.steps
    batches = [
        source.samples("train", i * args.batch_size, args.batch_size)[0] for i in range(total)
    ]
    schema = source.schema
    del source
    gc.collect()  # the source's block cache holds a cycle back to it (and its teacher)
    if cut == rows:
        return batches, schema
    schema = replace(
        schema,
        sparse=tuple(
            replace(f, num_embeddings=r) for f, r in zip(schema.sparse, rows, strict=True)
        ),
    )
    gen = torch.Generator().manual_seed(args.seed)
    for batch in batches:
        features = batch.sparse
        values, lengths = features.values().clone(), features.lengths()
        offsets = features.offsets()
        size = features.stride()
        for t, (n, c) in enumerate(zip(rows, cut, strict=True)):
            if n == c:
                continue
            lo, hi = int(offsets[t * size]), int(offsets[(t + 1) * size])
            values[lo:hi] = zipf_ids(n, hi - lo, args.zipf_alpha, gen)
        sparse = KeyedJaggedTensor(features.keys(), values, lengths, validate=False)
        batch.sparse = sparse
    return batches, schema


def zipf_ids(rows: int, count: int, alpha: float, gen: torch.Generator) -> torch.Tensor:
    """``count`` ids of a table of ``rows``: Zipf(``alpha``) ranks (the continuous power
    law over ``[1, rows + 1)``, floored) scattered by ``rank * A mod rows``."""
    u = torch.rand(count, generator=gen, dtype=torch.float64)
    if alpha == 1.0:
        x = torch.exp(u * math.log(rows + 1))
    else:
        e = 1.0 - alpha
        x = (1.0 + u * ((rows + 1) ** e - 1.0)) ** (1.0 / e)
    rank = (x.floor().long() - 1).clamp_(0, rows - 1)
    step = 2_654_435_761  # a prime: prime to rows unless it divides it
    while math.gcd(step, rows) != 1:
        step += 2
    return (rank * step) % rows
