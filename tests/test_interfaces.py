"""Every implementation conforms to the interface it is used through, and the layers
above the collections reach them through those interfaces, not attribute probes."""

import ast
import inspect
import typing
from pathlib import Path

import pytest
import torch

from towerrec.build.models import build_model
from towerrec.config import load_config
from towerrec.data.loader import ColumnSource
from towerrec.data.movielens import bundled_movielens_path, load_movielens
from towerrec.data.source import DataSource
from towerrec.data.synthetic import SyntheticConfig, SyntheticSource
from towerrec.distributed.comm import Comm
from towerrec.distributed.embedding_bag import ShardedEmbeddingBagCollection
from towerrec.distributed.mesh import Topology
from towerrec.distributed.parallelize import uniform_plan
from towerrec.distributed.towers import TowerEmbeddingBagCollection, TowerParallelDMT
from towerrec.models.interfaces import RecommendationModel, RepresentationModel
from towerrec.modules.cached import CachedEmbeddingBagCollection
from towerrec.modules.compact import CompactConfig, CompactEmbeddingCollection
from towerrec.modules.embedding_bag import (
    EmbeddingBagCollection,
    dense_parameters,
    fused_embedding_modules,
)
from towerrec.modules.interfaces import (
    CachingCollection,
    FusedEmbeddingCollection,
    PooledEmbeddingCollection,
    PrefetchingCollection,
)
from towerrec.modules.tables import TableConfig
from towerrec.modules.tiers import TierConfig
from towerrec.sparse import KeyedJaggedTensor

SRC = Path(__file__).parent.parent / "src" / "towerrec"
TABLES = [TableConfig("t0", 40, 4, ("f0",)), TableConfig("t1", 60, 4, ("f1",))]


def conforms(obj: object, protocol: type) -> bool:
    """``isinstance(obj, protocol)`` as Python 3.12+ decides it, on any Python: every
    member found by ``inspect.getattr_static`` (which does not see an ``nn.Module``'s
    registered submodules, parameters or buffers)."""
    members = getattr(protocol, "__protocol_attrs__", None)  # 3.12+
    if members is None:
        members = typing._get_protocol_attrs(protocol)  # type: ignore[attr-defined]
    for member in members:
        try:
            inspect.getattr_static(obj, member)
        except AttributeError:
            return False
    return isinstance(obj, protocol)


def _features(seed: int = 0, batch: int = 5) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (2 * batch,), generator=gen)
    values = torch.randint(0, 40, (int(lengths.sum()),), generator=gen)
    return KeyedJaggedTensor(["f0", "f1"], values, lengths)


def _plain() -> EmbeddingBagCollection:
    return EmbeddingBagCollection(TABLES, backend="torch", seed=3)


def _compact(kind: str) -> CompactEmbeddingCollection:
    config = CompactConfig(kind=kind, row_threshold=0, compression=4.0)
    return CompactEmbeddingCollection(TABLES, config, backend="torch", seed=3)


def _cached() -> CachedEmbeddingBagCollection:
    """Half of each table's rows cached over host memory."""
    return CachedEmbeddingBagCollection(
        TABLES, backend="torch", seed=3, default=TierConfig("cached", 0.5)
    )


def _sharded() -> ShardedEmbeddingBagCollection:
    """A one-rank sharded collection: its collectives need no process group."""
    topology = Topology(1, 1, 0)
    return ShardedEmbeddingBagCollection(
        _plain(), uniform_plan(TABLES, topology, "table_wise"), Comm(topology)
    )


COLLECTIONS = {
    "plain": _plain,
    "hash": lambda: _compact("hash"),
    "qr": lambda: _compact("qr"),
    "md": lambda: _compact("md"),
    "cached": _cached,
    "sharded": _sharded,
}


@pytest.mark.parametrize("name", sorted(COLLECTIONS))
def test_every_collection_is_a_pooled_collection_with_one_path(name):
    collection = COLLECTIONS[name]()
    assert conforms(collection, PooledEmbeddingCollection)
    features = _features()
    with torch.no_grad():
        direct = collection(features)
        started = collection.forward_start(features).wait()
    assert started.keys() == direct.keys() == collection.feature_names
    assert torch.equal(started.values(), direct.values())
    assert len(collection.describe()) == len(TABLES)
    assert isinstance(collection.flops_per_sample(), int)


def test_fused_and_prefetching_collections():
    plain, compact, sharded = _plain(), _compact("qr"), _sharded()
    assert isinstance(plain, FusedEmbeddingCollection)
    assert isinstance(sharded, FusedEmbeddingCollection)
    assert not isinstance(compact, FusedEmbeddingCollection)  # its inner collection is
    assert [n for n, _ in fused_embedding_modules(compact)] == ["inner"]
    assert conforms(sharded, PrefetchingCollection)
    assert not isinstance(plain, PrefetchingCollection)
    assert issubclass(TowerEmbeddingBagCollection, ShardedEmbeddingBagCollection)
    # Full tables: no hashing, no dense compute of their own; the sharded twin says the same.
    assert plain.collisions() is None and sharded.collisions() is None
    assert sharded.describe() == plain.describe()
    assert compact.collisions() == {}


def test_collections_that_cache_rows():
    cached, sharded = _cached(), _sharded()
    for collection in (cached, sharded):
        assert conforms(collection, CachingCollection)
        assert isinstance(collection, FusedEmbeddingCollection)
    for collection in (_plain(), _compact("qr")):
        assert not isinstance(collection, CachingCollection)
    assert cached.cached_tables == ["t0", "t1"] and cached.read_rows_ahead(True)
    assert set(cached.cache_stats()) == {"t0", "t1"} and not cached.kv_stores
    # A sharded collection without cached tables has nothing to read ahead, count or save.
    assert not sharded.read_rows_ahead(True) and sharded.prefetch_rows
    assert sharded.cached_shards is None and sharded.cache_stats() == {}
    assert not sharded.kv_stores
    # Tower collections route ids themselves: they never read rows ahead.
    assert not TowerEmbeddingBagCollection.read_rows_ahead(sharded, True)
    assert not sharded.prefetch_rows


