"""DreamShard and AutoShard: cost-network reductions, deterministic training, a policy
that beats random placement on its estimated MDP, plans within memory, weight files."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from test_learned_cost import flip_tensor_byte

from towerrec.modules.tables import TableConfig
from towerrec.planner import autoshard, dreamshard
from towerrec.planner.cost import CostModel
from towerrec.planner.learned_planners import (
    default_weights_path,
    learned_placer,
    load_cost_data,
    train_policy,
)
from towerrec.planner.learned_policy import (
    FEATURE_LAYOUT,
    PolicyWeights,
    PolicyWeightsError,
    features,
    training_tasks,
)
from towerrec.planner.search import plan_tables
from towerrec.planner.suites import dlrm_like_suite
from towerrec.planner.topology import Topology

GiB = 1 << 30


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny networks: no spinning threads


def fake_seconds(shards):
    """A kernel-like device time: one overhead per width, lookups x width per table."""
    widths = len({c for *_, c in shards})
    return 1e-4 * widths + sum(s.pooling_factor * c * 4e-9 * 2048 + 5e-6 for s, _, c in shards)


def small_suite(n=60, seed=0):
    return [replace(s, num_embeddings=min(s.num_embeddings, 50_000)) for s in dlrm_like_suite(n, seed=seed)]  # fmt: skip


def cost_data(tables, num=60, seed=0):
    rng = np.random.default_rng(seed)
    devices = []
    for _ in range(num):
        chosen = rng.choice(len(tables), int(rng.integers(1, 12)), replace=False)
        devices.append([(tables[i], tables[i].num_embeddings, tables[i].embedding_dim) for i in chosen])  # fmt: skip
    return devices, [fake_seconds(d) for d in devices]


@pytest.fixture(scope="module")
def tiny():
    tables = small_suite()
    devices, seconds = cost_data(tables)
    tasks = training_tasks(tables, 6, 8, 16, (2, 4), seed=0)
    return tables, devices, seconds, tasks


def test_cost_network_sums_shards_and_takes_the_max_over_devices():
    torch.manual_seed(0)
    net = dreamshard.CostNetwork(hidden=8, comm=True)
    feats = torch.rand(3, 5, len(FEATURE_LAYOUT))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
    emb = net.device_embeddings(feats, mask)
    assert emb.shape == (3, 8)
    # sum-reduce: padding adds nothing, order does not matter
    assert torch.allclose(emb[0], net.embed(feats[0, :3]).sum(0), atol=1e-6)
    assert torch.allclose(emb[0], net.embed(feats[0, [2, 0, 1]]).sum(0), atol=1e-6)
    assert net.compute(emb).shape == (3, 2)
    dims = torch.tensor([[32.0, 64.0, 8.0]])
    per_device = net.device_costs(emb.unsqueeze(0), dims)
    assert per_device.shape == (1, 3)
    assert net.communication(dims, 3).shape == (1, 3)
    assert torch.equal(net.overall(emb.unsqueeze(0), dims), per_device.max(dim=-1).values)
    # one device: no all-to-all
    assert float(net.communication(torch.tensor([[64.0]]), 1).sum()) == 0.0


def test_training_is_deterministic_given_the_seed(tiny):
    _, devices, seconds, tasks = tiny
    kw = {"iterations": 2, "cost_steps": 20, "policy_batches": 3, "episodes": 4}
    a = dreamshard.train_dreamshard(devices, seconds, tasks, seed=3, **kw)
    b = dreamshard.train_dreamshard(devices, seconds, tasks, seed=3, **kw)
    c = dreamshard.train_dreamshard(devices, seconds, tasks, seed=4, **kw)
    assert a.state.keys() == b.state.keys()
    assert all(torch.equal(a.state[k], b.state[k]) for k in a.state)
    assert not all(torch.equal(a.state[k], c.state[k]) for k in a.state)
    kw = {"cost_steps": 20, "policy_batches": 3, "episodes": 4}
    a = autoshard.train_autoshard(devices, seconds, tasks, seed=3, **kw)
    b = autoshard.train_autoshard(devices, seconds, tasks, seed=3, **kw)
    assert all(torch.equal(a.state[k], b.state[k]) for k in a.state)
    assert a.cost_data_sha256 == b.cost_data_sha256


def _random_cost(estimate, feats, devices, draws=20):
    rng = np.random.default_rng(0)
    return np.mean([estimate(feats, rng.integers(devices, size=len(feats))) for _ in range(draws)])


def test_policies_beat_random_placement_on_the_estimated_cost(tiny):
    _, devices, seconds, tasks = tiny
    weights = dreamshard.train_dreamshard(
        devices, seconds, tasks, seed=0, iterations=2, cost_steps=300, policy_batches=20
    )
    cost, policy = dreamshard.networks(weights)
    learned, random = [], []
    for task_tables, count in tasks:
        feats = features([(s, s.num_embeddings, s.embedding_dim) for s in task_tables], 2048)
        order = dreamshard._order(cost, feats)
        with torch.no_grad():
            *_, total = dreamshard.rollout(cost, policy, feats[order], count, 1, None)
        learned.append(float(total[0]))

        def estimate_ds(f, a, cost=cost, count=count):
            return dreamshard.estimated_cost(cost, f, a.tolist(), count)

        random.append(_random_cost(estimate_ds, feats, count))
    print("dreamshard", np.mean(learned), "random", np.mean(random))
    assert np.mean(learned) < 0.9 * np.mean(random)

    weights = autoshard.train_autoshard(
        devices, seconds, tasks, seed=0, cost_steps=300, policy_batches=40
    )
    cost, policy = autoshard.networks(weights)
    learned, random = [], []
    for task_tables, count in tasks:
        feats = features([(s, s.num_embeddings, s.embedding_dim) for s in task_tables], 2048)
        order = autoshard._order(cost, feats)
        with torch.no_grad():
            out = autoshard.rollout(cost, policy, feats[order], count, 1, None)
        learned.append(float(out["cost"][0]))

        def estimate(f, a, cost=cost, count=count):
            with torch.no_grad():
                sums = torch.zeros(count, 32).index_add(0, torch.tensor(a), cost.embed(f))
                return float(cost.cost(sums).max())

        random.append(_random_cost(estimate, feats, count))
    print("autoshard", np.mean(learned), "random", np.mean(random))
    assert np.mean(learned) < 0.9 * np.mean(random)


@pytest.mark.parametrize("planner", ["dreamshard", "autoshard"])
def test_shipped_weights_plan_within_memory_and_on_more_devices(planner):
    suite = dlrm_like_suite(40, seed=3)
    # 16 devices: more than the shipped weights were trained for (2, 4, 8)
    model = CostModel(Topology(hosts=2, ranks_per_host=8, device_memory=2 * GiB), batch_size=256)
    result = plan_tables(suite, model, planner)
    result.plan.validate([TableConfig(s.name, s.num_embeddings, s.embedding_dim) for s in suite])
    assert max(result.device_memory) <= 2 * GiB
    assert sum(1 for shards in result.device_shards if shards) > 8
    weights = PolicyWeights.load(default_weights_path(planner), planner)
    assert max(weights.trained_devices) < 16


def test_bad_weight_files_are_refused(tmp_path, tiny):
    _, devices, seconds, tasks = tiny
    good = dreamshard.train_dreamshard(
        devices, seconds, tasks, iterations=1, cost_steps=2, policy_batches=1, episodes=2
    )
    path = tmp_path / "w.pt"
    good.save(path)
    assert isinstance(learned_placer("dreamshard", path), dreamshard.DreamShardPlacer)
    with pytest.raises(PolicyWeightsError, match="holds 'dreamshard' weights, not 'autoshard'"):
        learned_placer("autoshard", path)
    for change, match in [
        ({"version": 99}, "version 99, this code reads version 1"),
        ({"feature_layout": ["log_rows"]}, "feature layout"),
        ({"format": "other"}, "not a towerrec-learned-sharding weights file"),
    ]:
        torch.save({**good.to_dict(), **change}, tmp_path / "bad.pt")
        with pytest.raises(PolicyWeightsError, match=match):
            PolicyWeights.load(tmp_path / "bad.pt", "dreamshard")
    (tmp_path / "junk.pt").write_text("not a torch file")
    with pytest.raises(PolicyWeightsError, match="not a readable weights file"):
        PolicyWeights.load(tmp_path / "junk.pt", "dreamshard")
    with pytest.raises(
        FileNotFoundError, match="train one with `towerrec plan train-policy --planner dreamshard"
    ):
        learned_placer("dreamshard", tmp_path / "missing.pt")
    with pytest.raises(ValueError, match="unknown learned planner 'neuro'"):
        learned_placer("neuro")


def test_a_damaged_weights_file_is_refused(tmp_path, tiny):
    _, devices, seconds, tasks = tiny
    weights = autoshard.train_autoshard(
        devices, seconds, tasks, cost_steps=2, policy_batches=1, episodes=2
    )
    path = tmp_path / "w.pt"
    weights.save(path)
    assert PolicyWeights.load(path, "autoshard").state.keys() == weights.state.keys()
    flip_tensor_byte(path)
    with pytest.raises(
        PolicyWeightsError,
        match=r"w\.pt' does not match its own weights_sha256.*retrain it with `towerrec plan "
        "train-policy --planner autoshard",
    ):
        PolicyWeights.load(path, "autoshard")


def test_train_policy_from_a_cost_data_file(tmp_path, tiny):
    _, devices, seconds, _ = tiny
    data = {
        "format": "towerrec-cost-data",
        "version": 1,
        "machine": {},
        "kernel": "torch",
        "batch": 2048,
        "compute": [
            {
                "shards": [
                    {**vars(s), "feature_names": list(s.feature_names), "rows": r, "cols": c}
                    for s, r, c in d
                ],
                "forward_s": t / 3,
                "backward_s": 2 * t / 3,
            }
            for d, t in zip(devices, seconds)
        ],
        "comm": [{"world": 2, "dims": [64, 32], "batch": 2048, "seconds": 2e-4}],
    }
    (tmp_path / "costs.json").write_text(json.dumps(data))
    loaded = load_cost_data(tmp_path / "costs.json")
    assert len(loaded.split) == len(devices) and loaded.comm == [((64, 32), 2e-4)]
    path = train_policy(
        "dreamshard", tmp_path / "costs.json", tmp_path / "out", seed=1,
        iterations=1, cost_steps=5, policy_batches=1, episodes=2,
    )  # fmt: skip
    weights = PolicyWeights.load(path, "dreamshard")
    assert weights.extra["comm"] is True and weights.trained_devices == (2, 4, 8)
    assert len(weights.cost_data_sha256) == 64
    (tmp_path / "bad.json").write_text(json.dumps({"format": "towerrec-cost-data", "version": 7}))
    with pytest.raises(ValueError, match="version 7"):
        load_cost_data(tmp_path / "bad.json")


@pytest.mark.slow
def test_learned_benchmark_protocol_end_to_end():
    from towerrec.bench.plan_learned import learned_part

    r = learned_part(None, cost_devices=6, train_tasks=3, test_tasks=3, measured=1,
                     transfer_tasks=1, train_scale=0.02, transfer_measured=0)  # fmt: skip
    assert r["protocol"]["train_tables"] + r["protocol"]["test_tables"] == 856
    unseen = r["unseen_test_tasks"]
    for planner in ("dreamshard", "autoshard", "lpt", "greedy_size"):
        assert unseen["cost_model_ratio_to_best_greedy"][planner] > 0
        assert unseen["measured_ratio_to_best_greedy"][planner] > 0
        assert r["plan_856_on_128_s"][planner] > 0
    for greedy in ("greedy_size", "greedy_lookup", "greedy_size_lookup", "greedy_dim"):
        assert unseen["cost_model_ratio_to_best_greedy"][greedy] >= 1 - 1e-9
    assert set(r["transfer"]) == {"16", "128"}
