import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from towerrec.build.models import build_model
from towerrec.config import ConfigError, load_config
from towerrec.data.synthetic import SyntheticSource
from towerrec.models.dcn import DCN, CrossNetwork, DCNConfig
from towerrec.models.dlrm import DLRM
from towerrec.models.dmt import DMT
from towerrec.models.wukong import Wukong, WukongConfig, WukongLayer
from towerrec.modules.compact import CompactConfig, CompactEmbeddingCollection
from towerrec.modules.embedding_bag import EmbeddingBagCollection
from towerrec.modules.tables import TableConfig
from towerrec.sparse import KeyedJaggedTensor


def collection(num_tables=3, dim=4):
    return EmbeddingBagCollection(
        [TableConfig(f"t{i}", 10, dim) for i in range(num_tables)], backend="torch"
    )


def mixed_dim_collection(num_tables=3, dim=4):
    tables = [TableConfig(f"t{i}", 10 * 4**i, dim) for i in range(num_tables)]
    config = CompactConfig(kind="md", md_alpha=0.5, md_min_dim=1, md_round_to=1)
    return CompactEmbeddingCollection(tables, config, backend="torch")


def batch(num_tables=3, size=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    keys = [f"t{i}" for i in range(num_tables)]
    lengths = torch.randint(1, 3, (num_tables * size,), generator=gen)
    values = torch.randint(0, 10, (int(lengths.sum()),), generator=gen)
    return torch.randn(size, 6, generator=gen), KeyedJaggedTensor(keys, values, lengths)


def test_cross_network_matches_the_formula():
    torch.manual_seed(0)
    net = CrossNetwork(5, num_layers=2)
    x0 = torch.randn(3, 5)
    x = x0
    for layer in net.up:
        x = x0 * (x @ layer.weight.T + layer.bias) + x
    torch.testing.assert_close(net(x0), x)


def test_low_rank_cross_equals_full_rank_with_the_product_weight():
    torch.manual_seed(0)
    low = CrossNetwork(6, num_layers=2, rank=2)
    full = CrossNetwork(6, num_layers=2)
    with torch.no_grad():
        for d, u, f in zip(low.down, low.up, full.up):
            f.weight.copy_(u.weight @ d.weight)
            f.bias.copy_(u.bias)
    x0 = torch.randn(4, 6)
    torch.testing.assert_close(low(x0), full(x0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("structure", ["stacked", "parallel"])
def test_dcn_forward_and_backward(structure):
    torch.manual_seed(0)
    model = DCN(collection(), 6, [8, 4], [8, 1], DCNConfig(2, rank=0, structure=structure))
    dense, sparse = batch()
    logits = model(dense, sparse)
    assert logits.shape == (5,)
    logits.sum().backward()
    assert all(p.grad is not None for p in model.cross.parameters())


def test_wukong_layer_matches_the_formula():
    torch.manual_seed(0)
    layer = WukongLayer(num_in=5, dim=3, num_fm=2, num_lcb=4, fm_rank=2, fm_mlp=[7])
    x = torch.randn(4, 5, 3)
    # FM with the full interaction matrix: (X X^T) Y, flattened
    fm = (x @ x.transpose(1, 2) @ layer.fm_y).reshape(4, -1)
    fmb = layer.fm_mlp(layer.fm_norm(fm)).view(4, 2, 3)
    lcb = layer.lcb @ x  # [B, n_L, D]
    skip = layer.residual @ x  # 5 inputs -> 6 outputs: projected residual
    expected = torch.nn.functional.layer_norm(torch.cat([fmb, lcb], 1) + skip, (3,))
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    same_width = WukongLayer(num_in=6, dim=3, num_fm=2, num_lcb=4, fm_rank=2, fm_mlp=[7])
    assert same_width.residual is None


def test_wukong_forward_and_backward():
    torch.manual_seed(0)
    config = WukongConfig(num_layers=3, num_fm=3, num_lcb=2, fm_rank=2, fm_mlp=(8,), dense_rows=2)
    model = Wukong(collection(), 6, [8, 8], [8, 1], config)
    dense, sparse = batch()
    logits = model(dense, sparse)
    assert logits.shape == (5,)
    logits.sum().backward()
    assert model.layers[0].fm_y.grad is not None and model.layers[2].lcb.grad is not None
    with pytest.raises(ValueError, match="dense_rows \\* embedding dim = 2 \\* 4 = 8"):
        Wukong(collection(), 6, [8, 4], [8, 1], config)


@pytest.mark.parametrize(
    "make",
    [
        lambda: DLRM(collection(), 6, [16, 4], [16, 8, 1]),
        lambda: DCN(collection(), 6, [16, 4], [16, 1], DCNConfig(3)),
        lambda: DCN(collection(), 6, [16, 4], [16, 1], DCNConfig(2, rank=3, structure="parallel")),
        lambda: Wukong(collection(), 6, [16, 4], [16, 1], WukongConfig(2, 4, 3, 2, (16,))),
        lambda: DMT(collection(), 6, [16, 4], [16, 1], [["t0", "t1"], ["t2"]]),
        # mixed dims: the collection's own projections count too
        lambda: DMT(mixed_dim_collection(), 6, [16, 4], [16, 1], [["t0"], ["t1", "t2"]]),
    ],
)
def test_flops_per_sample_matches_torch_flop_counter(make):
    """Our analytic count against PyTorch's count of the matmuls actually run.

    Ours also counts elementwise work (bias, products, residuals), a few percent."""
    torch.manual_seed(0)
    model = make()
    dense, sparse = batch(size=8)
    with FlopCounterMode(display=False) as counter:
        model(dense, sparse)
    measured = counter.get_total_flops() / 8
    assert measured <= model.flops_per_sample() <= 1.08 * measured


def test_config_selects_the_model():
    base = ["data.synthetic.num_embeddings=[20, 30]", "data.synthetic.pooling_factors=[]"]
    source = SyntheticSource(load_config(None, base).data.synthetic)
    for name, cls in (("dlrm", DLRM), ("dcn", DCN), ("wukong", Wukong)):
        config = load_config(None, [*base, f"model.name={name}"])
        assert type(build_model(config, source.schema, torch.device("cpu"))) is cls
    config = load_config(
        None, [*base, "model.name=dcn", "model.dcn.rank=3", "model.dcn.num_layers=1"]
    )
    model = build_model(config, source.schema, torch.device("cpu"))
    assert model.cross.rank == 3 and len(model.cross.up) == 1


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["model.name=dmlr"], "model.name = 'dmlr' is not one of 'dlrm', 'dcn', 'wukong'"),
        (["model.dcn.structure=serial"], "model.dcn.structure = 'serial' is not one of"),
        (["model.dcn.num_layers=-1"], r"model.dcn.num_layers must be >= 0 \(0 = the deep"),
        (["model.wukong.num_fm=0", "model.wukong.num_lcb=0"], "positive sum"),
        (
            ["model.name=wukong", "model.wukong.dense_rows=2"],
            r"must end at model.wukong.dense_rows \* embedding_dim = 32.*\[64, 32\]",
        ),
    ],
)
def test_model_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def _raw_dense_config(name: str, *overrides: str):
    return load_config(
        None,
        [
            "data.synthetic.num_embeddings=[20, 30]",
            "data.synthetic.pooling_factors=[]",
            "data.synthetic.num_dense=3",
            f"model.name={name}",
            "model.bottom_mlp=[]",
            *overrides,
        ],
    )


