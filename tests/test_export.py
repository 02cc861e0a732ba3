"""``towerrec export`` and ``towerrec predict``: the artefact scores as the trained model does.

The reference is the run's own model: its checkpoint loaded into a freshly built model
(``reference_predictions``), and the validation metrics the training process itself
logged (metrics.jsonl), which for a 2-rank run come from the sharded model.
"""

import json
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from towerrec.build.models import build_model
from towerrec.build.optimizers import build_dense_optimizer
from towerrec.build.sources import build_source
from towerrec.checksums import digests, list_files, read_checksums, write_checksums
from towerrec.cli import main
from towerrec.config import load_config
from towerrec.data.criteo import CriteoOptions, preprocess_criteo
from towerrec.data.criteo_gen import generate_criteo_files
from towerrec.data.movielens import bundled_movielens_path
from towerrec.distributed.launch import launch
from towerrec.serve import artefact as artefact_module
from towerrec.serve.artefact import ArtefactError, load_artefact
from towerrec.serve.export import export_run, quantize_rowwise
from towerrec.serve.predict import predict
from towerrec.train.checkpoint import CheckpointError, CheckpointManager
from towerrec.train.run_dir import RunDir, RunFileError
from towerrec.workflows import training as trainer
from towerrec.workflows.worker import train_worker

SMALL = [
    "train.batch_size=128",
    "train.eval_every=0",
    "train.log_every=5",
    "train.progress=false",
    "train.eval_batch_size=512",
    "optimizer.warmup_steps=2",
    "model.embedding_dim=8",
    "model.bottom_mlp=[16, 8]",
    "model.top_mlp=[16, 1]",
]
SYNTHETIC = [
    "data.synthetic.num_embeddings=[60, 30, 90, 40]",
    "data.synthetic.pooling_factors=[1, 2, 1, 3]",
    "data.synthetic.eval_samples=1001",  # not a multiple of 2 ranks nor of the batch
    "train.steps=12",
]


def train_run(out, *overrides):
    config = load_config(None, [*SMALL, *overrides])
    trainer.train(config, out)
    return out


def reference_predictions(run):
    """Click probabilities of the run's validation split from its last checkpoint, loaded
    into a model built as training builds it."""
    config = load_config(base=run / "config.toml")
    source = build_source(config.data)
    model = build_model(config, source.schema, torch.device("cpu"))
    manager = CheckpointManager(run / "checkpoint")
    state = {"step": 0, "samples": 0, "train_s": 0.0, "rng": {}}
    optimizer = build_dense_optimizer(config.optimizer, model)
    manager.load(manager.latest(), model, optimizer, state)
    model.eval()
    with torch.no_grad():
        return torch.cat(
            [torch.sigmoid(model(b.dense, b.sparse)) for b in source.eval_batches(300)]
        ).numpy()


def final_eval(run):
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "eval"][-1]


def scored(path):
    table = pq.read_table(path)
    return table["prediction"].to_numpy(), table["label"].to_numpy()


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory):
    return train_run(tmp_path_factory.mktemp("export") / "run", *SYNTHETIC)


@pytest.fixture(scope="module")
def synthetic_artefact(synthetic_run):
    out = synthetic_run.parent / "artefact"
    export_run(synthetic_run, out)
    return out


def test_export_then_predict_equals_the_runs_eval_predictions(synthetic_run, synthetic_artefact):
    out = synthetic_run.parent / "preds.parquet"
    result = predict(synthetic_artefact, out=out, progress=False)
    preds, labels = scored(out)
    expected = reference_predictions(synthetic_run)
    assert preds.shape == expected.shape == (1001,)
    np.testing.assert_allclose(preds, expected, rtol=0, atol=1e-6)
    logged = final_eval(synthetic_run)  # computed by the training process itself
    assert result["eval_samples"] == logged["eval_samples"] == 1001
    assert abs(result["auc"] - logged["auc"]) < 1e-6
    assert abs(result["logloss"] - logged["logloss"]) < 1e-6
    # without DATA: the run's validation split, labels in data order
    source = build_source(load_config(base=synthetic_run / "config.toml").data)
    eval_labels = torch.cat([b.labels for b in source.eval_batches(1001)]).numpy()
    np.testing.assert_array_equal(labels, eval_labels)
    assert result["samples_per_s"] > 0


@pytest.mark.parametrize("dtype, tolerance", [("fp16", 2e-3), ("int8", 2e-2)])
def test_smaller_tables_score_close_to_fp32(
    synthetic_run, synthetic_artefact, tmp_path, dtype, tolerance
):
    export_run(synthetic_run, tmp_path / dtype, dtype)
    result = predict(tmp_path / dtype, out=tmp_path / "p.parquet", progress=False)
    preds, _ = scored(tmp_path / "p.parquet")
    expected = reference_predictions(synthetic_run)
    difference = np.abs(preds - expected).max()
    assert 0 < difference < tolerance  # rounded tables: close, not equal
    assert abs(result["auc"] - final_eval(synthetic_run)["auc"]) < 0.01
    manifest = json.loads((tmp_path / dtype / "manifest.json").read_text())
    fp32 = json.loads((synthetic_artefact / "manifest.json").read_text())
    assert manifest["tables"]["bytes"] < fp32["tables"]["bytes"]


