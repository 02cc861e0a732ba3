"""TorchRec builds its sharded model from an exported towerrec plan (gloo, 2 processes)."""

import pytest
import torch
import torch.multiprocessing as mp
from conftest import needs_torchrec

from towerrec.modules.tables import TableConfig
from towerrec.planner.cost import CostModel
from towerrec.planner.placement import TableConstraint
from towerrec.planner.search import plan_tables
from towerrec.planner.stats import TableStats
from towerrec.planner.topology import topology_preset
from towerrec.sharding import ShardingType

STATS = [
    TableStats("a", 40, 16, pooling_factor=3, pooling_p50=3, pooling_p99=3, pooling_max=3),
    TableStats("b", 30, 8),
    TableStats("c", 50, 8),
]
TABLES = [TableConfig(s.name, s.num_embeddings, s.embedding_dim) for s in STATS]


def _weight(table: TableConfig) -> torch.Tensor:
    rows = torch.arange(table.num_embeddings, dtype=torch.float32)[:, None]
    cols = torch.arange(table.embedding_dim, dtype=torch.float32)[None, :]
    return torch.sin(rows * 0.37 + cols * 1.3 + len(table.name))


def _batch(rank: int):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(rank)
    lengths = torch.randint(1, 4, (3 * 4,), generator=gen)  # 3 features x 4 samples
    values = torch.cat(
        [
            torch.randint(
                0, t.num_embeddings, (int(lengths[i * 4 : (i + 1) * 4].sum()),), generator=gen
            )
            for i, t in enumerate(TABLES)
        ]
    )
    return KeyedJaggedTensor(keys=[t.name for t in TABLES], values=values, lengths=lengths)


def _run(rank, world, port, plan_dict, queue):
    import torch.distributed as dist
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from towerrec.interop.torchrec_plan import to_torchrec_plan
    from towerrec.sharding import ShardingPlan

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    configs = [
        EmbeddingBagConfig(name=t.name, embedding_dim=t.embedding_dim,
                           num_embeddings=t.num_embeddings, feature_names=[t.name])
        for t in TABLES
    ]  # fmt: skip
    plan = to_torchrec_plan(ShardingPlan.from_dict(plan_dict), TABLES)
    sharded = DistributedModelParallel(
        EmbeddingBagCollection(tables=configs, device=torch.device("meta")),
        device=torch.device("cpu"),
        plan=plan,
        sharders=[EmbeddingBagCollectionSharder()],
    )
    placed = {}
    with torch.no_grad():
        for key, tensor in sharded.state_dict().items():
            name = key.split(".")[-2]
            table = next(t for t in TABLES if t.name == name)
            for shard in tensor.local_shards():
                (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                shard.tensor.copy_(_weight(table)[r0 : r0 + nr, c0 : c0 + nc])
                placed.setdefault(name, []).append((r0, r0 + nr, c0, c0 + nc))
    reference = EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
    with torch.no_grad():
        for t in TABLES:
            reference.embedding_bags[t.name].weight.copy_(_weight(t))
    batch = _batch(rank)
    got = sharded(batch).to_dict()
    want = reference(batch).to_dict()
    diffs = {k: float((got[k] - want[k]).abs().max()) for k in want}
    queue.put((rank, placed, diffs))
    dist.barrier()
    dist.destroy_process_group()


@needs_torchrec
@pytest.mark.multiprocess
def test_torchrec_shards_and_runs_an_exported_plan():
    from towerrec.distributed.launch import free_port

    model = CostModel(topology_preset("cpu", 1, 2), None, 64)
    # Table a column-wise over both ranks, b and c table-wise.
    only_columns = {"a": TableConstraint((ShardingType.COLUMN_WISE,))}
    plan = plan_tables(STATS, model, "lpt", only_columns).plan
    assert plan.tables["a"].sharding is ShardingType.COLUMN_WISE
    assert {plan.tables[t].sharding for t in "bc"} == {ShardingType.TABLE_WISE}
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_run, args=(r, 2, port, plan.to_dict(), queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, placed, diffs = queue.get(timeout=240)
        results[rank] = (placed, diffs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank, (placed, diffs) in results.items():
        expected = {
            name: sorted((s.rows[0], s.rows[1], s.cols[0], s.cols[1]) for s in tp.shards
                         if s.rank == rank)
            for name, tp in plan.tables.items()
            if any(s.rank == rank for s in tp.shards)
        }  # fmt: skip
        assert {k: sorted(v) for k, v in placed.items()} == expected
        assert max(diffs.values()) < 1e-5, diffs
