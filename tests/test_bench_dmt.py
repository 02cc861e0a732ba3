"""``towerrec bench dmt``: report assembly, argument checks, and a small run on loopback."""

import json

import pytest
from conftest import run_cli

from towerrec.bench import dmt as bench_dmt
from towerrec.bench import dmt_runs
from towerrec.bench.dmt import VARIANTS, bench_overrides, run_dmt_benchmark
from towerrec.bench.dmt_report import assemble_report, link_bounds, peers_per_collective


def fake_summary(samples_per_s, auc, cross, intra=100.0, dense_cross=300.0):
    return {
        "samples_per_s": samples_per_s,
        "auc": auc,
        "logloss": 0.5,
        "oracle_auc": 0.82,
        "comm_bytes_per_sample_cross": cross,
        "comm_bytes_per_sample_intra": intra,
        "dense_allreduce_bytes_per_sample_cross": dense_cross,
        "dense_allreduce_bytes_per_sample_intra": dense_cross,
        "total_bytes_per_sample_cross": cross + dense_cross,
        "total_bytes_per_sample_intra": intra + dense_cross,
        "steps": 10,
    }


LAYOUTS = {name: layout for name, (layout, _) in VARIANTS.items()}


def test_peers_per_collective_on_2x2_and_larger_meshes():
    flat = peers_per_collective("flat_table_wise", 2, 2)
    assert flat == [{"collective": "all_to_all", "peers": 3, "cross_host_peers": 2}]
    dmt = peers_per_collective("dmt", 2, 2)
    assert [(c["peers"], c["cross_host_peers"]) for c in dmt] == [(1, 1), (1, 0)]
    trw = peers_per_collective("flat_table_row_wise", 2, 2)
    assert [(c["peers"], c["cross_host_peers"]) for c in trw] == [(3, 2), (1, 0), (1, 1)]
    # 16 hosts of 8: flat talks to 127 peers (120 remote), DMT's peer all-to-all to 15
    assert peers_per_collective("flat_row_wise", 16, 8)[0]["cross_host_peers"] == 120
    assert peers_per_collective("dmt", 16, 8)[0]["peers"] == 15
    with pytest.raises(ValueError, match="unknown layout 'towers'"):
        peers_per_collective("towers", 2, 2)


def test_report_ratios_and_targets_from_run_summaries():
    runs = {
        "flat_table_wise": [
            fake_summary(1000.0, 0.8150, 2400.0),
            fake_summary(1200.0, 0.8150, 2400.0),
        ],
        "flat_table_row_wise": [fake_summary(900.0, 0.8150, 2000.0)],
        "dmt_identity": [fake_summary(1050.0, 0.8151, 2400.0)],
        "dmt_partitioner": [fake_summary(1800.0, 0.8140, 500.0)],
        "dmt_random": [fake_summary(1700.0, 0.8135, 520.0)],
    }
    for summary in runs["flat_table_wise"] + runs["dmt_partitioner"]:
        summary["batch_size"] = 1000
    runs["dmt_partitioner"][-1]["comm_calls_per_step"] = {"tower_input_ids": 1.0, "x": 2.5}
    report = assemble_report(runs, LAYOUTS, 2, 2, {"network": "netns"}, link_gbit=0.008)
    assert report["network"] == "netns" and report["hosts"] == 2
    rows = {row["variant"]: row for row in report["variants"]}
    base = rows["flat_table_wise"]
    assert base["samples_per_s"] == 1100.0  # median of the rounds
    assert base["max_cross_host_peers_per_collective"] == 2
    assert base["step_ms"] == pytest.approx(1000 * 1000 / 1100)
    # all cross-host traffic, (2400 + 300) B x 1000 samples, half each way, at 1 MB/s
    assert base["link_ms_per_step"] == pytest.approx(1350.0)
    assert "link_ms_per_step" not in rows["dmt_identity"]  # no batch size in its summary
    dmt = rows["dmt_partitioner"]
    assert dmt["max_peers_per_collective"] == 1
    assert dmt["collective_calls_per_step"] == {"tower_input_ids": 1.0, "x": 2.5}
    assert dmt["collective_calls_per_step_total"] == 3.5
    assert "collective_calls_per_step" not in base  # its summary has none
    vs = dmt["vs_flat_table_wise"]
    assert vs["cross_host_bytes_reduction"] == pytest.approx(4.8)
    # on all traffic the dense all-reduces (300 B each) shrink the ratio: 2700 / 800
    assert vs["total_cross_host_bytes_reduction"] == pytest.approx(2700 / 800)
    assert vs["speedup"] == pytest.approx(1800 / 1100)
    assert vs["auc_delta"] == pytest.approx(-0.0010)
    targets = report["targets"]
    assert targets["cross_host_bytes_reduction"]["met"] is True
    assert targets["total_cross_host_bytes_reduction"]["met"] is False
    assert targets["auc_delta"]["met"] is True
    assert targets["speedup"]["met"] is True
    assert targets["partitioner_vs_random_auc"]["value"] == pytest.approx(0.0005)
    assert targets["partitioner_vs_random_auc"]["met"] is True

    runs["dmt_partitioner"] = [fake_summary(1200.0, 0.8120, 700.0)]
    targets = assemble_report(runs, LAYOUTS, 2, 2)["targets"]
    assert targets["cross_host_bytes_reduction"]["met"] is False  # 2400 / 700 = 3.4x
    assert targets["auc_delta"]["met"] is False  # 0.003 below
    assert targets["speedup"]["met"] is False
    assert targets["partitioner_vs_random_auc"]["met"] is False


