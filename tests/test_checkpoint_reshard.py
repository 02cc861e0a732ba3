"""A checkpoint saved under one plan and world size loads under another.

4 ranks on 2 hosts, every table table-wise, train 3 steps and save; then 2
ranks with a mixed plan (every sharding type), and one process unsharded, load
it: the model's outputs, the embedding weights and their optimizer state are
those that were saved. And a run with column-split tables (row-wise Adagrad, partial
row-wise Adam) saved and resumed on 2 ranks ends exactly where the uninterrupted run
does.
"""

import pytest
import torch
import torch.nn.functional as F
from dist_cases import gather_tables, local_slice, make_batch, plan_mixed
from test_parallelize import FEATURES, NUM_DENSE, ROWS, TABLES, build
from torch.distributed.device_mesh import init_device_mesh

from towerrec.distributed.launch import spawn_world
from towerrec.distributed.parallelize import parallelize, uniform_plan
from towerrec.models.dlrm import DLRM
from towerrec.modules.embedding_bag import EmbeddingBagCollection, dense_parameters
from towerrec.optim.sparse import EmbeddingOptimizerConfig
from towerrec.train.checkpoint import CheckpointManager, embedding_optimizer_state_dict

EVAL = 8  # samples per rank of the 4-rank world (32 in all)


def _eval_batch():
    gen = torch.Generator().manual_seed(99)
    return torch.randn(4 * EVAL, NUM_DENSE, generator=gen), make_batch(
        99, 4 * EVAL, False, FEATURES, ROWS
    )


def _logits(model, topology):
    dense, sparse = _eval_batch()
    per_rank = dense.shape[0] // topology.world_size
    lo = topology.rank * per_rank
    with torch.no_grad():
        logits = model(
            dense[lo : lo + per_rank], local_slice(sparse, topology.rank, topology.world_size)
        )
    return logits


def _train_steps(model, optimizer, topology, steps):
    """Adam steps on a global batch of 16 samples per step, sliced over the ranks."""
    per_rank = 16 // topology.world_size
    lo = topology.rank * per_rank
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        sparse = make_batch(step, 16, False, FEATURES, ROWS)
        dense = torch.randn(16, NUM_DENSE, generator=gen)
        labels = torch.randint(0, 2, (16,), generator=gen).float()
        logits = model(
            dense[lo : lo + per_rank], local_slice(sparse, topology.rank, topology.world_size)
        )
        F.binary_cross_entropy_with_logits(logits, labels[lo : lo + per_rank]).backward()
        optimizer.step()
        optimizer.zero_grad()


def _save(topology, directory):
    mesh = init_device_mesh("cpu", (topology.hosts, topology.ranks_per_host))
    model = build(seed=1)
    model = parallelize(model, mesh, uniform_plan(TABLES, topology, "table_wise"))
    optimizer = torch.optim.Adam([p for _, p in dense_parameters(model)], lr=0.01)
    _train_steps(model, optimizer, topology, range(3))
    CheckpointManager(directory).save(3, model, optimizer, {"step": 3})
    weights, states = gather_tables(model.sparse)
    return _logits(model, topology), weights, states


def _load(topology, directory):
    mesh = init_device_mesh("cpu", (topology.hosts, topology.ranks_per_host))
    model = parallelize(build(seed=2), mesh, plan_mixed(topology, TABLES))
    optimizer = torch.optim.Adam([p for _, p in dense_parameters(model)], lr=0.01)
    manager = CheckpointManager(directory)
    train = manager.load(manager.latest(), model, optimizer, {"step": 0})
    weights, states = gather_tables(model.sparse)
    return _logits(model, topology), weights, states, train["step"]


@pytest.mark.multiprocess
def test_save_on_4_ranks_table_wise_load_on_2_ranks_mixed_and_unsharded(tmp_path):
    saved = spawn_world(_save, 4, 2, tmp_path)
    expected = torch.cat([s[0] for s in saved])
    loaded = spawn_world(_load, 2, 1, tmp_path)
    assert loaded[0][3] == 3
    got = torch.cat([r[0] for r in loaded])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    for key, w in saved[0][1].items():
        assert torch.equal(loaded[0][1][key], w), key
    for key, s in saved[0][2].items():
        assert torch.equal(loaded[0][2][key], s), key

    # and into the plain single-process model
    model = build(seed=3)
    optimizer = torch.optim.Adam([p for _, p in dense_parameters(model)], lr=0.01)
    manager = CheckpointManager(tmp_path)
    manager.load(manager.latest(), model, optimizer, {"step": 0})
    dense, sparse = _eval_batch()
    with torch.no_grad():
        torch.testing.assert_close(model(dense, sparse), expected, rtol=0, atol=1e-6)
    for name, w in model.sparse.table_weights().items():
        assert torch.equal(w, saved[0][1][name]), name
    for key, s in embedding_optimizer_state_dict(model).items():
        assert torch.equal(s, saved[0][2][key.removeprefix("sparse.")]), key


