import pytest
import torch
from conftest import needs_fbgemm

from towerrec.config import ConfigError, load_config
from towerrec.modules.embedding_bag import EmbeddingBagCollection
from towerrec.modules.tables import TableConfig
from towerrec.optim.sparse import EmbeddingOptimizerConfig
from towerrec.sparse import KeyedJaggedTensor


def step(ebc, values, lengths, grad):
    out = ebc(KeyedJaggedTensor(["t"], torch.tensor(values), torch.tensor(lengths))).values()
    out.backward(torch.tensor(grad))


def test_cf_sgd_by_hand():
    """3 rows of dim 2, lr 0.5, half-life 2 steps."""
    opt = EmbeddingOptimizerConfig(kind="cf_sgd", lr=0.5, counter_halflife=2.0)
    ebc = EmbeddingBagCollection([TableConfig("t", 3, 2)], opt, backend="torch")
    weights = ebc.table_weights()["t"]
    with torch.no_grad():
        weights.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]))
    # step 1: row 1, g = [1, -1]; c = 1; w1 = [3, 4] - 0.5 * g / 1
    step(ebc, [1], [1], [[1.0, -1.0]])
    torch.testing.assert_close(weights[1], torch.tensor([2.5, 4.5]))
    # step 2: row 1, g = [2, 0], c = 1 * 2^(-1/2) + 1 = 1.707107, sqrt = 1.306563
    #         row 2, g = [0, 4], c = 1
    step(ebc, [1, 2], [1, 1], [[2.0, 0.0], [0.0, 4.0]])
    torch.testing.assert_close(weights[1], torch.tensor([2.5 - 1.0 / 1.306563, 4.5]))
    torch.testing.assert_close(weights[2], torch.tensor([5.0, 4.0]))
    # step 3: id 1 twice in one bag: g = [2, 2]; c = 1.707107 * 2^(-1/2) + 1 = 2.207107,
    #         sqrt = 1.485633; w1 -= 0.5 * 2 / 1.485633 = 0.673113
    step(ebc, [1, 1], [2], [[1.0, 1.0]])
    expected = torch.tensor([[1.0, 2.0], [2.5 - 0.765367 - 0.673113, 4.5 - 0.673113], [5.0, 4.0]])
    torch.testing.assert_close(weights, expected)
    state = ebc.optimizer_state_dict()
    torch.testing.assert_close(
        state["embedding_bags.t.counter"], torch.tensor([0.0, 2.207107, 1.0])
    )
    torch.testing.assert_close(state["embedding_bags.t.last_step"], torch.tensor([0.0, 3.0, 2.0]))


def test_without_half_life_the_counter_counts_steps():
    opt = EmbeddingOptimizerConfig(kind="cf_sgd", lr=1.0)
    ebc = EmbeddingBagCollection([TableConfig("t", 4, 1)], opt, backend="torch")
    with torch.no_grad():
        ebc.table_weights()["t"].zero_()
    for _ in range(4):
        step(ebc, [0, 3], [1, 1], [[1.0], [0.0]])
    # row 0 moves by 1/sqrt(1) + 1/sqrt(2) + 1/sqrt(3) + 1/sqrt(4); row 3 is counted, not moved
    assert ebc.table_weights()["t"][0].item() == pytest.approx(-(1 + 2**-0.5 + 3**-0.5 + 0.5))
    assert ebc.optimizer_state_dict()["embedding_bags.t.counter"].tolist() == [4.0, 0.0, 0.0, 4.0]


@needs_fbgemm
def test_fbgemm_refuses_and_auto_picks_torch():
    opt = EmbeddingOptimizerConfig(kind="cf_sgd")
    with pytest.raises(
        ValueError,
        match=r"FBGEMM has no cpu kernel for embedding optimizer 'cf_sgd': set embedding\.backend",
    ):
        EmbeddingBagCollection([TableConfig("t", 3, 4)], opt, backend="fbgemm")
    assert EmbeddingBagCollection([TableConfig("t", 3, 4)], opt).backend.value == "torch"
    with pytest.raises(ConfigError, match="'cf_sgd' has no FBGEMM kernel"):
        load_config(None, ["embedding.optimizer=cf_sgd", "embedding.backend=fbgemm"])
    with pytest.raises(ConfigError, match="counter_halflife must be >= 0"):
        load_config(None, ["embedding.counter_halflife=-1"])


def test_cf_sgd_resume_equals_uninterrupted(tmp_path):
    from towerrec.workflows import training as trainer

    config = load_config(
        "configs/quick.toml",
        [
            "train.steps=10",
            "train.eval_every=0",
            "train.progress=false",
            "embedding.optimizer=cf_sgd",
            "embedding.counter_halflife=3",
            "embedding.lr=0.05",
        ],
    )
    full = trainer.train(config, tmp_path / "full")
    trainer.train(config, tmp_path / "split", stop_after=4)
    resumed = trainer.train(config, tmp_path / "split", resume=True)
    assert full["backend"] == "torch"
    assert resumed["auc"] == full["auc"] and resumed["logloss"] == full["logloss"]
