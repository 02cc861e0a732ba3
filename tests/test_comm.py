"""Topology, byte accounting and wire codecs (pure logic, no process group)."""

import gc
import weakref

import pytest
import torch

from towerrec.distributed.comm import Codec, Comm, CommCodecs
from towerrec.distributed.mesh import HOSTS_ENV, Topology, topology_from_env


def test_topology_hosts_and_ranks():
    topo = Topology(world_size=8, hosts=2, rank=5)
    assert (topo.ranks_per_host, topo.host, topo.local_rank) == (4, 1, 1)
    assert topo.host_ranks(0) == [0, 1, 2, 3]
    assert topo.is_cross_host(3) and not topo.is_cross_host(7)
    with pytest.raises(ValueError, match="multiple of hosts"):
        Topology(world_size=6, hosts=4)


def test_topology_from_torchrun_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "6")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv(HOSTS_ENV, raising=False)
    assert topology_from_env() == Topology(8, 4, 6)
    monkeypatch.setenv(HOSTS_ENV, "2")  # --hosts overrides what torchrun says
    assert topology_from_env() == Topology(8, 2, 6)


def test_bytes_are_split_into_intra_and_cross_host():
    comm = Comm(Topology(world_size=4, hosts=2, rank=1))
    # rank 1 is on host 0 with rank 0; ranks 2 and 3 are on host 1; self-sends are free
    comm._account("a2a", [10, 99, 5, 7], itemsize=4)
    comm._account("a2a", [1, 0, 0, 0], itemsize=2)
    assert comm.stats.intra == {"a2a": 42} and comm.stats.cross == {"a2a": 48}
    assert comm.stats.as_dict()["a2a"]["calls"] == 2


@pytest.mark.parametrize("codec", ["fp16", "bf16"])
def test_codec_error_is_within_half_an_ulp(codec):
    codec = Codec(codec)
    comm = Comm(Topology(1))
    # normal numbers of both formats, six decades either side of 1
    gen = torch.Generator().manual_seed(0)
    magnitude = 10 ** (torch.rand(10_000, generator=gen) * 6 - 3)
    x = magnitude * torch.where(torch.rand(10_000, generator=gen) < 0.5, -1.0, 1.0)
    got = comm.all_to_all_async(x, [x.numel()], [x.numel()], "pooled", codec).wait()
    assert got.dtype == torch.float32
    err = (got - x).abs()
    assert bool((err <= codec.relative_error * x.abs()).all())
    assert float(err.max()) > 0  # it really went through the narrow format
    # bytes on the wire shrink with the codec (counted only for other ranks: none here)
    assert comm.stats.intra_bytes == 0


def test_backward_codec_applies_to_gradients_only():
    comm = Comm(Topology(1))
    x = (torch.randn(64) * 100).requires_grad_(True)
    out = comm.all_to_all(x, [64], [64], "pooled", CommCodecs(forward="fp32", backward="bf16"))
    assert torch.equal(out, x)  # fp32 forward is exact
    grad = torch.randn(64) * 100
    out.backward(grad)
    assert not torch.equal(x.grad, grad)
    assert bool(((x.grad - grad).abs() <= Codec.BF16.relative_error * grad.abs()).all())


def test_unknown_codec_names_the_choices():
    with pytest.raises(ValueError, match="'fp16'"):
        CommCodecs(forward="int8")


def test_begun_all_to_all_overlaps_its_backward_with_what_ran_in_between(monkeypatch):
    """``all_to_all_start``: in the backward the gradient's all-to-all starts at the wait and
    is taken at the start, so the nodes created between them run while it is in flight."""
    comm = Comm(Topology(1))
    events = []
    plain = Comm.all_to_all_async

    def recorded(self, x, send, recv, name, codec=Codec.FP32):
        events.append(f"start {name}")
        pending = plain(self, x, send, recv, name, codec)
        finish = pending.wait
        pending.wait = lambda: (events.append(f"wait {name}"), finish())[1]
        return pending

    monkeypatch.setattr(Comm, "all_to_all_async", recorded)

    class Between(torch.autograd.Function):
        @staticmethod
        def forward(ctx, w):
            return w * 3

        @staticmethod
        def backward(ctx, grad):
            events.append("between")
            return grad * 3

    x = torch.randn(8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    in_flight = comm.all_to_all_start(x * 2, [8], [8], "pooled", CommCodecs(backward="bf16"))
    z = Between.apply(w)  # created between start and wait: run between them backwards
    y = in_flight.wait()
    events.clear()
    (y.sum() + z.sum()).backward()
    assert events == ["start pooled_grad", "between", "wait pooled_grad"]
    assert torch.equal(x.grad, torch.full((8,), 2.0)) and torch.equal(w.grad, torch.full((8,), 3.0))


@pytest.mark.parametrize("backward", [True, False])
def test_a_begun_all_to_all_frees_its_output_with_the_graph(backward):
    """The output of ``all_to_all_start`` is freed once nothing holds it or its graph
    (it used to stay alive through the in-flight record its own autograd node held: on
    2 ranks, every training step's exchanged embeddings leaked, ~0.6 MB a step)."""
    comm = Comm(Topology(1))
    x = torch.randn(8, requires_grad=True)
    y = comm.all_to_all_start(x * 2, [8], [8], "pooled").wait()
    freed = weakref.ref(y)
    if backward:
        y.sum().backward()
    del y
    gc.collect()
    assert freed() is None
