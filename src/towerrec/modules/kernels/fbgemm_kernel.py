"""``FbgemmKernel``: FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` (CPU or CUDA
build) with the optimizer fused into its backward kernel; tables with deferred
row-wise updates take the PyTorch path in backward (see the package doc)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch

from towerrec.compat import fbgemm_weight_decay_mode
from towerrec.modules.kernels.backend import FBGEMM_OPTIMIZERS, resolve_backend
from towerrec.modules.kernels.base import (
    Backend,
    EmbeddingKernel,
    RowwiseStep,
    TableSpec,
    row_gradients,
)
from towerrec.modules.tables import Pooling
from towerrec.optim.sparse import EmbeddingOptimizerConfig, WeightDecayMode


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

        FbgemmDecay = fbgemm_weight_decay_mode()

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
            optimizer=getattr(EmbOptimType, FBGEMM_OPTIMIZERS[optimizer.kind]),
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
        rows, grad_rows = row_gradients(ids, offsets, weights, grad_bags, kernel.pooling, dim)
        kernel._update_split(rows, grad_rows, ctx.step, ctx.iteration)
        return grad.new_zeros(ctx.trigger_shape), None, None, None, None, None, None
