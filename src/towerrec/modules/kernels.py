"""Fused table-batched embedding kernels: one call looks up every table of a group.

A kernel holds the weights and optimizer state of several tables that share a
pooling mode and dim, and looks up F features (``feature_table_map[f]`` is the
table of feature f) for a batch of B samples in one call::

    values [N]  ids, key-major jagged layout (see towerrec.sparse)
    offsets [F*B + 1]
    weights [N] optional per-id weights (sum pooling)
      -> pooled [B, F*D]

The optimizer runs inside backward: gradients never reach ``.grad``; the rows
that were looked up are updated in place. Two backends with the same
arithmetic:

- ``TorchKernel``: one ``embedding_bag`` over the tables' concatenated rows and
  an exact sparse update (sort + segment-sum) in a custom autograd function.
- ``FbgemmKernel``: FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` (CPU or
  CUDA build) with the optimizer fused into its backward kernel.

Adam's bias correction counts the kernel's training lookups (``iteration``,
FBGEMM's ``iter``; lookups without autograd, as in evaluation, do not count); it
is the ``step`` of each of the kernel's tables in the optimizer state.

Tables whose columns are split over ranks (a sharded collection's column
shards) cannot finish a row-wise step (row-wise Adagrad, partial row-wise Adam)
alone: the row statistic is the mean of g^2 over all the table's columns.
``defer_rowwise`` hands such tables' updates to a ``RowwiseSync`` (``distributed/column_sync.py``): the
backward computes their row gradients, the sync combines the statistic across
the shards and then calls back to apply the update. A kernel with deferred
tables runs its backward and updates on the pure-PyTorch path on either
backend (FBGEMM's fused kernel takes the mean over its own columns); its
forward is unchanged.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import partial
from itertools import pairwise
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from towerrec.memory import register_parent_only
from towerrec.modules.tables import Pooling
from towerrec.optim.sparse import (
    EmbeddingOptimizer,
    EmbeddingOptimizerConfig,
    WeightDecayMode,
    l2_gradient,
    rowwise_update,
    sparse_update,
)

__all__ = [
    "Backend",
    "EmbeddingKernel",
    "FbgemmKernel",
    "RowwiseStep",
    "RowwiseSync",
    "TableSpec",
    "TorchKernel",
    "auto_backend",
    "build_kernel",
    "fbgemm_available",
    "resolve_backend",
]


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


def fbgemm_available() -> bool:
    return importlib.util.find_spec("fbgemm_gpu") is not None


def fbgemm_has_kernel(
    optimizer: EmbeddingOptimizer, device_type: str, weight_decay: float = 0.0
) -> bool:
    """Whether FBGEMM has a fused kernel for ``optimizer`` on ``device_type``: its Adam
    kernels are generated for CUDA only (none in fbgemm-gpu-cpu), and its CPU kernels
    ignore ``weight_decay`` (row-wise Adagrad's included)."""
    if optimizer not in _FBGEMM_OPTIMIZERS:
        return False
    if device_type == "cuda":
        return True
    return optimizer not in _FBGEMM_CUDA_ONLY and not weight_decay


def auto_backend(
    device_type: str,
    cpu_capability: str,
    fbgemm_installed: bool,
    optimizer: EmbeddingOptimizer = EmbeddingOptimizer.ROWWISE_ADAGRAD,
    embedding_dims: Sequence[int] = (),
    weight_decay: float = 0.0,
) -> Backend:
    """The kernel ``auto`` stands for: FBGEMM on CUDA, and on CPUs with AVX-512
    (its CPU kernels are generated for 512-bit vectors); the pure-PyTorch kernel
    on narrower CPUs (AVX2: 1.25x faster in the full DLRM step, docs/benchmarks.md),
    without fbgemm_gpu, for an optimizer (or weight decay) FBGEMM has no kernel for
    on the device (``fbgemm_has_kernel``), or for tables whose dimension is not a
    multiple of 4 (FBGEMM's row alignment)."""
    if not fbgemm_installed or not fbgemm_has_kernel(optimizer, device_type, weight_decay):
        return Backend.TORCH
    if any(dim % 4 for dim in embedding_dims):
        return Backend.TORCH
    if device_type == "cpu" and not cpu_capability.upper().startswith("AVX512"):
        return Backend.TORCH
    return Backend.FBGEMM


def resolve_backend(
    backend: Backend | str,
    device: torch.device,
    optimizer: EmbeddingOptimizer = EmbeddingOptimizer.ROWWISE_ADAGRAD,
    embedding_dims: Sequence[int] = (),
    weight_decay: float = 0.0,
) -> Backend:
    """``auto`` resolves by ``auto_backend`` for this machine and these table dimensions;
    ``fbgemm`` needs fbgemm_gpu and its kernel for ``optimizer`` on ``device``."""
    backend = Backend(backend)
    device = torch.device(device)
    if backend is Backend.FBGEMM and not fbgemm_available():
        raise ValueError(
            "embedding backend 'fbgemm' needs fbgemm_gpu: install towerrec[cpu] "
            "(fbgemm-gpu-cpu) or towerrec[cuda] (fbgemm-gpu), or set embedding.backend = 'torch'"
        )
    if backend is Backend.FBGEMM and not fbgemm_has_kernel(optimizer, device.type, weight_decay):
        what = f"embedding optimizer {optimizer.value!r}"
        if optimizer in _FBGEMM_OPTIMIZERS and optimizer not in _FBGEMM_CUDA_ONLY:
            what += f" with weight decay {weight_decay}"  # the CPU kernels ignore it
        raise ValueError(
            f"FBGEMM has no {device.type} kernel for {what}: set embedding.backend = 'torch' "
            "(or 'auto', which picks the torch kernel for it)"
        )
    if backend is Backend.AUTO:
        return auto_backend(
            device.type,
            torch.backends.cpu.get_cpu_capability(),
            fbgemm_available(),
            optimizer,
            embedding_dims,
            weight_decay,
        )
    return backend


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


def _row_gradients(
    ids: torch.Tensor,
    offsets: torch.Tensor,
    weights: torch.Tensor | None,
    grad_bags: torch.Tensor,
    pooling: Pooling,
    dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique ``rows [U]`` of ``ids`` and their summed gradients ``[U, dim]`` from the
    bags' gradients ``grad_bags [bags, dim]``."""
    lengths = offsets.diff()
    bag_of_id = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=ids.device), lengths, output_size=ids.numel()
    )
    if pooling is Pooling.MEAN:
        grad_bags = grad_bags / lengths.clamp(min=1).unsqueeze(1).to(grad_bags.dtype)
    grad_ids = grad_bags.index_select(0, bag_of_id)
    if weights is not None:
        grad_ids = grad_ids * weights.unsqueeze(1)
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


