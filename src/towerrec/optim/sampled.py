"""What the sample-choosing dense optimizers (``pb_lbfgs.py``, ``dance.py``) work on.

These methods decide themselves which samples each evaluation sees (a batch that
grows, an overlap of consecutive batches, a stage's accumulated sample), and
evaluate the same samples several times (line-search trials, Hessian-vector
products). They therefore do not take one batch per ``step``: they draw *chunks*
(fixed-size groups of samples; in training one chunk is one global batch of
``train.batch_size``) from a ``SampleSet`` and ask it for per-chunk sums::

    draw(n)                       n fresh chunk ids
    evaluate(chunks, grad)        loss sums [C], sample counts [C], gradient sums [C, P]
    hessian(chunks)(v)            sum over the chunks' samples of H_i v, [P]
    release(chunks)               the chunks are no longer needed

All values are this process's share; an optimizer sums them over the ranks with
one ``Reducer.all_reduce_sum`` per evaluation (in a single process: nothing), so
every rank takes the same decisions and the same steps. P is the number of
dense parameters, flattened in parameter order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

__all__ = [
    "ChunkEvaluation",
    "ChunkedOptimizer",
    "LocalReducer",
    "PersistentScalars",
    "Reducer",
    "SampleSet",
    "SampledOptimizer",
    "TensorSamples",
    "chunk_cap",
    "contiguous_chunks",
    "flat_parameters",
    "hessian_operator",
    "reduce_evaluation",
    "set_flat_parameters",
]


@dataclass
class ChunkEvaluation:
    """Per-chunk sums over the samples of C chunks (this rank's or, reduced, all ranks')."""

    losses: torch.Tensor  # [C] loss sums
    counts: torch.Tensor  # [C] samples
    grads: torch.Tensor | None  # [C, P] gradient sums; None when not asked for


class SampleSet(Protocol):
    """The data an optimizer draws chunks from and evaluates the model on (module doc)."""

    @property
    def total_chunks(self) -> int | None:
        """Chunks in the whole data set (a finite sum); None for an endless stream."""
        ...

    @property
    def moves_other_parameters(self) -> bool:
        """Whether drawing and evaluating fresh chunks changes parameters the optimizer
        does not own (embedding rows moved by their fused optimizer), so that an earlier
        evaluation at the same dense point no longer holds."""
        ...

    def draw(self, count: int) -> list[int]: ...

    def evaluate(self, chunks: Sequence[int], grad: bool) -> ChunkEvaluation: ...

    def hessian(self, chunks: Sequence[int]) -> Callable[[torch.Tensor], torch.Tensor]: ...

    def release(self, chunks: Sequence[int]) -> None: ...


class Reducer(Protocol):
    """Sums a tensor over the ranks of a data-parallel group (in place, returned)."""

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor: ...


class LocalReducer:
    """One process: the sum over ranks is the tensor itself."""

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


@runtime_checkable
class SampledOptimizer(Protocol):
    """A dense optimizer that takes one iteration on samples it draws itself; the
    trainer calls ``iterate`` instead of a backward and ``step``. The report is a flat
    dict of numbers for metrics.jsonl; ``fresh_samples`` says how many samples it drew.

    Its ``state_dict`` holds everything the next iteration uses (a resume continues
    exactly), and ``chunk_position`` says where in the stream it stands: the chunks it
    holds (consecutive ids, drawn earlier and still needed) and the id it draws next.
    A resumed run draws the held chunks again, then continues at that id."""

    def iterate(self, samples: SampleSet) -> dict[str, float]: ...

    def chunk_position(self) -> tuple[list[int], int]: ...


def contiguous_chunks(chunks: Sequence[int]) -> tuple[int, int]:
    """(first id, count) of ``chunks``, which must be consecutive ids in order (as the
    optimizers hold them: a sample is what was drawn since some chunk)."""
    first = chunks[0] if chunks else 0
    if list(chunks) != list(range(first, first + len(chunks))):
        raise AssertionError(f"held chunks are not consecutive ids: {list(chunks)}")
    return first, len(chunks)


class PersistentScalars:
    """Named numbers of an optimizer kept as Python floats in the state of its first
    parameter (entries ``<prefix><name>``), created up front: checkpoint loaders fill the
    entries a state already has, and load_state_dict casts tensors to the parameters'
    dtype (float32 would round a counter) but leaves numbers as they are."""

    def __init__(self, optimizer: torch.optim.Optimizer, prefix: str, names: Sequence[str]) -> None:
        self.optimizer, self.prefix, self.names = optimizer, prefix, list(names)
        self._first = optimizer.param_groups[0]["params"][0]
        self.write(dict.fromkeys(self.names, 0.0))

    def write(self, values: dict[str, float]) -> None:
        state = self.optimizer.state[self._first]
        for name in self.names:
            state[self.prefix + name] = float(values[name])

    def read(self) -> dict[str, float]:
        state = self.optimizer.state[self._first]
        return {name: float(state[self.prefix + name]) for name in self.names}


_CHUNK_SCALARS = ("chunk_first", "chunk_count", "next_chunk")


def chunk_cap(samples: SampleSet, max_chunks: int) -> int:
    """The most chunks a sample may hold: ``max_chunks``, or the whole data set if smaller."""
    total = samples.total_chunks
    return min(max_chunks, total if total is not None else max_chunks)


class ChunkedOptimizer(torch.optim.Optimizer):
    """What the sample-drawing optimizers (``SampledOptimizer``) share: the chunks they
    hold (``_chunks``, consecutive ids) and the id they draw next, the sample counters
    they report (``counters``), an iteration count per parameter, and the state dict
    that keeps all of it. Their numbers are ``PersistentScalars``: a subclass names its
    own in ``_keep_state`` (after its per-parameter state entries) and gives their values
    in ``_own_scalars``; ``_restore`` reads them back after ``load_state_dict``.
    ``step`` refuses: these optimizers draw their own samples."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float,
        reducer: Reducer | None,
        counters: Sequence[str],
    ) -> None:
        super().__init__(list(params), {"lr": lr})
        self.reducer = reducer or LocalReducer()
        self.params = [p for g in self.param_groups for p in g["params"]]
        self.counters = dict.fromkeys(counters, 0.0)
        self._chunks: list[int] = []
        self._next_chunk = 0  # the id of the next chunk drawn
        for p in self.params:
            self.state[p]["iterations"] = torch.zeros((), dtype=torch.int64)

    def _keep_state(self, prefix: str, names: Sequence[str]) -> None:
        """Create the persistent numbers (``names``, the held chunks, the counters) under
        ``prefix`` and hook them to the state dict (the last step of ``__init__``)."""
        self._scalars = PersistentScalars(self, prefix, (*names, *_CHUNK_SCALARS, *self.counters))
        self.register_state_dict_pre_hook(lambda _: self._save())
        self.register_load_state_dict_post_hook(lambda _: self._load())

    def _own_scalars(self) -> dict[str, float]:
        """The values of the subclass's numbers (the ``names`` of ``_keep_state``)."""
        raise NotImplementedError

    def _restore(self, values: dict[str, float]) -> None:
        """Read the subclass's numbers (and anything else it keeps) back."""
        raise NotImplementedError

    def _save(self) -> None:
        first, count = contiguous_chunks(self._chunks)
        chunks = {"chunk_first": first, "chunk_count": count, "next_chunk": self._next_chunk}
        self._scalars.write({**self._own_scalars(), **chunks, **self.counters})

    def _load(self) -> None:
        values = self._scalars.read()
        first = int(values["chunk_first"])
        self._chunks = list(range(first, first + int(values["chunk_count"])))
        self._next_chunk = int(values["next_chunk"])
        self.counters = {name: values[name] for name in self.counters}
        self._restore(values)

    def _count_iteration(self) -> None:
        for p in self.params:
            self.state[p]["iterations"] += 1

    def chunk_position(self) -> tuple[list[int], int]:
        """The chunks held (drawn earlier, still needed) and the id drawn next."""
        return list(self._chunks), self._next_chunk

    def step(self, closure=None):  # draws its own samples: no closure step
        raise TypeError(
            f"{type(self).__name__} draws its own samples: call iterate(samples) with a "
            "SampleSet (towerrec train does)"
        )


