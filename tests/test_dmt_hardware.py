"""The DMT paper's hardware in the scale model: sourced constants, a measured dense
efficiency, and the comparison with the paper's reported speed-ups (pure arithmetic)."""

import json

import pytest

from towerrec.bench.dmt_scale import run_scale_model
from towerrec.planner.dmt_hardware import (
    ASSUMED,
    PAPER,
    PAPER_REPORTED,
    SPECS,
    cluster_for,
    compare_with_paper,
    explain_gap,
    measured_efficiency,
)
from towerrec.planner.dmt_scale import Cluster, Workload, predict_step


def test_every_constant_has_a_source_and_the_clusters_follow_from_them():
    for key, spec in SPECS.items():
        assert {name for name, _ in spec.sources} == {
            "peak_flops",
            "hbm_bw",
            "nvlink_bw",
            "nic_bw",
        }, key
    h100 = cluster_for("h100")
    assert h100.ranks_per_host == PAPER["gpus_per_host"] == 8
    assert h100.flops == pytest.approx(989e12 * ASSUMED["dense_efficiency"][0])
    assert h100.cross_host_bw == pytest.approx(50e9 * ASSUMED["nic_efficiency"][0])
    assert h100.intra_host_bw == pytest.approx(450e9 * ASSUMED["nvlink_efficiency"][0])
    assert cluster_for("a100", dense_efficiency=0.5).flops == pytest.approx(156e12)
    with pytest.raises(ValueError, match=r"unknown GPU generation 'tpu'.*v100"):
        cluster_for("tpu")


def test_measured_efficiency_is_achieved_over_peak(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text(
        json.dumps(
            {
                "device": "NVIDIA H200",
                "measurements": [
                    {"kind": "flat_step", "flops": 989e12 * 0.2, "seconds": 1.0},
                    {"kind": "flat_step", "flops": 989e12 * 0.6, "seconds": 1.0},
                    {"kind": "tower_module", "flops": 989e12 * 0.1, "seconds": 0.5},
                ],
            }
        )
    )
    got = measured_efficiency(path)
    assert got["generation"] == "h200"
    assert got["by_kind"] == pytest.approx({"flat_step": 0.4, "tower_module": 0.2})
    assert got["dense_efficiency"] == pytest.approx(0.3)
    path.write_text(json.dumps({"device": "a TPU", "measurements": [{"kind": "x"}]}))
    with pytest.raises(ValueError, match="not a JSON of measured GPU steps"):
        measured_efficiency(path)
    path.write_text(json.dumps({"device": "a TPU", "measurements": []}))
    with pytest.raises(ValueError, match="device 'a TPU' is none of"):
        measured_efficiency(path)


def test_a_gap_is_put_on_the_term_that_explains_it():
    point = predict_step(64, cluster_for("h100"), Workload())
    flat, dmt = point["flat"]["step_s"], point["dmt"]["step_s"]
    low = explain_gap(point, 1.25 * flat / dmt)  # the paper faster than the model
    assert low["term"] == "flat_comm_ms"
    assert low["flat_step_ms_needed_extra"] == pytest.approx(1e3 * (1.25 * flat - flat))
    assert low["ratio"] == pytest.approx(0.8)
    high = explain_gap(point, 0.9 * flat / dmt)  # slower: flat's latency term can give
    assert high["term"] == "flat_comm_latency_ms"
    assert -high["flat_step_ms_needed_extra"] <= high["terms_ms"]["flat_comm_latency_ms"]
    # with no latency to give, DMT's own collectives are named
    slow = predict_step(64, Cluster(cross_latency=1e-9, intra_latency=1e-9), Workload())
    assert explain_gap(slow, 0.5 * slow["speedup"])["term"] == "dmt_comm_ms"


def test_the_paper_comparison_covers_its_generations_and_scales(tmp_path):
    result = compare_with_paper()
    rows = result["comparison"]
    assert len(rows) == len(PAPER["generations"]) * len(PAPER["scales"])
    reported = [r for r in rows if r["reported_speedup"] is not None]
    assert {(r["generation"], r["accelerators"]) for r in reported} == set(PAPER_REPORTED)
    for row in rows:
        if row["reported_speedup"] is None:
            # the paper's "up to" bounds every configuration
            at_most = PAPER["speedup_at_most"] * 1.15
            assert row["within_tolerance"] == (row["predicted_speedup"] <= at_most)
            assert ("gap" in row) == (not row["within_tolerance"])
    # through the command: JSON with the sources, and the plot
    out = run_scale_model(cross_host_gbs=(25.0,), paper=True, paper_plot=tmp_path / "p.png")
    paper = out["paper"]
    assert paper["dense_efficiency_from"] == "assumed"
    assert {h["key"] for h in paper["hardware"]} >= set(PAPER["generations"])
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
