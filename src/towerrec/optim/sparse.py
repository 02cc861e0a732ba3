"""Exact sparse optimizers for embedding rows (the pure-PyTorch kernel path).

Each update receives the rows touched in a step, already deduplicated, and
their summed gradients, and updates the weights and state in place, with the
same arithmetic as FBGEMM's fused CPU/CUDA kernels:

    rowwise_adagrad   m[r] += mean_j g[r, j]^2      w[r] -= lr * g[r] / (sqrt(m[r]) + eps)
    adagrad           m[r] += g[r]^2                w[r] -= lr * g[r] / (sqrt(m[r]) + eps)
    sgd                                             w[r] -= lr * g[r]
    adam              m1[r] = b1 m1[r] + (1 - b1) g[r]    m2[r] = b2 m2[r] + (1 - b2) g[r]^2
                      w[r] -= lr * (m1[r] / (1 - b1^t) / (sqrt(m2[r] / (1 - b2^t)) + eps) + wd w[r])
    partial_rowwise_adam   as adam, with one m2[r] per row: b2 m2[r] + (1 - b2) mean_j g[r, j]^2
    dense_adam        adam over every row of the table every step, g[r] = 0 where the batch
                      has no id r (its moments decay, its weight keeps moving): what
                      ``torch.optim.Adam`` does to an ``nn.Embedding`` with dense gradients
    cf_sgd            counter-based frequency-aware SGD, see ``optim/counter.py``
                      (no FBGEMM CPU kernel: the torch kernel path only)

``t`` is the kernel's step (``step`` in the state): its training lookups so far,
this one included, as FBGEMM's ``iter``; except under dense_adam, only the rows a
batch touches are updated (their moments do not decay while they are not looked up;
FBGEMM's and TensorFlow's "lazy" Adam). dense_adam, what FuxiCTR's recipe trains its
rows with, costs a pass over every row of the table a step, so it suits tables of up
to millions of rows (docs/benchmarks.md, "Model quality", for what it scored). Weight
decay (``wd``): Adam's is decoupled, as in FBGEMM's kernels; row-wise Adagrad
takes either mode of FBGEMM's ``weight_decay_mode``:

    l2          g'[r] = g[r] + wd w[r] feeds m[r]; w[r] -= lr * g'[r] / (sqrt(m[r]) + eps)
    decoupled   w[r] = (1 - lr wd) w[r] - lr * g[r] / (sqrt(m[r]) + eps)

FBGEMM has no weight decay for sgd and adagrad; nor has cf_sgd.

Small tables (``dense_update_applies``): row-wise Adagrad without weight decay over
tables with no more rows than the lookup has ids is updated over every row at once
(``dense_rowwise_update``): the gradient summed into a zero table by id instead of
deduplicating the ids (a sort), and the update run on all rows. An untouched row's
gradient is 0, so its statistic gains 0 and its weight loses 0: the same result, bit for
bit, as the update of the touched rows alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch

from towerrec.optim.counter import counter_sgd_update
from towerrec.utils import at_least, parse_enum, positive

__all__ = [
    "EmbeddingOptimizer",
    "EmbeddingOptimizerConfig",
    "WeightDecayMode",
    "dense_adam_update",
    "dense_rowwise_update",
    "dense_update_applies",
    "l2_gradient",
    "rowwise_update",
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
    ADAM = "adam"
    PARTIAL_ROWWISE_ADAM = "partial_rowwise_adam"
    DENSE_ADAM = "dense_adam"

    @property
    def is_rowwise(self) -> bool:
        """Whether a row's update needs a statistic over all of its columns."""
        return self in (EmbeddingOptimizer.ROWWISE_ADAGRAD, EmbeddingOptimizer.PARTIAL_ROWWISE_ADAM)

    def state_shapes(self, num_embeddings: int, embedding_dim: int) -> dict[str, tuple[int, ...]]:
        """Optimizer state tensors kept per table, by canonical name: ``[rows]`` row-wise,
        ``[rows, dim]`` per element, ``()`` the kernel's step (shared by its tables)."""
        if self in (EmbeddingOptimizer.ADAM, EmbeddingOptimizer.DENSE_ADAM):
            shape = (num_embeddings, embedding_dim)
            return {"momentum1": shape, "momentum2": shape, "step": ()}
        if self is EmbeddingOptimizer.PARTIAL_ROWWISE_ADAM:
            shape = (num_embeddings, embedding_dim)
            return {"momentum1": shape, "momentum2": (num_embeddings,), "step": ()}
        if self is EmbeddingOptimizer.ROWWISE_ADAGRAD:
            return {"momentum1": (num_embeddings,)}
        if self is EmbeddingOptimizer.ADAGRAD:
            return {"momentum1": (num_embeddings, embedding_dim)}
        if self is EmbeddingOptimizer.CF_SGD:
            return {"counter": (num_embeddings,), "last_step": (num_embeddings,)}
        return {}


