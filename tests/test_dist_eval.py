"""Evaluation on several ranks whose slices of the eval split differ in length.

Rank r of w evaluates rows [r*N//w, (r+1)*N//w): when N is not a multiple of w
the slices (and the number of eval batches) differ. Every rank must still run
the same number of forwards (a sharded forward holds all-to-alls), and the
metrics must be those of the whole split.
"""

import json

import pytest
import torch
from conftest import run_cli

from towerrec.build.models import build_model
from towerrec.build.optimizers import build_dense_optimizer
from towerrec.build.sources import build_source
from towerrec.config import load_config
from towerrec.data.criteo import CriteoOptions, preprocess_criteo
from towerrec.data.criteo_gen import generate_criteo_files
from towerrec.distributed.launch import spawn_world
from towerrec.train.checkpoint import CheckpointManager
from towerrec.train.distributed import start_distributed
from towerrec.train.step import evaluate
from towerrec.workflows import training as trainer

EVAL_ROWS = 1001  # odd: uneven over 2 and over 4 ranks

SMALL = [
    "train.batch_size=128",
    "train.progress=false",
    "optimizer.warmup_steps=2",
    "model.embedding_dim=8",
    "model.bottom_mlp=[16, 8]",
    "model.top_mlp=[16, 1]",
]


@pytest.fixture(scope="module")
def criteo_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("criteo-dist-eval")
    days = generate_criteo_files(root / "raw", files=2, rows_per_file=EVAL_ROWS, seed=5)
    options = CriteoOptions(num_embeddings=(500,), eval_files=("day_1",))
    preprocess_criteo(days, root / "cache", options, progress=False)
    return root / "cache"


def _train_cli(out, *overrides, nproc=2, hosts=1):
    sets = [x for s in overrides for x in ("--set", s)]
    result = run_cli(
        "train", "--out", str(out), "--nproc", str(nproc), "--hosts", str(hosts), *sets,
        OMP_NUM_THREADS="1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


@pytest.mark.multiprocess
@pytest.mark.slow
def test_movielens_on_2_ranks_evaluates_the_whole_split(tmp_path):
    overrides = [
        "train.steps=4",
        "train.eval_every=2",
        "train.progress=false",
        "train.eval_batch_size=4096",
    ]
    config_path = "configs/movielens.toml"
    sets = [x for s in overrides for x in ("--set", s)]
    result = run_cli(
        "train", "--config", config_path, "--nproc", "2", "--out", str(tmp_path / "two"), *sets,
        OMP_NUM_THREADS="1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    one = trainer.train(load_config(config_path, overrides), tmp_path / "one")
    assert two["world_size"] == 2 and two["completed"]
    assert two["eval_samples"] == one["eval_samples"]
    assert one["eval_samples"] % 2 == 1  # the bundled split is uneven over 2 ranks
    assert abs(two["auc"] - one["auc"]) < 1e-3
    assert abs(two["logloss"] - one["logloss"]) < 1e-3


@pytest.mark.multiprocess
@pytest.mark.slow
def test_criteo_cache_on_2_ranks_and_on_2_hosts_x_2(criteo_cache, tmp_path):
    # A global eval batch of 1000: 2 ranks read 500 + 501 rows (1 and 2 batches),
    # 4 ranks 250 + 250 + 250 + 251 (1, 1, 1 and 2 batches).
    overrides = [
        *SMALL,
        "data.source=criteo",
        f"data.path={criteo_cache}",
        "train.steps=6",
        "train.eval_every=3",
        "train.eval_batch_size=1000",
    ]
    one = trainer.train(load_config(None, overrides), tmp_path / "one")
    two = _train_cli(tmp_path / "two", *overrides, nproc=2)
    four = _train_cli(tmp_path / "four", *overrides, nproc=4, hosts=2)
    assert (four["world_size"], four["hosts"]) == (4, 2)
    for summary in (one, two, four):
        assert summary["eval_samples"] == EVAL_ROWS and summary["completed"]
        assert abs(summary["auc"] - one["auc"]) < 1e-3
        assert abs(summary["logloss"] - one["logloss"]) < 1e-3
    evals = [
        json.loads(line)
        for line in (tmp_path / "four" / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["kind"] == "eval"
    ]
    assert [e["step"] for e in evals] == [3, 6]  # training went on after the first evaluation


def _evaluate_checkpoint(topology, overrides, checkpoint_dir):
    """The trainer's evaluation of the checkpoint's model on this world."""
    config = load_config(None, overrides)
    device = torch.device("cpu")
    ctx = start_distributed(config, device)
    source = build_source(config.data)
    model = build_model(config, source.schema, device, materialize_embeddings=ctx.world_size == 1)
    model = ctx.parallelize(model, config, source)
    optimizer = build_dense_optimizer(config.optimizer, model)
    manager = CheckpointManager(checkpoint_dir)
    manager.load(manager.latest(), model, optimizer, {"step": 0})
    local = ctx.local_batch(config.train.eval_batch_size)
    metrics = evaluate(
        model,
        source.eval_batches(local, ctx.rank, ctx.world_size),
        device,
        ctx=ctx,
        padding=next(iter(source.eval_batches(1))),
    )
    return metrics.as_dict()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_one_checkpoint_evaluates_the_same_on_1_2_and_4_ranks(criteo_cache, tmp_path):
    base = [*SMALL, "data.source=criteo", f"data.path={criteo_cache}"]
    trained = trainer.train(
        load_config(
            None, [*base, "train.steps=6", "train.eval_every=0", "train.eval_batch_size=250"]
        ),
        tmp_path / "run",
    )
    checkpoints = tmp_path / "run" / "checkpoint"
    results = {}
    # The same local eval batch (250 rows) on every world, so every row is predicted
    # in the same batch as on one process: 4 x 250 + 1 rows.
    for world, hosts in ((1, 1), (2, 1), (4, 2)):
        overrides = [*base, f"train.eval_batch_size={250 * world}"]
        per_rank = spawn_world(_evaluate_checkpoint, world, hosts, overrides, checkpoints)
        assert all(r == per_rank[0] for r in per_rank)  # every rank computed the same metrics
        results[world] = per_rank[0]
    assert results[1]["eval_samples"] == EVAL_ROWS
    assert abs(results[1]["auc"] - trained["auc"]) < 1e-6  # the trainer's own evaluation
    for world in (2, 4):
        assert results[world]["eval_samples"] == EVAL_ROWS
        assert abs(results[world]["auc"] - results[1]["auc"]) < 1e-6
        assert abs(results[world]["logloss"] - results[1]["logloss"]) < 1e-6
