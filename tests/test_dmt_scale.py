import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from towerrec.bench.dmt_scale import run_scale_model
from towerrec.planner.dmt_scale import Cluster, Workload, predict_step, scale_sweep

REPO = Path(__file__).parent.parent


def test_bytes_and_peers_by_hand():
    work = Workload(num_features=64, embedding_dim=16, pooling_factor=2, compression=4)
    p = predict_step(32, Cluster(ranks_per_host=8), work)
    ids, pooled = 64 * 2 * 4, 64 * 16 * 2  # per sample
    # flat: a sample's ids and pooled rows (forward + gradient) cross for tables on 24 of 32 ranks
    assert p["flat"]["cross_host_bytes_per_sample"] == pytest.approx((ids + 2 * pooled) * 24 / 32)
    # DMT: the 3 remote towers' ids go out, their compressed outputs (and grads) come back
    assert p["dmt"]["cross_host_bytes_per_sample"] == pytest.approx((ids + 2 * pooled / 4) * 3 / 4)
    assert p["flat"]["peers_per_collective"] == {"cross_host": 24, "intra_host": 7}
    assert p["dmt"]["peers_per_collective"] == {"cross_host": 3, "intra_host": 7}
    assert p["hosts"] == 4


def test_cross_host_saving_tends_to_the_compression_when_ids_are_cheap():
    work = Workload(pooling_factor=1e-6, compression=6.0)
    assert predict_step(64, Cluster(), work)["cross_host_bytes_ratio"] == pytest.approx(
        6.0, rel=1e-4
    )


def test_one_host_sends_nothing_across():
    p = predict_step(8, Cluster(), Workload())
    assert p["flat"]["cross_host_bytes_per_sample"] == 0
    assert p["dmt"]["cross_host_bytes_per_sample"] == 0


def test_flat_slows_with_scale_and_dmt_gains():
    points = scale_sweep()["points"]
    flat = [p["flat"]["step_s"] for p in points]
    speedup = [p["speedup"] for p in points]
    assert flat == sorted(flat)
    assert speedup == sorted(speedup) and speedup[0] > 1
    # a faster cross-host link narrows the gap
    fast = predict_step(128, Cluster(cross_host_bw=400e9), Workload())
    assert fast["speedup"] < predict_step(128, Cluster(), Workload())["speedup"]


def test_errors():
    with pytest.raises(ValueError, match="multiple of ranks_per_host = 8"):
        predict_step(12, Cluster(), Workload())
    with pytest.raises(ValueError, match="cannot fill 4 towers"):
        predict_step(32, Cluster(), Workload(num_features=3))
    with pytest.raises(ValueError, match=r"Cluster\.cross_host_bw must be > 0"):
        Cluster(cross_host_bw=0)


def test_bench_writes_json_and_plot(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    plot = tmp_path / "scale.png"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "towerrec.cli",
            "bench",
            "dmt-scale",
            "--json",
            "--plot",
            str(plot),
            "--cross-host-gbs",
            "25",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    points = result["sweeps"]["25GB/s"]["points"]
    assert [p["accelerators"] for p in points] == [16, 32, 64, 128, 256, 512]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert run_scale_model(cross_host_gbs=(50.0,))["sweeps"]["50GB/s"]["points"][0]["hosts"] == 2


def test_synthetic_default_traffic_by_hand():
    from towerrec.bench.dmt_scale import synthetic_traffic

    t = synthetic_traffic()
    ids, pooled = (8 * 1 + 3) * 8, 9 * 16 * 4  # int64 ids (8 single-hot + one 3-hot), fp32 rows
    # half of a sample's tables live on the other host: its ids go out, pooled rows + grads cross
    assert t["flat_table_wise"]["cross_host_bytes_per_sample"] == pytest.approx(
        (ids + 2 * pooled) / 2
    )
    # DMT: half the ids go to the other tower; one 16-float vector (and its grad) comes back
    assert t["dmt"]["cross_host_bytes_per_sample"] == pytest.approx(ids / 2 + 2 * 16 * 4)
