"""What the tower transform puts on the wire (4 gloo processes as 2 hosts x 2 ranks): the
tower codecs apply to the tower outputs and their gradients (bf16: each float within
2^-8 of itself), and deduplicated ids change no bit of the result."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_cases import make_batch
from test_sptt import (
    FEATURES,
    NUM_DENSE,
    PARTITION,
    ROWS,
    SUM_TABLES,
    TABLES,
    _collection,
    _slice,
)
from torch.distributed.device_mesh import init_device_mesh

from towerrec.distributed.comm import Codec, CommCodecs, CommStats
from towerrec.distributed.id_wire import IdWire
from towerrec.distributed.launch import spawn_world
from towerrec.distributed.towers import parallelize_towers
from towerrec.models.dmt import DMT

BATCH = 8  # per rank


def _dmt():
    torch.manual_seed(0)
    return DMT(
        _collection(TABLES, "rowwise_adagrad"),
        NUM_DENSE,
        [8, 8],
        [8, 1],
        PARTITION,
        tower="dot",
        tower_outputs=2,
        tower_mlp=(8,),
    )


def _one_step(topology, tower_codecs, wire):
    """Logits of two steps, the cross-host bytes of each collective, the tower outputs
    each rank received and the gradients of its tower's outputs, per step."""
    mesh = init_device_mesh("cpu", (topology.hosts, topology.ranks_per_host))
    stats = CommStats()
    model = parallelize_towers(_dmt(), mesh, tower_codecs=tower_codecs, stats=stats, id_wire=wire)
    received, grads = [], []
    interact = model.interact

    def recording_interact(x, outputs):  # every tower's outputs, as received
        received.append(torch.cat([o.detach().reshape(-1) for o in outputs]))
        return interact(x, outputs)

    model.interact = recording_interact
    model.tower.register_full_backward_hook(
        lambda _m, _gin, gout: grads.append(gout[0].detach().clone())
    )
    lo = topology.rank * BATCH
    logits = []
    for step in range(2):
        world = topology.world_size
        sparse = make_batch(step, BATCH * world, False, FEATURES, ROWS)
        gen = torch.Generator().manual_seed(step)
        dense = torch.randn(BATCH * world, NUM_DENSE, generator=gen)[lo : lo + BATCH]
        out = model(dense, _slice(sparse, lo, lo + BATCH))
        F.binary_cross_entropy_with_logits(out, torch.ones_like(out)).backward()
        logits.append(out.detach())
    return torch.stack(logits), dict(stats.cross), received, grads


def _wire_cases(topology):
    fp16, bf16 = Codec.FP16, Codec.BF16
    return {
        "fp32": _one_step(topology, CommCodecs(), IdWire(False)),
        "fp16": _one_step(topology, CommCodecs(fp16, fp16), IdWire(False)),
        "bf16": _one_step(topology, CommCodecs(bf16, bf16), IdWire(False)),
        "dedup": _one_step(topology, CommCodecs(), IdWire(True, where_smaller=False)),
        "calls": _calls_per_step(topology),
    }


@pytest.fixture(scope="module")
def wire_results():
    """Every rank's ``_wire_cases`` (one spawn for this module's tests)."""
    return spawn_world(_wire_cases, 4, 2)


@pytest.mark.multiprocess
def test_bf16_tower_outputs_and_gradients_are_within_their_bound(wire_results):
    """The stated bound of ``distributed.tower_codec = "bf16"``: the first step's tower
    outputs (same weights and batch in both runs) arrive within 2^-8 of the fp32 run's,
    float by float; every gradient of a tower's outputs arrived as bf16 (times 1/H = 1/2,
    exact), so it too is its sender's value within 2^-8."""
    bound = Codec.BF16.relative_error
    for rank, cases in enumerate(wire_results):
        _, _, received32, grads32 = cases["fp32"]
        _, _, received16, grads16 = cases["bf16"]
        assert not torch.equal(grads32[0], grads32[0].bfloat16().float()), rank  # fp32: not
        exact, rounded = received32[0], received16[0]
        err = (rounded - exact).abs()
        assert bool((err <= bound * exact.abs()).all()), rank
        assert float(err.max()) > 0, rank  # it really went through bf16
        assert len(grads16) == 2, rank
        for grad in grads16:
            sent = grad * 2
            assert torch.equal(sent, sent.bfloat16().float()), rank
            assert bool(sent.abs().max() > 0), rank