def _load_and_train(topology, directory):
    """Load the 4-rank table-wise checkpoint under the mixed plan and train on."""
    mesh = init_device_mesh("cpu", (topology.hosts, topology.ranks_per_host))
    model = parallelize(build(seed=2), mesh, plan_mixed(topology, TABLES))
    optimizer = torch.optim.Adam([p for _, p in dense_parameters(model)], lr=0.01)
    manager = CheckpointManager(directory)
    manager.load(manager.latest(), model, optimizer, {"step": 0})
    _train_steps(model, optimizer, topology, range(3, 6))
    weights, states = gather_tables(model.sparse)
    dense = {n: p.detach().clone() for n, p in dense_parameters(model)}
    return weights, states, dense


@pytest.mark.multiprocess
def test_resharded_load_then_training_equals_an_uninterrupted_run(tmp_path):
    """3 steps on 4 ranks (table-wise), saved; loaded on 2 ranks under every sharding type
    and trained 3 steps more: the weights and optimizer state of an uninterrupted
    single-process run of 6 steps."""
    spawn_world(_save, 4, 2, tmp_path)
    weights, states, dense = spawn_world(_load_and_train, 2, 1, tmp_path)[0]

    reference = build(seed=1)
    optimizer = torch.optim.Adam([p for _, p in dense_parameters(reference)], lr=0.01)
    _train_steps(reference, optimizer, _OneProcess(), range(6))
    for name, w in reference.sparse.table_weights().items():
        torch.testing.assert_close(weights[name], w, rtol=0, atol=1e-5, msg=name)
    for key, s in embedding_optimizer_state_dict(reference).items():
        torch.testing.assert_close(states[key.removeprefix("sparse.")], s, rtol=0, atol=1e-5)
    for name, p in dense_parameters(reference):
        torch.testing.assert_close(dense[name], p.detach(), rtol=0, atol=1e-5, msg=name)


class _OneProcess:
    world_size, rank = 1, 0


def _build(seed, optimizer):
    if optimizer == "rowwise_adagrad":
        return build(seed=seed)
    ebc = EmbeddingBagCollection(
        TABLES, EmbeddingOptimizerConfig(kind=optimizer, lr=0.05), backend="torch", seed=seed
    )
    torch.manual_seed(seed)
    return DLRM(ebc, NUM_DENSE, [8, 8], [8, 1])


def _resume_column_split(topology, directory, kind):
    """Weights after 6 steps uninterrupted, and after 3, save, load into a fresh model, 3."""
    mesh = init_device_mesh("cpu", (topology.hosts, topology.ranks_per_host))
    plan = plan_mixed(topology, TABLES)  # t2 column-wise, t4 table-column-wise
    finals = []
    for resume in (False, True):
        model = parallelize(_build(1, kind), mesh, plan)
        optimizer = torch.optim.Adam([p for _, p in dense_parameters(model)], lr=0.01)
        _train_steps(model, optimizer, topology, range(3))
        if resume:
            CheckpointManager(directory).save(3, model, optimizer, {"step": 3})
            model = parallelize(_build(2, kind), mesh, plan)
            optimizer = torch.optim.Adam([p for _, p in dense_parameters(model)], lr=0.01)
            manager = CheckpointManager(directory)
            manager.load(manager.latest(), model, optimizer, {"step": 0})
        _train_steps(model, optimizer, topology, range(3, 6))
        dense = {n: p.detach().clone() for n, p in dense_parameters(model)}
        finals.append((*gather_tables(model.sparse), dense))
    return finals


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["rowwise_adagrad", "partial_rowwise_adam"])
def test_column_split_rowwise_optimizers_resume_exactly(tmp_path, kind):
    finals = spawn_world(_resume_column_split, 2, 1, tmp_path, kind)
    for rank, (uninterrupted, resumed) in enumerate(finals):
        for expected, got in zip(uninterrupted, resumed):
            for key, value in expected.items():
                assert torch.equal(got[key], value), (rank, key)
    # and the sharded run is the unsharded one's
    weights, states, _ = finals[0][0]
    reference = _build(1, kind)
    optimizer = torch.optim.Adam([p for _, p in dense_parameters(reference)], lr=0.01)
    _train_steps(reference, optimizer, _OneProcess(), range(6))
    for name, w in reference.sparse.table_weights().items():
        torch.testing.assert_close(weights[name], w, rtol=0, atol=1e-5, msg=name)
    for key, s in embedding_optimizer_state_dict(reference).items():
        torch.testing.assert_close(states[key.removeprefix("sparse.")], s, rtol=0, atol=1e-5)
