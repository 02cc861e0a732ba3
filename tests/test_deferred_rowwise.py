"""Deferred row-wise updates (row-wise Adagrad, with L2 weight decay, partial row-wise
Adam) in one process: a table's columns split over two kernels, whose statistic a
stand-in sync sums (as column shards' all-to-all does), updates like the whole table
in one kernel; a table beside it in a deferring kernel still updates at once. Both
backends (FBGEMM's CPU build has no Adam kernel)."""

import pytest
import torch

from towerrec.modules.kernels import (
    Backend,
    TableSpec,
    build_kernel,
    fbgemm_available,
    fbgemm_has_kernel,
)
from towerrec.modules.tables import Pooling
from towerrec.optim.sparse import EmbeddingOptimizerConfig

ROWS, DIM, OTHER_ROWS, BATCH = 20, 8, 9, 5
OPTS = {
    "rowwise_adagrad": EmbeddingOptimizerConfig(lr=0.2),
    "rowwise_adagrad_l2": EmbeddingOptimizerConfig(
        lr=0.2, weight_decay=0.1, weight_decay_mode="l2"
    ),
    "partial_rowwise_adam": EmbeddingOptimizerConfig(
        kind="partial_rowwise_adam", lr=0.2, weight_decay=0.1
    ),
}


class _SumSync:
    """The step of one lookup: the two halves' partials added, then each applied."""

    def __init__(self):
        self.leaf = torch.zeros(1, 0, requires_grad=True)
        self.deferred = []
        self.trigger = None

    def start(self):
        self.deferred = []
        self.trigger = _Finish.apply(self.leaf, self)

    def step(self):
        return self

    def defer(self, table, grad, apply):
        self.deferred.append((table, grad, apply))

    def finish(self):
        assert [t for t, _, _ in self.deferred] == ["a", "a"], self.deferred
        total = sum(g.square().sum(dim=1) for _, g, _ in self.deferred)
        for _, _, apply in self.deferred:
            apply(total / DIM)


class _Finish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, leaf, sync):
        ctx.sync = sync
        return leaf.new_zeros(1, 0)

    @staticmethod
    def backward(ctx, grad):
        ctx.sync.finish()
        return None, None


def _batch(step):
    gen = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 4, (2 * BATCH,), generator=gen)
    ids_a = torch.randint(0, ROWS, (int(lengths[:BATCH].sum()),), generator=gen)
    ids_b = torch.randint(0, OTHER_ROWS, (int(lengths[BATCH:].sum()),), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return torch.cat([ids_a, ids_b]), offsets


def _kernel(backend, opt, *widths_and_rows):
    tables = [TableSpec(rows, width) for rows, width in widths_and_rows]
    return build_kernel(
        backend, tables, list(range(len(tables))), Pooling.MEAN, opt, torch.device("cpu")
    )


@pytest.mark.parametrize("optimizer", list(OPTS))
@pytest.mark.parametrize("backend", ["torch", "fbgemm"])
def test_split_columns_with_summed_statistic_equal_one_kernel(backend, optimizer):
    if backend == "fbgemm" and not fbgemm_available():
        pytest.skip("fbgemm_gpu is not installed")
    opt = OPTS[optimizer]
    if backend == "fbgemm" and not fbgemm_has_kernel(opt.kind, "cpu", opt.weight_decay):
        pytest.skip(f"FBGEMM has no CPU kernel for {optimizer}")
    backend, half = Backend(backend), DIM // 2
    whole = _kernel(backend, opt, (ROWS, DIM))  # table a
    beside = _kernel(backend, opt, (OTHER_ROWS, half))  # table b, never deferred
    left = _kernel(backend, opt, (ROWS, half), (OTHER_ROWS, half))  # a's left half, b
    right = _kernel(backend, opt, (ROWS, half))  # a's right half
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        whole.split_weights()[0].copy_(torch.randn(ROWS, DIM, generator=gen))
        beside.split_weights()[0].copy_(torch.randn(OTHER_ROWS, half, generator=gen))
        left.split_weights()[0].copy_(whole.split_weights()[0][:, :half])
        left.split_weights()[1].copy_(beside.split_weights()[0])
        right.split_weights()[0].copy_(whole.split_weights()[0][:, half:])
    sync = _SumSync()
    left.defer_rowwise({0: "a"}, sync)
    right.defer_rowwise({0: "a"}, sync)
    for step in range(4):
        ids, offsets = _batch(step)
        split = int(offsets[BATCH])
        ids_a, offsets_a = ids[:split], offsets[: BATCH + 1]
        ids_b, offsets_b = ids[split:], offsets[BATCH:] - split
        grad_a, grad_b = torch.randn(
            2, BATCH, DIM, generator=torch.Generator().manual_seed(100 + step)
        )
        grad_b = grad_b[:, :half]
        whole(ids_a, offsets_a).backward(grad_a)
        beside(ids_b, offsets_b).backward(grad_b)
        sync.start()
        pooled_left = left(ids, offsets)  # [B, a's left half | b]
        pooled_right = right(ids_a, offsets_a)
        torch.autograd.backward(
            [pooled_left, pooled_right],
            [torch.cat([grad_a[:, :half], grad_b], dim=1), grad_a[:, half:]],
        )
    got = torch.cat([left.split_weights()[0], right.split_weights()[0]], dim=1)
    torch.testing.assert_close(got, whole.split_weights()[0], rtol=0, atol=1e-6)
    rowwise = "momentum2" if opt.kind.value == "partial_rowwise_adam" else "momentum1"
    expected = whole.split_optimizer_states()[0][rowwise]
    for kernel in (left, right):
        state = kernel.split_optimizer_states()[0][rowwise]
        torch.testing.assert_close(state, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(left.split_weights()[1], beside.split_weights()[0])
    for name, state in beside.split_optimizer_states()[0].items():
        torch.testing.assert_close(left.split_optimizer_states()[1][name], state)
