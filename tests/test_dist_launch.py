"""The launcher end to end: ``towerrec train --nproc N --hosts H``, and failures that
stop every rank instead of hanging."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import run_cli

from towerrec.distributed import launch as launch_module
from towerrec.distributed.launch import TeardownCrashWarning, WorkerError, launch, spawn_world

REPO = Path(__file__).parent.parent
QUICK = [
    "--config",
    str(REPO / "configs" / "quick.toml"),
    "--set",
    "train.steps=6",
    "--set",
    "train.eval_every=0",
    "--set",
    "train.progress=false",
    "--set",
    "data.synthetic.eval_samples=2048",
    "--set",
    "train.eval_batch_size=1024",
]


def _cli(*args):
    return run_cli("train", *args)


def _fail_on_rank_1():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise ValueError("invalid sharding plan: no placement for tables ['t9']")
    dist.all_reduce(torch.ones(1))  # waits for rank 1, which never comes
    return "unreachable"


@pytest.mark.multiprocess
def test_a_raising_rank_stops_every_rank_with_its_error(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1: ValueError: invalid sharding plan"):
        launch(_fail_on_rank_1, (), nproc=2)
    assert time.monotonic() - start < 120  # bounded: the agent stops rank 0, no hang
    # nor the failed worker's pickled traceback (torch's pytorch-errorfile-*.pickle)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert tempfile.tempdir == str(tmp_path)  # the launch put the caller's back


def _rank_from_environment():
    return int(os.environ["RANK"])


@pytest.mark.multiprocess
def test_a_launch_leaves_nothing_in_the_temp_folder(monkeypatch, tmp_path):
    """The elastic agent's per-attempt log folders go with the launch's own temporary
    folder, not one ``torchelastic_*`` folder left behind per run."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert launch(_rank_from_environment, (), nproc=2) == {0: 0, 1: 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def _returns_rank(topology):
    dist.barrier()
    return topology.rank


def _returns_then_dies_in_teardown(topology, how):
    """Every rank returns its rank; then rank 0's process-group teardown aborts (as a
    C++ ``std::terminate`` in gloo's teardown does), or every rank's never ends."""
    if how == "hang":
        dist.destroy_process_group = lambda: time.sleep(3600)
    elif topology.rank == 0:
        dist.destroy_process_group = os.abort
    dist.barrier()
    return topology.rank


def _dies_before_returning(topology):
    if topology.rank == 1:
        os.abort()
    dist.barrier()  # rank 0 waits on its dead peer until the harness stops it
    return topology.rank


def _exits_without_returning(topology):
    if topology.rank == 1:
        os._exit(0)  # a clean exit code, but no value: the work was not done
    dist.barrier()
    return topology.rank


@pytest.mark.parametrize(
    ("exitcode", "returned", "kind", "text"),
    [
        (0, True, "clean", "rank 1 returned its value and exited cleanly"),
        (-6, True, "teardown crash", "returned its value, then was killed by SIGABRT (exit"),
        (1, True, "teardown crash", "returned its value, then exited with code 1 in teardown"),
        (None, True, "teardown crash", "then hung (still running"),
        (0, False, "failed", "rank 1 failed: it exited with code 0 without returning"),
        (-9, False, "failed", "failed: it was killed by SIGKILL (exit code -9) without"),
    ],
)
def test_each_end_of_a_rank_is_told_apart(exitcode, returned, kind, text):
    end = launch_module.rank_end(1, exitcode, returned)
    assert end.kind == kind
    assert text in end.describe()


