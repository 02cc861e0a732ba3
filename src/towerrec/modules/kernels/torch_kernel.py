"""``TorchKernel``: one ``embedding_bag`` over the tables' concatenated rows and an
exact sparse update (sort + segment-sum) in a custom autograd function.

On the CPU, where the native extension is built (``_fused.c``), the lookup is one call
that pools the feature-major bags straight into the sample-major ``[B, F*D]`` the model
reads, so neither direction copies through a transpose, its bags split among torch's
intra-op threads (OpenMP). The gradient arrives in that layout and the update reads it
there. Row-wise Adagrad without weight decay runs in native calls around the per-row
arithmetic (the rows' mean squares in one native pass, ``row_statistics``, where a check
at first use finds it gives torch's bits for the dim; the factors in PyTorch's
operators), in place of the transposing copy, the sort, the segment sums and the
gathers and scatters of ``sparse_update``, with the same bits:

- small tables, every row updated: ``bag_grad`` (every row's summed gradient, the rows
  split among torch's threads), ``row_statistics``, the factors, and ``adagrad_rows``
  over every row;
- larger tables: ``row_sums`` (the distinct ids' summed gradients and statistics, table
  by table on torch's threads), ``row_statistics``, the factors, and ``adagrad_rows``
  (each touched row's update on torch's threads)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F

from towerrec.memory import advise_huge_pages
from towerrec.modules.kernels.base import (
    EmbeddingKernel,
    RowwiseStep,
    TableSpec,
    dense_gradient,
    row_gradients,
    sample_major_to_bags,
)
from towerrec.modules.native import fused
from towerrec.modules.tables import Pooling
from towerrec.optim.sparse import (
    EmbeddingOptimizer,
    EmbeddingOptimizerConfig,
    dense_adam_update,
    dense_rowwise_update,
    dense_update_applies,
    sparse_update,
)

Storage = Callable[[str, tuple[int, ...]], torch.Tensor]


def rowwise_statistic(sums: torch.Tensor) -> torch.Tensor:
    """Row-wise Adagrad's statistic increment of ``sums [U, D]``: the mean square of each
    row, as ``sparse_update`` computes it (``sums * sums``: ``square()``'s bits, pow by 2
    being one multiply, and 2.7x faster on the CPU)."""
    return (sums * sums).mean(dim=1)


@functools.cache
def native_row_statistics(dim: int) -> bool:
    """Whether ``_fused.c``'s ``row_statistics`` (each row's mean square added to its
    statistic, in one pass) gives the bits of torch's operators (``rowwise_statistic``)
    for rows of ``dim``: checked once per process and dim on rows of every magnitude,
    since the mean's summation order is ATen's (it differs by dim, and could by build).
    Where it does not, the update takes torch's operators. The factor after it stays in
    torch's operators: ATen's float square root is not the correctly rounded one C's is."""
    if fused is None:
        return False
    gen = torch.Generator().manual_seed(dim)
    count = 4096
    scale = torch.logspace(-6, 6, count, dtype=torch.float64).float().unsqueeze(1)
    sums = torch.randn(count, dim, generator=gen) * scale
    sums[::17] = 0.0
    state = torch.rand(count, generator=gen) * 4.0
    expected = state.clone().add_(rowwise_statistic(sums))
    fused.row_statistics(sums.numpy(), state.numpy(), count, dim)
    return torch.equal(state, expected)


class _FusedLookup(torch.autograd.Function):
    """The lookup forward (sample-major ``[B, F*D]``); backward applies the sparse
    optimizer in place."""

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
        features, dim = kernel.num_features, kernel.embedding_dim
        batch = (offsets.numel() - 1) // features
        mean = kernel.pooling is Pooling.MEAN
        if kernel.native_lookup(weights):
            assert fused is not None
            out = kernel.weight.new_empty(batch, features * dim)
            fused.bag_sum(
                kernel.weight.numpy(),
                ids.contiguous().numpy(),
                offsets.contiguous().numpy(),
                out.numpy(),
                None if weights is None else weights.contiguous().numpy(),
                mean,
                features,
                batch,
                dim,
                kernel.weight.shape[0],
            )
            return out
        bags = F.embedding_bag(
            ids,
            kernel.weight,
            offsets,
            mode="mean" if mean else "sum",
            per_sample_weights=weights,
            include_last_offset=True,
        )
        # [F*B, D] feature-major -> [B, F*D] sample-major
        return bags.view(features, batch, dim).transpose(0, 1).reshape(batch, features * dim)

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, None, None, None, None, None, None]:
        ids, offsets, weights = ctx.saved_tensors
        kernel = ctx.kernel
        if ctx.step is None:
            kernel.apply_gradient(ids, offsets, weights, grad, ctx.iteration)
            return None, None, None, None, None, None, None
        dim = kernel.embedding_dim
        grad_bags = sample_major_to_bags(grad, kernel.num_features, dim)
        rows, grad_rows = row_gradients(ids, offsets, weights, grad_bags, kernel.pooling, dim)
        kernel._update_split(rows, grad_rows, ctx.step, ctx.iteration)
        # A gradient for the step's trigger, so its backward runs after this one.
        return grad.new_zeros(ctx.trigger_shape), None, None, None, None, None, None


