"""Per-table storage (``[embedding.tables.<name>]``): config, model, training, sharding."""

import json
from pathlib import Path

import pytest
import torch
from conftest import run_cli

from towerrec.build.models import build_model
from towerrec.config import ConfigError, load_config
from towerrec.data.synthetic import SyntheticSource

REPO = Path(__file__).parent.parent
QUICK = REPO / "configs" / "quick.toml"  # tables cat_0..cat_3: 100, 50, 200, 20 rows; cat_2 2-hot
SHORT = ["train.steps=4", "train.eval_every=0", "train.progress=false"]
MIXED = [
    "embedding.tables.cat_0.kind=qr",
    "embedding.tables.cat_0.qr_operation=add",  # 100 rows -> 25 + 4
    "embedding.tables.cat_2.kind=hash",  # 200 rows -> 50
    "embedding.tables.cat_3.kind=qr",
    "embedding.tables.cat_3.compression=2",  # 20 rows -> 10 + 2, mult
]


def quick_model(overrides):
    config = load_config(QUICK, overrides)
    schema = SyntheticSource(config.data.synthetic).schema
    return build_model(config, schema, torch.device("cpu"))


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["embedding.tables.cat_0.kind=md"], "kind = 'md' cannot be set per table"),
        (["embedding.tables.cat_0.kind=tt"], "embedding.tables.cat_0.kind = 'tt' is not one of"),
        (["embedding.tables.cat_0.compression=8"], "a 'full' table does not use"),
        (
            ["embedding.tables.cat_0.kind=hash", "embedding.tables.cat_0.qr_partitions=3"],
            "sets qr_partitions, which a 'hash' table does not use",
        ),
        (
            ["embedding.tables.cat_0.kind=qr", "embedding.tables.cat_0.compression=1"],
            r"\[embedding.tables.cat_0\] compression must be > 1",
        ),
        (["embedding.kind=md", "embedding.tables.cat_0.kind=qr"], "takes no per-table settings"),
        (["embedding.tables.cat_0.rows=5"], "unknown config key 'embedding.tables.cat_0.rows'"),
        (["embedding.tables.cat_0=qr"], "embedding.tables.cat_0 must be a table of settings"),
    ],
)
def test_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_unknown_table_name_lists_the_tables():
    with pytest.raises(ValueError, match=r"\['cat_9'\].*its tables: cat_0, cat_1, cat_2, cat_3"):
        quick_model(["embedding.tables.cat_9.kind=qr"])


def test_mixed_kinds_parameters_flops_and_training(tmp_path):
    from towerrec.workflows.training import train

    model = quick_model(MIXED)
    full = quick_model([])
    dim = 16
    expected = {"cat_0": (25 + 4) * dim, "cat_1": 50 * dim, "cat_2": 50 * dim, "cat_3": 12 * dim}
    described = {t["table"]: t for t in model.sparse.describe()}
    assert {n: t["params"] for n, t in described.items()} == expected
    assert [t["kind"] for t in described.values()] == ["qr", "full", "hash", "qr"]
    assert model.sparse.num_embedding_parameters == sum(expected.values())
    # add and mult each cost one D-wide op per sample on top of the full model
    assert model.flops_per_sample() - full.flops_per_sample() == 2 * dim

    summary = train(load_config(QUICK, [*SHORT, *MIXED]), tmp_path / "run")
    assert summary["num_embedding_params"] == sum(expected.values())
    assert [t["kind"] for t in summary["embedding_tables"]] == ["qr", "full", "hash", "qr"]
    assert summary["hash_collisions"] == 200 - 50
    assert 0 < summary["auc"] < 1
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["embedding_tables"] == summary["embedding_tables"]


@pytest.mark.parametrize("kind", ["qr", "hash"])
def test_override_on_every_table_equals_the_global_setting(tmp_path, kind):
    from towerrec.workflows.training import train

    settings = {"kind": kind, "compression": 3}
    if kind == "qr":
        settings["qr_operation"] = "add"
    glob = [f"embedding.{k}={v}" for k, v in settings.items()]
    per_table = [f"embedding.tables.cat_{i}.{k}={v}" for i in range(4) for k, v in settings.items()]
    a, b = quick_model(glob), quick_model(per_table)
    state_a, state_b = a.state_dict(), b.state_dict()
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        torch.testing.assert_close(state_a[key], state_b[key], rtol=0, atol=0)
    batch = next(SyntheticSource(load_config(QUICK).data.synthetic).train_batches(64))
    torch.testing.assert_close(a(batch.dense, batch.sparse), b(batch.dense, batch.sparse))
    runs = [
        train(load_config(QUICK, [*SHORT, *o]), tmp_path / str(i))
        for i, o in enumerate((glob, per_table))
    ]
    assert runs[0]["auc"] == runs[1]["auc"] and runs[0]["logloss"] == runs[1]["logloss"]


def test_resume_equals_uninterrupted(tmp_path):
    from towerrec.workflows.training import train

    config = load_config(
        QUICK, ["train.steps=6", "train.eval_every=0", "train.progress=false", *MIXED]
    )
    whole = train(config, tmp_path / "whole")
    train(config, tmp_path / "split", stop_after=3)
    resumed = train(config, tmp_path / "split", resume=True)
    assert resumed["auc"] == whole["auc"] and resumed["logloss"] == whole["logloss"]


def test_cli_set_with_an_unknown_table_is_one_error_line(tmp_path):
    result = run_cli(
        "train",
        "--config",
        str(QUICK),
        "--set",
        "embedding.tables.cat_7.kind=qr",
        "--out",
        str(tmp_path / "run"),
    )
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: embedding.tables names ['cat_7'], which are not tables of this model; "
        "its tables: cat_0, cat_1, cat_2, cat_3"
    ]
    assert "Traceback" not in result.stderr


@pytest.mark.multiprocess
def test_two_processes_match_one_with_per_table_storage(tmp_path):
    from towerrec.workflows.training import train

    overrides = [*SHORT, "train.steps=6", "data.synthetic.eval_samples=2048", *MIXED]
    args = [a for o in overrides for a in ("--set", o)]
    result = run_cli(
        "train", "--config", str(QUICK), *args, "--nproc", "2", "--out", str(tmp_path / "dist")
    )
    assert result.returncode == 0, result.stderr[-3000:]
    dist = json.loads((tmp_path / "dist" / "summary.json").read_text())
    single = train(load_config(QUICK, overrides), tmp_path / "one")
    assert dist["world_size"] == 2
    assert dist["embedding_tables"] == single["embedding_tables"]
    assert abs(dist["auc"] - single["auc"]) < 1e-3
    assert abs(dist["logloss"] - single["logloss"]) < 1e-4


@pytest.mark.parametrize("strategy", ["auto", "file"])
def test_planned_sharding_refuses_compressed_tables(strategy):
    from towerrec.distributed.mesh import Topology
    from towerrec.train.distributed import RunContext

    config = load_config(QUICK, [*MIXED, f"plan.strategy={strategy}", "plan.path=plan.json"])
    source = SyntheticSource(config.data.synthetic)
    context = RunContext(Topology(2, 1, 0))  # the check comes before any collective
    with pytest.raises(ValueError, match=f"plan.strategy = '{strategy}' plans the data's tables"):
        context.parallelize(quick_model(MIXED), config, source)
