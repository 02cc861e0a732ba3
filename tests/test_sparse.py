import pytest
import torch
from conftest import needs_torchrec

from towerrec.sparse import KeyedJaggedTensor, KeyedTensor


def kjt(weights=False):
    # keys a, b; batch 3: a = [[1], [2, 3], []], b = [[4], [], [5, 6, 7]]
    values = torch.tensor([1, 2, 3, 4, 5, 6, 7])
    lengths = torch.tensor([1, 2, 0, 1, 0, 3])
    w = torch.arange(7, dtype=torch.float32) if weights else None
    return KeyedJaggedTensor(["a", "b"], values, lengths, w)


def test_layout_accessors():
    t = kjt()
    assert t.stride() == 3
    assert t.offsets().tolist() == [0, 1, 3, 3, 4, 4, 7]
    assert t.length_per_key() == [3, 4]
    assert t["b"].values.tolist() == [4, 5, 6, 7]
    assert t["b"].lengths.tolist() == [1, 0, 3]
    assert t["a"].to_padded(-1).tolist() == [[1, -1], [2, 3], [-1, -1]]


@pytest.mark.parametrize(
    "values, lengths, match",
    [
        (torch.tensor([1, 2, 3]), torch.tensor([1, 1, 0, 0]), "lengths sum to 2 but there are 3"),
        (torch.tensor([1, -2]), torch.tensor([1, 1, 0, 0]), "negative id -2 at value position 1"),
        (torch.tensor([1.0, 2.0]), torch.tensor([1, 1, 0, 0]), "int32 or int64 tensor of ids"),
        (torch.tensor([1, 2]), torch.tensor([1.0, 1.0, 0, 0]), "lengths must be an int32 or int64"),
        (torch.tensor([1, 2]), torch.tensor([1, 1, 0]), "not a multiple of the 2 keys"),
        (torch.tensor([1, 2]), torch.tensor([3, -1, 0, 0]), "non-negative"),
    ],
)
def test_construction_errors(values, lengths, match):
    with pytest.raises(ValueError, match=match):
        KeyedJaggedTensor(["a", "b"], values, lengths)


def test_weight_and_key_errors():
    with pytest.raises(ValueError, match="weights shape"):
        KeyedJaggedTensor(["a"], torch.tensor([1, 2]), torch.tensor([2]), torch.ones(3))
    with pytest.raises(ValueError, match="floating-point"):
        KeyedJaggedTensor(
            ["a"], torch.tensor([1, 2]), torch.tensor([2]), torch.ones(2, dtype=torch.int64)
        )
    with pytest.raises(ValueError, match="repeated"):
        KeyedJaggedTensor(["a", "a"], torch.tensor([1]), torch.tensor([1, 0]))
    with pytest.raises(KeyError, match="no key 'z'"):
        kjt()["z"]


def test_permute_select_split_concat_roundtrip():
    t = kjt(weights=True)
    p = t.permute([1, 0])
    assert p.keys() == ["b", "a"]
    assert p.values().tolist() == [4, 5, 6, 7, 1, 2, 3]
    assert p.lengths().tolist() == [1, 0, 3, 1, 2, 0]
    assert p.weights().tolist() == [3, 4, 5, 6, 0, 1, 2]
    assert t.select(["b"]).values().tolist() == [4, 5, 6, 7]
    a, b = t.split([1, 1])
    assert a.keys() == ["a"] and b["b"].lengths.tolist() == [1, 0, 3]
    back = KeyedJaggedTensor.concat([b, a]).permute([1, 0])
    for x, y in (
        (back.values(), t.values()),
        (back.lengths(), t.lengths()),
        (back.weights(), t.weights()),
    ):
        assert torch.equal(x, y)
    with pytest.raises(ValueError, match="sum to the 2 keys"):
        t.split([1, 2])
    with pytest.raises(KeyError, match="not in this batch"):
        t.select(["a", "q"])


def test_to_and_pin_memory_keep_data():
    t = kjt(weights=True)
    for moved in (t.to("cpu"), t.pin_memory()):
        assert moved.keys() == t.keys()
        assert torch.equal(moved.values(), t.values())
        assert torch.equal(moved.weights(), t.weights())
        assert torch.equal(moved.offsets(), t.offsets())


def test_from_jagged_dict():
    t = kjt()
    again = KeyedJaggedTensor.from_jagged_dict(t.to_dict())
    assert torch.equal(again.values(), t.values()) and torch.equal(again.lengths(), t.lengths())


def test_keyed_tensor():
    values = torch.arange(12.0).view(2, 6)
    kt = KeyedTensor(["x", "y"], [2, 4], values)
    assert kt["y"].tolist() == [[2, 3, 4, 5], [8, 9, 10, 11]]
    with pytest.raises(ValueError, match="one common dim"):
        kt.stacked()
    assert KeyedTensor(["x", "y"], [3, 3], values).stacked().shape == (2, 2, 3)
    with pytest.raises(ValueError, match=r"values must be \[B, 5\]"):
        KeyedTensor(["x", "y"], [2, 3], values)


@needs_torchrec
def test_torchrec_roundtrip():
    t = kjt(weights=True)
    trec = t.to_torchrec()
    assert trec.keys() == ["a", "b"]
    assert torch.equal(trec.offsets(), t.offsets())
    assert torch.equal(trec["b"].values(), t["b"].values)
    back = KeyedJaggedTensor.from_torchrec(trec)
    assert torch.equal(back.values(), t.values()) and torch.equal(back.weights(), t.weights())
