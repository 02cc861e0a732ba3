import itertools
import math

import pytest
import torch
from conftest import needs_fbgemm

from towerrec.config import ConfigError, load_config
from towerrec.modules.compact import CompactConfig, CompactEmbeddingCollection
from towerrec.modules.compositional import (
    count_collisions,
    crt_moduli,
    partition_ids,
    partition_sizes,
    quotient_remainder_radices,
)
from towerrec.modules.embedding_bag import EmbeddingBagCollection, dense_parameters
from towerrec.modules.mixed_dim import mixed_dimensions
from towerrec.modules.tables import TableConfig
from towerrec.optim.sparse import EmbeddingOptimizerConfig
from towerrec.sparse import KeyedJaggedTensor

TABLES = [
    TableConfig("a", 97, 8),
    TableConfig("b", 40, 8, feature_names=("b1", "b2")),
    TableConfig("c", 12, 8, pooling="mean"),
]
# per-id weights need sum pooling (as in torch.nn.functional.embedding_bag)
SUM_TABLES = [*TABLES[:2], TableConfig("c", 12, 8)]
ROWS = {"a": 97, "b1": 40, "b2": 40, "c": 12}
KEYS = ["a", "b1", "b2", "c"]


def random_batch(gen, batch=5, max_len=3, weighted=False, single_hot=False):
    if single_hot:
        lengths = torch.ones(len(KEYS) * batch, dtype=torch.int64)
    else:
        lengths = torch.randint(0, max_len + 1, (len(KEYS) * batch,), generator=gen)
    values = torch.cat(
        [
            torch.randint(0, ROWS[KEYS[i // batch]], (int(n),), generator=gen)
            for i, n in enumerate(lengths)
        ]
    )
    weights = torch.rand(values.numel(), generator=gen) if weighted else None
    return KeyedJaggedTensor(KEYS, values, lengths, weights)


# ------------------------------------------------------------ id arithmetic
@pytest.mark.parametrize("scheme", ["quotient_remainder", "crt"])
@pytest.mark.parametrize("rows, compression, parts", [(1000, 4, 2), (1000, 16, 3), (97, 2, 4)])
def test_partitions_are_complementary(scheme, rows, compression, parts):
    sizes = partition_sizes(scheme, rows, compression, parts)
    assert len(sizes) == parts and sizes[0] == math.ceil(rows / compression)
    mapped = torch.stack(partition_ids(torch.arange(rows), scheme, sizes), dim=1)
    assert all((mapped[:, j] < m).all() and (mapped[:, j] >= 0).all() for j, m in enumerate(sizes))
    assert torch.unique(mapped, dim=0).shape[0] == rows  # no two ids share every row


def test_crt_moduli_are_pairwise_coprime():
    for rows, c, p in [(1000, 4, 2), (10**6, 16, 3), (10**9, 16, 4)]:
        moduli = crt_moduli(rows, c, p)
        assert all(math.gcd(a, b) == 1 for a, b in itertools.combinations(moduli, 2))
        assert math.prod(moduli) >= rows


def test_ids_beyond_float_precision_map_exactly():
    rows = 2**40 + 12345
    ids = torch.tensor([2**40 + 12344, 2**24 + 1, 2**24, 2**53 // 2**14 + 3])
    sizes = quotient_remainder_radices(rows, 16, 3)
    parts = partition_ids(ids, "quotient_remainder", sizes)
    for i, x in enumerate(ids.tolist()):
        digits, rest = [], x
        for m in sizes[:-1]:
            digits.append(rest % m)
            rest //= m
        digits.append(rest)
        assert [int(p[i]) for p in parts] == digits
    crt = crt_moduli(rows, 16, 2)
    for p, m in zip(partition_ids(ids, "crt", crt), crt):
        assert p.tolist() == [x % m for x in ids.tolist()]
    with pytest.raises(TypeError, match="integer tensor"):
        partition_ids(ids.double(), "crt", crt)


def test_collision_count_by_hand():
    # ids 3, 13, 23 share row 3 of a 10-row table; 5 and 15 share row 5; 7 is alone
    ids = torch.tensor([3, 13, 23, 13, 5, 15, 7])
    assert count_collisions(ids, 10) == 6 - 3
    assert count_collisions(torch.arange(100), 100) == 0
    ebc = CompactEmbeddingCollection(
        TABLES, CompactConfig(kind="hash", compression=4), backend="torch"
    )
    assert ebc.collisions() == {"a": 97 - 25, "b": 40 - 10, "c": 12 - 3}
    assert count_collisions(torch.arange(97), 25) == 72


# ------------------------------------------------------------ forward values
def expected_output(ebc, batch):
    """Per id: combine the physical rows by hand; then pool per bag."""
    weights = ebc.inner.table_weights()
    out = []
    for feature, plan in ebc._feature_plans:
        jag = batch[feature]
        rows = []
        start = 0
        for n in jag.lengths.tolist():
            ids = jag.values[start : start + n]
            w = jag.weights[start : start + n] if jag.weights is not None else torch.ones(n)
            start += n
            total = torch.zeros(plan.table.embedding_dim)
            for x, wx in zip(ids.tolist(), w):
                parts = [
                    weights[p.name][int(r)]
                    for p, r in zip(plan.parts, plan.map_ids(torch.tensor([x])))
                ]
                total = total + wx * ebc._combine(plan, [p.unsqueeze(0) for p in parts])[0]
            if plan.table.pooling.value == "mean" and n:
                total = total / n
            rows.append(total)
        out.append(torch.stack(rows))
    return torch.cat(out, dim=1)


@pytest.mark.parametrize(
    "config",
    [
        CompactConfig(kind="qr", operation="mult"),
        CompactConfig(kind="qr", operation="add", num_partitions=3),
        CompactConfig(kind="qr", operation="concat", scheme="crt"),
        CompactConfig(kind="qr", operation="mult", row_threshold=50),  # only 'a' is compressed
        CompactConfig(kind="hash", compression=3),
        CompactConfig(kind="md", md_alpha=0.4, md_min_dim=1, md_round_to=1),
    ],
)
@pytest.mark.parametrize("shape", ["single_hot", "multi_hot", "weighted"])
def test_forward_matches_per_id_combination(config, shape):
    tables = SUM_TABLES if shape == "weighted" else TABLES
    ebc = CompactEmbeddingCollection(tables, config, backend="torch", seed=2)
    gen = torch.Generator().manual_seed(1)
    batch = random_batch(gen, single_hot=shape == "single_hot", weighted=shape == "weighted")
    out = ebc(batch)
    assert out.keys() == KEYS and out.values().shape == (5, 32)
    torch.testing.assert_close(out.values(), expected_output(ebc, batch), rtol=1e-5, atol=1e-6)


def test_row_threshold_and_parameter_counts():
    config = CompactConfig(kind="qr", compression=4, row_threshold=50)
    ebc = CompactEmbeddingCollection(TABLES, config, backend="torch")
    kinds = {d["table"]: (d["kind"], d["rows"]) for d in ebc.describe()}
    assert kinds == {"a": ("qr", [25, 4]), "b": ("full", [40]), "c": ("full", [12])}
    assert ebc.num_embedding_parameters == (25 + 4 + 40 + 12) * 8


@pytest.mark.parametrize(
    "config",
    [
        CompactConfig(kind="qr", operation="mult"),
        CompactConfig(kind="qr", operation="add"),
        CompactConfig(kind="qr", operation="concat", num_partitions=2),
        CompactConfig(kind="hash"),
        CompactConfig(kind="md", md_alpha=0.5),
    ],
)
def test_init_keeps_combined_vectors_at_full_table_scale(config):
    table = TableConfig("big", 4000, 16)
    full = EmbeddingBagCollection([table], backend="torch").table_weights()["big"]
    ebc = CompactEmbeddingCollection([table], config, backend="torch")
    ids = torch.arange(4000)
    with torch.no_grad():
        combined = ebc(KeyedJaggedTensor(["big"], ids, torch.ones(4000, dtype=torch.int64)))
    ratio = combined.values().std() / full.std()
    assert 0.85 < ratio < 1.15, ratio
    assert abs(combined.values().mean()) < 0.3 * full.std()  # few quotient rows: noisy


@pytest.mark.parametrize("operation", ["mult", "add", "concat"])
def test_backward_updates_physical_rows_like_autograd(operation):
    """SGD in the fused backward equals autograd through the combination by hand."""
    opt = EmbeddingOptimizerConfig(kind="sgd", lr=0.3)
    config = CompactConfig(kind="qr", operation=operation, compression=4)
    ebc = CompactEmbeddingCollection(SUM_TABLES, config, opt, backend="torch")
    before = {k: v.clone().requires_grad_(True) for k, v in ebc.inner.table_weights().items()}
    gen = torch.Generator().manual_seed(3)
    batch = random_batch(gen, weighted=True)
    grad_out = torch.randn(5, 32, generator=gen)
    ebc(batch).values().backward(grad_out)
    # reference: the same combination differentiated by autograd
    reference = []
    for feature, plan in ebc._feature_plans:
        jag = batch[feature]
        bag = torch.repeat_interleave(torch.arange(5), jag.lengths)
        parts = [before[p.name][r] for p, r in zip(plan.parts, plan.map_ids(jag.values))]
        per_id = ebc._combine(plan, parts) * jag.weights.unsqueeze(1)
        pooled = torch.zeros(5, per_id.shape[1]).index_add(0, bag, per_id)
        if plan.table.pooling.value == "mean":
            pooled = pooled / jag.lengths.clamp(min=1).unsqueeze(1)
        reference.append(pooled)
    (torch.cat(reference, dim=1) * grad_out).sum().backward()
    for name, weight in ebc.inner.table_weights().items():
        expected = before[name].detach() - 0.3 * before[name].grad
        torch.testing.assert_close(weight, expected, rtol=1e-5, atol=1e-6)


def test_md_projections_are_dense_parameters_and_trained():
    model = torch.nn.Module()
    model.sparse = CompactEmbeddingCollection(
        TABLES, CompactConfig(kind="md", md_alpha=0.5, md_min_dim=1, md_round_to=1), backend="torch"
    )
    names = [n for n, _ in dense_parameters(model)]
    assert names and all(n.startswith("sparse.projections.") for n in names)
    dims = {d["table"]: d["dims"][0] for d in model.sparse.describe()}
    # 8 * (12 / rows)^0.5: bigger table, rarer rows, narrower
    assert (dims["a"], dims["b"], dims["c"]) == (3, 4, 8)
    out = model.sparse(random_batch(torch.Generator().manual_seed(0))).values()
    out.sum().backward()
    assert all(p.grad is not None for p in model.sparse.projections.parameters())


# ------------------------------------------------------------ mixed dims
def test_mixed_dimensions_rule():
    rows = [10, 100, 1000, 10000]
    assert mixed_dimensions(rows, 0.0, 16) == [16, 16, 16, 16]
    # d_i = 16 * (10 / n_i)^0.5 -> 16, 5.06, 1.6, 0.5
    assert mixed_dimensions(rows, 0.5, 16) == [16, 5, 2, 1]
    assert mixed_dimensions(rows, 0.5, 16, round_to=4, min_dim=4) == [16, 4, 4, 4]
    dims = mixed_dimensions(rows, 0.3, 64, budget=50_000)
    cost = sum(n * d for n, d in zip(rows, dims))
    assert cost <= 50_000 and dims == sorted(dims, reverse=True)
    # one more unit of the scale would cross the budget: the budget is (nearly) used
    assert cost > 50_000 - 10000
    with pytest.raises(ValueError, match="below the 11,110 that min_dim = 1 needs"):
        mixed_dimensions(rows, 0.3, 64, budget=1000)


# ------------------------------------------------------------ config, backends
def test_config_builds_compact_tables_and_trains(tmp_path):
    from towerrec.workflows import training as trainer

    config = load_config(
        "configs/quick.toml",
        [
            "train.steps=4",
            "train.eval_every=0",
            "train.progress=false",
            "embedding.kind=qr",
            "embedding.compression=4",
            "embedding.row_threshold=60",
        ],
    )
    summary = trainer.train(config, tmp_path / "qr")
    full = trainer.train(
        load_config("configs/quick.toml", ["train.steps=4", "train.progress=false"]), tmp_path / "f"
    )
    # tables of 100, 50, 200, 20 rows: 100 -> 25 + 4, 200 -> 50 + 4, the rest stay full
    assert summary["num_embedding_params"] == (25 + 4 + 50 + 50 + 4 + 20) * 16
    assert full["num_embedding_params"] == (100 + 50 + 200 + 20) * 16
    assert 0 < summary["auc"] < 1
    assert summary["hash_collisions"] == 0 and full["hash_collisions"] is None


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["embedding.kind=tt"], "embedding.kind = 'tt' is not one of"),
        (["embedding.compression=1"], "embedding.compression must be > 1"),
        (["embedding.qr_partitions=1"], "embedding.qr_partitions must be >= 2"),
        (["embedding.qr_operation=max"], "embedding.qr_operation = 'max' is not one of"),
        (["embedding.md_alpha=-1"], "embedding.md_alpha must be >= 0"),
    ],
)
def test_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


@needs_fbgemm
def test_backends_agree_on_compact_tables():
    config = CompactConfig(kind="qr", operation="mult")
    opt = EmbeddingOptimizerConfig(lr=0.1)
    runs = {
        b: CompactEmbeddingCollection(TABLES, config, opt, backend=b) for b in ("torch", "fbgemm")
    }
    gen = {b: torch.Generator().manual_seed(4) for b in runs}
    for _ in range(3):
        outs = {}
        for b, ebc in runs.items():
            batch = random_batch(gen[b])
            outs[b] = ebc(batch).values()
            outs[b].backward(torch.ones_like(outs[b]))
        torch.testing.assert_close(outs["torch"], outs["fbgemm"], rtol=1e-5, atol=1e-6)
    for name, w in runs["torch"].inner.table_weights().items():
        torch.testing.assert_close(
            w, runs["fbgemm"].inner.table_weights()[name], rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize("kind", ["qr", "md"])
def test_resume_equals_uninterrupted(tmp_path, kind):
    from towerrec.workflows import training as trainer

    config = load_config(
        "configs/quick.toml",
        [
            "train.steps=8",
            "train.eval_every=0",
            "train.progress=false",
            f"embedding.kind={kind}",
            "embedding.md_alpha=0.5",
        ],
    )
    full = trainer.train(config, tmp_path / "full")
    trainer.train(config, tmp_path / "split", stop_after=3)
    resumed = trainer.train(config, tmp_path / "split", resume=True)
    assert resumed["auc"] == full["auc"] and resumed["logloss"] == full["logloss"]
