"""The augmentation service (``towerrec distill serve``), its period files and
``AugmentedPeriods``: each unique example scored once, nothing lost or duplicated by a
kill, trainers reading as shards land, and clear errors for bad input.

Two students read windows of one synthetic stream: ``a`` periods 0-2, ``b`` periods 1-3,
so stream periods 1 and 2 (600 rows) are shared, 1200 examples are unique in all.
"""

import functools
import json
import multiprocessing
import os
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from towerrec.build.sources import build_periods, build_source
from towerrec.cli import main
from towerrec.config import load_config
from towerrec.data.augmented import (
    TEACHER_LOGIT,
    AugmentedConfig,
    AugmentedPeriods,
    AugmentedTimeout,
)
from towerrec.data.cache import CacheError, PartWriter, read_manifest, write_manifest
from towerrec.data.loader import SplitRows
from towerrec.data.period_files import SPLIT, open_period, read_stream, write_periods
from towerrec.data.periods import ColumnPeriods, PeriodSource
from towerrec.data.synthetic import SyntheticConfig, SyntheticSource
from towerrec.serve.artefact import ArtefactError, load_artefact
from towerrec.serve.export import export_run
from towerrec.workflows import training as trainer
from towerrec.workflows.distill.augment import COUNTERS, CRASH_ENV, AugmentService, Counts, Memo

CONFIGS = Path(__file__).parent.parent / "configs"
ROWS = 300  # per period
TABLES = [60, 30, 90, 40]
POOLING = [1, 2, 1, 3]
UNIQUE = 4 * ROWS
STREAM = [
    f"data.synthetic.num_embeddings={TABLES}",
    f"data.synthetic.pooling_factors={POOLING}",
    "data.synthetic.eval_samples=500",
]


def stream(**changes):
    config = dict(num_embeddings=tuple(TABLES), pooling_factors=tuple(POOLING), periods=4,
                  period_samples=ROWS, seed=3, eval_samples=500)  # fmt: skip
    config.update(changes)
    return SyntheticSource(SyntheticConfig(**config))


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    root = tmp_path_factory.mktemp("teacher")
    overrides = [
        *STREAM, "train.batch_size=128", "train.steps=4", "train.eval_every=0",
        "train.progress=false", "optimizer.warmup_steps=1", "model.embedding_dim=8",
        "model.bottom_mlp=[16, 8]", "model.top_mlp=[16, 1]",
    ]  # fmt: skip
    trainer.train(load_config(None, overrides), root / "run")
    export_run(root / "run", root / "export")
    return root / "export"


@pytest.fixture(scope="module")
def students(tmp_path_factory):
    root = tmp_path_factory.mktemp("students")
    write_periods(stream(), root / "a", range(0, 3))
    write_periods(stream(), root / "b", range(1, 4))
    return root / "a", root / "b"


@functools.cache
def loaded(teacher_dir):
    return load_artefact(teacher_dir)


def direct_logits(teacher_dir, student, period):
    """The teacher run directly on all of one student period, in one batch."""
    data = read_stream(student)
    part = open_period(data, period)
    batch = SplitRows([part.columns]).gather(np.arange(part.columns.rows), data.single, data.multi)
    kjt = batch.sparse
    return loaded(teacher_dir).logits(batch.dense, kjt.keys(), kjt.values(), kjt.lengths())


def count_teacher_rows(service):
    """Wrap the service's teacher so that every row it scores is counted."""
    calls = {"rows": 0}
    logits = service.teacher.logits

    def counted(dense, *args, **kwargs):
        calls["rows"] += dense.shape[0]
        return logits(dense, *args, **kwargs)

    service.teacher.logits = counted
    return calls


