"""The NeuroShard planner: pre-training, weights files, and its search."""

import json

import numpy as np
import pytest
import torch
from test_learned_cost import flip_tensor_byte

from towerrec.calibration.cost_data import random_dims, random_split_device
from towerrec.planner.cost import CostModel
from towerrec.planner.costdata import CommSample, ComputeSample, CostData, file_digest
from towerrec.planner.neuroshard import (
    DEFAULT_WEIGHTS,
    NeuroShardPolicy,
    load_policy,
    train_neuroshard,
)
from towerrec.planner.neuroshard_search import search_neuroshard
from towerrec.planner.search import plan_tables
from towerrec.planner.stats import TableStats
from towerrec.planner.suites import dlrm_like_suite
from towerrec.planner.topology import topology_preset

BATCH = 2048


def _fused(shards):
    """A made-up fused-kernel time: one launch per width, lookups x columns."""
    widths = {c for *_, c in shards}
    work = sum(s.lookups(BATCH) * r / s.num_embeddings * (4 + c) for s, r, c in shards)
    return 2e-4 * len(widths) + 3e-9 * work


def _synthetic_data(n=60, seed=0):
    rng = np.random.default_rng(seed)
    compute = []
    for i in range(n):
        shards = random_split_device(rng, f"d{i}", 8, 5000)
        t = _fused(shards)
        compute.append(ComputeSample(tuple(shards), 0.4 * t, 0.6 * t))
    comm = []
    for _ in range(12):
        dims = random_dims(rng, 2)
        comm.append(CommSample(2, tuple(dims), BATCH, 1e-4 + 1e-9 * 4 * BATCH * sum(dims)))
    return CostData({"cpu": "synthetic"}, "torch", BATCH, compute, comm)


@pytest.fixture(scope="module")
def policy():
    return train_neuroshard(_synthetic_data(), seed=0, steps=300)


def test_training_is_deterministic_for_a_seed():
    data = _synthetic_data(20)
    a, b = (train_neuroshard(data, seed=5, steps=30) for _ in range(2))
    other = train_neuroshard(data, seed=6, steps=30)
    for key, value in a.forward.state_dict().items():
        assert torch.equal(value, b.forward.state_dict()[key])
    for key, value in a.backward.state_dict().items():
        assert torch.equal(value, b.backward.state_dict()[key])
    assert a.comm == b.comm
    assert not torch.equal(
        a.forward.state_dict()["encoder.0.weight"], other.forward.state_dict()["encoder.0.weight"]
    )


def test_policy_learns_the_costs(policy):
    data = _synthetic_data(20, seed=9)  # unseen devices
    predicted = np.array(policy.device_seconds([list(c.shards) for c in data.compute]))
    truth = np.array([c.seconds for c in data.compute])
    assert np.median(np.abs(predicted - truth) / truth) < 0.3
    # The linear all-to-all model recovers the made-up latency and bandwidth.
    assert policy.comm.latency_s == pytest.approx(1e-4, rel=1e-3)
    assert policy.comm.s_per_byte == pytest.approx(1e-9, rel=1e-3)


def test_weights_round_trip_and_refusals(policy, tmp_path):
    path = tmp_path / "neuroshard.pt"
    policy.save(path)
    again = NeuroShardPolicy.load(path)
    devices = [list(c.shards) for c in _synthetic_data(5, seed=3).compute]
    assert again.device_seconds(devices) == pytest.approx(policy.device_seconds(devices))
    assert again.info == policy.info
    raw = torch.load(path, weights_only=True)
    torch.save({**raw, "layout": {**raw["layout"], "shard_features": 12}}, path)
    with pytest.raises(ValueError, match=r"feature layout.*train-policy --planner neuroshard"):
        NeuroShardPolicy.load(path)
    torch.save({**raw, "version": 99}, path)
    with pytest.raises(ValueError, match=r"version 99.*retrain"):
        NeuroShardPolicy.load(path)
    path.write_text("not weights")
    with pytest.raises(ValueError, match=r"cannot be read.*train-policy"):
        NeuroShardPolicy.load(path)
    with pytest.raises(FileNotFoundError, match="train-policy"):
        NeuroShardPolicy.load(tmp_path / "missing.pt")


def test_a_damaged_weights_file_is_refused(policy, tmp_path):
    path = tmp_path / "neuroshard.pt"
    policy.save(path)
    NeuroShardPolicy.load(path)  # the undamaged file loads
    flip_tensor_byte(path)
    with pytest.raises(
        ValueError, match=r"neuroshard\.pt' do not match their own weights_sha256.*train-policy"
    ):
        NeuroShardPolicy.load(path)


def test_too_little_data_is_refused():
    data = _synthetic_data(4)
    with pytest.raises(ValueError, match=r"at least 5.*collect-costs"):
        train_neuroshard(data)
    no_comm = CostData(data.machine, "torch", BATCH, _synthetic_data(6).compute, [])
    with pytest.raises(ValueError, match=r"no all-to-all samples.*collect-costs"):
        train_neuroshard(no_comm, steps=5)