@pytest.mark.multiprocess
def test_ranks_that_return_and_exit_cleanly_report_nothing(monkeypatch, tmp_path):
    log = tmp_path / "crashes.jsonl"
    monkeypatch.setenv(launch_module.TEARDOWN_LOG_ENV, str(log))
    with warnings.catch_warnings():
        warnings.simplefilter("error", TeardownCrashWarning)
        assert spawn_world(_returns_rank, 2, 1) == [0, 1]
    assert not log.exists()


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["abort", "hang"])
def test_a_rank_that_returned_then_died_in_teardown_is_reported(how, monkeypatch, tmp_path, capfd):
    log = tmp_path / "crashes.jsonl"
    monkeypatch.setenv(launch_module.TEARDOWN_LOG_ENV, str(log))
    if how == "hang":  # every rank hangs: none can end before the grace runs out
        monkeypatch.setattr(launch_module, "TEARDOWN_GRACE_S", 1.0)
    said = (
        r"was killed by SIGABRT \(exit code -6\)" if how == "abort" else r"hung \(still running 1 s"
    )
    with pytest.warns(TeardownCrashWarning, match=rf"rank 0 returned its value, then {said}"):
        assert spawn_world(_returns_then_dies_in_teardown, 2, 1, how) == [0, 1]
    crash = {
        "fn": f"{_returns_then_dies_in_teardown.__module__}._returns_then_dies_in_teardown",
        "kind": "teardown crash",
    }
    expected = (
        [{**crash, "rank": 0, "exitcode": -6}]
        if how == "abort"
        else [{**crash, "rank": r, "exitcode": None} for r in (0, 1)]
    )
    assert [json.loads(line) for line in log.read_text().splitlines()] == expected
    if how == "abort":  # the dying rank printed where it died
        err = capfd.readouterr().err
        assert "Fatal Python error: Aborted" in err and "in _spawned" in err


def _reports_its_surroundings(topology):
    print(f"rank {topology.rank} says hello")
    print(f"rank {topology.rank} on stderr", file=sys.stderr)
    return os.environ.get("TOWERREC_TEST_MARK"), os.getcwd(), torch.get_num_threads()


@pytest.mark.multiprocess
def test_ranks_take_the_callers_environment_directory_and_output_at_each_start(
    monkeypatch, tmp_path, capfd
):
    """Ranks are forked from a server that started with the process's first world and
    kept its environment, directory and output: a later world's ranks still see the
    caller's as they are when it starts, as spawned processes would. (Run alone, this
    test starts the server; in the suite another test may have.)"""
    with capfd.disabled():  # the server runs, started with other output than the test's
        spawn_world(_returns_rank, 2, 1)
    monkeypatch.setenv("TOWERREC_TEST_MARK", "set after the server started")
    monkeypatch.chdir(tmp_path)
    got = spawn_world(_reports_its_surroundings, 2, 1)
    assert got == [("set after the server started", str(tmp_path), 1)] * 2
    out, err = capfd.readouterr()
    assert "rank 0 says hello" in out and "rank 1 says hello" in out
    assert "rank 0 on stderr" in err and "rank 1 on stderr" in err
    monkeypatch.delenv("TOWERREC_TEST_MARK")
    assert spawn_world(_reports_its_surroundings, 2, 1)[0][0] is None


@pytest.mark.multiprocess
def test_a_rank_that_died_before_returning_fails_the_world():
    with pytest.raises(WorkerError, match=r"without a result \(rank 1: exit code -6\)"):
        spawn_world(_dies_before_returning, 2, 1)


@pytest.mark.multiprocess
def test_a_rank_that_exited_cleanly_without_returning_fails_the_world():
    with pytest.raises(WorkerError, match=r"without a result \(rank 1: exit code 0\)"):
        spawn_world(_exits_without_returning, 2, 1)


_PROVOKED = """
import os
import torch.distributed as dist
from towerrec.distributed.launch import spawn_world


def _crashes_in_teardown(topology):
    if topology.rank == 1:
        dist.destroy_process_group = os.abort
    dist.barrier()
    return topology.rank


def test_provoked():
    assert spawn_world(_crashes_in_teardown, 2, 1) == [0, 1]
"""


@pytest.mark.multiprocess
def test_the_suite_fails_a_test_whose_world_crashed_in_teardown(tmp_path):
    """The suite's own check (conftest.py), run on a test whose world's rank 1 aborts in
    teardown after returning: the test's values are right, and it still fails."""
    shutil.copy(REPO / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_provoked.py").write_text(_PROVOKED)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 passed" in result.stdout and "1 error" in result.stdout, result.stdout
    assert "a rank crashed in teardown after returning its value" in result.stdout
    assert "'rank': 1, 'kind': 'teardown crash', 'exitcode': -6" in result.stdout


@pytest.mark.multiprocess
def test_train_nproc_hosts_matches_single_process(tmp_path):
    from towerrec.config import load_config
    from towerrec.workflows.training import train

    result = _cli(*QUICK, "--nproc", "2", "--hosts", "2", "--out", str(tmp_path / "dist"))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "dist" / "summary.json").read_text())
    assert (summary["world_size"], summary["hosts"]) == (2, 2)
    assert summary["comm_bytes_per_sample_cross"] > 0  # 2 hosts: every peer is remote
    assert summary["comm_bytes_per_sample_intra"] == 0
    per_rank = summary["peak_rss_mb_per_rank"]  # each rank's peak resident memory
    assert len(per_rank) == 2 and min(per_rank) > 50 and summary["peak_rss_mb"] == max(per_rank)
    records = [
        json.loads(x) for x in (tmp_path / "dist" / "metrics.jsonl").read_text().split("\n") if x
    ]
    assert all("comm_bytes_per_sample_cross" in r for r in records if r["kind"] == "train")
    config = load_config(REPO / "configs" / "quick.toml", QUICK[3::2])
    single = train(config, tmp_path / "one")
    assert abs(summary["auc"] - single["auc"]) < 1e-3


