"""Shards that initialise themselves equal the blocks of the full tables.

A distributed run builds its collection with ``materialize=False`` and each rank
allocates and fills only its own shards; the result must be bit-identical to
copying the shards out of a fully built collection (the golden tests' path), for
every sharding type, both poolings, both kernel backends and every init rule (a scale
from the rows or from ``init_scale``), and train the same.
"""

import pytest
import torch
from conftest import needs_fbgemm
from dist_cases import local_slice, make_batch, plan_all, plan_mixed

from towerrec.distributed.comm import Comm
from towerrec.distributed.embedding_bag import ShardedEmbeddingBagCollection
from towerrec.distributed.launch import spawn_world
from towerrec.modules.embedding_bag import EmbeddingBagCollection
from towerrec.modules.tables import INIT_BLOCK_ROWS, TableConfig, fill_table_block, init_table_block
from towerrec.optim.sparse import EmbeddingOptimizerConfig
from towerrec.sharding import ShardingType
from towerrec.sparse import KeyedJaggedTensor

# Dims that split into multiples of 4 columns over 4 ranks (FBGEMM's constraint);
# the first table spans three init blocks, so row shards cut blocks in the middle.
TABLES = [
    TableConfig("big", 2 * INIT_BLOCK_ROWS + 123, 16),
    TableConfig("mean", 30, 16, feature_names=("m1", "m2"), pooling="mean"),
    TableConfig("normal", 50, 32, pooling="mean", init="normal"),
    TableConfig("small", 37, 16),
    TableConfig("fixed", 45, 16, init="uniform", init_scale=0.05),  # embedding.init_scale
    TableConfig("scaled", 60, 16, init="normal", init_scale=0.01),
]
FEATURES = [f for t in TABLES for f in t.feature_names]
ROWS = {f: t.num_embeddings for t in TABLES for f in t.feature_names}
SEED = 11


def _collection(backend: str, materialize: bool, optimizer: str = "rowwise_adagrad"):
    opt = EmbeddingOptimizerConfig(kind=optimizer, lr=0.1)
    return EmbeddingBagCollection(TABLES, opt, backend=backend, seed=SEED, materialize=materialize)


def _shard_differences(topology) -> dict[str, list]:
    """Per (sharding type, backend): shards that differ between the two build paths,
    or from ``init_table_block``; and the lazy collection's state afterwards."""
    out = {}
    plans = {kind.value: plan_all(kind, topology, TABLES) for kind in ShardingType}
    plans["mixed"] = plan_mixed(topology, TABLES)
    for name, plan in plans.items():
        for backend in ("torch", "fbgemm"):
            lazy = _collection(backend, materialize=False)
            built = ShardedEmbeddingBagCollection(lazy, plan, Comm(topology))
            copied = ShardedEmbeddingBagCollection(
                _collection(backend, materialize=True), plan, Comm(topology)
            )
            tables = {t.name: t for t in TABLES}
            bad = []
            views = built.shard_views()
            if not views and name != "table_wise":
                bad.append("no shards on this rank")
            for mine, ref in zip(views, copied.shard_views(), strict=True):
                assert (mine.table, mine.shard) == (ref.table, ref.shard)
                block = init_table_block(tables[mine.table], SEED, mine.shard.rows, mine.shard.cols)
                if not torch.equal(mine.weight, ref.weight) or not torch.equal(mine.weight, block):
                    bad.append(f"{mine.table} weight {mine.shard}")
                for key, s in mine.state.items():
                    if not torch.equal(s, ref.state[key]):
                        bad.append(f"{mine.table} {key}")
            bad.extend(["the lazy collection got tables"] if lazy.is_materialized else [])
            out[f"{name}/{backend}"] = bad
    return out


def _train_both(topology) -> list[float]:
    """Max abs output and weight differences over 3 steps of the mixed plan: self-initialised
    shards vs shards copied from a full collection (both sharded, same batches)."""
    world, rank = topology.world_size, topology.rank
    plan = plan_mixed(topology, TABLES)
    lazy = ShardedEmbeddingBagCollection(
        _collection("torch", False, "adagrad"), plan, Comm(topology)
    )
    copied = ShardedEmbeddingBagCollection(
        _collection("torch", True, "adagrad"), plan, Comm(topology)
    )
    diffs = [0.0, 0.0]
    for step in range(3):
        batch = make_batch(step, 4 * world, features=FEATURES, rows=ROWS)
        mine = local_slice(batch, rank, world)
        a, b = lazy(mine).values(), copied(mine).values()
        diffs[0] = max(diffs[0], float((a - b).abs().max()))
        grad = torch.randn(a.shape, generator=torch.Generator().manual_seed(step))
        a.backward(grad)
        b.backward(grad)
    for x, y in zip(lazy.shard_views(), copied.shard_views(), strict=True):
        diffs[1] = max(diffs[1], float((x.weight - y.weight).abs().max()))
    return diffs


@pytest.mark.multiprocess
def test_self_initialised_shards_equal_blocks_of_the_full_tables():
    results = spawn_world(_shard_differences, 4, 2)
    for rank, per_case in enumerate(results):
        assert per_case is not None, f"rank {rank} returned nothing"
        assert len(per_case) == 2 * (len(ShardingType) + 1)
        for case, bad in per_case.items():
            assert bad == [], (rank, case, bad)


@pytest.mark.multiprocess
def test_self_initialised_shards_train_like_copied_shards():
    for rank, (out_diff, weight_diff) in enumerate(spawn_world(_train_both, 2, 1)):
        assert out_diff == 0.0, (rank, out_diff)
        assert weight_diff == 0.0, (rank, weight_diff)


@pytest.mark.parametrize("backend", ["torch", pytest.param("fbgemm", marks=needs_fbgemm)])
def test_materialize_later_equals_eager_build(backend):
    eager = _collection(backend, materialize=True)
    lazy = _collection(backend, materialize=False)
    assert not lazy.is_materialized
    assert lazy.feature_names == eager.feature_names
    lazy.materialize()
    for name, w in eager.table_weights().items():
        assert torch.equal(lazy.table_weights()[name], w), name


def test_unmaterialized_collection_refuses_to_look_up_or_save():
    lazy = _collection("torch", materialize=False).to("cpu")
    kjt = KeyedJaggedTensor(
        FEATURES,
        torch.zeros(len(FEATURES), dtype=torch.int64),
        torch.ones(len(FEATURES), dtype=torch.int64),
    )
    for use in (lambda: lazy(kjt), lazy.state_dict, lazy.optimizer_state_dict):
        with pytest.raises(ValueError, match=r"materialize=False .* \.materialize\(\)"):
            use()


def test_fill_table_block_writes_a_block_into_a_view():
    table = TABLES[0]
    full = init_table_block(table, SEED)
    target = torch.full((40_000, 20), float("nan"))
    view = target[3 : 3 + 20_000, 5:15]
    fill_table_block(view, table, SEED, rows=(10_000, 30_000), cols=(4, 14))
    assert torch.equal(view, full[10_000:30_000, 4:14])
    assert target[:3].isnan().all() and target[:, :5].isnan().all()
    with pytest.raises(ValueError, match="need an output of shape"):
        fill_table_block(torch.empty(5, 5), table, SEED, rows=(0, 4), cols=(0, 5))