def check_complete(out, teacher_dir, students):
    """Every period of every student is in its manifest once, as a final shard, with the
    teacher's logits; no temp directories are left; the counters add up."""
    for student in students:
        aug = out / student.name
        manifest = read_manifest(aug)
        assert [p["period"] for p in manifest["parts"]] == [0, 1, 2]
        assert sorted(d.name for d in (aug / "parts").iterdir()) == [
            "period-00000", "period-00001", "period-00002",
        ]  # fmt: skip
        reader = AugmentedPeriods(aug, timeout_s=0)
        for period in range(3):
            shard = reader.shard(period)
            expected = direct_logits(teacher_dir, student, period)
            torch.testing.assert_close(torch.from_numpy(np.array(shard.teacher_logits)), expected)
            assert np.array_equal(shard.example_ids, open_period(read_stream(student), period)
                                  .example_ids)  # fmt: skip
    counters = json.loads((out / COUNTERS).read_text())
    assert counters["teacher_calls"] == UNIQUE == counters["unique_examples"]
    assert counters["rows"] == 6 * ROWS
    assert counters["duplicates"] == 6 * ROWS - UNIQUE
    assert counters["shards_written"] == 6
    return counters


def test_period_files_carry_the_streams_rows_and_ids(students):
    a, b = students
    source = stream()
    for student, first in ((a, 0), (b, 1)):
        data = read_stream(student)
        assert data.num_periods == 3 and data.period_rows == [ROWS] * 3
        assert data.complete() == [0, 1, 2]
        for period in range(3):
            part = open_period(data, period)
            want = next(source.period_batches(first + period, 10_000))
            assert np.array_equal(part.columns.labels, want.labels.numpy())
            assert np.array_equal(part.columns.dense, want.dense.numpy())
            ids = np.arange(ROWS, dtype=np.int64) + (first + period) * ROWS
            assert np.array_equal(part.example_ids, ids)  # the row's place in the stream


def test_the_teacher_scores_each_unique_example_once(teacher, students, tmp_path):
    service = AugmentService(teacher, list(students), tmp_path / "out", batch_size=128)
    scored = count_teacher_rows(service)
    service.run(once=True)
    assert scored["rows"] == UNIQUE  # counted at the teacher itself
    counters = check_complete(tmp_path / "out", teacher, students)
    assert counters["students"]["a"]["teacher_calls"] == 3 * ROWS
    assert counters["students"]["b"]["teacher_calls"] == ROWS  # only its last period is new
    # a restart recomputes nothing and writes nothing
    again = AugmentService(teacher, list(students), tmp_path / "out")
    rescored = count_teacher_rows(again)
    assert again.run(once=True) == counters
    assert rescored["rows"] == 0


def _serve(teacher, students, out, crash, once=True):
    torch.set_num_threads(1)
    if crash:
        os.environ[CRASH_ENV] = crash
    AugmentService(teacher, list(students), out, batch_size=128).run(once=once, poll_s=0.05)


def _fork(target, *args):
    process = multiprocessing.get_context("fork").Process(target=target, args=args)
    process.start()
    return process


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("crash", "scored_before"),
    [("a:1:memo", 2 * ROWS), ("a:1:write", 2 * ROWS), ("b:0:shard", 3 * ROWS)],
)
def test_a_killed_service_restarts_without_losing_or_duplicating(
    teacher, students, tmp_path, crash, scored_before
):
    out = tmp_path / "out"
    child = _fork(_serve, teacher, students, out, crash)
    child.join(120)
    assert child.exitcode == -9  # SIGKILL at the hook
    student, period, _ = crash.split(":")
    listed = [p["period"] for p in read_manifest(out / student)["parts"]]
    assert listed == list(range(int(period)))  # the killed period is not listed
    service = AugmentService(teacher, list(students), out, batch_size=128)
    scored = count_teacher_rows(service)
    service.run(once=True)
    assert scored["rows"] == UNIQUE - scored_before  # the memo kept what was scored
    check_complete(out, teacher, students)


@pytest.mark.multiprocess
def test_a_trainer_reads_every_period_while_the_service_writes(teacher, tmp_path):
    student, out = tmp_path / "c", tmp_path / "out"

    def produce():
        write_periods(stream(), student, on_period=lambda p: time.sleep(0.2))

    producer = _fork(produce)
    service = _fork(_serve, teacher, [student], out, None, False)  # follows until done
    reader = AugmentedPeriods(out / "c", timeout_s=120, poll_s=0.05)  # before anything lands
    source = stream()
    for period in range(reader.num_periods):
        got = list(reader.period_batches(period, 128))
        want = list(source.period_batches(period, 128))
        assert [b.size for b in got] == [b.size for b in want]
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g.labels, w.labels) and torch.equal(g.dense, w.dense)
        logits = torch.cat([b.teacher_logits for b in got])
        torch.testing.assert_close(logits, direct_logits(teacher, student, period))
    producer.join(60)
    service.join(60)
    assert producer.exitcode == 0 and service.exitcode == 0


