"""The cost-data file of the learned planners: round trip, refusals, a tiny collection."""

import json

import numpy as np
import pytest

from towerrec.calibration.cost_data import collect_cost_data, random_split_device
from towerrec.planner.costdata import FORMAT, CommSample, ComputeSample, CostData
from towerrec.planner.learned_planners import load_cost_data
from towerrec.planner.stats import TableStats


def _data(kernel="torch"):
    rng = np.random.default_rng(0)
    compute = [
        ComputeSample(tuple(random_split_device(rng, f"d{i}", 4, 1000)), 1e-3 * (i + 1), 2e-3)
        for i in range(3)
    ]
    compute.append(
        ComputeSample(((TableStats("x", 10, 8, feature_names=("a", "b")), 10, 4),), 1e-4, 1e-4)
    )
    comm = [CommSample(2, (8, 64), 256, 1e-3), CommSample(2, (0, 12), 256, 5e-4)]
    return CostData({"cpu": "test", "flags": ["avx2"]}, kernel, 256, compute, comm)


def test_round_trip(tmp_path):
    data = _data()
    data.save(tmp_path / "c.json")
    again = CostData.load(tmp_path / "c.json", kernel="torch")
    assert again == data
    assert again.compute[3].shards[0][0].feature_names == ("a", "b")
    assert again.compute[0].seconds == pytest.approx(3e-3)
    raw = json.loads((tmp_path / "c.json").read_text())
    assert raw["format"] == FORMAT and raw["version"] == 1 and raw["kernel"] == "torch"
    assert set(raw["compute"][0]["shards"][0]) >= {"num_embeddings", "rows", "cols"}


def test_refuses_other_format_version_and_kernel(tmp_path):
    path = tmp_path / "c.json"
    _data().save(path)
    with pytest.raises(
        ValueError, match=r"c\.json.*'torch'.*not 'fbgemm'.*collect-costs --out .*c\.json"
    ):
        CostData.load(path, kernel="fbgemm")
    raw = json.loads(path.read_text())
    path.write_text(json.dumps({**raw, "version": 2}))
    with pytest.raises(ValueError, match=r"c\.json.*version 2.*collect-costs"):
        CostData.load(path)
    path.write_text(json.dumps({**raw, "format": "towerrec-calibration"}))
    with pytest.raises(ValueError, match=r"c\.json.*not a towerrec-cost-data.*collect-costs"):
        CostData.load(path)
    broken = {**raw, "comm": [{"world": 2, "dims": [1], "batch": 4, "seconds": 1.0}]}
    path.write_text(json.dumps(broken))
    with pytest.raises(ValueError, match=r"comm sample 0.*collect-costs"):
        CostData.load(path)
    shard = {**raw["compute"][0]["shards"][0], "rows": 10**9}
    path.write_text(json.dumps({**raw, "compute": [{**raw["compute"][0], "shards": [shard]}]}))
    with pytest.raises(ValueError, match=r"malformed.*does not fit"):
        CostData.load(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        CostData.load(path)
    with pytest.raises(FileNotFoundError, match="collect-costs"):
        CostData.load(tmp_path / "missing.json")


def test_a_changed_number_is_refused(tmp_path):
    path = tmp_path / "c.json"
    _data().save(path)
    assert CostData.load(path) == _data()  # unchanged: loads
    text = path.read_text()
    changed = text.replace('"forward_s":0.002,', '"forward_s":0.003,', 1)  # sample 1's time
    assert changed != text
    path.write_text(changed)
    assert json.loads(changed)["compute"][1]["forward_s"] == 0.003  # still valid JSON
    with pytest.raises(ValueError, match=r"c\.json' does not match its own data_sha256.*collect"):
        CostData.load(path)
    with pytest.raises(ValueError, match=r"c\.json' does not match its own data_sha256"):
        load_cost_data(path)  # the learned planners' reader
    raw = json.loads(changed)
    del raw["data_sha256"]  # a file from before the digest: read as it is
    path.write_text(json.dumps(raw))
    assert CostData.load(path).compute[1].forward_s == 0.003


def test_collect_a_few_devices_measures_positive_times():
    data = collect_cost_data(num_devices=2, num_comm=0, batch=64, reps=1, seed=3, max_rows=500)
    assert len(data.compute) == 2 and not data.comm
    assert data.kernel in ("torch", "fbgemm") and data.machine["kernel_backend"] == data.kernel
    for sample in data.compute:
        assert sample.forward_s > 0 and sample.backward_s > 0
        for stats, rows, cols in sample.shards:
            assert rows == stats.num_embeddings and stats.embedding_dim % cols == 0
    again = CostData.from_json(json.loads(json.dumps(data.to_json())))
    assert again == data


def test_collect_costs_command(tmp_path, capsys):
    from towerrec.cli.app import main

    out = tmp_path / "costs.json"
    argv = ["plan", "collect-costs", "--out", str(out), "--devices", "1", "--comm", "0"]
    assert main([*argv, "--batch", "32", "--reps", "1", "--seed", "1"]) == 0
    assert "1 devices" in capsys.readouterr().out
    assert len(CostData.load(out).compute) == 1
    assert main(["plan", "collect-costs", "--out", str(out), "--devices", "-1"]) == 2
    assert "--devices" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_collect_all_to_alls_on_two_gloo_ranks():
    data = collect_cost_data(num_devices=0, num_comm=2, batch=16, reps=1, seed=4)
    assert not data.compute and len(data.comm) == 2
    for sample in data.comm:
        assert sample.world == 2 and len(sample.dims) == 2 and sample.seconds > 0
        assert sample.batch == 16