def test_the_layers_above_reach_cached_collections_through_the_protocol():
    """No switch on the concrete cached class in train/ or distributed/ (the sharded
    collection builds its shards' cached collection, and names it only there)."""
    found = []
    for path in sorted([*(SRC / "train").rglob("*.py"), *(SRC / "distributed").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("isinstance", "issubclass")
                and "CachedEmbeddingBagCollection" in ast.unparse(node.args[1])
            ):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert found == []


def test_a_prefetched_input_is_taken_by_key_by_the_next_forward_only():
    sharded, plain = _sharded(), _plain()
    first, second = _features(1), _features(2, batch=7)
    keys = [sharded.prefetch(first), sharded.prefetch(second)]
    assert len(set(keys)) == 2
    with torch.no_grad():
        sharded.use_prefetched(keys[1])
        assert torch.equal(sharded(second).values(), plain(second).values())
        # Not named: a forward runs its own input_dist and leaves the prefetched one waiting.
        assert torch.equal(sharded(first).values(), plain(first).values())
        assert list(sharded._prefetched) == [keys[0]]
        sharded.use_prefetched(keys[0])
        assert torch.equal(sharded(first).values(), plain(first).values())
    assert not sharded._prefetched
    with pytest.raises(KeyError, match="no input_dist was prefetched"):
        sharded.use_prefetched(keys[0])


MODELS = {
    "dlrm": [],
    "dcn": [],
    "wukong": [],
    "dmt": ["model.dmt.partition=contiguous", "model.dmt.num_towers=2"],
    "compact dlrm": ["embedding.kind=qr", "embedding.row_threshold=0"],
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_model_is_a_recommendation_model(name):
    model_name = name.split()[-1]
    config = load_config("configs/quick.toml", [f"model.name={model_name}", *MODELS[name]])
    source = SyntheticSource(config.data.synthetic)
    model = build_model(config, source.schema, torch.device("cpu"))
    assert conforms(model, RecommendationModel)  # the trainer checks it
    assert conforms(model.sparse, PooledEmbeddingCollection)
    if model_name == "dlrm":
        assert conforms(model, RepresentationModel)  # contrastive losses, distillation
    assert model.num_dense_parameters() == sum(p.numel() for _, p in dense_parameters(model))
    assert model.flops_per_sample() > 0
    batch = next(source.train_batches(8))
    with torch.no_grad():
        assert model(batch.dense, batch.sparse).shape == (8,)


def test_the_tower_parallel_dmt_declares_the_model_interface():
    """It is built only on several processes (tests/test_sptt.py trains one, and the
    trainer checks it is a ``RecommendationModel``); its class declares the methods."""
    for member in ("forward", "flops_per_sample", "num_dense_parameters"):
        assert callable(getattr(TowerParallelDMT, member))
    assert isinstance(inspect.getattr_static(TowerParallelDMT, "sparse"), property)


def test_every_source_is_a_data_source_with_an_oracle_or_none():
    synthetic = SyntheticSource(SyntheticConfig(eval_samples=64))
    columns = ColumnSource(load_movielens(bundled_movielens_path()))
    for source in (synthetic, columns):
        assert conforms(source, DataSource)
    labels, probs = synthetic.eval_oracle()
    assert labels.shape == probs.shape == (64,)
    assert synthetic.train_rows is None and list(synthetic.test_batches(8)) == []
    assert columns.eval_oracle() is None and columns.train_rows > 0


# Where the layers meet the collections, models and sources: declared interfaces only.
NO_PROBES = [
    *sorted((SRC / "models").glob("*.py")),
    SRC / "modules/embedding_bag.py",
    SRC / "modules/compact.py",
    SRC / "modules/cached.py",
    SRC / "distributed/embedding_bag.py",
    SRC / "train/pipeline.py",
    SRC / "train/loop.py",
    SRC / "train/hooks.py",
    SRC / "train/checkpoint.py",
]


def _probes(path: Path) -> list[str]:
    """``hasattr``/``getattr`` calls in ``path``, but for ``getattr(self, name)`` in a
    config's ``__post_init__`` (a field's value for its validation message)."""
    tree = ast.parse(path.read_text())
    allowed = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "__post_init__":
            for call in ast.walk(node):
                if (
                    isinstance(call, ast.Call)
                    and isinstance(call.func, ast.Name)
                    and call.func.id == "getattr"
                    and isinstance(call.args[0], ast.Name)
                    and call.args[0].id == "self"
                ):
                    allowed.add(id(call))
    return [
        f"{path.name}:{node.lineno} {ast.unparse(node)}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("hasattr", "getattr")
        and id(node) not in allowed
    ]


@pytest.mark.parametrize("path", NO_PROBES, ids=lambda p: str(p.relative_to(SRC)))
def test_no_attribute_probes_above_the_collections(path):
    assert _probes(path) == []


def test_the_probe_check_finds_a_probe(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "class C:\n"
        "    def __post_init__(self):\n"
        "        getattr(self, 'steps')\n"
        "def f(m):\n"
        "    return hasattr(m, 'prefetch') or getattr(m, 'forward_start', None)\n"
    )
    assert [line.split(" ", 1)[1] for line in _probes(probe)] == [
        "hasattr(m, 'prefetch')",
        "getattr(m, 'forward_start', None)",
    ]
