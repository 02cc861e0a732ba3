"""One message per exchange once sizes settle (``distributed/sized_exchange.py``), on one
rank: the heads, the capacity the group agrees on, and the overflow all-to-all."""

import torch

from towerrec.distributed.comm import Comm
from towerrec.distributed.mesh import Topology
from towerrec.distributed.sized_exchange import SizedExchange, capacity_for, head_bytes


def _payload(n: int, fill: int) -> torch.Tensor:
    return torch.full((n,), fill, dtype=torch.uint8)


def test_capacity_is_an_eighth_over_the_largest_in_64_byte_steps():
    assert capacity_for(0) == 0
    assert capacity_for(100) == 128  # 112 rounded up
    assert capacity_for(512) == 576
    assert head_bytes(2) == 40


def test_the_first_exchange_overflows_and_steady_ones_take_one_message():
    comm = Comm(Topology(1))
    exchange = SizedExchange(comm, "ids", "ids_overflow")
    sizes = [100, 90, 180, 50]
    for step, n in enumerate(sizes):
        flight = exchange.start([_payload(n, step)], [[7, step]])
        assert flight.heads().tolist() == [[7, step]]
        (got,) = flight.received()
        assert torch.equal(got, _payload(n, step))
    calls = comm.stats.calls
    # capacity 0, then 128 (from 100): 90 fits; 180 overflows; 50 fits in 256
    assert calls == {"ids": 4, "ids_overflow": 2}
    assert exchange.capacity == capacity_for(50)


def test_settle_reads_the_heads_at_once_and_a_start_settles_the_one_before():
    comm = Comm(Topology(1))
    exchange = SizedExchange(comm, "ids", "ids_overflow")
    first = exchange.start([_payload(10, 1)], [[1]])
    assert first._heads is None  # not read yet
    second = exchange.start([_payload(20, 2)], [[2]], settle=True)
    # the first was read before the second started (one capacity for both ends),
    # and the second at once
    assert first._heads is not None and second._heads is not None
    assert second.capacity == capacity_for(10)
    assert torch.equal(first.received()[0], _payload(10, 1))
    assert torch.equal(second.received()[0], _payload(20, 2))