class WeightDecayMode(StrEnum):
    """FBGEMM's ``weight_decay_mode`` (module doc)."""

    DECOUPLED = "decoupled"
    L2 = "l2"


# The weight decay modes each optimizer has, on both backends (FBGEMM's kernels).
_WEIGHT_DECAY_MODES = {
    EmbeddingOptimizer.ROWWISE_ADAGRAD: (WeightDecayMode.DECOUPLED, WeightDecayMode.L2),
    EmbeddingOptimizer.ADAM: (WeightDecayMode.DECOUPLED,),
    EmbeddingOptimizer.DENSE_ADAM: (WeightDecayMode.DECOUPLED,),
    EmbeddingOptimizer.PARTIAL_ROWWISE_ADAM: (WeightDecayMode.DECOUPLED,),
}


@dataclass(frozen=True)
class EmbeddingOptimizerConfig:
    kind: EmbeddingOptimizer = EmbeddingOptimizer.ROWWISE_ADAGRAD
    lr: float = 0.05
    eps: float = 1e-8
    counter_halflife: float = 0.0  # cf_sgd: steps for a row's count to halve; 0 = no decay
    beta1: float = 0.9  # adam, partial_rowwise_adam (FBGEMM's defaults)
    beta2: float = 0.999
    weight_decay: float = 0.0
    weight_decay_mode: WeightDecayMode = WeightDecayMode.DECOUPLED

    def __post_init__(self) -> None:
        at_least("counter_halflife", self.counter_halflife, 0)
        object.__setattr__(
            self, "kind", parse_enum(EmbeddingOptimizer, self.kind, "embedding optimizer")
        )
        object.__setattr__(
            self,
            "weight_decay_mode",
            parse_enum(WeightDecayMode, self.weight_decay_mode, "embedding weight_decay_mode"),
        )
        positive("embedding optimizer lr", self.lr)
        positive("embedding optimizer eps", self.eps)
        for name, beta in (("beta1", self.beta1), ("beta2", self.beta2)):
            if not 0 <= beta < 1:
                raise ValueError(f"embedding adam {name} must be in [0, 1), got {beta}")
        at_least("embedding weight_decay", self.weight_decay, 0)
        modes = _WEIGHT_DECAY_MODES.get(self.kind, ())
        if self.weight_decay and self.weight_decay_mode not in modes:
            names = ", ".join(
                f"{k.value} ({'/'.join(m.value for m in v)})"
                for k, v in _WEIGHT_DECAY_MODES.items()
            )
            raise ValueError(
                f"embedding optimizer {self.kind.value!r} has no "
                f"{self.weight_decay_mode.value!r} weight decay (FBGEMM's kernels do not; "
                f"neither does the torch kernel): set embedding.weight_decay = 0, or use an "
                f"optimizer and mode that have it: {names}"
            )


