"""The SSD store keeps its rows out of the process: initialised with chunked ``pwrite``
(the same rows as the in-memory init), rows read and written with ``pread`` / ``pwrite``
or io_uring (no page of the file mapped) or read and written through the mapping (its
pages then mapped; writes by io where the file is sparse or its file system copies on
write), pages of ``records`` dropped by ``release`` without losing a row."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from towerrec.modules import ssd_store as tier_store
from towerrec.modules.row_io import available_methods
from towerrec.modules.ssd_store import HEADER_BYTES, SsdStore
from towerrec.modules.tables import TableConfig, fill_table_block
from towerrec.modules.tier_store import HostStore, RowLayout, StoreError

LAYOUT = RowLayout("t", 40_000, 8, (("momentum", 1),))
TABLE = TableConfig("t", 40_000, 8)


def fill(out: torch.Tensor, lo: int, hi: int) -> None:
    fill_table_block(out, TABLE, 5, rows=(lo, hi))


def file_rows(path: Path) -> np.ndarray:
    data = np.fromfile(path, dtype=np.float32, offset=HEADER_BYTES)
    return data.reshape(LAYOUT.num_embeddings, LAYOUT.record_width)


def mapped_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of ``path`` (``/proc/self/smaps``)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = fields[-1] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


@pytest.mark.parametrize("io", available_methods())
def test_chunked_init_writes_the_rows_of_the_in_memory_init(tmp_path, monkeypatch, io):
    # 3 chunks of whole init blocks, written a page a call; the last page is partial
    monkeypatch.setattr(tier_store, "INIT_CHUNK_BYTES", 1)  # one init block per chunk
    host = HostStore(LAYOUT)
    host.initialize(fill)
    ssd = SsdStore(LAYOUT, tmp_path / "t.tstore", io=io)
    ssd.records[:] = 7.0  # a run's leftovers: initialize overwrites every row
    ssd.flush()
    ssd.initialize(fill)
    assert torch.equal(ssd.records, host.records)
    assert np.array_equal(file_rows(ssd.path), host.records.numpy())
    assert host.records[:, 8].eq(0).all() and host.records[:, :8].ne(0).any()
    assert ssd.path.stat().st_size == HEADER_BYTES + LAYOUT.num_embeddings * 9 * 4  # cut back
    assert (LAYOUT.num_embeddings * 9) % 1024  # (the last page is partial)


READS = [*available_methods(), "mapped"]  # row_io's methods, and reads through the mapping


def store_reading(path: Path, reads: str) -> SsdStore:
    if reads == "mapped":
        return SsdStore(LAYOUT, path, mapped_reads=True)
    return SsdStore(LAYOUT, path, io=reads)


@pytest.mark.parametrize("io", READS)
def test_reads_and_writes_lose_no_row(tmp_path, io):
    store = store_reading(tmp_path / "t.tstore", io)
    store.initialize(fill)
    expected = store.records.clone()
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        rows = torch.randperm(LAYOUT.num_embeddings, generator=gen)[:500]
        records = torch.randn(500, LAYOUT.record_width, generator=gen)
        store.write(rows, records)
        expected[rows] = records
        assert torch.equal(store.read(rows), records)
        store.records[rows[:10]] += 1.0  # through the mapping: one page cache
        expected[rows[:10]] += 1.0
        store.release()
        assert torch.equal(store.read(rows), expected[rows])
    assert torch.equal(store.records, expected)
    store.flush()
    assert np.array_equal(file_rows(store.path), expected.numpy())


def test_reads_and_writes_map_no_page(tmp_path):
    store = SsdStore(LAYOUT, tmp_path / "t.tstore")
    store.initialize(fill)
    assert mapped_kib(store.path) == 0  # written with pwrite, not through the mapping
    rows = torch.arange(0, 40_000, 16)
    assert np.array_equal(store.read(rows).numpy(), file_rows(store.path)[rows.numpy()])
    store.write(rows, torch.randn(rows.numel(), LAYOUT.record_width))
    assert mapped_kib(store.path) == 0  # reads and writes map nothing
    assert torch.equal(store.records[7], store.read(torch.tensor([7]))[0])
    assert mapped_kib(store.path) > 0  # ``records`` maps what it touches
    store.release()
    assert mapped_kib(store.path) == 0


def _populates() -> bool:
    """Whether this kernel maps a range's pages on request (MADV_POPULATE_READ, 5.14+)."""
    area = mmap.mmap(-1, 4096)
    try:
        area.madvise(22)
    except OSError:
        return False
    finally:
        area.close()
    return True