def flat_parameters(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """[P]: the parameters, flattened in order (a copy)."""
    return torch.cat([p.detach().reshape(-1) for p in params])


@torch.no_grad()
def set_flat_parameters(params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Write the [P] vector ``flat`` into ``params`` in place."""
    offset = 0
    for p in params:
        p.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()


def reduce_evaluation(reducer: Reducer, local: ChunkEvaluation) -> ChunkEvaluation:
    """``local`` summed over the ranks in one all-reduce."""
    parts = [local.losses, local.counts.to(local.losses.dtype)]
    if local.grads is not None:
        parts.append(local.grads.reshape(-1).to(local.losses.dtype))
    total = reducer.all_reduce_sum(torch.cat(parts))
    c = local.losses.numel()
    grads = None
    if local.grads is not None:
        grads = total[2 * c :].view_as(local.grads).to(local.grads.dtype)
    return ChunkEvaluation(total[:c], total[c : 2 * c], grads)


class TensorSamples:
    """A ``SampleSet`` over in-memory tensors: ``rows`` samples in one shuffled order,
    cut into chunks of ``chunk_size`` consecutive rows (the last chunk may be shorter).
    Chunk id ``c`` is position ``c mod total_chunks``: chunks are drawn in order, so any
    ``total_chunks`` consecutive ids hold every sample exactly once.

    ``loss(rows)`` returns the per-sample losses [n] of the given row indices as a
    function of ``params``. With ``rank``/``world_size``, this process owns the rows of
    every chunk whose position in the chunk is ``rank`` modulo ``world_size``. ``first``:
    the id drawn first (a resumed optimizer's next chunk).
    """

    def __init__(
        self,
        loss: Callable[[torch.Tensor], torch.Tensor],
        params: Sequence[torch.Tensor],
        rows: int,
        chunk_size: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        first: int = 0,
    ) -> None:
        if chunk_size < 1 or rows < 1:
            raise ValueError(f"need rows >= 1 and chunk_size >= 1, got {rows} and {chunk_size}")
        self.loss, self.params = loss, list(params)
        self.rows, self.chunk_size = rows, chunk_size
        self.rank, self.world_size = rank, world_size
        self._order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
        self._next = first

    @property
    def total_chunks(self) -> int:
        return -(-self.rows // self.chunk_size)

    @property
    def moves_other_parameters(self) -> bool:
        return False

    def draw(self, count: int) -> list[int]:
        ids = list(range(self._next, self._next + count))
        self._next += count
        return ids

    def _rows(self, chunk: int) -> torch.Tensor:
        """This rank's rows of ``chunk``."""
        start = (chunk % self.total_chunks) * self.chunk_size
        return self._order[start : start + self.chunk_size][self.rank :: self.world_size]

    def evaluate(self, chunks: Sequence[int], grad: bool) -> ChunkEvaluation:
        losses, counts, grads = [], [], []
        for chunk in chunks:
            rows = self._rows(chunk)
            with torch.set_grad_enabled(grad):
                total = self.loss(rows).sum()
            losses.append(total.detach())
            counts.append(len(rows))
            if grad:
                parts = torch.autograd.grad(total, self.params, allow_unused=True)
                grads.append(_flat(parts, self.params))
        dtype = self.params[0].dtype
        return ChunkEvaluation(
            torch.stack(losses).to(dtype),
            torch.tensor(counts, dtype=dtype),
            torch.stack(grads) if grad else None,
        )

    def hessian(self, chunks: Sequence[int]) -> Callable[[torch.Tensor], torch.Tensor]:
        rows = torch.cat([self._rows(c) for c in chunks])
        return hessian_operator(lambda: self.loss(rows).sum(), self.params)

    def release(self, chunks: Sequence[int]) -> None:
        pass


def _flat(parts: Sequence[torch.Tensor | None], params: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat(
        [(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(parts, params)]
    )


def hessian_operator(
    total_loss: Callable[[], torch.Tensor], params: Sequence[torch.Tensor]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``v -> H v`` of the loss sum at the current parameters (double backward): the
    gradient's graph is built once and kept for every product."""
    with torch.enable_grad():
        parts = torch.autograd.grad(total_loss(), params, create_graph=True, allow_unused=True)
    live = [(g, p) for g, p in zip(parts, params) if g is not None]
    sizes = [p.numel() for p in params]
    used = [g is not None for g in parts]

    def product(v: torch.Tensor) -> torch.Tensor:
        pieces = _used(list(torch.split(v, sizes)), used)
        with torch.enable_grad():
            dot = torch.stack([(g * x.view_as(g)).sum() for (g, _), x in zip(live, pieces)]).sum()
            out = torch.autograd.grad(
                dot, [p for _, p in live], retain_graph=True, allow_unused=True
            )
        filled: Iterator[torch.Tensor | None] = iter(out)
        return _flat([next(filled) if u else None for u in used], params).detach()

    return product


def _used(pieces: list[torch.Tensor], used: list[bool]) -> list[torch.Tensor]:
    return [piece for piece, u in zip(pieces, used) if u]