def sparse_update(
    opt: EmbeddingOptimizerConfig,
    weight: torch.Tensor,
    state: dict[str, torch.Tensor],
    rows: torch.Tensor,
    grad: torch.Tensor,
    lr: float,
    *,
    iteration: int = 0,
) -> None:
    """Apply one step of ``opt`` (at learning rate ``lr``, the kernel's ``iteration``)
    to ``weight[rows]`` given ``grad[U, D]`` for unique ``rows[U]``.

    Rows are unique, so each update is a gather, arithmetic, and a scatter
    (``index_copy_``), several times faster on CPU than ``index_add_`` into a
    large table.
    """
    kind = opt.kind
    if kind is EmbeddingOptimizer.CF_SGD:
        counter_sgd_update(weight, state, rows, grad, lr, opt.counter_halflife)
        return
    if kind.is_rowwise:
        grad = l2_gradient(opt, weight, rows, grad)
        mean_square = grad.square().mean(dim=1)
        rowwise_update(opt, weight, state, rows, grad, mean_square, lr, iteration)
        return
    if kind is EmbeddingOptimizer.SGD:
        step = grad * lr
    elif kind is EmbeddingOptimizer.ADAGRAD:
        momentum = state["momentum1"]
        m = momentum.index_select(0, rows).add_(grad.square())
        momentum.index_copy_(0, rows, m)
        step = grad * lr / m.sqrt_().add_(opt.eps)
    elif kind is EmbeddingOptimizer.DENSE_ADAM:
        every_row = torch.zeros_like(weight).index_copy_(0, rows, grad)
        dense_adam_update(opt, weight, state, every_row, lr, iteration)
        return
    elif kind is EmbeddingOptimizer.ADAM:
        w = weight.index_select(0, rows)
        m1 = _moving_average(state["momentum1"], rows, grad, opt.beta1)
        m2 = _moving_average(state["momentum2"], rows, grad.square(), opt.beta2)
        bias1, bias2 = 1 - opt.beta1**iteration, 1 - opt.beta2**iteration
        step = m1.div_(bias1).div_(m2.div_(bias2).sqrt_().add_(opt.eps))
        weight.index_copy_(0, rows, w.sub_(step.add_(w, alpha=opt.weight_decay).mul_(lr)))
        return
    else:  # pragma: no cover - the enum is closed
        raise ValueError(f"unsupported embedding optimizer {kind}")
    weight.index_copy_(0, rows, weight.index_select(0, rows).sub_(step))


# PyTorch's one-pass AdamW (torch.optim.AdamW(fused=True) calls it; decoupled weight decay
# as dense_adam's): absent from a torch that lacks it, where the operators run instead.
_FUSED_ADAMW = getattr(torch, "_fused_adamw_", None)

DENSE_ROWS_PER_ID = 1.0  # dense update up to this many table rows per looked-up id


def dense_update_applies(opt: EmbeddingOptimizerConfig, rows: int, ids: int) -> bool:
    """Whether ``dense_rowwise_update`` serves a lookup of ``ids`` ids into ``rows`` rows
    (module doc): row-wise Adagrad without weight decay, and no more rows than
    ``DENSE_ROWS_PER_ID`` per id, where a pass over every row costs less than the sort.
    An untouched row is multiplied by at most lr / eps; eps from 1e-12 keeps that finite
    (0 times an infinite factor would be NaN)."""
    return (
        opt.kind is EmbeddingOptimizer.ROWWISE_ADAGRAD
        and not opt.weight_decay
        and opt.eps >= 1e-12
        and rows <= DENSE_ROWS_PER_ID * ids
    )


def dense_rowwise_update(
    opt: EmbeddingOptimizerConfig,
    weight: torch.Tensor,
    state: dict[str, torch.Tensor],
    grad: torch.Tensor,
    lr: float,
) -> None:
    """Row-wise Adagrad over every row of ``weight [R, D]`` given every row's summed
    gradient ``grad [R, D]`` (0 where the lookup did not touch it; overwritten): the
    result of ``rowwise_update`` on the touched rows alone (module doc)."""
    momentum = state["momentum1"].add_(grad.square().mean(dim=1))
    weight.sub_(grad.mul_((lr / momentum.sqrt().add_(opt.eps)).unsqueeze(1)))


