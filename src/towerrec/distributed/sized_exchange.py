"""An all-to-all of variable-size byte payloads in one message per peer once sizes settle.

The id payloads of input_dist and of the tower transform (lengths, ids and per-id
weights, ``id_wire.py``) change size every batch, so a receiver cannot know how much
to receive. The plain answer is two collectives, the sizes first, then the payloads.
``SizedExchange`` needs one::

    chunk to rank d = [ head int64 [F + 3] | first C bytes of payload d | zero padding ]
                        F caller's fields (batch, sizes, ...), then this payload's bytes,
                        whether any of the sender's payloads is over C, the sender's
                        largest payload

Every chunk has ``HEAD_BYTES(F) + C`` bytes, C the *capacity*, the same on every rank.
The group agrees on C without a message of its own: every rank receives every rank's
largest payload and sets the next exchange's C to the largest of them plus an eighth,
rounded up to 64 bytes (``capacity_for``). A payload over C sends its rest in a second
all-to-all (``overflow_name``), which every rank starts or skips alike because every
head says whether its sender overflows. The first exchange (C = 0) is thus the sizes
exchange plus the payload exchange; steady ones one message per peer. The price: up to
an eighth (plus 64 bytes) of padding per chunk, counted as traffic.

``settle=True`` reads the heads (and starts the overflow) inside ``start``, as the old
two collectives did: for an exchange started ahead of its use (a prefetch), whose
receipt would otherwise happen at a point that differs between ranks. Every rank sees
the same C at each start because it reads the heads of every exchange before starting
the next one (``start`` settles the previous one first) and all ranks run the same
sequence of starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from towerrec.distributed.comm import Comm, CommStats, Pending

__all__ = ["SizedExchange", "SizedFlight", "capacity_for", "head_bytes"]

_OWN_FIELDS = 3  # payload bytes, over capacity, largest payload


def head_bytes(fields: int) -> int:
    """Bytes of a chunk's head with ``fields`` caller fields."""
    return 8 * (fields + _OWN_FIELDS)


def capacity_for(largest: int) -> int:
    """Payload bytes a chunk carries in the next exchange: the group's largest payload of
    this one and an eighth more (batches vary), rounded up to 64 bytes."""
    return 64 * -(-(largest * 9 // 8) // 64)


@dataclass
class SizedFlight:
    """One exchange in flight (``SizedExchange.start``); ``heads()`` then ``received()``."""

    exchange: SizedExchange
    pending: Pending
    payloads: list[torch.Tensor]
    capacity: int
    fields: int
    stats: CommStats  # where the overflow all-to-all is counted (the start's)
    _heads: torch.Tensor | None = None
    sizes: list[int] = field(default_factory=list)
    bodies: list[torch.Tensor] = field(default_factory=list)
    overflow: Pending | None = None

    def heads(self) -> torch.Tensor:
        """Every source's fields ``[world, F]`` int64 on the CPU: waits for the chunks,
        sets the exchange's next capacity and starts the overflow all-to-all where a
        payload did not fit. The first call does this; later calls return the heads."""
        if self._heads is not None:
            return self._heads
        world, capacity = self.exchange.comm.world_size, self.capacity
        width = head_bytes(self.fields)
        got = self.pending.wait().view(world, width + capacity)
        head = got[:, :width].contiguous().view(torch.int64).cpu()
        sizes = head[:, self.fields].tolist()
        self.exchange.capacity = capacity_for(int(head[:, self.fields + 2].max()))
        self.bodies = [got[r, width : width + min(sizes[r], capacity)] for r in range(world)]
        self.sizes = sizes
        if bool(head[:, self.fields + 1].any()):
            comm = self.exchange.comm
            with comm.recording_into(self.stats):
                self.overflow = comm.all_to_all_async(
                    torch.cat([p[capacity:] for p in self.payloads]),
                    [max(p.numel() - capacity, 0) for p in self.payloads],
                    [max(size - capacity, 0) for size in sizes],
                    self.exchange.overflow_name,
                )
        self._heads = head[:, : self.fields]
        return self._heads

    def received(self) -> list[torch.Tensor]:
        """Every source's whole payload (uint8), in source order."""
        self.heads()
        if self.overflow is None:
            return self.bodies
        rest = self.overflow.wait().split([max(s - self.capacity, 0) for s in self.sizes])
        return [torch.cat([body, more]) for body, more in zip(self.bodies, rest)]


class SizedExchange:
    """Repeated exchanges of byte payloads over one ``Comm`` (module doc)."""

    def __init__(self, comm: Comm, name: str, overflow_name: str) -> None:
        self.comm, self.name, self.overflow_name = comm, name, overflow_name
        self.capacity = 0  # payload bytes per chunk, agreed by the group
        self._last: SizedFlight | None = None

    def start(
        self,
        payloads: Sequence[torch.Tensor],
        fields: Sequence[Sequence[int]],
        settle: bool = False,
    ) -> SizedFlight:
        """Send ``payloads[d]`` (uint8) with the int ``fields[d]`` (F per destination, the
        same F everywhere) to every rank d; ``settle``: read the heads now (module doc)."""
        if self._last is not None:
            self._last.heads()  # every rank reads it before this start: one capacity
        world, capacity = self.comm.world_size, self.capacity
        assert len(payloads) == len(fields) == world, (len(payloads), len(fields), world)
        num_fields = len(fields[0])
        largest = max(p.numel() for p in payloads)
        device = payloads[0].device
        chunks = []
        for p, own in zip(payloads, fields):
            head = [*own, p.numel(), int(largest > capacity), largest]
            body = p[:capacity]
            pad = torch.zeros(capacity - body.numel(), dtype=torch.uint8, device=device)
            chunks += [torch.tensor(head, dtype=torch.int64, device=device).view(torch.uint8)]
            chunks += [body, pad]
        width = head_bytes(num_fields) + capacity
        pending = self.comm.all_to_all_async(
            torch.cat(chunks), [width] * world, [width] * world, self.name
        )
        flight = SizedFlight(self, pending, list(payloads), capacity, num_fields, self.comm.stats)
        self._last = flight
        if settle:
            flight.heads()
        return flight
