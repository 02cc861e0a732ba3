"""Batches from a ``ColumnStore``: deterministic order, per-rank slices, resumable.

The training stream is a sequence of *global samples*; sample s is row
``order_e[s mod N]`` of epoch ``e = s // N`` (N training rows)::

    epoch order   rows cut into blocks of BLOCK; blocks in a random order
                  (seed, epoch), rows shuffled inside each block (seed, epoch, block)
    global batch  i holds samples [i*G, (i+1)*G), G = batch_size * world_size
    rank r        reads samples [i*G + r*B, i*G + (r+1)*B) of it

so in one epoch every row is read exactly once across all ranks, and batch i
depends only on (seed, i, batch size, world size): a run resumed at step i
continues the same stream (the position is the step the trainer checkpoints).
Block shuffling keeps reads local: a batch touches one or two blocks of the
memory-mapped files. Evaluation reads the validation or test split in file
order; rank r of w reads rows [r*N/w, (r+1)*N/w).
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from towerrec.data.batch import Batch
from towerrec.data.cache import ColumnStore, SplitColumns, Verify
from towerrec.data.dense_transform import SAMPLE_ROWS, DenseMode, fit_dense_transform
from towerrec.sparse import KeyedJaggedTensor, can_pin_memory
from towerrec.utils import at_least, parse_enum, stable_seed

__all__ = ["BLOCK", "VERIFY_ALIASES", "ColumnSource", "LoaderConfig", "SplitRows"]

log = logging.getLogger("towerrec")

BLOCK = 8192
# How to convert again with a validation split, by the converter that wrote the cache.
_EVAL_SPLIT = {
    "criteo": "`towerrec data criteo INPUT... --out DIR --validation-fraction F` "
    "(or --validation-files FILE...)",
    "libfm": "`towerrec data libfm INPUT... --fields FIELDS --out DIR --validation-fraction F`",
    "table": "`towerrec data table INPUT... --label COL ... --out DIR --validation-fraction F`",
}


def _no_eval(converter: str | None) -> str:
    how = _EVAL_SPLIT.get(converter or "", "--validation-fraction F or --validation-files FILE...")
    return (
        "the data has no validation rows, and training validates (at the end, and for early "
        f"stopping); preprocess it with a validation split: {how}"
    )


# ``data.loader.verify`` as earlier versions spelled it: true hashed at every open
VERIFY_ALIASES: dict[bool, str] = {True: "always", False: "never"}


@dataclass(frozen=True)
class LoaderConfig:
    """How a file-backed source reads its cache (``data.loader``)."""

    shuffle: bool = True  # block shuffle per epoch; false: file order
    seed: int = 0
    verify: Verify | str | bool = "once"  # checksums: once | always | never (Verify)
    num_workers: int = 0  # worker processes assembling batches; 0: in the training process
    prefetch: int = 4  # batches queued ahead per worker
    pin_memory: bool = True  # page-locked batches when an accelerator is present
    dense: DenseMode | str = "auto"  # dense columns standardised (data/dense_transform.py)

    def __post_init__(self) -> None:
        if isinstance(self.verify, bool):
            object.__setattr__(self, "verify", VERIFY_ALIASES[self.verify])
        object.__setattr__(self, "verify", parse_enum(Verify, self.verify, "data.loader.verify"))
        object.__setattr__(self, "dense", parse_enum(DenseMode, self.dense, "data.loader.dense"))
        at_least("data.loader.num_workers", self.num_workers, 0)
        at_least("data.loader.prefetch", self.prefetch, 1)


class SplitRows:
    """The parts of one split seen as one row range [0, rows)."""

    def __init__(self, parts: list[SplitColumns]) -> None:
        self.parts = [p for p in parts if p.rows]
        self.starts = np.cumsum([0] + [p.rows for p in self.parts])
        self.rows = int(self.starts[-1])

    def dense_rows(self, rows: np.ndarray) -> np.ndarray:
        """The dense columns ``[n, F]`` of the given global rows, in that order."""
        which = np.searchsorted(self.starts, rows, side="right") - 1
        num_dense = self.parts[0].dense.shape[1] if self.parts else 0
        dense = np.empty((len(rows), num_dense), dtype=np.float32)
        for p in np.unique(which):
            at = np.nonzero(which == p)[0]
            dense[at] = self.parts[p].dense[rows[at] - self.starts[p]]
        return dense

    def gather(self, rows: np.ndarray, single: list[str], multi: list[str]) -> Batch:
        """Batch of the given global rows, in that order."""
        n = len(rows)
        which = np.searchsorted(self.starts, rows, side="right") - 1
        first = self.parts[0] if self.parts else None
        num_dense = first.dense.shape[1] if first else 0
        labels = np.empty(n, dtype=np.float32)
        dense = np.empty((n, num_dense), dtype=np.float32)
        sparse = np.empty((n, len(single)), dtype=np.int32)
        multi_lengths = {m: np.empty(n, dtype=np.int64) for m in multi}
        located = []  # (batch positions, part, local rows) per part touched
        for p in np.unique(which):
            at = np.nonzero(which == p)[0]
            local = rows[at] - self.starts[p]
            part = self.parts[p]
            labels[at] = part.labels[local]
            dense[at] = part.dense[local]
            sparse[at] = part.sparse[local]
            for name in multi:
                offsets = part.multi[name][1]
                multi_lengths[name][at] = offsets[local + 1] - offsets[local]
            located.append((at, part, local))
        # numpy, not torch, for the small copies: no intra-op thread pool to wake per batch.
        all_values = [sparse.T.reshape(-1).astype(np.int64)]
        all_lengths = [np.ones(n * len(single), dtype=np.int64)]
        for name in multi:
            lengths = multi_lengths[name]
            out_offsets = np.concatenate([[0], np.cumsum(lengths)])
            values = np.empty(int(out_offsets[-1]), dtype=np.int64)
            for at, part, local in located:
                part_values, offsets = part.multi[name]
                src = _ranges(part_values, offsets[local], offsets[local + 1])
                dst = _ranges(None, out_offsets[at], out_offsets[at + 1])
                values[dst] = src
            all_values.append(values)
            all_lengths.append(lengths)
        kjt = KeyedJaggedTensor(
            single + multi,
            torch.from_numpy(np.concatenate(all_values)),
            torch.from_numpy(np.concatenate(all_lengths)),
            validate=False,
        )
        return Batch(torch.from_numpy(dense), kjt, torch.from_numpy(labels), validate=False)


def _ranges(values: np.ndarray | None, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """``concat(values[s:e] for s, e in zip(starts, ends))`` without a Python loop
    (the indices themselves when ``values`` is None)."""
    lengths = ends - starts
    total = int(lengths.sum())
    shift = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    index = np.arange(total, dtype=np.int64) + shift
    return index if values is None else np.asarray(values[index])


class ColumnSource:
    """A data source over a ``ColumnStore`` (a memory-mapped cache or in-memory columns).

    ``train_batches`` / ``eval_batches`` (validation) / ``test_batches`` follow the
    module docstring's order.
    """

    def __init__(
        self, store: ColumnStore, config: LoaderConfig | None = None, require_eval: bool = False
    ) -> None:
        self.store = store
        self.config = config or LoaderConfig()
        self.schema = store.schema
        self._train = SplitRows(store.splits.get("train", []))
        self._eval = SplitRows(store.splits.get("validation", []))
        self._test = SplitRows(store.splits.get("test", []))
        if self._train.rows == 0:
            raise ValueError(
                "the data has no training rows; check the input files and the split options "
                "(every input file given as validation or test?)"
            )
        if require_eval and self._eval.rows == 0:
            raise ValueError(_no_eval(store.manifest.get("source")))
        # the dense columns as the model reads them, fitted on the training rows
        self.dense_transform = fit_dense_transform(self._train, self.config.dense)
        if self.dense_transform is not None:
            log.info(self.dense_transform.summary(min(self._train.rows, SAMPLE_ROWS)))
        self._epoch_blocks = lru_cache(maxsize=2)(self._make_epoch_blocks)
        self._block_order = lru_cache(maxsize=8)(self._make_block_order)

    @property
    def train_rows(self) -> int:
        return self._train.rows

    @property
    def eval_rows(self) -> int:
        """Rows of the validation split."""
        return self._eval.rows

    @property
    def test_rows(self) -> int:
        return self._test.rows

    # ------------------------------------------------------------ ordering
    def _make_epoch_blocks(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Block ids in epoch order and the epoch position where each starts."""
        num_blocks = -(-self._train.rows // BLOCK)
        if self.config.shuffle:
            rng = np.random.default_rng(stable_seed("epoch", self.config.seed, epoch))
            blocks = rng.permutation(num_blocks)
        else:
            blocks = np.arange(num_blocks)
        sizes = np.minimum(BLOCK, self._train.rows - blocks * BLOCK)
        return blocks, np.concatenate([[0], np.cumsum(sizes)])

    def _make_block_order(self, epoch: int, block: int) -> np.ndarray:
        size = min(BLOCK, self._train.rows - block * BLOCK)
        if not self.config.shuffle:
            return np.arange(size)
        rng = np.random.default_rng(stable_seed("block", self.config.seed, epoch, block))
        return rng.permutation(size)

    def train_rows_of(self, start: int, count: int) -> np.ndarray:
        """Row ids of global samples [start, start + count)."""
        out = np.empty(count, dtype=np.int64)
        n, done = self._train.rows, 0
        while done < count:
            epoch, position = divmod(start + done, n)
            blocks, block_starts = self._epoch_blocks(epoch)
            k = int(np.searchsorted(block_starts, position, side="right")) - 1
            block = int(blocks[k])
            within = position - int(block_starts[k])
            order = self._block_order(epoch, block)
            take = min(count - done, len(order) - within)
            out[done : done + take] = block * BLOCK + order[within : within + take]
            done += take
        return out

    # ------------------------------------------------------------ batches
    def train_batch(self, index: int, batch_size: int, rank: int = 0, world_size: int = 1) -> Batch:
        start = index * batch_size * world_size + rank * batch_size
        rows = self.train_rows_of(start, batch_size)
        return self._gather(self._train, rows)

    def gather_train(self, rows: np.ndarray) -> Batch:
        """Batch of the given training rows (ids in ``[0, train_rows)``), in that order."""
        return self._gather(self._train, rows)

    def _gather(self, split: SplitRows, rows: np.ndarray) -> Batch:
        batch = split.gather(rows, self.store.single, self.store.multi)
        if self.dense_transform is not None:
            self.dense_transform.apply(batch.dense.numpy())
        return batch

    def train_batches(
        self, batch_size: int, start_batch: int = 0, rank: int = 0, world_size: int = 1
    ) -> Generator[Batch, None, None]:
        """Endless training stream from global batch ``start_batch`` (see module docstring)."""
        _check_rank(rank, world_size)
        if self.config.num_workers:
            from towerrec.data.workers import prefetched_batches

            yield from prefetched_batches(self, batch_size, start_batch, rank, world_size)
            return
        pin = self.config.pin_memory and can_pin_memory()
        index = start_batch
        while True:
            batch = self.train_batch(index, batch_size, rank, world_size)
            yield batch.pin_memory() if pin else batch
            index += 1

    def eval_batches(self, batch_size: int, rank: int = 0, world_size: int = 1) -> Iterator[Batch]:
        """This rank's batches of the validation split."""
        if self._eval.rows == 0:
            raise ValueError(_no_eval(self.store.manifest.get("source")))
        return self._batches_of(self._eval, batch_size, rank, world_size)

    def test_batches(self, batch_size: int, rank: int = 0, world_size: int = 1) -> Iterator[Batch]:
        """This rank's batches of the test split (none when it is empty)."""
        return self._batches_of(self._test, batch_size, rank, world_size)

    def eval_oracle(self, rank: int = 0, world_size: int = 1) -> None:
        """Recorded data has no known click probabilities: no oracle."""
        return None

    def _batches_of(
        self, split: SplitRows, batch_size: int, rank: int, world_size: int
    ) -> Iterator[Batch]:
        _check_rank(rank, world_size)
        total = split.rows
        lo, hi = rank * total // world_size, (rank + 1) * total // world_size
        for start in range(lo, hi, batch_size):
            rows = np.arange(start, min(start + batch_size, hi))
            yield self._gather(split, rows)


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size = {world_size})")
