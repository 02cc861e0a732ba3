"""Batch checks: teacher logits travel with the batch and are validated."""

import pytest
import torch

from towerrec.data.batch import Batch
from towerrec.sparse import KeyedJaggedTensor


def _batch(teacher: torch.Tensor | None) -> Batch:
    sparse = KeyedJaggedTensor(["a"], torch.tensor([1, 2, 3]), torch.tensor([1, 1, 1]))
    return Batch(torch.zeros(3, 2), sparse, torch.tensor([0.0, 1.0, 1.0]), teacher)


def test_teacher_logits_follow_the_batch() -> None:
    batch = _batch(torch.tensor([0.5, -1.0, 2.0]))
    moved = batch.to("cpu")
    assert moved.teacher_logits is not None
    assert torch.equal(moved.teacher_logits, torch.tensor([0.5, -1.0, 2.0]))
    assert batch.pin_memory().teacher_logits is not None
    assert _batch(None).to("cpu").teacher_logits is None


def test_bad_teacher_logits_are_named() -> None:
    with pytest.raises(ValueError, match="teacher logit of sample 1 is nan"):
        _batch(torch.tensor([0.5, float("nan"), 2.0]))
    with pytest.raises(ValueError, match=r"teacher logits must be a float tensor \[3\]"):
        _batch(torch.tensor([0.5, 1.0]))