def test_mapped_reads_map_the_pages_they_read_and_see_every_write(tmp_path):
    store = SsdStore(LAYOUT, tmp_path / "t.tstore", mapped_reads=True)
    store.initialize(fill)
    store.write_behind()
    if _populates():  # initialize mapped every page of the new file: no fault in a step
        assert mapped_kib(store.path) == -(-LAYOUT.rows_bytes // 4096) * 4
    store.release()
    assert mapped_kib(store.path) == 0
    rows = torch.tensor([5, 3, 5, 39_999, 1_000])  # any order, repeats
    assert np.array_equal(store.read(rows).numpy(), file_rows(store.path)[rows.numpy()])
    assert mapped_kib(store.path) > 0  # the pages read stay mapped
    records = torch.randn(2, LAYOUT.record_width)
    store.write(torch.tensor([3, 39_999]), records)  # lands in the writer thread
    assert torch.equal(store.read(torch.tensor([39_999, 3])), records.flip(0))
    store.release()
    assert mapped_kib(store.path) == 0
    with pytest.raises(IndexError, match="outside table 't' of 40000 rows"):
        store.read(torch.tensor([40_000]))


def test_mapped_stores_write_through_the_mapping_and_lose_no_row(tmp_path, monkeypatch):
    monkeypatch.setattr(tier_store, "file_system_type", lambda path: "ext4")
    store = SsdStore(LAYOUT, tmp_path / "t.tstore", mapped_reads=True)
    store.initialize(fill)
    assert store.mapped_writes  # the file's blocks are reserved at creation

    def no_io(*args: object) -> int:
        raise AssertionError("a mapped store wrote by io")

    monkeypatch.setattr(store.io, "write", no_io)
    rows = torch.tensor([39_999, 3, 17_000, 4])  # any order
    records = torch.randn(4, LAYOUT.record_width)
    store.write(rows, records)
    store.release()  # the dirty pages unmapped: their rows stay in the page cache
    store.flush()
    assert np.array_equal(file_rows(store.path)[rows.numpy()], records.numpy())
    store.mapped_reads = False  # read back by io: the same page cache
    assert torch.equal(store.read(rows), records)
    assert not store.mapped_writes


def test_a_sparse_store_file_is_written_by_io_even_with_mapped_reads(tmp_path):
    path = tmp_path / "t.tstore"
    with open(path, "wb") as f:  # a file system without fallocate leaves the file sparse
        f.write(tier_store.encode_header(LAYOUT))
        f.truncate(HEADER_BYTES + LAYOUT.rows_bytes)
    store = SsdStore(LAYOUT, path, mapped_reads=True)
    assert not store.mapped_writes  # a full disk must be an error, not SIGBUS
    rows, records = torch.tensor([7, 2]), torch.randn(2, LAYOUT.record_width)
    store.write(rows, records)
    assert torch.equal(store.read(rows), records)
    assert np.array_equal(file_rows(path)[rows.numpy()], records.numpy())


def test_a_store_on_a_copy_on_write_file_system_is_written_by_io(tmp_path, monkeypatch):
    monkeypatch.setattr(tier_store, "file_system_type", lambda path: "btrfs")
    store = SsdStore(LAYOUT, tmp_path / "t.tstore", mapped_reads=True)
    store.initialize(fill)
    assert not store.mapped_writes  # a rewrite needs a new block: a full disk is an error
    rows, records = torch.tensor([9, 1]), torch.randn(2, LAYOUT.record_width)
    store.write(rows, records)
    assert torch.equal(store.read(rows), records)


MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
30 22 8:2 / /nowhere/data rw,relatime shared:2 - btrfs /dev/sdb1 rw,space_cache=v2
31 22 8:3 / /nowhere/data\\040x rw - xfs /dev/sdc1 rw
32 30 0:40 / /nowhere/data/scratch rw - tmpfs tmpfs rw
33 22 0:41 / /nowhere/mnt rw - ext4 /dev/sdd1 rw
34 22 0:42 / /nowhere/mnt rw - zfs pool/mnt rw
"""


@pytest.mark.parametrize(
    ("path", "kind"),
    [  # paths that exist nowhere, so that no symbolic link of this machine's moves them
        ("/nowhere/data/run/t.tstore", "btrfs"),
        ("/nowhere/data", "btrfs"),
        ("/nowhere/database/t.tstore", "ext4"),  # a mount point is a whole path component
        ("/nowhere/data x/t.tstore", "xfs"),  # mountinfo writes the space as an octal escape
        ("/nowhere/data/scratch/t", "tmpfs"),  # the deepest mount above the path
        ("/nowhere/mnt/t", "zfs"),  # mounted over the other later: the one seen
        ("/nowhere/t", "ext4"),
    ],
)
def test_the_file_system_under_a_path_is_read_from_mountinfo(path, kind):
    assert tier_store.file_system_type(Path(path), MOUNTINFO) == kind


def test_a_truncated_store_is_refused_on_read(tmp_path):
    store = SsdStore(LAYOUT, tmp_path / "t.tstore")
    os.truncate(store.path, HEADER_BYTES + 100 * LAYOUT.record_width * 4)
    assert torch.equal(store.read(torch.tensor([99])), torch.zeros(1, LAYOUT.record_width))
    with pytest.raises(StoreError, match=r"ends before row 100 of table 't' .* delete it"):
        store.read(torch.tensor([3, 100]))
