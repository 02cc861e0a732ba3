"""Collectives with autograd, wire codecs and byte accounting.

Every collective of the sharded embedding path goes through ``Comm``:

- ``all_to_all(x, send_counts, recv_counts)``: variable-size all-to-all of a
  flat tensor (``send_counts[r]`` elements go to rank r). For float tensors it
  is differentiable: its backward is the all-to-all of the gradient with the
  counts swapped.
- wire codecs: ``fp32`` (default), ``fp16``, ``bf16``; float payloads are cast
  before sending and back to float32 after receiving, chosen separately for
  the forward values and the backward gradients (``CommCodecs``). 16-bit
  payloads travel as raw bytes, which every backend (gloo included) carries.
- accounting: each call records the bytes this rank sent to other ranks,
  split into intra-host and cross-host (``CommStats``); bytes a rank "sends"
  to itself are not traffic and are not counted. The dense layers' gradient
  all-reduces are counted by a DDP communication hook
  (``ring_allreduce_hook``) into a ``CommStats`` of their own.

Shapes: ``x [N]`` flat; ``send_counts[world]``, ``recv_counts[world]`` ints.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum

import torch
import torch.distributed as dist

from towerrec.distributed.mesh import Topology
from towerrec.utils import parse_enum

__all__ = ["Codec", "Comm", "CommCodecs", "CommStats", "Pending", "ring_allreduce_hook"]


class Codec(StrEnum):
    """Wire format of float payloads (embedding outputs and their gradients)."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"

    @property
    def dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[self.value]

    @property
    def relative_error(self) -> float:
        """Bound on |decode(encode(x)) - x| / |x| for normal numbers (half a unit in the
        last place of the format: 2^-11 for fp16, 2^-8 for bf16)."""
        return {"fp32": 0.0, "fp16": 2.0**-11, "bf16": 2.0**-8}[self.value]


@dataclass(frozen=True)
class CommCodecs:
    """Codecs of the embedding-output collectives: ``forward`` for pooled embeddings,
    ``backward`` for their gradients."""

    forward: Codec = Codec.FP32
    backward: Codec = Codec.FP32

    def __post_init__(self) -> None:
        object.__setattr__(self, "forward", parse_enum(Codec, self.forward, "forward codec"))
        object.__setattr__(self, "backward", parse_enum(Codec, self.backward, "backward codec"))


@dataclass
class CommStats:
    """Bytes this rank sent, per collective name, split into intra- and cross-host."""

    intra: dict[str, int] = field(default_factory=dict)
    cross: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def record(self, name: str, intra: int, cross: int) -> None:
        self.intra[name] = self.intra.get(name, 0) + intra
        self.cross[name] = self.cross.get(name, 0) + cross
        self.calls[name] = self.calls.get(name, 0) + 1

    @property
    def intra_bytes(self) -> int:
        return sum(self.intra.values())

    @property
    def cross_bytes(self) -> int:
        return sum(self.cross.values())

    def snapshot(self) -> tuple[int, int]:
        return self.intra_bytes, self.cross_bytes

    def merge(self, other: CommStats) -> None:
        """Add ``other``'s counts (collectives recorded aside, e.g. a prefetch's)."""
        for name, calls in other.calls.items():
            self.intra[name] = self.intra.get(name, 0) + other.intra[name]
            self.cross[name] = self.cross.get(name, 0) + other.cross[name]
            self.calls[name] = self.calls.get(name, 0) + calls

    def reset(self) -> None:
        self.intra.clear()
        self.cross.clear()
        self.calls.clear()

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {
            name: {"intra": self.intra[name], "cross": self.cross[name], "calls": self.calls[name]}
            for name in sorted(self.calls)
        }


class Pending:
    """A collective in flight: ``wait()`` finishes it and returns its result."""

    def __init__(self, work, finish: Callable[[], object]) -> None:
        self._work = work
        self._finish = finish
        self._result: object = None
        self._done = False

    def wait(self):
        if not self._done:
            if self._work is not None:
                self._work.wait()
            self._result = self._finish()
            self._done = True
        return self._result


def _encode(x: torch.Tensor, codec: Codec) -> tuple[torch.Tensor, int]:
    """The wire tensor of ``x`` and how many wire elements one element of ``x`` takes."""
    if codec is Codec.FP32 or not x.is_floating_point():
        return x.contiguous(), 1
    return x.to(codec.dtype).contiguous().view(torch.uint8), codec.dtype.itemsize