@pytest.mark.parametrize("name", ["dlrm", "wukong"])
def test_models_whose_interaction_needs_a_dense_vector_refuse_an_empty_bottom_mlp(name):
    config = _raw_dense_config(name)
    schema = SyntheticSource(config.data.synthetic).schema
    with pytest.raises(ValueError, match=r"3 dense features but bottom_mlp = \[\] reads none"):
        build_model(config, schema, torch.device("cpu"))


@pytest.mark.parametrize("structure", ["stacked", "parallel"])
def test_dcn_without_a_bottom_mlp_reads_the_dense_features_as_they_are(structure):
    """``model.bottom_mlp = []`` on data with dense features: x0 = [dense, E]; with no cross
    layer (``num_layers = 0``, stacked) the model is the deep MLP over that concatenation,
    FuxiCTR's DNN."""
    torch.manual_seed(0)
    config = _raw_dense_config("dcn", "model.dcn.num_layers=0", f"model.dcn.structure={structure}")
    source = SyntheticSource(config.data.synthetic)
    model = build_model(config, source.schema, torch.device("cpu"))
    assert model.bottom is None and model.cross.in_features == 3 + 2 * 16
    batch = source.samples("train", 0, 8)[0]
    embeddings = model.sparse(batch.sparse).values()
    x0 = torch.cat([batch.dense, embeddings], 1)
    if structure == "stacked":
        expected = model.deep(x0).squeeze(1)
    else:  # no cross layer: the head reads x0 itself beside the deep MLP's output
        expected = model.head(torch.cat([x0, model.deep(x0)], 1)).squeeze(1)
    torch.testing.assert_close(model(batch.dense, batch.sparse), expected)
