"""`towerrec plan`, the `plan` config section, and planning on several ranks."""

import json

import pytest
import torch
import torch.multiprocessing as mp
from conftest import run_cli as towerrec

from towerrec.build.planning import build_plan
from towerrec.config import ConfigError, load_config
from towerrec.data.synthetic import SyntheticSource
from towerrec.modules.tables import TableConfig
from towerrec.sharding import ShardingPlan


def _tables(config, source):
    return [
        TableConfig(f.name, f.num_embeddings, config.model.embedding_dim)
        for f in source.schema.sparse
    ]


def test_plan_command_writes_a_valid_plan_and_chart(tmp_path):
    out = tmp_path / "plan.json"
    result = towerrec("plan", "--world-size", "4", "--set", "plan.hosts=2", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "imbalance (max/mean)" in result.stdout
    lines = [line for line in result.stdout.splitlines() if line[:4].strip().isdigit()]
    assert len(lines) == 4  # one per device
    plan = ShardingPlan.load(out)
    assert plan.world_size == 4 and plan.hosts == 2
    config = load_config()
    plan.validate(_tables(config, SyntheticSource(config.data.synthetic)))
    assert out.with_suffix(".png").stat().st_size > 1000


def test_plan_command_on_a_suite_as_json(tmp_path, capsys):
    from towerrec.cli import main

    out = tmp_path / "p.json"
    args = ["plan", "--suite", "50", "--world-size", "8", "--planner", "lpt", "--out", str(out)]
    assert main([*args, "--json", "--save-stats", str(tmp_path / "s.json")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["planner"] == "lpt" and summary["imbalance"] >= 1
    assert len(ShardingPlan.load(out).tables) == 50
    again = ["plan", "--stats", str(tmp_path / "s.json"), "--world-size", "8", "--planner", "lpt"]
    assert main([*again, "--out", str(tmp_path / "q.json")]) == 0
    assert ShardingPlan.load(tmp_path / "q.json") == ShardingPlan.load(out)


def test_plan_command_user_errors(tmp_path, capsys):
    from towerrec.cli import main

    for args, needle in (
        (["--set", "plan.device_memory_gib=0.000001", "--world-size", "2"], "short by"),
        (["--set", "plan.planner=bogus"], "plan.planner = 'bogus' is not one of"),
        (["--world-size", "3", "--set", "plan.hosts=2"], "not a multiple of plan.hosts"),
        (["--stats", str(tmp_path / "none.json")], "does not exist"),
    ):
        assert main(["plan", "--out", str(tmp_path / "p.json"), *args]) == 2
        err = capsys.readouterr().err
        assert err.strip().startswith("error:") and needle in err and len(err.splitlines()) == 1


def test_plan_config_section():
    with pytest.raises(ConfigError, match=r"plan\.strategy = 'sometimes'"):
        load_config(overrides=["plan.strategy=sometimes"])
    with pytest.raises(ConfigError, match=r"needs plan\.path"):
        load_config(overrides=["plan.strategy=file"])
    config = load_config()
    source = SyntheticSource(config.data.synthetic)
    assert build_plan(config, source, 2) is None
    config = load_config(overrides=["plan.strategy=auto", "plan.stats_batches=2"])
    plan = build_plan(config, source, 4)
    plan.validate(_tables(config, source))
    assert plan.world_size == 4


def test_plan_file_strategy_checks_world_size(tmp_path):
    config = load_config(overrides=["plan.strategy=auto", "plan.stats_batches=1"])
    source = SyntheticSource(config.data.synthetic)
    build_plan(config, source, 2).save(tmp_path / "p.json")
    file_config = load_config(overrides=["plan.strategy=file", f"plan.path='{tmp_path}/p.json'"])
    assert build_plan(file_config, source, 2).world_size == 2
    with pytest.raises(ValueError, match="is for 2 ranks but the run has 4"):
        build_plan(file_config, source, 4)
    # --nproc 3 with that plan: one error line before any worker starts, no run directory
    out = tmp_path / "run"
    result = towerrec(
        "train", "--nproc", "3", "--out", str(out), "--set", "plan.strategy=file",
        "--set", f"plan.path={tmp_path}/p.json", "--set", "train.steps=2",
    )  # fmt: skip
    assert result.returncode == 2
    assert "error: plan" in result.stderr and "is for 2 ranks but the run has 3" in result.stderr
    assert "Traceback" not in result.stderr and "rank 0" not in result.stderr
    assert not out.exists()


def _plan_on_rank(rank, world, port, queue):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    config = load_config(overrides=["plan.strategy=auto", "plan.device_memory_gib=0.00001",
                                    "plan.stats_batches=1"])  # fmt: skip
    try:
        build_plan(config, SyntheticSource(config.data.synthetic), world)
        message = "planned"
    except ValueError as e:
        message = str(e)
    messages = [None] * world
    dist.all_gather_object(messages, message)  # every rank reaches this: no hang
    queue.put((rank, messages))
    dist.destroy_process_group()


@pytest.mark.multiprocess
def test_infeasible_plan_fails_the_same_way_on_every_rank():
    from towerrec.distributed.launch import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_plan_on_rank, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results[0] == results[1]
    first, second = results[0]
    assert first == second and "short by" in first and "table 'cat_" in first


def test_plan_calibrate_writes_constants_and_plans_with_them(tmp_path, monkeypatch, capsys):
    import towerrec.calibration as calibrate_module
    from towerrec.cli import main
    from towerrec.planner.cost import CostConstants

    slow_links = {"constants": {"intra_host_bandwidth": 1e6, "cross_host_bandwidth": 1e6,
                                "source": "calibrated in a test"}}  # fmt: skip
    monkeypatch.setattr(calibrate_module, "calibrate", lambda: slow_links)
    monkeypatch.setattr(calibrate_module, "measure_storage", lambda path: {"path": str(path)})
    out, constants = tmp_path / "p.json", tmp_path / "c.json"
    args = ["plan", "--world-size", "2", "--json", "--out", str(out)]
    assert main([*args, "--calibrate", "--calibration-out", str(constants)]) == 0
    calibrated = json.loads(capsys.readouterr().out)
    assert CostConstants.load(constants).source == "calibrated in a test"
    assert main(args) == 0
    default = json.loads(capsys.readouterr().out)
    # 1 MB/s links instead of the preset's GB/s: all-to-all dominates the predicted cost.
    assert calibrated["max_cost_ms"] > 50 * default["max_cost_ms"]