def test_rowwise_int8_round_trip_is_within_half_a_step():
    weight = torch.randn(50, 12)
    weight[3] = 0.25  # a constant row
    q, scale, bias = quantize_rowwise(weight)
    restored = torch.from_numpy(q).float() * torch.from_numpy(scale)[:, None]
    restored += torch.from_numpy(bias)[:, None]
    error = (restored - weight).abs()
    assert bool((error <= torch.from_numpy(scale)[:, None] / 2 + 1e-6).all())
    assert torch.equal(restored[3], weight[3])


@pytest.mark.parametrize(
    "settings",
    [
        ["model.name=dcn"],
        ["model.name=wukong", "model.wukong.num_layers=1"],
        ["model.name=dmt", "model.dmt.num_towers=2", "model.dmt.partition=contiguous"],
        ["embedding.pooling=mean"],
    ],
    ids=["dcn", "wukong", "dmt", "mean-pooling"],
)
def test_other_models_and_pooling_export(tmp_path, settings):
    run = train_run(tmp_path / "run", *SYNTHETIC, "train.steps=4", *settings)
    expected = reference_predictions(run)
    for dtype, tolerance in (("fp32", 1e-6), ("int8", 2e-2)):
        export_run(run, tmp_path / dtype, dtype)
        predict(tmp_path / dtype, out=tmp_path / "p.parquet", progress=False)
        preds, _ = scored(tmp_path / "p.parquet")
        np.testing.assert_allclose(preds, expected, rtol=0, atol=tolerance)


def test_movielens_run_scores_its_raw_files(tmp_path):
    run = train_run(
        tmp_path / "run",
        "data.source=movielens",
        "train.steps=6",
        "data.movielens.eval_fraction=0.05",
    )
    export_run(run, tmp_path / "artefact")
    result = predict(
        tmp_path / "artefact", [bundled_movielens_path()], tmp_path / "p.parquet", progress=False
    )
    preds, _ = scored(tmp_path / "p.parquet")
    np.testing.assert_allclose(preds, reference_predictions(run), rtol=0, atol=1e-6)
    assert abs(result["auc"] - final_eval(run)["auc"]) < 1e-6


@pytest.fixture(scope="module")
def criteo_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("criteo-export")
    days = generate_criteo_files(root / "raw", files=2, rows_per_file=1500, seed=4)
    options = CriteoOptions(num_embeddings=(300,), eval_files=("day_1",))
    preprocess_criteo(days, root / "cache", options, progress=False)
    return days, root / "cache"


def test_criteo_run_scores_its_cache_and_raw_tsv_alike(criteo_files, tmp_path):
    days, cache = criteo_files
    run = train_run(tmp_path / "run", "data.source=criteo", f"data.path={cache}", "train.steps=6")
    export_run(run, tmp_path / "artefact")
    result = predict(tmp_path / "artefact", out=tmp_path / "eval.parquet", progress=False)
    preds, _ = scored(tmp_path / "eval.parquet")
    np.testing.assert_allclose(preds, reference_predictions(run), rtol=0, atol=1e-6)
    assert abs(result["logloss"] - final_eval(run)["logloss"]) < 1e-6
    # day_1 is the validation file: its raw lines, hashed as the cache hashed, score alike
    raw = predict(tmp_path / "artefact", [days[1]], tmp_path / "raw.parquet", progress=False)
    raw_preds, _ = scored(tmp_path / "raw.parquet")
    np.testing.assert_array_equal(raw_preds, preds)
    assert raw["samples"] == result["samples"]


@pytest.mark.multiprocess
def test_a_two_rank_sharded_run_exports_and_scores_as_it_evaluated(tmp_path):
    overrides = [
        *SMALL,
        *SYNTHETIC,
        "distributed.sharding=row_wise",
        "distributed.timeout_s=60",
    ]
    run = tmp_path / "run"
    launch(train_worker, (None, overrides, run, False), nproc=2)
    export_run(run, tmp_path / "artefact")
    result = predict(tmp_path / "artefact", out=tmp_path / "p.parquet", progress=False)
    logged = final_eval(run)  # the sharded model's own validation, gathered over 2 ranks
    assert result["eval_samples"] == logged["eval_samples"] == 1001
    assert abs(result["auc"] - logged["auc"]) < 1e-6
    assert abs(result["logloss"] - logged["logloss"]) < 1e-6
    preds, _ = scored(tmp_path / "p.parquet")
    np.testing.assert_allclose(preds, reference_predictions(run), rtol=0, atol=1e-6)