def test_a_teacher_of_other_features_is_refused(teacher, tmp_path):
    write_periods(stream(num_embeddings=(60, 30, 90, 41)), tmp_path / "s", range(0, 1))
    service = AugmentService(teacher, [tmp_path / "s"], tmp_path / "out")
    with pytest.raises(ArtefactError, match="feature 'cat_3': the teacher's table has 40 rows"):
        service.run(once=True)
    write_periods(stream(num_dense=3), tmp_path / "d", range(0, 1))
    service = AugmentService(teacher, [tmp_path / "d"], tmp_path / "out2")
    with pytest.raises(ArtefactError, match="dense width: the teacher reads 13, the student"):
        service.run(once=True)
    assert not (tmp_path / "out" / "s" / "parts").exists()  # nothing written


def _rewrite_shard(aug, period, logits):
    """Write period ``period``'s shard again with ``logits`` (None: no logit column), its
    checksums correct: what a faulty writer would leave."""
    manifest = read_manifest(aug)
    shard = AugmentedPeriods(aug, timeout_s=0).shard(period)
    columns = shard.rows.parts[0]
    writer = PartWriter(aug, manifest["parts"][period]["name"], columns.dense.shape[1],
                        list(columns.multi))  # fmt: skip
    multi = {n: (np.asarray(v), np.diff(o).astype(np.int32)) for n, (v, o) in columns.multi.items()}
    writer.append(SPLIT, np.asarray(columns.labels), np.asarray(columns.dense),
                  np.asarray(columns.sparse), multi)  # fmt: skip
    writer.append_column(SPLIT, "example_id", np.asarray(shard.example_ids))
    if logits is not None:
        writer.append_column(SPLIT, TEACHER_LOGIT, logits)
    entry = writer.finish({"period": period})
    manifest["parts"][period] = entry
    write_manifest(aug, {k: v for k, v in manifest.items() if k not in ("format", "version")})


def test_a_shard_with_a_missing_or_non_finite_logit_is_refused(teacher, students, tmp_path):
    out = tmp_path / "out"
    AugmentService(teacher, [students[0]], out).run(once=True)
    aug = out / "a"
    logits = np.array(AugmentedPeriods(aug, timeout_s=0).shard(1).teacher_logits)
    logits[7] = np.nan
    _rewrite_shard(aug, 1, logits)
    reader = AugmentedPeriods(aug, timeout_s=0)
    assert len(list(reader.period_batches(0, 128))) == 3  # period 0 is fine
    with pytest.raises(ValueError, match=r"period-00001 \(period 1\): the teacher logit of row 7"):
        list(reader.period_batches(1, 128))
    _rewrite_shard(aug, 2, None)
    with pytest.raises(ValueError, match=r"period-00002 \(period 2\) has no teacher-logit column"):
        list(AugmentedPeriods(aug, timeout_s=0).period_batches(2, 128))


def test_periods_out_of_order_are_refused(teacher, students, tmp_path):
    student = tmp_path / "a"
    shutil.copytree(students[0], student)
    manifest = read_manifest(student)
    body = {k: v for k, v in manifest.items() if k not in ("format", "version")}
    # period 1 listed, period 0 not (a gap, or period 0 arriving after period 1)
    write_manifest(student, {**body, "parts": body["parts"][1:]})
    service = AugmentService(teacher, [student], tmp_path / "out")
    with pytest.raises(ValueError, match="lists period 1 where period 0 belongs"):
        service.run(once=True)
    # a period rewritten after it was augmented
    write_manifest(student, body)
    AugmentService(teacher, [student], tmp_path / "out").run(once=True)
    shutil.rmtree(student)
    write_periods(stream(seed=4), student, range(0, 3))
    with pytest.raises(ValueError, match=r"period 0 of .* changed after it was augmented"):
        AugmentService(teacher, [student], tmp_path / "out").run(once=True)


