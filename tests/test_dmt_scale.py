import json
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import run_cli

from towerrec.bench.dmt_scale import run_scale_model
from towerrec.planner.dmt_scale import (
    LINK_TERMS,
    Cluster,
    MeasuredStep,
    Workload,
    fit_link_constants,
    fit_terms,
    peer_messages,
    predict_step,
    scale_sweep,
)

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
    plot = tmp_path / "scale.png"
    out = run_cli("bench", "dmt-scale", "--json", "--plot", str(plot), "--cross-host-gbs", "25")
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


# ------------------------------------------------------------------ calibration
FLAT_CALLS = {"input_counts": 1, "input_ids": 1, "output_pooled": 1, "output_pooled_grad": 1}
DMT_CALLS = {**FLAT_CALLS, "tower_input_ids": 1, "tower_outputs": 1, "tower_outputs_grad": 1}
HIER = {"dense_reduce_scatter": 1, "dense_allreduce_cross": 1, "dense_all_gather": 1}


def test_peer_messages_on_two_hosts_of_two():
    # flat all-to-all: 1 peer inside, 2 across; a ring all-reduce over 4: 6 steps, across
    assert peer_messages("flat_table_wise", "input_ids", 2, 2, 1) == (1, 2)
    assert peer_messages("flat_table_wise", "dense_allreduce", 2, 2, 1) == (0, 6)
    assert peer_messages("flat_table_row_wise", "output_host_reduce_grad", 2, 2, 1) == (1, 0)
    assert peer_messages("flat_table_row_wise", "output_cross_host", 2, 2, 1) == (0, 1)
    # DMT: the peer all-to-alls cross to 1 peer, the host lookup stays inside; of its 3
    # all-reduces, bottom and top span the world, the tower its host (2 steps inside)
    assert peer_messages("dmt", "tower_outputs", 2, 2, 1) == (0, 1)
    assert peer_messages("dmt", "input_ids", 2, 2, 1) == (1, 0)
    assert peer_messages("dmt", "dense_allreduce", 2, 2, 3) == (2, 12)
    # hierarchical: reduce-scatter and all-gather inside, a ring of 2 hosts across
    got = [peer_messages("flat_table_wise", n, 2, 2, 1) for n in HIER]
    assert got == [(1, 0), (0, 2), (1, 0)]
    # one host: everything inside
    assert peer_messages("flat_table_wise", "dense_allreduce", 1, 4, 1) == (6, 0)


def _planted_steps():
    """Steps the fitted model itself produces from known constants: flat and DMT, ring and
    hierarchical all-reduce, on loopback and on links of three rates."""
    names = ("c_dlrm_d16", "c_dmt_d16", *LINK_TERMS)
    truth = dict(zip(names, (0.030, 0.045, 0.002, 0.003, 2e-9, 1.4), strict=True))
    steps = []
    for layout, calls, cross, intra in (
        ("flat_table_wise", FLAT_CALLS, 2400.0, 1200.0),
        ("dmt", DMT_CALLS, 580.0, 2450.0),
    ):
        for dense, extra in (
            ("ring", {"dense_allreduce": 1 + 2 * (layout == "dmt")}),
            ("hier", HIER),
        ):
            if layout == "dmt" and dense == "hier":
                extra = {**HIER, "dense_allreduce": 1}
            for gbit in (None, 1.0, 0.5, 0.2):
                step = MeasuredStep(
                    f"{layout}_{dense}",
                    layout,
                    2,
                    2,
                    4096,
                    0.0,
                    cross + 7 * (dense == "ring"),
                    intra,
                    {**calls, **extra},
                    gbit * 1e9 / 8 if gbit else None,
                )
                seconds = sum(truth[t] * x for t, x in fit_terms(step).items())
                steps.append(replace(step, step_s=seconds))
    return truth, steps


def test_fit_recovers_planted_link_constants():
    truth, steps = _planted_steps()
    fit = fit_link_constants(steps)
    for term, value in truth.items():
        assert fit["terms"][term] == pytest.approx(value, rel=1e-6), term
    assert fit["constants"]["link_efficiency"] == pytest.approx(1 / 1.4)
    assert fit["constants"]["intra_host_bw"] == pytest.approx(0.5e9)
    assert fit["max_abs_residual_ms"] < 1e-6
    assert len(fit["residuals"]) == len(steps) == fit["points"]


def test_fit_needs_a_shaped_link_and_enough_steps():
    _, steps = _planted_steps()
    with pytest.raises(ValueError, match="no measured step ran over a shaped link"):
        fit_link_constants([s for s in steps if s.link_bytes_per_s is None] * 3)
    with pytest.raises(ValueError, match="3 measured steps cannot fit 5 constants"):
        fit_link_constants(steps[:3])


def _report(network, gbit, step_ms):
    row = {
        "variant": "flat_table_wise",
        "layout": "flat_table_wise",
        "batch_size": 4096,
        "step_ms": step_ms,
        "total_cross_host_bytes_per_sample": 2358.2,
        "total_intra_host_bytes_per_sample": 1199.9,
        "collective_calls_per_step": {**FLAT_CALLS, "dense_allreduce": 1.0},
    }
    dmt = {
        **row,
        "variant": "dmt_partitioner",
        "layout": "dmt",
        "step_ms": step_ms * 0.6 + 30,
        "total_cross_host_bytes_per_sample": 584.5,
        "total_intra_host_bytes_per_sample": 2448.7,
        "collective_calls_per_step": {**DMT_CALLS, "dense_allreduce": 3.0},
    }
    failed = {"variant": "flat_table_row_wise", "layout": "flat_table_row_wise", "errors": ["x"]}
    return {
        "network": network,
        "link_gbit": gbit,
        "hosts": 2,
        "ranks_per_host": 2,
        "variants": [row, dmt, failed],
    }


def test_bench_fits_measured_reports(tmp_path):
    paths = []
    for network, gbit, ms in (
        ("local", None, 65.0),
        ("netns", 1.0, 100.0),
        ("netns", 0.5, 166.0),
        ("netns", 0.2, 345.0),
    ):
        paths.append(tmp_path / f"{network}-{gbit}.json")
        paths[-1].write_text(json.dumps(_report(network, gbit, ms)))
    result = run_scale_model(cross_host_gbs=(0.125,), measured=paths, plot=tmp_path / "p.png")
    fit = result["fit"]
    assert fit["points"] == 8  # the failed variant is left out
    assert [r["link_gbit"] for r in fit["residuals"][:4]] == [None, None, 1.0, 1.0]
    cluster = result["sweeps"]["0.125GB/s"]["cluster"]
    assert cluster["cross_host_bw"] == pytest.approx(0.125e9 * fit["constants"]["link_efficiency"])
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="not a towerrec bench dmt --json report"):
        run_scale_model(measured=[bad])


def test_a_fit_predicts_steps_it_was_not_fitted_to():
    from towerrec.planner.dmt_scale import evaluate_fit

    _, steps = _planted_steps()
    fit = fit_link_constants(steps[::2])  # every other step
    held_out = evaluate_fit(fit, steps[1::2])
    assert held_out["points"] == len(steps[1::2])
    assert held_out["max_abs_residual_ms"] < 1e-4  # ms: exact up to float rounding
    other_dim = replace(steps[1], embedding_dim=64)
    (row,) = evaluate_fit(fit, [other_dim])["residuals"]
    assert row["not_predicted"] == "no c_dlrm_d64 in the fit"
    with pytest.raises(ValueError, match="--validate evaluates the links fitted to --measured"):
        run_scale_model(validate=[REPO / "docs/results/bench-dmt-fused-dim16-local.json"])