@pytest.mark.multiprocess
def test_tower_outputs_use_the_codecs_and_dedup_is_exact(wire_results):
    for rank, cases in enumerate(wire_results):
        logits32, bytes32, _, _ = cases["fp32"]
        for codec in ("fp16", "bf16"):
            logits16, bytes16, _, _ = cases[codec]
            for name in ("tower_outputs", "tower_outputs_grad"):
                assert bytes32[name] > 0 and bytes16[name] * 2 == bytes32[name], (rank, name)
            assert bytes16["tower_input_ids"] == bytes32["tower_input_ids"], rank
            assert 0 < float((logits16 - logits32).abs().max()) < 1e-2, (rank, codec)
        logits_dedup, bytes_dedup, _, _ = cases["dedup"]
        assert torch.equal(logits_dedup, logits32), rank  # deduplicated ids: same bits
        # the first step's payloads follow the chunks in full (capacity 0: tower_input_ids
        # carries heads only), so the deduplicated payloads' size shows there
        ids = ("tower_input_ids", "tower_input_overflow")
        assert sum(bytes_dedup[n] for n in ids) != sum(bytes32[n] for n in ids), rank


def _calls_per_step(topology):
    """Each of three training steps' collective calls per name (one stats object for the
    peer and host collectives), on weighted features with x sent to the towers; steps 2
    and 3 train the batch of step 1 again (payloads of the same size)."""
    mesh = init_device_mesh("cpu", (topology.hosts, topology.ranks_per_host))
    stats = CommStats()
    torch.manual_seed(0)
    dmt = DMT(
        _collection(SUM_TABLES, "rowwise_adagrad"),
        NUM_DENSE,
        [8, 8],
        [8, 1],
        PARTITION,
        tower="dot",
        tower_outputs=2,
        tower_mlp=(8,),
        tower_dense=True,
    )
    model = parallelize_towers(dmt, mesh, stats=stats, id_wire=IdWire())
    lo, world = topology.rank * BATCH, topology.world_size
    sparse = _slice(make_batch(0, BATCH * world, True, FEATURES, ROWS), lo, lo + BATCH)
    dense = torch.randn(BATCH * world, NUM_DENSE, generator=torch.Generator().manual_seed(0))
    steps = []
    for _ in range(3):
        before = dict(stats.calls)
        out = model(dense[lo : lo + BATCH], sparse)
        F.binary_cross_entropy_with_logits(out, torch.ones_like(out)).backward()
        steps.append(
            {n: c - before.get(n, 0) for n, c in stats.calls.items() if c > before.get(n, 0)}
        )
    return steps


@pytest.mark.multiprocess
def test_one_peer_message_per_step(wire_results):
    """The tower transform's peer collectives per training step: ids, lengths and per-id
    weights in one all-to-all, no counts exchange once the peer group knows the message
    size (the first step's capacity is 0: its payloads follow in a second all-to-all),
    then x, the tower outputs and their gradients. Before: counts, ids, weights, x, x's
    gradient, outputs, their gradient (7 per step)."""
    for rank, steps in enumerate(r["calls"] for r in wire_results):
        peer = [{n: c for n, c in step.items() if n.startswith("tower_")} for step in steps]
        steady = {
            "tower_input_ids": 1,
            "tower_dense": 1,
            "tower_dense_grad": 1,
            "tower_outputs": 1,
            "tower_outputs_grad": 1,
        }
        assert peer[0] == {**steady, "tower_input_overflow": 1}, (rank, peer[0])
        assert peer[1] == peer[2] == steady, (rank, peer)
        # the host lookup's collectives are the same every step: its ids in one message
        # too (sized_exchange.py; the first step's payloads follow in a second one)
        assert steps[1] == steps[2], (rank, steps)
        host = [{n: c for n, c in step.items() if not n.startswith("tower_")} for step in steps]
        assert host[0]["input_overflow"] == 1 and host[1]["input_ids"] == 1, (rank, host)
        assert "input_overflow" not in host[1] and "input_counts" not in host[1], (rank, host)