def test_a_period_that_does_not_land_times_out_naming_the_service(teacher, students, tmp_path):
    student = tmp_path / "a"
    shutil.copytree(students[0], student)
    manifest = read_manifest(student)
    body = {k: v for k, v in manifest.items() if k not in ("format", "version")}
    write_manifest(student, {**body, "parts": body["parts"][:2]})  # period 2 not yet there
    AugmentService(teacher, [student], tmp_path / "out").run(once=True)
    reader = AugmentedPeriods(tmp_path / "out" / "a", timeout_s=0.3, poll_s=0.05)
    assert isinstance(reader, PeriodSource)
    assert reader.num_periods == 3 and len(list(reader.period_batches(1, 128))) == 3
    with pytest.raises(AugmentedTimeout, match=r"period 2 of .* has not landed after 0\.3 s.*"
                       r"towerrec distill serve"):  # fmt: skip
        list(reader.period_batches(2, 128))
    with pytest.raises(AugmentedTimeout, match="its manifest"):
        AugmentedPeriods(tmp_path / "nothing", timeout_s=0)


def test_config_and_command_line(teacher, tmp_path, capsys):
    with pytest.raises(ValueError, match=r"needs data\.augmented\.dir"):
        load_config(None, ["data.source=augmented"])
    with pytest.raises(ValueError, match="wait_s must be >= 0"):
        AugmentedConfig(dir="x", wait_s=-1)
    config = load_config(
        None, ["data.source=augmented", f"data.augmented.dir={tmp_path}", "data.augmented.wait_s=5"]
    )
    assert config.data.augmented == AugmentedConfig(dir=str(tmp_path), wait_s=5.0)
    with pytest.raises(ValueError, match="train on it with `towerrec replay`"):
        build_source(config.data)
    with pytest.raises(ValueError, match=r"periods 2:9 is not a window of the source's 4"):
        write_periods(stream(), tmp_path / "w", range(2, 9))
    sets = [
        "--set", "data.synthetic.periods=3", "--set", "data.synthetic.period_samples=100",
        *[arg for s in STREAM for arg in ("--set", s)],
    ]  # fmt: skip
    assert main(["data", "periods", str(tmp_path / "s"), *sets, "--periods", "1:3"]) == 0
    assert read_stream(tmp_path / "s").period_rows == [100, 100]
    serve = ["distill", "serve", "--teacher", str(teacher), "--watch", str(tmp_path / "s")]
    assert main([*serve, "--out", str(tmp_path / "out"), "--once"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["teacher_calls"] == 200 and printed["shards_written"] == 2
    assert main(["data", "periods", str(tmp_path / "s"), *sets]) == 2  # not a fresh dir
    assert "already holds period files" in capsys.readouterr().err


@pytest.mark.slow
def test_replay_trains_on_an_augmented_movielens_stream(tmp_path, capsys):
    """A MovieLens teacher's export augments a MovieLens student stream, end to end
    through the command line, and ``towerrec replay`` trains through it."""
    ml = ["--config", str(CONFIGS / "movielens.toml"), "--set", "train.progress=false"]
    run, export = tmp_path / "fm", tmp_path / "fm-export"
    short = ["--set", "train.steps=10", "--set", "train.eval_every=0"]
    assert main(["train", *ml, *short, "--out", str(run)]) == 0
    assert main(["export", str(run), "--out", str(export)]) == 0
    periods = ["--set", "data.movielens.periods=3"]
    assert main(["data", "periods", str(tmp_path / "ml"), *ml, *periods]) == 0
    out = tmp_path / "aug"
    assert main(["distill", "serve", "--teacher", str(export), "--watch", str(tmp_path / "ml"),
                 "--out", str(out), "--once"]) == 0  # fmt: skip
    rows = read_stream(tmp_path / "ml").period_rows
    counters = json.loads((out / COUNTERS).read_text())
    assert counters["teacher_calls"] == sum(rows) and counters["shards_written"] == 3
    reader = AugmentedPeriods(out / "ml", timeout_s=0)
    batch = next(reader.period_batches(2, 512))
    # the teacher scored the rows as the source holds them (its program standardises them
    # by its own run's transform), not rows standardised already
    source = build_periods(
        load_config(CONFIGS / "movielens.toml", ["data.movielens.periods=3"]).data
    )
    assert isinstance(source, ColumnPeriods)
    raw = next(source.raw().period_batches(2, 512))
    kjt = raw.sparse
    expected = loaded(export).logits(raw.dense, kjt.keys(), kjt.values(), kjt.lengths())
    torch.testing.assert_close(batch.teacher_logits, expected)
    assert not torch.equal(raw.dense, batch.dense)  # the student reads them standardised
    augmented = ["--set", "data.source=augmented", "--set", f"data.augmented.dir={out / 'ml'}"]
    assert main(["replay", *ml, *augmented, "--out", str(tmp_path / "replay")]) == 0
    summary = json.loads((tmp_path / "replay" / "replay.json").read_text())
    assert summary["period_rows"] == rows
    assert [r["period"] for r in summary["results"]] == [1, 2]
    assert all(0.5 < r["auc"] < 1 for r in summary["results"])


def test_an_output_of_another_teacher_or_without_its_memo_is_refused(teacher, students, tmp_path):
    out = tmp_path / "out"
    AugmentService(teacher, [students[0]], out).run(once=True)
    manifest = read_manifest(out / "a")
    body = {k: v for k, v in manifest.items() if k not in ("format", "version")}
    other = {**body, "teacher": {"path": "/elsewhere", "program_sha256": "0" * 64}}
    write_manifest(out / "a", other)
    with pytest.raises(ValueError, match="augmented by another teacher"):
        AugmentService(teacher, [students[0]], out)
    write_manifest(out / "a", body)
    shutil.rmtree(out / "memo")
    with pytest.raises(ValueError, match=r"lists periods \[0, 1, 2\] whose memo files are missing"):
        AugmentService(teacher, [students[0]], out)


@pytest.mark.parametrize("damage", ["cut", "byte"])
def test_a_damaged_memo_file_is_refused_naming_it(tmp_path, damage):
    ids = np.arange(0, 400, 2, dtype=np.int64)
    Memo(tmp_path).add("a", 0, ids, np.ones(ids.size, np.float32), Counts(ids.size, 0, ids.size))
    file = tmp_path / "a.0.npz"
    raw = bytearray(file.read_bytes())
    if damage == "cut":
        raw = raw[: len(raw) // 2]
    else:
        raw[len(raw) // 4] ^= 0xFF  # inside the ids array
    file.write_bytes(raw)
    with pytest.raises(CacheError, match=rf"memo file {file} is damaged.*fresh --out directory"):
        Memo(tmp_path)


@pytest.mark.multiprocess
def test_a_following_service_killed_from_outside_resumes(teacher, students, tmp_path):
    """The service follows a producer that pauses after period 1; it is SIGKILLed from
    outside while it waits, the producer finishes, and a restart completes the rest."""
    student, out = tmp_path / "a", tmp_path / "out"
    go_on = multiprocessing.get_context("fork").Event()

    def produce():
        write_periods(stream(), student, range(0, 3), on_period=lambda p: p == 1 and go_on.wait())

    producer = _fork(produce)
    service = _fork(_serve, teacher, [student, students[1]], out, None, False)
    deadline = time.monotonic() + 120
    while not (out / "a" / "manifest.json").is_file() or len(read_manifest(out / "a")["parts"]) < 2:
        assert time.monotonic() < deadline and service.is_alive()
        time.sleep(0.05)
    os.kill(service.pid, signal.SIGKILL)
    service.join(60)
    assert service.exitcode == -signal.SIGKILL
    go_on.set()
    producer.join(60)
    assert producer.exitcode == 0
    AugmentService(teacher, [student, students[1]], out).run(once=True)
    check_complete(out, teacher, [student, students[1]])


def test_a_students_periods_hold_the_sources_values_and_read_as_a_run_on_it(tmp_path):
    """Period files of a MovieLens source hold its dense values untransformed, with the
    transform ``towerrec train`` fits recorded beside them; the student's augmented
    periods read exactly what ``towerrec replay`` on the source reads."""
    config = load_config(CONFIGS / "movielens.toml", ["data.movielens.periods=3"])
    source = build_periods(config.data)
    assert isinstance(source, ColumnPeriods) and source.dense_transform is not None
    write_periods(source, tmp_path / "ml", description="data.source = movielens")
    data = read_stream(tmp_path / "ml")
    assert data.manifest["stream"]["dense_transform"] == source.dense_transform.describe()
    raw = source.raw()
    for period in range(3):
        want = next(raw.period_batches(period, 100_000))
        assert np.array_equal(open_period(data, period).columns.dense, want.dense.numpy())
    # the service copies the record; its reader applies it
    out = tmp_path / "aug"
    manifest = {"source": "augmented", "schema": data.manifest["schema"],
                "stream": data.manifest["stream"], "parts": []}  # fmt: skip
    out.mkdir()
    write_manifest(out, manifest)
    for period in range(3):
        part = open_period(data, period)
        writer = PartWriter(out, f"period-{period:05d}", data.schema.num_dense, data.multi)
        columns = part.columns
        multi = {n: (np.asarray(v), np.diff(o).astype(np.int32))
                 for n, (v, o) in columns.multi.items()}  # fmt: skip
        writer.append(SPLIT, np.asarray(columns.labels), np.asarray(columns.dense),
                      np.asarray(columns.sparse), multi)  # fmt: skip
        writer.append_column(SPLIT, "example_id", np.asarray(part.example_ids))
        writer.append_column(SPLIT, TEACHER_LOGIT, np.zeros(columns.rows, dtype=np.float32))
        manifest["parts"].append(writer.finish({"period": period}))
        write_manifest(out, manifest)
    reader = AugmentedPeriods(out, timeout_s=0)
    for period in range(3):
        got = list(reader.period_batches(period, 256))
        want = list(source.period_batches(period, 256))
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g.dense, w.dense) and torch.equal(g.labels, w.labels)
    # a student configured with data.loader.dense = "none" reads the files' values
    student = ["data.source=augmented", f"data.augmented.dir={out}", "data.augmented.wait_s=0"]
    for dense, want_source in (("auto", source), ("none", raw)):
        config = load_config(CONFIGS / "movielens.toml", [*student, f"data.loader.dense={dense}"])
        got = next(build_periods(config.data).period_batches(1, 256))
        assert torch.equal(got.dense, next(want_source.period_batches(1, 256)).dense)


def test_period_directories_without_the_transform_record_are_refused(students, tmp_path):
    """A period directory written before the transform was recorded holds a file or
    MovieLens source's dense columns standardised already: refused, naming the fix; a
    synthetic stream's (no transform) is read as before; a damaged record is refused."""
    old = tmp_path / "old"
    shutil.copytree(students[0], old)
    manifest = read_manifest(old)
    kept = {k: v for k, v in manifest.items() if k not in ("format", "version")}
    del kept["stream"]["dense_transform"]
    write_manifest(old, {**kept, "description": "data.source = movielens"})
    with pytest.raises(CacheError, match=r"earlier towerrec.*towerrec data periods"):
        read_stream(old)
    write_manifest(old, {**kept, "description": "data.source = synthetic"})
    assert read_stream(old).num_periods == 3
    for record, problem in (
        ({"log": [True]}, "exactly"),
        ({"log": [False] * 13, "shift": [0.0] * 13, "scale": ["x"] * 13}, "numbers"),
        ({"log": [False] * 2, "shift": [0.0] * 2, "scale": [1.0] * 2}, "2 columns, its schema 13"),
    ):
        kept["stream"]["dense_transform"] = record
        write_manifest(old, kept)
        with pytest.raises(CacheError, match=f"damaged.*{problem}"):
            read_stream(old)


def test_an_augmented_directory_without_the_transform_record_is_refused(
    teacher, students, tmp_path
):
    out = tmp_path / "out"
    AugmentService(teacher, [students[0]], out).run(once=True)
    assert AugmentedPeriods(out / "a", timeout_s=0).dense_transform is None  # synthetic
    manifest = read_manifest(out / "a")
    kept = {k: v for k, v in manifest.items() if k not in ("format", "version")}
    del kept["stream"]["dense_transform"]
    write_manifest(out / "a", kept)
    with pytest.raises(CacheError, match=r"earlier towerrec.*augment its student's period files"):
        AugmentedPeriods(out / "a", timeout_s=0)
