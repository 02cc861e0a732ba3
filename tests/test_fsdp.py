"""``distributed.dense = "fsdp"`` against DDP on 2 gloo ranks, with sharded embeddings.

Golden: the same model, batches and default dense optimizer (Adam) under DDP and
under FSDP2 end with the same dense weights and embedding tables after several
steps, for DLRM, Wukong, DCN and DMT (flat on one host; the tower transform on two).
Tolerance: FSDP reduce-scatters the gradients where DDP all-reduces them, so the
average over ranks is formed in another order (and divided before or after the
sum); that is an fp32 rounding of the gradients (relative ~1e-7), which Adam's
normalised steps of lr = 2e-3 carry into the weights as a few 1e-8 per step
(measured after 5 steps: at most 1.5e-8 on DLRM's and Wukong's dense weights,
4.5e-8 on their tables). ``TOL = 1e-6`` leaves a margin of 20 over that and
nothing else: one misplaced gradient scale (a sum instead of a mean) moves the
weights by ~lr, 2e-3.

DCP: a checkpoint saved under FSDP resumes under DDP and the reverse, and the
resumed runs continue as the uninterrupted ones (to TOL); one process loads an
FSDP checkpoint into the unsharded model (the eval path).
"""

import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import run_cli
from dist_cases import gather_tables, local_slice, make_batch, plan_mixed
from test_parallelize import FEATURES, NUM_DENSE, ROWS, TABLES
from torch.distributed.device_mesh import init_device_mesh

from towerrec.build.optimizers import build_dense_optimizer
from towerrec.config import OptimizerConfig, load_config
from towerrec.distributed.fsdp import (
    apply_fsdp,
    check_shardable,
    dense_memory,
    dense_units,
    is_sharded,
)
from towerrec.distributed.launch import spawn_world
from towerrec.distributed.parallelize import parallelize
from towerrec.distributed.towers import parallelize_towers
from towerrec.models.dcn import DCN, DCNConfig
from towerrec.models.dlrm import DLRM
from towerrec.models.dmt import DMT
from towerrec.models.wukong import Wukong, WukongConfig
from towerrec.modules.embedding_bag import EmbeddingBagCollection, dense_parameters
from towerrec.optim.sparse import EmbeddingOptimizerConfig
from towerrec.train.checkpoint import CheckpointManager
from towerrec.workflows import training as trainer

TOL = 1e-6
BATCH, STEPS = 8, 5
PARTITION = [["t0", "f1a", "f1b", "t2"], ["t3", "t4", "t5"]]


def _build(name: str, seed: int = 0):
    ebc = EmbeddingBagCollection(
        TABLES, EmbeddingOptimizerConfig(lr=0.1), backend="torch", seed=seed
    )
    torch.manual_seed(seed)
    if name == "wukong":
        config = WukongConfig(num_layers=2, num_fm=4, num_lcb=4, fm_rank=4, fm_mlp=(16,))
        return Wukong(ebc, NUM_DENSE, [8, 8], [16, 1], config)
    if name == "dcn":  # parallel: cross network, deep MLP and a linear head beside them
        return DCN(ebc, NUM_DENSE, [8, 8], [16, 1], DCNConfig(num_layers=2, structure="parallel"))
    if name == "dmt":
        return DMT(
            ebc, NUM_DENSE, [8, 8], [8, 1], PARTITION, tower="dot", tower_outputs=2,
            tower_mlp=(8,),
        )  # fmt: skip
    return DLRM(ebc, NUM_DENSE, [8, 8], [8, 1])


def _parallel(name, topology, dense, seed=0, reshard=True):
    mesh = init_device_mesh("cpu", (topology.hosts, topology.ranks_per_host))
    if name == "dmt" and topology.hosts > 1:
        return parallelize_towers(_build(name, seed), mesh, dense=dense)
    plan = plan_mixed(topology, TABLES)
    return parallelize(_build(name, seed), mesh, plan, dense=dense, reshard_after_forward=reshard)


