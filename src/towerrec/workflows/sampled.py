"""The step strategy of the dense optimizers that draw their own samples
(``optimizer.name = "pb_lbfgs" | "dance"``): ``SampledSteps``, over the training stream
as a ``SampleSet`` (``optim/sampled.py``, ``BatchSamples``).

A chunk is one global batch of ``train.batch_size`` (this rank holds its slice), drawn
from the loader in order and kept in memory until the optimizer releases it. What
the embeddings see: their fused optimizer updates the looked-up rows inside backward,
so the whole backward runs once per chunk, at its first gradient evaluation, before
anything else is computed on it (the rows move once per batch drawn, as in ordinary
training; that pass's dense gradient is discarded). Every evaluation then leaves the
rows as they are: dense gradients (a chunk's first, an overlap, a stage's
accumulated sample) and Hessian-vector products are ``torch.autograd.grad`` with
respect to the dense parameters only, which never runs the embedding backward, and
line-search trials are forwards under ``no_grad``. So every loss and gradient an
iteration compares sees the same embeddings, at the cost of one extra forward and
backward per batch drawn. Dropout makes repeated
evaluations of one batch disagree: use ``model.dropout = 0`` with these optimizers.

The dense parameters are not replicated with DDP here: the optimizer sums each
evaluation over the ranks itself (``distributed/sum_reduce.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from towerrec.data.batch import Batch
from towerrec.optim.sampled import ChunkEvaluation, SampledOptimizer, hessian_operator
from towerrec.train.loop import train_batches
from towerrec.train.run_dir import RunDir
from towerrec.train.session import Session
from towerrec.train.step import autocast

__all__ = ["BatchSamples", "SampledSteps", "sampled_train_step"]


class BatchSamples:
    """The training batches as chunks (module doc); ``rows_drawn``: this rank's rows;
    ``total_chunks``: the global batches of one pass over a finite data set."""

    def __init__(
        self,
        model: nn.Module,
        params: Sequence[torch.nn.Parameter],
        batches: Iterator[Batch],
        autocast_dtype: torch.dtype | None = None,
        total_chunks: int | None = None,
        first: int = 0,
    ) -> None:
        self.model, self.params, self.batches = model, list(params), batches
        self._total = total_chunks
        self.autocast_dtype = autocast_dtype
        self._cache: dict[int, Batch] = {}
        self._fresh: set[int] = set()
        self._next = first  # chunk id c is the stream's batch c: ``batches`` starts at first
        self.rows_drawn = 0

    def redraw(self, chunks: Sequence[int]) -> None:
        """On resume: the chunks an optimizer still holds (consecutive ids from the first
        drawn next), drawn again. Their backward ran before the checkpoint, so they are
        not fresh, and their rows are not counted again."""
        if list(chunks) != list(range(self._next, self._next + len(chunks))):
            raise AssertionError(f"chunks {list(chunks)} do not start the stream at {self._next}")
        for i in chunks:
            self._cache[i] = next(self.batches)
        self._next += len(chunks)

    @property
    def total_chunks(self) -> int | None:
        """The batches of one pass over the training rows (None: an endless stream): no
        sample grows beyond one pass."""
        return self._total

    @property
    def moves_other_parameters(self) -> bool:
        return True  # the embedding rows

    def draw(self, count: int) -> list[int]:
        ids = list(range(self._next, self._next + count))
        for i in ids:
            batch = next(self.batches)
            self._cache[i] = batch
            self._fresh.add(i)
            self.rows_drawn += batch.size
        self._next += count
        return ids

    def _loss(self, batch: Batch) -> torch.Tensor:
        """The mean loss of ``batch`` (a scalar)."""
        with autocast(batch.dense.device, self.autocast_dtype):
            logits = self.model(batch.dense, batch.sparse)
        return F.binary_cross_entropy_with_logits(logits.float(), batch.labels)

    def evaluate(self, chunks: Sequence[int], grad: bool) -> ChunkEvaluation:
        losses, counts, grads = [], [], []
        # First the whole backward of every fresh chunk (the embedding rows move), then
        # every loss and gradient, all at the same rows.
        for chunk in [c for c in chunks if c in self._fresh] if grad else []:
            self._fresh.discard(chunk)
            self._loss(self._cache[chunk]).backward()
        for p in self.params:  # that backward's dense gradients are not used
            p.grad = None
        for chunk in chunks:
            batch = self._cache[chunk]
            counts.append(batch.size)
            if not grad:
                with torch.no_grad():
                    losses.append(self._loss(batch) * batch.size)
                continue
            loss = self._loss(batch)
            parts = list(torch.autograd.grad(loss, self.params, allow_unused=True))
            flat = torch.cat(
                [
                    (g if g is not None else torch.zeros_like(p)).reshape(-1)
                    for g, p in zip(parts, self.params)
                ]
            )
            grads.append(flat * batch.size)
            losses.append(loss.detach() * batch.size)
        dtype = self.params[0].dtype
        return ChunkEvaluation(
            torch.stack(losses).to(dtype),
            torch.tensor(counts, dtype=dtype, device=self.params[0].device),
            torch.stack(grads) if grad else None,
        )

    def hessian(self, chunks: Sequence[int]) -> Callable[[torch.Tensor], torch.Tensor]:
        batches = [self._cache[c] for c in chunks]
        return hessian_operator(
            lambda: torch.stack([self._loss(b) * b.size for b in batches]).sum(), self.params
        )

    def release(self, chunks: Sequence[int]) -> None:
        for chunk in chunks:
            self._cache.pop(chunk, None)
            self._fresh.discard(chunk)


def sampled_train_step(
    optimizer: SampledOptimizer, samples: BatchSamples
) -> tuple[torch.Tensor, int, dict[str, float]]:
    """One iteration of a sample-drawing optimizer: its loss (on its sample), this rank's
    rows drawn for it, and its report."""
    before = samples.rows_drawn
    report = optimizer.iterate(samples)
    return torch.tensor(report["loss"]), samples.rows_drawn - before, report


class SampledSteps:
    """The loop's ``StepStrategy`` for a ``SampledOptimizer``: one iteration per step on
    the stream's chunks (one global batch each), its report logged as an ``optimizer``
    record. A resumed optimizer's held chunks are drawn again first; the stream goes on
    at its next chunk."""

    optimizer: SampledOptimizer
    samples: BatchSamples
    run: RunDir

    def start(self, session: Session) -> None:
        optimizer = session.optimizer
        assert isinstance(optimizer, SampledOptimizer)  # optimizer.draws_samples
        held, next_chunk = optimizer.chunk_position()
        start = held[0] if held else next_chunk  # one chunk is one batch of the stream
        batches = train_batches(session, start)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        rows, batch_size = session.source.train_rows, session.config.train.batch_size
        epoch = -(-rows // batch_size) if rows else None  # no sample beyond one pass
        samples = BatchSamples(
            session.model, params, batches, session.amp_dtype, epoch, first=start
        )
        if held and held[-1] + 1 != next_chunk:
            raise AssertionError(f"held chunks {held} do not end before chunk {next_chunk}")
        samples.redraw(held)  # a resumed optimizer's sample; the stream goes on at next_chunk
        self.optimizer, self.samples, self.run = optimizer, samples, session.run

    def step(self, step: int) -> tuple[torch.Tensor, int]:
        loss, rows, report = sampled_train_step(self.optimizer, self.samples)
        self.run.log({"kind": "optimizer", "step": step, **report})
        return loss, rows