def dense_adam_update(
    opt: EmbeddingOptimizerConfig,
    weight: torch.Tensor,
    state: dict[str, torch.Tensor],
    grad: torch.Tensor,
    lr: float,
    iteration: int,
) -> None:
    """dense_adam (module doc): Adam over every row of ``weight [R, D]`` given every row's
    summed gradient ``grad [R, D]`` (0 where the batch has no id; the operators use it as
    scratch). One pass over the rows in PyTorch's fused AdamW kernel where this torch has
    it (6.5x faster than the operators below on 2.6 million rows of dim 16), else those
    operators."""
    m1, m2 = state["momentum1"], state["momentum2"]
    if _FUSED_ADAMW is not None:
        step = torch.tensor(float(iteration), device=weight.device)
        _FUSED_ADAMW(
            [weight],
            [grad],
            [m1],
            [m2],
            [],
            [step],
            lr=lr,
            beta1=opt.beta1,
            beta2=opt.beta2,
            weight_decay=opt.weight_decay,
            eps=opt.eps,
            amsgrad=False,
            maximize=False,
        )
        return
    m1 = m1.mul_(opt.beta1).add_(grad, alpha=1 - opt.beta1)
    m2 = m2.mul_(opt.beta2).addcmul_(grad, grad, value=1 - opt.beta2)
    bias1, bias2 = 1 - opt.beta1**iteration, 1 - opt.beta2**iteration
    denominator = torch.div(m2, bias2, out=grad).sqrt_().add_(opt.eps)
    step = torch.div(m1, denominator, out=denominator).div_(bias1)
    weight.sub_(step.add_(weight, alpha=opt.weight_decay).mul_(lr))


def _moving_average(
    state: torch.Tensor, rows: torch.Tensor, value: torch.Tensor, beta: float
) -> torch.Tensor:
    """``state[rows] = beta * state[rows] + (1 - beta) * value``; returns the new rows."""
    new = state.index_select(0, rows).mul_(beta).add_(value, alpha=1 - beta)
    state.index_copy_(0, rows, new)
    return new


def l2_gradient(
    opt: EmbeddingOptimizerConfig, weight: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor
) -> torch.Tensor:
    """``grad + wd * weight[rows]`` under L2 weight decay (it feeds the row statistic), else
    ``grad``."""
    if opt.weight_decay and opt.weight_decay_mode is WeightDecayMode.L2:
        return grad.add(weight.index_select(0, rows), alpha=opt.weight_decay)
    return grad


def rowwise_update(
    opt: EmbeddingOptimizerConfig,
    weight: torch.Tensor,
    state: dict[str, torch.Tensor],
    rows: torch.Tensor,
    grad: torch.Tensor,
    mean_square: torch.Tensor,
    lr: float,
    iteration: int,
) -> None:
    """Row-wise Adagrad or partial row-wise Adam on unique ``rows[U]`` given ``grad[U, D]``
    (``l2_gradient``'s) and each row's ``mean_square[U]`` (``mean_j g[r, j]^2``, passed in
    so that a table split by columns can use the mean over all of its columns, not only
    the shard's)."""
    w = weight.index_select(0, rows)
    if opt.kind is EmbeddingOptimizer.PARTIAL_ROWWISE_ADAM:
        m1 = _moving_average(state["momentum1"], rows, grad, opt.beta1)
        m2 = _moving_average(state["momentum2"], rows, mean_square, opt.beta2)
        bias1, bias2 = 1 - opt.beta1**iteration, 1 - opt.beta2**iteration
        step = m1.div_(bias1).div_(m2.div_(bias2).sqrt_().add_(opt.eps).unsqueeze(1))
        weight.index_copy_(0, rows, w.sub_(step.add_(w, alpha=opt.weight_decay).mul_(lr)))
        return
    assert opt.kind is EmbeddingOptimizer.ROWWISE_ADAGRAD, opt.kind
    momentum = state["momentum1"]
    m = momentum.index_select(0, rows).add_(mean_square)
    momentum.index_copy_(0, rows, m)
    step = grad * (lr / m.sqrt_().add_(opt.eps)).unsqueeze(1)
    if opt.weight_decay and opt.weight_decay_mode is WeightDecayMode.DECOUPLED:
        w.mul_(1 - lr * opt.weight_decay)
    weight.index_copy_(0, rows, w.sub_(step))