def _steps(model, optimizer, topology, steps):
    world, rank = topology.world_size, topology.rank
    lo = rank * BATCH
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        sparse = make_batch(step, BATCH * world, False, FEATURES, ROWS)
        dense = torch.randn(BATCH * world, NUM_DENSE, generator=gen)
        labels = torch.randint(0, 2, (BATCH * world,), generator=gen).float()
        logits = model(dense[lo : lo + BATCH], local_slice(sparse, rank, world))
        F.binary_cross_entropy_with_logits(logits, labels[lo : lo + BATCH]).backward()
        optimizer.step()
        optimizer.zero_grad()


def _full(tensor):
    return tensor.full_tensor() if is_sharded(tensor) else tensor


def _weights(model, whole_tables=False):
    """Every dense weight (whole), and this rank's embedding shards (or, ``whole_tables``,
    every table gathered from its shards)."""
    dense = {n: _full(p.detach()).clone() for n, p in dense_parameters(model)}
    if whole_tables:
        return dense, gather_tables(model.sparse)[0]
    shards = {
        f"{v.table}{v.shard.rows}{v.shard.cols}": v.weight.clone()
        for v in model.sparse.shard_views()
    }
    return dense, shards


def _max_diff(a, b):
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _golden(topology, name, optimizer_name="adam", reshard=True):
    models = {dense: _parallel(name, topology, dense, reshard=reshard) for dense in ("ddp", "fsdp")}
    result = {}
    for dense, model in models.items():
        optimizer = build_dense_optimizer(OptimizerConfig(name=optimizer_name), model)
        _steps(model, optimizer, topology, range(STEPS))
        result[dense] = _weights(model)
        memory = dense_memory(model, optimizer)
        result[dense + "_state_bytes"] = memory.optimizer_state
    fsdp = models["fsdp"]
    params = [p for _, p in dense_parameters(fsdp)]
    result["sharded"] = sum(is_sharded(p) for p in params), len(params)
    # Shard(0) gives the first rank ceil(rows / world): at most one row more per
    # parameter than an even split, in each of Adam's two moments.
    result["row_bytes"] = sum(2 * p.numel() // max(p.shape[0], 1) * 4 for p in params)
    result["embedding_sharded"] = any(is_sharded(p) for p in fsdp.sparse.parameters())
    result["same_keys"] = sorted(fsdp.state_dict()) == sorted(models["ddp"].state_dict())
    dist.barrier()
    return result


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "name, hosts", [("dlrm", 1), ("wukong", 1), ("dcn", 1), ("dmt", 1), ("dmt", 2)]
)
def test_fsdp_trains_the_weights_ddp_trains(name, hosts):
    for result in spawn_world(_golden, 2, hosts, name):
        sharded, total = result["sharded"]
        # Every dense parameter is a shard; the tower transform on 2 hosts of 1 rank
        # keeps each host's tower whole (no data parallelism inside a host of one rank).
        assert sharded == total if hosts == 1 else 0 < sharded < total
        assert not result["embedding_sharded"] and result["same_keys"]
        (ddp_dense, ddp_tables), (fsdp_dense, fsdp_tables) = result["ddp"], result["fsdp"]
        assert _max_diff(ddp_dense, fsdp_dense) < TOL
        assert _max_diff(ddp_tables, fsdp_tables) < TOL
        if hosts == 1:  # Adam's two moments, a piece of each per rank
            half = result["ddp_state_bytes"] / 2
            assert result["fsdp_state_bytes"] <= half + result["row_bytes"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("optimizer", ["adagrad", "sgd"])
def test_adagrad_and_sgd_step_on_the_shards_as_under_ddp(optimizer):
    for result in spawn_world(_golden, 2, 1, "dlrm", optimizer):
        sharded, total = result["sharded"]
        assert sharded == total
        assert _max_diff(result["ddp"][0], result["fsdp"][0]) < TOL
        assert _max_diff(result["ddp"][1], result["fsdp"][1]) < TOL


@pytest.mark.multiprocess
def test_keeping_the_gathered_weights_until_backward_trains_the_same():
    for result in spawn_world(_golden, 2, 1, "wukong", "adam", False):
        assert _max_diff(result["ddp"][0], result["fsdp"][0]) < TOL
        assert _max_diff(result["ddp"][1], result["fsdp"][1]) < TOL


def _across(topology, directory):
    """Train 3 steps under each layout and save; load each checkpoint under the other
    layout (other seeds), then train 2 more steps on all four."""
    runs = {}
    for dense in ("ddp", "fsdp"):
        model = _parallel("wukong", topology, dense)
        optimizer = build_dense_optimizer(OptimizerConfig(), model)
        _steps(model, optimizer, topology, range(3))
        CheckpointManager(f"{directory}/{dense}").save(3, model, optimizer, {"step": 3})
        runs[dense] = (model, optimizer)
    saved_fsdp = _weights(runs["fsdp"][0], whole_tables=True)
    for saved, dense in (("fsdp", "ddp"), ("ddp", "fsdp")):
        model = _parallel("wukong", topology, dense, seed=7)
        optimizer = build_dense_optimizer(OptimizerConfig(), model)
        manager = CheckpointManager(f"{directory}/{saved}")
        assert manager.load(manager.latest(), model, optimizer, {"step": 0}) == {"step": 3}
        runs[f"{saved}->{dense}"] = (model, optimizer)
    weights = {}
    for key, (model, optimizer) in runs.items():
        _steps(model, optimizer, topology, range(3, 5))
        weights[key] = _weights(model)
    dist.barrier()
    return weights, saved_fsdp


@pytest.mark.multiprocess
def test_dcp_checkpoints_resume_across_ddp_and_fsdp(tmp_path):
    weights, saved_fsdp = spawn_world(_across, 2, 1, str(tmp_path))[0]
    for saved, dense in (("fsdp", "ddp"), ("ddp", "fsdp")):
        resumed, uninterrupted = weights[f"{saved}->{dense}"], weights[saved]
        # Same layout as the uninterrupted run up to the checkpoint, then the other one:
        # the optimizer state came through (a fresh Adam would differ by ~lr).
        assert _max_diff(resumed[0], uninterrupted[0]) < TOL
        assert _max_diff(resumed[1], uninterrupted[1]) < TOL
    # One process, unsharded (the eval path), loads the FSDP checkpoint.
    single = _build("wukong", seed=5)
    optimizer = build_dense_optimizer(OptimizerConfig(), single)
    manager = CheckpointManager(tmp_path / "fsdp")
    manager.load(manager.latest(), single, optimizer, {"step": 0})
    params = {n: p.detach() for n, p in dense_parameters(single)}
    assert all(torch.equal(params[n], w) for n, w in saved_fsdp[0].items())
    tables = single.sparse.table_weights()
    assert all(torch.equal(tables[n], w) for n, w in saved_fsdp[1].items())


# ------------------------------------------------------------------ pure logic, errors
def test_units_are_the_dense_layers_and_leave_the_tables_out():
    wukong = _build("wukong")
    units = dense_units(wukong)
    assert units == [wukong.bottom, *wukong.layers, wukong.top]
    dmt = _build("dmt")
    assert dense_units(dmt) == [dmt.bottom, *dmt.towers, dmt.top]
    dcn = _build("dcn")
    assert dense_units(dcn) == [dcn.bottom, dcn.cross, dcn.deep, dcn.head]
    assert all(u is not dmt.sparse for u in dense_units(dmt))


def test_a_model_without_dense_parameters_cannot_be_fully_sharded():
    ebc = EmbeddingBagCollection(TABLES, EmbeddingOptimizerConfig(), backend="torch")
    holder = torch.nn.Module()
    holder.sparse = ebc
    with pytest.raises(ValueError, match=r"has none .* use distributed.dense = 'ddp'"):
        check_shardable(holder)
    with pytest.raises(ValueError, match="has none"):
        apply_fsdp(holder, None)  # refused before any mesh is needed


def _shampoo_on_shards(topology):
    model = _parallel("dlrm", topology, "fsdp")
    try:
        build_dense_optimizer(OptimizerConfig(name="shampoo"), model)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.multiprocess
def test_shampoo_on_fsdp_shards_is_a_clear_error():
    for message in spawn_world(_shampoo_on_shards, 2, 1):
        assert message is not None and "distributed.dense = 'ddp' with Shampoo" in message


# ------------------------------------------------------------------ through the CLI
def _sets(overrides):
    return [x for s in overrides for x in ("--set", s)]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_movielens_under_fsdp_resumes_under_ddp_and_follows_one_process(tmp_path):
    """MovieLens on 2 ranks: 3 steps under fsdp, resumed under ddp to 6 steps; the
    result is the one-process run's (the LR schedule does not depend on train.steps)."""
    overrides = [
        "optimizer.decay=none",
        "optimizer.warmup_steps=1",
        "train.progress=false",
        "train.eval_every=0",
        "train.eval_batch_size=4096",
    ]
    out = str(tmp_path / "two")
    first = run_cli(
        "train", "--config", "configs/movielens.toml", "--nproc", "2", "--out", out,
        *_sets([*overrides, "train.steps=3", "distributed.dense=fsdp"]), OMP_NUM_THREADS="1",
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_cli(
        "train", "--config", "configs/movielens.toml", "--nproc", "2", "--out", out, "--resume",
        *_sets([*overrides, "train.steps=6", "distributed.dense=ddp"]), OMP_NUM_THREADS="1",
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    one = trainer.train(
        load_config("configs/movielens.toml", [*overrides, "train.steps=6"]), tmp_path / "one"
    )
    assert two["completed"] and one["completed"]
    assert abs(two["auc"] - one["auc"]) < 1e-3
    assert abs(two["logloss"] - one["logloss"]) < 1e-3


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_criteo_format_cache_with_wukong_under_fsdp_follows_one_process(tmp_path):
    from towerrec.data.criteo import CriteoOptions, preprocess_criteo
    from towerrec.data.criteo_gen import generate_criteo_files

    days = generate_criteo_files(tmp_path / "raw", files=2, rows_per_file=801, seed=3)
    cache = tmp_path / "cache"
    options = CriteoOptions(num_embeddings=(500,), eval_files=("day_1",))
    preprocess_criteo(days, cache, options, progress=False)
    overrides = [
        "data.source=criteo",
        f"data.path={cache}",
        "model.name=wukong",
        "model.embedding_dim=8",
        "model.bottom_mlp=[16, 8]",
        "model.top_mlp=[16, 1]",
        "model.wukong.fm_mlp=[16]",
        "optimizer.warmup_steps=2",
        "train.batch_size=128",
        "train.steps=6",
        "train.progress=false",
    ]
    result = run_cli(
        "train", "--nproc", "2", "--out", str(tmp_path / "two"),
        *_sets([*overrides, "distributed.dense=fsdp"]), OMP_NUM_THREADS="1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    one = trainer.train(load_config(None, overrides), tmp_path / "one")
    assert two["eval_samples"] == one["eval_samples"] == 801  # uneven over 2 ranks
    assert abs(two["auc"] - one["auc"]) < 1e-3
    assert abs(two["logloss"] - one["logloss"]) < 1e-3


def test_fsdp_in_one_process_is_a_warning(tmp_path, caplog):
    overrides = ["distributed.dense=fsdp", "train.steps=2", "train.progress=false"]
    overrides += ["data.synthetic.eval_samples=256", "train.eval_batch_size=256"]
    with caplog.at_level("WARNING", logger="towerrec"):
        summary = trainer.train(load_config(None, overrides), tmp_path)
    assert summary["completed"]
    assert "one process keeps them whole" in caplog.text


def test_distributed_dense_names_its_choices():
    with pytest.raises(
        ValueError, match=r"distributed\.dense = 'zero3' is not one of 'ddp', 'fsdp'"
    ):
        load_config(None, ["distributed.dense=zero3"])
