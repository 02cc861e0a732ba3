import itertools

import pytest
import torch

from towerrec.models.dlrm import DLRM
from towerrec.modules.embedding_bag import EmbeddingBagCollection
from towerrec.modules.interaction import DotInteraction
from towerrec.modules.tables import TableConfig
from towerrec.sparse import KeyedJaggedTensor


@pytest.mark.parametrize("self_interaction", [False, True])
def test_dot_interaction_matches_pairwise_loop(self_interaction):
    x = torch.randn(5, 4, 3)
    out = DotInteraction(4, self_interaction)(x)
    pairs = (
        itertools.combinations_with_replacement(range(4), 2)
        if self_interaction
        else itertools.combinations(range(4), 2)
    )
    expected = torch.stack([(x[:, i] * x[:, j]).sum(1) for i, j in pairs], dim=1)
    torch.testing.assert_close(out, expected)


def make_dlrm(**kwargs):
    ebc = EmbeddingBagCollection([TableConfig(f"t{i}", 10, 4) for i in range(3)], backend="torch")
    return DLRM(ebc, num_dense=5, bottom_mlp=[8, 4], top_mlp=[6, 1], **kwargs)


def test_dlrm_forward_shapes_and_gradients():
    model = make_dlrm()
    sparse = KeyedJaggedTensor(
        ["t0", "t1", "t2"], torch.tensor([1, 2, 3, 4, 5, 6, 7]), torch.tensor([1, 1, 2, 0, 1, 2])
    )
    dense = torch.randn(2, 5, requires_grad=True)
    logits = model(dense, sparse)
    assert logits.shape == (2,)
    logits.sum().backward()
    assert dense.grad is not None and model.top[0].weight.grad is not None
    # 4 vectors (bottom + 3 tables): 6 pairwise dots + the bottom output of width 4
    assert model.top[0].in_features == 4 + 6
    assert model.flops_per_sample() > 0


def test_dlrm_shape_errors():
    ebc = EmbeddingBagCollection(
        [TableConfig("a", 10, 4), TableConfig("b", 10, 8)], backend="torch"
    )
    with pytest.raises(ValueError, match="one embedding dim"):
        DLRM(ebc, 5, [4], [1])
    ebc = EmbeddingBagCollection([TableConfig("a", 10, 4)], backend="torch")
    with pytest.raises(ValueError, match="must end at the embedding dim 4"):
        DLRM(ebc, 5, [8], [1])
    with pytest.raises(ValueError, match="end in one logit"):
        DLRM(ebc, 5, [4], [3])
