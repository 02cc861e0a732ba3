"""Pipelined training input: the next batch's input_dist runs while this batch computes.

::

    plain       [dist i | lookup i, dense i, backward i] [dist i+1 | ...]
    pipelined   [dist i+1 (async, in flight) ... lookup i, dense i, backward i]
                                              [dist i+2 ... lookup i+1 ...]

``pipelined(model, batches)`` wraps the batch iterator: before handing out
batch i it starts ``prefetch`` (count exchange, then the id all-to-alls as
asynchronous collectives) of batch i+1 on every sharded embedding collection;
``forward`` of batch i+1 later picks up the result. The train step itself is
unchanged, and the arithmetic is identical to the plain loop.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from towerrec.data.batch import Batch
from towerrec.modules.embedding_bag import fused_embedding_modules

__all__ = ["pipelined"]


def pipelined(model: nn.Module, batches: Iterator[Batch]) -> Iterator[Batch]:
    """``batches`` with each next batch's input_dist started one step ahead."""
    sharded = [m for _, m in fused_embedding_modules(model) if hasattr(m, "prefetch")]
    if not sharded:
        yield from batches
        return
    current = next(batches)
    for module in sharded:
        module.prefetch(current.sparse)
    for upcoming in batches:
        for module in sharded:
            module.prefetch(upcoming.sparse)
        yield current
        current = upcoming
    yield current
