import itertools
import tomllib

import pytest
import torch
import torch.nn.functional as F

from towerrec.build.models import build_model
from towerrec.config import ConfigError, config_from_dict, config_to_toml, load_config
from towerrec.data.synthetic import SyntheticSource
from towerrec.models.dlrm import DLRM
from towerrec.models.dmt import DMT, DMTConfig, LowRankFM, TowerKind, TowerModule
from towerrec.modules.embedding_bag import EmbeddingBagCollection, dense_parameters
from towerrec.modules.tables import TableConfig
from towerrec.sparse import KeyedJaggedTensor

NAMES = [f"t{i}" for i in range(5)]


def make_ebc(seed=0, dim=4):
    tables = [TableConfig(n, 20 + 3 * i, dim) for i, n in enumerate(NAMES)]
    return EmbeddingBagCollection(tables, backend="torch", seed=seed)


def make_batch(batch=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (len(NAMES) * batch,), generator=g)
    values = torch.randint(0, 20, (int(lengths.sum()),), generator=g)
    dense = torch.randn(batch, 3, generator=g)
    labels = torch.randint(0, 2, (batch,), generator=g).float()
    return dense, KeyedJaggedTensor(NAMES, values, lengths), labels


PARTITION = [["t3", "t0"], ["t4", "t1", "t2"]]


@pytest.mark.parametrize("kind", ["dot", "fm", "identity"])
def test_dmt_shapes_and_gradients(kind):
    torch.manual_seed(0)
    model = DMT(make_ebc(), 3, [8, 4], [6, 1], PARTITION, tower=kind, tower_outputs=2)
    dense, sparse, _ = make_batch()
    dense.requires_grad_(True)
    x = model.bottom(dense)
    inputs = model.tower_inputs(model.sparse(sparse))
    assert [tuple(e.shape) for e in inputs] == [(6, 2, 4), (6, 3, 4)]
    outputs = [tower(e, x) for tower, e in zip(model.towers, inputs)]
    width = 2 if kind != "identity" else None
    assert [o.shape[1] for o in outputs] == ([width, width] if width else [2, 3])
    logits = model(dense, sparse)
    assert logits.shape == (6,)
    torch.testing.assert_close(logits, model.interact(x, outputs))
    logits.sum().backward()
    assert dense.grad is not None and dense.grad.abs().sum() > 0
    for name, p in dense_parameters(model):
        assert p.grad is not None, name
    assert model.compression_ratio == (5 / 4 if kind != "identity" else 1.0)
    assert model.flops_per_sample() > model.bottom.flops_per_sample()


def test_tower_inputs_follow_the_partition():
    model = DMT(make_ebc(), 3, [8, 4], [6, 1], PARTITION, tower="identity")
    _, sparse, _ = make_batch()
    pooled = model.sparse(sparse)
    first, second = model.tower_inputs(pooled)
    torch.testing.assert_close(first[:, 0], pooled["t3"])
    torch.testing.assert_close(first[:, 1], pooled["t0"])
    torch.testing.assert_close(second[:, 2], pooled["t2"])


def test_low_rank_fm_matches_weighted_pairwise_dots():
    fm = LowRankFM(4, 3)
    x = torch.randn(2, 4, 5)
    out = fm(x).view(2, 4, 3)
    gram = torch.einsum("bid,bjd->bij", x, x)
    torch.testing.assert_close(out, torch.einsum("bij,jr->bir", gram, fm.projection))


def test_dot_tower_with_dense_uses_x():
    tower = TowerModule(2, 4, "dot", outputs=1, use_dense=True)
    e, x = torch.randn(3, 2, 4), torch.randn(3, 4)
    assert not torch.allclose(tower(e, x), tower(e, x + 1))
    with pytest.raises(ValueError, match="pass the bottom output x"):
        tower(e)
    with pytest.raises(ValueError, match="use_dense needs kind dot or fm"):
        TowerModule(2, 4, "identity", use_dense=True)


