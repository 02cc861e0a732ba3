"""``towerrec bench quality``: the JSON of a tiny run, the reference's independence from
towerrec, and that the reference is a real model (it learns a plain signal)."""

import ast
import inspect
import json
import types

import pytest
import torch
from conftest import run_cli

from towerrec.bench import quality_reference
from towerrec.bench.quality import early_stopped
from towerrec.bench.quality_reference import Architecture, Bag, PlainData, train_reference


def test_tiny_run_json(tmp_path):
    result = run_cli(
        "bench", "quality", "--json", "--datasets", "criteo", "--models", "dlrm",
        "--seeds", "1", "--epochs", "1", "--criteo-files", "1", "--criteo-rows", "3000",
        "--criteo-num-embeddings", "500", "--data-dir", str(tmp_path),
        "--set", "train.batch_size=256",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)  # stdout holds nothing but the JSON
    assert out["benchmark"] == "quality" and out["seeds"] == 1 and out["epochs"] == 1
    criteo = out["datasets"]["criteo"]
    assert criteo["batch_size"] == 256
    assert criteo["train_rows"] + criteo["validation_rows"] == 3000
    model = criteo["models"]["dlrm"]
    for side in ("towerrec", "reference"):
        stats = model[side]
        assert 0 <= stats["auc"] <= 1 and stats["logloss"] > 0 and stats["auc_std"] == 0
        (run,) = stats["per_seed"]
        assert run["seed"] == 0 and run["best_epoch"] == 1 and len(run["epochs"]) == 1
    # the same architecture on both sides
    assert model["towerrec"]["num_dense_params"] == model["reference"]["num_dense_params"] > 0
    diff = model["towerrec"]["auc"] - model["reference"]["auc"]
    assert model["auc_towerrec_minus_reference"] == pytest.approx(diff, abs=1e-5)
    assert isinstance(model["towerrec_within_one_std_or_above"], bool)


def test_reference_imports_nothing_from_towerrec():
    tree = ast.parse(inspect.getsource(quality_reference))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
    assert imported and not any(name.startswith("towerrec") for name in imported), imported
    own = quality_reference.__name__
    for name, value in vars(quality_reference).items():  # nor a towerrec object in its globals
        if isinstance(value, types.ModuleType):
            module = value.__name__
        else:
            module = getattr(value, "__module__", None)
        if isinstance(module, str) and module != own:
            assert not module.startswith("towerrec"), (name, module)


def test_early_stopping_keeps_the_best_epoch_before_patience_runs_out():
    losses = [0.6, 0.5, 0.55, 0.56, 0.4]
    evals = [{"epoch": i + 1, "logloss": x} for i, x in enumerate(losses)]
    assert early_stopped(evals, patience=2)["epoch"] == 2  # stopped before epoch 5
    assert early_stopped(evals, patience=3)["epoch"] == 5


def _planted(rows: int, seed: int) -> PlainData:
    """Click iff feature 0's id is even or the first dense feature is large."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 100, (rows,), generator=g)
    other = torch.randint(0, 50, (rows * 2,), generator=g)  # a 2-hot noise feature
    dense = torch.randn(rows, 3, generator=g)
    labels = ((ids % 2 == 0) ^ (dense[:, 0] > 1.0)).float()
    return PlainData(
        dense,
        labels,
        (
            Bag(ids, torch.arange(rows + 1), 100),
            Bag(other, torch.arange(0, 2 * rows + 1, 2), 50),
        ),
    )


@pytest.mark.parametrize("model", ["dlrm", "dcn", "wukong"])
def test_reference_learns_a_plain_signal(model, one_thread):
    arch = Architecture(model, embedding_dim=8, bottom_mlp=(16, 8), top_mlp=(32, 16, 1))
    result = train_reference(
        arch, _planted(6000, 0), _planted(2000, 1), epochs=4, batch_size=128, patience=2, seed=0
    )
    assert result.auc > 0.9, result.epochs
