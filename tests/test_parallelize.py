"""parallelize(DLRM) on 2 and 4 gloo ranks equals DLRM on the global batch: logits,
gradients of the dense inputs, and every weight after 5 Adam steps (embeddings:
row-wise Adagrad under a plan of every sharding type)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_cases import gather_tables, local_slice, make_batch, plan_mixed
from torch.distributed.device_mesh import init_device_mesh

from towerrec.data.batch import Batch
from towerrec.distributed.comm import Codec, CommCodecs
from towerrec.distributed.launch import spawn_world
from towerrec.distributed.parallelize import comm_stats, parallelize, uniform_plan
from towerrec.models.dlrm import DLRM
from towerrec.modules.embedding_bag import EmbeddingBagCollection, dense_parameters
from towerrec.modules.tables import TableConfig
from towerrec.optim.sparse import EmbeddingOptimizerConfig
from towerrec.train.pipeline import pipelined
from towerrec.train.trainer import train_step

TABLES = [
    TableConfig("t0", 40, 8),
    TableConfig("t1", 30, 8, feature_names=("f1a", "f1b"), pooling="mean"),
    TableConfig("t2", 50, 8),
    TableConfig("t3", 23, 8),
    TableConfig("t4", 37, 8, pooling="mean"),
    TableConfig("t5", 12, 8),
]
FEATURES = [f for t in TABLES for f in t.feature_names]
ROWS = {f: t.num_embeddings for t in TABLES for f in t.feature_names}
BATCH, STEPS, NUM_DENSE = 8, 5, 3


def build(seed=0):
    # The default optimizer, row-wise Adagrad: the mixed plan splits tables by columns.
    ebc = EmbeddingBagCollection(
        TABLES, EmbeddingOptimizerConfig(lr=0.1), backend="torch", seed=seed
    )
    torch.manual_seed(seed)
    return DLRM(ebc, NUM_DENSE, [8, 8], [8, 1])


def _compare(topology):
    world, rank = topology.world_size, topology.rank
    reference = build()
    model = build()
    mesh = init_device_mesh("cpu", (topology.hosts, topology.ranks_per_host))
    model = parallelize(model, mesh, plan_mixed(topology, TABLES))
    opt_ref = torch.optim.Adam([p for _, p in dense_parameters(reference)], lr=0.01)
    opt = torch.optim.Adam([p for _, p in dense_parameters(model)], lr=0.01)
    diffs = {"logits": 0.0, "dense_grad": 0.0}
    lo = rank * BATCH
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        sparse = make_batch(step, BATCH * world, False, FEATURES, ROWS)
        dense = torch.randn(BATCH * world, NUM_DENSE, generator=gen)
        labels = torch.randint(0, 2, (BATCH * world,), generator=gen).float()
        x_ref = dense.clone().requires_grad_(True)
        logits_ref = reference(x_ref, sparse)
        F.binary_cross_entropy_with_logits(logits_ref, labels).backward()
        opt_ref.step()
        opt_ref.zero_grad()
        x = dense[lo : lo + BATCH].clone().requires_grad_(True)
        logits = model(x, local_slice(sparse, rank, world))
        F.binary_cross_entropy_with_logits(logits, labels[lo : lo + BATCH]).backward()
        opt.step()
        opt.zero_grad()
        diffs["logits"] = max(
            diffs["logits"],
            float((logits.detach() - logits_ref.detach()[lo : lo + BATCH]).abs().max()),
        )
        # the local loss averages B samples, the reference W*B
        grad_diff = (x.grad / world - x_ref.grad[lo : lo + BATCH]).abs().max()
        diffs["dense_grad"] = max(diffs["dense_grad"], float(grad_diff))
    ref_params = dict(dense_parameters(reference))
    diffs["dense_weights"] = max(
        float((p.detach() - ref_params[n].detach()).abs().max()) for n, p in dense_parameters(model)
    )
    weights, _ = gather_tables(model.sparse)
    diffs["embeddings"] = max(
        float((weights[n] - w).abs().max()) for n, w in reference.sparse.table_weights().items()
    )
    stats = comm_stats(model)
    diffs["intra_bytes"] = stats.intra_bytes
    diffs["cross_bytes"] = stats.cross_bytes
    diffs["same_state_keys"] = sorted(model.state_dict()) == sorted(reference.state_dict())
    dist.barrier()
    return diffs


def _train(model, topology, steps, pipeline):
    """``steps`` Adam steps through the trainer's own step (and pipeline, if asked)."""
    world, rank = topology.world_size, topology.rank
    optimizer = torch.optim.Adam([p for _, p in dense_parameters(model)], lr=0.01)

    def batches():
        for step in range(steps):
            gen = torch.Generator().manual_seed(step)
            sparse = make_batch(step, BATCH * world, False, FEATURES, ROWS)
            dense = torch.randn(BATCH * world, NUM_DENSE, generator=gen)
            labels = torch.randint(0, 2, (BATCH * world,), generator=gen).float()
            lo = rank * BATCH
            yield Batch(
                dense[lo : lo + BATCH], local_slice(sparse, rank, world), labels[lo : lo + BATCH]
            )

    stream = pipelined(model, batches()) if pipeline else batches()
    for batch in stream:
        train_step(model, optimizer, batch)
    assert not model.sparse._prefetched, "a prefetched input_dist was never used"
    weights, states = gather_tables(model.sparse)
    dense = {n: p.detach().clone() for n, p in dense_parameters(model)}
    return weights, states, dense


