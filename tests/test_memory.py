"""Memory guards: a training step allocates nothing proportional to the tables, and a
sharded collection built from an unallocated one never holds the full tables.

Two views of "allocated", both needed: every tensor an operator creates (a
``TorchDispatchMode`` that records the size of each output that is not a view
or in-place result of an input: clones, concatenations, dense gradients), and
what the operating system saw (the process's peak resident memory, reset
before the step through ``/proc/self/clear_refs``), which also catches buffers
that kernels allocate internally. The tables are 64 MiB; a step's batch touches
a few hundred rows.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import needs_fbgemm
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from towerrec.data.batch import Batch
from towerrec.distributed.comm import Comm
from towerrec.distributed.embedding_bag import ShardedEmbeddingBagCollection
from towerrec.distributed.launch import spawn_world
from towerrec.distributed.parallelize import uniform_plan
from towerrec.models.dlrm import DLRM
from towerrec.modules import compact
from towerrec.modules.compact_config import CompactConfig
from towerrec.modules.embedding_bag import EmbeddingBagCollection
from towerrec.modules.tables import TableConfig
from towerrec.optim.sparse import EmbeddingOptimizer, EmbeddingOptimizerConfig
from towerrec.sparse import KeyedJaggedTensor
from towerrec.train.step import train_step

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self (Linux)"),
    pytest.mark.usefixtures("one_thread"),
]

ROWS, DIM = 1_000_000, 16  # 64 MB of weights
TABLE_BYTES = ROWS * DIM * 4
TABLES = [TableConfig("big", ROWS, DIM), TableConfig("small", 1000, DIM, pooling="mean")]
MIB = 1024 * 1024


class AllocationRecorder(TorchDispatchMode):
    """Sizes of the tensors that operators create (outputs sharing no input's storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest, self.largest_op, self.total = 0, "", 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.total += t.nbytes
                if t.nbytes > self.largest:
                    self.largest, self.largest_op = t.nbytes, str(func)
        return out


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def _fresh_pages_for_large_allocations() -> None:
    """Make a table-sized allocation raise the resident set however the earlier tests in
    this process left the C heap: allocations over 1 MiB get fresh pages of their own
    (glibc's mmap threshold), and the heap's free pages go back to the system, so
    nothing is served from memory that is already resident."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc


def measure(step) -> dict[str, float]:
    """Run ``step()`` once to warm up, then once measured: the largest and total bytes
    operators allocated, and how far the peak resident memory rose above the start."""
    with AllocationRecorder():
        step()
    _fresh_pages_for_large_allocations()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident set size (VmHWM) to the current one
    start = _status_mb("VmRSS")
    with AllocationRecorder() as recorder:
        step()
    return {
        "largest": recorder.largest,
        "largest_op": recorder.largest_op,
        "total": recorder.total,
        "peak_rise_mb": _status_mb("VmHWM") - start,
    }


def _batch(seed: int, batch: int = 64) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (2 * batch,), generator=gen)
    n_big = int(lengths[:batch].sum())
    values = torch.cat(
        [
            torch.randint(0, ROWS, (n_big,), generator=gen),
            torch.randint(0, 1000, (int(lengths.sum()) - n_big,), generator=gen),
        ]
    )
    return KeyedJaggedTensor(["big", "small"], values, lengths)


def assert_no_table_sized_allocation(m: dict) -> None:
    assert m["largest"] < TABLE_BYTES / 64, m  # < 1 MB: batch-sized, not table-sized
    assert m["total"] < TABLE_BYTES / 8, m
    # A quarter of the table: allocator and page noise stay far below, a copy of the
    # table (or of its row state) would be far above.
    assert m["peak_rise_mb"] < TABLE_BYTES / MIB / 4, m


CASES = [
    ("torch", "rowwise_adagrad"),
    ("torch", "adagrad"),
    ("torch", "sgd"),
    ("torch", "cf_sgd"),
    pytest.param("fbgemm", "rowwise_adagrad", marks=needs_fbgemm),
    pytest.param("fbgemm", "adagrad", marks=needs_fbgemm),
]


@pytest.mark.parametrize("backend,optimizer", CASES)
def test_embedding_step_allocates_nothing_table_sized(backend, optimizer):
    ebc = EmbeddingBagCollection(TABLES, EmbeddingOptimizerConfig(kind=optimizer), backend=backend)
    batches = iter(range(100))

    def step():
        out = ebc(_batch(next(batches))).values()
        out.backward(torch.ones_like(out))

    assert_no_table_sized_allocation(measure(step))


def test_train_step_of_a_model_allocates_nothing_table_sized():
    model = DLRM(EmbeddingBagCollection(TABLES), num_dense=4, bottom_mlp=(8, DIM), top_mlp=(8, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    batches = iter(range(100))

    def step():
        i = next(batches)
        gen = torch.Generator().manual_seed(i)
        dense = torch.randn(64, 4, generator=gen)
        labels = torch.randint(0, 2, (64,), generator=gen).float()
        train_step(model, optimizer, Batch(dense, _batch(i), labels))

    assert_no_table_sized_allocation(measure(step))


def test_the_recorder_sees_a_table_copy():
    """The guard can fail: a step that copies the table trips both measures."""
    ebc = EmbeddingBagCollection(TABLES, backend="torch")

    def step():
        out = ebc(_batch(0)).values()
        out.backward(torch.ones_like(out))
        ebc.table_weights()["big"].clone()

    m = measure(step)
    assert m["largest"] >= TABLE_BYTES and m["peak_rise_mb"] > TABLE_BYTES / MIB / 2, m


def _build_memory(topology, materialize: bool) -> dict[str, float]:
    """Building this rank's row-wise shards: the largest tensor any operator created, and
    how far the peak resident memory rose (MiB), after a warm-up that loads the kernels'
    code."""
    torch.set_num_threads(1)
    EmbeddingBagCollection([TableConfig("warm", 8, DIM)], backend="fbgemm")
    plan = uniform_plan(TABLES, topology, "row_wise")

    def build() -> ShardedEmbeddingBagCollection:
        ebc = EmbeddingBagCollection(TABLES, backend="fbgemm", materialize=materialize)
        return ShardedEmbeddingBagCollection(ebc, plan, Comm(topology))

    # Two builds: the recorder's Python dispatch holds temporaries longer than a plain
    # build, so the resident memory is measured on a build of its own.
    with AllocationRecorder() as recorder:
        assert build().shard_views()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = _status_mb("VmRSS")
    assert build().shard_views()
    return {"largest": recorder.largest, "rise_mb": _status_mb("VmHWM") - start}


STEP_CASES = [
    ("row_wise", "fbgemm"),
    ("table_wise", "torch"),
    ("column_wise", "fbgemm"),
    ("data_parallel", "torch"),
]


def _lazy_build_and_steps(topology) -> tuple[dict[str, float], dict[str, dict]]:
    """The build's peak rise (self-initialised shards), then each sharding type's step."""
    rise = _build_memory(topology, materialize=False)
    steps = {}
    for kind, backend in STEP_CASES:
        ebc = EmbeddingBagCollection(TABLES, backend=backend, materialize=False)
        sharded = ShardedEmbeddingBagCollection(
            ebc, uniform_plan(TABLES, topology, kind), Comm(topology)
        )
        batches = iter(range(topology.rank * 100, topology.rank * 100 + 100))

        def step(sharded=sharded, batches=batches):
            out = sharded(_batch(next(batches))).values()
            out.backward(torch.ones_like(out))

        steps[f"{kind}/{backend}"] = measure(step)
    return rise, steps


@pytest.mark.multiprocess
def test_sharded_collections_never_hold_the_full_table_nor_copy_it_per_step():
    table_mb = TABLE_BYTES / MIB
    lazy = spawn_world(_lazy_build_and_steps, 2, 1)
    copied = spawn_world(_build_memory, 2, 1, True)
    for rank, (build, steps) in enumerate(lazy):
        # The largest tensor built is this rank's shard (half the rows of "big", possibly in
        # one buffer with its share of "small"), never the whole table.
        assert build["largest"] <= 0.55 * TABLE_BYTES, (rank, build)
        # Resident memory: the shard (table/2) plus row-wise state (1/16 of that) is about
        # 0.53 of the table; 0.8 leaves 17 MiB of margin for allocator and code pages,
        # while holding the full table even briefly would pass 1.0.
        assert build["rise_mb"] < 0.8 * table_mb, (rank, build, table_mb)
        assert set(steps) == {f"{k}/{b}" for k, b in STEP_CASES}
        for m in steps.values():
            assert_no_table_sized_allocation(m)
    for build in copied:  # building whole and copying shards out: the full table, then a shard
        assert build["largest"] >= TABLE_BYTES, (copied, TABLE_BYTES)
        assert build["rise_mb"] > table_mb, (copied, table_mb)


@pytest.mark.parametrize("backend", ["torch", pytest.param("fbgemm", marks=needs_fbgemm)])
def test_forked_loader_workers_hold_no_pages_of_the_tables(backend):
    """A worker forked after the tables exist drops its mappings of them: its RSS is the
    trainer's less (about) the tables, and rewriting rows leaves it no stale copies."""
    import multiprocessing

    from towerrec.data.loader import ColumnSource, LoaderConfig
    from towerrec.data.movielens import bundled_movielens_path, load_movielens
    from towerrec.memory import process_memory

    ebc = EmbeddingBagCollection(TABLES, backend=backend)
    source = ColumnSource(
        load_movielens(bundled_movielens_path()), LoaderConfig(num_workers=1, prefetch=1)
    )
    before = set(multiprocessing.active_children())
    batches = source.train_batches(64, 0, 0, 1)
    next(batches)  # forks the worker
    (worker,) = set(multiprocessing.active_children()) - before
    for i in range(3):
        next(batches)
        out = ebc(_batch(i)).values()
        out.backward(torch.ones_like(out))
    trainer, child = process_memory(), process_memory(worker.pid)
    batches.close()
    table_mb = TABLE_BYTES / MIB
    assert trainer["rss_mb"] - child["rss_mb"] > 0.9 * table_mb, (trainer, child)
    assert child["uss_mb"] < table_mb / 4, child
    assert trainer["uss_mb"] > table_mb, trainer  # the tables are the trainer's alone


def test_full_tables_beyond_the_devices_memory_are_refused_before_allocation(monkeypatch):
    tables = [TableConfig("a", 1000, 8), TableConfig("b", 3000, 8)]
    adam = EmbeddingOptimizerConfig(EmbeddingOptimizer.ADAM)
    # weights and two moments per element: 4000 rows x 24 floats x 4 bytes
    assert compact.full_table_bytes(tables, adam) == 4000 * 24 * 4
    monkeypatch.setattr(compact, "device_memory_bytes", lambda device: 4000 * 24 * 4 - 1)
    with pytest.raises(ValueError, match=r"'b', has 3,000 rows of dim 8\), more than this"):
        compact.build_embedding_collection(tables, CompactConfig(), adam)
    # a sharded collection (not materialised here) holds no whole table: no refusal
    compact.build_embedding_collection(tables, CompactConfig(), adam, materialize=False)
    monkeypatch.setattr(compact, "device_memory_bytes", lambda device: 4000 * 24 * 4)
    assert compact.build_embedding_collection(tables, CompactConfig(), adam).is_materialized


_HEAP_PROBE = """
import sys
import torch
from towerrec.memory import reuse_freed_memory
if sys.argv[1] == "reuse":
    assert reuse_freed_memory()
if sys.argv[1] == "benchmark":  # a benchmark runs as `towerrec train` does
    from towerrec.bench.common import keeps_process_settings
    keeps_process_settings(lambda: None)()
block = torch.empty(1 << 20, dtype=torch.uint8)  # 1 MiB: mmap'd at glibc's defaults
address = block.data_ptr()
with open("/proc/self/maps") as f:
    heaps = [line.split()[0] for line in f if line.rstrip().endswith("[heap]")]
inside = any(int(a, 16) <= address < int(b, 16) for a, b in (h.split("-") for h in heaps))
print("heap" if inside else "mapped")
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="glibc's allocator",
)
@pytest.mark.parametrize(
    "mode,where", [("reuse", "heap"), ("default", "mapped"), ("benchmark", "heap")]
)
def test_reuse_freed_memory_serves_large_blocks_from_the_heap(mode: str, where: str) -> None:
    """A fresh process puts its first 1 MiB block in a mapping of its own at glibc's
    defaults (each such block faults in fresh pages), and on the heap, where freed
    memory is reused, after reuse_freed_memory(), which every benchmark entry calls."""
    out = subprocess.run(
        [sys.executable, "-c", _HEAP_PROBE, mode],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert out.stdout.strip() == where


def test_huge_page_range_is_the_whole_2mib_pages_inside():
    from towerrec.memory import HUGE_PAGE, huge_page_range

    assert huge_page_range(3 * HUGE_PAGE + 100, 10 << 20) == (4 * HUGE_PAGE, 4 * HUGE_PAGE)
    assert huge_page_range(4 * HUGE_PAGE, 2 * HUGE_PAGE) == (4 * HUGE_PAGE, 2 * HUGE_PAGE)
    assert huge_page_range(HUGE_PAGE + 1, HUGE_PAGE) == (2 * HUGE_PAGE, 0)  # none inside


def _vm_flags(address: int) -> set[str]:
    """The VmFlags of this process's mapping that holds ``address``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(
    not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(),
    reason="a Linux kernel with transparent huge pages",
)
def test_torch_kernel_tables_are_advised_huge_pages():
    """A CPU table of 16 MiB and more is advised MADV_HUGEPAGE ("hg" among its mapping's
    flags) before its zeros are written; a small one is left alone."""
    from towerrec.memory import HUGE_PAGE, advise_huge_pages, huge_page_range

    big = EmbeddingBagCollection(
        [TableConfig("t", 1 << 18, 16)], EmbeddingOptimizerConfig(lr=0.1), backend="torch"
    )
    weight = big._kernels[0].weight
    start, length = huge_page_range(weight.data_ptr(), weight.nbytes)
    assert length >= HUGE_PAGE
    assert "hg" in _vm_flags(start)
    assert "hg" in _vm_flags(start + length - 1)
    small = torch.empty(1 << 20, dtype=torch.uint8)
    assert advise_huge_pages(small.data_ptr(), small.nbytes) == 0  # below HUGE_PAGES_FROM


@pytest.mark.skipif(
    not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(),
    reason="a Linux kernel with transparent huge pages",
)
def test_a_host_slot_map_is_advised_huge_pages_and_starts_empty():
    """A cache's id -> slot map in host memory (32 MiB here) is advised MADV_HUGEPAGE
    before its -1s are written (a batch's ids land anywhere in it)."""
    from towerrec.memory import HUGE_PAGE, huge_page_range
    from towerrec.modules.cache_maps import DenseSlotMap

    slots = DenseSlotMap(1 << 23)
    start, length = huge_page_range(slots.table.data_ptr(), slots.table.nbytes)
    assert length >= HUGE_PAGE
    assert "hg" in _vm_flags(start)
    assert "hg" in _vm_flags(start + length - 1)
    assert slots.get(torch.tensor([3, 1 << 22, 5])).tolist() == [-1, -1, -1]
    slots.set(torch.tensor([3, 1 << 22]), torch.tensor([0, 1]))
    assert slots.get(torch.tensor([3, 1 << 22, 5])).tolist() == [0, 1, -1]
