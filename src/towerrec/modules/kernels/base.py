"""What every fused kernel shares: the backend names, a table's stored shape, the
deferred row-wise update protocol, the ``EmbeddingKernel`` base class and the row
gradients of a lookup (see the package doc)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import partial
from itertools import pairwise
from typing import Protocol

import torch
from torch import nn

from towerrec.memory import register_parent_only
from towerrec.modules.native import fused
from towerrec.modules.tables import Pooling
from towerrec.optim.sparse import (
    EmbeddingOptimizerConfig,
    l2_gradient,
    rowwise_update,
    sparse_update,
)


class Backend(StrEnum):
    AUTO = "auto"
    TORCH = "torch"
    FBGEMM = "fbgemm"


@dataclass(frozen=True)
class TableSpec:
    """The stored shape of one table (or one shard of a table) inside a kernel."""

    num_embeddings: int
    embedding_dim: int


class RowwiseStep(Protocol):
    """One lookup's collector of deferred row-wise updates."""

    @property
    def trigger(self) -> torch.Tensor:
        """The lookup's autograd input: its backward runs after every kernel's."""
        ...

    def defer(self, table: str, grad: torch.Tensor, apply: Callable[[torch.Tensor], None]) -> None:
        """``grad [U, D_shard]`` (with any L2 term) of the U rows of ``table`` this lookup
        touched; ``apply(mean_square [U])`` updates them once the statistic is combined."""
        ...


class RowwiseSync(Protocol):
    """Gives the kernels the current lookup's ``RowwiseStep``."""

    def step(self) -> RowwiseStep: ...


