import math

import pytest
import torch
from conftest import needs_fbgemm

from towerrec.modules.embedding_bag import EmbeddingBagCollection, dense_parameters
from towerrec.modules.tables import TableConfig, init_table_block
from towerrec.optim.sparse import EmbeddingOptimizerConfig
from towerrec.sparse import KeyedJaggedTensor

TABLES = [
    TableConfig("a", 50, 8),
    TableConfig("b", 70, 8, feature_names=("b1", "b2")),  # one table, two features
    TableConfig("c", 30, 4, pooling="mean"),  # second kernel group
]
ROWS = {"a": 50, "b1": 70, "b2": 70, "c": 30}


def random_batch(gen, batch=6, max_len=4, keys=("a", "b1", "b2", "c")):
    lengths = torch.randint(0, max_len, (len(keys) * batch,), generator=gen)
    values = torch.cat(
        [
            torch.randint(0, ROWS[keys[i // batch]], (int(n),), generator=gen)
            for i, n in enumerate(lengths)
        ]
    )
    return KeyedJaggedTensor(list(keys), values, lengths)


def train_steps(ebc, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    outputs = []
    for _ in range(steps):
        out = ebc(random_batch(gen)).values()
        grad = torch.randn(out.shape, generator=gen)
        out.backward(grad)
        outputs.append(out.detach())
    return outputs


@needs_fbgemm
@pytest.mark.parametrize("kind", ["rowwise_adagrad", "adagrad", "sgd"])
def test_backends_agree_after_ten_steps(kind):
    opt = EmbeddingOptimizerConfig(kind=kind, lr=0.1)
    runs = {b: EmbeddingBagCollection(TABLES, opt, backend=b, seed=3) for b in ("torch", "fbgemm")}
    outs = {b: train_steps(m, 10) for b, m in runs.items()}
    for step in range(10):
        torch.testing.assert_close(outs["torch"][step], outs["fbgemm"][step], rtol=1e-5, atol=1e-6)
    w_torch, w_fbgemm = runs["torch"].table_weights(), runs["fbgemm"].table_weights()
    for name in ("a", "b", "c"):
        assert not torch.equal(
            w_torch[name],
            init_table_block(
                TABLES[0] if name == "a" else TABLES[1] if name == "b" else TABLES[2], 3
            ),
        )
        torch.testing.assert_close(w_torch[name], w_fbgemm[name], rtol=1e-5, atol=1e-6)
    s_torch, s_fbgemm = runs["torch"].optimizer_state_dict(), runs["fbgemm"].optimizer_state_dict()
    assert s_torch.keys() == s_fbgemm.keys()
    for key in s_torch:
        torch.testing.assert_close(s_torch[key], s_fbgemm[key], rtol=1e-5, atol=1e-7)


@needs_fbgemm
def test_backends_agree_with_per_id_weights():
    tables = [TableConfig("a", 20, 4), TableConfig("b", 10, 4)]
    runs = {b: EmbeddingBagCollection(tables, backend=b) for b in ("torch", "fbgemm")}
    values = torch.tensor([1, 1, 5, 3, 9, 0])
    lengths = torch.tensor([2, 1, 1, 2])
    weights = torch.tensor([0.5, 2.0, -1.0, 1.5, 0.25, 3.0])
    outs = {}
    for backend, ebc in runs.items():
        out = ebc(KeyedJaggedTensor(["a", "b"], values, lengths, weights)).values()
        out.backward(torch.arange(out.numel(), dtype=torch.float32).view_as(out))
        outs[backend] = out
    torch.testing.assert_close(outs["torch"], outs["fbgemm"])
    for name in ("a", "b"):
        torch.testing.assert_close(
            runs["torch"].table_weights()[name], runs["fbgemm"].table_weights()[name]
        )


def test_rowwise_adagrad_by_hand():
    """One table of 3 rows, dim 2; id 1 twice and id 2 once in two bags."""
    ebc = EmbeddingBagCollection(
        [TableConfig("t", 3, 2)], EmbeddingOptimizerConfig(lr=0.5, eps=1e-8), backend="torch"
    )
    with torch.no_grad():
        ebc.table_weights()["t"].copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]))
    out = ebc(KeyedJaggedTensor(["t"], torch.tensor([1, 1, 2]), torch.tensor([2, 1]))).values()
    assert out.tolist() == [[6.0, 8.0], [5.0, 6.0]]
    out.backward(torch.tensor([[1.0, -1.0], [2.0, 0.0]]))
    # row 1: grad = 2 * [1, -1] = [2, -2]; m = mean(4, 4) = 4; w -= 0.5 * g / 2
    # row 2: grad = [2, 0]; m = mean(4, 0) = 2;   w -= 0.5 * g / sqrt(2)
    expected = torch.tensor([[1.0, 2.0], [2.5, 4.5], [5.0 - 0.5 * 2 / 2**0.5, 6.0]])
    torch.testing.assert_close(ebc.table_weights()["t"], expected)
    torch.testing.assert_close(
        ebc.optimizer_state_dict()["embedding_bags.t.momentum1"], torch.tensor([0.0, 4.0, 2.0])
    )


def test_id_policies():
    tables = [TableConfig("a", 10, 4), TableConfig("b", 5, 4)]
    batch = KeyedJaggedTensor(["a", "b"], torch.tensor([3, 12, 4, 7]), torch.tensor([1, 1, 1, 1]))
    with pytest.raises(
        ValueError,
        match=r"id 12 of feature 'a' \(sample 1\) is out of range for its table of 10 rows",
    ):
        EmbeddingBagCollection(tables, backend="torch")(batch)
    only_b_bad = KeyedJaggedTensor(
        ["a", "b"], torch.tensor([3, 9, 4, 7]), torch.tensor([1, 1, 1, 1])
    )
    with pytest.raises(ValueError, match=r"id 7 of feature 'b' \(sample 1\).*id_policy = 'hash'"):
        EmbeddingBagCollection(tables, backend="torch")(only_b_bad)
    hashed = EmbeddingBagCollection(tables, backend="torch", id_policy="hash")
    clipped = EmbeddingBagCollection(tables, backend="torch", id_policy="clip")
    w = hashed.table_weights()
    expected = torch.cat(
        [torch.stack([w["a"][3], w["a"][2]]), torch.stack([w["b"][4], w["b"][2]])], dim=1
    )
    torch.testing.assert_close(hashed(batch).values(), expected)
    w = clipped.table_weights()
    expected = torch.cat(
        [torch.stack([w["a"][3], w["a"][9]]), torch.stack([w["b"][4], w["b"][4]])], dim=1
    )
    torch.testing.assert_close(clipped(batch).values(), expected)
    with pytest.raises(ValueError, match="unknown embedding id_policy 'wrap'"):
        EmbeddingBagCollection(tables, id_policy="wrap")


def test_missing_feature_is_a_clear_error():
    ebc = EmbeddingBagCollection([TableConfig("a", 10, 4), TableConfig("b", 5, 4)], backend="torch")
    with pytest.raises(KeyError, match=r"keys \['b'\] are not in this batch"):
        ebc(KeyedJaggedTensor(["a"], torch.tensor([1]), torch.tensor([1])))


def test_feature_order_of_input_does_not_matter():
    ebc = EmbeddingBagCollection(TABLES, backend="torch")
    gen = torch.Generator().manual_seed(0)
    batch = random_batch(gen)
    shuffled = batch.permute([3, 1, 0, 2])
    torch.testing.assert_close(ebc(batch).values(), ebc(shuffled).values())


@pytest.mark.parametrize("source_backend", ["torch", "fbgemm"])
def test_state_dict_roundtrip_across_backends(source_backend):
    pytest.importorskip("fbgemm_gpu")
    opt = EmbeddingOptimizerConfig(lr=0.2)
    src = EmbeddingBagCollection(TABLES, opt, backend=source_backend, seed=1)
    train_steps(src, 3)
    target_backend = "fbgemm" if source_backend == "torch" else "torch"
    dst = EmbeddingBagCollection(TABLES, opt, backend=target_backend, seed=99)
    dst.load_state_dict(src.state_dict())
    dst.load_optimizer_state_dict(src.optimizer_state_dict())
    gen = torch.Generator().manual_seed(5)
    batch = random_batch(gen)
    torch.testing.assert_close(src(batch).values(), dst(batch).values())
    for key, value in src.optimizer_state_dict().items():
        torch.testing.assert_close(dst.optimizer_state_dict()[key], value)


def test_state_dict_errors():
    ebc = EmbeddingBagCollection(TABLES, backend="torch")
    state = ebc.state_dict()
    state["embedding_bags.a.weight"] = torch.zeros(49, 8)
    with pytest.raises(RuntimeError, match=r"size mismatch for embedding_bags.a.weight"):
        ebc.load_state_dict(state)
    del state["embedding_bags.a.weight"]
    with pytest.raises(RuntimeError, match="Missing key"):
        ebc.load_state_dict(state)
    with pytest.raises(ValueError, match="missing"):
        ebc.load_optimizer_state_dict({})


def test_init_is_a_function_of_seed_name_and_position():
    table = TableConfig("big", 40_000, 6)
    full = init_table_block(table, seed=7)
    torch.testing.assert_close(
        init_table_block(table, 7, rows=(16_000, 33_000), cols=(2, 5)), full[16_000:33_000, 2:5]
    )
    assert full.abs().max() <= table.scale
    assert not torch.equal(init_table_block(table, 8), full)
    ebc = EmbeddingBagCollection([table], backend="torch", seed=7)
    assert torch.equal(ebc.table_weights()["big"], full)


def test_embedding_weights_stay_out_of_dense_parameters():
    model = torch.nn.Module()
    model.sparse = EmbeddingBagCollection(TABLES, backend="torch")
    model.linear = torch.nn.Linear(3, 1)
    assert [name for name, _ in dense_parameters(model)] == ["linear.weight", "linear.bias"]
    assert "sparse.embedding_bags.b.weight" in model.state_dict()


def test_no_update_under_no_grad_or_eval():
    ebc = EmbeddingBagCollection(TABLES, backend="torch")
    before = {k: v.clone() for k, v in ebc.table_weights().items()}
    with torch.no_grad():
        ebc(random_batch(torch.Generator().manual_seed(0)))
    for k, v in ebc.table_weights().items():
        assert torch.equal(v, before[k])


def test_config_validation():
    with pytest.raises(ValueError, match="num_embeddings must be >= 1"):
        TableConfig("x", 0, 4)
    with pytest.raises(ValueError, match="unknown table 'x' pooling 'max'"):
        TableConfig("x", 3, 4, pooling="max")
    with pytest.raises(ValueError, match="table names must be unique"):
        EmbeddingBagCollection([TableConfig("x", 3, 4), TableConfig("x", 3, 4)])
    with pytest.raises(ValueError, match=r"features \['f'\] are assigned to more than one table"):
        EmbeddingBagCollection(
            [
                TableConfig("x", 3, 4, feature_names=("f",)),
                TableConfig("y", 3, 4, feature_names=("f",)),
            ]
        )
    with pytest.raises(ValueError, match="lr must be > 0"):
        EmbeddingOptimizerConfig(lr=0)


@pytest.mark.parametrize("backend", ["torch", pytest.param("fbgemm", marks=needs_fbgemm)])
def test_ids_outside_the_table_are_refused_on_every_backend(backend):
    """The loaders build batches without the KeyedJaggedTensor checks; the collection is
    where every id is checked (FBGEMM reads rows without bounds checks)."""
    tables = [TableConfig("a", 10, 4), TableConfig("b", 5, 4)]
    ebc = EmbeddingBagCollection(tables, backend=backend)
    lengths = torch.ones(4, dtype=torch.int64)
    for values, match in (
        ([3, 1, -2, 4], r"id -2 of feature 'b' \(sample 0\) is out of range for its table of 5"),
        ([-1, 1, 2, 4], r"id -1 of feature 'a' \(sample 0\).*embedding.id_policy = 'hash'"),
        ([3, 1, 2, 5], r"id 5 of feature 'b' \(sample 1\)"),
    ):
        batch = KeyedJaggedTensor(["a", "b"], torch.tensor(values), lengths, validate=False)
        with pytest.raises(ValueError, match=match):
            ebc(batch)
    negative = KeyedJaggedTensor(["a", "b"], torch.tensor([3, 1, -2, 4]), lengths, validate=False)
    w = ebc.table_weights()
    for policy, row in (("hash", 3), ("clip", 0)):  # -2 mod 5; clipped up to the first row
        mapped = EmbeddingBagCollection(tables, backend=backend, id_policy=policy)
        torch.testing.assert_close(mapped(negative).values()[0, 4:], w["b"][row])


def test_each_feature_is_checked_against_its_own_table():
    """The check takes each feature's largest id: an id that fits the larger table but not
    its own is refused, one at the last row passes, and a feature without ids is skipped."""
    tables = [TableConfig("a", 10, 4), TableConfig("b", 5, 4), TableConfig("c", 3, 4)]
    ebc = EmbeddingBagCollection(tables, backend="torch")
    lengths = torch.tensor([1, 1, 0, 0, 1, 1])  # feature b has no ids
    fits = KeyedJaggedTensor(["a", "b", "c"], torch.tensor([9, 0, 2, 1]), lengths)
    assert ebc(fits).values().shape == (2, 12)
    for values, match in (
        ([9, 0, 3, 1], r"id 3 of feature 'c' \(sample 0\) is out of range for its table of 3"),
        ([10, 0, 2, 1], r"id 10 of feature 'a' \(sample 0\)"),
    ):
        batch = KeyedJaggedTensor(["a", "b", "c"], torch.tensor(values), lengths, validate=False)
        with pytest.raises(ValueError, match=match):
            ebc(batch)


@pytest.mark.parametrize("backend", ["torch", pytest.param("fbgemm", marks=needs_fbgemm)])
def test_per_id_weights_with_mean_pooling_are_refused_on_every_backend(backend):
    ebc = EmbeddingBagCollection(TABLES, backend=backend)
    gen = torch.Generator().manual_seed(0)
    batch = random_batch(gen)
    weighted = KeyedJaggedTensor(
        batch.keys(), batch.values(), batch.lengths(), torch.rand(batch.values().numel())
    )
    with pytest.raises(ValueError, match=r"table 'c' pools by mean.*embedding.pooling = 'sum'"):
        ebc(weighted)
    sum_tables = [*TABLES[:2], TableConfig("c", 30, 4)]
    EmbeddingBagCollection(sum_tables, backend=backend)(weighted)  # sum pooling: weighted


def _dense_path_run(monkeypatch, rows_per_id, weighted, native=True):
    """Six steps of two small tables (ids of 40 samples, up to 4 per bag) with the dense
    update allowed up to ``rows_per_id`` rows per id (its row gradients and update from
    the native extension or PyTorch); the collection and the dense updates taken
    ("native" or "torch" each)."""
    from towerrec.modules.kernels import base, torch_kernel
    from towerrec.optim import sparse

    monkeypatch.setattr(sparse, "DENSE_ROWS_PER_ID", rows_per_id)
    if not native:
        monkeypatch.setattr(base, "fused", None)
        monkeypatch.setattr(torch_kernel, "fused", None)
    calls = []
    real = torch_kernel.dense_rowwise_update
    real_native = torch_kernel.TorchKernel._native_dense_update

    def counted(*args, **kwargs):
        calls.append("torch")
        real(*args, **kwargs)

    def counted_native(*args, **kwargs):
        calls.append("native")
        real_native(*args, **kwargs)

    monkeypatch.setattr(torch_kernel, "dense_rowwise_update", counted)
    monkeypatch.setattr(torch_kernel.TorchKernel, "_native_dense_update", counted_native)
    pooling = "sum" if weighted else "mean"  # per-id weights need sum pooling
    tables = [TableConfig("a", 50, 8), TableConfig("c", 30, 8, pooling=pooling)]
    ebc = EmbeddingBagCollection(tables, EmbeddingOptimizerConfig(lr=0.1), backend="torch")
    gen = torch.Generator().manual_seed(3)
    for _ in range(6):
        lengths = torch.randint(0, 5, (2 * 40,), generator=gen)
        values = torch.randint(0, 30, (int(lengths.sum()),), generator=gen)
        weights = torch.rand(values.shape, generator=gen) if weighted else None
        out = ebc(KeyedJaggedTensor(["a", "c"], values, lengths, weights)).values()
        out.backward(torch.randn(out.shape, generator=gen))
    monkeypatch.undo()
    return ebc, calls


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("weighted", [False, True])
def test_small_tables_take_the_dense_update_with_the_same_result_bit_for_bit(
    monkeypatch, weighted, native
):
    """Row-wise Adagrad over every row of a small table (no dedup) against the update of
    the touched rows alone: the same weights and statistics, bit for bit, with the row
    gradients and the update from the native extension (where built) and from PyTorch."""
    from towerrec.modules.kernels.torch_kernel import native_row_statistics
    from towerrec.modules.native import fused

    if native and fused is None:
        pytest.skip("the native extension _fused is not built here")
    dense, dense_calls = _dense_path_run(monkeypatch, 1.0, weighted, native)
    sparse, sparse_calls = _dense_path_run(monkeypatch, 0.0, weighted)
    path = "native" if native and native_row_statistics(8) else "torch"
    assert dense_calls and set(dense_calls) == {path} and not sparse_calls
    for name, w in dense.table_weights().items():
        assert torch.equal(w, sparse.table_weights()[name]), name
    theirs = sparse.optimizer_state_dict()
    for key, state in dense.optimizer_state_dict().items():
        assert torch.equal(state, theirs[key]), key
    assert any(s.abs().sum() > 0 for s in theirs.values())  # the statistics did move


def test_dense_update_applies_only_where_it_matches():
    from towerrec.optim.sparse import dense_update_applies

    rowwise = EmbeddingOptimizerConfig()
    assert dense_update_applies(rowwise, rows=100, ids=100)
    assert not dense_update_applies(rowwise, rows=101, ids=100)
    assert not dense_update_applies(EmbeddingOptimizerConfig(kind="adagrad"), 10, 100)
    assert not dense_update_applies(EmbeddingOptimizerConfig(weight_decay=0.01), 10, 100)
    l2 = EmbeddingOptimizerConfig(weight_decay=0.01, weight_decay_mode="l2")
    assert not dense_update_applies(l2, 10, 100)
    assert not dense_update_applies(EmbeddingOptimizerConfig(eps=1e-40), 10, 100)


def test_native_row_gradients_refuse_bad_offsets_and_ids():
    from towerrec.modules.native import fused

    if fused is None:
        pytest.skip("the native extension _fused is not built here")
    ids = torch.tensor([0, 2, 1])
    grad = torch.ones(1, 2 * 4)  # one sample, two features of dim 4
    out = torch.zeros(3, 4)

    def call(ids, offsets, rows=3):
        fused.bag_grad(
            out.numpy(), ids.numpy(), offsets.numpy(), grad.numpy(), None, False, 2, 1, 4, rows
        )

    call(ids, torch.tensor([0, 1, 3]))
    assert out.sum(1).tolist() == [4.0, 4.0, 4.0]
    with pytest.raises(ValueError, match="from 0 to the number of ids"):
        call(ids, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="decrease"):
        call(ids, torch.tensor([0, 4, 3]))
    with pytest.raises(ValueError, match="outside"):
        call(torch.tensor([0, 3, 1]), torch.tensor([0, 1, 3]))
    with pytest.raises(ValueError, match="table holds"):
        call(ids, torch.tensor([0, 1, 3]), rows=4)


@pytest.mark.parametrize(("pooling", "weighted"), [("sum", False), ("sum", True), ("mean", False)])
def test_native_lookup_matches_embedding_bag(pooling, weighted):
    """The native pooled lookup (sample-major) against embedding_bag over the same bags,
    empty bags included."""
    from towerrec.modules.native import fused

    if fused is None:
        pytest.skip("the native extension _fused is not built here")
    gen = torch.Generator().manual_seed(4)
    features, batch, dim, rows = 3, 5, 8, 20
    table = torch.randn(rows, dim, generator=gen)
    lengths = torch.randint(0, 4, (features * batch,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    ids = torch.randint(0, rows, (int(lengths.sum()),), generator=gen)
    weights = torch.rand(ids.shape, generator=gen) if weighted else None
    out = torch.empty(batch, features * dim)
    fused.bag_sum(
        table.numpy(),
        ids.numpy(),
        offsets.numpy(),
        out.numpy(),
        None if weights is None else weights.numpy(),
        pooling == "mean",
        features,
        batch,
        dim,
        rows,
    )
    bags = torch.nn.functional.embedding_bag(
        ids, table, offsets, mode=pooling, per_sample_weights=weights, include_last_offset=True
    )
    expected = bags.view(features, batch, dim).transpose(0, 1).reshape(batch, features * dim)
    torch.testing.assert_close(out, expected)


def _native_or_torch_steps(
    monkeypatch, native: bool, pooling: str, weighted: bool, batch: int = 64, big: int = 3000
):
    """Three training lookups of the torch kernel over a small table (20 rows, the dense
    update) and two larger ones (500 and ``big`` rows, the sparse update; two features
    look up the last), with repeated ids; the pooled outputs, then each table's weights
    and row statistics."""
    from towerrec.modules.kernels import torch_kernel

    if not native:
        monkeypatch.setattr(torch_kernel, "fused", None)
    tables = [
        TableConfig("small", 20, 16, pooling=pooling),
        TableConfig("mid", 500, 16, pooling=pooling),
        TableConfig("big", big, 16, pooling=pooling, feature_names=("big", "again")),
    ]
    ebc = EmbeddingBagCollection(tables, EmbeddingOptimizerConfig(lr=0.05), backend="torch")
    kernel = ebc._kernels[0]
    assert kernel.native_lookup(None) == native
    assert kernel._native_rowwise(torch.zeros(1), None) == native
    gen = torch.Generator().manual_seed(11)
    outs = []
    for _ in range(3):
        lengths = torch.randint(0, 5, (4 * batch,), generator=gen)
        per_feature = lengths.view(4, batch).sum(1).tolist()
        values = torch.cat(
            [
                torch.randint(0, r, (n,), generator=gen)
                for r, n in zip((20, 40, big, 200), per_feature)
            ]
        )  # "mid" draws from its first 40 rows: many repeats; "again" shares big's first rows
        weights = torch.rand(values.shape, generator=gen) if weighted else None
        lookup = KeyedJaggedTensor(["small", "mid", "big", "again"], values, lengths, weights)
        out = ebc(lookup).values()
        out.backward(torch.randn(out.shape, generator=gen))
        outs.append(out.detach())
    return outs, kernel.weight.clone(), kernel.state["momentum1"].clone()


@pytest.mark.parametrize("pooling,weighted", [("sum", False), ("mean", False), ("sum", True)])
def test_native_lookup_and_update_match_the_pytorch_path(monkeypatch, pooling, weighted):
    """The native lookup (every table) and update (the dense one of small tables,
    row-wise Adagrad over the distinct rows of larger ones) against embedding_bag, the
    sort and segment sums and sparse_update: the same outputs, weights and row
    statistics over three steps, bit for bit; with per-id weights to float32 rounding
    (embedding_bag's weighted sums fuse the multiply and the add)."""
    from towerrec.modules.native import fused

    if fused is None:
        pytest.skip("the native extension _fused is not built here")
    with monkeypatch.context() as patch:
        reference = _native_or_torch_steps(patch, False, pooling, weighted)
    native = _native_or_torch_steps(monkeypatch, True, pooling, weighted)
    same = torch.testing.assert_close if weighted else _assert_equal
    for got, want in zip(native[0], reference[0]):
        same(got, want)
    same(native[1], reference[1])
    same(native[2], reference[2])
    assert not torch.equal(native[1], _fresh_torch_weights(pooling))  # the steps trained


def _assert_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(got, want), (got - want).abs().max()


def _fresh_torch_weights(pooling: str) -> torch.Tensor:
    tables = [
        TableConfig(n, r, 16, pooling=pooling)
        for n, r in (("small", 20), ("mid", 500), ("big", 3000))
    ]
    ebc = EmbeddingBagCollection(tables, EmbeddingOptimizerConfig(lr=0.05), backend="torch")
    return ebc._kernels[0].weight.clone()


def test_native_rowwise_adagrad_does_not_depend_on_the_thread_count(monkeypatch):
    """The native lookup and update split their bags and rows among torch's threads
    (batches of some 24,000 ids, 12,000 distinct rows: large enough for 3): the same
    bits on 1 and 3."""
    from towerrec.modules.native import fused

    if fused is None:
        pytest.skip("the native extension _fused is not built here")
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            results.append(
                _native_or_torch_steps(monkeypatch, True, "sum", True, batch=4096, big=100_000)
            )
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(results[0][0], results[1][0]):
        assert torch.equal(a, b)
    assert torch.equal(results[0][1], results[1][1])
    assert torch.equal(results[0][2], results[1][2])


@pytest.mark.parametrize("weighted", [False, True])
def test_native_bag_grad_split_among_threads_matches_a_numpy_oracle(weighted):
    """bag_grad splits the rows among torch's threads, each reading every id and adding
    those in its rows (about 20,000 ids here: enough for 3 threads): on 1 and 3 threads
    the sums np.add.at gives, each row's shares added in the ids' order."""
    import numpy as np

    from towerrec.modules.native import fused

    if fused is None:
        pytest.skip("the native extension _fused is not built here")
    gen = torch.Generator().manual_seed(6)
    features, batch, dim, rows = 4, 2048, 16, 700
    lengths = torch.randint(0, 5, (features * batch,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    # skewed ids: most in the first rows, so that the threads' shares differ
    ids = (torch.rand(int(offsets[-1]), generator=gen) ** 3 * rows).long()
    grad = torch.randn(batch, features * dim, generator=gen)
    weights = torch.rand(ids.shape, generator=gen) if weighted else None

    want = np.zeros((rows, dim), np.float32)
    ids_np, off_np, grad_np = ids.numpy(), offsets.numpy(), grad.numpy()
    for f in range(features):
        for b in range(batch):
            lo, hi = off_np[f * batch + b], off_np[f * batch + b + 1]
            g = grad_np[b, f * dim : (f + 1) * dim]
            for k in range(lo, hi):
                share = g * weights[k].numpy() if weights is not None else g
                np.add.at(want, ids_np[k], share)
    threads = torch.get_num_threads()
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            out = torch.zeros(rows, dim)
            fused.bag_grad(
                out.numpy(), ids.numpy(), offsets.numpy(), grad.numpy(),
                None if weights is None else weights.numpy(), False, features, batch, dim,
                rows,
            )  # fmt: skip
            np.testing.assert_array_equal(out.numpy(), want)
    finally:
        torch.set_num_threads(threads)
    assert ids.numel() > 3 * 4096  # three threads' worth (MIN_ROWS_PER_THREAD)


@pytest.mark.parametrize("mean,weighted", [(False, False), (True, True)])
def test_native_row_sums_split_among_threads_match_a_numpy_oracle(mean, weighted):
    """row_sums splits the tables among torch's threads (about 26,000 ids here: 2 threads
    have enough) and moves each thread's rows behind the ones before: on 1 and 2 threads
    the same distinct rows in order of first appearance, table by table, with the sums
    np.add.at gives and the statistics momentum[rows] gives."""
    import numpy as np

    from towerrec.modules.native import fused

    if fused is None:
        pytest.skip("the native extension _fused is not built here")
    gen = torch.Generator().manual_seed(5)
    features, batch, dim = 5, 2048, 16
    table_rows = (30, 4000, 9000, 9000)  # features 3 and 4 look up table 3; table 0 repeats
    tables = torch.tensor([0, 1, 2, 3, 3])
    starts = np.cumsum((0, *table_rows))
    lengths = torch.randint(0, 5, (features * batch,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    per_feature = lengths.view(features, batch).sum(1).tolist()
    ids = torch.cat(
        [
            torch.randint(0, table_rows[t], (n,), generator=gen) + int(starts[t])
            for t, n in zip(tables.tolist(), per_feature)
        ]
    )
    total = int(starts[-1])
    grad = torch.randn(batch, features * dim, generator=gen)
    weights = torch.rand(ids.shape, generator=gen) if weighted else None
    momentum = torch.rand(total, generator=gen)

    # the oracle: ids table by table in order (a table's features one after another),
    # each id's share of its bag's gradient added in that order
    want_rows, shares = [], []
    ids_np, off_np, grad_np = ids.numpy(), offsets.numpy(), grad.numpy()
    for t in dict.fromkeys(tables.tolist()):
        for f in [f for f in range(features) if tables[f] == t]:
            for b in range(batch):
                lo, hi = off_np[f * batch + b], off_np[f * batch + b + 1]
                g = grad_np[b, f * dim : (f + 1) * dim]
                for k in range(lo, hi):
                    share = g / np.float32(max(hi - lo, 1)) if mean else g
                    if weights is not None:
                        share = share * weights[k].numpy()
                    want_rows.append(ids_np[k])
                    shares.append(share)
    order = list(dict.fromkeys(want_rows))
    slot = {r: i for i, r in enumerate(order)}
    want_sums = np.zeros((len(order), dim), np.float32)
    for r, s in zip(want_rows, shares):
        want_sums[slot[r]] += s

    threads = torch.get_num_threads()
    got = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            rows = torch.empty(ids.numel(), dtype=torch.int64)
            sums = torch.empty(ids.numel(), dim)
            state = torch.empty(ids.numel())
            distinct = fused.row_sums(
                ids.numpy(), offsets.numpy(), grad.numpy(),
                None if weights is None else weights.numpy(), mean, features, batch, dim,
                total, rows.numpy(), sums.numpy(), tables.numpy(), momentum.numpy(),
                state.numpy(),
            )  # fmt: skip
            got.append((rows[:distinct], sums[:distinct], state[:distinct]))
    finally:
        torch.set_num_threads(threads)
    assert ids.numel() > 2 * 8192  # two threads' worth (MIN_SUMS_PER_THREAD)
    for rows, sums, state in got:
        assert rows.tolist() == order
        np.testing.assert_array_equal(sums.numpy(), want_sums)
        assert torch.equal(state, momentum[rows])
    assert torch.equal(got[0][1], got[1][1])


def test_native_rowwise_adagrad_checks_its_arguments():
    """Ids and rows outside the table and buffers of the wrong size are refused by name;
    repeated ids are summed into one row."""
    from towerrec.modules.native import fused

    if fused is None:
        pytest.skip("the native extension _fused is not built here")
    weight, momentum = torch.zeros(10, 16), torch.zeros(10)
    offsets = torch.tensor([0, 1, 2])
    grad = torch.ones(2, 16)
    rows, sums = torch.empty(2, dtype=torch.int64), torch.empty(2, 16)

    def row_sums(ids: torch.Tensor, out_rows: torch.Tensor = rows) -> int:
        return fused.row_sums(
            ids.numpy(), offsets.numpy(), grad.numpy(), None, False, 1, 2, 16, 10,
            out_rows.numpy(), sums.numpy(), torch.zeros(1, dtype=torch.int64).numpy(),
        )  # fmt: skip

    def update(r: torch.Tensor, m: torch.Tensor, count: int) -> None:
        state = torch.full((count,), 4.0)
        factor = 0.1 / state.sqrt().add_(1e-8)
        fused.adagrad_rows(
            weight.numpy(), m.numpy(), r[:count].numpy(), sums[:count].numpy(),
            state.numpy(), factor.numpy(), count, 16,
        )  # fmt: skip

    with pytest.raises(ValueError, match="id 10 at 1 outside"):
        row_sums(torch.tensor([3, 10]))
    with pytest.raises(ValueError, match="out_rows holds 8 bytes"):
        row_sums(torch.tensor([3, 3]), torch.empty(1, dtype=torch.int64))
    assert row_sums(torch.tensor([3, 3])) == 1  # one distinct row, its gradient 2
    assert rows[0] == 3 and sums[0].eq(2).all()
    with pytest.raises(ValueError, match="momentum holds 36 bytes"):
        update(rows, torch.zeros(9), 1)
    with pytest.raises(ValueError, match="row 12 at 0 outside"):
        update(torch.tensor([12]), momentum, 1)
    update(rows, momentum, 1)
    # m = 4, w = -2 * 0.1 / (2 + 1e-8)
    torch.testing.assert_close(momentum[3], torch.tensor(4.0))
    torch.testing.assert_close(weight[3], torch.full((16,), -0.1))
    assert weight[torch.arange(10) != 3].eq(0).all()


@pytest.mark.parametrize("dim", [8, 16, 32, 64])
def test_native_row_statistics_are_taken_only_where_they_give_torchs_bits(dim):
    """``row_statistics`` (each distinct row's mean square added to its statistic in one
    pass) is used for a dim only after a check that it matches ``(s * s).mean(1)``; on
    other rows than the check's it matches too."""
    from towerrec.modules.kernels import torch_kernel
    from towerrec.modules.native import fused

    if fused is None:
        pytest.skip("the native extension _fused is not built here")
    gen = torch.Generator().manual_seed(100 + dim)
    sums = torch.randn(3000, dim, generator=gen) * torch.rand(3000, 1, generator=gen) * 50
    state = torch.rand(3000, generator=gen)
    expected = state.clone().add_(torch_kernel.rowwise_statistic(sums))
    fused.row_statistics(sums.numpy(), state.numpy(), 3000, dim)
    if torch_kernel.native_row_statistics(dim):
        assert torch.equal(state, expected)
    with pytest.raises(ValueError, match="state holds"):
        fused.row_statistics(sums.numpy(), state[:10].numpy(), 3000, dim)


def test_the_row_statistics_check_refuses_an_extension_that_rounds_otherwise(monkeypatch):
    from towerrec.modules.kernels import torch_kernel
    from towerrec.modules.native import fused

    if fused is None:
        pytest.skip("the native extension _fused is not built here")

    class OffByOne:  # the extension with a statistic one float step too high
        def row_statistics(self, sums, state, count, dim):
            fused.row_statistics(sums, state, count, dim)
            state[:] = torch.nextafter(torch.from_numpy(state), torch.tensor(math.inf)).numpy()

    monkeypatch.setattr(torch_kernel, "fused", OffByOne())
    torch_kernel.native_row_statistics.cache_clear()
    try:
        assert not torch_kernel.native_row_statistics(16)
    finally:
        torch_kernel.native_row_statistics.cache_clear()


def test_native_update_with_torchs_statistics_matches_the_pytorch_path(monkeypatch):
    """Where the check declines (here forced), the statistics come from torch's operators
    around the same native calls: still the PyTorch path's bits."""
    from towerrec.modules.kernels import torch_kernel
    from towerrec.modules.native import fused

    if fused is None:
        pytest.skip("the native extension _fused is not built here")
    with monkeypatch.context() as patch:
        reference = _native_or_torch_steps(patch, False, "sum", False)
    calls = []
    monkeypatch.setattr(torch_kernel, "native_row_statistics", lambda dim: calls.append(dim))
    native = _native_or_torch_steps(monkeypatch, True, "sum", False)
    assert calls  # the update asked, and took torch's operators
    for got, want in zip((*native[0], native[1], native[2]), (*reference[0], *reference[1:])):
        _assert_equal(got, want)


def test_native_global_ids_match_the_pytorch_path(monkeypatch):
    """The lookup's ids in the concatenated rows (``_global_ids``) in one native pass
    (``_fused.c``: global_ids) against repeat_interleave and an add, on bags of 0-4 ids
    with two features on one table; offsets that do not run from 0 to the ids' count, or
    that fall, are refused by name."""
    from towerrec.modules.kernels import base
    from towerrec.modules.native import fused

    if fused is None:
        pytest.skip("the native extension _fused is not built here")
    tables = [
        TableConfig("a", 20, 8),
        TableConfig("b", 500, 8),
        TableConfig("c", 70, 8, feature_names=("c", "again")),
    ]
    kernel = EmbeddingBagCollection(tables, backend="torch")._kernels[0]
    gen = torch.Generator().manual_seed(5)
    batch = 33
    lengths = torch.randint(0, 5, (4 * batch,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    values = torch.randint(0, 20, (int(offsets[-1]),), generator=gen)
    native = kernel._global_ids(values, offsets)
    monkeypatch.setattr(base, "fused", None)
    expected = kernel._global_ids(values, offsets)
    assert torch.equal(native, expected) and native.dtype == torch.int64
    out = torch.empty_like(values)
    rows = kernel.feature_row_base.numpy()
    with pytest.raises(ValueError, match="must run from 0 to the"):
        fused.global_ids(values.numpy(), (offsets + 1).numpy(), rows, out.numpy(), 4, batch)
    falling = offsets.clone()
    falling[5] = falling[6] + 1
    with pytest.raises(ValueError, match="must not fall"):
        fused.global_ids(values.numpy(), falling.numpy(), rows, out.numpy(), 4, batch)


def test_native_id_range_check_matches_the_pytorch_path(monkeypatch):
    """The id range check in one native pass (``_fused.c``: ids_in_range) against each
    feature's largest id in PyTorch, at each feature's edges: its last row, one past it, -1,
    and a feature with no ids; starts that fall are refused by name."""
    from towerrec.modules import embedding_bag
    from towerrec.modules.native import fused

    if fused is None:
        pytest.skip("the native extension _fused is not built here")
    rows = torch.tensor([5, 1, 300, 7], dtype=torch.int64)
    starts = torch.tensor([0, 4, 4, 9, 12], dtype=torch.int64)  # feature 1 has no ids
    base = torch.tensor([0, 4, 1, 3, 0, 299, 8, 150, 2, 6, 0, 1])
    cases = [base]
    for position, value in [(3, 5), (4, 299), (5, 300), (11, 7), (0, -1), (9, -1), (11, 6)]:
        case = base.clone()
        case[position] = value
        cases.append(case)
    native = [embedding_bag._in_range(c, starts, rows) for c in cases]
    monkeypatch.setattr(embedding_bag, "fused", None)
    assert native == [embedding_bag._in_range(c, starts, rows) for c in cases]
    assert native == [True, False, True, False, False, False, False, True]
    with pytest.raises(ValueError, match="must rise within the 12 ids"):
        fused.ids_in_range(base.numpy(), torch.tensor([0, 4, 3, 9, 12]).numpy(), rows.numpy(), 4)