class _FusedLookup(torch.autograd.Function):
    """``embedding_bag`` forward; backward applies the sparse optimizer in place."""

    @staticmethod
    def forward(
        ctx: Any,
        trigger: torch.Tensor,
        kernel: TorchKernel,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None,
        step: RowwiseStep | None,
        iteration: int,
    ) -> torch.Tensor:
        ctx.kernel, ctx.step, ctx.trigger_shape = kernel, step, trigger.shape
        ctx.iteration = iteration
        ctx.save_for_backward(ids, offsets, weights)
        mode = "sum" if kernel.pooling is Pooling.SUM else "mean"
        return F.embedding_bag(
            ids,
            kernel.weight,
            offsets,
            mode=mode,
            per_sample_weights=weights,
            include_last_offset=True,
        )

    @staticmethod
    def backward(
        ctx: Any, grad_bags: torch.Tensor
    ) -> tuple[torch.Tensor | None, None, None, None, None, None, None]:
        ids, offsets, weights = ctx.saved_tensors
        if ctx.step is None:
            ctx.kernel.apply_gradient(ids, offsets, weights, grad_bags, ctx.iteration)
            return None, None, None, None, None, None, None
        kernel = ctx.kernel
        rows, grad_rows = _row_gradients(
            ids, offsets, weights, grad_bags, kernel.pooling, kernel.embedding_dim
        )
        kernel._update_split(rows, grad_rows, ctx.step, ctx.iteration)
        # A gradient for the step's trigger, so its backward runs after this one.
        return grad_bags.new_zeros(ctx.trigger_shape), None, None, None, None, None, None


