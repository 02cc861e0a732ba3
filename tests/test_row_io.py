"""Batched row reads and writes of the SSD store (``modules/row_io.py``, ``_rowio.c``):
every method moves the bytes the one-row-at-a-time path moves, for runs of adjacent
rows, repeated ids, runs longer than one transfer, the file's last row, and a file
cut short; the native extension builds from its source and agrees with Python."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import threading

import pytest
import torch
from conftest import ROOT

from towerrec.modules import row_io
from towerrec.modules.row_io import RowIO, available_methods, runs
from towerrec.modules.ssd_store import HEADER_BYTES, SsdStore
from towerrec.modules.tier_store import RowLayout, StoreError

LAYOUT = RowLayout("t", 3000, 6, (("momentum", 1),))  # 28-byte records
METHODS = available_methods()


def fill(out: torch.Tensor, lo: int, hi: int) -> None:
    out.copy_(torch.arange(lo * 6, hi * 6, dtype=torch.float32).view(hi - lo, 6))


def expected(rows: torch.Tensor) -> torch.Tensor:
    weight = (rows.view(-1, 1) * 6 + torch.arange(6)).float()
    return torch.cat([weight, torch.zeros(rows.numel(), 1)], dim=1)


@pytest.fixture
def store(tmp_path):
    store = SsdStore(LAYOUT, tmp_path / "t.tstore", io="python")
    store.initialize(fill)
    return store


@pytest.mark.parametrize(
    "rows, limit, want",
    [
        ([], 4, ([], [])),
        ([7], 4, ([0], [1])),
        ([3, 4, 5, 9, 10, 2], 4, ([0, 3, 5], [3, 2, 1])),  # adjacent runs, then a step back
        ([5, 5, 6], 4, ([0, 1], [1, 2])),  # a repeated row starts a new run
        (list(range(10)), 4, ([0, 4, 8], [4, 4, 2])),  # a run longer than the limit splits
        ([1, *range(20, 29), 40], 3, ([0, 1, 4, 7, 10], [1, 3, 3, 3, 1])),
    ],
)
def test_runs(rows, limit, want):
    starts, lengths = runs(torch.tensor(rows, dtype=torch.int64), limit)
    assert (starts.tolist(), lengths.tolist()) == want


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    "rows",
    [
        [0, 1, 2, 3, 10, 11, 2999],  # adjacent runs and the file's last row
        [2998, 2999],  # a run ending at the end of the file
        [17, 5, 17, 6, 5, 2999, 0],  # any order, repeats
        list(range(100, 140)),  # one run across several transfers (limit 16)
    ],
    ids=["runs-and-last-row", "run-to-the-end", "repeats", "run-across-the-limit"],
)
def test_reads_return_each_rows_record(store, method, rows):
    store.io = RowIO(method, max_run_rows=16)
    rows = torch.tensor(rows)
    assert torch.equal(store.read(rows), expected(rows))


@pytest.mark.parametrize("uring_writes", [False, True])  # uring's writes: the loop or its own
@pytest.mark.parametrize("method", METHODS)
def test_writes_land_where_single_rows_would(store, method, uring_writes):
    store.io = RowIO(method, max_run_rows=16, uring_writes=uring_writes)
    gen = torch.Generator().manual_seed(1)
    scattered = torch.randperm(LAYOUT.num_embeddings, generator=gen)[:700]  # > ring entries
    rows = torch.cat([scattered, torch.arange(2960, 3000)]).unique()  # with a long last run
    records = torch.randn(rows.numel(), LAYOUT.record_width, generator=gen)
    order = torch.randperm(rows.numel(), generator=gen)  # the store sorts them
    store.write(rows[order], records[order])
    truth = expected(torch.arange(LAYOUT.num_embeddings))
    truth[rows] = records
    assert torch.equal(store.read(torch.arange(LAYOUT.num_embeddings)), truth)
    assert torch.equal(store.records, truth)  # the mapping sees the same page cache


@pytest.mark.parametrize("method", METHODS)
def test_a_truncated_file_is_refused_naming_the_first_missing_row(store, method):
    store.io = RowIO(method, max_run_rows=16)
    record = LAYOUT.record_width * 4
    os.truncate(store.path, HEADER_BYTES + 100 * record + record // 2)  # row 100 cut in half
    rows = torch.arange(90, 110)  # one run across the cut
    assert torch.equal(store.read(torch.tensor([99])), expected(torch.tensor([99])))
    with pytest.raises(StoreError, match=r"ends before row 100 of table 't' .* delete it"):
        store.read(rows)
    with pytest.raises(StoreError, match=r"ends before row 500 "):
        store.read(torch.tensor([3, 500, 501]))


NATIVE = [m for m in METHODS if m != "python"]


@pytest.mark.skipif(not NATIVE, reason="the native extension is not built here")
@pytest.mark.parametrize("method", NATIVE)
def test_a_large_read_split_over_threads_reads_what_one_thread_reads(store, method):
    gen = torch.Generator().manual_seed(3)
    scattered = torch.randperm(LAYOUT.num_embeddings, generator=gen)[:1500]
    rows = torch.cat([scattered, torch.arange(2900, 3000)]).unique()  # with a long last run
    assert rows.numel() >= 3 * row_io.SPLIT_READ_ROWS  # three pieces
    store.io = RowIO(method, max_run_rows=16, read_threads=3)
    split = store.read(rows)
    store.io = RowIO(method)  # one piece
    assert torch.equal(split, store.read(rows))
    assert torch.equal(split, expected(rows))


@pytest.mark.skipif(not NATIVE, reason="the native extension is not built here")
@pytest.mark.parametrize("method", NATIVE)
def test_a_split_read_names_the_first_row_past_a_truncated_end(store, method):
    record = LAYOUT.record_width * 4
    os.truncate(store.path, HEADER_BYTES + 2500 * record)  # rows 2500.. are gone
    store.io = RowIO(method, read_threads=4)
    rows = torch.cat([torch.arange(0, 2000, 2), torch.arange(2400, 2600)])  # last piece cut
    with pytest.raises(StoreError, match=r"ends before row 2500 "):
        store.read(rows)
    with pytest.raises(ValueError, match="read_threads must be >= 1"):
        RowIO(method, read_threads=0)


def test_rows_outside_the_table_and_unknown_methods_are_refused(store):
    with pytest.raises(IndexError, match="outside table 't' of 3000 rows"):
        store.read(torch.tensor([1, 3000]))
    with pytest.raises(ValueError, match="'mmap' unknown; choose from uring, pread, python"):
        RowIO("mmap")
    with pytest.raises(ValueError, match="max_run_rows must be >= 1"):
        RowIO("python", max_run_rows=0)


def test_a_method_this_machine_lacks_is_refused_naming_the_ones_it_has(monkeypatch):
    monkeypatch.setattr(row_io, "_native", None)
    assert available_methods() == ("python",)
    with pytest.raises(ValueError, match=r"'pread' does not work here .*not built.* python"):
        RowIO("pread")
    assert RowIO().method == "python"


def test_written_behind_rows_are_read_back_and_a_failed_write_is_raised(store):
    store.write_behind()
    rows = torch.tensor([4, 9, 10, 2999])
    records = torch.randn(4, LAYOUT.record_width)
    store.write(rows, records)
    one = torch.full((1, LAYOUT.record_width), 7.0)
    store.write(torch.tensor([11]), one)
    one.zero_()  # the caller's tensor changes after the call: the write kept its own
    assert torch.equal(store.read(torch.tensor([4, 9, 10, 11, 2999]))[[0, 1, 2, 4]], records)
    assert torch.equal(store.records[11], torch.full((LAYOUT.record_width,), 7.0))

    def fail(*args):
        raise OSError(5, "Input/output error")

    store.io.write = fail
    store.write(torch.tensor([1]), records[:1])  # returns; the error waits for a reader
    with pytest.raises(OSError, match="Input/output error"):
        store.read(torch.tensor([1]))
    assert torch.equal(store.read(torch.tensor([1])), expected(torch.tensor([1])))


def test_a_read_waits_only_for_the_writes_in_flight_of_its_rows(store):
    """A write held in the writer thread: a read of other rows returns meanwhile; a read
    of one of its rows returns once it lands, with the written record."""
    store.write_behind()
    release, started = threading.Event(), threading.Event()
    write = store.io.write

    def held(*args):
        started.set()
        release.wait(60)
        return write(*args)

    store.io.write = held
    records = torch.full((2, LAYOUT.record_width), 5.0)
    store.write(torch.tensor([20, 21]), records)
    assert started.wait(60)
    assert torch.equal(store.read(torch.tensor([19, 22, 7])), expected(torch.tensor([19, 22, 7])))
    got: list[torch.Tensor] = []
    reader = threading.Thread(target=lambda: got.append(store.read(torch.tensor([3, 21]))))
    reader.start()
    reader.join(0.2)
    assert not got  # still waiting for row 21's write
    release.set()
    reader.join(60)
    assert torch.equal(got[0], torch.cat([expected(torch.tensor([3])), records[1:]]))


@pytest.mark.parametrize(
    ("setting", "cpus", "want"),
    [
        ("on", 1, True),
        ("off", 8, False),
        (True, 1, True),
        (False, 8, False),
        ("auto", 3, True),
        ("auto", 2, False),
    ],
)
def test_cached_ssd_stores_write_behind_as_told_or_where_a_core_is_spare(
    tmp_path, monkeypatch, one_thread, setting, cpus, want
):
    from towerrec.modules.cached import build_store
    from towerrec.modules.tiers import TierConfig

    torch.set_num_threads(2)  # (one_thread restores the count)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    tier = TierConfig("cached", backing="ssd", backing_path=str(tmp_path), write_behind=setting)
    assert build_store(LAYOUT, tier).writes_behind is want


def _compiler() -> str | None:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc)


@pytest.mark.skipif(_compiler() is None, reason="no C compiler to build the extension with")
def test_the_native_extension_builds_from_source_and_agrees_with_python(tmp_path, monkeypatch):
    out = ["--build-lib", str(tmp_path / "lib"), "--build-temp", str(tmp_path / "tmp")]
    build = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", *out],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    (built,) = (tmp_path / "lib" / "towerrec" / "modules").glob("_rowio*")
    spec = importlib.util.spec_from_file_location("towerrec.modules._rowio", built)
    assert spec is not None and spec.loader is not None
    native = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(native)
    monkeypatch.setattr(row_io, "_native", native)
    assert {"pread", "python"} <= set(available_methods())
    path = tmp_path / "f"
    data = torch.randn(500, 5)
    path.write_bytes(b"\0" * 64 + data.numpy().tobytes())
    fd = os.open(path, os.O_RDWR)
    try:
        rows = torch.tensor([0, 1, 2, 40, 41, 300, 499])
        for method in available_methods():
            out = torch.empty(rows.numel(), 5)
            assert RowIO(method, max_run_rows=2).read(fd, rows, out, 64) == -1
            assert torch.equal(out, data[rows]), method
            past = torch.empty(3, 5)
            assert RowIO(method).read(fd, torch.tensor([498, 499, 500]), past, 64) == 2
        new = torch.randn(rows.numel(), 5)
        assert RowIO(available_methods()[0]).write(fd, rows, new, 64) == -1
        data[rows] = new
        back = torch.empty(500, 5)
        assert RowIO("python").read(fd, torch.arange(500), back, 64) == -1
        assert torch.equal(back, data)
    finally:
        os.close(fd)


def test_bench_row_io_times_every_method_warm_and_cold_on_the_same_rows(tmp_path):
    from towerrec.cli.bench import BENCHMARKS

    parser = __import__("argparse").ArgumentParser()
    BENCHMARKS["row-io"].add_arguments(parser)
    argv = "--gib 0.02 --batch-size 64 --steps 2 --warmup 1 --dim 8 --min-rows 5000 --rounds 1"
    argv += " --cold --probe 16"
    args = parser.parse_args([*argv.split(), "--path", str(tmp_path / "files")])
    result = BENCHMARKS["row-io"].run(args)
    assert result["cached_tables"] > 0 and result["rows_read_per_step"] > 0
    # the native methods as the store runs them (one piece) and split in two (``-2t``)
    # and reads through the files' mapping (``mapped``)
    ran = {"row", *METHODS, "mapped", *(f"{m}-2t" for m in NATIVE)}
    assert set(result["results"]) == {"warm", "cold"}
    for pass_ in ("warm", "cold"):
        assert set(result["results"][pass_]) == ran
        for stats in result["results"][pass_].values():
            assert stats["read_us_per_row"] > 0
    assert result["disk"]["sequential_read_mb_s"] > 0


def test_bench_row_io_refuses_a_bad_read_thread_count(tmp_path):
    from towerrec.cli.bench import BENCHMARKS

    parser = __import__("argparse").ArgumentParser()
    BENCHMARKS["row-io"].add_arguments(parser)
    args = parser.parse_args(["--read-threads", "1,0", "--path", str(tmp_path)])
    with pytest.raises(ValueError, match=r"--read-threads takes counts >= 1, got '0'"):
        BENCHMARKS["row-io"].run(args)


def test_bench_row_io_probes_the_disk_without_the_native_extension(tmp_path, monkeypatch):
    from towerrec.cli.bench import BENCHMARKS

    monkeypatch.setattr(row_io, "_native", None)  # as where no C compiler built it
    parser = __import__("argparse").ArgumentParser()
    BENCHMARKS["row-io"].add_arguments(parser)
    argv = "--gib 0.02 --batch-size 64 --steps 2 --warmup 1 --dim 8 --min-rows 5000 --rounds 1"
    args = parser.parse_args([*argv.split(), "--probe", "16", "--path", str(tmp_path / "files")])
    result = BENCHMARKS["row-io"].run(args)
    assert set(result["results"]["warm"]) == {"row", "python", "mapped"}  # no native way
    assert result["disk"]["random_4k_reads_per_s_depth1"] > 0  # one Python read at a time
    assert not any(
        key.startswith("random_4k_reads_per_s_depth") and key != ("random_4k_reads_per_s_depth1")
        for key in result["disk"]
    )