def test_rows_of_another_dense_allreduce_compare_with_their_own_flat_row():
    runs = {
        "flat_table_wise": [fake_summary(1000.0, 0.815, 600.0, dense_cross=24.0)],
        "dmt_partitioner": [fake_summary(1000.0, 0.815, 140.0, dense_cross=21.0)],
        "flat_table_wise+hierarchical": [fake_summary(900.0, 0.815, 600.0, dense_cross=16.0)],
        "dmt_partitioner+hierarchical": [fake_summary(1100.0, 0.814, 140.0, dense_cross=14.0)],
    }
    layouts = {name: LAYOUTS[name.partition("+")[0]] for name in runs}
    report = assemble_report(runs, layouts, 2, 2)
    rows = {row["variant"]: row for row in report["variants"]}
    vs = rows["dmt_partitioner+hierarchical"]["vs_flat_table_wise"]
    assert vs["total_cross_host_bytes_reduction"] == pytest.approx(616 / 154)
    assert vs["speedup"] == pytest.approx(1100 / 900)
    by_kind = report["targets_by_dense_allreduce"]["hierarchical"]
    assert by_kind["total_cross_host_bytes_reduction"]["value"] == pytest.approx(616 / 154)
    assert report["targets"]["total_cross_host_bytes_reduction"]["value"] == pytest.approx(
        624 / 161
    )