def _decode(wire: torch.Tensor, codec: Codec, dtype: torch.dtype) -> torch.Tensor:
    if wire.dtype == dtype:
        return wire
    return wire.view(codec.dtype).to(dtype)


class Comm:
    """The collectives of one process group, with accounting (see module doc)."""

    def __init__(
        self,
        topology: Topology,
        group: dist.ProcessGroup | None = None,
        stats: CommStats | None = None,
    ) -> None:
        self.topology = topology
        self.group = group
        self.stats = stats if stats is not None else CommStats()

    @property
    def rank(self) -> int:
        return self.topology.rank

    @contextmanager
    def recording_into(self, stats: CommStats) -> Iterator[None]:
        """Count the collectives started inside the block in ``stats`` instead (a
        prefetched batch's, merged into the totals when that batch is trained)."""
        kept, self.stats = self.stats, stats
        try:
            yield
        finally:
            self.stats = kept

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    def _account(self, name: str, send_counts: Sequence[int], itemsize: int) -> None:
        intra = cross = 0
        for peer, count in enumerate(send_counts):
            if peer == self.rank or not count:
                continue
            if self.topology.is_cross_host(peer):
                cross += count * itemsize
            else:
                intra += count * itemsize
        self.stats.record(name, intra, cross)

    def all_to_all_async(
        self,
        x: torch.Tensor,
        send_counts: Sequence[int],
        recv_counts: Sequence[int],
        name: str,
        codec: Codec = Codec.FP32,
    ) -> Pending:
        """Start a (non-differentiable) all-to-all; ``.wait()`` gives the received tensor."""
        send_counts, recv_counts = list(send_counts), list(recv_counts)
        assert x.dim() == 1 and x.numel() == sum(send_counts), (x.shape, send_counts)
        wire, scale = _encode(x, codec)
        send = [c * scale for c in send_counts]
        recv = [c * scale for c in recv_counts]
        out = torch.empty(sum(recv), dtype=wire.dtype, device=x.device)
        self._account(name, send, wire.element_size())
        if self.world_size == 1:
            out.copy_(wire)
            work = None
        else:
            work = dist.all_to_all_single(out, wire, recv, send, group=self.group, async_op=True)
        dtype = x.dtype
        return Pending(work, lambda: _decode(out, codec, dtype))

    def all_to_all(
        self,
        x: torch.Tensor,
        send_counts: Sequence[int],
        recv_counts: Sequence[int],
        name: str,
        codecs: CommCodecs | None = None,
    ) -> torch.Tensor:
        """All-to-all; differentiable for float ``x`` (backward: counts swapped)."""
        codecs = codecs or CommCodecs()
        if x.is_floating_point() and torch.is_grad_enabled() and x.requires_grad:
            return _AllToAll.apply(x, self, list(send_counts), list(recv_counts), name, codecs)
        return self.all_to_all_async(x, send_counts, recv_counts, name, codecs.forward).wait()

    def all_to_all_start(
        self,
        x: torch.Tensor,
        send_counts: Sequence[int],
        recv_counts: Sequence[int],
        name: str,
        codecs: CommCodecs | None = None,
    ) -> Pending:
        """``all_to_all`` begun: returns while the data is in flight, so the caller can
        compute meanwhile; ``.wait()`` gives what ``all_to_all`` returns (differentiable
        for float ``x``: its backward is the same all-to-all of the gradient).

        The backward overlaps too: the gradient's all-to-all starts where autograd
        reaches the wait and finishes where it reaches the start, so whatever the
        caller computed between start and wait (created later in the forward, run
        earlier in the backward) runs while the gradients are in flight."""
        codecs = codecs or CommCodecs()
        send_counts, recv_counts = list(send_counts), list(recv_counts)
        if not (x.is_floating_point() and torch.is_grad_enabled() and x.requires_grad):
            return self.all_to_all_async(x, send_counts, recv_counts, name, codecs.forward)
        flight: dict[str, object] = {}  # the forward's Pending, the backward's
        link = _AllToAllStart.apply(x, self, send_counts, recv_counts, name, codecs, flight)
        return Pending(None, lambda: _AllToAllWait.apply(link, flight))

    def exchange_counts(self, counts: torch.Tensor, name: str) -> torch.Tensor:
        """``counts[world, k]`` int64 (row r goes to rank r) -> what every rank sent us."""
        k = counts.shape[1]
        received = self.all_to_all_async(
            counts.reshape(-1), [k] * self.world_size, [k] * self.world_size, name
        ).wait()
        return received.view(self.world_size, k)

    def all_gather_async(self, x: torch.Tensor, counts: Sequence[int], name: str) -> Pending:
        """Start gathering every rank's flat ``x`` (non-differentiable)."""
        send = [x.numel()] * self.world_size
        replicated = x.repeat(self.world_size) if self.world_size > 1 else x
        return self.all_to_all_async(replicated, send, counts, name)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)