def test_the_artefact_loads_without_towerrec(synthetic_run, synthetic_artefact, tmp_path):
    """The loader file alone, in a process where importing towerrec fails."""
    shutil.copy(artefact_module.__file__, tmp_path / "artefact_loader.py")
    source = build_source(load_config(base=synthetic_run / "config.toml").data)
    batch = next(iter(source.eval_batches(64)))
    torch.save(
        {
            "dense": batch.dense,
            "keys": batch.sparse.keys(),
            "values": batch.sparse.values(),
            "lengths": batch.sparse.lengths(),
        },
        tmp_path / "batch.pt",
    )
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["towerrec"] = None  # any import of towerrec fails
        sys.path.insert(0, {str(tmp_path)!r})
        import torch
        from artefact_loader import load_artefact
        b = torch.load({str(tmp_path / "batch.pt")!r})
        model = load_artefact({str(synthetic_artefact)!r})
        torch.save(model.predict(b["dense"], b["keys"], b["values"], b["lengths"]),
                   {str(tmp_path / "out.pt")!r})
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    got = torch.load(tmp_path / "out.pt")
    np.testing.assert_allclose(got.numpy(), reference_predictions(synthetic_run)[:64], atol=1e-6)


def _edited_copy(artefact, tmp_path, **changes):
    """A copy whose manifest says otherwise, with checksums to match (as another
    version's export would write it)."""
    copy = tmp_path / "edited"
    shutil.copytree(artefact, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest.update(changes)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    write_checksums(copy, digests(copy, list_files(copy)))
    return copy


def test_another_towerrec_version_is_refused(synthetic_artefact, tmp_path):
    copy = _edited_copy(synthetic_artefact, tmp_path, towerrec_version="0.0.1")
    with pytest.raises(ArtefactError, match=r"exported by towerrec 0\.0\.1.*export the run again"):
        predict(copy, progress=False)
    load_artefact(copy)  # the standalone loader, given no version, checks the format only


def test_another_format_version_is_refused(synthetic_artefact, tmp_path):
    copy = _edited_copy(synthetic_artefact, tmp_path, format_version=99)
    with pytest.raises(ArtefactError, match="format version 99, this loader reads version 1"):
        load_artefact(copy)


def test_missing_artefact_files_are_named(synthetic_artefact, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(synthetic_artefact, copy)
    (copy / "program.pt2").unlink()
    with pytest.raises(ArtefactError, match=r"program\.pt2 is missing.*Export the run again"):
        load_artefact(copy)
    with pytest.raises(FileNotFoundError, match=r"lacks .*program\.pt2.*export the run again"):
        load_artefact(copy, verify=False)
    table = next((synthetic_artefact / "tables").iterdir())
    shutil.copy(synthetic_artefact / "program.pt2", copy / "program.pt2")
    (copy / "tables" / table.name).unlink()
    with pytest.raises(ArtefactError, match=f"tables/{table.name} is missing"):
        load_artefact(copy)
    with pytest.raises(FileNotFoundError, match=f"lacks .*{table.name}"):
        load_artefact(copy, verify=False)
    with pytest.raises(FileNotFoundError, match="no artefact directory"):
        load_artefact(tmp_path / "nowhere")


def _flip(file, count=64):
    data = bytearray(file.read_bytes())
    for i in range(len(data) // 2, min(len(data), len(data) // 2 + count)):
        data[i] ^= 0xFF
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("kind", ["flipped table", "truncated program", "flipped manifest"])
def test_a_damaged_artefact_is_refused_naming_the_file(kind, synthetic_artefact, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(synthetic_artefact, copy)
    table = sorted((copy / "tables").iterdir())[0]
    if kind == "flipped table":
        _flip(table)
        named = f"tables/{table.name} does not match its sha256"
    elif kind == "truncated program":
        (copy / "program.pt2").write_bytes((copy / "program.pt2").read_bytes()[:1000])
        named = r"program\.pt2 has 1000 bytes"
    else:
        _flip(copy / "manifest.json", 1)
        named = r"manifest\.json does not match"
    before = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    with pytest.raises(ArtefactError, match=f"{named}.*Export the run again"):
        load_artefact(copy)
    with pytest.raises(ArtefactError, match=named):
        predict(copy, progress=False)
    assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()} == before


def test_an_artefact_without_checksums_is_refused_unless_verification_is_off(
    synthetic_artefact, tmp_path, capsys
):
    """As an artefact exported before checksums: refused, naming the fixes."""
    copy = tmp_path / "old"
    shutil.copytree(synthetic_artefact, copy)
    (copy / "checksums.json").unlink()
    with pytest.raises(
        ArtefactError, match=r"no checksums\.json.*export the run again.*--no-verify"
    ):
        load_artefact(copy)
    assert load_artefact(copy, verify=False).feature_names
    assert main(["predict", str(copy), "--no-progress"]) == 2
    assert "--no-verify" in capsys.readouterr().err
    assert main(["predict", str(copy), "--no-progress", "--no-verify"]) == 0


def test_the_artefact_lists_every_file_in_the_format_of_checkpoints(synthetic_artefact):
    entries = read_checksums(synthetic_artefact)
    assert entries is not None and sorted(entries) == list_files(synthetic_artefact)
    assert {"manifest.json", "program.pt2", "run_config.toml"} <= set(entries)
    assert any(name.startswith("tables/") for name in entries)
    artefact_module.verify_files(synthetic_artefact)


def test_export_checks_the_runs_checkpoint(synthetic_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(synthetic_run, run)
    checkpoint = CheckpointManager(run / "checkpoint").latest()
    assert checkpoint is not None
    _flip(checkpoint / "__0_0.distcp")
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp does not match.*nothing was deleted"):
        export_run(run, tmp_path / "artefact")
    assert not (tmp_path / "artefact").exists()
    shutil.copy(synthetic_run / "checkpoint" / checkpoint.name / "__0_0.distcp", checkpoint)
    (checkpoint / "checksums.json").unlink()  # a run of a towerrec before checksums
    with pytest.raises(CheckpointError, match="--no-verify"):
        export_run(run, tmp_path / "artefact")
    assert main(["export", str(run), "--out", str(tmp_path / "artefact"), "--no-verify"]) == 0
    load_artefact(tmp_path / "artefact")


def test_data_of_another_schema_is_refused(synthetic_artefact, criteo_files, tmp_path):
    with pytest.raises(ArtefactError, match="id spaces differ from the model's tables"):
        predict(synthetic_artefact, [criteo_files[1]], progress=False)
    with pytest.raises(ArtefactError, match="dense features, the model reads 13"):
        predict(synthetic_artefact, [bundled_movielens_path()], progress=False)
    with pytest.raises(ValueError, match="raw Criteo TSV needs a model trained on a Criteo"):
        predict(synthetic_artefact, criteo_files[0], progress=False)
    artefact = load_artefact(synthetic_artefact)
    dense = torch.zeros(2, artefact.num_dense)
    with pytest.raises(ArtefactError, match="lacks the sparse feature"):
        artefact.predict(dense, ["cat_0"], torch.tensor([1, 2]), torch.tensor([1, 1]))


def test_export_takes_the_weights_the_run_returned(tmp_path):
    """Under early stopping a run returns its best step's weights (best/): so does export."""
    run = train_run(tmp_path / "run", *SYNTHETIC, "train.checkpoint_every=6")
    (run / "best").mkdir()
    shutil.move(run / "checkpoint" / "step_00000006", run / "best" / "step_00000006")
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "weights_step": 6}))
    with pytest.raises(RunFileError, match=r"summary\.json changed since the run wrote it"):
        export_run(run, tmp_path / "artefact")  # a file edited by hand
    RunDir(run).write_summary({**summary, "weights_step": 6})  # as early stopping writes it
    manifest = export_run(run, tmp_path / "artefact")
    assert manifest["step"] == 6
    predict(tmp_path / "artefact", out=tmp_path / "p.parquet", progress=False)
    preds, _ = scored(tmp_path / "p.parquet")
    last = reference_predictions(run)  # the last step's weights, in checkpoint/
    assert np.abs(preds - last).max() > 1e-3
    shutil.rmtree(run / "checkpoint")
    shutil.move(run / "best", run / "checkpoint")
    np.testing.assert_allclose(preds, reference_predictions(run), rtol=0, atol=1e-6)


def test_export_refuses_an_unfinished_run(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no finished run"):
        export_run(tmp_path / "empty", tmp_path / "artefact")
    config = load_config(None, [*SMALL, *SYNTHETIC])
    trainer.train(config, tmp_path / "run", stop_after=3)  # as a stop signal ends a run
    with pytest.raises(ValueError, match=r"stopped at step 3 before it finished.*--resume"):
        export_run(tmp_path / "run", tmp_path / "artefact")
    assert not (tmp_path / "artefact").exists()


def test_command_line(synthetic_run, tmp_path, capsys):
    assert (
        main(["export", str(synthetic_run), "--out", str(tmp_path / "a"), "--tables", "fp16"]) == 0
    )
    assert "fp16" in capsys.readouterr().out
    out = tmp_path / "p.parquet"
    assert main(["predict", str(tmp_path / "a"), "--out", str(out), "--no-progress"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["samples"] == 1001 and result["tables"] == "fp16" and out.is_file()
    assert main(["predict", str(tmp_path / "missing")]) == 2
    assert "no artefact directory" in capsys.readouterr().err