@pytest.mark.multiprocess
def test_train_nproc_of_the_plain_dnn_matches_single_process(tmp_path):
    """DCN without cross layers or bottom MLP (the dense features into the deep MLP as
    they are) on two ranks: the single process's result."""
    from towerrec.config import load_config
    from towerrec.workflows.training import train

    dnn = ["model.name=dcn", "model.dcn.num_layers=0", "model.bottom_mlp=[]"]
    args = [*QUICK, *(x for item in dnn for x in ("--set", item))]
    result = _cli(*args, "--nproc", "2", "--out", str(tmp_path / "dist"))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "dist" / "summary.json").read_text())
    config = load_config(REPO / "configs" / "quick.toml", [*QUICK[3::2], *dnn])
    assert config.model.bottom_mlp == () and config.data.synthetic.num_dense > 0
    single = train(config, tmp_path / "one")
    assert summary["world_size"] == 2
    assert abs(summary["auc"] - single["auc"]) < 1e-3


@pytest.mark.multiprocess
def test_train_with_the_planners_plan(tmp_path):
    """plan.strategy = auto: every rank plans from the data's statistics, the same plan."""
    from towerrec.build.planning import build_plan
    from towerrec.config import load_config
    from towerrec.workflows.training import train

    overrides = ["--set", "plan.strategy=auto", "--set", "plan.stats_batches=2"]
    result = _cli(*QUICK, *overrides, "--nproc", "2", "--out", str(tmp_path / "dist"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "plan.strategy = auto" in result.stderr
    summary = json.loads((tmp_path / "dist" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["completed"]
    config = load_config(REPO / "configs" / "quick.toml", QUICK[3::2] + overrides[1::2])
    from towerrec.build.sources import build_source

    plan = build_plan(config, build_source(config.data), 2)
    assert {s.rank for tp in plan.tables.values() for s in tp.shards} == {0, 1}
    single = train(config, tmp_path / "one")
    assert abs(summary["auc"] - single["auc"]) < 2e-3


@pytest.mark.multiprocess
def test_worker_user_error_prints_one_line_and_exits_2(tmp_path):
    result = _cli(
        *QUICK,
        "--nproc",
        "2",
        "--out",
        str(tmp_path),
        "--set",
        "plan.strategy=file",
        "--set",
        "plan.path=nope.json",
    )
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "nope.json" in last and "does not exist" in last


def _crash_once(config_path, overrides, out):
    """First attempt: train 4 steps (checkpoint), then crash; the restart resumes."""
    from towerrec.config import load_config
    from towerrec.workflows.training import train
    from towerrec.workflows.worker import train_worker

    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        train(load_config(config_path, overrides), out, stop_after=4)
        raise RuntimeError("simulated crash after step 4")
    return train_worker(config_path, overrides, out, resume=False)


def _stop_then_resume(config_path, overrides, out):
    """A planned interruption at the crash's step: train 4 steps (checkpoint), then
    resume in the same process."""
    from towerrec.config import load_config
    from towerrec.workflows.training import train
    from towerrec.workflows.worker import train_worker

    train(load_config(config_path, overrides), out, stop_after=4)
    return train_worker(config_path, overrides, out, resume=True)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_elastic_restart_resumes_from_the_last_checkpoint(tmp_path):
    from towerrec.config import load_config

    overrides = QUICK[3::2]
    config_path = REPO / "configs" / "quick.toml"
    results = launch(
        _crash_once, (config_path, overrides, tmp_path / "run"), nproc=2, max_restarts=1
    )
    summary = results[0]
    assert summary["completed"] and summary["steps"] == 6
    records = [
        json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().split("\n") if x
    ]
    assert [r["step"] for r in records if r["kind"] == "train"] == sorted(
        {r["step"] for r in records if r["kind"] == "train"}
    )
    # Weight for weight: the restarted run ends where an uninterrupted 2-rank run ends.
    from test_trainer import final_state

    from towerrec.workflows.worker import train_worker

    full_summary = launch(
        train_worker, (config_path, overrides, tmp_path / "full", False), nproc=2
    )[0]
    # The byte counters are saved with the checkpoint: the restarted run reports the
    # whole run's traffic, as a run resumed at the same step does (a resumed id exchange
    # agrees its chunk capacity anew, so its first step's bytes differ from an
    # uninterrupted run's: distributed/sized_exchange.py).
    resumed = launch(_stop_then_resume, (config_path, overrides, tmp_path / "planned"), nproc=2)
    byte_fields = [k for k in full_summary if "bytes_per_sample" in k]
    assert len(byte_fields) == 6 and full_summary["total_bytes_per_sample_intra"] > 0
    assert {k: summary[k] for k in byte_fields} == {k: resumed[0][k] for k in byte_fields}
    config = load_config(config_path, overrides)
    restarted, full = final_state(tmp_path / "run", config), final_state(tmp_path / "full", config)
    assert restarted.keys() == full.keys()
    for key, value in full.items():
        assert torch.equal(restarted[key], value), key


def _sigterm_rank_1_at(step, config_path, overrides, out):
    """A worker of ``towerrec train --nproc 2`` in which rank 1 alone receives SIGTERM,
    from inside its training step ``step``: the stop request reaches one process only,
    at a known step, whatever the speed of the machine."""
    from towerrec.train import loop
    from towerrec.workflows.worker import train_worker

    if os.environ["RANK"] == "1":
        real_step, calls = loop.train_step, [0]

        def train_step(*args, **kwargs):
            calls[0] += 1
            if calls[0] == step:
                os.kill(os.getpid(), signal.SIGTERM)
            return real_step(*args, **kwargs)

        loop.train_step = train_step
    return train_worker(config_path, overrides, out, resume=False)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigterm_on_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    """Without an agreed stop step, rank 1 would write its checkpoint while rank 0 runs
    the next step's collectives (a hang until distributed.timeout_s, then an error)."""
    from test_trainer import final_state

    from towerrec.config import load_config
    from towerrec.train.checkpoint import CheckpointManager

    settings = [*QUICK[3::2], "train.steps=10", "distributed.timeout_s=60"]
    config_path = REPO / "configs" / "quick.toml"
    config = load_config(config_path, settings)
    full = _cli(
        "--config",
        str(config_path),
        *[a for s in settings for a in ("--set", s)],
        "--nproc",
        "2",
        "--out",
        str(tmp_path / "full"),
    )
    assert full.returncode == 0, full.stderr[-3000:]

    split = tmp_path / "split"
    summary = launch(_sigterm_rank_1_at, (4, config_path, settings, split), nproc=2)[0]
    assert summary["steps"] == 4 and not summary["completed"]
    assert CheckpointManager(split / "checkpoint").steps() == [4]  # one save, by both ranks
    resumed = _cli("--out", str(split), "--resume", "--nproc", "2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((split / "summary.json").read_text())["completed"]
    a, b = final_state(tmp_path / "full", config), final_state(split, config)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_a_worker_error_the_agent_missed_is_reported_over_a_lost_peer(tmp_path):
    """The agent may see only rank 0's lost connection (it stops rank 1 before seeing its
    exit); the error rank 1 wrote is the cause, and the one reported."""
    from types import SimpleNamespace

    from towerrec.distributed.launch import _root_failure

    lost = SimpleNamespace(
        message="RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:50358",
        timestamp=1,
        exitcode=1,
    )
    assert _root_failure({0: lost}, str(tmp_path)).startswith("rank 0: RuntimeError")
    (tmp_path / "rank1.txt").write_text("ValueError: invalid sharding plan: no placement")
    (tmp_path / "rank0.txt").write_text("RuntimeError: Connection closed by peer")
    assert _root_failure({0: lost}, str(tmp_path)) == (
        "rank 1: ValueError: invalid sharding plan: no placement"
    )
