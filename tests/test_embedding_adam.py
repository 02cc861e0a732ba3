"""Adam, partial row-wise Adam and weight decay on the torch kernel: steps computed by
hand with FBGEMM's arithmetic (fbgemm_gpu/codegen/genscript/optimizers.py), the step
counter of the bias correction, checkpoint round trips, and the refusals. FBGEMM's
Adam kernels are CUDA-only, and its CPU kernels ignore weight decay: test_cuda.py
compares the two backends on a GPU."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from test_embedding import TABLES, random_batch, train_steps
from torch import nn

from towerrec.config import config_from_dict
from towerrec.modules.cached import CachedEmbeddingBagCollection
from towerrec.modules.embedding_bag import EmbeddingBagCollection
from towerrec.modules.kernels import Backend, auto_backend, fbgemm_available
from towerrec.modules.tables import TableConfig
from towerrec.modules.tiers import TierConfig
from towerrec.optim.sparse import (
    EmbeddingOptimizer,
    EmbeddingOptimizerConfig,
    dense_adam_update,
    sparse_update,
)
from towerrec.sparse import KeyedJaggedTensor

W0 = [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]


def _one_table(**opt):
    """One table of 3 rows, dim 2, on the torch kernel."""
    ebc = EmbeddingBagCollection(
        [TableConfig("t", 3, 2)], EmbeddingOptimizerConfig(lr=0.5, **opt), backend="torch"
    )
    with torch.no_grad():
        ebc.table_weights()["t"].copy_(torch.tensor(W0))
    return ebc


def _step(ebc):
    """Ids 1, 1 in one bag and 2 in another: row gradients g1 = [2, -2], g2 = [2, 0]."""
    out = ebc(KeyedJaggedTensor(["t"], torch.tensor([1, 1, 2]), torch.tensor([2, 1]))).values()
    out.backward(torch.tensor([[1.0, -1.0], [2.0, 0.0]]))


def test_adam_by_hand_with_decoupled_weight_decay():
    ebc = _one_table(kind="adam", weight_decay=0.1)
    _step(ebc)
    # t = 1: m1 = 0.1 g, m2 = 0.001 g^2, so m1 / (1 - 0.9) = g, m2 / (1 - 0.999) = g^2:
    # row 1: step [1, -1]; w -= 0.5 * (step + 0.1 w)
    # row 2: step [1, 0] (0 / (0 + eps) in the second column)
    expected = [[1.0, 2.0], [3 - 0.5 * 1.3, 4 - 0.5 * -0.6], [5 - 0.5 * 1.5, 6 - 0.5 * 0.6]]
    torch.testing.assert_close(ebc.table_weights()["t"], torch.tensor(expected))
    state = ebc.optimizer_state_dict()
    torch.testing.assert_close(
        state["embedding_bags.t.momentum1"], torch.tensor([[0.0, 0.0], [0.2, -0.2], [0.2, 0.0]])
    )
    torch.testing.assert_close(
        state["embedding_bags.t.momentum2"],
        torch.tensor([[0.0, 0.0], [0.004, 0.004], [0.004, 0.0]]),
    )
    assert int(state["embedding_bags.t.step"]) == 1
    # A lookup without autograd (evaluation) neither updates nor counts.
    with torch.no_grad():
        ebc(KeyedJaggedTensor(["t"], torch.tensor([0, 1]), torch.tensor([1, 1])))
    assert int(ebc.optimizer_state_dict()["embedding_bags.t.step"]) == 1
    # t = 2, the same gradients: bias-corrected moments are again g and g^2, so the
    # step is again [1, -1] (with t = 1 it would be 0.38 / 0.1 / sqrt(0.007996 / 0.001)).
    w1 = expected[1]
    _step(ebc)
    torch.testing.assert_close(
        ebc.table_weights()["t"][1],
        torch.tensor([w1[0] - 0.5 * (1 + 0.1 * w1[0]), w1[1] - 0.5 * (-1 + 0.1 * w1[1])]),
    )
    assert int(ebc.optimizer_state_dict()["embedding_bags.t.step"]) == 2


def test_partial_rowwise_adam_by_hand():
    ebc = _one_table(kind="partial_rowwise_adam")
    _step(ebc)
    # m2[r] = 0.001 * mean_j g[r, j]^2: row 1 mean 4, row 2 mean 2; m1 as Adam's.
    # row 1: w -= 0.5 * g / sqrt(4); row 2: w -= 0.5 * g / sqrt(2)
    expected = [[1.0, 2.0], [2.5, 4.5], [5 - 0.5 * 2 / 2**0.5, 6.0]]
    torch.testing.assert_close(ebc.table_weights()["t"], torch.tensor(expected))
    state = ebc.optimizer_state_dict()
    torch.testing.assert_close(
        state["embedding_bags.t.momentum2"], torch.tensor([0.0, 0.004, 0.002])
    )
    assert state["embedding_bags.t.momentum1"].shape == (3, 2)


@pytest.mark.parametrize("mode", ["l2", "decoupled"])
def test_rowwise_adagrad_weight_decay_by_hand(mode):
    ebc = _one_table(weight_decay=0.1, weight_decay_mode=mode)
    _step(ebc)
    w, g = torch.tensor(W0[1]), torch.tensor([2.0, -2.0])
    if mode == "l2":  # g + 0.1 w feeds the statistic and the step
        g = g + 0.1 * w
        expected = w - 0.5 * g / g.square().mean().sqrt()
    else:  # the row shrinks by 1 - lr * wd; the statistic is of g alone
        expected = (1 - 0.5 * 0.1) * w - 0.5 * g / g.square().mean().sqrt()
    torch.testing.assert_close(ebc.table_weights()["t"][1], expected)
    torch.testing.assert_close(ebc.table_weights()["t"][0], torch.tensor(W0[0]))  # untouched


@pytest.mark.parametrize("kind", ["adam", "partial_rowwise_adam", "dense_adam"])
def test_checkpoint_round_trip_resumes_exactly(kind):
    """3 steps, state saved and loaded into a fresh collection, 3 more: the same as 6."""
    opt = EmbeddingOptimizerConfig(kind=kind, lr=0.05, weight_decay=0.01)
    whole = EmbeddingBagCollection(TABLES, opt, backend="torch", seed=3)
    first = EmbeddingBagCollection(TABLES, opt, backend="torch", seed=3)
    gen = torch.Generator().manual_seed(0)
    batches = [(i, random_batch(gen)) for i in range(6)]

    def run(ebc, steps):
        for i, batch in steps:
            out = ebc(batch).values()
            out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(i)))

    run(whole, batches)
    run(first, batches[:3])
    weights = {k: v.clone() for k, v in first.state_dict().items()}
    states = {k: v.clone() for k, v in first.optimizer_state_dict().items()}
    assert {int(states[f"embedding_bags.{t}.step"]) for t in "abc"} == {3}
    resumed = EmbeddingBagCollection(TABLES, opt, backend="torch", seed=5)
    resumed.load_state_dict(weights)
    resumed.load_optimizer_state_dict(states)
    run(resumed, batches[3:])
    for key, value in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key
    for key, value in whole.optimizer_state_dict().items():
        assert torch.equal(resumed.optimizer_state_dict()[key], value), key


def test_adam_trains_both_kernel_groups():
    ebc = EmbeddingBagCollection(
        TABLES, EmbeddingOptimizerConfig(kind="adam", lr=0.05), backend="torch"
    )
    before = {k: v.clone() for k, v in ebc.table_weights().items()}
    train_steps(ebc, 3)
    for name, weight in ebc.table_weights().items():
        assert not torch.equal(weight, before[name]), name


@pytest.mark.parametrize(
    "opt, needle",
    [
        ({"kind": "sgd", "weight_decay": 0.1}, "'sgd' has no 'decoupled' weight decay"),
        ({"kind": "adagrad", "weight_decay": 0.1}, "'adagrad' has no 'decoupled' weight decay"),
        ({"kind": "cf_sgd", "weight_decay": 0.1}, "'cf_sgd' has no 'decoupled' weight decay"),
        (
            {"kind": "adam", "weight_decay": 0.1, "weight_decay_mode": "l2"},
            "'adam' has no 'l2' weight decay",
        ),
        (
            {"kind": "partial_rowwise_adam", "weight_decay": 0.1, "weight_decay_mode": "l2"},
            "'partial_rowwise_adam' has no 'l2' weight decay",
        ),
        ({"kind": "adam", "beta2": 1.0}, r"beta2 must be in \[0, 1\)"),
        ({"weight_decay": -1.0}, "weight_decay must be >= 0"),
    ],
)
def test_unsupported_settings_are_refused_on_every_backend(opt, needle):
    with pytest.raises(ValueError, match=needle):
        EmbeddingOptimizerConfig(**opt)
    section = {"optimizer": opt.pop("kind", "rowwise_adagrad"), **opt}
    if "beta2" in section:
        section["adam_betas"] = [0.9, section.pop("beta2")]
    for backend in ("torch", "fbgemm"):
        with pytest.raises(ValueError, match=needle):
            config_from_dict({"embedding": {**section, "backend": backend}})


def test_zero_weight_decay_is_allowed_everywhere():
    for kind in EmbeddingOptimizer:
        EmbeddingOptimizerConfig(kind=kind, weight_decay=0.0, weight_decay_mode="l2")


def test_fbgemm_on_cpu_refuses_what_its_cpu_kernels_lack():
    pytest.importorskip("fbgemm_gpu")
    for opt, needle in (
        (EmbeddingOptimizerConfig(kind="adam"), "no cpu kernel for embedding optimizer 'adam'"),
        (
            EmbeddingOptimizerConfig(kind="partial_rowwise_adam"),
            "no cpu kernel for embedding optimizer 'partial_rowwise_adam'",
        ),
        (
            EmbeddingOptimizerConfig(weight_decay=0.1),
            "no cpu kernel for embedding optimizer 'rowwise_adagrad' with weight decay 0.1",
        ),
    ):
        with pytest.raises(ValueError, match=needle + r".*embedding.backend = 'torch'"):
            EmbeddingBagCollection(TABLES, opt, backend="fbgemm")
        assert EmbeddingBagCollection(TABLES, opt, backend="auto").backend is Backend.TORCH


def test_auto_backend_for_adam_and_weight_decay():
    adam, rowwise = EmbeddingOptimizer.ADAM, EmbeddingOptimizer.ROWWISE_ADAGRAD
    partial = EmbeddingOptimizer.PARTIAL_ROWWISE_ADAM
    assert auto_backend("cpu", "AVX512", True, adam) is Backend.TORCH
    assert auto_backend("cpu", "AVX512", True, partial) is Backend.TORCH
    assert auto_backend("cuda", "AVX2", True, adam) is Backend.FBGEMM
    assert auto_backend("cuda", "AVX2", True, partial, [8]) is Backend.FBGEMM
    assert auto_backend("cpu", "AVX512", True, rowwise, [8], 0.1) is Backend.TORCH
    assert auto_backend("cpu", "AVX512", True, rowwise, [8], 0.0) is Backend.FBGEMM
    assert auto_backend("cuda", "AVX2", True, rowwise, [8], 0.1) is Backend.FBGEMM


def _plain_adam_oracle(ebc, batches, grads, weight_decay):
    """The same steps on plain ``nn.EmbeddingBag``-style tables (dense gradients) under
    ``torch.optim.AdamW`` (decoupled weight decay; without it, ``torch.optim.Adam``)."""
    weights = {n: nn.Parameter(w.detach().clone()) for n, w in ebc.table_weights().items()}
    table_of = {f: t.name for t in TABLES for f in t.feature_names}
    pooling = {t.name: t.pooling.value for t in TABLES}
    # AdamW scales its decay by lr; towerrec's decoupled decay is lr * wd * w as well.
    opt = torch.optim.AdamW(weights.values(), lr=0.05, weight_decay=weight_decay, eps=1e-8)
    outputs = []
    for batch, grad in zip(batches, grads):
        pooled = []
        for key, jagged in batch.to_dict().items():
            table = table_of[key]
            offsets = torch.cat([torch.zeros(1, dtype=torch.long), jagged.lengths.cumsum(0)])
            pooled.append(
                F.embedding_bag(jagged.values, weights[table], offsets[:-1], mode=pooling[table])
            )
        out = torch.cat(pooled, dim=1)
        opt.zero_grad()
        out.backward(grad)
        opt.step()
        outputs.append(out.detach())
    return outputs, {n: w.detach() for n, w in weights.items()}


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_dense_adam_matches_torch_adam_on_dense_gradients(weight_decay, fused, monkeypatch):
    """``dense_adam`` moves every row every step, as ``torch.optim.Adam(W)`` does over an
    ``nn.EmbeddingBag`` with dense gradients: rows a batch misses keep moving on their
    moments. Lazy ``adam`` leaves them where they are, so the two must differ. Both of
    its paths: PyTorch's fused AdamW kernel, and the operators of a torch without it."""
    import towerrec.optim.sparse as sparse

    if not fused:
        monkeypatch.setattr(sparse, "_FUSED_ADAMW", None)
    elif sparse._FUSED_ADAMW is None:
        pytest.skip("this torch has no fused AdamW kernel")
    gen = torch.Generator().manual_seed(0)
    batches = [random_batch(gen, batch=3, max_len=2) for _ in range(8)]  # few rows a step
    opt = EmbeddingOptimizerConfig(kind="dense_adam", lr=0.05, weight_decay=weight_decay)
    ebc = EmbeddingBagCollection(TABLES, opt, backend="torch", seed=3)
    start = {n: w.detach().clone() for n, w in ebc.table_weights().items()}
    lazy = EmbeddingBagCollection(
        TABLES, replace(opt, kind=EmbeddingOptimizer.ADAM), backend="torch", seed=3
    )
    grads, seen = [], []
    for i, batch in enumerate(batches):
        out = ebc(batch).values()
        seen.append(out.detach().clone())
        grads.append(torch.randn(out.shape, generator=torch.Generator().manual_seed(i)))
        out.backward(grads[i])
        lazy(batch).values().backward(grads[i])
    fresh = EmbeddingBagCollection(TABLES, opt, backend="torch", seed=3)
    outputs, expected = _plain_adam_oracle(fresh, batches, grads, weight_decay)
    for name, weight in ebc.table_weights().items():
        torch.testing.assert_close(weight, expected[name], rtol=1e-5, atol=1e-6)
        assert not torch.equal(weight, start[name]), name
    assert any(
        not torch.allclose(w, ebc.table_weights()[n]) for n, w in lazy.table_weights().items()
    )
    for got, want in zip(seen, outputs):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert int(ebc.optimizer_state_dict()["embedding_bags.a.step"]) == len(batches)


