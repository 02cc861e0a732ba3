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
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from towerrec.memory import register_parent_only
from towerrec.modules.tables import Pooling
from towerrec.optim.sparse import EmbeddingOptimizer, EmbeddingOptimizerConfig, sparse_update

__all__ = [
    "Backend",
    "EmbeddingKernel",
    "FbgemmKernel",
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


def fbgemm_available() -> bool:
    return importlib.util.find_spec("fbgemm_gpu") is not None


def auto_backend(
    device_type: str,
    cpu_capability: str,
    fbgemm_installed: bool,
    optimizer: EmbeddingOptimizer = EmbeddingOptimizer.ROWWISE_ADAGRAD,
) -> Backend:
    """The kernel ``auto`` stands for: FBGEMM on CUDA, and on CPUs with AVX-512
    (its CPU kernels are generated for 512-bit vectors); the pure-PyTorch kernel
    on narrower CPUs (AVX2: 1.25x faster in the full DLRM step, docs/benchmarks.md),
    without fbgemm_gpu, or for an optimizer FBGEMM has no kernel for."""
    if not fbgemm_installed or optimizer not in _FBGEMM_OPTIMIZERS:
        return Backend.TORCH
    if device_type == "cpu" and not cpu_capability.upper().startswith("AVX512"):
        return Backend.TORCH
    return Backend.FBGEMM


def resolve_backend(
    backend: Backend | str,
    device: torch.device,
    optimizer: EmbeddingOptimizer = EmbeddingOptimizer.ROWWISE_ADAGRAD,
) -> Backend:
    """``auto`` resolves by ``auto_backend`` for this machine; ``fbgemm`` needs fbgemm_gpu."""
    backend = Backend(backend)
    if backend is Backend.FBGEMM and not fbgemm_available():
        raise ValueError(
            "embedding backend 'fbgemm' needs fbgemm_gpu: install towerrec[cpu] "
            "(fbgemm-gpu-cpu) or towerrec[cuda] (fbgemm-gpu), or set embedding.backend = 'torch'"
        )
    if backend is Backend.AUTO:
        device = torch.device(device)
        return auto_backend(
            device.type, torch.backends.cpu.get_cpu_capability(), fbgemm_available(), optimizer
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

    def forward(
        self, values: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        raise NotImplementedError


class _FusedLookup(torch.autograd.Function):
    """``embedding_bag`` forward; backward applies the sparse optimizer in place."""

    @staticmethod
    def forward(
        ctx: Any,
        _trigger: torch.Tensor,
        kernel: TorchKernel,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.kernel = kernel
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
    def backward(ctx: Any, grad_bags: torch.Tensor) -> tuple[None, None, None, None, None]:
        ids, offsets, weights = ctx.saved_tensors
        ctx.kernel.apply_gradient(ids, offsets, weights, grad_bags)
        return None, None, None, None, None


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
        rows = [t.num_embeddings for t in self.tables]
        self.row_offsets = [0]
        for r in rows:
            self.row_offsets.append(self.row_offsets[-1] + r)
        dim = self.embedding_dim
        self.weight = torch.zeros(self.row_offsets[-1], dim, device=self.device)
        self.state = {
            name: torch.zeros((self.row_offsets[-1], *shape[1:]), device=self.device)
            for name, shape in optimizer.kind.state_shapes(1, dim).items()
        }
        self.lr = optimizer.lr
        # Row base of each feature's table inside the concatenated weight.
        self.feature_row_base = torch.tensor(
            [self.row_offsets[t] for t in self.feature_table_map],
            dtype=torch.int64,
            device=self.device,
        )
        # Leaf that makes autograd call backward; not a parameter of any model.
        self._trigger = torch.zeros(0, device=self.device, requires_grad=True)

    def split_weights(self) -> list[torch.Tensor]:
        return [self.weight[a:b] for a, b in zip(self.row_offsets, self.row_offsets[1:])]

    def split_optimizer_states(self) -> list[dict[str, torch.Tensor]]:
        return [
            {name: s[a:b] for name, s in self.state.items()}
            for a, b in zip(self.row_offsets, self.row_offsets[1:])
        ]

    def set_learning_rate(self, lr: float) -> None:
        self.lr = lr

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

    def forward(
        self, values: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        num_bags = offsets.numel() - 1
        batch = num_bags // self.num_features
        ids = self._global_ids(values, offsets)
        bags: torch.Tensor = _FusedLookup.apply(self._trigger, self, ids, offsets.long(), weights)  # type: ignore[no-untyped-call]  # torch leaves Function.apply untyped
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
    ) -> None:
        lengths = offsets.diff()
        bag_of_id = torch.repeat_interleave(
            torch.arange(lengths.numel(), device=ids.device), lengths, output_size=ids.numel()
        )
        if self.pooling is Pooling.MEAN:
            grad_bags = grad_bags / lengths.clamp(min=1).unsqueeze(1).to(grad_bags.dtype)
        grad_ids = grad_bags.index_select(0, bag_of_id)
        if weights is not None:
            grad_ids = grad_ids * weights.unsqueeze(1)
        rows, inverse = torch.unique(ids, return_inverse=True)
        grad_rows = torch.zeros(
            rows.numel(), self.embedding_dim, dtype=grad_ids.dtype, device=ids.device
        )
        if ids.is_cuda:
            # index_add_ uses atomics on CUDA (the sum's order varies run to run);
            # index_put_ with accumulate sorts the indices: deterministic, so a
            # resumed run reproduces an uninterrupted one bit for bit on GPUs too.
            grad_rows.index_put_((inverse,), grad_ids, accumulate=True)
        else:
            grad_rows.index_add_(0, inverse, grad_ids)
        sparse_update(
            self.optimizer.kind,
            self.weight,
            self.state,
            rows,
            grad_rows,
            self.lr,
            self.optimizer.eps,
            halflife=self.optimizer.counter_halflife,
        )


_FBGEMM_OPTIMIZERS = {
    EmbeddingOptimizer.ROWWISE_ADAGRAD: "EXACT_ROWWISE_ADAGRAD",
    EmbeddingOptimizer.ADAGRAD: "EXACT_ADAGRAD",
    EmbeddingOptimizer.SGD: "EXACT_SGD",
}


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
        if optimizer.kind not in _FBGEMM_OPTIMIZERS:
            raise ValueError(
                f"embedding optimizer {optimizer.kind.value!r} has no FBGEMM kernel; "
                "set embedding.backend = 'torch'"
            )
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
            pooling_mode=PoolingMode.SUM if self.pooling is Pooling.SUM else PoolingMode.MEAN,
            bounds_check_mode=BoundsCheckMode.NONE,  # ids are checked by the collection
            device=self.device,
        )
        for w in self.tbe.split_embedding_weights():
            w.detach().zero_()

    def split_weights(self) -> list[torch.Tensor]:
        return [w.detach() for w in self.tbe.split_embedding_weights()]

    def split_optimizer_states(self) -> list[dict[str, torch.Tensor]]:
        names = list(self.optimizer.kind.state_shapes(1, 1))
        out = []
        for states in self.tbe.split_optimizer_states():
            out.append({name: s.detach() for name, s in zip(names, states)})
        if not out:
            out = [{} for _ in self.tables]
        return out

    def set_learning_rate(self, lr: float) -> None:
        self.tbe.set_learning_rate(lr)

    def forward(
        self, values: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        return cast(
            torch.Tensor, self.tbe(values.long(), offsets.long(), per_sample_weights=weights)
        )


def build_kernel(
    backend: Backend,
    tables: Sequence[TableSpec],
    feature_table_map: Sequence[int],
    pooling: Pooling,
    optimizer: EmbeddingOptimizerConfig,
    device: torch.device,
) -> EmbeddingKernel:
    cls = {Backend.TORCH: TorchKernel, Backend.FBGEMM: FbgemmKernel}[
        resolve_backend(backend, device)
    ]
    return cls(tables, feature_table_map, pooling, optimizer, device)