def test_report_keeps_failed_runs_as_errors_not_numbers():
    runs = {
        "flat_table_wise": [fake_summary(1000.0, 0.815, 2400.0)],
        "dmt_partitioner": [{"error": "exit codes [1]: error: boom"}],
    }
    report = assemble_report(runs, LAYOUTS, 2, 2)
    row = report["variants"][1]
    assert row["errors"] == ["exit codes [1]: error: boom"]
    assert "samples_per_s" not in row and "vs_flat_table_wise" not in row
    assert report["targets"] == {}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"network": "wifi"}, "--network 'wifi': use one of local, netns"),
        ({"steps": 10}, "--steps must be > 10: the first 5 are warm-up"),
        ({"rounds": 0}, "--rounds must be >= 1"),
        ({"batch_size": 1022}, "multiple of 4"),
        ({"embedding_dims": [16, 0]}, r"--embedding-dim must be >= 1 \(a comma list"),
        ({"seeds": [1, 1]}, "--seeds must be distinct"),
        ({"link_gbits": [1.0, 1.0], "network": "netns"}, "--link-gbit: give distinct rates"),
        ({"variants": ["flat_table_wise", "flat_dp"]}, r"unknown \['flat_dp'\]"),
        ({"variants": []}, "none given"),
        ({"link_gbits": [1.0, 0.0], "network": "netns"}, "--link-gbit must be > 0"),
        ({"dense_allreduce": ["ring", "tree"]}, "distinct kinds from ring, hierarchical"),
        ({"dense_allreduce": ["ring", "ring"]}, "distinct kinds"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(kwargs, message):
    kwargs = {"variants": ["flat_table_wise"], **kwargs}
    with pytest.raises(ValueError, match=message):
        run_dmt_benchmark(**kwargs)


def test_dmt_variants_need_the_tower_transform(monkeypatch):
    monkeypatch.setattr(bench_dmt, "has_tower_transform", lambda: False)
    with pytest.raises(ValueError, match=r"tower transform.*--variants flat_table_wise"):
        run_dmt_benchmark(variants=["flat_table_wise", "dmt_partitioner"])


def test_every_variant_trains_the_same_shape():
    shape = bench_overrides(steps=7, batch_size=64, embedding_dim=32, threads=1)
    assert "model.embedding_dim=32" in shape and "model.bottom_mlp=[64, 32]" in shape
    assert "train.precision=fp32" in shape  # never each layout's own timed choice
    for layout, overrides in VARIANTS.values():
        keys = {item.split("=")[0] for item in overrides}
        assert not keys & {item.split("=")[0] for item in shape}, layout


def test_cli_reports_a_bad_network_as_one_error_line():
    done = run_cli("bench", "dmt", "--network", "wifi", "--variants", "flat_table_wise")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["error: --network 'wifi': use one of local, netns"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_bench_dmt_local_runs_flat_layouts_side_by_side(tmp_path):
    """Two tiny 4-rank runs on loopback: table-row-wise sharding is exact, so its AUC
    equals table-wise's; its hierarchical output moves more bytes inside the hosts."""
    done = run_cli(
        "bench",
        "dmt",
        "--network",
        "local",
        "--steps",
        "12",
        "--batch-size",
        "256",
        "--embedding-dim",
        "8",
        "--variants",
        "flat_table_wise,flat_table_row_wise",
        "--set",
        "data.synthetic.eval_samples=2048",
        "--work-dir",
        str(tmp_path),
        OMP_NUM_THREADS="1",
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert [(c["embedding_dim"], c["link"]) for c in report["cases"]] == [(8, "loopback")]
    rows = {row["variant"]: row for row in report["cases"][0]["variants"]}
    flat, trw = rows["flat_table_wise"], rows["flat_table_row_wise"]
    assert "errors" not in flat and "errors" not in trw
    assert flat["auc"] == pytest.approx(trw["auc"], abs=1e-5)
    assert flat["samples_per_s"] > 0 and flat["cross_host_bytes_per_sample"] > 0
    assert trw["intra_host_bytes_per_sample"] > flat["intra_host_bytes_per_sample"]
    assert flat["vs_flat_table_wise"]["cross_host_bytes_reduction"] == 1.0
    summary = json.loads((tmp_path / "flat_table_wise-d8-loopback-0" / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["hosts"] == 2
    assert flat["cross_host_bytes_per_sample"] == summary["comm_bytes_per_sample_cross"]


def test_a_run_is_read_from_its_summary_and_log(tmp_path):
    out = tmp_path / "dmt_partitioner-0"
    out.mkdir()
    log = out.with_suffix(".log")
    log.write_text(
        "04:31:25 INFO towerrec: tower partition [['cat_0', 'cat_2'], ['cat_1']]: 80.0% of ...\n"
    )
    (out / "summary.json").write_text(json.dumps(fake_summary(10.0, 0.8, 5.0)))
    (out / "config.toml").write_text(
        '[embedding]\nbackend = "fbgemm"\n\n[train]\nprecision = "fp32"\n'
    )
    run = dmt_runs.read_summary(out, log, [0, 0])
    assert run["partition"] == "[['cat_0', 'cat_2'], ['cat_1']]" and run["auc"] == 0.8
    assert run["precision"] == "fp32" and run["backend"] == "fbgemm"
    # a failed host: the error line of the log, never the stale summary's numbers
    log.write_text("Traceback ...\nerror: model.dmt.num_towers = 3 but 2 hosts\n")
    failed = dmt_runs.read_summary(out, log, [0, 1])
    assert failed == {"error": "exit codes [0, 1]: error: model.dmt.num_towers = 3 but 2 hosts"}


def test_samples_per_s_leaves_out_the_warm_up_window(tmp_path):
    records = [
        {"kind": "train", "step": 5, "samples": 500, "samples_per_s": 10.0},  # warm-up: 50 s
        {"kind": "train", "step": 10, "samples": 1000, "samples_per_s": 100.0},  # 5 s
        {"kind": "eval", "step": 10, "auc": 0.7},
        {"kind": "train", "step": 12, "samples": 1200, "samples_per_s": 40.0},  # 5 s
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert dmt_runs.steady_samples_per_s(path) == pytest.approx(700 / 10)
    path.write_text(json.dumps(records[0]) + "\n")
    assert dmt_runs.steady_samples_per_s(path) is None


def test_a_launcher_left_waiting_after_a_finished_run_is_stopped_and_the_run_counts():
    import subprocess
    import sys
    import time

    from towerrec.bench.dmt_runs import _wait

    def start(code: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)

    # one launcher exits, the other waits (as on torch's exit barrier): cut once finished
    done, waiting = start("pass"), start("import time; time.sleep(60)")
    begun = time.monotonic()
    codes, cut = _wait([done, waiting], 50, finished=lambda: True, grace_s=0.5)
    assert (codes, cut) == ([0, 0], True) and time.monotonic() - begun < 30
    assert waiting.poll() is not None  # stopped, not left behind
    # a run that did not finish is not cut: the wait runs into its timeout
    done, waiting = start("pass"), start("import time; time.sleep(60)")
    with pytest.raises(subprocess.TimeoutExpired):
        _wait([done, waiting], 2, finished=lambda: False, grace_s=0.5)
    assert waiting.poll() is not None
    # a failing launcher stops the other at once, with its code
    failed, waiting = start("raise SystemExit(3)"), start("import time; time.sleep(60)")
    codes, cut = _wait([failed, waiting], 50, finished=lambda: True, grace_s=0.5)
    assert codes[0] == 3 and not cut and waiting.poll() is not None


def test_auc_difference_over_seeds_is_the_mean_of_paired_differences():
    def seeded(auc, seed):
        return {**fake_summary(1000.0, auc, 600.0), "seed": seed}

    runs = {
        "flat_table_wise": [seeded(0.810, 0), seeded(0.820, 1), seeded(0.800, 2)],
        "dmt_partitioner": [seeded(0.809, 0), seeded(0.818, 1), seeded(0.803, 2)],
    }
    report = assemble_report(runs, LAYOUTS, 2, 2)
    rows = {row["variant"]: row for row in report["variants"]}
    assert rows["flat_table_wise"]["auc_by_seed"] == {0: 0.810, 1: 0.820, 2: 0.800}
    assert rows["flat_table_wise"]["auc"] == pytest.approx(0.810)
    vs = rows["dmt_partitioner"]["vs_flat_table_wise"]
    assert vs["auc_delta_by_seed"] == pytest.approx({0: -0.001, 1: -0.002, 2: 0.003})
    assert vs["auc_delta"] == pytest.approx(0.0)
    assert vs["auc_delta_stdev"] == pytest.approx(0.002645751, rel=1e-6)
    assert report["targets"]["auc_delta"]["met"] is True


def _case(link, gbit, flat_sps, dmt_sps, flat_bytes=600.0, dmt_bytes=100.0):
    runs = {
        "flat_table_wise": [fake_summary(flat_sps, 0.8, flat_bytes, dense_cross=0.0)],
        "dmt_partitioner": [fake_summary(dmt_sps, 0.8, dmt_bytes, dense_cross=0.0)],
    }
    for rs in runs.values():
        rs[0]["batch_size"] = 1000
    settings = {"embedding_dim": 16, "link": link, "link_gbit": gbit}
    return assemble_report(runs, LAYOUTS, 2, 2, settings, gbit)


def test_link_bound_from_flat_steps_with_and_without_the_shaped_link():
    # flat: 100 ms a step unshaped, 120 ms over the link (20 ms of link time, measured);
    # DMT sends 1/6 of flat's bytes: 20 / 6 ms at flat's seconds per byte
    unshaped = _case("unshaped", None, 10_000.0, 9_000.0)
    shaped = _case("0.048 Gbit/s", 0.048, 1000 / 0.120, 1000 / 0.110)
    (bound,) = link_bounds([shaped, unshaped])
    assert bound["flat_cross_host_ms"] == pytest.approx(20.0)
    assert bound["dmt_cross_host_ms_at_its_bytes"] == pytest.approx(20.0 / 6)
    assert bound["bound"] == pytest.approx(120.0 / (100.0 + 20.0 / 6))
    assert bound["dmt_speedup"] == pytest.approx(120.0 / 110.0)
    assert bound["fraction_of_bound"] == pytest.approx((120.0 / 110.0) / bound["bound"])
    assert bound["met"] is True  # 0.94 of the bound
    # the nominal link: 600 B x 1000 / 2 at 6 MB/s = 50 ms for flat, 100 B: 8.3 ms for DMT
    assert bound["flat_link_ms_nominal"] == pytest.approx(50.0)
    assert bound["bound_nominal"] == pytest.approx(120.0 / (120.0 - 50.0 + 50.0 / 6))
    slow = _case("0.048 Gbit/s", 0.048, 1000 / 0.120, 1000 / 0.118)
    assert link_bounds([slow, unshaped])[0]["met"] is False  # 0.87 of the bound
    # without the unshaped reference there is no measured link time
    assert "error" in link_bounds([shaped])[0]


def test_the_default_dim_is_the_models_and_number_lists_are_checked():
    from towerrec.config import ModelConfig

    assert bench_dmt.default_embedding_dim() == ModelConfig().embedding_dim == 16
    done = run_cli("bench", "dmt", "--embedding-dim", "16,x", "--variants", "flat_table_wise")
    assert done.returncode == 2
    assert "--embedding-dim '16,x': give a comma list of numbers" in done.stderr