def test_plans_are_valid_and_respect_memory(policy):
    """16 devices (the policy saw 2-rank all-to-alls only) with memory that binds."""
    stats = dlrm_like_suite(40, seed=2, batch_size=512)
    model = CostModel(topology_preset("gpu", 2, 8), None, 512)
    need = sum(model.shard_memory(s, s.num_embeddings, s.embedding_dim) for s in stats)
    capacity = max(
        need / 16 * 1.3,
        max(model.shard_memory(s, s.num_embeddings, s.embedding_dim) for s in stats),
    )
    model = model.with_topology(device_memory=capacity)
    result = plan_tables(stats, model, "neuroshard", policy=policy)
    assert result.planner == "neuroshard"
    assert set(result.plan.tables) == {s.name for s in stats}
    assert max(result.device_memory) <= capacity * (1 + 1e-9)
    assert len(result.device_costs) == 16


def test_beam_search_is_no_worse_than_its_greedy_start(policy):
    """One table dominates; splitting it in column shards lowers the predicted maximum."""
    hot = TableStats(
        "hot", 4000, 128, pooling_factor=40, pooling_p50=40, pooling_p99=40, pooling_max=40
    )
    small = [TableStats(f"s{i}", 1000, 8) for i in range(6)]
    model = CostModel(topology_preset("gpu", 1, 4), None, 512)
    found = search_neuroshard([hot, *small], model, policy, {}, {})
    assert found is not None
    assert found.predicted_max_s <= found.start_predicted_max_s
    assert found.column_parts.get("hot", 1) > 1
    assert found.predicted_max_s < found.start_predicted_max_s
    # The search is deterministic.
    again = search_neuroshard([hot, *small], model, policy, {}, {})
    assert again is not None and again.ranks == found.ranks


def test_train_policy_command(tmp_path, capsys):
    from towerrec.cli.app import main

    data = tmp_path / "costs.json"
    _synthetic_data(20).save(data)
    out = tmp_path / "w"
    argv = ["plan", "train-policy", "--planner", "neuroshard", "--cost-data", str(data)]
    assert main([*argv, "--out", str(out), "--seed", "1", "--steps", "20"]) == 0
    record = json.loads((out / "neuroshard.json").read_text())
    assert record["cost_data"]["sha256"] == file_digest(data)
    assert record["seed"] == 1 and record["cost_data"]["compute_samples"] == 20
    assert load_policy(out / "neuroshard.pt").batch == BATCH
    raw = json.loads(data.read_text())
    data.write_text(json.dumps({**raw, "version": 0}))
    assert main([*argv, "--out", str(out)]) == 2
    assert "collect-costs" in capsys.readouterr().err


def test_shipped_weights_load_and_name_their_data():
    policy = load_policy()
    record = json.loads(DEFAULT_WEIGHTS.with_suffix(".json").read_text())
    shipped = DEFAULT_WEIGHTS.parent / record["cost_data"]["file"]
    assert file_digest(shipped) == record["cost_data"]["sha256"]
    assert policy.batch == record["cost_data"]["batch"]
    data = CostData.load(shipped, kernel=record["cost_data"]["kernel"])
    assert len(data.compute) == record["cost_data"]["compute_samples"]


def test_plan_command_with_neuroshard(tmp_path, capsys):
    from towerrec.cli.app import main

    out = tmp_path / "plan.json"
    argv = ["plan", "--suite", "20", "--world-size", "4", "--planner", "neuroshard"]
    argv += ["--set", "plan.topology=gpu"]
    assert main([*argv, "--out", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["planner"] == "neuroshard"
    assert out.is_file()
    missing = tmp_path / "none.pt"
    assert main([*argv, "--out", str(out), "--set", f"plan.weights={missing}"]) == 2
    assert "train-policy" in capsys.readouterr().err


def test_a_policy_for_another_kernel_is_named(caplog):
    from towerrec.build.planning import plan_source
    from towerrec.config import load_config

    kernel = load_policy().info["kernel"]
    other = "torch" if kernel == "fbgemm" else "fbgemm"
    overrides = ["plan.planner=neuroshard", "plan.topology=gpu", f"embedding.backend={other}"]
    stats = dlrm_like_suite(12, seed=1)
    with caplog.at_level("WARNING", logger="towerrec"):
        result = plan_source(load_config(None, overrides), None, 4, stats)
    assert result.planner == "neuroshard"
    assert f"trained on the {kernel!r} embedding kernel" in caplog.text
    assert "collect-costs" in caplog.text


def test_pinned_tables_stay_whole_and_where_they_are_pinned(policy):
    from towerrec.planner.placement import TableConstraint

    hot = TableStats(
        "hot", 4000, 128, pooling_factor=40, pooling_p50=40, pooling_p99=40, pooling_max=40
    )
    small = [TableStats(f"s{i}", 1000, 8) for i in range(6)]
    model = CostModel(topology_preset("gpu", 1, 4), None, 512)
    result = plan_tables(
        [hot, *small], model, "neuroshard", {"hot": TableConstraint(rank=2)}, policy=policy
    )
    shards = result.plan.tables["hot"].shards
    assert len(shards) == 1 and shards[0].rank == 2