class EmbeddingKernel(nn.Module):
    """Common interface of the fused kernels (see module docstring)."""

    def __init__(
        self,
        tables: Sequence[TableSpec],
        feature_table_map: Sequence[int],
        pooling: Pooling,
        optimizer: EmbeddingOptimizerConfig,
        device: torch.device,
    ) -> None:
        super().__init__()
        dims = {t.embedding_dim for t in tables}
        if len(dims) != 1:
            raise ValueError(f"a kernel's tables must share one dim, got {sorted(dims)}")
        if (
            not feature_table_map
            or max(feature_table_map) >= len(tables)
            or min(feature_table_map) < 0
        ):
            raise ValueError("feature_table_map must map every feature to one of the tables")
        self.tables = list(tables)
        self.feature_table_map = list(feature_table_map)
        self.pooling = Pooling(pooling)
        self.optimizer = optimizer
        self.device = torch.device(device)
        self.embedding_dim = dims.pop()
        self.lr = optimizer.lr
        self.row_offsets = [0]
        for t in self.tables:
            self.row_offsets.append(self.row_offsets[-1] + t.num_embeddings)
        # Row base of each feature's table inside the concatenated rows.
        self.feature_row_base = torch.tensor(
            [self.row_offsets[t] for t in self.feature_table_map],
            dtype=torch.int64,
            device=self.device,
        )
        # Training lookups so far (module doc); a CPU scalar, the tables' "step" state.
        self.iteration = torch.zeros((), dtype=torch.int64)
        self._deferred: dict[int, str] = {}  # table index -> name given to the sync
        self._sync: RowwiseSync | None = None
        if self.device.type == "cpu":
            register_parent_only(self)  # forked loader workers drop the tables' pages

    def memory_ranges(self) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of the weights and optimizer state (CPU)."""
        tensors = [*self.split_weights()]
        tensors += [s for states in self.split_optimizer_states() for s in states.values()]
        return [(t.data_ptr(), t.nbytes) for t in tensors if t.is_contiguous() and t.numel()]

    @property
    def num_features(self) -> int:
        return len(self.feature_table_map)

    def split_weights(self) -> list[torch.Tensor]:
        """Per-table views ``[rows, dim]`` of the weights (writes go to the kernel)."""
        raise NotImplementedError

    def split_optimizer_states(self) -> list[dict[str, torch.Tensor]]:
        """Per-table views of the optimizer state, by canonical name (``momentum1``)."""
        raise NotImplementedError

    def table_views(self, index: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Table ``index``'s entries of ``split_weights`` and ``split_optimizer_states``
        (a kernel that can slice one table alone overrides this)."""
        return self.split_weights()[index], self.split_optimizer_states()[index]

    def set_learning_rate(self, lr: float) -> None:
        raise NotImplementedError

    def _with_step(self, states: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        """``states`` with the kernel's ``iteration`` as each table's ``step``, if it has one."""
        if "step" in self.optimizer.kind.state_shapes(1, 1):
            for table_states in states:
                table_states["step"] = self.iteration
        return states

    def _next_iteration(self) -> int:
        """The iteration of this lookup: counted if it will be trained (autograd on)."""
        if torch.is_grad_enabled():
            self.iteration += 1
        return int(self.iteration)

    def forward(
        self, values: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        raise NotImplementedError

    def defer_rowwise(self, tables: Mapping[int, str], sync: RowwiseSync) -> None:
        """Hand the row-wise updates of ``tables`` (index -> name) to ``sync``
        (module doc); the other tables keep updating in backward."""
        if not self.optimizer.kind.is_rowwise:
            raise ValueError(
                "only row-wise optimizers' updates (rowwise_adagrad, partial_rowwise_adam) "
                f"are deferred, not {self.optimizer.kind.value!r}"
            )
        self._deferred = dict(tables)
        self._sync = sync

    def _global_ids(self, values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        values = values.long()
        if len(self.tables) == 1:
            return values
        batch = (offsets.numel() - 1) // self.num_features
        if (
            fused is not None
            and values.device.type == "cpu"
            and offsets.dtype == torch.int64
            and not torch.jit.is_tracing()
            and not torch.compiler.is_compiling()
        ):  # one native pass in place of repeat_interleave and an add
            values, offsets = values.contiguous(), offsets.contiguous()
            out = torch.empty_like(values)
            fused.global_ids(
                values.numpy(),
                offsets.numpy(),
                self.feature_row_base.numpy(),
                out.numpy(),
                self.num_features,
                batch,
            )
            return out
        per_feature = offsets[::batch].diff()
        base = torch.repeat_interleave(
            self.feature_row_base, per_feature, output_size=values.numel()
        )
        return values + base

    @torch.no_grad()
    def _update_split(
        self, rows: torch.Tensor, grad_rows: torch.Tensor, step: RowwiseStep, iteration: int
    ) -> None:
        """Update unique concatenated ``rows``: deferred tables through ``step``, others now."""
        edges = torch.tensor(self.row_offsets, device=rows.device)
        bounds = torch.searchsorted(rows, edges).tolist()
        weights, states = self.split_weights(), self.split_optimizer_states()
        for t, (lo, hi) in enumerate(pairwise(bounds)):
            local, grad = rows[lo:hi] - self.row_offsets[t], grad_rows[lo:hi]
            if t in self._deferred:
                grad = l2_gradient(self.optimizer, weights[t], local, grad)
                apply = partial(self._apply_rowwise, t, local, grad, iteration)
                step.defer(self._deferred[t], grad, apply)
            elif hi > lo:
                sparse_update(
                    self.optimizer, weights[t], states[t], local, grad, self.lr, iteration=iteration
                )

    @torch.no_grad()
    def _apply_rowwise(
        self,
        table: int,
        rows: torch.Tensor,
        grad: torch.Tensor,
        iteration: int,
        mean_square: torch.Tensor,
    ) -> None:
        state = self.split_optimizer_states()[table]
        weight = self.split_weights()[table]
        rowwise_update(self.optimizer, weight, state, rows, grad, mean_square, self.lr, iteration)


def id_gradients(
    offsets: torch.Tensor,
    weights: torch.Tensor | None,
    grad_bags: torch.Tensor,
    pooling: Pooling,
    num_ids: int,
) -> torch.Tensor:
    """Each looked-up id's gradient ``[num_ids, dim]`` from the bags' gradients
    ``grad_bags [bags, dim]`` (its bag's, scaled by its weight and the mean's 1/length)."""
    lengths = offsets.diff()
    bag_of_id = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=offsets.device), lengths, output_size=num_ids
    )
    if pooling is Pooling.MEAN:
        grad_bags = grad_bags / lengths.clamp(min=1).unsqueeze(1).to(grad_bags.dtype)
    grad_ids = grad_bags.index_select(0, bag_of_id)
    if weights is not None:
        grad_ids = grad_ids * weights.unsqueeze(1)
    return grad_ids


def sample_major_to_bags(grad: torch.Tensor, features: int, dim: int) -> torch.Tensor:
    """A lookup's gradient ``[B, F*D]`` (sample-major) as its bags' ``[F*B, D]``."""
    batch = grad.shape[0]
    return grad.reshape(batch, features, dim).transpose(0, 1).reshape(features * batch, dim)


def dense_gradient(
    ids: torch.Tensor,
    offsets: torch.Tensor,
    weights: torch.Tensor | None,
    grad: torch.Tensor,
    pooling: Pooling,
    rows: int,
    features: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every row's summed gradient ``[rows, dim]`` (0 where no id is), for the dense
    update of small tables, from the lookup's gradient ``grad [B, F*D]`` (sample-major,
    ``features`` features; bags feature-major in ``offsets``): ``id_gradients`` added up
    by ``index_add_``, or the same sums in the same order in one call of the native
    extension on the CPU (``_fused.c``). ``out``: a ``[rows, dim]`` buffer to zero and
    fill (a large table's gradient is not allocated anew every step)."""
    batch = grad.shape[0]
    dim = grad.shape[1] // features
    if out is None:
        out = torch.zeros(rows, dim, dtype=grad.dtype, device=grad.device)
    else:
        out.zero_()
    if fused is not None and grad.device.type == "cpu" and grad.dtype == torch.float32:
        weights = None if weights is None else weights.detach().float().contiguous()
        fused.bag_grad(
            out.numpy(),
            ids.long().contiguous().numpy(),
            offsets.long().contiguous().numpy(),
            grad.detach().contiguous().numpy(),
            None if weights is None else weights.numpy(),
            pooling is Pooling.MEAN,
            features,
            batch,
            dim,
            rows,
        )
        return out
    grad_bags = sample_major_to_bags(grad, features, dim)
    grad_ids = id_gradients(offsets, weights, grad_bags, pooling, ids.numel())
    return out.index_add_(0, ids, grad_ids)


def row_gradients(
    ids: torch.Tensor,
    offsets: torch.Tensor,
    weights: torch.Tensor | None,
    grad_bags: torch.Tensor,
    pooling: Pooling,
    dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique ``rows [U]`` of ``ids`` and their summed gradients ``[U, dim]`` from the
    bags' gradients ``grad_bags [bags, dim]``."""
    grad_ids = id_gradients(offsets, weights, grad_bags, pooling, ids.numel())
    rows, inverse = torch.unique(ids, return_inverse=True)
    grad_rows = torch.zeros(rows.numel(), dim, dtype=grad_ids.dtype, device=ids.device)
    if ids.is_cuda:
        # index_add_ uses atomics on CUDA (the sum's order varies run to run);
        # index_put_ with accumulate sorts the indices: deterministic, so a
        # resumed run reproduces an uninterrupted one bit for bit on GPUs too.
        grad_rows.index_put_((inverse,), grad_ids, accumulate=True)
    else:
        grad_rows.index_add_(0, inverse, grad_ids)
    return rows, grad_rows
