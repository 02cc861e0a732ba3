"""``towerrec bench memory``: its JSON on a small shape, and its user errors."""

import pytest
from conftest import run_cli

from towerrec.bench.memory import run_memory_benchmark


def test_bad_shape_is_one_error_line_and_exit_2():
    result = run_cli("bench", "memory", "--rows", "0")
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith("error: bench memory: --rows")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_small_run_reports_ranks_and_workers():
    shape = {"num_tables": 2, "num_embeddings": 400_000, "embedding_dim": 16}
    result = run_memory_benchmark(nproc=2, steps=2, workers=1, shape=shape)
    table_mb = 2 * 400_000 * 17 * 4 / 2**20
    assert result["tables_mb"] == round(table_mb, 1)
    lazy, whole = result["ranks"]["self_initialised"], result["ranks"]["build_whole_then_shard"]
    assert len(lazy["per_rank"]) == 2
    # Each rank: about its half of the tables plus a constant; building whole: the tables too.
    assert lazy["model_mb_max"] < table_mb / 2 + 40, lazy
    assert whole["model_mb_max"] > table_mb, whole
    workers = result["loader_workers"]
    assert workers["workers"] == 1 and workers["worker_uss_mb_max"] < table_mb / 2, workers