def make_pair(partition, self_interaction=False):
    """A DLRM and an identity DMT with equal weights over separate, equal collections."""
    torch.manual_seed(1)
    dlrm = DLRM(make_ebc(), 3, [8, 4], [7, 5, 1], self_interaction=self_interaction)
    return dlrm, DMT.from_dlrm(dlrm, partition, sparse=make_ebc())


@pytest.mark.parametrize(
    "partition, self_interaction",
    [
        ([NAMES[:2], NAMES[2:]], False),  # towers in feature order
        (PARTITION, False),  # reordered: the top's columns are permuted
        ([["t2"], ["t4", "t0"], ["t1", "t3"]], True),
    ],
)
def test_identity_towers_reproduce_dlrm_outputs_gradients_and_training(partition, self_interaction):
    dlrm, dmt = make_pair(partition, self_interaction)
    opt_a = torch.optim.SGD([p for _, p in dense_parameters(dlrm)], lr=0.1)
    opt_b = torch.optim.SGD([p for _, p in dense_parameters(dmt)], lr=0.1)
    for step in range(4):
        dense, sparse, labels = make_batch(seed=step)
        dense_a, dense_b = dense.clone().requires_grad_(), dense.clone().requires_grad_()
        out_a, out_b = dlrm(dense_a, sparse), dmt(dense_b, sparse)
        torch.testing.assert_close(out_b, out_a, rtol=1e-5, atol=1e-6)
        for opt, out in ((opt_a, out_a), (opt_b, out_b)):
            opt.zero_grad()
            F.binary_cross_entropy_with_logits(out, labels).backward()
        torch.testing.assert_close(dense_b.grad, dense_a.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(
            dmt.bottom[0].weight.grad, dlrm.bottom[0].weight.grad, rtol=1e-5, atol=1e-6
        )
        opt_a.step()
        opt_b.step()
    # trained weights: bottom, top (deeper layers are not permuted) and embedding tables
    for name in ("bottom.0.weight", "bottom.2.weight", "top.2.weight", "top.4.bias"):
        torch.testing.assert_close(
            dmt.state_dict()[name], dlrm.state_dict()[name], rtol=1e-5, atol=1e-6
        )
    for name, weight in dlrm.sparse.table_weights().items():
        torch.testing.assert_close(dmt.sparse.table_weights()[name], weight, rtol=1e-5, atol=1e-6)


def test_identity_dmt_without_the_permutation_differs():
    """The permutation in from_dlrm matters: skip it and the outputs differ."""
    dlrm, dmt = make_pair(PARTITION)
    with torch.no_grad():
        dmt.top[0].weight.copy_(dlrm.top[0].weight)
    dense, sparse, _ = make_batch()
    assert not torch.allclose(dmt(dense, sparse), dlrm(dense, sparse), atol=1e-4)


def test_compressing_towers_shrink_the_top():
    flat = DMT(make_ebc(), 3, [8, 4], [6, 1], PARTITION, tower="identity")
    small = DMT(make_ebc(), 3, [8, 4], [6, 1], PARTITION, tower="dot", tower_outputs=1)
    # identity: 6 vectors -> 15 dots + x; dot: 3 vectors -> 3 dots + x + 2 flattened outputs
    assert flat.top[0].in_features == 4 + 15
    assert small.top[0].in_features == 4 + 2 * 4 + 3
    assert small.compression_ratio == 2.5


def test_tower_outputs_by_tower_size():
    """Default: one vector per 4 of a tower's features, rounded up; a count overrides it."""
    assert DMTConfig().outputs_per_tower([5, 4]) == [2, 1]
    assert DMTConfig().outputs_per_tower([1, 8, 9]) == [1, 2, 3]
    assert DMTConfig(features_per_output=2).outputs_per_tower([5, 4]) == [3, 2]
    assert DMTConfig(tower_outputs=1).outputs_per_tower([5, 4]) == [1, 1]


def test_towers_with_their_own_output_counts():
    torch.manual_seed(0)
    model = DMT(make_ebc(), 3, [8, 4], [6, 1], PARTITION, tower="dot", tower_outputs=[2, 1])
    dense, sparse, _ = make_batch()
    x = model.bottom(dense)
    outputs = [t(e, x) for t, e in zip(model.towers, model.tower_inputs(model.sparse(sparse)))]
    assert [tuple(o.shape) for o in outputs] == [(6, 2, 4), (6, 1, 4)]
    # x and 3 vectors: 6 dots; x and 3 flattened outputs
    assert model.top[0].in_features == 4 + 3 * 4 + 6
    assert model.compression_ratio == 5 / 3
    torch.testing.assert_close(model(dense, sparse), model.interact(x, outputs))
    with pytest.raises(ValueError, match="lists 3 counts for 2 towers"):
        DMT(make_ebc(), 3, [8, 4], [6, 1], PARTITION, tower_outputs=[1, 1, 1])


def test_built_dmt_sends_the_configured_outputs():
    groups = "[['cat_0', 'cat_1', 'cat_2', 'cat_3', 'cat_4'], ['cat_5', 'cat_6', 'cat_7', 'cat_8']]"
    sets = ["model.name=dmt", f"model.dmt.partition={groups}"]
    for extra, counts in (([], [2, 1]), (["model.dmt.tower_outputs=1"], [1, 1])):
        config = load_config(None, [*sets, *extra])
        schema = SyntheticSource(config.data.synthetic).schema
        model = build_model(config, schema, torch.device("cpu"))
        assert [t.num_outputs for t in model.towers] == counts


@pytest.mark.parametrize(
    "partition, match",
    [
        ([["t0", "t1"], ["t2", "t3"]], r"missing \['t4'\]"),
        ([["t0", "t1", "t9"], ["t2", "t3", "t4"]], r"unknown \['t9'\]"),
        ([["t0", "t1"], ["t1", "t2", "t3", "t4"]], "'t1' is in towers 0 and 1"),
        ([[], NAMES], "tower 0 of the partition has no features"),
    ],
)
def test_bad_partitions(partition, match):
    with pytest.raises(ValueError, match=match):
        DMT(make_ebc(), 3, [8, 4], [6, 1], partition)


def test_dmt_config_validation_and_toml():
    cfg = load_config(
        None,
        [
            "model.name=dmt",
            "model.dmt.num_towers=2",
            "model.dmt.partition=[['cat_0', 'cat_1'], ['cat_2']]",
            "model.dmt.tower=fm",
        ],
    )
    assert cfg.model.dmt.partition == (("cat_0", "cat_1"), ("cat_2",))
    assert cfg.model.dmt.tower is TowerKind.FM
    assert config_from_dict(tomllib.loads(config_to_toml(cfg))) == cfg  # run dirs reproduce it
    assert load_config(None, ["model.dmt.partition=random"]).model.dmt.partition == "random"
    with pytest.raises(ConfigError, match=r"lists 1 groups but model\.dmt\.num_towers = 2"):
        load_config(None, ["model.dmt.partition=[['cat_0']]"])
    with pytest.raises(ConfigError, match=r"model\.dmt\.partition = 'best'"):
        load_config(None, ["model.dmt.partition=best"])
    with pytest.raises(ConfigError, match=r"model\.dmt\.tower = 'mlp' is not one of"):
        load_config(None, ["model.dmt.tower=mlp"])
    with pytest.raises(ValueError, match="tower_outputs must be >= 0"):
        DMTConfig(tower_outputs=-1)
    with pytest.raises(ValueError, match="features_per_output must be >= 1"):
        DMTConfig(features_per_output=0)
    with pytest.raises(ValueError, match="must be >= 0 with a sum <= 1"):
        DMTConfig(memory_weight=0.5, count_weight=0.7)


def test_pair_order_matches_a_loop():
    """from_dlrm relies on the dot order of DotInteraction: row-major upper triangle."""
    from towerrec.models.dmt import _pair_positions

    pairs = _pair_positions(4, False)
    assert list(pairs) == list(itertools.combinations(range(4), 2))