def ring_allreduce_hook(
    topology: Topology, stats: CommStats, group: dist.ProcessGroup | None = None
) -> Callable[[object, dist.GradBucket], torch.futures.Future[torch.Tensor]]:
    """A DDP communication hook that all-reduces each gradient bucket as DDP does by
    default (averaged over the group) and records the bytes this rank sends as
    ``dense_allreduce``.

    The bytes follow the ring algorithm gloo runs: over a reduce-scatter and an
    all-gather, each of the group's ``n`` ranks sends ``2 (n - 1) / n`` of the bucket
    to the next rank of the group in rank order, so the link class (intra- or
    cross-host) is that of this rank's ring neighbour. NCCL on GPUs may choose a tree
    for small buckets; the count stays the ring's.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    ranks = (
        dist.get_process_group_ranks(group)
        if group is not None
        else list(range(topology.world_size))
    )
    n = len(ranks)
    neighbour = ranks[(ranks.index(topology.rank) + 1) % n]
    cross_host = topology.is_cross_host(neighbour)

    # No annotations: DDP checks them at run time, and this module's are strings.
    def hook(_state, bucket):
        buffer = bucket.buffer()
        sent = 2 * (n - 1) * buffer.numel() * buffer.element_size() // n
        stats.record("dense_allreduce", 0 if cross_host else sent, sent if cross_host else 0)
        return allreduce_hook(group, bucket)  # type: ignore[arg-type]

    return hook


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm: Comm, send_counts, recv_counts, name, codecs: CommCodecs):
        ctx.comm, ctx.name, ctx.codecs = comm, name, codecs
        ctx.send_counts, ctx.recv_counts = send_counts, recv_counts
        return comm.all_to_all_async(x, send_counts, recv_counts, name, codecs.forward).wait()

    @staticmethod
    def backward(ctx, grad):
        comm = ctx.comm
        back = comm.all_to_all_async(
            grad.contiguous(),
            ctx.recv_counts,
            ctx.send_counts,
            ctx.name + "_grad",
            ctx.codecs.backward,
        ).wait()
        return back, None, None, None, None, None


class _AllToAllStart(torch.autograd.Function):
    """Forward: launch the all-to-all (into ``flight``) and return an unfilled tensor
    of the received size that links the graph to ``_AllToAllWait``. Backward: finish
    the gradient's all-to-all that ``_AllToAllWait``'s backward started."""

    @staticmethod
    def forward(ctx, x, comm: Comm, send_counts, recv_counts, name, codecs: CommCodecs, flight):
        ctx.flight = flight
        flight["pending"] = comm.all_to_all_async(x, send_counts, recv_counts, name, codecs.forward)
        flight["backward"] = _Reverse(comm, send_counts, recv_counts, name, codecs)
        return x.new_empty(sum(recv_counts))

    @staticmethod
    def backward(ctx, _link_grad):
        return (ctx.flight.pop("grad").wait(),) + (None,) * 6


class _AllToAllWait(torch.autograd.Function):
    """Forward: wait for the all-to-all and return its data. Backward: start the
    gradient's all-to-all (counts swapped) and pass the gradient on to the start."""

    @staticmethod
    def forward(ctx, link, flight):
        ctx.flight = flight
        # Popped, not read: the Pending keeps its result, and the result's grad_fn is
        # this node, whose ctx holds ``flight``; a cycle through autograd's C++ nodes
        # that Python's garbage collector cannot see, so every step's output leaked.
        return flight.pop("pending").wait()

    @staticmethod
    def backward(ctx, grad):
        ctx.flight["grad"] = ctx.flight["backward"].start(grad)
        return grad, None


@dataclass(frozen=True)
class _Reverse:
    """The gradient's all-to-all of an ``all_to_all_start``."""

    comm: Comm
    send_counts: list[int]
    recv_counts: list[int]
    name: str
    codecs: CommCodecs

    def start(self, grad: torch.Tensor) -> Pending:
        return self.comm.all_to_all_async(
            grad.contiguous(),
            self.recv_counts,
            self.send_counts,
            self.name + "_grad",
            self.codecs.backward,
        )