def test_dense_adam_refuses_cached_tables_and_fbgemm():
    opt = EmbeddingOptimizerConfig(kind="dense_adam")
    with pytest.raises(ValueError, match=r"'dense_adam' moves every row.*memory = 'device'"):
        config_from_dict({"embedding": {"optimizer": "dense_adam", "memory": "cached"}})
    tables = {"tables": {"t0": {"memory": "cached"}}}
    with pytest.raises(ValueError, match=r"'dense_adam' moves every row.*\(t0\)"):
        config_from_dict({"embedding": {"optimizer": "dense_adam", **tables}})
    with pytest.raises(ValueError, match=r"'dense_adam' moves every row.*\['a'\]"):
        CachedEmbeddingBagCollection(TABLES, opt, tiers={"a": TierConfig(memory="cached")})
    if fbgemm_available():
        with pytest.raises(ValueError, match="no cpu kernel for embedding optimizer 'dense_adam'"):
            EmbeddingBagCollection(TABLES, opt, backend="fbgemm")
    assert EmbeddingBagCollection(TABLES, opt, backend="auto").backend is Backend.TORCH


def test_dense_adam_from_unique_rows_equals_the_dense_pass():
    """``sparse_update`` (the CUDA path: deduplicated rows) and ``dense_adam_update`` (the
    CPU path: every row's summed gradient) give the same bits."""
    opt = EmbeddingOptimizerConfig(kind="dense_adam", lr=0.05, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(20, 4, generator=gen)
    state = {"momentum1": torch.randn(20, 4, generator=gen), "momentum2": torch.rand(20, 4)}
    rows = torch.tensor([2, 5, 11])
    grad = torch.randn(3, 4, generator=gen)
    every_row = torch.zeros(20, 4).index_copy_(0, rows, grad)
    w2, s2 = weight.clone(), {k: v.clone() for k, v in state.items()}
    start = weight.clone()
    sparse_update(opt, weight, state, rows, grad, 0.05, iteration=3)
    dense_adam_update(opt, w2, s2, every_row, 0.05, 3)
    assert torch.equal(weight, w2)
    assert all(torch.equal(state[k], s2[k]) for k in state)
    assert not torch.equal(weight[0], start[0])  # a row without an id moves on its moments
