"""What the tower transform puts on the wire (4 gloo processes as 2 hosts x 2 ranks): the
float codecs apply to the tower outputs and their gradients, and deduplicated ids change
no bit of the result."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_cases import make_batch
from test_sptt import FEATURES, NUM_DENSE, PARTITION, ROWS, TABLES, _collection, _slice
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


def _one_step(topology, codecs, wire):
    """Logits of two steps and the cross-host bytes of each collective."""
    mesh = init_device_mesh("cpu", (topology.hosts, topology.ranks_per_host))
    stats = CommStats()
    model = parallelize_towers(_dmt(), mesh, codecs=codecs, stats=stats, id_wire=wire)
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
    return torch.stack(logits), dict(stats.cross)


def _wire_cases(topology):
    fp16 = Codec.FP16
    return {
        "fp32": _one_step(topology, CommCodecs(), IdWire(False)),
        "fp16": _one_step(topology, CommCodecs(fp16, fp16), IdWire(False)),
        "dedup": _one_step(topology, CommCodecs(), IdWire(True, where_smaller=False)),
    }


@pytest.mark.multiprocess
def test_tower_outputs_use_the_codecs_and_dedup_is_exact():
    for rank, cases in enumerate(spawn_world(_wire_cases, 4, 2)):
        logits32, bytes32 = cases["fp32"]
        logits16, bytes16 = cases["fp16"]
        for name in ("tower_outputs", "tower_outputs_grad"):
            assert bytes32[name] > 0 and bytes16[name] * 2 == bytes32[name], (rank, name)
        assert bytes16["tower_input_ids"] == bytes32["tower_input_ids"], rank
        assert 0 < float((logits16 - logits32).abs().max()) < 1e-2, rank
        logits_dedup, bytes_dedup = cases["dedup"]
        assert torch.equal(logits_dedup, logits32), rank  # deduplicated ids: same bits
        assert bytes_dedup["tower_input_ids"] != bytes32["tower_input_ids"], rank
