"""Tables trained in given tensors (``materialize(storage=...)``: the page-cache baseline
of ``towerrec bench tiers`` maps files) train as the collection's own tensors do; the
bench's ``--ids zipf`` draws skewed ids over a whole table without per-row arrays."""

from __future__ import annotations

import pytest
import torch
from conftest import needs_fbgemm

from towerrec.bench.tiers_data import zipf_ids
from towerrec.modules.embedding_bag import EmbeddingBagCollection
from towerrec.modules.tables import TableConfig
from towerrec.sparse import KeyedJaggedTensor

TABLES = [TableConfig("a", 300, 8), TableConfig("b", 50, 8)]


def step(collection: EmbeddingBagCollection, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    values = torch.cat(
        [torch.randint(0, 300, (40,), generator=gen), torch.randint(0, 50, (40,), generator=gen)]
    )
    features = KeyedJaggedTensor(["a", "b"], values, torch.ones(80, dtype=torch.int64))
    collection(features).values().square().sum().backward()


def test_tables_in_given_tensors_train_as_their_own(tmp_path):
    own = EmbeddingBagCollection(TABLES, backend="torch", seed=1)
    given: dict[str, torch.Tensor] = {}

    def storage(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        given[name] = torch.from_file(str(tmp_path / name), shared=True, size=n).view(shape)
        return given[name]

    mapped = EmbeddingBagCollection(TABLES, backend="torch", seed=1, materialize=False)
    mapped.materialize(storage=storage)
    assert set(given) == {"weight", "momentum1"}
    for seed in range(3):
        step(own, seed)
        step(mapped, seed)
    for key, value in own.table_weights().items():
        assert torch.equal(mapped.table_weights()[key], value)
    assert torch.equal(given["weight"][:300], own.table_weights()["a"])  # trained in place
    ref, got = own.optimizer_state_dict(), mapped.optimizer_state_dict()
    assert all(torch.equal(ref[k], got[k]) for k in ref)


def test_storage_of_the_wrong_shape_is_refused():
    lazy = EmbeddingBagCollection(TABLES, backend="torch", materialize=False)
    with pytest.raises(ValueError, match=r"'weight' must be a contiguous float32 tensor"):
        lazy.materialize(storage=lambda name, shape: torch.zeros(shape[0] - 1, *shape[1:]))


def test_zipf_ids_cover_the_table_skewed():
    gen = torch.Generator().manual_seed(0)
    rows = 1_000_003
    ids = zipf_ids(rows, 200_000, 1.1, gen)
    assert ids.dtype == torch.int64 and int(ids.min()) >= 0 and int(ids.max()) < rows
    counts = torch.bincount(ids, minlength=rows).sort(descending=True).values
    # rank 1 takes about 1 / zeta-like share of the lookups; the tail reaches far rows
    assert counts[0] > 10 * counts[100] > 0
    assert int(ids.max()) > rows // 2 and torch.unique(ids).numel() > 10_000


def test_bench_tiers_runs_tables_from_files_without_a_reference(tmp_path):
    from towerrec.cli.bench import BENCHMARKS

    parser = __import__("argparse").ArgumentParser()
    BENCHMARKS["tiers"].add_arguments(parser)
    argv = "--gib 0.02 --batch-size 64 --steps 2 --warmup 1 --dim 8 --variants ssd,mmap"
    argv += " --ids zipf --min-rows 5000"
    args = parser.parse_args([*argv.split(), "--path", str(tmp_path / "files")])
    result = BENCHMARKS["tiers"].run(args)
    assert set(result["results"]) == {"ssd", "mmap"} and not result["ratios"]
    assert result["results"]["ssd"]["cached_tables"] > 0
    for variant in ("ssd", "mmap"):
        stats = result["results"][variant]
        assert stats["samples_per_s"] > 0 and stats["train_peak_rss_fraction"] > 0
    assert not any((tmp_path / "files").iterdir())  # every variant's files deleted


@pytest.mark.parametrize(
    ("backend", "optimizer"),
    [
        ("torch", "rowwise_adagrad"),
        ("torch", "adam"),  # a state of the table's width, and a step
        pytest.param("fbgemm", "rowwise_adagrad", marks=needs_fbgemm),
    ],
)
def test_one_tables_views_are_those_of_every_tables(backend, optimizer):
    from towerrec.optim.sparse import EmbeddingOptimizerConfig

    tables = [TableConfig("a", 300, 8), TableConfig("b", 50, 8), TableConfig("c", 20, 4)]
    ebc = EmbeddingBagCollection(
        tables, EmbeddingOptimizerConfig(kind=optimizer), backend=backend, seed=1
    )
    weights, state = ebc.table_weights(), ebc.optimizer_state_dict()
    for table in tables:
        weight, states = ebc.table_views(table.name)
        assert torch.equal(weight, weights[table.name])
        assert weight.data_ptr() == weights[table.name].data_ptr()  # a view: writes reach it
        prefix = f"embedding_bags.{table.name}."
        assert set(states) == {k[len(prefix) :] for k in state if k.startswith(prefix)}
        for name, value in states.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(state[prefix + name]))
    with pytest.raises(KeyError, match="'z'"):
        ebc.table_views("z")
