"""towerrec sweep (a grid of runs, failures recorded, resumable) and towerrec scaling fit."""

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli

from towerrec.config import load_config
from towerrec.distributed.launch import WorkerError
from towerrec.workflows import sweep
from towerrec.workflows.sweep import read_runs, run_sweep, sweep_points

REPO = Path(__file__).parent.parent

QUICK = [
    "data.synthetic.num_embeddings=[60, 30, 90]",
    "data.synthetic.pooling_factors=[1, 2, 1]",
    "data.synthetic.eval_samples=2048",
    "train.batch_size=256",
    "train.eval_every=0",
    "train.progress=false",
    "optimizer.warmup_steps=1",
]


def test_the_grid_is_the_product_of_its_axes():
    points = sweep_points(["model.embedding_dim=8,16", "train.steps=2, 4 ,6"])
    assert len(points) == 6
    assert points[0] == ["model.embedding_dim=8", "train.steps=2"]
    assert points[-1] == ["model.embedding_dim=16", "train.steps=6"]


def test_list_values_split_at_the_commas_between_them():
    points = sweep_points(["model.top_mlp=[64,1], [256,128,1]", 'model.name="dlrm","wukong"'])
    assert [p[0] for p in points[::2]] == ["model.top_mlp=[64,1]", "model.top_mlp=[256,128,1]"]
    assert points[1] == ["model.top_mlp=[64,1]", 'model.name="wukong"']
    assert sweep_points(['data.path="a,b",c']) == [['data.path="a,b"'], ["data.path=c"]]


@pytest.mark.parametrize(
    "axes, message",
    [
        (["model.top_mlp=[64,1],[256,1"], "unclosed bracket"),
        ([], "at least one --grid"),
        (["train.steps"], "KEY=V1,V2"),
        (["train.steps="], "KEY=V1,V2"),
        (["train.steps=1,2", "train.steps=3"], "given twice"),
    ],
)
def test_bad_axes_are_refused(axes, message):
    with pytest.raises(ValueError, match=message):
        sweep_points(axes)


def test_a_bad_value_is_refused_before_any_run(tmp_path):
    with pytest.raises(ValueError, match=r"model\.embedding_dim"):
        run_sweep(None, QUICK, ["model.embedding_dim=8,-1"], tmp_path)
    assert not (tmp_path / "runs.jsonl").exists()


def test_a_failing_point_is_recorded_and_the_sweep_goes_on_then_resumes(tmp_path, monkeypatch):
    real = sweep.train
    fail = {"on": True}

    def train(config, out_dir):
        if config.train.steps == 4 and fail["on"]:
            out_dir.mkdir()  # as a run that started and then failed leaves its directory
            raise RuntimeError("out of memory (simulated)")
        return real(config, out_dir)

    monkeypatch.setattr(sweep, "train", train)
    records = run_sweep(None, QUICK, ["train.steps=2,4,6"], tmp_path)
    assert [r["status"] for r in records] == ["ok", "failed", "ok"]
    assert "out of memory" in records[1]["error"]
    ok = records[0]
    assert ok["examples"] == 2 * 256 and ok["compute"] == 3 * ok["flops"] * 512
    assert ok["params"] == ok["dense_params"] + ok["embedding_params"] > 0
    assert ok["ne"] > 0 and 0 < ok["auc"] < 1
    assert 0 < ok["oracle_ne"] < 1  # the synthetic teacher's own NE: the floor of ne

    fail["on"] = False  # the run again: finished points are skipped, the failed one retried
    again = run_sweep(None, QUICK, ["train.steps=2,4,6"], tmp_path)
    assert [r["status"] for r in again] == ["ok", "ok", "ok"]
    assert again[1]["run"] == "point-001-1"  # the failed attempt's directory is kept
    assert [r["status"] for r in read_runs(tmp_path)] == ["ok", "failed", "ok", "ok"]


@pytest.mark.parametrize("nproc, hosts", [(0, 1), (3, 2), (2, 0)])
def test_bad_process_counts_are_refused_before_any_run(tmp_path, nproc, hosts):
    with pytest.raises(ValueError, match=r"--nproc .* --hosts"):
        run_sweep(None, QUICK, ["train.steps=2"], tmp_path, nproc=nproc, hosts=hosts)
    assert not (tmp_path / "runs.jsonl").exists()