class TorchKernel(EmbeddingKernel):
    """Pure-PyTorch fused kernel: runs wherever PyTorch runs (CPU, CUDA).

    ``storage(name, shape)``, if given, supplies the weight (``"weight"``) and each
    optimizer state in place of zero-filled tensors (e.g. memory-mapped files; its
    tensors must be float32, contiguous, of ``shape`` and on ``device``).
    """

    def __init__(
        self,
        tables: Sequence[TableSpec],
        feature_table_map: Sequence[int],
        pooling: Pooling,
        optimizer: EmbeddingOptimizerConfig,
        device: torch.device,
        storage: Storage | None = None,
    ) -> None:
        super().__init__(tables, feature_table_map, pooling, optimizer, device)
        dim = self.embedding_dim

        def allocate(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            if storage is None and self.device.type == "cpu":
                out = torch.empty(shape)
                advise_huge_pages(out.data_ptr(), out.nbytes)  # before its pages are touched
                return out.zero_()
            if storage is None:
                return torch.zeros(shape, device=self.device)
            out = storage(name, shape)
            if (
                tuple(out.shape) != shape
                or out.dtype != torch.float32
                or out.device != self.device
                or not out.is_contiguous()
            ):
                raise ValueError(
                    f"embedding storage for {name!r} must be a contiguous float32 tensor of "
                    f"shape {shape} on {self.device}, got {out.dtype} {tuple(out.shape)} on "
                    f"{out.device}"
                )
            return out

        self.weight = allocate("weight", (self.row_offsets[-1], dim))
        self.state = {
            name: allocate(name, (self.row_offsets[-1], *shape[1:]))
            for name, shape in optimizer.kind.state_shapes(1, dim).items()
            if shape  # not the step (``iteration``)
        }
        self._feature_tables = torch.tensor(self.feature_table_map, dtype=torch.int64)
        # Leaf that makes autograd call backward; not a parameter of any model.
        self._trigger = torch.zeros(0, device=self.device, requires_grad=True)
        self._every_row_grad: torch.Tensor | None = None  # dense_adam's, made on first use
        self._all_rows: torch.Tensor | None = None  # 0 .. R - 1, for the native dense update

    def split_weights(self) -> list[torch.Tensor]:
        return [self.weight[a:b] for a, b in zip(self.row_offsets, self.row_offsets[1:])]

    def split_optimizer_states(self) -> list[dict[str, torch.Tensor]]:
        return self._with_step(
            [
                {name: s[a:b] for name, s in self.state.items()}
                for a, b in zip(self.row_offsets, self.row_offsets[1:])
            ]
        )

    def table_views(self, index: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        a, b = self.row_offsets[index], self.row_offsets[index + 1]
        states = self._with_step([{name: s[a:b] for name, s in self.state.items()}])[0]
        return self.weight[a:b], states

    def set_learning_rate(self, lr: float) -> None:
        self.lr = lr

    def forward(
        self, values: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        ids = self._global_ids(values, offsets)
        step = self._sync.step() if self._sync is not None else None
        trigger = step.trigger if step is not None else self._trigger
        iteration = self._next_iteration()
        return cast(
            torch.Tensor,
            _FusedLookup.apply(  # type: ignore[no-untyped-call]  # torch leaves it untyped
                trigger, self, ids, offsets.long(), weights, step, iteration
            ),
        )

    def native_lookup(self, weights: torch.Tensor | None) -> bool:
        """Whether the lookup runs in the native extension (module doc): built, on the
        CPU, float32 rows and weights, no tracing."""
        return (
            fused is not None
            and self.weight.device.type == "cpu"
            and self.weight.dtype == torch.float32
            and self.weight.is_contiguous()
            and (weights is None or weights.dtype == torch.float32)
            and not torch.jit.is_tracing()
            and not torch.compiler.is_compiling()
        )

    def _native_rowwise(self, grad: torch.Tensor, weights: torch.Tensor | None) -> bool:
        """Whether ``apply_gradient`` takes the native row-wise Adagrad (module doc): where
        the lookup is native, for row-wise Adagrad without weight decay on float32."""
        momentum = self.state.get("momentum1")
        return (
            self.native_lookup(weights)
            and self.optimizer.kind is EmbeddingOptimizer.ROWWISE_ADAGRAD
            and not self.optimizer.weight_decay
            and momentum is not None
            and momentum.is_contiguous()
            and momentum.dtype == torch.float32
            and grad.device.type == "cpu"
            and grad.dtype == torch.float32
        )

    def _native_rowwise_update(
        self,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None,
        grad: torch.Tensor,
    ) -> None:
        """``sparse_update``'s row-wise Adagrad in two native calls (``_fused.c``:
        ``row_sums``, ``adagrad_rows``) around the per-row arithmetic of
        ``rowwise_update`` in PyTorch's operators on ``[U]`` vectors: the same bits."""
        assert fused is not None
        features, dim = self.num_features, self.embedding_dim
        momentum = self.state["momentum1"]
        rows = torch.empty(ids.numel(), dtype=torch.int64)
        sums = torch.empty(ids.numel(), dim)
        state = torch.empty(ids.numel())  # the rows' statistics, gathered as rows are found
        distinct = fused.row_sums(
            ids.contiguous().numpy(),
            offsets.contiguous().numpy(),
            grad.detach().contiguous().numpy(),
            None if weights is None else weights.detach().contiguous().numpy(),
            self.pooling is Pooling.MEAN,
            features,
            grad.shape[0],
            dim,
            self.weight.shape[0],
            rows.numpy(),
            sums.numpy(),
            self._feature_tables.numpy(),
            momentum.numpy(),
            state.numpy(),
        )
        rows, sums, state = rows[:distinct], sums[:distinct], state[:distinct]
        if native_row_statistics(dim):  # the same bits in one pass over the sums
            fused.row_statistics(sums.numpy(), state.numpy(), distinct, dim)
        else:
            state = state.add_(rowwise_statistic(sums))
        # lr / x is reciprocal(x) * lr in torch (Tensor.__rdiv__): the same two operators
        # in place
        factor = state.sqrt().add_(self.optimizer.eps).reciprocal_().mul_(self.lr)
        fused.adagrad_rows(
            self.weight.numpy(),
            momentum.numpy(),
            rows.numpy(),
            sums.numpy(),
            state.numpy(),
            factor.numpy(),
            distinct,
            dim,
        )

    def _native_dense_update(self, summed: torch.Tensor) -> None:
        """``dense_rowwise_update`` over every row in two native passes around the factor
        in PyTorch's operators: the statistic added in place (``row_statistics``), then
        each row's step (``adagrad_rows`` over rows 0 to R - 1, the statistic written back
        unchanged), the same bits (``lr / x`` is ``reciprocal(x) * lr`` in torch)."""
        assert fused is not None
        momentum, (rows, dim) = self.state["momentum1"], self.weight.shape
        if self._all_rows is None or self._all_rows.numel() != rows:
            self._all_rows = torch.arange(rows)
        fused.row_statistics(summed.numpy(), momentum.numpy(), rows, dim)
        factor = momentum.sqrt().add_(self.optimizer.eps).reciprocal_().mul_(self.lr)
        fused.adagrad_rows(
            self.weight.numpy(),
            momentum.numpy(),
            self._all_rows.numpy(),
            summed.numpy(),
            momentum.numpy(),
            factor.numpy(),
            rows,
            dim,
        )

    @torch.no_grad()
    def apply_gradient(
        self,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None,
        grad: torch.Tensor,
        iteration: int,
    ) -> None:
        """Update the rows of a lookup given its gradient ``grad [B, F*D]``."""
        features, dim = self.num_features, self.embedding_dim
        if not ids.is_cuda and dense_update_applies(
            self.optimizer, self.weight.shape[0], ids.numel()
        ):  # small tables: no dedup (optim/sparse.py); on CUDA index_add_ is not deterministic
            rows = self.weight.shape[0]
            summed = dense_gradient(ids, offsets, weights, grad, self.pooling, rows, features)
            if self._native_rowwise(grad, weights) and native_row_statistics(dim):
                self._native_dense_update(summed)
            else:
                dense_rowwise_update(self.optimizer, self.weight, self.state, summed, self.lr)
            return
        if self.optimizer.kind is EmbeddingOptimizer.DENSE_ADAM and not ids.is_cuda:
            # every row moves: no dedup (optim/sparse.py); the table-sized gradient kept
            # between steps (a fresh one would fault in its pages every step)
            if self._every_row_grad is None:
                self._every_row_grad = torch.empty_like(self.weight)
            summed = dense_gradient(
                ids, offsets, weights, grad, self.pooling, self.weight.shape[0], features,
                out=self._every_row_grad,
            )  # fmt: skip
            dense_adam_update(self.optimizer, self.weight, self.state, summed, self.lr, iteration)
            return
        if self._native_rowwise(grad, weights):
            self._native_rowwise_update(ids, offsets, weights, grad)
            return
        grad_bags = sample_major_to_bags(grad, features, dim)
        rows, grad_rows = row_gradients(ids, offsets, weights, grad_bags, self.pooling, dim)
        sparse_update(
            self.optimizer, self.weight, self.state, rows, grad_rows, self.lr, iteration=iteration
        )