def _pipeline_and_codecs(topology):
    """Pipelined and plain loops end with identical weights; fp16/bf16 codecs stay
    within their error bound of the fp32 outputs."""
    mesh = init_device_mesh("cpu", (topology.hosts, topology.ranks_per_host))
    plan = plan_mixed(topology, TABLES)
    plain = _train(parallelize(build(), mesh, plan), topology, 4, pipeline=False)
    piped = _train(parallelize(build(), mesh, plan), topology, 4, pipeline=True)
    identical = all(torch.equal(a[k], b[k]) for a, b in zip(plain, piped) for k in a)
    # codecs: table-wise, so each output element is one value through the codec
    sparse = local_slice(
        make_batch(42, BATCH * topology.world_size, False, FEATURES, ROWS),
        topology.rank,
        topology.world_size,
    )
    reference = parallelize(build(), mesh, uniform_plan(TABLES, topology, "table_wise"))
    expected = reference.sparse(sparse).values().detach()
    within = {}
    for codec in ("fp16", "bf16"):
        model = parallelize(
            build(),
            mesh,
            uniform_plan(TABLES, topology, "table_wise"),
            codecs=CommCodecs(forward=codec),
        )
        got = model.sparse(sparse).values().detach()
        err = (got - expected).abs()
        within[codec] = bool((err <= Codec(codec).relative_error * expected.abs() + 1e-30).all())
        within[codec + "_lossy"] = float(err.max()) > 0
    return identical, within


def _all_checks(topology):
    extra = _pipeline_and_codecs(topology) if topology.world_size == 2 else None
    return _compare(topology), extra


@pytest.mark.multiprocess
@pytest.mark.parametrize("world,hosts", [(2, 1), (4, 2)])
def test_parallel_dlrm_matches_single_process(world, hosts):
    """Also (2 ranks): pipelined and plain loops agree, codecs keep their error bound."""
    for rank, (d, extra) in enumerate(spawn_world(_all_checks, world, hosts)):
        assert (extra is not None) == (world == 2)
        if extra is not None:
            identical, within = extra
            assert identical, rank
            assert all(within.values()), (rank, within)
        assert d["logits"] < 1e-5, (rank, d)
        assert d["dense_grad"] < 1e-6, (rank, d)
        assert d["dense_weights"] < 1e-5, (rank, d)
        assert d["embeddings"] < 1e-5, (rank, d)
        assert d["same_state_keys"], rank
        assert d["intra_bytes"] > 0
        assert (d["cross_bytes"] > 0) == (hosts > 1), (rank, d)