class TorchKernel(EmbeddingKernel):
    """Pure-PyTorch fused kernel: runs wherever PyTorch runs (CPU, CUDA)."""

    def __init__(
        self,
        tables: Sequence[TableSpec],
        feature_table_map: Sequence[int],
        pooling: Pooling,
        optimizer: EmbeddingOptimizerConfig,
        device: torch.device,
    ) -> None:
        super().__init__(tables, feature_table_map, pooling, optimizer, device)
        dim = self.embedding_dim
        self.weight = torch.zeros(self.row_offsets[-1], dim, device=self.device)
        self.state = {
            name: torch.zeros((self.row_offsets[-1], *shape[1:]), device=self.device)
            for name, shape in optimizer.kind.state_shapes(1, dim).items()
            if shape  # not the step (``iteration``)
        }
        # Leaf that makes autograd call backward; not a parameter of any model.
        self._trigger = torch.zeros(0, device=self.device, requires_grad=True)

    def split_weights(self) -> list[torch.Tensor]:
        return [self.weight[a:b] for a, b in zip(self.row_offsets, self.row_offsets[1:])]

    def split_optimizer_states(self) -> list[dict[str, torch.Tensor]]:
        return self._with_step(
            [
                {name: s[a:b] for name, s in self.state.items()}
                for a, b in zip(self.row_offsets, self.row_offsets[1:])
            ]
        )

    def set_learning_rate(self, lr: float) -> None:
        self.lr = lr

    def forward(
        self, values: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        num_bags = offsets.numel() - 1
        batch = num_bags // self.num_features
        ids = self._global_ids(values, offsets)
        step = self._sync.step() if self._sync is not None else None
        trigger = step.trigger if step is not None else self._trigger
        iteration = self._next_iteration()
        bags: torch.Tensor = _FusedLookup.apply(  # type: ignore[no-untyped-call]  # torch leaves Function.apply untyped
            trigger, self, ids, offsets.long(), weights, step, iteration
        )
        # [F*B, D] feature-major -> [B, F*D] sample-major
        return (
            bags.view(self.num_features, batch, self.embedding_dim)
            .transpose(0, 1)
            .reshape(batch, self.num_features * self.embedding_dim)
        )

    @torch.no_grad()
    def apply_gradient(
        self,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None,
        grad_bags: torch.Tensor,
        iteration: int,
    ) -> None:
        rows, grad_rows = _row_gradients(
            ids, offsets, weights, grad_bags, self.pooling, self.embedding_dim
        )
        sparse_update(
            self.optimizer, self.weight, self.state, rows, grad_rows, self.lr, iteration=iteration
        )


_FBGEMM_OPTIMIZERS = {
    EmbeddingOptimizer.ROWWISE_ADAGRAD: "EXACT_ROWWISE_ADAGRAD",
    EmbeddingOptimizer.ADAGRAD: "EXACT_ADAGRAD",
    EmbeddingOptimizer.SGD: "EXACT_SGD",
    EmbeddingOptimizer.ADAM: "ADAM",
    EmbeddingOptimizer.PARTIAL_ROWWISE_ADAM: "PARTIAL_ROWWISE_ADAM",
}
_FBGEMM_CUDA_ONLY = {EmbeddingOptimizer.ADAM, EmbeddingOptimizer.PARTIAL_ROWWISE_ADAM}


class FbgemmKernel(EmbeddingKernel):
    """FBGEMM ``SplitTableBatchedEmbeddingBagsCodegen`` with its fused optimizer."""

    def __init__(
        self,
        tables: Sequence[TableSpec],
        feature_table_map: Sequence[int],
        pooling: Pooling,
        optimizer: EmbeddingOptimizerConfig,
        device: torch.device,
    ) -> None:
        super().__init__(tables, feature_table_map, pooling, optimizer, device)
        resolve_backend(Backend.FBGEMM, device, optimizer.kind, (), optimizer.weight_decay)
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            BoundsCheckMode,
            EmbeddingLocation,
            PoolingMode,
        )
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )
        from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode as FbgemmDecay

        if self.device.type == "cuda":
            location, compute = EmbeddingLocation.DEVICE, ComputeDevice.CUDA
        elif self.device.type == "cpu":
            location, compute = EmbeddingLocation.HOST, ComputeDevice.CPU
        else:
            raise ValueError(f"FBGEMM kernels run on cpu or cuda, not {self.device}")
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[
                (t.num_embeddings, t.embedding_dim, location, compute) for t in self.tables
            ],
            feature_table_map=self.feature_table_map,
            optimizer=getattr(EmbOptimType, _FBGEMM_OPTIMIZERS[optimizer.kind]),
            learning_rate=optimizer.lr,
            eps=optimizer.eps,
            beta1=optimizer.beta1,
            beta2=optimizer.beta2,
            weight_decay=optimizer.weight_decay,
            # Adam's kernels read weight_decay alone (decoupled); row-wise Adagrad's, both.
            weight_decay_mode=(
                FbgemmDecay.NONE
                if not optimizer.weight_decay
                else FbgemmDecay.L2
                if optimizer.weight_decay_mode is WeightDecayMode.L2
                else FbgemmDecay.DECOUPLE
            ),
            pooling_mode=PoolingMode.SUM if self.pooling is Pooling.SUM else PoolingMode.MEAN,
            bounds_check_mode=BoundsCheckMode.NONE,  # ids are checked by the collection
            device=self.device,
        )
        for w in self.tbe.split_embedding_weights():
            w.detach().zero_()

    def split_weights(self) -> list[torch.Tensor]:
        return [w.detach() for w in self.tbe.split_embedding_weights()]

    def split_optimizer_states(self) -> list[dict[str, torch.Tensor]]:
        names = [n for n, shape in self.optimizer.kind.state_shapes(1, 1).items() if shape]
        out = []
        for states in self.tbe.split_optimizer_states():
            out.append({name: s.detach() for name, s in zip(names, states)})
        if not out:
            out = [{} for _ in self.tables]
        return self._with_step(out)

    def set_learning_rate(self, lr: float) -> None:
        self.lr = lr
        self.tbe.set_learning_rate(lr)

    def _sync_iteration(self) -> int:
        """Set FBGEMM's step counter (it adds one in each forward) to ``iteration``, which
        counts training lookups only, and advance ``iteration`` for this one."""
        if "step" in self.optimizer.kind.state_shapes(1, 1):
            self.tbe.iter_cpu.fill_(int(self.iteration))
            self.tbe.iter.fill_(int(self.iteration))
        return self._next_iteration()

    def forward(
        self, values: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        iteration = self._sync_iteration()
        if self._sync is not None:
            step = self._sync.step()
            return cast(
                torch.Tensor,
                _DeferredFbgemmLookup.apply(  # type: ignore[no-untyped-call]
                    step.trigger, self, values, offsets, weights, step, iteration
                ),
            )
        return cast(
            torch.Tensor, self.tbe(values.long(), offsets.long(), per_sample_weights=weights)
        )


class _DeferredFbgemmLookup(torch.autograd.Function):
    """FBGEMM's forward; backward on the PyTorch path with deferred tables (module doc)."""

    @staticmethod
    def forward(
        ctx: Any,
        trigger: torch.Tensor,
        kernel: FbgemmKernel,
        values: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None,
        step: RowwiseStep,
        iteration: int,
    ) -> torch.Tensor:
        ctx.kernel, ctx.step, ctx.trigger_shape = kernel, step, trigger.shape
        ctx.iteration = iteration
        values, offsets = values.long(), offsets.long()
        ctx.save_for_backward(kernel._global_ids(values, offsets), offsets, weights)
        return cast(torch.Tensor, kernel.tbe(values, offsets, per_sample_weights=weights))

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor, None, None, None, None, None, None]:
        ids, offsets, weights = ctx.saved_tensors
        kernel = ctx.kernel
        dim, features = kernel.embedding_dim, kernel.num_features
        # [B, F*D] sample-major -> [F*B, D] feature-major bags
        grad_bags = grad.reshape(-1, features, dim).transpose(0, 1).reshape(-1, dim)
        rows, grad_rows = _row_gradients(ids, offsets, weights, grad_bags, kernel.pooling, dim)
        kernel._update_split(rows, grad_rows, ctx.step, ctx.iteration)
        return grad.new_zeros(ctx.trigger_shape), None, None, None, None, None, None


def build_kernel(
    backend: Backend,
    tables: Sequence[TableSpec],
    feature_table_map: Sequence[int],
    pooling: Pooling,
    optimizer: EmbeddingOptimizerConfig,
    device: torch.device,
) -> EmbeddingKernel:
    dims = [t.embedding_dim for t in tables]
    cls = {Backend.TORCH: TorchKernel, Backend.FBGEMM: FbgemmKernel}[
        resolve_backend(backend, device, optimizer.kind, dims, optimizer.weight_decay)
    ]
    return cls(tables, feature_table_map, pooling, optimizer, device)
