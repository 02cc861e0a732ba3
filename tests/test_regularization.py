"""Dropout, batch norm and weight decay of the dense part (``model.dropout``,
``model.batch_norm``, ``optimizer.weight_decay``)."""

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from towerrec.build.models import build_model
from towerrec.build.optimizers import build_dense_optimizer
from towerrec.config import ConfigError, load_config
from towerrec.data.synthetic import SyntheticSource
from towerrec.models.dlrm import DLRM
from towerrec.modules.embedding_bag import EmbeddingBagCollection
from towerrec.modules.mlp import MLP
from towerrec.modules.tables import TableConfig
from towerrec.train.step import evaluate

MODELS = ("dlrm", "dcn", "wukong", "dmt")
BASE = [
    "data.synthetic.num_embeddings=[20, 30, 40]",
    "data.synthetic.pooling_factors=[]",
    "data.synthetic.eval_samples=64",
    "embedding.backend=torch",
    "model.dmt.partition=contiguous",
    "model.dmt.tower_mlp=[8]",
    "model.dcn.structure=parallel",
]


def built(name, *overrides):
    config = load_config(None, [*BASE, f"model.name={name}", *overrides])
    source = SyntheticSource(config.data.synthetic)
    return build_model(config, source.schema, torch.device("cpu")), source


def mlps(model):
    return [m for m in model.modules() if isinstance(m, MLP)]


def test_defaults_are_the_plain_mlp():
    plain = MLP(6, [8, 4])
    assert [type(m) for m in plain] == [nn.Linear, nn.ReLU, nn.Linear, nn.ReLU]
    head = MLP(6, [8, 1], final_activation=False, dropout=0.5, batch_norm=True)
    assert [type(m) for m in head] == [nn.Linear, nn.BatchNorm1d, nn.ReLU, nn.Linear]


@pytest.mark.parametrize("name", MODELS)
def test_options_at_their_defaults_give_the_same_model(name):
    default, source = built(name)
    explicit, _ = built(name, "model.dropout=0.0", "model.batch_norm=false")
    assert default.state_dict().keys() == explicit.state_dict().keys()
    batch = next(iter(source.train_batches(16)))
    assert torch.equal(default(batch.dense, batch.sparse), explicit(batch.dense, batch.sparse))
    assert all(type(m) in (nn.Linear, nn.ReLU) for mlp in mlps(default) for m in mlp)


@pytest.mark.parametrize("name", MODELS)
def test_dropout_acts_in_training_only(name):
    plain, source = built(name)
    dropped, _ = built(name, "model.dropout=0.5")
    assert len(mlps(dropped)) >= 2 and all(mlp.dropout == 0.5 for mlp in mlps(dropped))
    assert dropped.state_dict().keys() == plain.state_dict().keys()
    dropped.load_state_dict(plain.state_dict())
    batch = next(iter(source.train_batches(32)))
    torch.manual_seed(1)
    assert not torch.equal(plain(batch.dense, batch.sparse), dropped(batch.dense, batch.sparse))
    plain.eval(), dropped.eval()
    assert torch.equal(plain(batch.dense, batch.sparse), dropped(batch.dense, batch.sparse))
    # The trainer's evaluation switches dropout off and restores training mode after.
    plain.train(), dropped.train()
    device = torch.device("cpu")
    metrics = evaluate(dropped, source.eval_batches(16), device)
    assert dropped.training
    assert metrics == evaluate(plain, source.eval_batches(16), device)


@pytest.mark.parametrize("name", MODELS)
def test_batch_norm_trains_and_evaluates(name):
    model, source = built(name, "model.batch_norm=true", "model.dropout=0.1")
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm1d)]
    assert norms and all(
        torch.equal(n.running_mean, torch.zeros_like(n.running_mean)) for n in norms
    )
    config = load_config(None, [*BASE, f"model.name={name}"])
    optimizer = build_dense_optimizer(config.optimizer, model)
    for batch in (b for _, b in zip(range(3), source.train_batches(32))):
        loss = nn.functional.binary_cross_entropy_with_logits(
            model(batch.dense, batch.sparse), batch.labels
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert all(not torch.equal(n.running_mean, torch.zeros_like(n.running_mean)) for n in norms)
    model.eval()
    single = next(iter(source.eval_batches(1)))  # eval mode: one row is fine
    logits = model(single.dense, single.sparse)
    assert logits.shape == (1,) and torch.isfinite(logits).all()


def test_flop_count_leaves_out_dropout_and_batch_norm():
    """Both are elementwise: neither our count nor torch's FlopCounterMode includes them."""
    _, source = built("dlrm")
    batch = next(iter(source.train_batches(8)))
    tables = [TableConfig(f"cat_{i}", n, 16) for i, n in enumerate((20, 30, 40))]
    counted, measured = [], []
    for options in ({}, {"dropout": 0.3, "batch_norm": True}):
        model = DLRM(
            EmbeddingBagCollection(tables, backend="torch"), 13, [16, 16], [16, 1], **options
        )
        counted.append(model.flops_per_sample())
        for training in (True, False):
            model.train(training)
            with FlopCounterMode(display=False) as counter:
                model(batch.dense, batch.sparse)
            measured.append(counter.get_total_flops())
    assert counted[0] == counted[1] and len(set(measured)) == 1


@pytest.mark.parametrize("name", ["adam", "adagrad", "sgd"])
def test_weight_decay_shrinks_weights_with_zero_gradient(name):
    model, _ = built("dlrm")
    config = load_config(None, [f"optimizer.name={name}", "optimizer.weight_decay=0.1"])
    optimizer = build_dense_optimizer(config.optimizer, model)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for old, new in zip(before, params):
        assert new.norm() < old.norm()  # adagrad's L2 step is ~lr * sign(w): can cross 0
        if name in ("adam", "sgd"):  # AdamW's decoupled decay; SGD's first step of L2
            torch.testing.assert_close(new, old * (1 - 0.002 * 0.1), rtol=1e-6, atol=0)


def test_no_weight_decay_leaves_weights_with_zero_gradient():
    model, _ = built("dlrm")
    optimizer = build_dense_optimizer(load_config().optimizer, model)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    assert all(torch.equal(old, new) for old, new in zip(before, params))


@pytest.mark.parametrize(
    "override, match",
    [
        ("model.dropout=1.0", r"model.dropout = 1.0 must lie in \[0, 1\)"),
        ("model.dropout=-0.1", r"model.dropout = -0.1 must lie in \[0, 1\)"),
        ("model.batch_norm=1", "model.batch_norm must be true or false"),
        ("optimizer.weight_decay=-0.01", "optimizer.weight_decay must be >= 0"),
    ],
)
def test_bad_values_are_refused(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_mlp_refuses_bad_dropout():
    with pytest.raises(ValueError, match=r"dropout must lie in \[0, 1\), got 1.5"):
        MLP(4, [4], dropout=1.5)