def test_points_on_the_launcher_record_rank_0s_summary_and_a_failed_worker(tmp_path, monkeypatch):
    """With nproc > 1 each point goes to the launcher with its overrides; its rank 0
    summary is the record, and a worker's failure is recorded as the point's error."""
    calls = []

    def launch(entry, args, nproc, hosts):
        config_path, overrides, out, resume = args
        calls.append((entry, overrides, nproc, hosts, resume))
        if "train.steps=4" in overrides:
            raise WorkerError("rank 1: ValueError: invalid sharding plan (simulated)")
        return {0: sweep.train(load_config(config_path, overrides), out), 1: None}

    monkeypatch.setattr(sweep, "launch", launch)
    records = run_sweep(None, QUICK, ["train.steps=2,4"], tmp_path, nproc=4, hosts=2)
    assert [c[1:] for c in calls] == [
        ([*QUICK, "train.steps=2"], 4, 2, False),
        ([*QUICK, "train.steps=4"], 4, 2, False),
    ]
    assert all(c[0] is sweep.train_worker for c in calls)
    assert [r["status"] for r in records] == ["ok", "failed"]
    assert "a worker failed: rank 1: ValueError: invalid sharding plan" in records[1]["error"]
    assert (records[0]["nproc"], records[0]["hosts"]) == (4, 2)
    assert records[0]["examples"] == 2 * 256 and records[0]["ne"] > 0
    # The finished point counts as done only at the same process layout.
    again = run_sweep(None, QUICK, ["train.steps=2"], tmp_path, nproc=4, hosts=2)
    assert len(calls) == 2 and again[0]["run"] == "point-000"

    def train(config, out):
        raise RuntimeError("ran again")

    monkeypatch.setattr(sweep, "train", train)
    (single,) = run_sweep(None, QUICK, ["train.steps=2"], tmp_path)
    assert single["status"] == "failed" and "ran again" in single["error"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sweep_nproc_2_equals_train_nproc_2_and_records_a_failing_point(tmp_path):
    base = [
        "--config", str(REPO / "configs" / "quick.toml"),
        "--set", "train.steps=6", "--set", "train.eval_every=0",
        "--set", "train.progress=false", "--set", "data.synthetic.eval_samples=2048",
        "--set", "train.eval_batch_size=1024", "--set", "plan.stats_batches=2",
        "--set", f'plan.path="{tmp_path / "nope.json"}"',
    ]  # fmt: skip
    result = run_cli(
        "sweep", *base, "--grid", 'plan.strategy="auto","file"', "--nproc", "2",
        "--out", str(tmp_path / "sweep"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_runs(tmp_path / "sweep")
    assert [r["status"] for r in records] == ["ok", "failed"]
    assert "nope.json" in records[1]["error"] and "does not exist" in records[1]["error"]
    for record in records[:1]:
        assert record["nproc"] == 2
        out = tmp_path / record["run"]
        single = run_cli(
            "train", *base, "--set", record["overrides"][0], "--nproc", "2", "--out", str(out)
        )
        assert single.returncode == 0, single.stderr[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["world_size"] == 2
        for key in ("ne", "logloss", "auc"):
            assert record[key] == summary[key], key
        assert record["examples"] == summary["steps"] * summary["batch_size"] == 6 * 512


def test_a_run_stopped_by_a_signal_is_not_a_finished_point_and_stops_the_sweep(
    tmp_path, monkeypatch
):
    real = sweep.train

    def train(config, out_dir):  # as SIGTERM after step 1 leaves the run of 4 steps
        return real(config, out_dir, stop_after=1 if config.train.steps == 4 else None)

    monkeypatch.setattr(sweep, "train", train)
    records = run_sweep(None, QUICK, ["train.steps=2,4,6"], tmp_path)
    assert [r["status"] for r in records] == ["ok", "stopped"]
    assert "stopped at step 1" in records[1]["error"] and "ne" not in records[1]
    assert [r["status"] for r in read_runs(tmp_path)] == ["ok", "stopped"]


def test_a_changed_metric_in_the_runs_file_is_refused_with_its_line(tmp_path):
    run_sweep(None, QUICK, ["train.steps=2,3"], tmp_path)
    path = tmp_path / "runs.jsonl"
    assert [r["status"] for r in read_runs(path)] == ["ok", "ok"]  # unchanged: reads
    lines = path.read_text().splitlines(keepends=True)
    ne = json.loads(lines[1])["ne"]
    at = lines[1].index(".", lines[1].index(f'"ne": {ne!r}')) + 1  # ne's first decimal
    digit = str((int(lines[1][at]) + 1) % 10)
    lines[1] = lines[1][:at] + digit + lines[1][at + 1 :]
    assert json.loads(lines[1])["ne"] != ne  # still JSON, another ne
    path.write_text("".join(lines))
    with pytest.raises(ValueError, match=r"runs\.jsonl:2 does not match its own record_sha256"):
        read_runs(tmp_path)
    record = json.loads(lines[1])
    del record["record_sha256"]  # a record from before the digest: read as it is
    lines[1] = json.dumps(record) + "\n"
    path.write_text("".join(lines))
    assert read_runs(path)[1]["ne"] == record["ne"]


def _planted_runs(path, alpha=3.0, beta=0.4, gamma=0.55):
    with path.open("w") as f:
        for examples in np.geomspace(1e3, 1e7, 9):
            ne = alpha * examples**-beta + gamma
            f.write(
                json.dumps({"status": "ok", "overrides": [], "examples": examples, "ne": ne}) + "\n"
            )
        f.write(json.dumps({"status": "failed", "overrides": [], "error": "x"}) + "\n")


def test_scaling_fit_recovers_a_planted_curve_and_plots_it(tmp_path):
    _planted_runs(tmp_path / "runs.jsonl")
    result = run_cli(
        "scaling", "fit", str(tmp_path), "--x", "examples", "--y", "ne",
        "--bootstrap", "50", "--plot", str(tmp_path / "fit.png"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    fit = json.loads(result.stdout)["fit"]
    assert fit["beta"] == pytest.approx(0.4, rel=1e-3)
    assert fit["gamma"] == pytest.approx(0.55, rel=1e-3)
    assert fit["alpha"] == pytest.approx(3.0, rel=1e-3)
    assert (tmp_path / "fit.png").read_bytes()[:4] == b"\x89PNG"


def test_scaling_fit_of_too_few_points_is_a_clear_error(tmp_path):
    (tmp_path / "runs.jsonl").write_text(
        "".join(
            json.dumps({"status": "ok", "overrides": [], "examples": n, "ne": 1 / n}) + "\n"
            for n in (10, 20, 40)
        )
    )
    result = run_cli("scaling", "fit", str(tmp_path))
    assert result.returncode == 2
    assert "too few points to fit" in result.stderr


def test_scaling_fit_of_a_rising_loss_says_there_is_no_scaling(tmp_path):
    (tmp_path / "runs.jsonl").write_text(
        "".join(
            json.dumps({"status": "ok", "overrides": [], "examples": n, "ne": 0.8 - 2 / n}) + "\n"
            for n in (10, 20, 40, 80, 160)
        )
    )
    result = run_cli("scaling", "fit", str(tmp_path), "--bootstrap", "0")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["fit"]["alpha"] < 0 and out["fit"]["falls"] is False
    assert "does not fall with examples" in out["warning"]
    assert "does not fall with examples" in result.stderr
    planted = tmp_path / "planted"
    planted.mkdir()
    _planted_runs(planted / "runs.jsonl")
    falling = json.loads(run_cli("scaling", "fit", str(planted), "--bootstrap", "0").stdout)
    assert falling["fit"]["falls"] is True and "warning" not in falling


@pytest.mark.slow
def test_sweep_then_fit_through_the_command_line(tmp_path):
    sets = [x for s in QUICK for x in ("--set", s)]
    result = run_cli(
        "sweep", *sets, "--grid", "train.steps=2,4,8,16", "--out", str(tmp_path / "sweep"),
        OMP_NUM_THREADS="1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads(result.stdout)
    assert summary["points"] == 4 and summary["failed"] == []
    fitted = run_cli("scaling", "fit", str(tmp_path / "sweep"), "--bootstrap", "20")
    assert fitted.returncode == 0, fitted.stderr
    result = json.loads(fitted.stdout)
    assert len(result["points"]) == 4 and np.isfinite(result["fit"]["gamma"])
