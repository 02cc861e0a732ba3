"""Worker processes that assemble batches ahead of the training loop.

Batch i of a ``ColumnSource`` is a pure function of (seed, i, batch size,
rank, world size), so W workers split the stream round-robin and the result
is the same stream, in the same order, as the in-process loader::

    worker w:  batches start+w, start+w+W, ...  --(queue, prefetch deep)--+
    main:      takes batch start+k from worker k mod W  <----------------+
               (pins it when an accelerator is present)

Batches travel as pickled numpy arrays through a pipe (about 1 MB per batch of
2,048 Criteo samples: cheaper than a shared-memory segment per tensor); the
workers are forked, so they share the memory-mapped cache with the parent
instead of copying it, and run one intra-op thread each. A worker first drops
its copy-on-write mappings of the trainer's embedding tables
(``towerrec.memory.release_parent_only``), so it never comes to hold a stale
copy of the pages the trainer rewrites.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import signal
from collections.abc import Iterator

import torch

from towerrec.data.batch import Batch
from towerrec.memory import release_parent_only
from towerrec.sparse import KeyedJaggedTensor, can_pin_memory

__all__ = ["prefetched_batches"]

_POLL_S = 1.0


def _worker(source, out, stop, worker: int, workers: int, args: tuple) -> None:
    batch_size, start, rank, world_size = args
    # A forked worker inherits the trainer's handlers (SIGTERM: "finish the step and
    # checkpoint"); the trainer stops it through ``stop``, and a SIGTERM ends it.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    release_parent_only()  # no stale copy of the trainer's tables here (towerrec.memory)
    torch.set_num_threads(1)
    out.cancel_join_thread()  # exit on stop even while batches are still queued
    index = start + worker
    try:
        while not stop.is_set():
            batch = source.train_batch(index, batch_size, rank, world_size)
            item = (
                index,
                batch.dense.numpy(),
                batch.sparse.values().numpy(),
                batch.sparse.lengths().numpy(),
                batch.labels.numpy(),
            )
            while not stop.is_set():
                try:
                    out.put(item, timeout=_POLL_S)
                    break
                except queue.Full:
                    continue
            index += workers
    except Exception as e:  # handed to the training process
        out.put(("error", f"{type(e).__name__}: {e}"))


def prefetched_batches(
    source, batch_size: int, start_batch: int, rank: int, world_size: int
) -> Iterator[Batch]:
    """The stream of ``source.train_batch(i, ...)`` for i = start_batch, ... from
    ``source.config.num_workers`` processes, each ``source.config.prefetch`` batches ahead."""
    config = source.config
    workers = config.num_workers
    context = mp.get_context("fork")
    stop = context.Event()
    queues = [context.Queue(maxsize=config.prefetch) for _ in range(workers)]
    processes = [
        context.Process(
            target=_worker,
            args=(source, queues[w], stop, w, workers, (batch_size, start_batch, rank, world_size)),
            daemon=True,
        )
        for w in range(workers)
    ]
    for p in processes:
        p.start()
    keys = source.schema.sparse_names
    pin = config.pin_memory and can_pin_memory()
    try:
        index = start_batch
        while True:
            w = (index - start_batch) % workers
            while True:
                try:
                    item = queues[w].get(timeout=_POLL_S)
                    break
                except queue.Empty:
                    if not processes[w].is_alive():
                        raise RuntimeError(
                            f"data loader worker {w} exited (code {processes[w].exitcode}); "
                            "retry with data.loader.num_workers = 0 to see the error in-process"
                        ) from None
            if item[0] == "error":
                raise RuntimeError(f"data loader worker {w} failed: {item[1]}")
            got, dense, values, lengths, labels = (
                torch.from_numpy(a) if i else a for i, a in enumerate(item)
            )
            assert got == index, (got, index)
            sparse = KeyedJaggedTensor(keys, values, lengths, validate=False)
            batch = Batch(dense, sparse, labels, validate=False)
            yield batch.pin_memory() if pin else batch
            index += 1
    finally:
        stop.set()
        for p in processes:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
        for q in queues:
            q.cancel_join_thread()
            q.close()
