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
from towerrec.distributed.comm import Codec, CommCodecs, CommStats
from towerrec.distributed.launch import spawn_world
from towerrec.distributed.parallelize import comm_stats, parallelize, uniform_plan
from towerrec.models.dlrm import DLRM
from towerrec.modules.embedding_bag import EmbeddingBagCollection, dense_parameters
from towerrec.modules.tables import TableConfig
from towerrec.optim.sparse import EmbeddingOptimizerConfig
from towerrec.train.pipeline import pipelined
from towerrec.train.step import train_step

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
    dense_stats = CommStats()
    model = parallelize(model, mesh, plan_mixed(topology, TABLES), dense_stats=dense_stats)
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
    diffs["dense_bytes"] = dense_stats.snapshot()
    diffs["dense_gradient_bytes"] = sum(p.numel() * 4 for _, p in dense_parameters(model))
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
    stats = comm_stats(model)
    step_bytes = []  # as the trainer counts them: around each train step
    for batch in stream:
        before = stats.snapshot()
        train_step(model, optimizer, batch)
        step_bytes.append([a - b for a, b in zip(stats.snapshot(), before)])
    assert not model.sparse._prefetched, "a prefetched input_dist was never used"
    weights, states = gather_tables(model.sparse)
    dense = {n: p.detach().clone() for n, p in dense_parameters(model)}
    return weights, states, dense, {"step_bytes": torch.tensor(step_bytes)}


def _pipeline_and_codecs(topology):
    """Pipelined and plain loops end with identical weights; fp16/bf16 codecs stay
    within their error bound of the fp32 outputs.

    The codecs run on table-row-wise tables, so on 2 hosts every output goes through
    the hierarchical path (partial sums reduced inside the host, then sent across):
    each partial sum is rounded once and their sum once more, so an element's error is
    at most ``2 * r * (|out| + A)`` where ``A`` is its pooled sum of absolute embedding
    values (a bound on the partials' absolute sum), computed here on the unsharded
    tables."""
    mesh = init_device_mesh("cpu", (topology.hosts, topology.ranks_per_host))
    plan = plan_mixed(topology, TABLES)
    plain = _train(parallelize(build(), mesh, plan), topology, 4, pipeline=False)
    piped = _train(parallelize(build(), mesh, plan), topology, 4, pipeline=True)
    # Weights, state and each step's bytes (a prefetch counts in the step that trains it).
    identical = all(torch.equal(a[k], b[k]) for a, b in zip(plain, piped) for k in a)
    identical &= bool(plain[3]["step_bytes"].sum() > 0)
    sparse = local_slice(
        make_batch(42, BATCH * topology.world_size, False, FEATURES, ROWS),
        topology.rank,
        topology.world_size,
    )
    codec_plan = uniform_plan(TABLES, topology, "table_row_wise")
    reference = parallelize(build(), mesh, codec_plan)
    expected = reference.sparse(sparse).to_dict()
    absolute = build().sparse
    with torch.no_grad():
        for weight in absolute.table_weights().values():
            weight.abs_()
        pooled_abs = absolute(sparse).to_dict()
    within = {}
    for codec in ("fp16", "bf16"):
        model = parallelize(build(), mesh, codec_plan, codecs=CommCodecs(forward=codec))
        got = model.sparse(sparse).to_dict()
        bound_ok, lossy = True, False
        for key, want in expected.items():
            err = (got[key] - want).detach().abs()
            bound = 2 * Codec(codec).relative_error * (want.detach().abs() + pooled_abs[key])
            bound_ok &= bool((err <= bound + 1e-30).all())
            lossy |= float(err.max()) > 0
        within[codec], within[codec + "_lossy"] = bound_ok, lossy
    return identical, within


def _all_checks(topology):
    return _compare(topology), _pipeline_and_codecs(topology)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world,hosts", [(2, 1), (4, 2)])
def test_parallel_dlrm_matches_single_process(world, hosts):
    """Also: pipelined and plain loops agree, codecs keep their error bound (on 2 hosts,
    through the hierarchical table-row-wise path)."""
    for rank, (d, (identical, within)) in enumerate(spawn_world(_all_checks, world, hosts)):
        assert identical, rank
        assert all(within.values()), (rank, within)
        assert d["logits"] < 1e-5, (rank, d)
        assert d["dense_grad"] < 1e-6, (rank, d)
        assert d["dense_weights"] < 1e-5, (rank, d)
        assert d["embeddings"] < 1e-5, (rank, d)
        assert d["same_state_keys"], rank
        assert d["intra_bytes"] > 0
        assert (d["cross_bytes"] > 0) == (hosts > 1), (rank, d)
        # Ring all-reduce: each step, 2 (n-1)/n of the gradients to the next rank, which
        # is on the other host for the last rank of each host (1 -> 2 and 3 -> 0).
        expected = STEPS * 2 * (world - 1) * d["dense_gradient_bytes"] / world
        intra, cross = d["dense_bytes"]
        crosses = hosts > 1 and (rank + 1) % (world // hosts) == 0
        assert (intra, cross)[1 - crosses] == 0, (rank, d)
        assert abs((intra, cross)[crosses] - expected) <= STEPS * 4, (rank, d, expected)
