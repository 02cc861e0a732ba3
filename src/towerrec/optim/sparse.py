"""Exact sparse optimizers for embedding rows (the pure-PyTorch kernel path).

Each update receives the rows touched in a step, already deduplicated, and
their summed gradients, and updates the weights and state in place, with the
same arithmetic as FBGEMM's fused CPU/CUDA kernels:

    rowwise_adagrad   m[r] += mean_j g[r, j]^2      w[r] -= lr * g[r] / (sqrt(m[r]) + eps)
    adagrad           m[r] += g[r]^2                w[r] -= lr * g[r] / (sqrt(m[r]) + eps)
    sgd                                             w[r] -= lr * g[r]
    cf_sgd            counter-based frequency-aware SGD, see ``optim/counter.py``
                      (no FBGEMM CPU kernel: the torch kernel path only)
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch

from towerrec.optim.counter import counter_sgd_update
from towerrec.utils import parse_enum

__all__ = [
    "EmbeddingOptimizer",
    "EmbeddingOptimizerConfig",
    "rowwise_adagrad_update",
    "sparse_update",
]


class EmbeddingOptimizer(StrEnum):
    """Sparse optimizers fused into the embedding backward pass.

    All are "exact": gradients of repeated ids in a batch are summed before the
    row is updated once.
    """

    ROWWISE_ADAGRAD = "rowwise_adagrad"
    ADAGRAD = "adagrad"
    SGD = "sgd"
    CF_SGD = "cf_sgd"

    def state_shapes(self, num_embeddings: int, embedding_dim: int) -> dict[str, tuple[int, ...]]:
        """Optimizer state tensors kept per table, by canonical name."""
        if self is EmbeddingOptimizer.ROWWISE_ADAGRAD:
            return {"momentum1": (num_embeddings,)}
        if self is EmbeddingOptimizer.ADAGRAD:
            return {"momentum1": (num_embeddings, embedding_dim)}
        if self is EmbeddingOptimizer.CF_SGD:
            return {"counter": (num_embeddings,), "last_step": (num_embeddings,)}
        return {}


@dataclass(frozen=True)
class EmbeddingOptimizerConfig:
    kind: EmbeddingOptimizer = EmbeddingOptimizer.ROWWISE_ADAGRAD
    lr: float = 0.05
    eps: float = 1e-8
    counter_halflife: float = 0.0  # cf_sgd: steps for a row's count to halve; 0 = no decay

    def __post_init__(self) -> None:
        if self.counter_halflife < 0:
            raise ValueError(f"counter_halflife must be >= 0, got {self.counter_halflife}")
        object.__setattr__(
            self, "kind", parse_enum(EmbeddingOptimizer, self.kind, "embedding optimizer")
        )
        if not self.lr > 0:
            raise ValueError(f"embedding optimizer lr must be > 0, got {self.lr}")
        if not self.eps > 0:
            raise ValueError(f"embedding optimizer eps must be > 0, got {self.eps}")


def sparse_update(
    kind: EmbeddingOptimizer,
    weight: torch.Tensor,
    state: dict[str, torch.Tensor],
    rows: torch.Tensor,
    grad: torch.Tensor,
    lr: float,
    eps: float,
    *,
    halflife: float = 0.0,
) -> None:
    """Apply one step to ``weight[rows]`` given ``grad[U, D]`` for unique ``rows[U]``.

    Rows are unique, so each update is a gather, arithmetic, and a scatter
    (``index_copy_``), several times faster on CPU than ``index_add_`` into a
    large table.
    """
    if kind is EmbeddingOptimizer.CF_SGD:
        counter_sgd_update(weight, state, rows, grad, lr, halflife)
        return
    if kind is EmbeddingOptimizer.SGD:
        step = grad * lr
    elif kind is EmbeddingOptimizer.ROWWISE_ADAGRAD:
        mean_square = grad.square().mean(dim=1)
        rowwise_adagrad_update(weight, state["momentum1"], rows, grad, mean_square, lr, eps)
        return
    elif kind is EmbeddingOptimizer.ADAGRAD:
        momentum = state["momentum1"]
        m = momentum.index_select(0, rows).add_(grad.square())
        momentum.index_copy_(0, rows, m)
        step = grad * lr / m.sqrt_().add_(eps)
    else:  # pragma: no cover - the enum is closed
        raise ValueError(f"unsupported embedding optimizer {kind}")
    weight.index_copy_(0, rows, weight.index_select(0, rows).sub_(step))


def rowwise_adagrad_update(
    weight: torch.Tensor,
    momentum: torch.Tensor,
    rows: torch.Tensor,
    grad: torch.Tensor,
    mean_square: torch.Tensor,
    lr: float,
    eps: float,
) -> None:
    """Row-wise Adagrad on unique ``rows[U]`` given ``grad[U, D]`` and each row's
    ``mean_square[U]`` (``mean_j g[r, j]^2``, passed in so that a table split by
    columns can use the mean over all of its columns, not only the shard's)."""
    m = momentum.index_select(0, rows).add_(mean_square)
    momentum.index_copy_(0, rows, m)
    step = grad * (lr / m.sqrt_().add_(eps)).unsqueeze(1)
    weight.index_copy_(0, rows, weight.index_select(0, rows).sub_(step))
